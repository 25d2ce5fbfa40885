// The queue's policy on a large simulated cluster: shoal::queue::plan() (src/queue/policy.h), the
// very function the scheduler calls, decides every start, shrink, grow and preemption of a seeded
// synthetic trace, and three contenders run that same trace in one process:
//   elastic       what shoal does: a shrink is a graceful leave, a grow a join; the workers that
//                 stay keep training;
//   goodput       elastic under the goodput policy (--policy goodput, src/queue/policy.h); the
//                 other three run the priority policy;
//   fixed         no elasticity: every job runs at one size (--fixed-at max: the size it asks for,
//                 or min), given to plan() as --min = --max, so the same code admits it and never
//                 shrinks or grows it; a higher priority still preempts preemptible jobs;
//   ckpt-restart  resizing by checkpoint-restart (Kubeflow's elastic PyTorchJob, Ray Train,
//                 Pollux/AdaptDL): plan()'s decisions are those of elastic, but every shrink and
//                 grow stops the whole job, which makes no progress for --restart-cost seconds.
//
//   queue_sim [--hosts 1000] [--slots 8] [--jobs 3000] [--seed 1] [--load 1.5]
//             [--restart-cost 60] [--cooldown 30] [--grow-idle 5] ...
//
// It prints, per contender, jobs finished, completion time (submit to finish; mean, p95, high
// priority alone), queueing delay (submit to first start), utilisation of the slots (held by a
// worker; held by a worker that makes progress), resizes, preemptions, cycles (a job shrunk or
// preempted, then given back what it lost: the scheduler's `cycles`) and plan()'s cost, then the
// ratios elastic / fixed and elastic / ckpt-restart.
//
// The model, and its assumptions:
// - A job's work is in worker-seconds; n workers do n^alpha of it per second (--alpha 0.9:
//   diminishing returns), whatever hosts they are on (no placement or network effects). With
//   --alphas, each job's alpha is drawn from that list (jobs that scale and jobs that do not).
//   plan() sees each job's rate at the worker counts it has run at, as the scheduler measures it
//   (docs/queue.md, "Throughput"); the goodput contender's policy models the job from them.
// - Trace: Poisson arrivals at the rate that offers --load times the cluster's slot-seconds at each
//   job's --min; 20% high priority (--high); --min in {1, 2, 4, 8}, --max = --min x {1, 2, 4};
//   half the low-priority jobs preemptible (--preemptible); a job's run time at its --min is
//   log-uniform in [--run-min, --run-max] (5 min to 2 h).
// - Time moves in whole seconds, as the scheduler's tick does, but only from event to event:
//   plan() runs at each second in which its snapshot changed (an arrival, a completion, a worker
//   that left) and, while a job waits or slots are free, when a cooldown or the grow-idle wait
//   ends: the only moments at which its answer can change. Snapshots are built as the scheduler's
//   snapshot() builds them (leaving workers included; last_resize; idle_since kept as tick()
//   keeps it) and actions applied as its apply() does.
// - A shrink is a graceful leave: the leaving workers hold their slots for --leave-delay seconds
//   (the scheduler counts a slot until its worker exits) and do no work; the others go on.
//   A grow's new workers hold their slots for --join-delay seconds before they add speed.
// - A preempted job stops making progress at once, its workers hold their slots for
//   --leave-delay, and it loses no work: shoal commits every step and the job leaves at a commit.
//   The same is assumed of the other contenders (they checkpoint as they are stopped).
//   Its next start is a restart from a checkpoint in every contender: --resume-cost seconds with
//   all its workers held and no progress. A job's first start costs nothing in any contender.
// - No failures, no hosts lost, no below --min requeue: shrinks never go below --min.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "queue/policy.h"
#include "queue_contenders.h"

namespace {

namespace q = shoal::queue;
using Clock = std::chrono::steady_clock;
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Options {
  int hosts = 1000;
  int slots = 8;
  int jobs = 3000;
  uint64_t seed = 1;
  double load = 1.5;
  double high = 0.2;
  double preemptible = 0.5;
  double alpha = 0.9;
  std::vector<double> alphas;  // each job's alpha, drawn from these; empty: alpha for all
  double run_min = 300;  // seconds a job runs at its --min: log-uniform in [run_min, run_max]
  double run_max = 7200;
  double restart_cost = 60;
  double resume_cost = 60;
  double leave_delay = 5;
  double join_delay = 5;
  std::string fixed_at = "max";
  q::PolicyOptions policy;
};

struct TraceJob {
  int64_t id = 0;
  int priority = 0;
  int min_workers = 1;
  int max_workers = 1;
  bool preemptible = false;
  double submitted = 0;
  double work = 0;  // worker-seconds
  double alpha = 0.9;
};

struct Trace {
  std::vector<TraceJob> jobs;
  double rate = 0;          // arrivals per second
  double offered_load = 0;  // slot-seconds at --min over the slots' during the arrivals
};

Trace make_trace(const Options& options) {
  std::mt19937_64 random(options.seed);
  std::uniform_real_distribution<double> unit(0, 1);
  const int sizes[] = {1, 2, 4, 8};
  const int factors[] = {1, 2, 4};
  // Alphas from a stream of their own: the rest of the trace is the same with or without them.
  std::mt19937_64 scaling(options.seed + 1);
  Trace trace;
  double slot_seconds = 0;
  for (int i = 0; i < options.jobs; ++i) {
    TraceJob job;
    job.id = i + 1;
    job.priority = unit(random) < options.high ? 1 : 0;
    job.min_workers = sizes[std::uniform_int_distribution<int>(0, 3)(random)];
    job.max_workers = job.min_workers * factors[std::uniform_int_distribution<int>(0, 2)(random)];
    job.preemptible = job.priority == 0 && unit(random) < options.preemptible;
    const double seconds_at_min =
        options.run_min * std::exp(unit(random) * std::log(options.run_max / options.run_min));
    job.alpha = options.alphas.empty()
                    ? options.alpha
                    : options.alphas[std::uniform_int_distribution<size_t>(0, options.alphas.size() - 1)(scaling)];
    job.work = seconds_at_min * std::pow(job.min_workers, job.alpha);
    slot_seconds += seconds_at_min * job.min_workers;
    trace.jobs.push_back(job);
  }
  const double capacity = static_cast<double>(options.hosts) * options.slots;
  trace.rate = options.load * capacity / (slot_seconds / options.jobs);
  std::exponential_distribution<double> gap(trace.rate);
  double now = 0;
  for (auto& job : trace.jobs) {
    job.submitted = now;
    now += gap(random);
  }
  const double span = trace.jobs.back().submitted;
  trace.offered_load = span > 0 ? slot_seconds / (capacity * span) : 0;
  return trace;
}

using shoal::bench::Contender;
using shoal::bench::name_of;

struct Result {
  int finished = 0;
  double jct_mean = 0, jct_p95 = 0;
  double high_jct_mean = 0, high_jct_p95 = 0;
  double low_jct_mean = 0;
  double size_mean = 0, high_size_mean = 0;  // progressing workers, averaged over running time
  double queue_mean = 0, high_queue_mean = 0;
  double makespan = 0;
  double util_held = 0, util_progress = 0;
  double util_held_arriving = 0, util_progress_arriving = 0;  // until the last arrival
  int resizes = 0, preemptions = 0, cycles = 0;
  int64_t plan_calls = 0;
  double plan_seconds = 0;
  double wall_seconds = 0;
};

class Simulation {
 public:
  Simulation(const Trace& trace, const Options& options, Contender contender)
      : trace_(trace), options_(options), contender_(contender) {
    jobs_.resize(trace.jobs.size());
    for (size_t i = 0; i < jobs_.size(); ++i) {
      jobs_[i].spec = &trace.jobs[i];
      jobs_[i].work_left = trace.jobs[i].work;
    }
    const int digits = static_cast<int>(std::to_string(std::max(0, options.hosts - 1)).size());
    for (int h = 0; h < options.hosts; ++h) {
      // Zero-padded, so that the policy's map of hosts orders them as their indices.
      std::string name = std::to_string(h);
      name = "h" + std::string(digits - name.size(), '0') + name;
      snapshot_.hosts.push_back({name, options.slots, true, 0});
    }
  }

  Result run();

 private:
  enum class Phase { kJoining, kActive, kLeaving };
  struct Worker {
    int64_t id = 0;
    int host = 0;
    Phase phase = Phase::kActive;
    double until = kInf;  // when a joining worker starts to work, or a leaving one exits
  };
  enum class State { kFuture, kWaiting, kRunning, kDone };
  struct Job {
    const TraceJob* spec = nullptr;
    State state = State::kFuture;
    std::vector<Worker> workers;  // those that hold a slot, leaving ones included
    double work_left = 0;
    double last_resize = -kInf;
    double paused_until = -kInf;  // restarting: none of its workers makes progress before this
    double first_start = -1;
    double finish = -1;
    bool owed = false;  // lost workers since it last grew or restarted (src/queue/scheduler_impl.h's `owed`)
    int resizes = 0, preemptions = 0, cycles = 0;
    double running_seconds = 0, worker_seconds = 0;  // while running; of progressing workers
    std::map<int, double> measured;  // its rate at each worker count it has made progress at
  };

  int progressing(const Job& job) const;
  bool process_tick();
  void check_hosts() const;
  void call_plan();
  void apply(const q::Action& action);
  double next_event() const;
  void advance(double to);
  Result summarise(double wall_seconds) const;

  const Trace& trace_;
  const Options& options_;
  Contender contender_;
  std::vector<Job> jobs_;
  std::vector<size_t> live_;  // waiting and running jobs
  size_t next_arrival_ = 0;
  int64_t next_worker_ = 1;
  double now_ = 0;
  double idle_since_ = kInf;
  double replan_at_ = kInf;
  q::Snapshot snapshot_;
  double busy_ = 0, useful_ = 0;  // slot-seconds held; held by a worker making progress
  double busy_arriving_ = 0, useful_arriving_ = 0;  // the same, before the last arrival
  int64_t plan_calls_ = 0;
  double plan_seconds_ = 0;
};

int Simulation::progressing(const Job& job) const {
  if (job.state != State::kRunning || job.paused_until > now_) return 0;
  int count = 0;
  for (const auto& worker : job.workers) count += worker.phase == Phase::kActive ? 1 : 0;
  return count;
}

// Arrivals, completions, workers that joined or left by now. True when what plan() sees changed.
bool Simulation::process_tick() {
  bool changed = false;
  while (next_arrival_ < jobs_.size() && jobs_[next_arrival_].spec->submitted <= now_) {
    jobs_[next_arrival_].state = State::kWaiting;
    live_.push_back(next_arrival_++);
    changed = true;
  }
  for (size_t index : live_) {
    Job& job = jobs_[index];
    if (job.state == State::kRunning && job.work_left <= 0) {
      // Its workers exit at the tick after the last step, as the scheduler sees them go.
      job.state = State::kDone;
      job.workers.clear();
      changed = true;
      continue;
    }
    // A restart or a join that ends changes the job's speed, not what plan() sees: no new plan.
    if (job.paused_until <= now_) job.paused_until = -kInf;
    const size_t before = job.workers.size();
    job.workers.erase(std::remove_if(job.workers.begin(), job.workers.end(),
                                     [&](const Worker& w) {
                                       return w.phase == Phase::kLeaving && w.until <= now_;
                                     }),
                      job.workers.end());
    changed |= job.workers.size() != before;
    for (auto& worker : job.workers) {
      if (worker.phase == Phase::kJoining && worker.until <= now_) {
        worker.phase = Phase::kActive;
        worker.until = kInf;
      }
    }
  }
  live_.erase(std::remove_if(live_.begin(), live_.end(),
                             [&](size_t i) { return jobs_[i].state == State::kDone; }),
              live_.end());
  return changed;
}

// The simulation's own invariant: plan() never places more workers on a host than it has slots,
// but for leaving workers, whose slots a new job may take while they finish (Note [Starting on
// leaving slots] in src/queue/policy.cpp).
void Simulation::check_hosts() const {
  std::vector<int> used(static_cast<size_t>(options_.hosts), 0);
  for (size_t index : live_) {
    for (const auto& worker : jobs_[index].workers) {
      if (worker.phase != Phase::kLeaving) ++used[static_cast<size_t>(worker.host)];
    }
  }
  for (size_t h = 0; h < used.size(); ++h) {
    if (used[h] <= options_.slots) continue;
    std::fprintf(stderr, "queue_sim: %s: host %zu runs %d workers on %d slots at t=%.0f s\n",
                 name_of(contender_), h, used[h], options_.slots, now_);
    std::abort();
  }
}

void Simulation::call_plan() {
  snapshot_.now = now_;
  snapshot_.idle_since = idle_since_;
  snapshot_.jobs.clear();
  for (size_t index : live_) {
    const Job& job = jobs_[index];
    q::JobView view;
    view.id = job.spec->id;
    view.priority = job.spec->priority;
    view.min_workers = job.spec->min_workers;
    view.max_workers = job.spec->max_workers;
    if (contender_ == Contender::kFixed) {
      const int size = options_.fixed_at == "min" ? job.spec->min_workers : job.spec->max_workers;
      view.min_workers = view.max_workers = size;
    }
    view.preemptible = job.spec->preemptible;
    view.submitted = job.spec->submitted;
    view.running = job.state == State::kRunning;
    for (const auto& worker : job.workers) {
      view.workers.push_back(
          {worker.id, snapshot_.hosts[worker.host].name, worker.phase == Phase::kLeaving});
    }
    view.last_resize = job.last_resize;
    view.throughput = job.measured;
    snapshot_.jobs.push_back(std::move(view));
  }
  check_hosts();
  const auto start = Clock::now();
  q::PolicyOptions policy = options_.policy;
  if (contender_ == Contender::kGoodput) policy.kind = q::PolicyOptions::Kind::kGoodput;
  const q::Plan plan = q::plan(snapshot_, policy);
  plan_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
  ++plan_calls_;
  for (const auto& action : plan.actions) apply(action);

  // As the scheduler's tick() keeps it.
  if (plan.free_after > 0) {
    if (std::isinf(idle_since_)) idle_since_ = now_;
  } else {
    idle_since_ = kInf;
  }
  // The next moment at which the same state could plan differently: capacity idle long enough to
  // grow into, or a job whose cooldown ends (one that could shrink for a waiting job, or grow).
  replan_at_ = kInf;
  if (plan.free_after > 0 && idle_since_ + options_.policy.grow_idle > now_) {
    replan_at_ = idle_since_ + options_.policy.grow_idle;
  }
  if (!plan.waiting.empty() || plan.free_after > 0) {
    for (size_t index : live_) {
      const Job& job = jobs_[index];
      const double cooled = job.last_resize + options_.policy.cooldown;
      if (job.state == State::kRunning && cooled > now_) replan_at_ = std::min(replan_at_, cooled);
    }
  }
}

void Simulation::apply(const q::Action& action) {
  Job& job = jobs_[static_cast<size_t>(action.job - 1)];
  const auto add_workers = [&](Phase phase, double until) {
    for (const auto& host : action.hosts) {
      job.workers.push_back({next_worker_++, std::stoi(host.substr(1)), phase, until});
    }
  };
  const auto restart = [&](double cost) {
    job.paused_until = std::max(job.paused_until, now_ + cost);
  };
  switch (action.kind) {
    case q::Action::kStart:
      job.state = State::kRunning;
      if (job.first_start < 0) {
        job.first_start = now_;
      } else {
        restart(options_.resume_cost);  // back from a preemption: from its checkpoint
      }
      if (job.preemptions > 0 && job.owed) {
        ++job.cycles;
        job.owed = false;
      }
      // A start is no resize (src/queue/scheduler_jobs.cpp's apply()).
      add_workers(Phase::kActive, kInf);
      break;
    case q::Action::kGrow:
      ++job.resizes;
      if (job.owed) {
        ++job.cycles;
        job.owed = false;
      }
      job.last_resize = now_;
      if (contender_ == Contender::kCheckpointRestart) {
        add_workers(Phase::kActive, kInf);
        restart(options_.restart_cost);
      } else {
        // A join of no delay adds speed at once, as a ckpt-restart of no cost does.
        add_workers(options_.join_delay > 0 ? Phase::kJoining : Phase::kActive,
                    options_.join_delay > 0 ? now_ + options_.join_delay : kInf);
      }
      break;
    case q::Action::kShrink:
    case q::Action::kPreempt:
      for (int64_t id : action.workers) {
        for (auto& worker : job.workers) {
          if (worker.id != id || worker.phase == Phase::kLeaving) continue;
          worker.phase = Phase::kLeaving;
          worker.until = now_ + options_.leave_delay;
        }
      }
      job.last_resize = now_;
      job.owed = true;
      if (action.kind == q::Action::kShrink) {
        ++job.resizes;
        if (contender_ == Contender::kCheckpointRestart) restart(options_.restart_cost);
      } else {
        ++job.preemptions;
        job.state = State::kWaiting;
        job.paused_until = -kInf;
      }
      break;
    case q::Action::kReplace:
      break;  // no worker fails here
  }
}

// The next whole second at which something happens, or +inf when nothing will.
double Simulation::next_event() const {
  double next = replan_at_;
  if (next_arrival_ < jobs_.size()) next = std::min(next, jobs_[next_arrival_].spec->submitted);
  for (size_t index : live_) {
    const Job& job = jobs_[index];
    if (job.paused_until > now_) next = std::min(next, job.paused_until);
    for (const auto& worker : job.workers) next = std::min(next, worker.until);
    const int count = progressing(job);
    if (count > 0) next = std::min(next, now_ + job.work_left / std::pow(count, job.spec->alpha));
  }
  return std::isinf(next) ? next : std::max(now_ + 1, std::ceil(next));
}

// Between two events nothing changes but the work done: every rate is constant.
void Simulation::advance(double to) {
  const double dt = to - now_;
  const double arriving = std::max(0.0, std::min(to, trace_.jobs.back().submitted) - now_);
  for (size_t index : live_) {
    Job& job = jobs_[index];
    busy_ += static_cast<double>(job.workers.size()) * dt;
    busy_arriving_ += static_cast<double>(job.workers.size()) * arriving;
    const int count = progressing(job);
    if (job.state == State::kRunning && job.work_left > 0) job.running_seconds += dt;
    if (count == 0 || job.work_left <= 0) continue;  // done, its workers exit at this tick
    const double rate = std::pow(count, job.spec->alpha);
    const double worked = std::min(dt, job.work_left / rate);
    // Measured once it has run at this count for the scheduler's shortest window (2 s).
    if (worked >= 2.0) job.measured[count] = rate;
    useful_ += count * worked;
    useful_arriving_ += count * std::min(worked, arriving);
    job.worker_seconds += count * worked;
    job.work_left -= rate * worked;
    if (worked < dt || job.work_left <= 1e-6) {
      job.work_left = 0;
      job.finish = now_ + worked;
    }
  }
  now_ = to;
}

Result Simulation::run() {
  const auto start = Clock::now();
  now_ = std::ceil(trace_.jobs.front().submitted);  // --jobs is positive
  while (true) {
    const bool changed = process_tick();
    if (changed || replan_at_ <= now_) call_plan();
    if (live_.empty() && next_arrival_ == jobs_.size()) break;
    const double next = next_event();
    if (std::isinf(next)) {
      std::fprintf(stderr, "queue_sim: %s: %zu jobs wait and nothing will happen at t=%.0f s\n",
                   name_of(contender_), live_.size(), now_);
      break;
    }
    advance(next);
  }
  return summarise(std::chrono::duration<double>(Clock::now() - start).count());
}

double mean(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v;
  return values.empty() ? 0 : sum / static_cast<double>(values.size());
}

double p95(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(0.95 * static_cast<double>(values.size())));
  return values[std::max<size_t>(rank, 1) - 1];
}

Result Simulation::summarise(double wall_seconds) const {
  Result result;
  std::vector<double> all, high, low, queued, high_queued;
  double last = 0;
  double running[2] = {0, 0}, worker_seconds[2] = {0, 0};
  for (const auto& job : jobs_) {
    if (job.state != State::kDone) continue;
    const double jct = job.finish - job.spec->submitted;
    all.push_back(jct);
    (job.spec->priority > 0 ? high : low).push_back(jct);
    queued.push_back(job.first_start - job.spec->submitted);
    if (job.spec->priority > 0) high_queued.push_back(queued.back());
    last = std::max(last, job.finish);
    running[job.spec->priority > 0 ? 1 : 0] += job.running_seconds;
    worker_seconds[job.spec->priority > 0 ? 1 : 0] += job.worker_seconds;
    result.resizes += job.resizes;
    result.preemptions += job.preemptions;
    result.cycles += job.cycles;
  }
  result.finished = static_cast<int>(all.size());
  result.jct_mean = mean(all);
  result.jct_p95 = p95(all);
  result.high_jct_mean = mean(high);
  result.high_jct_p95 = p95(high);
  result.low_jct_mean = mean(low);
  result.size_mean =
      (worker_seconds[0] + worker_seconds[1]) / std::max(1.0, running[0] + running[1]);
  result.high_size_mean = worker_seconds[1] / std::max(1.0, running[1]);
  result.queue_mean = mean(queued);
  result.high_queue_mean = mean(high_queued);
  result.makespan = last - trace_.jobs.front().submitted;
  // Over the whole run: the slot-seconds end at the tick after the last job's last step.
  const double capacity = static_cast<double>(options_.hosts) * options_.slots * now_;
  result.util_held = busy_ / capacity;
  result.util_progress = useful_ / capacity;
  const double window = static_cast<double>(options_.hosts) * options_.slots *
                        (trace_.jobs.back().submitted - trace_.jobs.front().submitted);
  result.util_held_arriving = window > 0 ? busy_arriving_ / window : 0;
  result.util_progress_arriving = window > 0 ? useful_arriving_ / window : 0;
  result.plan_calls = plan_calls_;
  result.plan_seconds = plan_seconds_;
  result.wall_seconds = wall_seconds;
  return result;
}


void print_table(const std::vector<Result>& results) {
  struct Row {
    const char* metric;
    double Result::*value;
    int decimals;
    double scale;
  };
  const Row rows[] = {
      {"jobs finished", nullptr, 0, 1},
      {"JCT mean (min)", &Result::jct_mean, 1, 1.0 / 60},
      {"JCT p95 (min)", &Result::jct_p95, 1, 1.0 / 60},
      {"high-priority JCT mean (min)", &Result::high_jct_mean, 1, 1.0 / 60},
      {"high-priority JCT p95 (min)", &Result::high_jct_p95, 1, 1.0 / 60},
      {"low-priority JCT mean (min)", &Result::low_jct_mean, 1, 1.0 / 60},
      {"queueing delay mean (min)", &Result::queue_mean, 1, 1.0 / 60},
      {"high-priority queueing mean (min)", &Result::high_queue_mean, 1, 1.0 / 60},
      {"workers of a running job, mean", &Result::size_mean, 2, 1},
      {"high-priority: workers, mean", &Result::high_size_mean, 2, 1},
      {"makespan (h)", &Result::makespan, 2, 1.0 / 3600},
      {"utilisation, slots held", &Result::util_held, 3, 1},
      {"utilisation, slots making progress", &Result::util_progress, 3, 1},
      {"utilisation until the last arrival, held", &Result::util_held_arriving, 3, 1},
      {"utilisation until the last arrival, progress", &Result::util_progress_arriving, 3, 1},
      {"resizes", nullptr, 0, 1},
      {"preemptions", nullptr, 0, 1},
      {"cycles (lost workers, given back)", nullptr, 0, 1},
      {"plan() calls", nullptr, 0, 1},
      {"plan() time (s)", &Result::plan_seconds, 2, 1},
      {"simulation wall time (s)", &Result::wall_seconds, 2, 1},
  };
  const auto integer = [](const Result& r, const std::string& metric) -> double {
    if (metric == "jobs finished") return r.finished;
    if (metric == "resizes") return r.resizes;
    if (metric == "preemptions") return r.preemptions;
    if (metric == "cycles (lost workers, given back)") return r.cycles;
    return static_cast<double>(r.plan_calls);
  };
  std::vector<shoal::bench::ContenderRow> table;
  for (const auto& row : rows) {
    shoal::bench::ContenderRow out{row.metric, row.decimals, {}};
    for (const auto& result : results) {
      out.values.push_back(row.value == nullptr ? integer(result, row.metric) : result.*row.value * row.scale);
    }
    table.push_back(out);
  }
  shoal::bench::print_contender_table(table);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "The queue's policy (shoal::queue::plan) on a simulated cluster: elastic resizing, "
      "fixed-size jobs and checkpoint-restart resizing over one trace"};
  app.add_option("--hosts", o.hosts, "hosts")->check(CLI::PositiveNumber);
  app.add_option("--slots", o.slots, "workers each host may run")->check(CLI::PositiveNumber);
  app.add_option("--jobs", o.jobs, "jobs in the trace")->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "the trace generator's seed (std::mt19937_64)");
  app.add_option("--load", o.load, "offered slot-seconds at --min over capacity")
      ->check(CLI::PositiveNumber);
  app.add_option("--high", o.high, "share of high-priority jobs")->check(CLI::Range(0.0, 1.0));
  app.add_option("--preemptible", o.preemptible, "share of low-priority jobs that are preemptible")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--alpha", o.alpha, "n workers run at n^alpha worker-seconds per second")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--alphas", o.alphas, "each job's alpha, drawn uniformly from these (default: --alpha)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--run-min", o.run_min, "shortest run time at --min, seconds (log-uniform)")
      ->check(CLI::PositiveNumber);
  app.add_option("--run-max", o.run_max, "longest run time at --min, seconds")
      ->check(CLI::PositiveNumber);
  app.add_option("--restart-cost", o.restart_cost,
                 "seconds without progress for every shrink or grow under ckpt-restart")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--resume-cost", o.resume_cost,
                 "seconds without progress when a preempted job starts again (all contenders)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--leave-delay", o.leave_delay, "seconds a leaving worker keeps its slot")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--join-delay", o.join_delay, "seconds before a joining worker adds speed")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--fixed-at", o.fixed_at, "the size of the fixed contender's jobs: max or min")
      ->check(CLI::IsMember({"max", "min"}));
  app.add_option("--cooldown", o.policy.cooldown, "PolicyOptions::cooldown, seconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--grow-idle", o.policy.grow_idle, "PolicyOptions::grow_idle, seconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--min-gain", o.policy.min_gain, "PolicyOptions::min_gain (goodput)")->check(CLI::NonNegativeNumber);
  app.add_option("--fair-share", o.policy.fair_share, "PolicyOptions::fair_share (goodput)")
      ->check(CLI::Range(0.0, 1.0));
  CLI11_PARSE(app, argc, argv);

  const Trace trace = make_trace(o);
  int high = 0, preemptible = 0;
  for (const auto& job : trace.jobs) {
    high += job.priority > 0 ? 1 : 0;
    preemptible += job.preemptible ? 1 : 0;
  }
  std::string alphas = shoal::bench::format(o.alpha, 2);
  if (!o.alphas.empty()) {
    alphas = "alpha, alpha drawn per job from {";
    for (size_t i = 0; i < o.alphas.size(); ++i) alphas += (i ? ", " : "") + shoal::bench::format(o.alphas[i], 2);
    alphas += "}";
  }
  std::printf(
      "queue_sim: %d hosts x %d slots, %d jobs (%d high priority, %d preemptible), "
      "seed %llu\n",
      o.hosts, o.slots, o.jobs, high, preemptible, static_cast<unsigned long long>(o.seed));
  std::printf(
      "trace: Poisson arrivals at %.4f/s over %.2f h, offered load %.2f (slot-seconds at "
      "--min); --min in {1,2,4,8}, --max = --min x {1,2,4}; run time at --min log-uniform "
      "in [%.0f, %.0f] s\n",
      trace.rate, trace.jobs.back().submitted / 3600, trace.offered_load, o.run_min, o.run_max);
  std::printf(
      "model: n workers do n^%s worker-seconds/s; leave %.0f s, join %.0f s; preempted "
      "jobs lose no work and resume in %.0f s; ckpt-restart resize %.0f s; fixed at --%s; "
      "cooldown %.0f s, grow-idle %.0f s; goodput: min gain %.2f, fair share %.2f\n\n",
      alphas.c_str(), o.leave_delay, o.join_delay, o.resume_cost, o.restart_cost, o.fixed_at.c_str(),
      o.policy.cooldown, o.policy.grow_idle, o.policy.min_gain, o.policy.fair_share);
  std::fflush(stdout);

  std::vector<Result> results;
  for (Contender c :
       {Contender::kElastic, Contender::kFixed, Contender::kCheckpointRestart, Contender::kGoodput}) {
    Simulation simulation(trace, o, c);
    results.push_back(simulation.run());
  }
  print_table(results);
  return 0;
}
