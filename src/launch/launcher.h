// The launcher of one node: starts its workers, forwards their output and the user's signals,
// records how each worker ended, and stops them all when one fails. See docs/launch.md.
//
// Elastic jobs (--min/--max, --join) use the same workers and lifecycle; what differs (no store
// of the launcher's, a membership agent, restarts instead of stopping the job) is in
// elastic_launch.cpp. See docs/elastic.md.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <optional>
#include <string>
#include <vector>

#include "options.h"
#include "output.h"
#include "shoal/core/env.h"

namespace shoal::proc {
struct ExitStatus;
}
namespace shoal::ps::detail {
class MembershipClient;
}

namespace shoal::launch {

class ElasticAgent;
class JobStore;
class NodeGroup;
class SignalSet;
class Watchdog;

class Launcher {
 public:
  explicit Launcher(LaunchOptions options);
  // SIGKILLs any worker still running (only reached on an unexpected error).
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // Runs this node's part of the job to its end and returns `shoal run`'s exit code: 0 when all
  // workers exited 0; the first failed worker's code (128 + signal if killed); 128 + signal when
  // the launcher was stopped by one; 1 when another node failed or the store was lost.
  // Raises UsageError for what is wrong before any worker starts (exit code 2) and CommError when
  // the nodes cannot form the job.
  int run();

 private:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Worker;

  void start_workers(const std::string& run_id, int port);
  // Starts the worker's process (again, for a restart) with its environment.
  void spawn(Worker& worker);
  void supervise();
  void reap();
  void on_exit(Worker& worker, const proc::ExitStatus& status);
  void on_failure(Worker& worker, const proc::ExitStatus& status);
  void on_signal(int signal);
  void check_nodes();
  void begin_stop(int signal);
  // Signals each running worker's process group, or with `group` false the worker's own process
  // only.
  void signal_running(int signal, bool group = true);
  void drain(Worker& worker);
  void close_output(Worker& worker);
  void kill_leftovers();
  bool any_running() const;
  void say(const std::string& message);

  // Parameter servers (ps_launch.cpp; docs/ps.md, "Processes"): started before the workers, kept
  // in workers_ with Worker::server set, stopped once every worker has ended.
  void start_servers(const std::string& run_id, int port);
  // SHOAL_PS_SERVERS and SHOAL_JOB_TOKEN, for workers and servers alike.
  void add_ps_environment(env::Environment& env) const;
  void on_server_exit(Worker& server, const proc::ExitStatus& status);
  std::string server_name(const Worker& server) const;
  void stop_servers_after_workers();
  // Several nodes (docs/ps.md, "Processes"): node 0 publishes its server flags under kServersKey
  // before the nodes join, and every other node checks its own against them.
  static constexpr const char* kServersKey = "ps/launch/servers";
  // The servers' token (SHOAL_JOB_TOKEN): the user's, else node 0 makes one and publishes it
  // under kTokenKey before the nodes join (docs/ps.md, "Transport").
  static constexpr const char* kTokenKey = "ps/launch/token";
  void choose_ps_token();
  void adopt_ps_token();
  std::string servers_flags() const;
  void check_servers_flags();
  // An elastic job with servers (--servers S --min A --max B; docs/ps.md, "Elastic workers"):
  // each worker has an id at the servers that no other worker of the job ever had (the slot, then
  // slot + n * restarts); a worker whose process ended leaves the servers; a failed one restarts
  // under a new id, and the job fails when fewer than --min workers remain.
  bool ps_elastic() const { return options_.elastic && options_.servers > 0; }
  void set_ps_worker(Worker& worker);
  void leave_servers(Worker& worker);
  void check_min_workers(const Worker& lost, const proc::ExitStatus& status);
  // The job's keys (kept by the first launcher's store) through which launchers that join
  // (`shoal run --servers S --join HOST:PORT`) find the job: its first workers' count, its --max,
  // its mode, and the workers running over all launchers.
  static constexpr const char* kFirstWorkersKey = "ps/launch/first_workers";
  static constexpr const char* kMaxWorkersKey = "ps/launch/max_workers";
  static constexpr const char* kModeKey = "ps/launch/mode";
  static constexpr const char* kRunningKey = "ps/launch/running";
  static constexpr const char* kIdsKey = "ps/launch/ids";
  static constexpr const char* kJoinersKey = "ps/launch/joiners";
  void publish_ps_job();
  // A joining launcher signs its life every NodeGroup::kCheckInterval under
  // "ps/launch/joiner/<n>/beat", with its workers' ids at the servers and their count; the first
  // launcher makes the workers of one silent for NodeGroup::kSilenceLimit leave the servers and
  // frees their room (docs/ps.md, "Elastic workers").
  void publish_joiner();
  void watch_joiners();
  // Counts `count` more workers running over all launchers; false (counting none) when that
  // would pass the job's --max.
  bool reserve_workers(int count);
  void release_workers(int count);
  int run_ps_join();

  // Elastic jobs (elastic_launch.cpp).
  int run_elastic();
  // How this launcher finds the job: through its gossip membership, or its record in etcd.
  void join_gossip(const std::string& token);
  void join_etcd(const std::string& token);
  void start_elastic_workers();
  void on_elastic_failure(Worker& worker, const proc::ExitStatus& status);
  void restart_due(TimePoint now);
  std::optional<TimePoint> next_restart() const;

  LaunchOptions options_;
  Sink out_;
  Sink err_;
  // Created by run() in this order: signals are blocked before the store starts its threads,
  // and the guard is forked while the process has no other thread.
  std::unique_ptr<SignalSet> signals_;
  std::unique_ptr<Watchdog> watchdog_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<NodeGroup> nodes_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::unique_ptr<ElasticAgent> agent_;
  bool any_success_ = false;  // a worker exited 0 (an elastic job's training finished)
  std::string ps_token_;           // the job's token for its parameter servers
  bool servers_stopping_ = false;  // the workers are done and the servers were told to stop
  // ps_elastic(): makes lost workers leave the servers.
  std::unique_ptr<ps::detail::MembershipClient> ps_members_;
  bool workers_done_counted_ = false;  // several nodes: this node's workers counted as done
  int ps_first_workers_ = 0;          // ps_elastic(): the first launcher's -n
  int ps_joiner_ = 0;                 // a joining launcher's number in the job (from 1)
  int ps_held_ = 0;                   // workers this launcher counts under kRunningKey
  std::set<int> ps_live_ids_;         // a joining launcher's workers not yet gone from the servers
  struct Joiner {
    int64_t beat = -1;
    TimePoint changed;
    bool gone = false;
  };
  std::map<int, Joiner> joiners_;  // the first launcher's view of the joining launchers

  bool stopping_ = false;
  int exit_code_ = 0;
  std::optional<TimePoint> kill_at_;     // when a stop escalates to SIGKILL
  std::optional<TimePoint> give_up_at_;  // when to stop waiting for SIGKILLed workers
};

}  // namespace shoal::launch
