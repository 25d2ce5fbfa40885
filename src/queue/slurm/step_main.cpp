// `shoal-slurm-step PREFIX PROGRAM [ARGS...]`: what the Slurm engine's batch scripts execute
// (step.h). A program of its own, without LibTorch, so that it starts in milliseconds where the
// `shoal` command takes seconds to load its libraries.
#include <iostream>
#include <string>
#include <vector>

#include "step.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: shoal-slurm-step PREFIX PROGRAM [ARGS...]; the Slurm engine of "
                 "`shoal agent` runs it (docs/queue.md, section Slurm)"
              << std::endl;
    return 2;
  }
  return shoal::queue::slurm::run_step(argv[1], std::vector<std::string>(argv + 2, argv + argc));
}
