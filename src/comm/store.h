// The job's rendezvous key-value store (c10d's TCPStore) and the keys that launchers and workers
// share through it. Internal to shoal (the API names only StorePtr, shoal/comm/store.h).
#pragma once

#include <optional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "shoal/comm/address.h"
#include "shoal/comm/store.h"
#include "shoal/core/timeout.h"

namespace shoal::comm {

struct StoreOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // a server on port 0 takes a free port; see hosted_port()
  bool is_server = false;
  // How long a client keeps retrying to connect, and the default for waits on keys.
  Duration timeout = std::chrono::seconds(60);
  // Names the setting the address came from ("MASTER_ADDR:MASTER_PORT", "--master"), so that
  // an unreachable store is reported in the user's terms.
  std::string described_as = "the store address";
  // The job's identity (JobSpec::job_id; "" for a job that has none). When set, a server writes
  // it under kJobIdKey as soon as it listens, and a client compares it before anything else:
  // another job's store on this port is a UsageError naming both jobs. See docs/runtime.md.
  std::optional<std::string> job_id;
  // Appended to the error when `host` does not resolve: what the user should set instead.
  std::string if_unresolved;
};

// Where the store's host writes the job's id.
inline const std::string kJobIdKey = "shoal/job_id";

// Hosts (is_server) or connects to a store. A host name that does not resolve, a server whose port
// is taken, a client that cannot connect within the timeout, or a store of another job raise
// UsageError naming options.described_as and host:port, in one line: c10d's own log lines about
// failed binds and connections are held back while the store opens.
StorePtr open_store(const StoreOptions& options);

// The port a store opened by open_store listens on (useful after asking for port 0).
int hosted_port(const StorePtr& store);


// Keys. A launcher records how each of its workers ended under worker_exit_key(rank), as a
// sentence ("exited with code 3", "was killed by signal 9 (SIGKILL)"); a group whose collective
// fails reads these to name the lost peer.
std::string worker_exit_key(int rank);

// Sets key to a text value.
void put(const StorePtr& store, const std::string& key, const std::string& value);

// Reads key if it is present, without waiting; "" when it is not.
std::string try_get(const StorePtr& store, const std::string& key);

}  // namespace shoal::comm
