#include "agent.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "elastic/membership.h"
#include "core/token.h"
#include "engine.h"
#include "heartbeat.h"
#include "http.h"
#include "local/engine.h"
#include "proc/worker_env.h"
#include "shoal/comm/address.h"
#include "shoal/core/error.h"
#include "slurm/engine.h"
#include "core/log.h"

namespace shoal::queue {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kBeat = std::chrono::milliseconds(500);
constexpr auto kWatch = std::chrono::milliseconds(50);
// What the agent tells a job's workers and its other agents (Note [An elastic job's settings in its
// agents' metadata]) of how long a round waits for late joiners.
constexpr Duration kLastCall{1000};
// A worker asked to leave leaves at its next commit; one that has not after this long is killed.
constexpr auto kLeaveGrace = std::chrono::seconds(120);
// A worker to be stopped (its job cancelled, failed or requeued) gets SIGTERM, then SIGKILL.
constexpr auto kStopGrace = std::chrono::seconds(10);

volatile sig_atomic_t g_stop = 0;
void on_agent_stop_signal(int) {
  g_stop = 1;
}

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Worker {
  int64_t id = 0;
  int64_t job = 0;
  int64_t pid = 0;  // 0 until its program runs (a Slurm job may wait in Slurm's queue first)
  bool running = true;
  int64_t started_ms = 0;
  std::optional<Clock::time_point> kill_at;  // SIGTERM sent; SIGKILL then
  bool leave_sent = false;
  std::string leave_note;  // SHOAL_LEAVE_NOTE: written when the program leaves on a SIGTERM
  std::string progress;    // SHOAL_PROGRESS_FILE: the job's progress, from its first worker
  std::string exit;
  bool success = false;
};

struct JobMember {
  std::unique_ptr<elastic::GossipAgent> gossip;
  std::string token_file;
};

class Agent {
 public:
  Agent(AgentOptions options, std::unique_ptr<Engine> engine)
      : options_(std::move(options)),
        engine_(std::move(engine)),
        capacity_(engine_->capacity()),
        client_(options_.queue_address, options_.token, options_.ca_file) {
    // Where the scheduler nudges this agent to beat at once (Note [Nudges] in server.cpp); without
    // it the agent only beats on its own cadence.
    nudge_fd_ = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    // It listens on the address the scheduler's datagrams come to (the route towards it), not
    // on every interface of the host (docs/queue.md, "Security").
    sockaddr_in any{};
    any.sin_family = AF_INET;
    ::inet_pton(AF_INET, address_towards_queue().c_str(), &any.sin_addr);
    socklen_t length = sizeof(any);
    if (nudge_fd_ >= 0 && ::bind(nudge_fd_, reinterpret_cast<sockaddr*>(&any), sizeof(any)) == 0 &&
        ::getsockname(nudge_fd_, reinterpret_cast<sockaddr*>(&any), &length) == 0) {
      nudge_port_ = ntohs(any.sin_port);
    }
  }
  ~Agent() {
    if (nudge_fd_ >= 0) ::close(nudge_fd_);
  }

  int run() {
    struct sigaction action {};
    action.sa_handler = on_agent_stop_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGTERM, &action, nullptr);
    ::sigaction(SIGINT, &action, nullptr);
    log::info(
        log::line("shoal agent: host ", options_.host, " reports to ", options_.queue_address));
    // Between beats the agent looks at its workers every kWatch: a worker that started or ended
    // is reported at once, so that the scheduler's answer (a waiting job's start, a
    // replacement) comes without waiting out the rest of the beat.
    // A nudge makes it beat at once too, but not more often than every kWatch, whoever sends them.
    auto next = Clock::now();
    auto last = Clock::now() - kBeat;
    bool nudged = false;
    while (g_stop == 0) {
      const bool changed = reap();
      const auto now = Clock::now();
      if (changed || now >= next || (nudged && now - last >= kWatch)) {
        next = now + kBeat;
        last = now;
        nudged = false;
        beat();
        escalate();
      }
      if (nudged) {
        std::this_thread::sleep_until(last + kWatch);
      } else {
        nudged = wait_for_nudge(kWatch);
      }
    }
    stop_everything();
    return 0;
  }

 private:
  // Waits up to `timeout` for a nudge (and takes every datagram waiting); whether one came.
  bool wait_for_nudge(std::chrono::milliseconds timeout) {
    if (nudge_fd_ < 0) {
      std::this_thread::sleep_for(timeout);
      return false;
    }
    pollfd ready{nudge_fd_, POLLIN, 0};
    if (::poll(&ready, 1, static_cast<int>(timeout.count())) <= 0) return false;
    char byte;
    bool any = false;
    while (::recv(nudge_fd_, &byte, sizeof(byte), 0) >= 0) any = true;
    return any;
  }

  // Whether any worker started or ended.
  bool reap() {
    bool changed = false;
    for (const auto& change : engine_->poll()) {
      auto it = workers_.find(change.worker);
      if (it == workers_.end() || !it->second.running) continue;
      Worker& worker = it->second;
      if (worker.pid == 0 && change.pid > 0) {
        worker.pid = change.pid;
        worker.started_ms = wall_ms();
        changed = true;
      }
      if (!change.ended) continue;
      changed = true;
      worker.running = false;
      worker.exit = change.exit;
      worker.success = change.success;
      // Note [An agent that stops]: an exit 0 is the end of the training only when nobody asked
      // the worker to leave (Note [A leave is not the end], src/elastic/notes.cpp).
      const bool ordered = worker.leave_sent || worker.kill_at.has_value();
      const bool left = change.success && ::access(worker.leave_note.c_str(), F_OK) == 0;
      if (!ordered && stopping_ && (left || !change.success)) {
        worker.success = false;
        worker.exit = std::string(left ? "left" : "ended") +
                      " when its agent was stopped (SIGTERM to the agent): " + change.exit;
      } else if (!ordered && left) {
        worker.success = false;
        worker.exit = "left the job after a SIGTERM that its agent did not send: " + change.exit;
      }
      ::unlink(worker.leave_note.c_str());
      ::unlink(worker.progress.c_str());
      worker.kill_at.reset();
    }
    return changed;
  }

  HeartbeatReport report() const {
    HeartbeatReport out;
    out.host = options_.host;
    out.cores = capacity_.cores;
    out.slots = options_.slots > 0 ? options_.slots : capacity_.slots;
    out.pid = static_cast<int64_t>(::getpid());
    out.nudge_port = nudge_port_;
    for (const auto& [id, w] : workers_) {
      // One still waiting to start (in Slurm's queue) stays "starting" in the scheduler.
      if (w.running && w.pid == 0) continue;
      HeartbeatReport::Worker entry;
      entry.id = id;
      entry.job = w.job;
      entry.pid = w.pid;
      entry.running = w.running;
      entry.started_ms = w.started_ms;
      entry.exit = w.exit;
      entry.success = w.success;
      // The job's progress, if this worker writes it (the first one does: src/elastic/notes.h).
      if (w.running && !w.progress.empty()) entry.progress = read_progress(w.progress);
      out.workers.push_back(std::move(entry));
    }
    for (const auto& [job, member] : members_) out.members[job] = member.gossip->address();
    return out;
  }

  // A worker's progress file, or nullopt while it is absent, half written or not a progress: a
  // file the worker writes must not get the agent's whole heartbeat refused (Note [A heartbeat is
  // read whole], heartbeat.h).
  static std::optional<HeartbeatReport::Progress> read_progress(const std::string& path) {
    std::ifstream in(path);
    const json progress = json::parse(in, nullptr, false);
    if (!in || !progress.is_object()) return std::nullopt;
    try {
      return progress.get<HeartbeatReport::Progress>();
    } catch (const UsageError&) {
      return std::nullopt;
    }
  }

  void beat() {
    json orders;
    try {
      orders = client_.post("/agent/heartbeat", json(report()));
      if (unreachable_) log::info(log::line("shoal agent: the scheduler answers again"));
      unreachable_ = false;
    } catch (const Error& e) {
      // The workers train on while the scheduler is down (docs/queue.md, "Failures").
      if (!unreachable_) {
        log::warn(log::line("shoal agent: ", e.what(), "; the workers go on, retrying"));
      }
      unreachable_ = true;
      return;
    }
    for (const auto& id : orders.value("forget", json::array())) workers_.erase(id.get<int64_t>());
    std::set<int64_t> listed;
    std::map<int64_t, int> per_job;
    for (const auto& order : orders.value("workers", json::array())) {
      listed.insert(order.at("id").get<int64_t>());
      ++per_job[order.at("job").get<int64_t>()];
    }
    const json jobs = orders.value("jobs", json::object());
    for (const auto& order : orders.value("workers", json::array())) {
      const int64_t id = order.at("id");
      const int64_t job = order.at("job");
      auto it = workers_.find(id);
      if (it == workers_.end()) {
        if (started_.count(id) > 0 || order.value("stop", false) || order.value("leave", false))
          continue;
        start(id, job, jobs.at(std::to_string(job)), per_job[job]);
        continue;
      }
      Worker& w = it->second;
      if (!w.running) continue;
      if (order.value("stop", false) && !w.kill_at) {
        terminate(w, kStopGrace);
      } else if (order.value("leave", false) && !w.leave_sent) {
        w.leave_sent = true;
        terminate(w, kLeaveGrace);
      }
    }
    for (auto& [id, w] : workers_) {
      if (w.running && listed.count(id) == 0 && !w.kill_at) terminate(w, kStopGrace);
    }
    // A job's membership agent lives while the job has workers here, or is to.
    for (auto it = members_.begin(); it != members_.end();) {
      bool needed = per_job.count(it->first) > 0;
      for (const auto& [id, w] : workers_) needed = needed || (w.job == it->first && w.running);
      if (needed) {
        ++it;
        continue;
      }
      it->second.gossip.reset();  // leaves the job's membership
      ::unlink(it->second.token_file.c_str());
      it = members_.erase(it);
    }
  }

  JobMember& member(int64_t job, const json& spec) {
    auto it = members_.find(job);
    if (it != members_.end()) return it->second;
    JobMember member;
    const std::string token = spec.at("token");
    member.token_file = options_.dir + "/job-" + std::to_string(job) + ".token";
    ::unlink(member.token_file.c_str());
    write_token_file(member.token_file, token);
    elastic::GossipAgentOptions gossip;
    gossip.seeds = spec.value("seeds", std::vector<std::string>{});
    gossip.token = token;
    gossip.advertise_host = advertise_;
    gossip.bind_host = advertise_;  // the route the job's other hosts reach it by, not every one
    proc::ElasticPlace settings;
    settings.min_workers = spec.at("min");
    settings.max_workers = spec.at("max");
    settings.last_call = kLastCall;
    settings.run_id = spec.at("run_id");
    gossip.meta = proc::agent_metadata(settings);
    member.gossip = std::make_unique<elastic::GossipAgent>(gossip);
    return members_.emplace(job, std::move(member)).first->second;
  }

  void start(int64_t id, int64_t job, const json& spec, int local_workers) {
    started_.insert(id);
    Worker w;
    w.id = id;
    w.job = job;
    w.started_ms = wall_ms();
    std::string failure;
    try {
      if (advertise_.empty()) advertise_ = address_towards_queue();
      JobMember& m = member(job, spec);
      proc::ElasticPlace place;
      place.local_world_size = local_workers;
      place.min_workers = spec.at("min");
      place.max_workers = spec.at("max");
      place.seeds = m.gossip->address();
      place.token_file = m.token_file;
      place.last_call = kLastCall;
      place.rendezvous_timeout = std::chrono::seconds(600);
      place.run_id = spec.at("run_id");
      env::Environment base = spec.at("env").get<env::Environment>();
      base["SHOAL_QUEUE_JOB"] = std::to_string(job);
      base["SHOAL_QUEUE_WORKER"] = std::to_string(id);
      base["SHOAL_QUEUE_HOST"] = options_.host;
      const std::string log_dir = options_.dir + "/job-" + std::to_string(job);
      ::mkdir(log_dir.c_str(), 0755);
      w.leave_note = log_dir + "/worker-" + std::to_string(id) + ".left";
      ::unlink(w.leave_note.c_str());
      base["SHOAL_LEAVE_NOTE"] = w.leave_note;
      w.progress = log_dir + "/worker-" + std::to_string(id) + ".progress";
      ::unlink(w.progress.c_str());
      base["SHOAL_PROGRESS_FILE"] = w.progress;
      WorkerLaunch launch;
      launch.worker = id;
      launch.job = job;
      launch.priority = spec.value("priority", 0);
      launch.env = proc::to_envp(proc::elastic_worker_environment(base, place));
      launch.argv = spec.at("argv").get<std::vector<std::string>>();
      launch.cwd = spec.value("cwd", std::string("/"));
      launch.user = job_user(spec.value("run_as", std::string()));
      if (launch.user) {
        // The worker writes its leave note beside its log, and reads the job's token.
        ::chmod(log_dir.c_str(), 0700);
        for (const std::string& path : {log_dir, m.token_file}) {
          if (::chown(path.c_str(), launch.user->uid, launch.user->gid) != 0) {
            throw Error("cannot give " + path + " to user " + launch.user->name + ": " +
                        std::strerror(errno));
          }
        }
      }
      launch.log = log_dir + "/worker-" + std::to_string(id) + ".log";
      w.pid = engine_->start(launch);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (!failure.empty()) {
      w.running = false;
      w.pid = -1;
      w.exit = "could not start: " + failure;
      log::info(log::line("shoal agent: worker ", id, " of job ", job, " ", w.exit));
    }
    workers_[id] = w;
  }

  // The user a job's workers run as when it is not this agent's (docs/queue.md, "Security");
  // UsageError when this agent may not or cannot start them as `run_as`.
  std::optional<UnixUser> job_user(const std::string& run_as) const {
    if (run_as.empty()) return std::nullopt;  // a job of before users: as the agent's
    UnixUser user = unix_user(run_as);
    if (user.uid == 0 && !options_.allow_root_workers) {
      throw UsageError("this agent does not start workers as root (shoal agent "
                       "--allow-root-workers)");
    }
    if (user.uid == ::geteuid()) return std::nullopt;
    if (::geteuid() != 0) {
      throw UsageError("the agent runs as " + current_user() + " and cannot start workers as " +
                       user.name + "; run the agent as root, or the job as " + current_user());
    }
    return user;
  }

  void terminate(Worker& w, std::chrono::seconds grace) {
    engine_->signal(w.id, SIGTERM);
    w.kill_at = Clock::now() + grace;
  }

  void escalate() {
    const auto now = Clock::now();
    for (auto& [id, w] : workers_) {
      if (w.running && w.kill_at && now >= *w.kill_at) {
        engine_->signal(id, SIGKILL);
        w.kill_at = now + std::chrono::hours(1);
      }
    }
  }

  // Note [An agent that stops]
  // SIGTERM to an agent drains its host: its workers leave at their next commit (a job loses no
  // sample) and the agent's last heartbeat says it stops, so the scheduler counts the host lost
  // at once and replaces those workers elsewhere, each a failure of its job, as when a host is
  // lost. A worker that leaves because its agent stops exits 0 as one that finished does; the
  // agent reports it as the failure it is (docs/queue.md, "When a job is done").
  void stop_everything() {
    stopping_ = true;
    for (auto& [id, w] : workers_) {
      if (w.running) engine_->signal(id, SIGTERM);
    }
    const auto deadline = Clock::now() + kStopGrace;
    for (;;) {
      reap();
      bool any = false;
      for (const auto& [id, w] : workers_) any = any || w.running;
      if (!any) break;
      if (Clock::now() >= deadline) {
        for (auto& [id, w] : workers_) {
          if (w.running) engine_->signal(id, SIGKILL);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        reap();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (auto& [job, member] : members_) {
      member.gossip.reset();  // leaves the job's membership
      ::unlink(member.token_file.c_str());
    }
    members_.clear();
    // Tell the scheduler how they ended, if it listens.
    try {
      HeartbeatReport last = report();
      last.stopping = true;
      client_.post("/agent/heartbeat", json(last));
    } catch (const Error&) {
    }
  }

  // What the other hosts reach this one on: the address on the route to the scheduler.
  std::string address_towards_queue() const {
    return comm::local_address_towards(options_.queue_host, options_.queue_port);
  }

  AgentOptions options_;
  std::unique_ptr<Engine> engine_;
  Capacity capacity_;
  HttpClient client_;
  std::map<int64_t, Worker> workers_;
  std::set<int64_t> started_;
  std::map<int64_t, JobMember> members_;
  std::string advertise_;
  bool unreachable_ = false;
  bool stopping_ = false;  // SIGTERM or SIGINT came: the workers' ends are the agent's doing
  int nudge_fd_ = -1;
  int nudge_port_ = 0;
};

}  // namespace

int run_agent(const AgentOptions& options) {
  AgentOptions resolved = options;
  if (resolved.host.empty() && resolved.engine == "slurm") resolved.host = resolved.slurm_node;
  if (resolved.host.empty()) {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    resolved.host = name;
  }
  ::mkdir(resolved.dir.c_str(), 0755);
  std::unique_ptr<Engine> engine;
  if (resolved.engine == "slurm") {
    slurm::SlurmOptions slurm;
    slurm.node = resolved.slurm_node;
    slurm.partition = resolved.partition;
    slurm.dir = resolved.dir + "/slurm";
    engine = std::make_unique<slurm::SlurmEngine>(slurm);
  } else {
    engine = std::make_unique<local::LocalEngine>();
  }
  return Agent(std::move(resolved), std::move(engine)).run();
}

}  // namespace shoal::queue
