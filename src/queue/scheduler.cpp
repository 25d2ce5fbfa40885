#include "scheduler.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>

#include "../elastic/token.h"
#include "access.h"
#include "shoal/core/error.h"
#include "throughput.h"

namespace shoal::queue {

using nlohmann::json;

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

constexpr int64_t kNever = INT64_MIN / 2;
// The due time of a worker that starts once the job's workers of before are all gone.
constexpr int64_t kOnceGone = INT64_MAX / 2;
constexpr int kMaxPriority = 1000000;
// A gap longer than this since the scheduler was last alive is an outage (Note [Outages]).
constexpr int64_t kOutageMs = 3000;
// What one submission may hold (docs/queue.md, "Submitting"): every job is kept in the database
// and served to every client and dashboard refresh, so none may be large.
constexpr size_t kMaxName = 200;
constexpr size_t kMaxPath = 4096;
constexpr size_t kMaxArgvBytes = 128 * 1024;
constexpr size_t kMaxEnvBytes = 256 * 1024;

void check_size(const std::string& what, size_t size, size_t most, const std::string& unit) {
  if (size > most) {
    throw UsageError(what + " has " + std::to_string(size) + " " + unit + "; at most " +
                     std::to_string(most) + " are accepted");
  }
}

// A failed worker's replacement waits 1 s, then twice as long after each further failure of the
// job, up to 30 s (as `shoal run --max-restarts`).
int64_t backoff_ms(int failures) {
  return std::min<int64_t>(30000, int64_t{1000} << std::min(failures - 1, 5));
}

int int_field(const json& body, const char* name, int fallback, int low, int high) {
  if (!body.contains(name)) return fallback;
  const json& value = body.at(name);
  if (!value.is_number_integer()) {
    throw UsageError(std::string(name) + " must be an integer, not " + value.dump());
  }
  const int64_t number = value.get<int64_t>();
  if (number < low || number > high) {
    throw UsageError(std::string(name) + " must be between " + std::to_string(low) + " and " +
                     std::to_string(high) + ", not " + std::to_string(number));
  }
  return static_cast<int>(number);
}

}  // namespace

std::optional<int64_t> parse_integer(const std::string& text, int64_t low, int64_t high) {
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size() && value >= low && value <= high) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

JobSpec JobSpec::from_json(const json& body) {
  if (!body.is_object()) throw UsageError("a job must be a JSON object");
  JobSpec spec;
  if (!body.contains("argv") || !body.at("argv").is_array() || body.at("argv").empty()) {
    throw UsageError("argv must be a non-empty array: the program and its arguments");
  }
  size_t argv_bytes = 0;
  for (const auto& arg : body.at("argv")) {
    if (!arg.is_string()) throw UsageError("argv must hold strings, not " + arg.dump());
    spec.argv.push_back(arg.get<std::string>());
    argv_bytes += spec.argv.back().size() + 1;
  }
  check_size("argv", argv_bytes, kMaxArgvBytes, "bytes");
  const std::string& program = spec.argv[0];
  if (program.empty() || program[0] != '/') {
    throw UsageError("the program must be an absolute path, not '" + program + "'");
  }
  struct stat info {};
  if (::stat(program.c_str(), &info) != 0) {
    throw UsageError("program '" + program + "' does not exist");
  }
  if (S_ISDIR(info.st_mode) || ::access(program.c_str(), X_OK) != 0) {
    throw UsageError("program '" + program + "' is not an executable file");
  }
  if (body.contains("name") && !body.at("name").is_string())
    throw UsageError("name must be a string, not " + body.at("name").dump());
  spec.name = body.value("name", std::string());
  check_size("the name", spec.name.size(), kMaxName, "bytes");
  if (body.contains("cwd") && !body.at("cwd").is_string())
    throw UsageError("cwd must be a string, not " + body.at("cwd").dump());
  spec.cwd = body.value("cwd", std::string("/"));
  check_size("cwd", spec.cwd.size(), kMaxPath, "bytes");
  if (body.contains("env")) {
    if (!body.at("env").is_object()) throw UsageError("env must be an object of strings");
    size_t env_bytes = 0;
    for (const auto& [key, value] : body.at("env").items()) {
      if (!value.is_string()) throw UsageError("env." + key + " must be a string");
      spec.env[key] = value.get<std::string>();
      env_bytes += key.size() + spec.env[key].size() + 2;
    }
    check_size("env", env_bytes, kMaxEnvBytes, "bytes");
  }
  if (body.contains("priority") && !body.at("priority").is_number_integer()) {
    throw UsageError("--priority must be an integer (higher runs first), not " +
                     body.at("priority").dump());
  }
  spec.priority = int_field(body, "priority", 0, -kMaxPriority, kMaxPriority);
  spec.min_workers = int_field(body, "min", 1, 1, 4096);
  spec.max_workers = int_field(body, "max", spec.min_workers, 1, 4096);
  if (spec.min_workers > spec.max_workers) {
    throw UsageError("--min " + std::to_string(spec.min_workers) + " is above --max " +
                     std::to_string(spec.max_workers) + "; expected --min <= --max");
  }
  if (body.contains("preemptible") && !body.at("preemptible").is_boolean()) {
    throw UsageError("preemptible must be true or false");
  }
  spec.preemptible = body.value("preemptible", false);
  spec.max_restarts = int_field(body, "max_restarts", 3, 0, 1000);
  spec.owner = body.value("owner", std::string("admin"));
  spec.run_as = body.value("run_as", std::string());
  return spec;
}

json JobSpec::to_json() const {
  return json{{"name", name},
              {"argv", argv},
              {"cwd", cwd},
              {"env", env},
              {"priority", priority},
              {"min", min_workers},
              {"max", max_workers},
              {"preemptible", preemptible},
              {"max_restarts", max_restarts},
              {"owner", owner},
              {"run_as", run_as}};
}

struct Scheduler::Impl {
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
    JobSpec spec;
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

  explicit Impl(SchedulerOptions opts)
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

  // --- persistence -------------------------------------------------------------------------

  static json job_doc(const Job& job) {
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

  static Job job_from_doc(int64_t id, const json& doc) {
    Job job;
    job.id = id;
    job.spec = JobSpec::from_json(doc.at("spec"));
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

  static json worker_doc(const Worker& w) {
    return json{{"pid", w.pid},           {"leave", w.leave},
                {"kill", w.kill},         {"started_ms", w.started_ms},
                {"ended_ms", w.ended_ms}, {"exit", w.exit},
                {"success", w.success},   {"ordered", w.ordered}};
  }

  void load() {
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
  void alive(int64_t now) {
    if (now - alive_ms < 1000) return;
    alive_ms = now;
    db.exec("INSERT OR REPLACE INTO meta (key, value) VALUES ('alive_ms', ?)", {now});
  }

  void event(int64_t job, std::string kind, std::string message) {
    pending_events.push_back({now_ms(), job, std::move(kind), std::move(message)});
  }

  // Writes what changed since the last flush, and the new events, in one transaction.
  void flush() {
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

  // --- workers ---------------------------------------------------------------------------------

  std::vector<Worker*> live_workers(int64_t job) {
    std::vector<Worker*> out;
    for (auto& [id, w] : workers) {
      if (w.job == job && w.state != "exited") out.push_back(&w);
    }
    return out;
  }

  void add_workers(Job& job, const std::vector<std::string>& on, int64_t now) {
    for (const auto& host : on) {
      Worker w;
      w.id = next_worker++;
      w.job = job.id;
      w.host = host;
      workers[w.id] = w;
      dirty_workers.insert(w.id);
      news.insert(host);
    }
    (void)now;
  }

  void stop_all(Job& job) {
    for (Worker* w : live_workers(job.id)) {
      if (!w->kill) {
        w->kill = true;
        dirty_workers.insert(w->id);
        news.insert(w->host);
        withdraw(*w, now_ms());
      }
    }
    job.restarting.clear();
  }

  // A worker asked to leave or stop before any order told its agent to run it never runs: it
  // ends now, rather than hold its slot (and a job resized by restart) for an exit that its agent
  // will never report.
  void withdraw(Worker& w, int64_t now) {
    if (w.ordered || w.state != "starting") return;
    w.state = "exited";
    w.exit = "withdrawn before its agent started it";
    w.success = true;
    w.ended_ms = now;
    dirty_workers.insert(w.id);
    dirty_jobs.insert(w.job);
    event(w.job, "left", "worker " + std::to_string(w.id) + " on " + w.host + " " + w.exit);
  }

  void fail(Job& job, const std::string& reason, int64_t now) {
    job.state = "failed";
    job.reason = reason;
    job.ended_ms = now;
    stop_all(job);
    dirty_jobs.insert(job.id);
    event(job.id, "failed", "job " + std::to_string(job.id) + " failed: " + reason);
  }

  void on_exit(Worker& w, const std::string& how, bool success, int64_t now) {
    w.state = "exited";
    w.exit = how;
    w.success = success;
    w.ended_ms = now;
    dirty_workers.insert(w.id);
    Job& job = jobs.at(w.job);
    dirty_jobs.insert(job.id);
    const std::string who = "worker " + std::to_string(w.id) + " on " + w.host;
    if (w.leave || w.kill) {
      event(job.id, "left", who + (w.leave && success ? " left at a commit" : " stopped: " + how));
      return;
    }
    if (job.state == "running" && success) {
      job.state = "done";
      job.done_at = now;
      job.reason = "training finished (" + who + " exited with code 0)";
      job.restarting.clear();
      event(job.id, "done", "job " + std::to_string(job.id) + ": " + job.reason);
      return;
    }
    if (job.state != "running") {
      event(job.id, "ended", who + " " + how);
      return;
    }
    ++job.failures;
    if (job.failures > job.spec.max_restarts) {
      fail(job,
           who + " " + how + "; " + std::to_string(job.failures) +
               " failures, more than --max-restarts " + std::to_string(job.spec.max_restarts),
           now);
      return;
    }
    const int64_t wait = backoff_ms(job.failures);
    job.restarting.push_back({w.host, now + wait, false});
    event(job.id, "failed-worker",
          who + " " + how + "; a replacement starts in " + std::to_string(wait / 1000) +
              " s (failure " + std::to_string(job.failures) + " of at most " +
              std::to_string(job.spec.max_restarts) + " restarts)");
  }

  // Note [Resizing by restart]
  // With --resize-by restart, the policy's decisions are the same as with leave (policy.cpp is
  // shared with bench/queue_sim, whose ckpt-restart contender makes the same choice), but a
  // shrink or a grow of a running job is carried out as Kubeflow's elastic PyTorchJob and Ray
  // Train do it: every worker of the job is asked to leave, as in a preemption; those that go
  // last go together at one commit, which the first of them writes as the job's durable commit
  // (src/elastic/state.cpp), and once they are all gone the job starts again with its new count
  // of workers, which resume from that commit. Meanwhile the slots of the new generation stay
  // held as a failed worker's are (as `restarting` entries due kOnceGone), so no other job takes
  // them: the job holds its slots and makes no progress for the length of the restart, which is
  // what bench/queue_sim's model of ckpt-restart charges. The policy sees such a job as one with
  // no active worker and its slots taken: it neither shrinks nor preempts it until it runs
  // again. The workers that leave for the job that caused a shrink free their slots as with
  // leave.
  void restart_at(Job& job, std::vector<std::string> hosts) {
    for (Worker* w : live_workers(job.id)) {
      if (w->leave || w->kill) continue;
      hosts.push_back(w->host);
      w->leave = true;
      dirty_workers.insert(w->id);
      news.insert(w->host);
      withdraw(*w, now_ms());
    }
    // A failed worker's replacement becomes a worker of the next generation too.
    for (auto& r : job.restarting) {
      r.due_ms = kOnceGone;
      r.resize = true;
    }
    for (const auto& host : hosts) job.restarting.push_back({host, kOnceGone, true});
  }

  // A job resized by restart whose workers of before have all left starts again now.
  void restart_when_gone(int64_t now) {
    for (auto& [id, job] : jobs) {
      if (job.state != "running") continue;
      const bool pending = std::any_of(job.restarting.begin(), job.restarting.end(),
                                       [](const Restart& r) { return r.due_ms == kOnceGone; });
      if (!pending || !live_workers(id).empty()) continue;
      for (auto& r : job.restarting) {
        if (r.due_ms == kOnceGone) r.due_ms = now;
      }
      dirty_jobs.insert(id);
    }
  }

  // --- the policy round ------------------------------------------------------------------------

  void check_hosts(int64_t now) {
    for (auto& [name, host] : hosts) {
      if (!host.alive || now - host.last_seen <= options.host_timeout * 1000) continue;
      host.alive = false;
      dirty_hosts.insert(name);
      event(0, "host-lost",
            "host " + name + " lost: no heartbeat for " +
                std::to_string(static_cast<int>(options.host_timeout)) + " s");
      for (auto& [id, w] : workers) {
        if (w.host == name && w.state != "exited")
          on_exit(w, "was lost with host " + name, false, now);
      }
    }
  }

  void check_jobs(int64_t now) {
    for (auto& [id, job] : jobs) {
      auto live = live_workers(id);
      if (job.state == "done" && !live.empty() && now - job.done_at > options.done_grace * 1000) {
        for (Worker* w : live) {
          if (!w->kill) {
            w->kill = true;
            dirty_workers.insert(w->id);
            news.insert(w->host);
            event(id, "stop",
                  "worker " + std::to_string(w->id) + " still runs " +
                      std::to_string(static_cast<int>(options.done_grace)) +
                      " s after the job finished; stopping it");
          }
        }
      }
      if ((job.state == "done" || job.state == "cancelled" || job.state == "failed") &&
          live.empty() && job.ended_ms == 0) {
        job.ended_ms = now;
        dirty_jobs.insert(id);
      }
      if (job.state != "running") continue;
      int active = static_cast<int>(job.restarting.size());
      for (Worker* w : live) active += w->leave ? 0 : 1;
      if (active >= job.spec.min_workers) {
        if (job.below_min_since != 0) {
          job.below_min_since = 0;
          dirty_jobs.insert(id);
        }
        continue;
      }
      if (job.below_min_since == 0) {
        job.below_min_since = now;
        dirty_jobs.insert(id);
      } else if (now - job.below_min_since > options.below_min_grace * 1000) {
        stop_all(job);
        job.state = "waiting";
        job.below_min_since = 0;
        job.reason = "ran below --min " + std::to_string(job.spec.min_workers) + " for " +
                     std::to_string(static_cast<int>(options.below_min_grace)) +
                     " s; back to waiting";
        dirty_jobs.insert(id);
        event(id, "requeue", "job " + std::to_string(id) + " " + job.reason);
      }
    }
  }

  Snapshot snapshot(int64_t now) {
    Snapshot snap;
    snap.now = static_cast<double>(now) / 1000;
    snap.idle_since = idle_since;
    std::map<std::string, int> held;
    for (const auto& [id, w] : workers) {
      if (w.state == "exited") continue;
      const std::string& state = jobs.at(w.job).state;
      if (state != "waiting" && state != "running") ++held[w.host];
    }
    for (const auto& [name, host] : hosts) {
      snap.hosts.push_back({name, host.capacity, host.alive, held[name]});
    }
    for (const auto& [id, job] : jobs) {
      if (job.state != "waiting" && job.state != "running") continue;
      JobView view;
      view.id = id;
      view.priority = job.spec.priority;
      view.min_workers = job.spec.min_workers;
      view.max_workers = job.spec.max_workers;
      view.preemptible = job.spec.preemptible;
      view.submitted = static_cast<double>(job.submitted_ms) / 1000;
      view.running = job.state == "running";
      for (const auto& [wid, w] : workers) {
        if (w.job == id && w.state != "exited")
          view.workers.push_back({wid, w.host, w.leave || w.kill});
      }
      auto restarting = job.restarting;
      std::stable_sort(restarting.begin(), restarting.end(),
                       [](const Restart& a, const Restart& b) { return a.due_ms < b.due_ms; });
      for (const auto& r : restarting) {
        view.restarting.push_back(r.host);
        view.restarts_due += r.due_ms <= now ? 1 : 0;
      }
      view.last_resize = job.last_resize_ms == kNever
                             ? -std::numeric_limits<double>::infinity()
                             : static_cast<double>(job.last_resize_ms) / 1000;
      snap.jobs.push_back(std::move(view));
    }
    return snap;
  }

  void apply(const Action& action, int64_t now) {
    Job& job = jobs.at(action.job);
    dirty_jobs.insert(job.id);
    const std::string name = "job " + std::to_string(job.id);
    std::string kind = to_string(action.kind);
    std::string reason = action.reason;
    if (options.resize_by == ResizeBy::kRestart &&
        (action.kind == Action::kGrow || action.kind == Action::kShrink)) {
      reason += " (--resize-by restart: all its workers leave at a commit and it starts again)";
    }
    switch (action.kind) {
      case Action::kStart:
        job.state = "running";
        if (job.started_ms == 0) job.started_ms = now;
        if (job.preemptions > 0 && job.owed) {
          ++job.cycles;
          job.owed = false;
        }
        // A start is no resize: a job that took idle capacity a moment ago still gives its
        // surplus to a higher-priority arrival at once (the cooldown is between resizes).
        job.below_min_since = 0;
        job.failures = 0;
        job.members.clear();
        job.origin = action.hosts.front();
        add_workers(job, action.hosts, now);
        break;
      case Action::kGrow:
        ++job.resizes;
        if (job.owed) {
          ++job.cycles;
          job.owed = false;
        }
        job.last_resize_ms = now;
        if (options.resize_by == ResizeBy::kRestart) {
          restart_at(job, action.hosts);
        } else {
          add_workers(job, action.hosts, now);
        }
        break;
      case Action::kReplace: {
        std::stable_sort(job.restarting.begin(), job.restarting.end(),
                         [](const Restart& a, const Restart& b) { return a.due_ms < b.due_ms; });
        const size_t count = std::min(job.restarting.size(), action.hosts.size());
        bool generation = false;
        for (size_t i = 0; i < count; ++i) generation = generation || job.restarting[i].resize;
        job.restarting.erase(job.restarting.begin(), job.restarting.begin() + count);
        if (generation) {
          // A new generation forms its membership afresh, as after a start (Note [Resizing by
          // restart]).
          job.members.clear();
          job.origin = action.hosts.front();
          kind = "restart";
          reason = "starts again with " + std::to_string(action.hosts.size()) +
                   " workers from its last commit (--resize-by restart)";
        }
        add_workers(job, action.hosts, now);
        break;
      }
      case Action::kShrink:
      case Action::kPreempt:
        for (int64_t id : action.workers) {
          workers.at(id).leave = true;
          dirty_workers.insert(id);
          news.insert(workers.at(id).host);
          withdraw(workers.at(id), now);
        }
        job.last_resize_ms = now;
        job.owed = true;
        if (action.kind == Action::kShrink) {
          ++job.resizes;
          if (options.resize_by == ResizeBy::kRestart) restart_at(job, {});
        } else {
          ++job.preemptions;
          job.state = "waiting";
          job.restarting.clear();
        }
        break;
    }
    job.reason = reason;
    std::string where;
    if (!action.hosts.empty()) {
      std::map<std::string, int> count;
      for (const auto& host : action.hosts) ++count[host];
      for (const auto& [host, n] : count) {
        where += (where.empty() ? " on " : ", ") + host + (n > 1 ? " x" + std::to_string(n) : "");
      }
    }
    if (!action.workers.empty()) {
      where += " (workers";
      for (int64_t id : action.workers) where += " " + std::to_string(id);
      where += ")";
    }
    event(job.id, kind, name + " " + reason + where);
  }

  void tick() {
    const int64_t now = now_ms();
    alive(now);
    check_hosts(now);
    check_jobs(now);
    restart_when_gone(now);
    const Plan plan = queue::plan(snapshot(now), options.policy);
    for (const auto& action : plan.actions) apply(action, now);
    for (const auto& [id, why] : plan.waiting) {
      Job& job = jobs.at(id);
      if (job.reason == why) continue;
      job.reason = why;
      dirty_jobs.insert(id);
      event(id, "wait", "job " + std::to_string(id) + " " + why);
    }
    if (plan.free_after > 0) {
      if (std::isinf(idle_since)) idle_since = static_cast<double>(now) / 1000;
    } else {
      idle_since = std::numeric_limits<double>::infinity();
    }
    flush();
  }

  // --- views -------------------------------------------------------------------------------------

  json worker_json(const Worker& w) const {
    return json{{"id", w.id},
                {"job", w.job},
                {"host", w.host},
                {"state", w.state},
                {"pid", w.pid},
                {"leave", w.leave},
                {"stop", w.kill},
                {"started_ms", w.started_ms},
                {"ended_ms", w.ended_ms},
                {"exit", w.exit}};
  }

  json job_json(const Job& job, bool with_workers) const {
    json out{{"id", job.id},
             {"name", job.spec.name},
             {"argv", job.spec.argv},
             {"priority", job.spec.priority},
             {"min", job.spec.min_workers},
             {"max", job.spec.max_workers},
             {"preemptible", job.spec.preemptible},
             {"max_restarts", job.spec.max_restarts},
             {"owner", job.spec.owner},
             {"run_as", job.spec.run_as},
             {"state", job.state},
             {"reason", job.reason},
             {"submitted_ms", job.submitted_ms},
             {"started_ms", job.started_ms},
             {"ended_ms", job.ended_ms},
             {"failures", job.failures},
             {"resizes", job.resizes},
             {"preemptions", job.preemptions},
             {"cycles", job.cycles},
             {"restarting", static_cast<int>(job.restarting.size())},
             {"throughput", job.throughput.to_json()}};
    int live = 0;
    json list = json::array();
    for (const auto& [id, w] : workers) {
      if (w.job != job.id) continue;
      if (w.state != "exited") ++live;
      if (with_workers) list.push_back(worker_json(w));
    }
    out["workers"] = live;
    if (with_workers) out["worker_list"] = list;
    return out;
  }
};

Scheduler::Scheduler(SchedulerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

Scheduler::~Scheduler() = default;

int64_t Scheduler::submit(const JobSpec& spec) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& db = impl_->db;
  Impl::Job job;
  job.spec = spec;
  job.submitted_ms = now_ms();
  job.token = elastic::make_token();
  job.reason = "submitted";
  // The id comes from the table itself, so that it is never reused, even after a crash.
  int64_t id = 0;
  db.transaction([&] {
    db.exec("INSERT INTO jobs (state, priority, doc) VALUES ('waiting', ?, '{}')", {spec.priority});
    id = db.last_insert_id();
    job.id = id;
    job.run_id = "q" + std::to_string(id) + "-" + elastic::random_hex(8);
    // Durable commits by default: a preempted job resumes from its last one (docs/queue.md).
    const std::string dir = impl_->options.state_dir + "/jobs/" + std::to_string(id);
    ::mkdir((impl_->options.state_dir + "/jobs").c_str(), 0711);
    ::mkdir(dir.c_str(), 0700);
    // The job's workers write there as its user (docs/queue.md, "Security").
    if (!spec.run_as.empty()) {
      const UnixUser user = unix_user(spec.run_as);
      if (user.uid != ::geteuid() && ::chown(dir.c_str(), user.uid, user.gid) != 0) {
        throw Error("cannot give " + dir + " to user " + user.name + ": " + std::strerror(errno));
      }
    }
    if (job.spec.env.count("SHOAL_CHECKPOINT") == 0)
      job.spec.env["SHOAL_CHECKPOINT"] = dir + "/commit.ckpt";
    db.exec("UPDATE jobs SET doc = ? WHERE id = ?", {Impl::job_doc(job).dump(), id});
    db.exec("INSERT INTO events (time_ms, job, kind, message) VALUES (?, ?, 'submit', ?)",
            {job.submitted_ms, id,
             "job " + std::to_string(id) + " submitted: " + spec.argv[0] + ", priority " +
                 std::to_string(spec.priority) + ", --min " + std::to_string(spec.min_workers) +
                 " --max " + std::to_string(spec.max_workers) +
                 (spec.preemptible ? ", preemptible" : "")});
  });
  impl_->jobs[id] = std::move(job);
  return id;
}

void Scheduler::cancel(int64_t id) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->jobs.find(id);
  if (it == impl_->jobs.end()) throw UsageError("no job " + std::to_string(id));
  Impl::Job& job = it->second;
  if (job.state != "waiting" && job.state != "running") {
    throw UsageError("job " + std::to_string(id) + " has already ended (" + job.state + ")");
  }
  job.state = "cancelled";
  job.reason = "cancelled by the user";
  impl_->stop_all(job);
  impl_->dirty_jobs.insert(id);
  impl_->event(id, "cancel", "job " + std::to_string(id) + " cancelled");
  impl_->flush();
}

json Scheduler::jobs() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  json list = json::array();
  for (const auto& [id, job] : impl_->jobs) list.push_back(impl_->job_json(job, false));
  return json{{"jobs", list}};
}

json Scheduler::job(int64_t id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->jobs.find(id);
  if (it == impl_->jobs.end()) throw UsageError("no job " + std::to_string(id));
  json out = impl_->job_json(it->second, true);
  json events = json::array();
  for (const auto& row : impl_->db.query(
           "SELECT id, time_ms, kind, message FROM events WHERE job = ? ORDER BY id", {id})) {
    events.push_back({{"id", row[0].integer},
                      {"time_ms", row[1].integer},
                      {"kind", row[2].text},
                      {"message", row[3].text}});
  }
  out["events"] = events;
  return out;
}

json Scheduler::nodes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  json list = json::array();
  for (const auto& [name, host] : impl_->hosts) {
    json running = json::array();
    for (const auto& [id, w] : impl_->workers) {
      if (w.host == name && w.state != "exited")
        running.push_back({{"id", id}, {"job", w.job}, {"pid", w.pid}});
    }
    list.push_back({{"name", name},
                    {"cores", host.cores},
                    {"capacity", host.capacity},
                    {"alive", host.alive},
                    {"last_seen_ms", host.last_seen},
                    {"workers", running}});
  }
  return json{{"nodes", list}};
}

json Scheduler::events(int64_t since, int limit) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  json list = json::array();
  for (const auto& row : impl_->db.query(
           "SELECT id, time_ms, job, kind, message FROM events WHERE id > ? ORDER BY id LIMIT ?",
           {since, limit})) {
    list.push_back({{"id", row[0].integer},
                    {"time_ms", row[1].integer},
                    {"job", row[2].integer},
                    {"kind", row[3].text},
                    {"message", row[4].text}});
  }
  return json{{"events", list}};
}

json Scheduler::metrics() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  int resizes = 0, preemptions = 0, cycles = 0, failures = 0;
  std::map<std::string, int> states;
  for (const auto& [id, job] : impl_->jobs) {
    resizes += job.resizes;
    preemptions += job.preemptions;
    cycles += job.cycles;
    failures += job.failures;
    ++states[job.state];
  }
  int capacity = 0, used = 0;
  for (const auto& [name, host] : impl_->hosts) capacity += host.alive ? host.capacity : 0;
  for (const auto& [id, w] : impl_->workers) used += w.state != "exited" ? 1 : 0;
  json outages = json::array();
  for (const auto& row : impl_->db.query(
           "SELECT from_ms, to_ms FROM outages ORDER BY id DESC LIMIT 20")) {
    outages.push_back({{"from_ms", row[0].integer}, {"to_ms", row[1].integer}});
  }
  return json{{"jobs", states},
              {"outages", outages},
              {"resizes", resizes},
              {"preemptions", preemptions},
              {"preemption_cycles", cycles},
              {"failures", failures},
              {"capacity", capacity},
              {"workers", used}};
}

json Scheduler::heartbeat(const json& report) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Impl& s = *impl_;
  const int64_t now = now_ms();
  const std::string name = report.at("host").get<std::string>();
  if (name.empty()) throw UsageError("an agent's heartbeat must name its host");
  auto& host = s.hosts[name];
  const bool is_new = host.name.empty();
  host.name = name;
  host.last_seen = now;
  const int cores = report.value("cores", 1);
  const int slots = report.value("slots", 0);
  const int capacity =
      slots > 0 ? slots
                : std::max(1, static_cast<int>(std::floor(cores * s.options.oversubscribe + 1e-9)));
  const int64_t agent_pid = report.value("pid", int64_t{0});
  // An agent's last heartbeat as it stops (SIGTERM): its workers have left, each a failure
  // (Note [An agent that stops]), and the host is gone until an agent beats for it again.
  const bool stopping = report.value("stopping", false);
  if (!stopping && (is_new || !host.alive || host.cores != cores || host.capacity != capacity ||
                    host.agent_pid != agent_pid)) {
    if (is_new || !host.alive) {
      s.event(0, "host",
              "host " + name + " (agent pid " + std::to_string(agent_pid) + ") with " +
                  std::to_string(capacity) + " slots" + (is_new ? " joined" : " is back"));
    }
    host.alive = true;
    host.cores = cores;
    host.capacity = capacity;
    host.agent_pid = agent_pid;
    s.dirty_hosts.insert(name);
  }

  json forget = json::array();
  bool freed = false;
  for (const auto& entry : report.value("workers", json::array())) {
    const int64_t id = entry.at("id");
    auto it = s.workers.find(id);
    if (it == s.workers.end() || it->second.host != name) continue;  // not ours: the orders lack it
    Impl::Worker& w = it->second;
    if (entry.contains("progress")) {
      const json& p = entry.at("progress");
      if (s.jobs.at(w.job).throughput.add(p.value("time_ms", int64_t{0}),
                                          p.value("samples", int64_t{0}), p.value("world", 1))) {
        s.dirty_jobs.insert(w.job);
      }
    }
    if (entry.value("running", false)) {
      if (w.state == "starting") {
        w.state = "running";
        w.pid = entry.value("pid", int64_t{0});
        w.started_ms = entry.value("started_ms", now);
        s.dirty_workers.insert(id);
        s.event(w.job, "worker",
                "worker " + std::to_string(id) + " of job " + std::to_string(w.job) + " runs on " +
                    name + " (pid " + std::to_string(w.pid) + ")");
      }
      continue;
    }
    if (w.state != "exited") {
      if (w.pid == 0) w.pid = entry.value("pid", int64_t{0});
      s.on_exit(w, entry.value("exit", std::string("ended")), entry.value("success", false), now);
      freed = true;
    }
    forget.push_back(id);
  }
  if (stopping && host.alive) {
    host.alive = false;
    s.dirty_hosts.insert(name);
    s.event(0, "host-lost",
            "host " + name + " lost: its agent (pid " + std::to_string(agent_pid) + ") stopped");
    for (auto& [id, w] : s.workers) {
      if (w.host == name && w.state != "exited")
        s.on_exit(w, "was lost with host " + name + " (its agent stopped)", false, now);
    }
    freed = true;
  }
  // A worker that ended freed a slot: the policy runs now, so that what it decides (a waiting
  // job's start, a replacement) is in this very answer rather than in the host's next one.
  if (freed) s.tick();
  if (stopping) {
    s.flush();
    return json{{"workers", json::array()}, {"jobs", json::object()}, {"forget", forget}};
  }
  const json members = report.value("members", json::object());
  for (const auto& [job_id, address] : members.items()) {
    auto it = s.jobs.find(std::stoll(job_id));
    if (it == s.jobs.end()) continue;
    if (it->second.members[name] != address.get<std::string>()) {
      it->second.members[name] = address.get<std::string>();
      s.dirty_jobs.insert(it->first);
    }
  }

  // The orders: every live worker on this host. A job's membership forms on its origin host
  // first; another host's workers wait until an address to join through is known.
  json orders = json::array();
  json job_orders = json::object();
  for (auto& [id, w] : s.workers) {
    if (w.host != name || w.state == "exited") continue;
    Impl::Job& job = s.jobs.at(w.job);
    std::vector<std::string> seeds;
    for (const auto& [member_host, address] : job.members) {
      if (member_host != name && s.hosts.count(member_host) > 0 && s.hosts.at(member_host).alive) {
        seeds.push_back(address);
      }
    }
    const bool own_member = job.members.count(name) > 0;
    if (w.state == "starting" && seeds.empty() && !own_member && job.origin != name) {
      bool origin_alive = s.hosts.count(job.origin) > 0 && s.hosts.at(job.origin).alive;
      if (origin_alive) continue;
      job.origin = name;  // the first host lost before it formed the membership
      s.dirty_jobs.insert(job.id);
    }
    orders.push_back({{"id", id}, {"job", w.job}, {"leave", w.leave}, {"stop", w.kill}});
    if (!w.ordered && !w.leave && !w.kill) {
      w.ordered = true;
      s.dirty_workers.insert(id);
    }
    const std::string key = std::to_string(w.job);
    if (!job_orders.contains(key)) {
      job_orders[key] = {{"argv", job.spec.argv},
                         {"cwd", job.spec.cwd},
                         {"env", job.spec.env},
                         {"token", job.token},
                         {"run_id", job.run_id},
                         {"min", job.spec.min_workers},
                         {"max", job.spec.max_workers},
                         {"priority", job.spec.priority},
                         {"run_as", job.spec.run_as},
                         {"seeds", seeds}};
    }
  }
  s.flush();
  s.news.erase(name);  // this answer carries them
  return json{{"workers", orders}, {"jobs", job_orders}, {"forget", forget}};
}

void Scheduler::tick() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->tick();
}

std::set<std::string> Scheduler::take_news() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::set<std::string> out;
  out.swap(impl_->news);
  return out;
}

}  // namespace shoal::queue
