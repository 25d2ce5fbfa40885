// The environment contract between `shoal run` and its workers (shoal::init() reads it; programs
// written for torchrun read the torchrun half). docs/launch.md lists it for users.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shoal/core/env.h"
#include "shoal/core/timeout.h"

namespace shoal::proc {

// Where one worker stands in the job. With N workers per node and K nodes, worker i of node k
// has rank k*N + i in a world of K*N.
struct WorkerPlace {
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr;
  int master_port = 0;
  std::string run_id;

  int rank() const { return node_rank * local_world_size + local_rank; }
  int world_size() const { return nnodes * local_world_size; }
};

// `base` (the launcher's own environment) with the job's variables set for this worker: the
// SHOAL_* set, and torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, ..., TORCHELASTIC_*). Variables of
// the same names in `base` are replaced. OMP_NUM_THREADS is left as the user set it: init()
// chooses thread counts itself and takes a set OMP_NUM_THREADS as the user's choice.
env::Environment worker_environment(const env::Environment& base, const WorkerPlace& place);

// What a worker of an elastic job is told: no rank (rounds decide it), but how to find the job.
struct ElasticPlace {
  int local_world_size = 1;  // workers this launcher starts (for thread counts)
  int min_workers = 1;
  int max_workers = 1;
  bool quorum = false;
  std::string seeds;       // gossip: "HOST:PORT" of this launcher's membership agent
  std::string etcd;        // etcd: "HOST:PORT" of its client URL
  std::string token_file;  // empty when the token comes from SHOAL_JOB_TOKEN
  Duration last_call{0};
  Duration rendezvous_timeout{0};
  std::string run_id;
};

// `base` with SHOAL_ELASTIC=1 and the job's settings; any static job's variables in `base`
// (SHOAL_RANK, RANK, WORLD_SIZE, ...) are removed. See docs/elastic.md.
env::Environment elastic_worker_environment(const env::Environment& base, const ElasticPlace& place);

// Note [An elastic job's settings in its agents' metadata]
// Each launcher of an elastic gossip job (`shoal run --min/--max`, or a queue agent that starts the
// job's workers on its host) is a member of the job's membership, beside the workers. Its metadata
// says "agent" (so that the rendezvous counts no launcher as a worker) and carries the job's
// settings, so that a launcher joining with --join takes them from any agent already in the job.
// Both kinds of launcher write and read it through these two functions.
std::string agent_metadata(const ElasticPlace& place);

// The job's settings (min, max, quorum, last call, run id) from a member's metadata; nullopt when
// the metadata is not an agent's.
std::optional<ElasticPlace> parse_agent_metadata(const std::string& metadata);

// How long a failed worker's replacement waits, given how many times this job's workers (one
// worker's, for `shoal run`; the job's, for the queue) failed before: 1 s, then twice as long
// after each further failure, up to 30 s. `shoal run --max-restarts` and the queue's
// `max_restarts` bound the count.
inline Duration restart_backoff(int earlier_failures) {
  return std::min(Duration(30000), Duration(1000) * (int64_t{1} << std::min(std::max(earlier_failures, 0), 5)));
}

// "NAME=value" strings, as execve takes them.
std::vector<std::string> to_envp(const env::Environment& env);

}  // namespace shoal::proc
