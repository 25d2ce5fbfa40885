#include "policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

namespace shoal::queue {

int JobView::active() const {
  int count = 0;
  for (const auto& worker : workers) count += worker.leaving ? 0 : 1;
  return count;
}

const char* to_string(Action::Kind kind) {
  switch (kind) {
    case Action::kStart:
      return "start";
    case Action::kGrow:
      return "grow";
    case Action::kReplace:
      return "replace";
    case Action::kShrink:
      return "shrink";
    case Action::kPreempt:
      return "preempt";
  }
  return "?";
}

namespace {

std::string plural(int count, const char* noun) {
  return std::to_string(count) + " " + noun + (count == 1 ? "" : "s");
}

std::string seconds(double value) {
  return std::to_string(static_cast<int64_t>(std::ceil(value))) + " s";
}

// Free slots per live host, and the choice of hosts for new workers.
//
// Note [Starting on leaving slots]: a worker asked to leave goes at its next commit, within a
// step or two, and its process then exits. A job that waits only for such slots starts at once
// on them rather than after the leavers are gone, so that its workers load their program while
// the leavers finish their last step: a host then runs up to its leaving workers' count above
// its slots, for about that long. Each leaving slot is claimed once: a host already running
// more workers than its slots has that many fewer to give.
class Room {
 public:
  explicit Room(const Snapshot& snapshot) {
    std::map<std::string, int> used;
    std::map<std::string, int> leaving;
    for (const auto& job : snapshot.jobs) {
      for (const auto& worker : job.workers) {
        ++used[worker.host];
        if (worker.leaving) ++leaving[worker.host];
      }
      for (const auto& host : job.restarting) ++used[host];
    }
    for (const auto& host : snapshot.hosts) {
      if (!host.alive) continue;
      alive_.insert(host.name);
      capacity_ += host.capacity;
      const int taken = used[host.name] + host.held;
      free_[host.name] = std::max(0, host.capacity - taken);
      total_ += free_[host.name];
      claimable_[host.name] = std::max(0, leaving[host.name] - std::max(0, taken - host.capacity));
      claimable_total_ += claimable_[host.name];
    }
  }

  // Slots of leaving workers that no new worker has claimed (Note [Starting on leaving slots]).
  int claimable() const { return claimable_total_; }
  // A worker this plan asks to leave: its slot is claimable from now on.
  void leaving(const std::string& host) {
    if (alive_.count(host) == 0) return;
    ++claimable_[host];
    ++claimable_total_;
  }
  // `count` claimable slots (fewer when short), most claimable hosts first.
  std::vector<std::string> claim(int count) {
    std::vector<std::string> hosts;
    while (static_cast<int>(hosts.size()) < count) {
      auto best = claimable_.end();
      for (auto it = claimable_.begin(); it != claimable_.end(); ++it) {
        if (it->second > 0 && (best == claimable_.end() || it->second > best->second)) best = it;
      }
      if (best == claimable_.end()) break;
      --best->second;
      --claimable_total_;
      hosts.push_back(best->first);
    }
    return hosts;
  }

  bool alive(const std::string& host) const { return alive_.count(host) > 0; }
  int capacity() const { return capacity_; }
  int total() const { return total_; }  // kept, not summed: plan() asks once per waiting job

  // `count` hosts (with repeats) for new workers of `job`: hosts where the job already runs, or
  // where this plan starts it (`starting`), first (its traffic stays on one host where it can),
  // then those with the most free slots. Takes the slots. Fewer than `count` when the room is
  // short.
  std::vector<std::string> take(const JobView& job, int count,
                                const std::vector<std::string>& starting = {}) {
    std::map<std::string, int> mine;
    for (const auto& worker : job.workers) ++mine[worker.host];
    for (const auto& host : starting) ++mine[host];
    std::vector<std::string> hosts;
    while (static_cast<int>(hosts.size()) < count) {
      const std::string* best = nullptr;
      for (const auto& [name, slots] : free_) {
        if (slots == 0) continue;
        if (best == nullptr) {
          best = &name;
          continue;
        }
        const auto key = [&](const std::string& host) {
          return std::make_pair(mine[host], free_[host]);
        };
        if (key(name) > key(*best)) best = &name;
      }
      if (best == nullptr) break;
      --free_[*best];
      --total_;
      ++mine[*best];
      hosts.push_back(*best);
    }
    return hosts;
  }

 private:
  std::set<std::string> alive_;
  std::map<std::string, int> free_;
  int total_ = 0;
  std::map<std::string, int> claimable_;
  int claimable_total_ = 0;
  int capacity_ = 0;
};

bool by_priority_then_age(const JobView* a, const JobView* b) {
  if (a->priority != b->priority) return a->priority > b->priority;
  if (a->submitted != b->submitted) return a->submitted < b->submitted;
  return a->id < b->id;
}

// What the last of `workers` adds to the job's speed-up (what its next adds, at workers + 1).
double gain_at(const JobView& job, int workers, const PolicyOptions& options) {
  return speedup(job, workers, options) - speedup(job, workers - 1, options);
}

// What the last of `workers` takes off 1 / the job's speed-up: its worth under Note [Giving
// workers where they speed training most] (infinite for a job's first).
double fair_gain_at(const JobView& job, int workers, const PolicyOptions& options) {
  const double before = speedup(job, workers - 1, options);
  if (!(before > 0)) return std::numeric_limits<double>::infinity();
  return 1.0 / before - 1.0 / speedup(job, workers, options);
}

// A job's workers not asked to leave yet, newest first: the newest leave first (the oldest hold
// the job's first ranks and its store).
std::vector<WorkerView> newest_first(const JobView& job) {
  std::vector<WorkerView> workers;
  for (const auto& worker : job.workers) {
    if (!worker.leaving) workers.push_back(worker);
  }
  std::sort(workers.begin(), workers.end(),
            [](const WorkerView& a, const WorkerView& b) { return a.id > b.id; });
  return workers;
}

// The head of a start's reason: "starts with 4 workers (--min 1, --max 8)".
std::string starts_with(const JobView& job, int count) {
  return "starts with " + plural(count, "worker") + " (--min " + std::to_string(job.min_workers) +
         ", --max " + std::to_string(job.max_workers) + ")";
}

std::string fixed(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", value);
  return text;
}

// Step 3 under kGoodput (Note [Giving workers where they speed training most]): `spare` slots,
// idle for `idle_for` seconds (< 0: not yet long enough), go one at a time to the eligible job
// whose speed-up gains most, higher priorities first, the jobs this plan starts (`starting`: the
// index of each one's start in `result`) among them, whose start then takes those too; with none
// left, one running job's last worker may be reclaimed for another's next.
template <typename Eligible, typename Floor, typename Discount, typename Weight>
void grow_by_gain(Plan& result, Room& room, const std::vector<const JobView*>& running,
                  const std::map<const JobView*, size_t>& starting, int& spare,
                  const Eligible& eligible, double idle_for, const Floor& fair_floor, int lowest,
                  const Discount& discount, const Weight& weight, const PolicyOptions& options) {
  std::map<int64_t, int> added;
  const auto size_of = [&](const JobView& job) {
    const auto it = starting.find(&job);
    return job.active() + static_cast<int>(job.restarting.size()) +
           (it == starting.end() ? 0 : static_cast<int>(result.actions[it->second].hosts.size()));
  };
  std::map<std::pair<int64_t, int>, double> speedups;  // (job, workers) -> speedup(), once each
  const auto speedup_of = [&](const JobView& job, int workers) {
    const auto [it, added_now] = speedups.try_emplace({job.id, workers}, 0.0);
    if (added_now) it->second = speedup(job, workers, options);
    return it->second;
  };
  // The 1..most more workers from `from` whose worth per worker (what they take off 1 / the
  // speed-up) is highest with the speed-up after them times `factor`; none (count 0) when no
  // count adds min_gain a worker. A job's first resize in a plan passes its discount (Note [What
  // a resize costs]); a free resize (factor 1) and every later worker go one at a time.
  struct Jump {
    int count = 0;
    double worth = 0;
  };
  const auto jump = [&](const JobView& job, int from, int most, double factor) {
    Jump best;
    const double before = speedup_of(job, from);
    for (int k = 1; k <= (factor < 1 ? most : std::min(most, 1)); ++k) {
      const double after = factor * speedup_of(job, from + k);
      if ((after - before) / k < options.min_gain) continue;
      const double worth = before > 0 ? weight(job) * (1.0 / before - 1.0 / after) / k
                                      : std::numeric_limits<double>::infinity();
      if (best.count == 0 || worth > best.worth) best = {k, worth};
    }
    return best;
  };
  if (idle_for >= 0) {
    std::vector<const JobView*> growing = running;
    for (const auto& [job, index] : starting) growing.push_back(job);
    std::sort(growing.begin(), growing.end(), by_priority_then_age);
    while (spare > 0) {
      const JobView* best = nullptr;
      double best_gain = 0;
      int best_count = 0;
      for (const JobView* job : growing) {
        const int target = size_of(*job) + added[job->id];
        if (!eligible(*job) || target >= job->max_workers) continue;
        const bool first = added[job->id] == 0;
        const Jump next = jump(*job, target, first ? std::min(spare, job->max_workers - target) : 1,
                               first ? discount(*job) : 1.0);
        if (next.count == 0) continue;
        if (best == nullptr || job->priority > best->priority ||
            (job->priority == best->priority && next.worth > best_gain)) {
          best = job;
          best_gain = next.worth;
          best_count = next.count;
        }
      }
      if (best == nullptr) break;
      added[best->id] += best_count;
      spare -= best_count;
    }
    for (const JobView* job : growing) {
      const int count = added[job->id];
      if (count == 0) continue;
      const int from = size_of(*job);
      if (const auto it = starting.find(job); it != starting.end()) {
        // Its start takes them: one rendezvous, not a start and a grow.
        Action& action = result.actions[it->second];
        const auto hosts = room.take(*job, count, action.hosts);
        action.hosts.insert(action.hosts.end(), hosts.begin(), hosts.end());
        const int to = from + static_cast<int>(hosts.size());
        action.reason = starts_with(*job, to) + ": " + std::to_string(hosts.size()) +
                        " beyond its first " + std::to_string(from) + " into capacity idle for " +
                        seconds(idle_for) + ", where a worker is worth most: its speed-up " +
                        fixed(speedup(*job, from, options)) + " -> " +
                        fixed(speedup(*job, to, options));
        continue;
      }
      Action action{Action::kGrow, job->id, room.take(*job, count), {}, ""};
      const int to = from + static_cast<int>(action.hosts.size());
      action.reason = "grows from " + std::to_string(from) + " to " + std::to_string(to) +
                      " workers into capacity idle for " + seconds(idle_for) + ": its speed-up " +
                      fixed(speedup(*job, from, options)) + " -> " + fixed(speedup(*job, to, options)) +
                      ", where a worker is worth most";
      if (discount(*job) < 1) {
        action.reason += " (worth its resize at " + fixed(discount(*job)) + " of that speed-up)";
      }
      result.actions.push_back(std::move(action));
    }
  }
  // Reclaim, not while capacity is free or a worker is on its way out (its slot is for the
  // receiver to take first). First for higher priorities: the workers of lower-priority jobs
  // above their --min, for each worker a job could still use (gaining at least min_gain; a higher
  // priority takes up to its --max, as on arrival).
  if (spare > 0 || room.claimable() > 0) return;
  std::map<int64_t, int> giving;
  for (const JobView* receiver : running) {
    if (!eligible(*receiver) || added[receiver->id] > 0) continue;
    int wanted = 0;
    for (int w = size_of(*receiver) + 1; w <= receiver->max_workers; ++w) {
      if (gain_at(*receiver, w, options) < options.min_gain) break;
      ++wanted;
    }
    for (auto it = running.rbegin(); it != running.rend() && wanted > 0; ++it) {
      const JobView* giver = *it;  // the lowest priority and youngest first
      if (giver->priority >= receiver->priority || !eligible(*giver) || added[giver->id] > 0) continue;
      const int count = std::min(wanted, giver->active() - giving[giver->id] - giver->min_workers);
      if (count <= 0) continue;
      const std::vector<WorkerView> candidates = newest_first(*giver);
      Action action{Action::kShrink, giver->id, {}, {}, ""};
      for (int i = 0; i < count; ++i) {
        const WorkerView& worker = candidates[giving[giver->id] + i];
        action.workers.push_back(worker.id);
        room.leaving(worker.host);
      }
      const int from = giver->active() - giving[giver->id];
      giving[giver->id] += count;
      wanted -= count;
      action.reason = "shrinks from " + std::to_string(from) + " to " + std::to_string(from - count) +
                      " workers for job " + std::to_string(receiver->id) + " (priority " +
                      std::to_string(receiver->priority) + "), whose speed-up gains at least " +
                      fixed(options.min_gain) + " a worker up to its --max";
      result.actions.push_back(std::move(action));
    }
  }
  if (!giving.empty()) return;
  // Then within the lowest priority running: workers move one by one, in this plan, from the job
  // whose last worker is worth least to the one whose next is worth most (fair_gain_at), while
  // that is at least twice as much, the receiver's speed-up gains at least min_gain from it, and
  // the giver stays above its fair floor and has a measured curve (at two worker counts: the
  // prior alone says nothing of a job's last worker). They return as idle capacity, which goes
  // to the receivers by the rule above.
  const auto measured = [](const JobView& job) {
    int counts = 0;
    for (const auto& [workers, rate] : job.throughput) counts += workers >= 1 && rate > 0 ? 1 : 0;
    return counts >= 2;
  };
  const auto peer = [&](const JobView& job) {
    return eligible(job) && added[job.id] == 0 && job.priority == lowest;
  };
  std::map<int64_t, int> gets, gives;
  std::map<int64_t, std::vector<const JobView*>> receivers;  // of each giver's workers
  for (int moves = 0; moves < room.capacity(); ++moves) {
    const JobView* to = nullptr;
    double worth_to = 0;
    for (const JobView* job : running) {
      const int target = size_of(*job) + gets[job->id];
      if (!peer(*job) || gives[job->id] > 0 || target >= job->max_workers) continue;
      // Its first worker pays for its resize alone.
      const Jump next = jump(*job, target, 1, gets[job->id] == 0 ? discount(*job) : 1.0);
      if (next.count == 0) continue;
      if (to == nullptr || next.worth > worth_to) {
        to = job;
        worth_to = next.worth;
      }
    }
    if (to == nullptr) break;
    const JobView* from = nullptr;
    double worth_from = 0;
    for (const JobView* job : running) {
      const int left = job->active() - gives[job->id];
      if (!peer(*job) || gets[job->id] > 0 || job == to || left <= fair_floor(*job) ||
          !measured(*job))
        continue;
      // What its last worker takes off 1 / its speed-up; its first one given is its resize.
      const double factor = gives[job->id] == 0 ? discount(*job) : 1.0;
      const double worth = weight(*job) * (1.0 / (factor * speedup_of(*job, left - 1)) -
                                           1.0 / speedup_of(*job, left));
      if (from == nullptr || worth < worth_from) {
        from = job;
        worth_from = worth;
      }
    }
    if (from == nullptr || worth_to < 2 * worth_from) break;
    ++gets[to->id];
    ++gives[from->id];
    auto& list = receivers[from->id];
    if (std::find(list.begin(), list.end(), to) == list.end()) list.push_back(to);
  }
  for (const JobView* giver : running) {
    const int count = gives[giver->id];
    if (count == 0) continue;
    const std::vector<WorkerView> candidates = newest_first(*giver);
    Action action{Action::kShrink, giver->id, {}, {}, ""};
    for (int i = 0; i < count; ++i) {
      action.workers.push_back(candidates[i].id);
      room.leaving(candidates[i].host);
    }
    const int from = giver->active();
    std::string whom;
    for (const JobView* receiver : receivers[giver->id]) {
      const int size = size_of(*receiver);
      whom += (whom.empty() ? "" : ", ") + std::string("job ") + std::to_string(receiver->id) +
              "'s " + fixed(speedup(*receiver, size, options)) + " -> " +
              fixed(speedup(*receiver, size + gets[receiver->id], options));
    }
    action.reason = "shrinks from " + std::to_string(from) + " to " + std::to_string(from - count) +
                    " workers: its speed-up " + fixed(speedup(*giver, from, options)) + " -> " +
                    fixed(speedup(*giver, from - count, options)) + ", where " + whom;
    result.actions.push_back(std::move(action));
  }
}

}  // namespace

Plan plan(const Snapshot& snapshot, const PolicyOptions& options) {
  Plan result;
  Room room(snapshot);
  const double now = snapshot.now;
  const auto cooled = [&](const JobView& job) { return now - job.last_resize >= options.cooldown; };
  // Note [What a resize costs]: what a job's speed-up after a resize is worth.
  const auto discount = [&](const JobView& job) {
    if (!(options.resize_cost > 0)) return 1.0;
    const double age = std::max(0.0, now - job.submitted), cost = options.resize_cost;
    return std::max(age - job.resizes * cost, 0.0) / (age + cost);
  };
  // Note [Giving workers where they speed training most].
  const bool goodput = options.kind == PolicyOptions::Kind::kGoodput;
  // An equal split of the capacity among the jobs: rounded down for the fair floor; rounded up
  // (Pollux's fair share) for the weight of a worker's worth, a job's speed-up there (at most its
  // --max).
  const int jobs = std::max(1, static_cast<int>(snapshot.jobs.size()));
  const int equal_split = room.capacity() / jobs;
  const int fair = std::max(1, (room.capacity() + jobs - 1) / jobs);
  std::map<int64_t, double> weights;  // once per job: a job under goodput() fits a model for it
  const auto weight = [&](const JobView& job) {
    const auto [it, added] = weights.try_emplace(job.id, 0.0);
    if (added) it->second = speedup(job, std::min(job.max_workers, fair), options);
    return it->second;
  };
  // Peers give up workers to each other only in the lowest priority running: a higher one is
  // served as under the priority policy, whole.
  int lowest = std::numeric_limits<int>::max();
  for (const auto& job : snapshot.jobs) {
    if (job.running) lowest = std::min(lowest, job.priority);
  }
  const auto fair_floor = [&](const JobView& job) {
    const int share = static_cast<int>(std::floor(options.fair_share * equal_split));
    return std::min(job.max_workers, std::max(job.min_workers, share));
  };

  std::vector<const JobView*> running;
  std::vector<const JobView*> waiting;
  for (const auto& job : snapshot.jobs) (job.running ? running : waiting).push_back(&job);
  std::sort(running.begin(), running.end(), by_priority_then_age);
  std::sort(waiting.begin(), waiting.end(), by_priority_then_age);

  // 1. Replacements: the slot of a failed worker stayed taken for it, on its host.
  for (const JobView* job : running) {
    Action action{Action::kReplace, job->id, {}, {}, ""};
    for (int i = 0; i < job->restarts_due && i < static_cast<int>(job->restarting.size()); ++i) {
      const std::string& host = job->restarting[i];
      if (room.alive(host)) {
        action.hosts.push_back(host);
      } else {
        auto moved = room.take(*job, 1);
        action.hosts.insert(action.hosts.end(), moved.begin(), moved.end());
      }
    }
    if (action.hosts.empty()) continue;
    action.reason = "replaces " + plural(static_cast<int>(action.hosts.size()), "failed worker");
    result.actions.push_back(std::move(action));
  }

  // 2. Admission. A job that lacks only slots that leaving workers free starts at once on them
  // (Note [Starting on leaving slots]).
  std::map<int64_t, int> taken;  // workers of a running job this plan makes leave
  // Read without adding the job: a job only weighed for a shrink is not one.
  const auto taken_from = [&](const JobView& job) {
    const auto it = taken.find(job.id);
    return it == taken.end() ? 0 : it->second;
  };
  std::set<int64_t> asked;       // their ids
  std::set<int64_t> preempted;   // running jobs this plan preempts
  int held = 0;                  // free slots held for waiting jobs ahead
  std::map<const JobView*, size_t> starting;  // under kGoodput, jobs started at --min: their start
  const auto start = [&](const JobView& job, int free, int leaving, const std::string& why,
                         bool by_worth) {
    Action action{Action::kStart, job.id, room.take(job, free), {}, ""};
    const auto claimed = room.claim(leaving);
    action.hosts.insert(action.hosts.end(), claimed.begin(), claimed.end());
    const int count = static_cast<int>(action.hosts.size());
    action.reason = starts_with(job, count);
    if (!claimed.empty()) {
      action.reason +=
          ", " + std::to_string(claimed.size()) + " on the slots of workers leaving" + why;
    }
    if (by_worth && count < job.max_workers) action.reason += "; more as they are worth it";
    result.actions.push_back(std::move(action));
  };
  for (const JobView* job : waiting) {
    if (!job->workers.empty()) {
      // Preempted, or back from running below its --min: one generation of a job at a time.
      result.waiting[job->id] = "waits for its " +
                                plural(static_cast<int>(job->workers.size()), "worker") +
                                " of before to leave";
      continue;
    }
    const int available = room.total() - held;
    if (available < job->min_workers && job->min_workers > room.capacity()) {
      result.waiting[job->id] = "needs " + plural(job->min_workers, "worker") + " at once; the " +
                                "live hosts have " + plural(room.capacity(), "slot");
      continue;
    }
    // What --min lacks beyond the free slots: first slots that leaving workers free, then workers
    // of lower-priority jobs.
    int need = std::max(0, job->min_workers - available);
    const int counted = std::min(need, room.claimable());
    need -= counted;

    // Who could make room: lower-priority running jobs, the least important and youngest first;
    // with kGoodput also those of its priority, above their fair floor, whose last workers add
    // least first.
    std::vector<const JobView*> lower;
    for (const JobView* other : running) {
      const bool peer = goodput && other->priority == job->priority && job->priority <= lowest;
      if ((other->priority < job->priority || peer) && preempted.count(other->id) == 0)
        lower.push_back(other);
    }
    std::sort(lower.begin(), lower.end(), [&](const JobView* a, const JobView* b) {
      if (a->priority != b->priority) return a->priority < b->priority;
      if (goodput) {
        const double ga = weight(*a) * fair_gain_at(*a, a->active(), options);
        const double gb = weight(*b) * fair_gain_at(*b, b->active(), options);
        if (ga != gb) return ga < gb;
      }
      if (a->submitted != b->submitted) return a->submitted > b->submitted;
      return a->id > b->id;
    });
    std::map<int64_t, int> shrink;
    std::vector<const JobView*> preempt;
    int cooling = 0;  // workers that could leave but for a job's cooldown
    int remaining = need;
    const auto surplus_of = [&](const JobView& other) {
      const int keeps = other.priority < job->priority ? other.min_workers : fair_floor(other);
      return other.active() - taken_from(other) - shrink[other.id] - keeps;
    };
    for (const JobView* other : lower) {
      // Peers come last, and only when no lower-priority job would make room once it cools down:
      // then the job waits for those, as under the priority policy, and takes up to its --max.
      if (other->priority == job->priority && cooling > 0) break;
      const int surplus = surplus_of(*other);
      if (surplus <= 0 || remaining == 0) continue;
      if (!cooled(*other)) {
        cooling += surplus;
        continue;
      }
      const int count = std::min(surplus, remaining);
      shrink[other->id] += count;
      remaining -= count;
    }
    for (const JobView* other : lower) {
      if (remaining <= 0) break;
      if (!other->preemptible || other->priority == job->priority) continue;
      const int left = other->active() - taken_from(*other) - shrink[other->id];
      if (left <= 0) continue;
      if (!cooled(*other)) {
        cooling += left;
        continue;
      }
      preempt.push_back(other);
      remaining -= left;
      shrink.erase(other->id);
    }
    if (remaining > 0) {
      held += available;
      std::string why = "needs " + plural(job->min_workers, "worker") +
                        " at once: " + std::to_string(available) + " free, " +
                        std::to_string(counted) + " leaving, " + std::to_string(need - remaining) +
                        (goodput ? " to take from lower-priority jobs and jobs of its priority above their fair share"
                                 : " to take from lower-priority jobs");
      if (cooling > 0) {
        why += ", " + std::to_string(cooling) + " more once resized jobs cool down (" +
               seconds(options.cooldown) + " between resizes)";
      }
      result.waiting[job->id] = why;
      continue;
    }
    // Note [Priority takes up to --max]: with its --min assured, a job also takes the surplus of
    // lower-priority jobs (above their --min, past their cooldown) up to its own --max, as a
    // fixed-size queue would give it its whole size by preemption. Taking only --min left the
    // high-priority jobs of bench/queue_real and queue_sim at their --min while lower-priority
    // jobs kept workers above theirs (bench/RESULTS.md). Only shrinks: nobody is preempted
    // for more than --min.
    int extra = job->max_workers - std::min(job->max_workers, available) - counted - need;
    // A whole job preempted for --min may free more than --min lacked: those slots come first.
    const int over = std::min(std::max(extra, 0), std::max(0, -remaining));
    extra -= over;
    need += over;
    for (const JobView* other : lower) {
      if (extra <= 0) break;
      if (std::find(preempt.begin(), preempt.end(), other) != preempt.end() || !cooled(*other) ||
          other->priority == job->priority)
        continue;
      const int count = std::min(surplus_of(*other), extra);
      if (count <= 0) continue;
      shrink[other->id] += count;
      extra -= count;
      need += count;
    }
    const std::string for_whom = "to make room for job " + std::to_string(job->id) + " (priority " +
                                 std::to_string(job->priority) + ")";
    for (const JobView* other : lower) {
      auto it = shrink.find(other->id);
      if (it == shrink.end() || it->second == 0) continue;
      std::vector<WorkerView> candidates = newest_first(*other);
      candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                      [&](const WorkerView& w) { return asked.count(w.id) > 0; }),
                       candidates.end());
      Action action{Action::kShrink, other->id, {}, {}, ""};
      for (int i = 0; i < it->second; ++i) {
        action.workers.push_back(candidates[i].id);
        asked.insert(candidates[i].id);
        room.leaving(candidates[i].host);
      }
      taken[other->id] += it->second;
      action.reason = "shrinks from " + std::to_string(other->active()) + " to " +
                      std::to_string(other->active() - taken[other->id]) + " workers " + for_whom;
      result.actions.push_back(std::move(action));
    }
    for (const JobView* other : preempt) {
      // Those an earlier waiting job's shrink already asked to leave are not asked twice.
      Action action{Action::kPreempt, other->id, {}, {}, ""};
      for (const auto& worker : other->workers) {
        if (worker.leaving || asked.count(worker.id) > 0) continue;
        action.workers.push_back(worker.id);
        room.leaving(worker.host);
      }
      preempted.insert(other->id);
      action.reason = "is preempted (" + plural(static_cast<int>(action.workers.size()), "worker") +
                      " leave) " + for_whom;
      result.actions.push_back(std::move(action));
    }
    // Under kGoodput a job of the lowest priority starts with its --min, and with the idle
    // workers worth most to it in step 3, weighed against the running jobs' next workers.
    const bool by_worth = goodput && job->priority <= lowest;
    start(*job, std::min(by_worth ? job->min_workers : job->max_workers, available), counted + need,
          need > 0 ? " for it" : "", by_worth);
    if (by_worth) starting[job] = result.actions.size() - 1;
  }

  // 3. Growth: capacity nobody waits for, once it has been idle for a while.
  int spare = room.total() - held;
  if (goodput) {
    grow_by_gain(
        result, room, running, starting, spare,
        [&](const JobView& job) {
          return taken_from(job) == 0 && preempted.count(job.id) == 0 && cooled(job);
        },
        now - snapshot.idle_since >= options.grow_idle ? now - snapshot.idle_since : -1.0,
        fair_floor, lowest, discount, weight, options);
  } else if (spare > 0 && now - snapshot.idle_since >= options.grow_idle) {
    for (const JobView* job : running) {
      if (spare == 0) break;
      if (taken_from(*job) > 0 || preempted.count(job->id) > 0 || !cooled(*job)) continue;
      const int target = job->active() + static_cast<int>(job->restarting.size());
      const int count = std::min(job->max_workers - target, spare);
      if (count <= 0) continue;
      Action action{Action::kGrow, job->id, room.take(*job, count), {}, ""};
      spare -= static_cast<int>(action.hosts.size());
      action.reason = "grows from " + std::to_string(target) + " to " +
                      std::to_string(target + static_cast<int>(action.hosts.size())) +
                      " workers into capacity idle for " + seconds(now - snapshot.idle_since);
      result.actions.push_back(std::move(action));
    }
  }
  result.free_after = spare;
  return result;
}

}  // namespace shoal::queue
