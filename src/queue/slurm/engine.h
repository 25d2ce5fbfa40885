// The Slurm engine: the agent speaks for one Slurm node, and each of its workers is a Slurm job of
// one task on that node (`sbatch -w NODE -N1 -n1`). Slurm's own controls do the work: a leave is
// `scancel --batch --signal=TERM` (the job's program leaves at its next commit and exits 0, and
// its job ends), a stop is `scancel JOBID` (Slurm's SIGTERM, then SIGKILL after KillWait), and
// the job's priority in the queue becomes the Slurm job's --nice, so that Slurm's partitions,
// limits and priorities apply where the queue's jobs share a node with others. A SIGTERM that
// Slurm sends by itself fails the worker (Note [Slurm's own SIGTERM], engine.cpp). See
// docs/queue.md, "Slurm".
//
// Assumes that this agent's --dir is on a filesystem the node shares (the batch scripts, the
// workers' logs and the files of slurm/step.h), as the jobs' own files are on a cluster.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>

#include "../engine.h"

namespace shoal::queue::slurm {

struct SlurmOptions {
  std::string node;       // the NodeName the workers run on
  std::string partition;  // "": the cluster's default partition
  std::string dir;        // batch scripts and the steps' files, shared with the node
  // A bound on every sbatch, scancel, squeue and scontrol.
  std::chrono::milliseconds command_timeout{10000};
};

class SlurmEngine : public Engine {
 public:
  // Asks Slurm for the node (`scontrol show node`); raises UsageError with one line when Slurm's
  // commands are missing, the node does not exist, or the partition does not hold it.
  explicit SlurmEngine(SlurmOptions options);

  Capacity capacity() const override;
  int64_t start(const WorkerLaunch& launch) override;
  void signal(int64_t worker, int signal) override;
  std::vector<WorkerChange> poll() override;

 private:
  using Clock = std::chrono::steady_clock;

  struct Job {
    std::string id;      // Slurm's job id
    std::string prefix;  // PREFIX.pid and PREFIX.exit (slurm/step.h)
    int64_t pid = 0;
    std::optional<int> cancelled;  // the signal that cancelled it before its program ran
    bool signalled = false;        // the agent has signalled it (a leave or a stop)
    std::optional<Clock::time_point> gone_since;  // Slurm says it ended; its .exit is awaited
    std::string state;                            // Slurm's last word on it: PENDING, RUNNING, ...
  };

  // A Slurm job that an earlier agent with this --dir submitted and that still pends or runs.
  struct Predecessor {
    std::string id;  // Slurm's job id
    int64_t job = 0;
  };

  std::string tool(const std::string& name) const;
  // Lists the predecessors' jobs (squeue); see Note [A restarted agent's Slurm jobs].
  void find_predecessors();
  // The agent's own environment, for squeue, scancel and scontrol.
  std::vector<std::string> client_env() const;
  void scancel(const Job& job, const std::vector<std::string>& flags);
  // Slurm's state of each of `jobs_` that squeue lists; nullopt when squeue did not answer.
  std::optional<std::map<std::string, std::pair<std::string, std::string>>> states();

  SlurmOptions options_;
  std::map<std::string, std::string> tools_;  // sbatch, scancel, squeue, scontrol -> their paths
  std::string slurm_conf_;                    // the agent's SLURM_CONF, passed to every command
  std::string step_;                          // shoal-slurm-step, which the batch scripts execute
  Capacity capacity_;
  std::map<int64_t, Job> jobs_;  // by worker
  std::map<int64_t, Predecessor> predecessors_;  // by worker, until start() follows them
  bool squeue_failing_ = false;
  Clock::time_point last_squeue_{};
};

}  // namespace shoal::queue::slurm
