// A worker for fault tests under `shoal run`: all-reduces in a loop, records its pid, and the
// worker named on the command line SIGKILLs itself in the middle of an all-reduce.
//   fault_worker VICTIM_RANK PID_DIR
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <iostream>

#include <torch/torch.h>

#include "shoal/shoal.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: fault_worker VICTIM_RANK PID_DIR\n";
    return 2;
  }
  shoal::init();
  const int victim = std::atoi(argv[1]);
  std::ofstream(std::string(argv[2]) + "/" + std::to_string(getpid())) << shoal::rank() << "\n";
  auto& world = shoal::world();
  world.set_timeout(std::chrono::seconds(5));
  try {
    for (int step = 0; step < 1000; ++step) {
      auto t = torch::ones({1 << 20});
      auto work = world.all_reduce_async(t);
      if (shoal::rank() == victim && step == 3) raise(SIGKILL);
      work.wait();
    }
  } catch (const shoal::CommError& e) {
    std::cout << "CommError: " << e.what() << std::endl;
    return 3;
  }
  return 0;
}
