// What job this process belongs to (shoal::job(), shoal/runtime/init.h), as found from whatever
// started it. Finding it out is shoal's own business (src/runtime/job_discovery.h).
#pragma once

#include <string>
#include <vector>


namespace shoal {

// Where this process stands in its job. A pure function of the environment.
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

}  // namespace shoal
