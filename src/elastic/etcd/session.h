// This worker's presence in etcd: a lease kept alive with a key under it, and a copy of every key
// under the job's prefix kept current by a watch. One background thread does all the talking
// (the watch's response is read by a thread of the watch's own, which wakes it), so that readers
// of the copy never wait for etcd. See Note [etcd going away] in session.cpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "client.h"
#include "rendezvous.h"

namespace shoal::elastic::etcd {

class Session {
 public:
  using Keys = std::map<std::string, std::string>;

  // Grants a lease, creates `key` = `value` under it and reads the prefix, trying again until
  // options.connect_timeout; then CommError naming the endpoint and the last failure.
  Session(const EtcdOptions& options, std::string key, const std::string& value);
  // Stops the thread; the key stays until its lease expires.
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const Client& client() const { return client_; }
  const std::string& key() const { return key_; }

  // Sets this worker's key to `value`. Sent by the thread at once, and again while etcd is
  // away; a newer value replaces one not yet sent.
  void publish(std::string value);
  // Revokes the lease, which deletes the key at once, and stops the thread. Best effort: etcd may
  // not answer (then the lease expires).
  void leave();

  // The keys under the prefix as last seen. While etcd does not answer they stay as they were:
  // an unreachable etcd says nothing about the workers.
  std::shared_ptr<const Keys> keys() const;
  // Raised at every change of keys(), expired() or reachable().
  uint64_t version() const;
  // Returns once version() != seen, or after `timeout`.
  void wait_change(uint64_t seen, Duration timeout) const;
  // This worker's key is gone for good: its lease expired (the worker was silent longer than the
  // TTL) or another worker deleted it (check() found its store closed). Final for this session.
  bool expired() const { return expired_; }
  // The thread's last request got an answer; otherwise `error` says what failed.
  bool reachable(std::string* error = nullptr) const;

 private:
  void run();
  void sync();  // reads the whole prefix; the watch goes on from there
  void apply(const std::vector<Watch::Event>& events);
  void changed(const std::function<void()>& change);
  void set_reachable(bool reachable, const std::string& error = "");
  void send_published();
  void wake();  // the thread, from publish(), the watch's thread or the destructor

  Client client_;
  std::string prefix_;
  std::string key_;
  int64_t lease_ = 0;
  Duration ttl_{0};  // as granted
  int64_t create_revision_ = 0;

  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  std::shared_ptr<const Keys> keys_;
  uint64_t version_ = 1;
  std::string unsent_;  // publish()'s value not yet in etcd
  bool has_unsent_ = false;
  bool reachable_ = true;
  std::string error_;
  std::atomic<bool> expired_{false};
  std::condition_variable wake_;  // the thread waits on it for woken_
  bool woken_ = false;

  std::unique_ptr<Watch> watch_;  // the thread's; its own thread calls wake()
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace shoal::elastic::etcd
