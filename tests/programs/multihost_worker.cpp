// A worker for the two-host tests (multihost_test.cpp), started by one `shoal run` per network
// namespace. It all-reduces known values and prints one line the test parses:
//   result rank=R world=W node=K master=HOST:PORT local=ADDR netns=net:[INODE] sum=S vector=OK|BAD
// `local` is this worker's address on the route to the master and `netns` its network namespace,
// so the test can tell that the two nodes really were apart and met over the veth link.
//   multihost_worker [--exit-rank R | --kill-rank R]
// With --exit-rank, worker R exits with code 3 once every worker has printed its line; with
// --kill-rank, it SIGKILLs itself then, printing "failing at MS" (wall-clock milliseconds) first.
// The others keep all-reducing until the group fails.
#include <signal.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <torch/torch.h>

#include "shoal/shoal.h"

namespace {

std::string network_namespace() {
  char target[PATH_MAX] = {};
  const ssize_t length = readlink("/proc/self/ns/net", target, sizeof(target) - 1);
  return length > 0 ? std::string(target, length) : "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  int failing_rank = -1;
  bool kill = false;
  if (argc == 3 && (std::strcmp(argv[1], "--exit-rank") == 0 || std::strcmp(argv[1], "--kill-rank") == 0)) {
    failing_rank = std::atoi(argv[2]);
    kill = std::strcmp(argv[1], "--kill-rank") == 0;
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: multihost_worker [--exit-rank R | --kill-rank R]\n");
    return 2;
  }
  shoal::init();
  auto& world = shoal::world();
  // Short, so that a lost peer that Gloo does not report at once still ends the test in time.
  world.set_timeout(std::chrono::seconds(10));
  const int rank = shoal::rank();
  const int n = shoal::world_size();

  // Rank r contributes r + 1 everywhere: the sum is n(n+1)/2. The vector adds a per-element
  // term, so that a reduction that mixed up elements or ranks could not pass by accident.
  auto scalar = torch::full({1}, static_cast<float>(rank + 1));
  world.all_reduce(scalar);
  auto vector = torch::arange(1000, torch::kFloat32) * (rank + 1);
  world.all_reduce(vector);
  const auto expected = torch::arange(1000, torch::kFloat32) * (n * (n + 1) / 2);
  const bool vector_ok = vector.equal(expected);

  const auto& job = shoal::job();
  std::printf("result rank=%d world=%d node=%s master=%s:%d local=%s netns=%s sum=%g vector=%s\n",
              rank, n, std::getenv("SHOAL_NODE_RANK") ? std::getenv("SHOAL_NODE_RANK") : "?",
              job.master_addr.c_str(), job.master_port,
              shoal::comm::local_address_towards(job.master_addr, job.master_port).c_str(),
              network_namespace().c_str(), scalar.item<float>(), vector_ok ? "OK" : "BAD");
  std::fflush(stdout);

  // Past this barrier every worker has printed its line, so the failure below cannot cut one short.
  world.barrier();
  if (failing_rank >= 0) {
    if (rank == failing_rank) {
      // The moment of the failure, for the test to time the launchers' exits from.
      std::printf("failing at %lld ms\n",
                  static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                             std::chrono::system_clock::now().time_since_epoch())
                                             .count()));
      std::fflush(stdout);
      if (kill) raise(SIGKILL);
      return 3;
    }
    try {
      // Bounded: the group's 10 s timeout ends each step, and the launchers stop the job
      // well before the steps run out.
      for (int step = 0; step < 100000; ++step) world.all_reduce(vector);
    } catch (const shoal::CommError& e) {
      std::printf("CommError: %s\n", e.what());
      return 1;
    }
    return 0;
  }
  return vector_ok ? 0 : 1;
}
