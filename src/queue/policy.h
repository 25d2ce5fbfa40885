// The queue's policy: given what runs where and what waits, which jobs start, shrink, grow or are
// preempted, and why. A pure function of a snapshot, with no clock and no I/O of its own, so that
// the scheduler (scheduler_jobs.cpp) and the simulation of a large cluster (bench/queue) run the very
// same decisions. See docs/queue.md, "Policy".
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "shoal/dp/goodput.h"

namespace shoal::queue {

struct HostView {
  std::string name;
  int capacity = 0;  // workers it may run: its cores times the operator's oversubscription
  bool alive = true;
  int held = 0;  // slots still taken by workers of ended jobs, on their way out
};

struct WorkerView {
  int64_t id = 0;
  std::string host;
  bool leaving = false;  // asked to leave (a shrink or a preemption) and not gone yet
};

struct JobView {
  int64_t id = 0;
  int priority = 0;  // higher first
  int min_workers = 1;
  int max_workers = 1;
  bool preemptible = false;
  double submitted = 0;  // seconds on the snapshot's clock; earlier first among equal priorities
  bool running = false;  // false: waiting for admission
  // Its workers that still hold a slot, those leaving included.
  std::vector<WorkerView> workers;
  // Hosts of failed workers whose replacement waits out its back-off: their slots stay taken.
  std::vector<std::string> restarting;
  // Of those, the ones whose back-off is over (a prefix of `restarting`'s count).
  int restarts_due = 0;
  double last_resize = -std::numeric_limits<double>::infinity();  // shrink, grow or preemption
  int resizes = 0;  // how often it was resized or preempted since it was submitted
  // What the goodput policy models the job's speed-up from (Note [Speed-up curves]): samples per
  // second measured at each worker count (docs/queue.md, "Throughput"), and the gradient noise
  // scale its DataParallel measured (in samples; 0: unknown) with the batch of each worker when
  // that stays as the world changes (0: the global batch stays, and so does the efficiency).
  std::map<int, double> throughput;
  double noise_scale = 0;
  int64_t batch_per_worker = 0;
  // A job whose batch follows its world by goodput (elastic::BatchPolicy::goodput()): the limits
  // of its batch (base_batch 0: not such a job) and the steps it measured, from which its
  // speed-up is modeled instead (Note [Speed-up curves]).
  BatchLimits batch_limits;
  std::vector<StepSample> steps;

  int active() const;  // workers not leaving
};

struct PolicyOptions {
  double cooldown = 30;  // seconds between two resizes of one job
  double grow_idle = 5;  // how long capacity stays free before it goes to running jobs
  enum class Kind {
    // Priorities, --min/--max and idle time only: idle capacity goes to the highest priority.
    kPriority,
    // Goodput-aware (Note [Giving workers where they speed training most]).
    kGoodput,
  };
  Kind kind = Kind::kPriority;
  // kGoodput: a worker goes to a job only when it adds at least this much of one worker's speed
  // (the job's speed-up gain); and a job gives up workers to others of its priority only down to
  // this fraction of an equal split of the capacity among the jobs (never below --min).
  double min_gain = 0.25;
  double fair_share = 0.5;
  // kGoodput, before a job has run at two worker counts: each worker beyond the first is assumed
  // to add this fraction of one worker's step time (communication).
  double overhead_prior = 0.05;
  // kGoodput: the seconds of training a resize costs a job (Note [What a resize costs]); 0: none.
  double resize_cost = 0;
};

// Note [Speed-up curves]
// A job's speed-up on w workers, against one, is its goodput there over its goodput on one:
// throughput times statistical efficiency (Pollux, OSDI'21). Throughput: a step on w workers is
// modeled as taking a + b (w - 1) per sample of one worker, fitted by least squares to the rates
// measured at each worker count (b >= 0), so T(w) = w / (a + b (w - 1)) samples per time. Only
// b / a matters; before two counts are measured it is overhead_prior. Efficiency: when each
// worker's batch stays (a per_worker loader, BatchPolicy::scale_learning_rate or adascale), the
// global batch is w B_w and a sample is worth E(w) = (B_noise + B_w) / (B_noise + w B_w) of one
// at one worker's batch (shoal/dp/gradient_noise.h); otherwise E = 1.
// speedup(w) = T(w) E(w) / (T(1) E(1)).
// A job whose batch follows its world by goodput picks, at each world, the batch of the highest
// goodput under the step-time model fitted to the steps it measured (shoal/dp/goodput.h, the
// job's own rule): its speed-up is that best goodput at w over the best at one worker.
double speedup(const JobView& job, int workers, const PolicyOptions& options);

struct Snapshot {
  double now = 0;
  std::vector<HostView> hosts;
  std::vector<JobView> jobs;  // waiting and running jobs only
  // Since when some capacity has been free with no job waiting for it; +inf when none is.
  double idle_since = std::numeric_limits<double>::infinity();
};

struct Action {
  enum Kind {
    kStart,    // a waiting job starts with one worker per entry of `hosts` (at least its --min)
    kGrow,     // a running job takes one more worker per entry of `hosts` (joins)
    kReplace,  // a failed worker's replacement starts on `hosts[i]`
    kShrink,   // `workers` leave gracefully at their next commit; the others keep their processes
    kPreempt,  // all of `workers` leave and the job goes back to waiting
  };
  Kind kind = kStart;
  int64_t job = 0;
  std::vector<std::string> hosts;
  std::vector<int64_t> workers;
  std::string reason;  // one sentence, for the events table and `shoal queue show`
};

struct Plan {
  std::vector<Action> actions;
  std::map<int64_t, std::string> waiting;  // why each job that stays waiting waits
  int free_after = 0;                      // slots still free once the plan is carried out
};

const char* to_string(Action::Kind kind);

// Decides, in this order (docs/queue.md, "Policy"):
//  1. replacements whose back-off is over, on the failed worker's host (else any free one);
//  2. waiting jobs by priority, then age: a job starts only when its --min workers can all start
//     (gang admission). Short of room, it first takes the surplus above --min of lower-priority
//     running jobs (a shrink, by graceful leave; newest workers first; lowest priority and youngest
//     job first), then whole preemptible lower-priority jobs; the slots it waits for are held for
//     it, so later jobs cannot take them (no starvation);
//  3. capacity free since `idle_since` for `grow_idle` goes to running jobs below their --max,
//     highest priority first.
// No job is resized twice within `cooldown`; a start is no resize, so a job that took idle
// capacity a moment ago still gives its surplus to a higher-priority arrival at once.
//
// Note [Giving workers where they speed training most]
// With PolicyOptions::Kind::kGoodput, steps 1 and 2 stand (a higher priority is served as
// above), and four things change:
//  - a waiting job may also take, for its --min, the workers of running jobs of its own priority
//    above their fair floor (max(--min, fair_share of an equal split), at most --max): a job's
//    first workers are worth more than another's last ones, and no job waits behind jobs that
//    hold more than their share;
//  - a job of the lowest priority running starts with its --min workers and the idle ones worth
//    most to it by the next rule, weighed against the running jobs' next workers (with a resize
//    cost, as a resize of the job: one too young to pay for it starts at its --min), not with
//    every free slot up to its --max. Its curve is then the prior's, soon its measurement's;
//    Pollux too starts a job small. Starting it on every free slot kept capacity from the jobs
//    that would have used it better (bench/RESULTS.md, "queue on Pollux's workloads: a start at
//    --min");
//  - idle capacity goes one worker at a time to the running job where it is worth most, higher
//    priorities first, while it adds at least min_gain of a worker to that job's speed-up (Note
//    [Speed-up curves]): a job that would not use a worker does not get it. A worker's worth is
//    what it takes off 1 / the job's speed-up, times the job's speed-up on an equal split of the
//    capacity (at most its --max): giving by it maximizes the sum over jobs of -S_j(e) / S_j(w),
//    the power mean with p = -1 of each job's speed over its speed on an equal split, which
//    Pollux (OSDI'21) maximizes for fairness. Not the sum of speed-ups, which starves the jobs
//    that scale poorly and has every newcomer wait behind the big jobs (bench/RESULTS.md,
//    "queue on Pollux's workloads"); and against an equal split rather than one worker, so that
//    a job's share is weighed by what a fair share would give it (bench/RESULTS.md, the same
//    section as the start at --min);
//  - without idle capacity, a higher priority takes the workers of lower ones above their --min
//    that add at least min_gain each, up to its --max; else, among the lowest priority's jobs,
//    workers move in one plan from the job whose last worker is worth least to the one whose next
//    is worth most, while that is at least twice as much (no move back on a measurement's noise),
//    down to the giver's fair floor. They return as idle capacity and go by the rule above.
//
// Note [What a resize costs]
// With resize_cost C > 0, a job's speed-up after a resize counts as discounted by
// f = max(A - R C, 0) / (A + C), where A is its age (seconds since it was submitted) and R its
// resizes so far: the factor Pollux (OSDI'21) applies to a change of allocation. A young job, or
// one resized often for its age, changes only for a large gain; the time a job spends resizing
// stays below its age. Its first workers of a plan come as one resize: the k more workers whose
// worth per worker, f S(w + k) against S(w), is highest, when that adds min_gain a worker; a peer
// gives a worker up only for twice its discounted worth. A higher priority is served whole, as
// above. shoal resizes in place (a rendezvous at a commit), so the scheduler's default is 0;
// under --resize-by restart a resize costs the job its steps since its last commit and its
// workers' start.
Plan plan(const Snapshot& snapshot, const PolicyOptions& options);

}  // namespace shoal::queue
