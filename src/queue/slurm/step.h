// What a Slurm job of the queue runs: `shoal-slurm-step PREFIX PROGRAM [ARGS...]` (step_main.cpp),
// exec'd by the batch script, so that it is the batch step's own process (the one `scancel --batch`
// signals). It starts the program as its child, passes on the signals it gets (SIGTERM: leave),
// and writes two files the agent reads, the node and the agent sharing a filesystem:
//   PREFIX.pid   the program's process id, once it runs;
//   PREFIX.exit  {"exit": "exited with code 0", "success": true, "signals": ["SIGTERM"]}, once it
//                ended; "signals" are those it passed on (from the agent's scancel --batch, or
//                from Slurm itself: a time limit, a preemption, a scancel of the job).
// Slurm's accounting may be off, and then Slurm forgets a job's exit code MinJobAge seconds after
// it ends; the files keep it. Each is written to a temporary name and renamed.
#pragma once

#include <string>
#include <vector>

namespace shoal::queue::slurm {

// Returns the program's exit code (128 + the signal when killed), for Slurm's own record.
int run_step(const std::string& prefix, const std::vector<std::string>& argv);

}  // namespace shoal::queue::slurm
