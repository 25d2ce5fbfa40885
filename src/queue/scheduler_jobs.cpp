// The scheduler's state machine: a job's submission, its start, its workers' exits and failures
// (with the back-off of their replacements), its resizes (by leave or by restart), preemptions and
// cancellation, and the round that asks the policy (policy.h) what to do next and carries it out.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "access.h"
#include "core/token.h"
#include "proc/worker_env.h"
#include "scheduler_impl.h"
#include "shoal/core/error.h"

namespace shoal::queue {

int64_t Scheduler::submit(const Submission& spec) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& db = impl_->db;
  Impl::Job job;
  job.spec = spec;
  job.submitted_ms = Impl::now_ms();
  job.token = make_token();
  job.reason = "submitted";
  // The id comes from the table itself, so that it is never reused, even after a crash.
  int64_t id = 0;
  db.transaction([&] {
    db.exec("INSERT INTO jobs (state, priority, doc) VALUES ('waiting', ?, '{}')", {spec.priority});
    id = db.last_insert_id();
    job.id = id;
    job.run_id = "q" + std::to_string(id) + "-" + random_hex(8);
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

// --- workers -------------------------------------------------------------------------------------

std::vector<Scheduler::Impl::Worker*> Scheduler::Impl::live_workers(int64_t job) {
  std::vector<Worker*> out;
  for (auto& [id, w] : workers) {
    if (w.job == job && w.state != "exited") out.push_back(&w);
  }
  return out;
}

void Scheduler::Impl::add_workers(Job& job, const std::vector<std::string>& on, int64_t now) {
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

void Scheduler::Impl::stop_all(Job& job) {
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
void Scheduler::Impl::withdraw(Worker& w, int64_t now) {
  if (w.ordered || w.state != "starting") return;
  w.state = "exited";
  w.exit = "withdrawn before its agent started it";
  w.success = true;
  w.ended_ms = now;
  dirty_workers.insert(w.id);
  dirty_jobs.insert(w.job);
  event(w.job, "left", "worker " + std::to_string(w.id) + " on " + w.host + " " + w.exit);
}

void Scheduler::Impl::fail(Job& job, const std::string& reason, int64_t now) {
  job.state = "failed";
  job.reason = reason;
  job.ended_ms = now;
  stop_all(job);
  dirty_jobs.insert(job.id);
  event(job.id, "failed", "job " + std::to_string(job.id) + " failed: " + reason);
}

void Scheduler::Impl::on_exit(Worker& w, const std::string& how, bool success, int64_t now) {
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
  const int64_t wait = proc::restart_backoff(job.failures - 1).count();
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
void Scheduler::Impl::restart_at(Job& job, std::vector<std::string> hosts) {
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
void Scheduler::Impl::restart_when_gone(int64_t now) {
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

// --- the policy round ----------------------------------------------------------------------------

void Scheduler::Impl::check_jobs(int64_t now) {
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

Snapshot Scheduler::Impl::snapshot(int64_t now) {
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
    view.resizes = job.resizes + job.preemptions;
    job.model_into(view);
    snap.jobs.push_back(std::move(view));
  }
  return snap;
}

void Scheduler::Impl::apply(const Action& action, int64_t now) {
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

void Scheduler::Impl::tick() {
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

}  // namespace shoal::queue
