// etcd's v3 API as its JSON gateway serves it (POST /v3/kv/..., /v3/lease/..., /v3/watch): the
// few calls the rendezvous needs, with keys and values as plain strings (the gateway's base64
// and its int64-as-string numbers stay in here).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "http.h"

namespace shoal::elastic::etcd {

struct KeyValue {
  std::string key;
  std::string value;
};

// Every call is one request that either completes within the client's timeout or throws
// CommError naming the endpoint and the call.
class Client {
 public:
  Client(Endpoint endpoint, Duration request_timeout) : endpoint_(std::move(endpoint)), timeout_(request_timeout) {}

  const Endpoint& endpoint() const { return endpoint_; }

  // A new lease; etcd may raise the TTL to its minimum. Returns {id, granted TTL}.
  std::pair<int64_t, Duration> grant(Duration ttl) const;
  // Renews `lease`; returns its TTL, or 0 when the lease no longer exists (it expired or was revoked).
  Duration keep_alive(int64_t lease) const;
  // Revokes `lease` and deletes its keys; a lease that is already gone is fine.
  void revoke(int64_t lease) const;

  struct Range {
    std::vector<KeyValue> kvs;
    int64_t revision = 0;  // the store's revision that `kvs` shows
  };
  // Every key that starts with `prefix`.
  Range range_prefix(const std::string& prefix) const;
  // Deletes `key`.
  void erase(const std::string& key) const;
  // Deletes the keys in [from, to).
  void erase_range(const std::string& from, const std::string& to) const;

  // Sets `key` = `value` (under `lease`, 0 for none), whether it exists or not.
  void put(const std::string& key, const std::string& value, int64_t lease) const;
  // Creates `key` = `value` (under `lease`, 0 for none) unless it exists. Returns the revision
  // of the creation (the key's create_revision), or nullopt when the key existed.
  std::optional<int64_t> create(const std::string& key, const std::string& value, int64_t lease) const;
  // Sets `key` = `value` (under `lease`) only if `key` is still the one created at
  // `create_revision`: false when it was deleted since (a deleted key is never brought back).
  bool update(const std::string& key, const std::string& value, int64_t lease, int64_t create_revision) const;

 private:
  friend class Watch;
  // The response's JSON; CommError on a non-200 status or a body that is not JSON.
  nlohmann::json call(const std::string& path, const std::string& body) const;

  Endpoint endpoint_;
  Duration timeout_;
};

// The keys that start with a prefix, from a revision on, as etcd streams their changes.
class Watch {
 public:
  struct Event {
    bool deleted = false;
    KeyValue kv;  // for a deletion, only the key
  };

  // Starts watching from `start_revision`. CommError when etcd does not answer. `arrived` is
  // called, from the watch's own thread, whenever events() may have something new.
  Watch(const Client& client, const std::string& prefix, int64_t start_revision, std::function<void()> arrived);

  // The events that have arrived, in order, without blocking. CommError once the stream ended
  // (etcd went away) or etcd canceled the watch (its start revision was compacted): read the
  // keys again and start a new watch.
  std::vector<Event> events();

 private:
  Endpoint endpoint_;
  HttpStream stream_;
  std::string buffer_;
};

// The end of the range of keys that start with `prefix` (the prefix with its last byte raised).
std::string end_of(const std::string& prefix);

}  // namespace shoal::elastic::etcd
