// Finding out what job this process belongs to, from whatever started it.
#pragma once

#include <string>
#include <vector>

#include "shoal/core/env.h"

namespace shoal {

// Where this process stands in its job. A pure function of the environment; see discover_job.
struct JobSpec {
  // Who started the job: "single" (no launcher: a job of one), "shoal" (`shoal run`),
  // "torchrun" (RANK/WORLD_SIZE/...), "openmpi" (OMPI_COMM_WORLD_*), "slurm" (SLURM_*).
  std::string launcher = "single";
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // The rendezvous store. Empty host for a job of one.
  std::string master_addr;
  int master_port = 0;
  // The setting the address came from, for error messages ("MASTER_ADDR:MASTER_PORT").
  std::string master_described_as;
  // When the launcher names several addresses of the store's host (mpirun on a host with several
  // networks), all of them in the launcher's order, master_addr being the first; shoal::init()
  // then settles on the one that the workers on other hosts reach (Note [mpirun's host] in
  // docs/runtime.md). Empty otherwise.
  std::vector<std::string> master_candidates;
  // True on a worker that runs on the store's host as its launcher says (Open MPI: its local
  // daemon is mpirun); such a worker reaches the store at any of master_candidates.
  bool on_master_host = false;
  // True when a launcher process hosts the store (shoal run, torchrun's agent); otherwise
  // a worker hosts it (see hosts_store), as torch.distributed's env:// does.
  bool store_hosted_by_launcher = false;
  // True on the one worker that hosts the store: rank 0, or under a multi-node mpirun the first
  // worker on mpirun's own host (the address the others know).
  bool hosts_store = false;
  // The job's identity as its launcher names it: "Slurm job 42 step 0", "shoal run 3fa0...",
  // "Open MPI job 1206517761", "torchrun run 9c1e...". Empty when the launcher gives none. The
  // store's host writes it under comm::kJobIdKey and every other worker compares it before
  // anything else, so that a worker never joins another job's store (see docs/runtime.md).
  std::string job_id;
  // False when the store belongs to a launcher that is not shoal's (torchrun's agent), which
  // writes no job id to compare.
  bool store_names_job = true;
  // An elastic job (SHOAL_ELASTIC=1, as `shoal run --min/--max` sets it): the workers find each
  // other through the job's membership, and rank and world size are those of the current
  // rendezvous round (see docs/elastic.md); discover_job leaves them 0 and 1.
  bool elastic = false;
};

// Reads the job from `env`, trying in order: shoal run's SHOAL_* variables; torchrun's RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; Open MPI's
// OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE and mpirun's own address; Slurm's
// SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID, SLURM_LOCALID, this node's entry of
// SLURM_STEP_TASKS_PER_NODE and the first host of SLURM_STEP_NODELIST. With none: a job of one.
// `master` ("HOST:PORT", may be empty) overrides the address for Open MPI and Slurm jobs, whose
// launchers don't provide one; SHOAL_MASTER=HOST:PORT does the same.
// Incomplete or contradictory variables raise UsageError naming the variable and what was expected.
JobSpec discover_job(const env::Environment& env, const std::string& master = "");

// The part of the job every worker reads alike: launcher, job id, world size and the store's
// address (rank and local fields are left as in a job of one), and whether this worker hosts the
// store or runs on its host as far as its rank variables tell. discover_job is this plus the worker's own place; a
// worker whose own variables are wrong uses this to tell the others (see shoal::init).
JobSpec discover_job_store(const env::Environment& env, const std::string& master = "");

// The store port of a job whose launcher names none, in [29500, 32500) (below Linux's ephemeral
// range, which starts at 32768), so that two jobs on one host do not collide: for "Slurm job J
// step S", 29500 + (8J + S) mod 3000, so jobs close in number differ; for other ids,
// 29500 + (FNV-1a hash of the id) mod 3000. 29500, torch.distributed's default, when empty.
int default_master_port(const std::string& job_id);

// The first host of a Slurm node list: "node[07-09,12],gpu1" -> "node07".
std::string first_slurm_host(const std::string& nodelist);

// Slurm's compressed task counts, one per node: "2(x3),1" -> {2, 2, 2, 1}. `what` names the
// variable in the UsageError raised for a malformed list.
std::vector<int> expand_slurm_tasks_per_node(const std::string& text, const std::string& what);

// Splits "HOST:PORT" (or "[V6ADDR]:PORT"); `what` names the setting in the error.
std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& what);

}  // namespace shoal
