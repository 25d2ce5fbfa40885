// The job this process belongs to: init()'s options (shoal/init.h joins), the worker's place in
// the job and the world group.
#pragma once

#include <string>

#include "shoal/comm/group.h"
#include "shoal/core/timeout.h"
#include "shoal/runtime/job.h"

namespace shoal {

struct InitOptions {
  // "HOST:PORT" of the job's master, for launchers that don't say (Open MPI, Slurm); see
  // discover_job for the variables that can say it instead.
  std::string master;
  // How long to keep trying to reach the master and to wait for every worker to connect.
  Duration connect_timeout = std::chrono::seconds(60);
  // Default deadline of collectives; kUnsetTimeout: SHOAL_TIMEOUT (seconds) or 10 minutes.
  Duration timeout = kUnsetTimeout;
  // Intra-op threads of this process; 0: OMP_NUM_THREADS or SHOAL_NUM_THREADS if set, else
  // (cores on this host / workers on this host), at least 1.
  int intra_op_threads = 0;
};

bool is_initialized();

// The number of workers in the job.
int world_size();
// True on exactly one worker of the job: print and save there.
bool is_main();
// This worker's index in the job, 0 <= rank() < world_size(). Most programs never need it.
int rank();
// This worker's index among the job's workers on its host.
int local_rank();

// The job as init() found it.
const JobSpec& job();
// The group of all the job's workers.
comm::Group& world();

// Leaves the job: releases the world group and the store connection. Optional; a process
// that exits without it is fine. Later calls to shoal functions raise UsageError until init().
void shutdown();

}  // namespace shoal
