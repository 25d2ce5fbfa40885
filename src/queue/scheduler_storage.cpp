// The scheduler's storage: its jobs, workers, hosts and events kept in SQLite (STATE_DIR/queue.db,
// docs/queue.md, "State"), each as a JSON document beside the columns it is looked up by, and
// loaded back by a scheduler that starts on the state again, after a restart or a crash.
#include <algorithm>
#include <string>

#include "scheduler_impl.h"

namespace shoal::queue {

using nlohmann::json;

Scheduler::Impl::Impl(SchedulerOptions opts)
    : options(std::move(opts)), db(options.state_dir + "/queue.db") {
  db.exec(
      "CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY, state TEXT, priority INTEGER, "
      "doc TEXT)");
  db.exec(
      "CREATE TABLE IF NOT EXISTS workers (id INTEGER PRIMARY KEY, job INTEGER, host TEXT, "
      "state TEXT, doc TEXT)");
  db.exec("CREATE TABLE IF NOT EXISTS hosts (name TEXT PRIMARY KEY, doc TEXT)");
  // Note [Outages]: the scheduler writes the time it was last alive every second; a scheduler
  // that starts on a state whose last alive time is more than a few seconds old records the
  // gap as an outage, which the dashboard marks (no decision was taken in it, and the jobs
  // trained on).
  db.exec("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER)");
  db.exec(
      "CREATE TABLE IF NOT EXISTS outages (id INTEGER PRIMARY KEY AUTOINCREMENT, from_ms "
      "INTEGER, to_ms INTEGER)");
  db.exec(
      "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, time_ms "
      "INTEGER, job INTEGER, kind TEXT, message TEXT)");
  load();
}

json Scheduler::Impl::job_doc(const Job& job) {
  json restarting = json::array();
  for (const auto& r : job.restarting)
    restarting.push_back({{"host", r.host}, {"due_ms", r.due_ms}, {"resize", r.resize}});
  return json{{"spec", job.spec.to_json()},
              {"state", job.state},
              {"reason", job.reason},
              {"submitted_ms", job.submitted_ms},
              {"started_ms", job.started_ms},
              {"ended_ms", job.ended_ms},
              {"last_resize_ms", job.last_resize_ms},
              {"below_min_since", job.below_min_since},
              {"done_at", job.done_at},
              {"token", job.token},
              {"run_id", job.run_id},
              {"origin", job.origin},
              {"failures", job.failures},
              {"resizes", job.resizes},
              {"preemptions", job.preemptions},
              {"cycles", job.cycles},
              {"owed", job.owed},
              {"restarting", restarting},
              {"members", job.members},
              {"throughput", job.throughput.to_json()}};
}

Scheduler::Impl::Job Scheduler::Impl::job_from_doc(int64_t id, const json& doc) {
  Job job;
  job.id = id;
  job.spec = Submission::from_json(doc.at("spec"));
  job.state = doc.at("state");
  job.reason = doc.value("reason", "");
  job.submitted_ms = doc.value("submitted_ms", int64_t{0});
  job.started_ms = doc.value("started_ms", int64_t{0});
  job.ended_ms = doc.value("ended_ms", int64_t{0});
  job.last_resize_ms = doc.value("last_resize_ms", kNever);
  job.below_min_since = doc.value("below_min_since", int64_t{0});
  job.done_at = doc.value("done_at", int64_t{0});
  job.token = doc.value("token", "");
  job.run_id = doc.value("run_id", "");
  job.origin = doc.value("origin", "");
  job.failures = doc.value("failures", 0);
  job.resizes = doc.value("resizes", 0);
  job.preemptions = doc.value("preemptions", 0);
  job.cycles = doc.value("cycles", 0);
  job.owed = doc.value("owed", false);
  for (const auto& r : doc.value("restarting", json::array())) {
    job.restarting.push_back({r.at("host"), r.at("due_ms"), r.value("resize", false)});
  }
  job.members = doc.value("members", std::map<std::string, std::string>{});
  job.throughput.restore(doc.value("throughput", json()));
  return job;
}

json Scheduler::Impl::worker_doc(const Worker& w) {
  return json{{"pid", w.pid},           {"leave", w.leave},
              {"kill", w.kill},         {"started_ms", w.started_ms},
              {"ended_ms", w.ended_ms}, {"exit", w.exit},
              {"success", w.success},   {"ordered", w.ordered}};
}

void Scheduler::Impl::load() {
  for (const auto& row : db.query("SELECT id, doc FROM jobs")) {
    jobs[row[0].integer] = job_from_doc(row[0].integer, json::parse(row[1].text));
  }
  for (const auto& row : db.query("SELECT id, job, host, state, doc FROM workers")) {
    Worker w;
    w.id = row[0].integer;
    w.job = row[1].integer;
    w.host = row[2].text;
    w.state = row[3].text;
    const json doc = json::parse(row[4].text);
    w.pid = doc.value("pid", int64_t{0});
    w.leave = doc.value("leave", false);
    w.kill = doc.value("kill", false);
    w.started_ms = doc.value("started_ms", int64_t{0});
    w.ended_ms = doc.value("ended_ms", int64_t{0});
    w.exit = doc.value("exit", "");
    w.success = doc.value("success", false);
    w.ordered = doc.value("ordered", true);  // a database from before the field: assume sent
    workers[w.id] = w;
    next_worker = std::max(next_worker, w.id + 1);
  }
  // A restarted scheduler gives every host a full timeout to report again before counting it
  // lost: its agent kept running while the scheduler was down.
  const int64_t now = now_ms();
  for (const auto& row : db.query("SELECT name, doc FROM hosts")) {
    const json doc = json::parse(row[1].text);
    Host host;
    host.name = row[0].text;
    host.cores = doc.value("cores", 0);
    host.capacity = doc.value("capacity", 0);
    host.alive = doc.value("alive", true);
    host.agent_pid = doc.value("agent_pid", int64_t{0});
    host.last_seen = now;
    hosts[host.name] = host;
  }
  for (const auto& row : db.query("SELECT value FROM meta WHERE key = 'alive_ms'")) {
    const int64_t alive = row[0].integer;
    if (now - alive > kOutageMs) {
      db.exec("INSERT INTO outages (from_ms, to_ms) VALUES (?, ?)", {alive, now});
      event(0, "outage",
            "no scheduler ran for " + std::to_string((now - alive) / 1000) +
                " s (no decisions were taken; the jobs trained on)");
    }
  }
  alive(now);
  int running = 0;
  for (const auto& [id, w] : workers) running += w.state != "exited" ? 1 : 0;
  event(0, "scheduler",
        "scheduler started: " + std::to_string(jobs.size()) + " jobs, " +
            std::to_string(running) + " live workers, " + std::to_string(hosts.size()) +
            " hosts in " + options.state_dir + "/queue.db");
  flush();
}

// Note [Outages]
void Scheduler::Impl::alive(int64_t now) {
  if (now - alive_ms < 1000) return;
  alive_ms = now;
  db.exec("INSERT OR REPLACE INTO meta (key, value) VALUES ('alive_ms', ?)", {now});
}

void Scheduler::Impl::event(int64_t job, std::string kind, std::string message) {
  pending_events.push_back({now_ms(), job, std::move(kind), std::move(message)});
}

// Writes what changed since the last flush, and the new events, in one transaction.
void Scheduler::Impl::flush() {
  if (dirty_jobs.empty() && dirty_workers.empty() && dirty_hosts.empty() &&
      pending_events.empty()) {
    return;
  }
  db.transaction([&] {
    for (int64_t id : dirty_jobs) {
      const Job& job = jobs.at(id);
      db.exec("INSERT OR REPLACE INTO jobs (id, state, priority, doc) VALUES (?, ?, ?, ?)",
              {id, job.state, job.spec.priority, job_doc(job).dump()});
    }
    for (int64_t id : dirty_workers) {
      const Worker& w = workers.at(id);
      db.exec("INSERT OR REPLACE INTO workers (id, job, host, state, doc) VALUES (?, ?, ?, ?, ?)",
              {id, w.job, w.host, w.state, worker_doc(w).dump()});
    }
    for (const auto& name : dirty_hosts) {
      const Host& host = hosts.at(name);
      db.exec("INSERT OR REPLACE INTO hosts (name, doc) VALUES (?, ?)",
              {name, json{{"cores", host.cores},
                          {"capacity", host.capacity},
                          {"alive", host.alive},
                          {"agent_pid", host.agent_pid}}
                         .dump()});
    }
    for (const auto& e : pending_events) {
      db.exec("INSERT INTO events (time_ms, job, kind, message) VALUES (?, ?, ?, ?)",
              {e.time_ms, e.job, e.kind, e.message});
    }
  });
  dirty_jobs.clear();
  dirty_workers.clear();
  dirty_hosts.clear();
  pending_events.clear();
}

}  // namespace shoal::queue
