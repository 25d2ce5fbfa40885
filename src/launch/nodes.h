// How the launchers of a job's nodes (one `shoal run` per node) start, watch and finish together,
// through the store that node 0's launcher hosts. With one node most of this is a no-op; the
// store is still hosted, since workers rendezvous through it and read exit sentences from it.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "job_store.h"
#include "options.h"
#include "output.h"
#include "signals.h"

namespace shoal::launch {

// Node 0 hosts the store; other nodes wait (up to --connect-timeout, waking for signals) until
// it listens, then connect. Raises UsageError (port taken, host unknown, never reachable) or
// Interrupted.
// Node 0's store names the job `run_id` (see JobStore::host); the others adopt node 0's.
std::unique_ptr<JobStore> open_job_store(const LaunchOptions& options, SignalSet& signals,
                                         const std::string& run_id);

// A random id for the job: 16 hex digits.
std::string make_run_id();

class NodeGroup {
 public:
  // How often a running launcher looks for another node's failure and signs its own life.
  static constexpr std::chrono::milliseconds kCheckInterval{500};
  // How long node 0 keeps hosting the store for a node whose launcher shows no sign of life.
  static constexpr std::chrono::seconds kSilenceLimit{10};

  // Notices (a node given up on) go to `messages` as whole lines.
  NodeGroup(JobStore& store, const LaunchOptions& options, SignalSet& signals, Sink& messages);

  // Node 0 publishes `run_id`; the others adopt node 0's. Every node checks that all use the same
  // -n and distinct --node-rank, then waits (up to --connect-timeout) until all K nodes have
  // joined, so no worker starts in a job that cannot form. Returns the job's run id.
  // Raises UsageError (a mismatch), CommError (a timeout, another node's failure) or Interrupted.
  std::string join(const std::string& run_id);

  // While workers run, every kCheckInterval: signs this node's life and returns another node's
  // failure sentence ("" if none). Raises CommError when the store is lost.
  std::string check();

  // Store writes that must not stop the launcher if the store is gone: they are best effort.
  void record_exit(int rank, const std::string& how);
  void report_failure(const std::string& reason);

  // This node is finished. Node 0 then keeps hosting the store until every other node's launcher
  // is finished too, or silent for kSilenceLimit, or a stopping signal comes. Returns the job's
  // failure sentence, if any node reported one ("" if none, or the store is lost).
  std::string finish();

  bool store_lost() const { return lost_; }

 private:
  // Polls ready() until --connect-timeout; what() names what was waited for in the error.
  template <typename Ready, typename What>
  void wait_until(Ready ready, What what);
  std::string missing_nodes();

  JobStore& store_;
  const LaunchOptions& options_;
  SignalSet& signals_;
  Sink& messages_;
  bool lost_ = false;
  bool excluded_ = false;  // another launcher had claimed this node rank
};

}  // namespace shoal::launch
