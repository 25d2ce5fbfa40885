// Finding out what job this process belongs to, from whatever started it.
#pragma once

#include <string>

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
  // True when a launcher process hosts the store (shoal run, torchrun's agent); otherwise
  // rank 0 hosts it, as torch.distributed's env:// does.
  bool store_hosted_by_launcher = false;
  // An elastic job (SHOAL_ELASTIC=1, as `shoal run --min/--max` sets it): the workers find each
  // other through the job's membership, and rank and world size are those of the current
  // rendezvous round (see docs/elastic.md); discover_job leaves them 0 and 1.
  bool elastic = false;
};

// Reads the job from `env`, trying in order: shoal run's SHOAL_* variables; torchrun's RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; Open MPI's
// OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; Slurm's SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID and the first host of SLURM_JOB_NODELIST. With none of them: a job of one.
// `master` ("HOST:PORT", may be empty) overrides the address for Open MPI and Slurm jobs, whose
// launchers don't provide one; SHOAL_MASTER=HOST:PORT does the same.
// Incomplete or contradictory variables raise UsageError naming the variable and what was expected.
JobSpec discover_job(const env::Environment& env, const std::string& master = "");

// The first host of a Slurm node list: "node[07-09,12],gpu1" -> "node07".
std::string first_slurm_host(const std::string& nodelist);

// Splits "HOST:PORT" (or "[V6ADDR]:PORT"); `what` names the setting in the error.
std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& what);

}  // namespace shoal
