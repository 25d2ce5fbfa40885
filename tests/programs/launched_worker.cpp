// A worker for the tests of real launchers (slurm_test.cpp, mpi_test.cpp), started by srun,
// sbatch or mpirun. It joins the job, all-reduces rank + 1 and prints one line the tests parse:
//   result rank=R world=W local=L/LW job=JOB_ID master=HOST:PORT sum=S
//   launched_worker [--meet DIR N] [--hold-until PATH]
// --meet: after the all-reduce, every worker marks itself in DIR and waits until N workers (of
// any job) have, then all-reduces again: the jobs that meet there were all alive at once.
// --hold-until: after its line, waits until PATH exists (keeping the job's store up).
// A shoal::Error from init() is printed as "launched_worker: WHAT" on stderr, exit code 1.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "shoal/shoal.h"

namespace {

// Polls until `ready` holds, for at most 60 s.
template <typename Ready>
bool wait_for(Ready ready) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string meet_dir, hold_until;
  int meet_count = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--meet") == 0 && i + 2 < argc) {
      meet_dir = argv[++i];
      meet_count = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--hold-until") == 0 && i + 1 < argc) {
      hold_until = argv[++i];
    } else {
      std::fprintf(stderr, "usage: launched_worker [--meet DIR N] [--hold-until PATH]\n");
      return 2;
    }
  }
  try {
    shoal::init();
  } catch (const shoal::Error& e) {
    std::fprintf(stderr, "launched_worker: %s\n", e.what());
    return 1;
  }
  auto& world = shoal::world();
  world.set_timeout(std::chrono::seconds(60));
  const int rank = shoal::rank();
  auto sum = torch::full({1}, static_cast<float>(rank + 1));
  world.all_reduce(sum);

  if (!meet_dir.empty()) {
    std::ofstream(meet_dir + "/" + std::to_string(getpid())) << rank;
    const bool met = wait_for([&] {
      int n = 0;
      for (const auto& entry : std::filesystem::directory_iterator(meet_dir))
        n += entry.is_regular_file();
      return n >= meet_count;
    });
    if (!met) {
      std::fprintf(stderr, "launched_worker: the %d workers did not meet in %s\n", meet_count,
                   meet_dir.c_str());
      return 1;
    }
    auto again = torch::full({1}, static_cast<float>(rank + 1));
    world.all_reduce(again);
    if (!again.equal(sum)) return 1;
  }

  const auto& job = shoal::job();
  std::printf("result rank=%d world=%d local=%d/%d job=%s master=%s:%d sum=%g\n", rank,
              shoal::world_size(), shoal::local_rank(), job.local_world_size, job.job_id.c_str(),
              job.master_addr.c_str(), job.master_port, sum.item<float>());
  std::fflush(stdout);
  if (!hold_until.empty() && !wait_for([&] { return std::filesystem::exists(hold_until); }))
    return 1;
  world.barrier();
  return 0;
}
