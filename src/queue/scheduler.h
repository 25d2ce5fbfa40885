// The queue's scheduler: its jobs, workers and hosts, kept in SQLite, and the loop that applies
// the policy (policy.h) and tells each host's agent which workers it should run. The HTTP face
// (server.cpp) is a thin layer over this class. See docs/queue.md.
//
// Note [Desired state]: an agent does not receive commands; each heartbeat reply is the whole
// list of workers its host should run (with, for each, whether to leave). The agent starts those
// it never started, signals those asked to leave, stops any it runs that the list lacks, and
// reports every worker's end until the scheduler has recorded it. A lost reply, a scheduler that
// restarts from its database, or an agent that restarts, all converge on the next heartbeat.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "heartbeat.h"
#include "policy.h"
#include "scheduler_views.h"

namespace shoal::queue {

// How a running job changes size. kLeave is shoal's: a shrink is a graceful leave of some
// workers, a grow a join, and the workers that stay keep their processes. kRestart is how
// Kubeflow's elastic PyTorchJob and Ray Train resize: the whole job stops at a commit and starts
// again at its new size from that commit (Note [Resizing by restart], scheduler_jobs.cpp). The
// policy decides the same in both; only how its shrinks and grows are carried out differs.
enum class ResizeBy { kLeave, kRestart };

struct SchedulerOptions {
  std::string state_dir;  // the database, the token, the jobs' checkpoints
  PolicyOptions policy;
  ResizeBy resize_by = ResizeBy::kLeave;
  double oversubscribe = 1.0;   // workers per core a host may run
  double host_timeout = 5;      // seconds without a heartbeat before a host counts as lost
  double below_min_grace = 60;  // seconds a job may run below its --min before it waits again
  double done_grace = 30;       // seconds a finished job's other workers have to end by themselves
};

// What a user submits (POST /jobs).
struct Submission {
  std::string name;
  std::vector<std::string> argv;  // argv[0]: the program, an absolute path
  std::string cwd;
  std::map<std::string, std::string> env;
  int priority = 0;
  int min_workers = 1;
  int max_workers = 1;
  bool preemptible = false;
  int max_restarts = 3;
  // Set by the scheduler, not the submitter (docs/queue.md, "Security"): whose job it is, and
  // the Unix user its workers run as.
  std::string owner = "admin";
  std::string run_as;

  // Raises UsageError with one line naming what is wrong; see docs/queue.md, "Submitting".
  static Submission from_json(const nlohmann::json& body);
  nlohmann::json to_json() const;
};

// The integer `text` spells, whole, when it lies in [low, high]; else nullopt. One parser for the
// REST API's and the command line's numbers.
std::optional<int64_t> parse_integer(const std::string& text, int64_t low, int64_t high);

// A job's id written as text (a REST path, a command's argument); nullopt when the text is not a
// positive integer.
inline std::optional<int64_t> parse_job_id(const std::string& text) {
  return parse_integer(text, 1, INT64_MAX);
}

// The answer to an agent's heartbeat, its orders (Note [Desired state]): the whole list of workers
// its host should run, what the agent needs to start each job's workers, and the ended workers
// the scheduler has recorded (the agent stops reporting them).
struct Orders {
  struct Worker {
    int64_t id = 0;
    int64_t job = 0;
    bool leave = false;
    bool stop = false;
  };
  struct Job {
    std::vector<std::string> argv;
    std::string cwd;
    std::map<std::string, std::string> env;
    std::string token;
    std::string run_id;
    int min_workers = 1;
    int max_workers = 1;
    int priority = 0;
    std::string run_as;
    std::vector<std::string> seeds;  // membership addresses of the job on its other hosts
  };
  std::vector<Worker> workers;
  std::map<int64_t, Job> jobs;  // by job id: one for each job of `workers`
  std::vector<int64_t> forget;
};

// The reply's JSON, which the agent (agent.cpp) reads (nlohmann's to_json: `json(orders)`).
void to_json(nlohmann::json& out, const Orders& orders);

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);
  ~Scheduler();

  // The REST API's operations (server.cpp). Times are wall-clock milliseconds.
  int64_t submit(const Submission& spec);
  void cancel(int64_t job);  // UsageError when there is no such job or it has ended
  // The views (scheduler_views.h), in the order of their ids (a host's: of its name).
  std::vector<JobInfo> jobs() const;
  JobDetails job(int64_t id) const;  // UsageError when there is no such job
  std::vector<HostInfo> nodes() const;
  // The events after id `since`, `limit` at most.
  std::vector<EventInfo> events(int64_t since, int limit) const;
  QueueMetrics metrics() const;

  // An agent's heartbeat: what its host runs and what ended there, read whole from the JSON it
  // posts before this is called (heartbeat.h, Note [A heartbeat is read whole]); the reply is its
  // orders (Note [Desired state]). UsageError when the report names no host.
  Orders heartbeat(const HeartbeatReport& report);

  // One round of the policy; the server calls it a few times a second.
  void tick();

  // The hosts whose orders changed since their agents' last heartbeats (cleared): the server
  // nudges those agents to beat at once (Note [Nudges] in server.cpp).
  std::set<std::string> take_news();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::queue
