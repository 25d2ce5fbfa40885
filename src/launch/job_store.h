// The launchers' view of the job's store (a c10d TCPStore): the keys through which the launchers
// of a job's nodes agree on it, record how workers ended and stop together.
//
// This is the only launcher file that includes c10d (through src/comm/store.h): LibTorch's
// headers cost ~10 s per translation unit. Every method may raise CommError naming the store's
// address when the store cannot be reached; none of them blocks waiting for a key.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shoal/core/timeout.h"

namespace shoal::launch {

class JobStore {
 public:
  // Node 0: hosts the store on every interface at `port` (0: any free port), naming the job
  // `run_id` under comm::kJobIdKey for the workers to check. Raises UsageError (port taken) with
  // a one-line message naming `described_as`.
  static std::unique_ptr<JobStore> host(int port, Duration timeout, const std::string& described_as,
                                        const std::string& run_id);
  // Other nodes: connects to node 0's store at host:port, retrying until `timeout`.
  static std::unique_ptr<JobStore> connect(const std::string& host, int port, Duration timeout,
                                           const std::string& described_as);
  ~JobStore();

  int port() const;
  // "--master=10.0.0.1:29500", for messages.
  const std::string& where() const;

  // Joining. Node 0 publishes the job's run id and workers per node; every node claims its
  // rank (true if no other launcher had claimed it) and then counts itself in.
  void publish_job(const std::string& run_id, int nproc_per_node);
  bool job_published();
  std::string run_id();
  int nproc_per_node();
  bool claim_node(int node_rank);
  bool node_claimed(int node_rank);
  void count_joined();
  int64_t joined();

  // The sentence under comm::worker_exit_key(rank), which workers quote to name a lost peer.
  void record_exit(int rank, const std::string& how);

  // The job's first failure, as a sentence; later reports do not replace it. "" when none.
  void report_failure(const std::string& reason);
  std::string failure();

  // Any other key of the job (the parameter servers' keys, ps_launch.cpp): "" when not set.
  void put(const std::string& key, const std::string& value);
  std::string get(const std::string& key);
  int64_t add(const std::string& key, int64_t amount);

  // Signs of life and of completion, per node; node 0 hosts the store until the others are done.
  void heartbeat(int node_rank);
  int64_t heartbeats(int node_rank);
  void mark_done(int node_rank);
  bool is_done(int node_rank);

 private:
  struct State;
  explicit JobStore(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace shoal::launch
