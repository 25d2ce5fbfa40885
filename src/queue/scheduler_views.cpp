// What the scheduler shows (scheduler_views.h): its jobs, workers, hosts, events and counters,
// copied out under its lock for the REST API's reads, and their JSON.
#include <map>
#include <string>

#include "scheduler_impl.h"
#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

WorkerInfo Scheduler::Impl::worker_info(const Worker& w) const {
  WorkerInfo out;
  out.id = w.id;
  out.job = w.job;
  out.host = w.host;
  out.state = w.state;
  out.pid = w.pid;
  out.leave = w.leave;
  out.stop = w.kill;
  out.started_ms = w.started_ms;
  out.ended_ms = w.ended_ms;
  out.exit = w.exit;
  return out;
}

JobInfo Scheduler::Impl::job_info(const Job& job) const {
  JobInfo out;
  out.id = job.id;
  out.name = job.spec.name;
  out.argv = job.spec.argv;
  out.priority = job.spec.priority;
  out.min_workers = job.spec.min_workers;
  out.max_workers = job.spec.max_workers;
  out.preemptible = job.spec.preemptible;
  out.max_restarts = job.spec.max_restarts;
  out.owner = job.spec.owner;
  out.run_as = job.spec.run_as;
  out.state = job.state;
  out.reason = job.reason;
  out.submitted_ms = job.submitted_ms;
  out.started_ms = job.started_ms;
  out.ended_ms = job.ended_ms;
  out.failures = job.failures;
  out.resizes = job.resizes;
  out.preemptions = job.preemptions;
  out.cycles = job.cycles;
  out.restarting = static_cast<int>(job.restarting.size());
  out.throughput = job.throughput;
  out.noise_scale = job.noise_scale;
  out.batch_per_worker = job.batch_per_worker;
  JobView view;
  job.model_into(view);
  for (int w = 1; w <= std::min(job.spec.max_workers, 64); ++w) out.speedup.push_back(speedup(view, w, options.policy));
  for (const auto& [id, w] : workers) {
    if (w.job == job.id && w.state != "exited") ++out.workers;
  }
  return out;
}

std::vector<JobInfo> Scheduler::jobs() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<JobInfo> list;
  for (const auto& [id, job] : impl_->jobs) list.push_back(impl_->job_info(job));
  return list;
}

JobDetails Scheduler::job(int64_t id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->jobs.find(id);
  if (it == impl_->jobs.end()) throw UsageError("no job " + std::to_string(id));
  JobDetails out;
  static_cast<JobInfo&>(out) = impl_->job_info(it->second);
  for (const auto& [worker_id, w] : impl_->workers) {
    if (w.job == id) out.worker_list.push_back(impl_->worker_info(w));
  }
  for (const auto& row : impl_->db.query(
           "SELECT id, time_ms, kind, message FROM events WHERE job = ? ORDER BY id", {id})) {
    out.events.push_back({row[0].integer, row[1].integer, id, row[2].text, row[3].text});
  }
  return out;
}

std::vector<HostInfo> Scheduler::nodes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<HostInfo> list;
  for (const auto& [name, host] : impl_->hosts) {
    HostInfo info;
    info.name = name;
    info.cores = host.cores;
    info.capacity = host.capacity;
    info.alive = host.alive;
    info.last_seen_ms = host.last_seen;
    for (const auto& [id, w] : impl_->workers) {
      if (w.host == name && w.state != "exited") info.workers.push_back({id, w.job, w.pid});
    }
    list.push_back(std::move(info));
  }
  return list;
}

std::vector<EventInfo> Scheduler::events(int64_t since, int limit) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<EventInfo> list;
  for (const auto& row : impl_->db.query(
           "SELECT id, time_ms, job, kind, message FROM events WHERE id > ? ORDER BY id LIMIT ?",
           {since, limit})) {
    list.push_back({row[0].integer, row[1].integer, row[2].integer, row[3].text, row[4].text});
  }
  return list;
}

QueueMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  QueueMetrics out;
  for (const auto& [id, job] : impl_->jobs) {
    out.resizes += job.resizes;
    out.preemptions += job.preemptions;
    out.preemption_cycles += job.cycles;
    out.failures += job.failures;
    ++out.jobs[job.state];
  }
  for (const auto& [name, host] : impl_->hosts) out.capacity += host.alive ? host.capacity : 0;
  for (const auto& [id, w] : impl_->workers) out.workers += w.state != "exited" ? 1 : 0;
  for (const auto& row : impl_->db.query(
           "SELECT from_ms, to_ms FROM outages ORDER BY id DESC LIMIT 20")) {
    out.outages.push_back({row[0].integer, row[1].integer});
  }
  return out;
}

// --- JSON (the REST API's) -----------------------------------------------------------------------

void to_json(json& out, const WorkerInfo& w) {
  out = json{{"id", w.id},
             {"job", w.job},
             {"host", w.host},
             {"state", w.state},
             {"pid", w.pid},
             {"leave", w.leave},
             {"stop", w.stop},
             {"started_ms", w.started_ms},
             {"ended_ms", w.ended_ms},
             {"exit", w.exit}};
}

void to_json(json& out, const JobInfo& job) {
  out = json{{"id", job.id},
             {"name", job.name},
             {"argv", job.argv},
             {"priority", job.priority},
             {"min", job.min_workers},
             {"max", job.max_workers},
             {"preemptible", job.preemptible},
             {"max_restarts", job.max_restarts},
             {"owner", job.owner},
             {"run_as", job.run_as},
             {"state", job.state},
             {"reason", job.reason},
             {"submitted_ms", job.submitted_ms},
             {"started_ms", job.started_ms},
             {"ended_ms", job.ended_ms},
             {"failures", job.failures},
             {"resizes", job.resizes},
             {"preemptions", job.preemptions},
             {"cycles", job.cycles},
             {"restarting", job.restarting},
             {"throughput", job.throughput.to_json()},
             {"goodput",
              {{"noise_scale", job.noise_scale}, {"batch_per_worker", job.batch_per_worker}, {"speedup", job.speedup}}},
             {"workers", job.workers}};
}

void to_json(json& out, const EventInfo& event) {
  out = json{{"id", event.id},
             {"time_ms", event.time_ms},
             {"job", event.job},
             {"kind", event.kind},
             {"message", event.message}};
}

void to_json(json& out, const JobDetails& job) {
  to_json(out, static_cast<const JobInfo&>(job));
  out["worker_list"] = job.worker_list;
  json events = json::array();
  for (const auto& e : job.events) {
    events.push_back(
        {{"id", e.id}, {"time_ms", e.time_ms}, {"kind", e.kind}, {"message", e.message}});
  }
  out["events"] = events;
}

void to_json(json& out, const HostInfo& host) {
  json running = json::array();
  for (const auto& w : host.workers) {
    running.push_back({{"id", w.id}, {"job", w.job}, {"pid", w.pid}});
  }
  out = json{{"name", host.name},
             {"cores", host.cores},
             {"capacity", host.capacity},
             {"alive", host.alive},
             {"last_seen_ms", host.last_seen_ms},
             {"workers", running}};
}

void to_json(json& out, const Outage& outage) {
  out = json{{"from_ms", outage.from_ms}, {"to_ms", outage.to_ms}};
}

void to_json(json& out, const QueueMetrics& metrics) {
  out = json{{"jobs", metrics.jobs},
             {"outages", metrics.outages},
             {"resizes", metrics.resizes},
             {"preemptions", metrics.preemptions},
             {"preemption_cycles", metrics.preemption_cycles},
             {"failures", metrics.failures},
             {"capacity", metrics.capacity},
             {"workers", metrics.workers}};
}

}  // namespace shoal::queue
