// The queue's policy (src/queue/policy.h) on snapshots: admission, shrink, preemption, growth,
// replacements, and a simulated clock for the anti-thrashing rules. The scheduler and the
// simulation in bench/queue run this same code.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "queue/policy.h"

namespace shoal::queue {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

JobView job(int64_t id, int priority, int min, int max, double submitted = 0) {
  JobView view;
  view.id = id;
  view.priority = priority;
  view.min_workers = min;
  view.max_workers = max;
  view.submitted = submitted;
  return view;
}

JobView running(int64_t id, int priority, int min, int max, std::vector<std::string> hosts,
                int64_t first_worker, double last_resize = -kInf) {
  JobView view = job(id, priority, min, max);
  view.running = true;
  view.last_resize = last_resize;
  for (const auto& host : hosts) view.workers.push_back({first_worker++, host, false});
  return view;
}

Snapshot cluster(std::vector<std::pair<std::string, int>> hosts, double now = 100) {
  Snapshot snapshot;
  snapshot.now = now;
  for (const auto& [name, capacity] : hosts) snapshot.hosts.push_back({name, capacity, true, 0});
  return snapshot;
}

std::vector<const Action*> of_kind(const Plan& plan, Action::Kind kind) {
  std::vector<const Action*> out;
  for (const auto& action : plan.actions) {
    if (action.kind == kind) out.push_back(&action);
  }
  return out;
}

TEST(QueuePolicy, AJobStartsOnlyWhenItsMinCanAllStart) {
  auto snapshot = cluster({{"a", 2}, {"b", 1}});
  snapshot.jobs.push_back(job(1, 0, 4, 4));
  Plan plan = queue::plan(snapshot, {});
  EXPECT_TRUE(plan.actions.empty());
  EXPECT_EQ(plan.waiting.at(1), "needs 4 workers at once; the live hosts have 3 slots");

  snapshot.jobs[0] = job(1, 0, 3, 5);
  plan = queue::plan(snapshot, {});
  ASSERT_EQ(plan.actions.size(), 1u);
  EXPECT_EQ(plan.actions[0].kind, Action::kStart);
  EXPECT_EQ(plan.actions[0].hosts, (std::vector<std::string>{"a", "a", "b"}));
  EXPECT_EQ(plan.free_after, 0);
}

TEST(QueuePolicy, PriorityThenAgeDecideWhoStarts) {
  auto snapshot = cluster({{"a", 2}});
  snapshot.jobs.push_back(job(1, 0, 2, 2, 10));
  snapshot.jobs.push_back(job(2, 5, 2, 2, 20));
  snapshot.jobs.push_back(job(3, 5, 2, 2, 15));
  const Plan plan = queue::plan(snapshot, {});
  ASSERT_EQ(plan.actions.size(), 1u);
  EXPECT_EQ(plan.actions[0].job, 3);  // priority 5, and older than job 2
  EXPECT_EQ(plan.waiting.count(1), 1u);
  EXPECT_EQ(plan.waiting.count(2), 1u);
}

TEST(QueuePolicy, AHigherPriorityArrivalTakesTheSurplusOfTheNewestWorkers) {
  auto snapshot = cluster({{"a", 4}});
  snapshot.jobs.push_back(running(1, 0, 2, 4, {"a", "a", "a", "a"}, 10));
  snapshot.jobs.push_back(job(2, 10, 2, 2, 50));
  const Plan plan = queue::plan(snapshot, {});
  const auto shrinks = of_kind(plan, Action::kShrink);
  ASSERT_EQ(shrinks.size(), 1u);
  EXPECT_EQ(shrinks[0]->job, 1);
  EXPECT_EQ(shrinks[0]->workers, (std::vector<int64_t>{13, 12}));
  EXPECT_EQ(shrinks[0]->reason, "shrinks from 4 to 2 workers to make room for job 2 (priority 10)");
  // Job 2 starts in the same round, on the slots the leavers free (Note [Starting on leaving
  // slots]): its workers load while the leavers finish their last step.
  ASSERT_EQ(of_kind(plan, Action::kStart).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->job, 2);
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->hosts, (std::vector<std::string>{"a", "a"}));
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->reason,
            "starts with 2 workers (--min 2, --max 2), 2 on the slots of workers leaving for it");
  EXPECT_TRUE(plan.waiting.empty());

  // Next round: the leavers are still there, and their slots are taken: a third job gets none
  // of them, and nobody else is asked to leave for it (job 1 is at its --min).
  snapshot.jobs[0].workers[2].leaving = true;
  snapshot.jobs[0].workers[3].leaving = true;
  snapshot.jobs[1].running = true;
  snapshot.jobs[1].workers = {{20, "a", false}, {21, "a", false}};
  snapshot.jobs.push_back(job(3, 10, 1, 1, 60));
  const Plan next = queue::plan(snapshot, {});
  EXPECT_TRUE(next.actions.empty());
  EXPECT_EQ(next.waiting.at(3),
            "needs 1 worker at once: 0 free, 0 leaving, 0 to take from lower-priority jobs");

  // Once the leavers are gone, the host runs its 4 slots' worth and job 3 still waits.
  snapshot.jobs[0].workers.resize(2);
  const Plan last = queue::plan(snapshot, {});
  EXPECT_TRUE(last.actions.empty());
}

// A job that lacks only slots that workers already leaving will free starts on them at once,
// and two waiting jobs never claim the same leaving slot.
TEST(QueuePolicy, ALeavingSlotIsClaimedOnce) {
  auto snapshot = cluster({{"a", 2}, {"b", 2}});
  auto low = running(1, 0, 1, 4, {"a", "a", "b", "b"}, 10);
  low.workers[3].leaving = true;  // asked by an earlier round, for a job that has since ended
  snapshot.jobs.push_back(low);
  snapshot.jobs.push_back(job(2, 5, 1, 1, 1));
  snapshot.jobs.push_back(job(3, 5, 1, 1, 2));
  const Plan plan = queue::plan(snapshot, {});
  const auto starts = of_kind(plan, Action::kStart);
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_EQ(starts[0]->job, 2);
  EXPECT_EQ(starts[0]->hosts, (std::vector<std::string>{"b"}));
  EXPECT_EQ(starts[0]->reason,
            "starts with 1 worker (--min 1, --max 1), 1 on the slots of workers leaving");
  EXPECT_EQ(starts[1]->job, 3);  // took job 1's surplus: the newest worker that is not leaving
  ASSERT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kShrink)[0]->workers, (std::vector<int64_t>{12}));
  EXPECT_EQ(starts[1]->hosts, (std::vector<std::string>{"b"}));
}

// Note [Priority takes up to --max]: with its --min assured, a higher-priority arrival takes
// the cooled surplus of lower-priority jobs up to its --max (and the free slots first); a job in
// its cooldown gives nothing beyond what --min needs, and nobody is preempted for more than --min.
TEST(QueuePolicy, AHigherPriorityArrivalTakesLowerPrioritySurplusUpToItsMax) {
  auto snapshot = cluster({{"a", 6}});
  snapshot.jobs.push_back(running(1, 0, 1, 5, {"a", "a", "a", "a", "a"}, 10));  // surplus 4
  snapshot.jobs.push_back(job(2, 10, 2, 4));
  Plan plan = queue::plan(snapshot, {});
  ASSERT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kShrink)[0]->workers, (std::vector<int64_t>{14, 13, 12}));
  EXPECT_EQ(of_kind(plan, Action::kShrink)[0]->reason,
            "shrinks from 5 to 2 workers to make room for job 2 (priority 10)");
  ASSERT_EQ(of_kind(plan, Action::kStart).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->hosts.size(), 4u);  // 1 free, 3 leaving
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->reason,
            "starts with 4 workers (--min 2, --max 4), 3 on the slots of workers leaving for it");

  // With 2 free, --min needs nobody; the surplus still brings the job to its --max.
  snapshot.jobs[0].workers.resize(4);
  snapshot.hosts[0].capacity = 6;
  plan = queue::plan(snapshot, {});
  ASSERT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kShrink)[0]->workers, (std::vector<int64_t>{13, 12}));
  EXPECT_EQ(of_kind(plan, Action::kStart).at(0)->hosts.size(), 4u);

  // In its cooldown job 1 gives only what --min lacks.
  snapshot.jobs[0].workers.resize(5);
  snapshot.jobs[0].workers[4] = {14, "a", false};
  snapshot.jobs[0].last_resize = 95;
  PolicyOptions options;
  options.cooldown = 30;
  plan = queue::plan(snapshot, options);
  EXPECT_TRUE(plan.actions.empty());  // a cooling job gives nothing, not even for --min
  EXPECT_EQ(plan.waiting.at(2),
            "needs 2 workers at once: 1 free, 0 leaving, 0 to take from lower-priority jobs, 4 "
            "more once resized jobs cool down (30 s between resizes)");

  // A preemptible job without surplus is preempted only for --min: its freed slots beyond
  // --min go to the arrival before any other job is shrunk for its --max.
  snapshot = cluster({{"a", 6}});
  snapshot.jobs.push_back(running(1, 0, 2, 3, {"a", "a", "a"}, 10));  // surplus 1
  auto whole = running(2, 1, 3, 3, {"a", "a", "a"}, 20);
  whole.preemptible = true;
  snapshot.jobs.push_back(whole);
  snapshot.jobs.push_back(job(3, 10, 3, 5));
  plan = queue::plan(snapshot, {});
  EXPECT_EQ(of_kind(plan, Action::kPreempt).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kShrink).size(), 1u);  // 1 + 3 for --min 3, then 1 over
  EXPECT_EQ(of_kind(plan, Action::kStart).at(0)->hosts.size(), 4u);
}

TEST(QueuePolicy, WholePreemptibleJobsGoOnlyAfterTheSurplus) {
  auto snapshot = cluster({{"a", 6}});
  snapshot.jobs.push_back(running(1, 0, 2, 3, {"a", "a", "a"}, 10));  // surplus 1
  auto preemptible = running(2, 1, 3, 3, {"a", "a", "a"}, 20);        // no surplus
  preemptible.preemptible = true;
  snapshot.jobs.push_back(preemptible);
  snapshot.jobs.push_back(job(3, 10, 1, 1));
  Plan plan = queue::plan(snapshot, {});
  ASSERT_EQ(plan.actions.size(), 2u);  // one worker is enough: the surplus of job 1
  EXPECT_EQ(plan.actions[0].kind, Action::kShrink);
  EXPECT_EQ(plan.actions[0].job, 1);
  EXPECT_EQ(plan.actions[1].kind, Action::kStart);
  EXPECT_EQ(plan.actions[1].job, 3);

  snapshot.jobs[2] = job(3, 10, 4, 4);  // needs 4: job 1's surplus and all of job 2
  plan = queue::plan(snapshot, {});
  ASSERT_EQ(plan.actions.size(), 3u);
  EXPECT_EQ(of_kind(plan, Action::kStart).at(0)->hosts.size(), 4u);
  EXPECT_EQ(of_kind(plan, Action::kShrink).at(0)->job, 1);
  EXPECT_EQ(of_kind(plan, Action::kPreempt).at(0)->job, 2);
  EXPECT_EQ(of_kind(plan, Action::kPreempt).at(0)->workers, (std::vector<int64_t>{20, 21, 22}));

  snapshot.jobs[1].preemptible = false;  // then nothing is disturbed for a start that cannot come
  plan = queue::plan(snapshot, {});
  EXPECT_TRUE(plan.actions.empty());
  EXPECT_EQ(plan.waiting.at(3),
            "needs 4 workers at once: 0 free, 0 leaving, 1 to take from lower-priority jobs");
}

// Two arrivals in one round: the first takes job 1's surplus, the second preempts job 1 and
// asks only the workers the first did not take (no worker is asked to leave twice).
TEST(QueuePolicy, AJobShrunkAndPreemptedInOneRoundIsAskedForEachWorkerOnce) {
  auto snapshot = cluster({{"a", 8}});
  auto low = running(1, 0, 2, 8, {"a", "a", "a", "a", "a", "a", "a", "a"}, 10);
  low.preemptible = true;
  snapshot.jobs.push_back(low);
  snapshot.jobs.push_back(job(2, 10, 6, 6, 1));
  snapshot.jobs.push_back(job(3, 10, 2, 2, 2));
  const Plan plan = queue::plan(snapshot, {});
  ASSERT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
  ASSERT_EQ(of_kind(plan, Action::kPreempt).size(), 1u);
  const auto& shrunk = of_kind(plan, Action::kShrink)[0]->workers;
  const auto& preempted = of_kind(plan, Action::kPreempt)[0]->workers;
  EXPECT_EQ(shrunk, (std::vector<int64_t>{17, 16, 15, 14, 13, 12}));
  EXPECT_EQ(preempted, (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(of_kind(plan, Action::kPreempt)[0]->reason,
            "is preempted (2 workers leave) to make room for job 3 (priority 10)");
}

TEST(QueuePolicy, EqualOrHigherPriorityJobsAreNeverShrunk) {
  auto snapshot = cluster({{"a", 4}});
  snapshot.jobs.push_back(running(1, 10, 1, 4, {"a", "a", "a", "a"}, 10));
  snapshot.jobs.push_back(job(2, 10, 1, 1));
  const Plan plan = queue::plan(snapshot, {});
  EXPECT_TRUE(plan.actions.empty());
}

TEST(QueuePolicy, HeldSlotsKeepASmallLaterJobFromStarvingABigEarlierOne) {
  auto snapshot = cluster({{"a", 4}});
  snapshot.jobs.push_back(running(1, 5, 2, 2, {"a", "a"}, 10));
  snapshot.jobs.push_back(job(2, 5, 4, 4, 1));  // needs all 4; job 1 (equal priority) keeps its 2
  snapshot.jobs.push_back(job(3, 0, 1, 1, 2));
  const Plan plan = queue::plan(snapshot, {});
  EXPECT_TRUE(plan.actions.empty());  // job 3 may not take the 2 free slots job 2 holds
  EXPECT_EQ(plan.free_after, 0);
  EXPECT_EQ(plan.waiting.count(3), 1u);
}

TEST(QueuePolicy, NoResizeWithinTheCooldown) {
  PolicyOptions options;
  options.cooldown = 30;
  auto snapshot = cluster({{"a", 4}}, 100);
  snapshot.jobs.push_back(running(1, 0, 2, 4, {"a", "a", "a", "a"}, 10, 80));  // resized 20 s ago
  snapshot.jobs.push_back(job(2, 10, 2, 2));
  Plan plan = queue::plan(snapshot, options);
  EXPECT_TRUE(plan.actions.empty());
  EXPECT_EQ(plan.waiting.at(2),
            "needs 2 workers at once: 0 free, 0 leaving, 0 to take from lower-priority jobs, 2 "
            "more once resized jobs cool down (30 s between resizes)");
  snapshot.now = 111;
  plan = queue::plan(snapshot, options);
  EXPECT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
}

TEST(QueuePolicy, IdleCapacityGrowsRunningJobsOnlyAfterGrowIdle) {
  PolicyOptions options;
  options.cooldown = 10;
  options.grow_idle = 5;
  auto snapshot = cluster({{"a", 3}, {"b", 3}}, 100);
  snapshot.jobs.push_back(running(1, 0, 2, 8, {"b", "b"}, 10));
  snapshot.jobs.push_back(running(2, 3, 1, 2, {"a"}, 20));
  snapshot.idle_since = 97;
  Plan plan = queue::plan(snapshot, options);
  EXPECT_TRUE(plan.actions.empty());
  EXPECT_EQ(plan.free_after, 3);

  snapshot.now = 102;
  plan = queue::plan(snapshot, options);
  const auto grows = of_kind(plan, Action::kGrow);
  ASSERT_EQ(grows.size(), 2u);
  EXPECT_EQ(grows[0]->job, 2);  // the higher priority first, up to its --max
  EXPECT_EQ(grows[0]->hosts, (std::vector<std::string>{"a"}));
  EXPECT_EQ(grows[1]->job, 1);  // then job 1, on its own host first
  EXPECT_EQ(grows[1]->hosts, (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(plan.free_after, 0);
}

TEST(QueuePolicy, AReplacementTakesTheSlotKeptForItAfterItsBackoff) {
  auto snapshot = cluster({{"a", 2}, {"b", 2}});
  auto job1 = running(1, 0, 2, 3, {"a", "b"}, 10);
  job1.restarting = {"a"};
  snapshot.jobs.push_back(job1);
  snapshot.jobs.push_back(job(2, 0, 1, 1));
  snapshot.idle_since = -kInf;
  Plan plan = queue::plan(snapshot, {});
  ASSERT_EQ(plan.actions.size(), 1u);  // job 2 gets a free slot, not the one kept on a
  EXPECT_EQ(plan.actions[0].kind, Action::kStart);
  EXPECT_EQ(plan.actions[0].hosts, (std::vector<std::string>{"b"}));

  snapshot.jobs[0].restarts_due = 1;
  snapshot.hosts[0].alive = false;  // host a is lost meanwhile: the replacement goes elsewhere
  snapshot.jobs[0].workers.erase(snapshot.jobs[0].workers.begin());
  plan = queue::plan(snapshot, {});
  const auto replace = of_kind(plan, Action::kReplace);
  ASSERT_EQ(replace.size(), 1u);
  EXPECT_EQ(replace[0]->hosts, (std::vector<std::string>{"b"}));
}

TEST(QueuePolicy, APreemptedJobWaitsForItsOldWorkersBeforeItStartsAgain) {
  auto snapshot = cluster({{"a", 4}});
  auto preempted = job(1, 0, 1, 2);
  preempted.workers = {{10, "a", true}};
  snapshot.jobs.push_back(preempted);
  const Plan plan = queue::plan(snapshot, {});
  EXPECT_TRUE(plan.actions.empty());
  EXPECT_EQ(plan.waiting.at(1), "waits for its 1 worker of before to leave");
}

// A simulated run of the policy, applying its actions at once (workers leave instantly), over
// several minutes: high-priority jobs arriving every 10 s cause at most one resize of the
// low-priority job per cooldown, and two min-4 jobs on 4 slots never both run below their min.
struct Simulation {
  Snapshot snapshot;
  PolicyOptions options;
  std::map<int64_t, std::vector<double>> resizes;
  int64_t next_worker = 1;
  int64_t next_job = 1;
  std::map<int64_t, double> ends;  // running jobs that end at a time

  void step() {
    const Plan plan = queue::plan(snapshot, options);
    for (const auto& action : plan.actions) {
      auto it = std::find_if(snapshot.jobs.begin(), snapshot.jobs.end(),
                             [&](const JobView& j) { return j.id == action.job; });
      ASSERT_NE(it, snapshot.jobs.end());
      if (action.kind == Action::kStart || action.kind == Action::kGrow) {
        for (const auto& host : action.hosts) it->workers.push_back({next_worker++, host, false});
        it->running = true;
      } else {
        for (int64_t id : action.workers) {
          it->workers.erase(std::remove_if(it->workers.begin(), it->workers.end(),
                                           [&](const WorkerView& w) { return w.id == id; }),
                            it->workers.end());
        }
        if (action.kind == Action::kPreempt) it->running = false;
      }
      it->last_resize = snapshot.now;
      if (action.kind != Action::kStart) resizes[action.job].push_back(snapshot.now);
    }
    snapshot.idle_since = plan.free_after > 0 ? std::min(snapshot.idle_since, snapshot.now) : kInf;
    for (auto& j : snapshot.jobs) {
      if (j.running) {
        EXPECT_GE(j.active(), j.min_workers) << "job " << j.id << " at " << snapshot.now;
      }
    }
  }

  void end_due() {
    for (auto it = snapshot.jobs.begin(); it != snapshot.jobs.end();) {
      auto end = ends.find(it->id);
      if (it->running && end != ends.end() && end->second <= snapshot.now) {
        it = snapshot.jobs.erase(it);
      } else {
        ++it;
      }
    }
  }
};

TEST(QueuePolicy, ArrivalsEveryTenSecondsResizeAJobAtMostOncePerCooldown) {
  Simulation sim;
  sim.snapshot = cluster({{"a", 4}}, 0);
  sim.options.cooldown = 30;
  sim.options.grow_idle = 5;
  sim.snapshot.jobs.push_back(job(1, 0, 2, 4));
  int64_t next = 2;
  for (double t = 0; t < 300; t += 0.5) {
    sim.snapshot.now = t;
    // A 2-worker high-priority job for 3 s, every 10 s: without the cooldown the low job would
    // shrink and grow back in every period.
    if (t > 0 && std::fmod(t, 10) == 0) {
      sim.snapshot.jobs.push_back(job(next, 10, 2, 2, t));
      sim.ends[next] = t + 3;
      ++next;
    }
    sim.end_due();
    sim.step();
  }
  const auto& times = sim.resizes[1];
  EXPECT_GE(times.size(), 4u);  // it did shrink and grow, more than once
  for (size_t i = 1; i < times.size(); ++i) {
    EXPECT_GE(times[i] - times[i - 1], 30) << "resizes at " << times[i - 1] << " and " << times[i];
  }
}

TEST(QueuePolicy, TwoMinFourJobsOnFourSlotsNeverDeadlock) {
  Simulation sim;
  sim.snapshot = cluster({{"a", 2}, {"b", 2}}, 0);
  sim.snapshot.jobs.push_back(job(1, 0, 4, 4, 0));
  sim.snapshot.jobs.push_back(job(2, 0, 4, 4, 0.1));
  sim.ends[1] = 20;
  sim.ends[2] = 1e9;
  bool second_ran = false;
  for (double t = 0; t < 60; t += 0.5) {
    sim.snapshot.now = t;
    sim.end_due();
    sim.step();
    int running = 0;
    for (const auto& j : sim.snapshot.jobs) running += j.running ? 1 : 0;
    EXPECT_LE(running, 1) << "at " << t;
    for (const auto& j : sim.snapshot.jobs) second_ran = second_ran || (j.id == 2 && j.running);
  }
  EXPECT_TRUE(second_ran);  // the second starts once the first has ended
}


// Note [Speed-up curves]: the throughput measured at each worker count, fitted; before two counts,
// the prior; with a per-worker batch, Pollux's efficiency from the noise scale.
TEST(GoodputPolicy, SpeedupFollowsTheMeasuredRatesAndTheNoiseScale) {
  PolicyOptions options;
  options.kind = PolicyOptions::Kind::kGoodput;
  JobView measured = job(1, 0, 1, 8);
  measured.throughput = {{1, 100.0}, {2, 190.0}, {4, 340.0}};
  EXPECT_NEAR(speedup(measured, 1, options), 1.0, 1e-12);
  EXPECT_NEAR(speedup(measured, 2, options), 1.9, 0.02);
  EXPECT_NEAR(speedup(measured, 4, options), 3.4, 0.05);
  // Exactly on a curve of the model: T(w) = w / (1 + 0.25 (w - 1)).
  JobView exact = job(2, 0, 1, 8);
  for (int w : {2, 3, 6}) exact.throughput[w] = 50.0 * w / (1 + 0.25 * (w - 1));
  EXPECT_NEAR(speedup(exact, 5, options), 5 / (1 + 0.25 * 4), 1e-9);
  JobView unknown = job(3, 0, 1, 8);
  EXPECT_NEAR(speedup(unknown, 4, options), 4 / (1 + options.overhead_prior * 3), 1e-12);
  unknown.throughput = {{4, 123.0}};  // one count tells nothing of the curve's shape
  EXPECT_NEAR(speedup(unknown, 4, options), 4 / (1 + options.overhead_prior * 3), 1e-12);
  // B_noise = 64 samples, 32 per worker: 4 workers' samples are each worth (64 + 32) / (64 + 128).
  exact.noise_scale = 64;
  exact.batch_per_worker = 32;
  EXPECT_NEAR(speedup(exact, 4, options), 4 / (1 + 0.25 * 3) * 96.0 / 192.0, 1e-9);
}

// A job under BatchPolicy::goodput(): its speed-up is the job's own best goodput at w workers
// (shoal::best_batch over the model fitted to its steps) over its best at one. With fixed costs
// and a large noise scale, a larger world pays beyond its throughput alone: its batch grows.
TEST(GoodputPolicy, AJobWhoseBatchFollowsItsWorldIsWeighedByItsOwnBestGoodput) {
  PolicyOptions options;
  options.kind = PolicyOptions::Kind::kGoodput;
  const shoal::StepTimeModel truth{0.05, 0.001, 0.02, 0.002};
  JobView adaptive = job(1, 0, 1, 16);
  adaptive.batch_limits = {32, 4096, 8, 256, 4};
  for (int w : {1, 2, 4})
    for (double m : {32.0, 128.0}) adaptive.steps.push_back({w, m, truth.seconds(w, m)});
  adaptive.noise_scale = 2000;
  const auto model = shoal::StepTimeModel::fit(adaptive.steps, options.overhead_prior);
  const auto noise = shoal::GradientNoise::of_scale(2000);
  const double one = shoal::best_batch(model, noise, 1, adaptive.batch_limits).goodput;
  for (int w : {1, 2, 5, 16}) {
    EXPECT_NEAR(speedup(adaptive, w, options),
                shoal::best_batch(model, noise, w, adaptive.batch_limits).goodput / one, 1e-9);
  }
  // Two such jobs, one whose gradient is noisy (a larger batch is worth almost as much a sample)
  // and one whose gradient is not (a batch above the base buys little): idle workers go to the
  // first, though the second is older.
  JobView quiet = adaptive;
  quiet.noise_scale = 8;
  EXPECT_LT(speedup(quiet, 8, options), 2.0);
  EXPECT_GT(speedup(adaptive, 8, options), 4.0);
  auto snapshot = cluster({{"a", 8}});
  snapshot.idle_since = 0;
  JobView first = running(2, 0, 1, 8, {"a", "a"}, 10);
  first.batch_limits = quiet.batch_limits;
  first.steps = quiet.steps;
  first.noise_scale = quiet.noise_scale;
  JobView second = running(1, 0, 1, 8, {"a", "a"}, 20);
  second.batch_limits = adaptive.batch_limits;
  second.steps = adaptive.steps;
  second.noise_scale = adaptive.noise_scale;
  second.submitted = 5;
  snapshot.jobs = {first, second};
  const Plan plan = queue::plan(snapshot, options);
  const auto grows = of_kind(plan, Action::kGrow);
  ASSERT_EQ(grows.size(), 1u) << plan.free_after;
  EXPECT_EQ(grows[0]->job, 1) << grows[0]->reason;
  EXPECT_EQ(grows[0]->hosts.size(), 4u) << grows[0]->reason;
}

JobView scales(JobView view) {
  view.throughput = {{1, 100.0}, {2, 198.0}, {4, 390.0}};
  return view;
}
JobView flat(JobView view) {
  view.throughput = {{1, 100.0}, {2, 104.0}, {4, 108.0}};
  return view;
}

PolicyOptions goodput() {
  PolicyOptions options;
  options.kind = PolicyOptions::Kind::kGoodput;
  return options;
}

// Two jobs of one priority, one that scales and one that does not (and is older, so that the
// priority policy serves it first): the idle workers go to the one that scales.
TEST(GoodputPolicy, IdleWorkersGoToTheJobThatScales) {
  auto snapshot = cluster({{"a", 8}});
  snapshot.idle_since = 0;
  snapshot.jobs.push_back(flat(running(1, 0, 1, 8, {"a", "a"}, 10)));
  snapshot.jobs.push_back(scales(running(2, 0, 1, 8, {"a", "a"}, 20)));
  snapshot.jobs[1].submitted = 5;
  Plan old = queue::plan(snapshot, {});
  ASSERT_EQ(of_kind(old, Action::kGrow).size(), 1u);
  EXPECT_EQ(of_kind(old, Action::kGrow)[0]->job, 1);

  Plan plan = queue::plan(snapshot, goodput());
  const auto grows = of_kind(plan, Action::kGrow);
  ASSERT_EQ(grows.size(), 1u);
  EXPECT_EQ(grows[0]->job, 2);
  EXPECT_EQ(grows[0]->hosts.size(), 4u);
  EXPECT_EQ(grows[0]->reason,
            "grows from 2 to 6 workers into capacity idle for 100 s: its speed-up 1.98 -> 5.76, "
            "where a worker is worth most");
  EXPECT_TRUE(of_kind(plan, Action::kShrink).empty());
  // The job that does not scale gets no worker it would not use: what is left stays free.
  snapshot.jobs[1].max_workers = 3;
  plan = queue::plan(snapshot, goodput());
  ASSERT_EQ(of_kind(plan, Action::kGrow).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kGrow)[0]->hosts.size(), 1u);
  EXPECT_EQ(plan.free_after, 3);
}

// Without idle capacity, the last workers of the job that does not scale are reclaimed for the
// one that does, while each is worth at least twice as much there (what it takes off 1 / the
// speed-up, times the job's speed-up on an equal split), down to the fair floor and never below
// --min; a higher priority is never reclaimed for a lower one.
TEST(GoodputPolicy, ReclaimsWorkersThatAddLittleDownToTheFairFloor) {
  auto snapshot = cluster({{"a", 8}});
  snapshot.jobs.push_back(flat(running(1, 0, 1, 8, {"a", "a", "a", "a", "a"}, 10)));
  snapshot.jobs.push_back(scales(running(2, 0, 1, 8, {"a", "a", "a"}, 20)));
  // Speed-ups fitted to the rates: job 1 1.0578, 1.0781, 1.0887, 1.0952 at 2-5 workers; job 2
  // 1.9833, 2.9503, 3.9013, 4.8369, 5.7573 at 2-6. An equal split is 4 workers each, where the
  // speed-ups are 1.0887 and 3.9013. Job 1's 5th worker takes 1/1.0887 - 1/1.0952 = 0.0055 off
  // its 1 / speed-up, weighed 0.0059; job 2's 4th 1/2.9503 - 1/3.9013 = 0.083, weighed 0.32: it
  // moves; job 1's 4th 0.0098 against job 2's 5th 0.19: it moves; job 1's 3rd 0.019 against
  // job 2's 6th 0.13: it moves, and job 1 is at its fair floor (2).
  Plan plan = queue::plan(snapshot, goodput());
  auto shrinks = of_kind(plan, Action::kShrink);
  ASSERT_EQ(shrinks.size(), 1u);
  EXPECT_EQ(shrinks[0]->job, 1);
  EXPECT_EQ(shrinks[0]->workers, (std::vector<int64_t>{14, 13, 12}));  // its newest
  EXPECT_EQ(shrinks[0]->reason,
            "shrinks from 5 to 2 workers: its speed-up 1.10 -> 1.06, where job 2's 2.95 -> 5.76");
  EXPECT_TRUE(queue::plan(snapshot, {}).actions.empty());  // the priority policy leaves them

  // Two jobs that scale alike: the 5th worker of one (1/3.9013 - 1/4.8369 = 0.050) is worth less
  // than twice the other's 4th (0.083): it stays, no move back and forth on a measurement's noise.
  snapshot.jobs[0] = scales(running(1, 0, 1, 8, {"a", "a", "a", "a", "a"}, 10));
  EXPECT_TRUE(queue::plan(snapshot, goodput()).actions.empty());

  // At its fair floor (half of an equal split of 8 slots over 2 jobs: 2) it keeps its workers.
  snapshot.jobs[0] = flat(running(1, 0, 1, 8, {"a", "a"}, 10));
  snapshot.jobs[1] = scales(running(2, 0, 1, 8, {"a", "a", "a", "a", "a", "a"}, 20));
  EXPECT_TRUE(of_kind(queue::plan(snapshot, goodput()), Action::kShrink).empty());
  // Its --min holds above the floor.
  snapshot.jobs[0] = flat(running(1, 0, 3, 8, {"a", "a", "a"}, 10));
  snapshot.jobs[1] = scales(running(2, 0, 1, 8, {"a", "a", "a", "a", "a"}, 20));
  EXPECT_TRUE(of_kind(queue::plan(snapshot, goodput()), Action::kShrink).empty());
  // A higher-priority job that does not scale keeps its workers from a lower one that does.
  snapshot.jobs[0] = flat(running(1, 1, 1, 8, {"a", "a", "a", "a", "a"}, 10));
  snapshot.jobs[1] = scales(running(2, 0, 1, 8, {"a", "a", "a"}, 20));
  EXPECT_TRUE(of_kind(queue::plan(snapshot, goodput()), Action::kShrink).empty());
  // A higher-priority job that scales takes a lower one's workers above its --min, for every
  // worker that adds at least min_gain, up to its --max.
  snapshot.jobs[0] = scales(running(1, 1, 1, 5, {"a", "a", "a"}, 10));
  snapshot.jobs[1] = flat(running(2, 0, 2, 8, {"a", "a", "a", "a", "a"}, 20));
  auto plan_up = queue::plan(snapshot, goodput());
  ASSERT_EQ(of_kind(plan_up, Action::kShrink).size(), 1u);
  EXPECT_EQ(of_kind(plan_up, Action::kShrink)[0]->job, 2);
  EXPECT_EQ(of_kind(plan_up, Action::kShrink)[0]->workers, (std::vector<int64_t>{24, 23}));
  EXPECT_EQ(of_kind(plan_up, Action::kShrink)[0]->reason,
            "shrinks from 5 to 3 workers for job 1 (priority 1), whose speed-up gains at least 0.25 a worker up to "
            "its --max");
  // Peers of a priority above the lowest running give nothing to each other.
  snapshot.jobs[0] = flat(running(1, 1, 1, 8, {"a", "a", "a", "a"}, 10));
  snapshot.jobs[1] = scales(running(2, 1, 1, 8, {"a", "a", "a"}, 20));
  snapshot.jobs.push_back(running(3, 0, 1, 1, {"a"}, 30));
  EXPECT_TRUE(of_kind(queue::plan(snapshot, goodput()), Action::kShrink).empty());
  // Within the cooldown of either, nothing moves.
  snapshot.jobs[0] = flat(running(1, 0, 1, 8, {"a", "a", "a", "a", "a"}, 10, 90));
  EXPECT_TRUE(of_kind(queue::plan(snapshot, goodput()), Action::kShrink).empty());
}

// A waiting job of the same priority starts on the workers of a running one above its fair
// floor, where the priority policy has it wait for the whole job to end; a higher priority is
// still served as before.
TEST(GoodputPolicy, AWaitingJobIsNotStarvedByAPeerAboveItsShare) {
  auto snapshot = cluster({{"a", 8}});
  snapshot.jobs.push_back(scales(running(1, 0, 1, 8, {"a", "a", "a", "a", "a", "a", "a", "a"}, 10)));
  snapshot.jobs.push_back(job(2, 0, 2, 4, 50));
  Plan old = queue::plan(snapshot, {});
  EXPECT_TRUE(old.actions.empty());
  EXPECT_EQ(old.waiting.at(2), "needs 2 workers at once: 0 free, 0 leaving, 0 to take from lower-priority jobs");

  Plan plan = queue::plan(snapshot, goodput());
  const auto shrinks = of_kind(plan, Action::kShrink);
  ASSERT_EQ(shrinks.size(), 1u);
  EXPECT_EQ(shrinks[0]->job, 1);
  EXPECT_EQ(shrinks[0]->workers, (std::vector<int64_t>{17, 16}));
  const auto starts = of_kind(plan, Action::kStart);
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0]->job, 2);
  EXPECT_EQ(starts[0]->hosts.size(), 2u);

  // A higher-priority arrival takes up to its --max from the lower-priority job, as before.
  snapshot.jobs[1] = job(2, 1, 2, 4, 50);
  plan = queue::plan(snapshot, goodput());
  ASSERT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kShrink)[0]->workers.size(), 4u);
  ASSERT_EQ(of_kind(plan, Action::kStart).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->hosts.size(), 4u);
}

// A job of the lowest priority starts under the goodput policy with its --min and the idle
// workers worth most to it against the running jobs' next ones, where the priority policy gives
// it every free slot up to its --max. With a resize cost, a job too young to pay for one starts
// at its --min. A higher-priority arrival is served whole, as before.
TEST(GoodputPolicy, AJobStartsWithItsMinAndTheIdleWorkersWorthMostToIt) {
  auto snapshot = cluster({{"a", 2}, {"b", 3}, {"c", 3}});
  snapshot.idle_since = 0;
  snapshot.jobs.push_back(scales(running(1, 0, 1, 8, {"a", "a"}, 10)));
  snapshot.jobs[0].submitted = 60;  // younger than job 2: its growth is placed after job 2's start
  snapshot.jobs.push_back(job(2, 0, 1, 8, 50));
  Plan old = queue::plan(snapshot, {});
  ASSERT_EQ(of_kind(old, Action::kStart).size(), 1u);
  EXPECT_EQ(of_kind(old, Action::kStart)[0]->hosts.size(), 6u);
  EXPECT_TRUE(of_kind(old, Action::kGrow).empty());

  // Job 2 has measured nothing: the prior (each worker beyond the first adds 5% of a step),
  // S = 1.905, 2.727, 3.478, 4.167 at 2-5 workers; job 1's fitted curve, 2.950, 3.901, 4.837
  // at 3-5. Weighed by each one's speed-up on an equal split (4 workers: 3.478 and 3.901), the
  // five free workers go to job 2's 2nd (1.65), job 1's 3rd (0.64), job 2's 3rd (0.55), job 1's
  // 4th (0.32) and job 2's 4th (0.28); job 1's 5th would be worth 0.19. Each job's workers stay
  // on as few hosts as they can: job 2's first took b (3 free, as c), its others follow it there.
  Plan plan = queue::plan(snapshot, goodput());
  const auto starts = of_kind(plan, Action::kStart);
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0]->job, 2);
  EXPECT_EQ(starts[0]->hosts, (std::vector<std::string>{"b", "b", "b", "c"}));
  EXPECT_EQ(starts[0]->reason,
            "starts with 4 workers (--min 1, --max 8): 3 beyond its first 1 into capacity idle for "
            "100 s, where a worker is worth most: its speed-up 1.00 -> 3.48");
  const auto grows = of_kind(plan, Action::kGrow);
  ASSERT_EQ(grows.size(), 1u);
  EXPECT_EQ(grows[0]->job, 1);
  EXPECT_EQ(grows[0]->hosts, (std::vector<std::string>{"c", "c"}));
  EXPECT_EQ(plan.free_after, 0);

  // At 30 s a resize and submitted now, job 2's resize is worth nothing yet (discount 0): it
  // starts at its --min; job 1, 40 s old (0.57), takes the other five (speed-up 1.98 -> 6.66,
  // discounted 3.80).
  auto options = goodput();
  options.resize_cost = 30;
  snapshot.jobs[1].submitted = 100;
  plan = queue::plan(snapshot, options);
  ASSERT_EQ(of_kind(plan, Action::kStart).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->hosts.size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->reason,
            "starts with 1 worker (--min 1, --max 8); more as they are worth it");
  ASSERT_EQ(of_kind(plan, Action::kGrow).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kGrow)[0]->hosts.size(), 5u);

  // Of a higher priority than every running job, it starts as under the priority policy: on the
  // six free slots and job 1's worker above its --min.
  snapshot.jobs[1] = job(2, 1, 1, 8, 50);
  plan = queue::plan(snapshot, goodput());
  ASSERT_EQ(of_kind(plan, Action::kStart).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kStart)[0]->hosts.size(), 7u);
  EXPECT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
}

// Note [What a resize costs]: with a cost, a job grows only for a gain that pays for it (its
// speed-up after discounted by max(age - resizes cost, 0) / (age + cost)), by the jump of
// workers worth most per worker, and a peer's worker moves only when the move pays both.
TEST(GoodputPolicy, AResizeMustPayForWhatItCosts) {
  auto snapshot = cluster({{"a", 8}});  // now = 100: the jobs are 100 s old
  snapshot.idle_since = 0;
  snapshot.jobs.push_back(scales(running(1, 0, 1, 8, {"a", "a", "a", "a"}, 10)));
  auto options = goodput();
  // Free, the four idle workers go one by one: each adds more than min_gain.
  Plan plan = queue::plan(snapshot, options);
  ASSERT_EQ(of_kind(plan, Action::kGrow).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kGrow)[0]->hosts.size(), 4u);
  // At 30 s a resize, the discount is 100 / 130 = 0.77: a fifth worker (speed-up 3.90 -> 4.84,
  // discounted 3.72) would not pay for the resize, four more do (-> 7.55, discounted 5.81), and
  // are worth more per worker than two or three (1/3.90 - 1/5.81 over 4 against 1/3.90 - 1/4.43
  // over 2 and 1/3.90 - 1/5.13 over 3).
  options.resize_cost = 30;
  plan = queue::plan(snapshot, options);
  ASSERT_EQ(of_kind(plan, Action::kGrow).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kGrow)[0]->hosts.size(), 4u);
  EXPECT_EQ(of_kind(plan, Action::kGrow)[0]->reason,
            "grows from 4 to 8 workers into capacity idle for 100 s: its speed-up 3.90 -> 7.55, "
            "where a worker is worth most (worth its resize at 0.77 of that speed-up)");
  // Younger (10 s: 0.25), or resized three times in its 100 s (0.08), it stays as it is.
  snapshot.jobs[0].submitted = 90;
  plan = queue::plan(snapshot, options);
  EXPECT_TRUE(plan.actions.empty());
  EXPECT_EQ(plan.free_after, 4);
  snapshot.jobs[0].submitted = 0;
  snapshot.jobs[0].resizes = 3;
  EXPECT_TRUE(queue::plan(snapshot, options).actions.empty());

  // Between peers (the jobs of ReclaimsWorkersThatAddLittleDownToTheFairFloor, where three
  // workers move for free): at 100 s old the receiver's first worker does not pay for its resize
  // (2.95 -> 3.90, discounted 3.00); at 3000 s (0.99) all three move as before.
  snapshot = cluster({{"a", 8}});
  snapshot.jobs.push_back(flat(running(1, 0, 1, 8, {"a", "a", "a", "a", "a"}, 10)));
  snapshot.jobs.push_back(scales(running(2, 0, 1, 8, {"a", "a", "a"}, 20)));
  EXPECT_TRUE(queue::plan(snapshot, options).actions.empty());
  snapshot.now = 3000;
  plan = queue::plan(snapshot, options);
  ASSERT_EQ(of_kind(plan, Action::kShrink).size(), 1u);
  EXPECT_EQ(of_kind(plan, Action::kShrink)[0]->workers, (std::vector<int64_t>{14, 13, 12}));
  // A giver resized often pays more for its resize (3000 s, 90 resizes: 0.10): its workers stay.
  snapshot.jobs[0].resizes = 90;
  EXPECT_TRUE(queue::plan(snapshot, options).actions.empty());
}

}  // namespace
}  // namespace shoal::queue
