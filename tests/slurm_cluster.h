// Real cluster tools for tests: a command run with a deadline (srun, sbatch, mpirun), and a real
// Slurm (munged, slurmctld and one slurmd per node, on this machine's loopback or on two
// network-namespace hosts) that a test starts and stops itself. See docs/testing.md.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "netns.h"

namespace shoal::testing {

struct CommandResult {
  int exit_code = -1;  // 128 + signal when killed
  bool timed_out = false;
  std::string out;
  std::string err;
  double seconds = 0;
};

// Exit, both streams: for failure messages.
std::string describe(const CommandResult& result);

// What tests/programs/launched_worker prints on a "result ..." line.
struct LaunchedResult {
  int rank, world, local, local_size;
  std::string job, master;
  double sum;
};

// The workers' "result ..." lines in `out`, by rank.
std::map<int, LaunchedResult> launched_results(const std::string& out);

// One command in its own process group, its stdout and stderr captured to files. The destructor
// SIGKILLs the group if it was not waited for.
class Command {
 public:
  // argv[0] is looked up on PATH; `env` is added to (and overrides) this process's environment.
  Command(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~Command();
  Command(const Command&) = delete;
  Command& operator=(const Command&) = delete;

  // Waits for the command to end; past the timeout (counted from the start), SIGKILLs its
  // group and reports timed_out.
  CommandResult wait(std::chrono::milliseconds timeout);
  // Whether the command has ended, without waiting.
  bool finished();

 private:
  int status_ = 0;
  double seconds_ = 0;
  std::chrono::steady_clock::time_point start_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string out_path_;
  std::string err_path_;
};

struct SlurmNode {
  std::string name;  // a NodeName that does not resolve, as on a cluster with its own names
  int cpus = 2;      // what slurmd claims (SlurmdParameters=config_overrides)
};

// What a test may change in the cluster's slurm.conf.
struct SlurmClusterOptions {
  // SchedulerParameters ("" leaves Slurm's defaults). Slurm holds batch jobs back up to its
  // batch_sched_delay (3 s) to schedule them in bulk; "batch_sched_delay=0" starts one on an idle
  // node in ~0.3 s here, for tests that time a start.
  std::string scheduler_parameters;
  // Seconds between the SIGTERM and the SIGKILL with which Slurm ends a job (KillWait): 2 ends a
  // test's leftover tasks quickly; Slurm's default, 30, leaves a program time to act on the
  // SIGTERM.
  int kill_wait = 2;
  // Where the daemons run. Null: on this machine, every node a `slurmd -N NAME` on 127.0.0.1.
  // Otherwise node i runs on host i of these two (at most two nodes), as on a machine of its own:
  // its slurmd in the host's network, UTS and mount namespaces (TwoHosts::on_host, with an
  // /etc/hosts that names both hosts), NodeHostname the host's name, NodeAddr its address; and
  // slurmctld runs on host 0, at the address both hosts reach. munged stays on this machine: its
  // socket is a path, which every namespace sees. Slurm's clients (sbatch, squeue, sinfo) then
  // work on either host and not on this machine's own network. `hosts` must outlive the cluster.
  const TwoHosts* hosts = nullptr;
};

// A Slurm 22.05 cluster of one slurmctld and one slurmd per node, on 127.0.0.1 (`slurmd -N NAME`)
// or on two namespaced hosts (SlurmClusterOptions::hosts), with ports of their own and state under
// a fresh temporary directory, so that tests running at once never meet. The destructor stops the
// daemons and kills every process that still runs with this cluster's SLURM_CONF (the tasks of a
// job cut short), even when the test failed.
class SlurmCluster {
 public:
  // Why no real Slurm can run here ("" when it can): not root, or a package is missing.
  static std::string unavailable();

  // Starts the cluster and waits (with a deadline) until every node is idle; raises
  // std::runtime_error, with the daemons' logs, when it does not come up.
  explicit SlurmCluster(const std::vector<SlurmNode>& nodes,
                        const SlurmClusterOptions& options = {});
  ~SlurmCluster();
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  // SLURM_CONF, for srun, sbatch and sinfo.
  std::map<std::string, std::string> client_env() const;
  // A directory for the test's own files, removed with the cluster.
  const std::string& dir() const { return dir_; }
  // The daemons' logs, for a failure message.
  std::string logs() const;
  // The id of the cluster's first job; later jobs count up from it. Clusters that run at once
  // start 16 apart (the first 23 of them), so their jobs' derived ports never meet.
  int first_job_id() const { return first_job_id_; }

 private:
  void stop();

  int first_job_id_ = 1;
  std::string dir_;
  std::string conf_;
  std::vector<pid_t> daemons_;  // munged first
  // What runs a client where slurmctld is reached (nothing on loopback; host 0's network).
  std::vector<std::string> client_prefix_;
};

}  // namespace shoal::testing
