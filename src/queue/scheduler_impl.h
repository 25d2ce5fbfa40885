// The scheduler's state: its jobs, workers and hosts in memory, the database they are kept in,
// and what the scheduler's files do to them, each under Scheduler's one lock:
//   scheduler_storage.cpp   keeping them in SQLite, loading them back after a restart
//                           (Note [Outages])
//   scheduler_jobs.cpp      the state machine: a job's submission, start, its workers' exits,
//                           failures and back-off, resizes (Note [Resizing by restart]),
//                           preemptions, cancellation; the policy's rounds
//   scheduler_heartbeat.cpp the agents' heartbeats, and hosts lost when those stop
//   scheduler_views.cpp     what `ls`, `show`, `top` and the dashboard read
// Private to those files and scheduler.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "db.h"
#include "policy.h"
#include "scheduler.h"
#include "scheduler_views.h"
#include "throughput.h"

namespace shoal::queue {

struct Scheduler::Impl {
  static constexpr int64_t kNever = INT64_MIN / 2;
  // The due time of a worker that starts once the job's workers of before are all gone.
  static constexpr int64_t kOnceGone = INT64_MAX / 2;
  // A gap longer than this since the scheduler was last alive is an outage (Note [Outages]).
  static constexpr int64_t kOutageMs = 3000;

  // Wall-clock milliseconds, the scheduler's times.
  static int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  struct Worker {
    int64_t id = 0;
    int64_t job = 0;
    std::string host;
    std::string state = "starting";  // starting, running, exited
    int64_t pid = 0;
    bool leave = false;  // asked to leave at its next commit
    bool kill = false;   // to be stopped (a cancelled, failed or requeued job)
    // Sent to its agent to run. An agent never starts a worker whose first order already says
    // leave or stop, and so never reports it: such a worker is withdrawn here (withdraw()).
    bool ordered = false;
    int64_t started_ms = 0;
    int64_t ended_ms = 0;
    std::string exit;  // how it ended, in words
    bool success = false;
  };
  // A slot held for a worker to be started: a failed worker's replacement, or a worker of the
  // next generation of a job resized by restart (`resize`; Note [Resizing by restart]).
  struct Restart {
    std::string host;
    int64_t due_ms = 0;
    bool resize = false;
  };
  struct Job {
    int64_t id = 0;
    Submission spec;
    std::string state = "waiting";  // waiting, running, done, failed, cancelled
    std::string reason;
    int64_t submitted_ms = 0;
    int64_t started_ms = 0;
    int64_t ended_ms = 0;
    int64_t last_resize_ms = kNever;
    int64_t below_min_since = 0;
    int64_t done_at = 0;
    std::string token;
    std::string run_id;
    std::string origin;  // the host whose agent forms the job's membership first
    int failures = 0;
    int resizes = 0;
    int preemptions = 0;
    int cycles = 0;     // shrunk or preempted, then given back what it lost (a preemption cycle)
    bool owed = false;  // lost workers to another job since it last grew
    std::vector<Restart> restarting;
    std::map<std::string, std::string> members;  // host -> its agent's membership address
    Throughput throughput;  // from its first worker's progress (docs/queue.md, "Throughput")
    double noise_scale = 0;  // the same progress's, for the goodput policy (src/queue/policy.h)
    int64_t batch_per_worker = 0;
    BatchLimits batch_limits{};     // under BatchPolicy::goodput(): base_batch > 0
    std::vector<StepSample> steps;  // its step times, then
    // What plan() models its speed-up from (Note [Speed-up curves]).
    void model_into(JobView& view) const {
      view.throughput = throughput.by_world();
      view.noise_scale = noise_scale;
      view.batch_per_worker = batch_per_worker;
      view.batch_limits = batch_limits;
      view.steps = steps;
    }
  };
  struct Host {
    std::string name;
    int cores = 0;
    int capacity = 0;
    int64_t last_seen = 0;
    bool alive = true;
    int64_t agent_pid = 0;
  };

  SchedulerOptions options;
  mutable std::mutex mutex;
  Database db;
  std::map<int64_t, Job> jobs;
  std::map<int64_t, Worker> workers;
  std::map<std::string, Host> hosts;
  // Hosts whose orders changed since their last heartbeat: the server nudges their agents to beat
  // now rather than at their next beat (Note [Nudges] in server.cpp).
  std::set<std::string> news;
  int64_t next_worker = 1;
  double idle_since = std::numeric_limits<double>::infinity();
  std::set<int64_t> dirty_jobs;
  std::set<int64_t> dirty_workers;
  std::set<std::string> dirty_hosts;
  struct Event {
    int64_t time_ms;
    int64_t job;
    std::string kind;
    std::string message;
  };
  std::vector<Event> pending_events;
  int64_t alive_ms = 0;  // last written to meta (Note [Outages])

  // Opens (creating) the database in the state directory and loads what it holds.
  explicit Impl(SchedulerOptions opts);

  // --- persistence (scheduler_storage.cpp) -------------------------------------------------------

  static nlohmann::json job_doc(const Job& job);
  static Job job_from_doc(int64_t id, const nlohmann::json& doc);
  static nlohmann::json worker_doc(const Worker& w);
  void load();
  void alive(int64_t now);
  void event(int64_t job, std::string kind, std::string message);
  void flush();

  // --- the state machine and the policy round (scheduler_jobs.cpp) -------------------------------

  std::vector<Worker*> live_workers(int64_t job);
  void add_workers(Job& job, const std::vector<std::string>& on, int64_t now);
  void stop_all(Job& job);
  void withdraw(Worker& w, int64_t now);
  void fail(Job& job, const std::string& reason, int64_t now);
  void on_exit(Worker& w, const std::string& how, bool success, int64_t now);
  void restart_at(Job& job, std::vector<std::string> hosts);
  void restart_when_gone(int64_t now);
  void check_jobs(int64_t now);
  Snapshot snapshot(int64_t now);
  void apply(const Action& action, int64_t now);
  void tick();

  // --- hosts (scheduler_heartbeat.cpp) -----------------------------------------------------------

  void check_hosts(int64_t now);

  // --- views (scheduler_views.cpp) ---------------------------------------------------------------

  WorkerInfo worker_info(const Worker& w) const;
  JobInfo job_info(const Job& job) const;
};

}  // namespace shoal::queue
