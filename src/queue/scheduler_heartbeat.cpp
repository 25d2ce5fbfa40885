// The agents' heartbeats (Note [Desired state] in scheduler.h): what each host runs and what
// ended there, answered with its orders; and hosts counted lost when their heartbeats stop.
#include <algorithm>
#include <cmath>

#include "scheduler_impl.h"
#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

void to_json(json& out, const Orders& orders) {
  json worker_orders = json::array();
  for (const auto& w : orders.workers) {
    worker_orders.push_back({{"id", w.id}, {"job", w.job}, {"leave", w.leave}, {"stop", w.stop}});
  }
  json job_orders = json::object();
  for (const auto& [id, job] : orders.jobs) {
    job_orders[std::to_string(id)] = {{"argv", job.argv},
                                      {"cwd", job.cwd},
                                      {"env", job.env},
                                      {"token", job.token},
                                      {"run_id", job.run_id},
                                      {"min", job.min_workers},
                                      {"max", job.max_workers},
                                      {"priority", job.priority},
                                      {"run_as", job.run_as},
                                      {"seeds", job.seeds}};
  }
  out = json{{"workers", worker_orders}, {"jobs", job_orders}, {"forget", orders.forget}};
}

Orders Scheduler::heartbeat(const HeartbeatReport& report) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Impl& s = *impl_;
  const int64_t now = Impl::now_ms();
  const std::string& name = report.host;
  if (name.empty()) throw UsageError("heartbeat: field 'host' is empty; expected the host's name");
  auto& host = s.hosts[name];
  const bool is_new = host.name.empty();
  host.name = name;
  host.last_seen = now;
  const int cores = report.cores;
  const int capacity =
      report.slots > 0
          ? report.slots
          : std::max(1, static_cast<int>(std::floor(cores * s.options.oversubscribe + 1e-9)));
  const int64_t agent_pid = report.pid;
  // An agent's last heartbeat as it stops (SIGTERM): its workers have left, each a failure
  // (Note [An agent that stops]), and the host is gone until an agent beats for it again.
  const bool stopping = report.stopping;
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

  Orders orders;
  bool freed = false;
  for (const HeartbeatReport::Worker& entry : report.workers) {
    const int64_t id = entry.id;
    auto it = s.workers.find(id);
    if (it == s.workers.end() || it->second.host != name) continue;  // not ours: the orders lack it
    Impl::Worker& w = it->second;
    if (entry.progress) {
      const HeartbeatReport::Progress& p = *entry.progress;
      auto& job = s.jobs.at(w.job);
      if (job.throughput.add(p.time_ms, p.samples, p.world)) s.dirty_jobs.insert(w.job);
      job.noise_scale = p.noise_scale;
      job.batch_per_worker = p.batch_per_worker;
      job.batch_limits = p.batch_limits;
      job.steps = p.steps;
    }
    if (entry.running) {
      if (w.state == "starting") {
        w.state = "running";
        w.pid = entry.pid;
        w.started_ms = entry.started_ms;
        s.dirty_workers.insert(id);
        s.event(w.job, "worker",
                "worker " + std::to_string(id) + " of job " + std::to_string(w.job) + " runs on " +
                    name + " (pid " + std::to_string(w.pid) + ")");
      }
      continue;
    }
    if (w.state != "exited") {
      if (w.pid == 0) w.pid = entry.pid;
      s.on_exit(w, entry.exit, entry.success, now);
      freed = true;
    }
    orders.forget.push_back(id);
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
    return orders;
  }
  for (const auto& [job_id, address] : report.members) {
    auto it = s.jobs.find(job_id);
    if (it == s.jobs.end()) continue;
    if (it->second.members[name] != address) {
      it->second.members[name] = address;
      s.dirty_jobs.insert(it->first);
    }
  }

  // The orders: every live worker on this host. A job's membership forms on its origin host
  // first; another host's workers wait until an address to join through is known.
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
    orders.workers.push_back({id, w.job, w.leave, w.kill});
    if (!w.ordered && !w.leave && !w.kill) {
      w.ordered = true;
      s.dirty_workers.insert(id);
    }
    if (orders.jobs.count(w.job) == 0) {
      Orders::Job& order = orders.jobs[w.job];
      order.argv = job.spec.argv;
      order.cwd = job.spec.cwd;
      order.env = job.spec.env;
      order.token = job.token;
      order.run_id = job.run_id;
      order.min_workers = job.spec.min_workers;
      order.max_workers = job.spec.max_workers;
      order.priority = job.spec.priority;
      order.run_as = job.spec.run_as;
      order.seeds = seeds;
    }
  }
  s.flush();
  s.news.erase(name);  // this answer carries them
  return orders;
}

// Each round of the policy (tick()) first counts lost the hosts whose agents have not beaten for
// --host-timeout, and their live workers with them, each a failure of its job.
void Scheduler::Impl::check_hosts(int64_t now) {
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

}  // namespace shoal::queue
