// The local engine: the agent forks its workers on this host. Each leads its own process group
// (signals reach whatever it started too), dies with the agent (PR_SET_PDEATHSIG), and runs
// with the CPU weight of its job's priority (cpu_weight.h: an oversubscribed host gives
// lower-priority workers less of its cores).
#pragma once

#include <sys/types.h>

#include <map>

#include "../cpu_weight.h"
#include "../engine.h"

namespace shoal::queue::local {

class LocalEngine : public Engine {
 public:
  Capacity capacity() const override;
  int64_t start(const WorkerLaunch& launch) override;
  void signal(int64_t worker, int signal) override;
  std::vector<WorkerChange> poll() override;

 private:
  struct Running {
    pid_t pid = -1;
    int64_t job = 0;
  };
  std::map<int64_t, Running> running_;  // worker -> its process (group)
  CpuWeights weights_;
};

}  // namespace shoal::queue::local
