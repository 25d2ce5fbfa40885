// What the scheduler shows of its jobs, workers and hosts: the answers of the REST API's reads
// (GET /jobs, /jobs/ID, /nodes, /events, /metrics), which `shoal queue ls`, `show` and `top` and
// the dashboard print. Plain values, copied out under the scheduler's lock (scheduler_views.cpp
// builds them); their to_json is the REST API's encoding (docs/queue.md, "REST API").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "throughput.h"

namespace shoal::queue {

// One of a job's workers, running or ended.
struct WorkerInfo {
  int64_t id = 0;
  int64_t job = 0;
  std::string host;
  std::string state;  // starting, running, exited
  int64_t pid = 0;
  bool leave = false;  // asked to leave at its next commit
  bool stop = false;   // to be stopped (a cancelled, failed or requeued job)
  int64_t started_ms = 0;
  int64_t ended_ms = 0;
  std::string exit;  // how it ended, in words
};

// A job as GET /jobs lists it: its spec (without its environment) and where it stands.
struct JobInfo {
  int64_t id = 0;
  std::string name;
  std::vector<std::string> argv;
  int priority = 0;
  int min_workers = 1;
  int max_workers = 1;
  bool preemptible = false;
  int max_restarts = 3;
  std::string owner;
  std::string run_as;
  std::string state;  // waiting, running, done, failed, cancelled
  std::string reason;
  int64_t submitted_ms = 0;
  int64_t started_ms = 0;
  int64_t ended_ms = 0;
  int failures = 0;
  int resizes = 0;
  int preemptions = 0;
  int cycles = 0;
  int restarting = 0;  // slots held for workers to be started
  Throughput throughput;
  // What the goodput policy models the job by (Note [Speed-up curves], src/queue/policy.h): the
  // noise scale and per-worker batch its first worker reports, and its modeled speed-up on 1 to
  // --max workers (at most 64 of them).
  double noise_scale = 0;
  int64_t batch_per_worker = 0;
  std::vector<double> speedup;
  int workers = 0;  // live workers
};

// One of the decisions and facts the scheduler records (GET /events, and a job's own).
struct EventInfo {
  int64_t id = 0;
  int64_t time_ms = 0;
  int64_t job = 0;  // 0: the queue's, not a job's
  std::string kind;
  std::string message;
};

// A job as GET /jobs/ID shows it: with all its workers and its events.
struct JobDetails : JobInfo {
  std::vector<WorkerInfo> worker_list;
  std::vector<EventInfo> events;
};

// A host as GET /nodes lists it, with its live workers.
struct HostInfo {
  struct Worker {
    int64_t id = 0;
    int64_t job = 0;
    int64_t pid = 0;
  };
  std::string name;
  int cores = 0;
  int capacity = 0;
  bool alive = true;
  int64_t last_seen_ms = 0;
  std::vector<Worker> workers;
};

// A time no scheduler ran (Note [Outages] in scheduler_storage.cpp).
struct Outage {
  int64_t from_ms = 0;
  int64_t to_ms = 0;
};

// The queue's counters (GET /metrics).
struct QueueMetrics {
  std::map<std::string, int> jobs;  // state -> how many jobs are in it
  std::vector<Outage> outages;      // the last 20, latest first
  int resizes = 0;
  int preemptions = 0;
  int preemption_cycles = 0;
  int failures = 0;
  int capacity = 0;  // slots of the live hosts
  int workers = 0;   // live workers
};

// The REST API's encoding of each (nlohmann's to_json: `json(value)`). A job's details list its
// events without their job.
void to_json(nlohmann::json& out, const WorkerInfo& worker);
void to_json(nlohmann::json& out, const JobInfo& job);
void to_json(nlohmann::json& out, const EventInfo& event);
void to_json(nlohmann::json& out, const JobDetails& job);
void to_json(nlohmann::json& out, const HostInfo& host);
void to_json(nlohmann::json& out, const Outage& outage);
void to_json(nlohmann::json& out, const QueueMetrics& metrics);

}  // namespace shoal::queue
