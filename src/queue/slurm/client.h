// Slurm's client commands (sbatch, scancel, squeue, scontrol), run with a deadline: a slurmctld
// that does not answer must not stall the agent's loop (DESIGN.md 3.6).
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace shoal::queue::slurm {

struct ClientResult {
  int exit_code = 0;
  std::string out;
  std::string err;

  // The last non-empty line of stderr (of stdout when stderr is empty) without
  // "sbatch: error: ": Slurm's own reason.
  std::string error_line() const;
};

// Runs `argv` (argv[0] an absolute path) with `env` ("NAME=value", the whole environment) and
// waits for it. Raises CommError "TOOL ... did not answer within N s" past `timeout`, after
// SIGKILLing it; UsageError when it cannot be executed.
ClientResult run_client(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                        std::chrono::milliseconds timeout);

}  // namespace shoal::queue::slurm
