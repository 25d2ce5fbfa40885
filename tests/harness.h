// Runs a test body in N worker processes (gloo's spawn(), with real processes and sockets).
//
//   TEST(Collectives, Sum) {
//     shoal::testing::run_workers(3, [] { /* runs in each of 3 workers, after shoal::init() */ });
//   }
//
// The test process re-executes its own binary N times, filtered to the current test, with the
// job's environment set as a launcher would. In a worker, run_workers runs the body and ends
// the process (exit code 1 on any gtest failure or exception); in the test process it waits,
// with a deadline, and fails the test if a worker failed, printing the worker's output.
// A test may call run_workers several times; each call is numbered, and a worker runs only
// the call it was started for.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shoal/core/timeout.h"
#include "test_paths.h"  // shoal_bin(), test_programs_dir()

namespace shoal::testing {

// Which launcher's environment the workers get; kNone: none (a job of one).
enum class Launcher { kShoal, kTorchrun, kOpenMpi, kSlurm, kNone };

struct WorkersOptions {
  Duration timeout = std::chrono::seconds(90);
  Launcher launcher = Launcher::kShoal;
  // Extra environment for every worker.
  std::map<std::string, std::string> env;
  // Ranks expected to die (by signal or non-zero exit); they don't fail the test.
  std::set<int> may_fail;
  // Ranks that are SIGKILLed once all the others have exited (e.g. a SIGSTOPped worker).
  std::set<int> stragglers;
  // Whether the worker calls shoal::init() before the body.
  bool init = true;
  // Network namespaces (`ip netns` names, e.g. TwoHosts'), one per host: the workers are cut
  // among them in rank order (host h runs ranks h*n/H .. (h+1)*n/H - 1), and the store is hosted
  // in the first, reached at `master_address` (its address on the link). Empty: all on this
  // host, store on loopback. Launcher::kShoal only.
  std::vector<std::string> hosts;
  std::string master_address;
};

struct WorkerExit {
  int rank = 0;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  std::string output;  // stdout and stderr
};

// In the test process: the workers' exits, in rank order. In a worker: does not return.
std::vector<WorkerExit> run_workers(int n, const std::function<void()>& body,
                                    const WorkersOptions& options = {});

// True in a worker process.
bool is_worker();

// Called by the tests' main() before anything else: starts the worker server (Note [Workers
// forked from a copy made at start] in harness.cpp) and returns argv. It returns again in every
// worker the server forks, with that worker's arguments.
std::vector<std::string> start_worker_server(int argc, char** argv);

// A free TCP port on loopback (bound and released; fine for tests on one machine).
int free_port();

}  // namespace shoal::testing
