// Finding out what job this process belongs to, from whatever started it: the variables of shoal
// run, torchrun, Open MPI and Slurm. Internal to shoal: runtime's init and elastic's world read the
// job with it, the launcher checks its flags with it; a program reads the result, shoal::job().
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "shoal/core/env.h"
#include "shoal/runtime/job.h"

namespace shoal {

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
