// The queue across hosts (docs/queue.md): two network namespaces joined by a veth pair, the
// scheduler and its local agent on host A, `shoal agent` on host B. A job's workers span both
// hosts, find each other through the agents' memberships, shrink and grow back (tests 1 and 2),
// survive their workers' deaths on either host (test 3), never thrash or deadlock (test 4), and
// survive the scheduler's death (test 5).
#include "queue_support.h"

namespace shoal::testing {
namespace {

class QueueMultiHost : public QueueOnTwoHosts {};

// Tests 1 and 2 across hosts: the low job's four workers span both hosts before the shrink and
// after the grow.
TEST_F(QueueMultiHost, AJobAcrossTwoHostsShrinksForAHighPriorityOneAndGrowsBackLosingNoSample) {
  Queue& queue = start("multihost", {"--cooldown", "8", "--grow-idle", "2"});
  ASSERT_FALSE(HasFailure());
  ShrinkAndGrowBack test;
  test.hosts = 2;
  expect_shrink_and_grow_back(queue, test);
}

// Test 3 across hosts: kills alternate between the hosts; each is replaced, and the third fails
// the job, leaving no process on either host.
TEST_F(QueueMultiHost, KilledWorkersOnEitherHostAreReplacedAndRepeatedFailuresFailTheJob) {
  Queue& queue = start("multihost-restart");
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(expect_killed_workers_replaced_then_the_job_failed(queue).size(), 2u)
      << "the kills should have hit both hosts";
}

// Test 5 across hosts: with the scheduler on host A SIGKILLed, a job on both hosts trains on;
// the restarted scheduler reconciles with both agents and schedules again.
TEST_F(QueueMultiHost, ASchedulerKilledMidRunLeavesAJobOnBothHostsTraining) {
  Queue& queue = start("multihost-scheduler");
  ASSERT_FALSE(HasFailure());
  const json before = expect_a_killed_scheduler_to_leave_jobs_training(queue);
  EXPECT_EQ(hosts_of(before).size(), 2u) << "the job should have spanned both hosts";
}

// Test 4, no deadlock: two jobs of --min 4 on 4 slots over two hosts. Gang admission starts one
// whole; the other waits for all four slots, never holding a part of them: at no moment does a
// running job have fewer than its 4 workers, and both train every sample once.
TEST_F(QueueMultiHost, TwoMinFourJobsOnFourSlotsRunOneAfterTheOtherNeverBelowTheirMin) {
  Queue& queue = start("multihost-gang");
  ASSERT_FALSE(HasFailure());
  const int64_t a = queue.submit("--min 4 --max 4 --name a " + kWorker + " " + queue.dir() +
                                 "/a.out 3 50");
  const int64_t b = queue.submit("--min 4 --max 4 --name b " + kWorker + " " + queue.dir() +
                                 "/b.out 3 50");
  int polls = 0;
  std::set<int64_t> ran;
  ASSERT_TRUE(eventually(
      [&] {
        ++polls;
        int running = 0;
        for (int64_t id : {a, b}) {
          const json job = queue.job(id);
          if (job.at("state") != "running") continue;
          ++running;
          ran.insert(id);
          // Its workers that have not ended, unless one already finished the training.
          int held = 0;
          bool finishing = false;
          for (const auto& w : job.at("worker_list")) {
            if (w.at("state") != "exited") ++held;
            if (w.at("state") == "exited" && w.at("exit") == "exited with code 0") finishing = true;
          }
          if (!finishing) {
            EXPECT_EQ(held, 4) << job.dump(1);
          }
        }
        EXPECT_LE(running, 1) << "two jobs of --min 4 ran at once on 4 slots";
        return finished(queue, a) && finished(queue, b);
      },
      180s))
      << queue.job(a).dump(1) << queue.job(b).dump(1);
  EXPECT_EQ(ran.size(), 2u);
  EXPECT_GT(polls, 50);
  expect_every_sample_once(queue.dir() + "/a.out", 3);
  expect_every_sample_once(queue.dir() + "/b.out", 3);
  for (int64_t id : {a, b}) {
    EXPECT_EQ(queue.job(id).at("resizes"), 0);
    EXPECT_EQ(queue.job(id).at("preemptions"), 0);
  }
}

// Test 4, no thrash: a 2-worker high-priority job arrives every 10 s for a minute while a low job
// of --min 2 --max 4 runs on both hosts. It shrinks for the arrivals and grows back between them,
// but never twice within --cooldown (12 s here: longer than the period, so the cooldown binds),
// and every high job trains every sample once.
TEST_F(QueueMultiHost, HighPriorityArrivalsEveryTenSecondsResizeALowJobAtMostOncePerCooldown) {
  constexpr int64_t kCooldownMs = 12000;
  Queue& queue = start("multihost-thrash", {"--cooldown", "12", "--grow-idle", "1"});
  ASSERT_FALSE(HasFailure());
  const int64_t low =
      queue.submit("--min 2 --max 4 --name low " + kWorker + " " + queue.dir() + "/low.out 400 80");
  ASSERT_TRUE(eventually([&] { return queue.staying(low).size() == 4; }, 60s))
      << queue.job(low).dump(1);
  std::vector<int64_t> highs;
  const auto start_time = Clock::now();
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_until(start_time + std::chrono::seconds(10 * i));
    highs.push_back(queue.submit("--priority 10 --min 2 --max 2 " + kWorker + " " + queue.dir() +
                                 "/high-" + std::to_string(i) + ".out 1 50"));
  }
  for (int64_t high : highs) {
    ASSERT_TRUE(eventually([&] { return finished(queue, high); }, 90s))
        << queue.job(high).dump(1);
  }
  std::string out;
  EXPECT_EQ(queue.cli("cancel " + std::to_string(low), &out), 0) << out;

  std::vector<int64_t> resizes;
  for (const auto& e : json(queue.client().get("/events?since=0").at("events"))) {
    if (e.at("job") == low && (e.at("kind") == "shrink" || e.at("kind") == "grow"))
      resizes.push_back(e.at("time_ms"));
  }
  std::cout << "[ measured ] the low job's resizes, s after its first:";
  for (int64_t at : resizes) std::cout << " " << (at - resizes.front()) / 1000.0;
  std::cout << std::endl;
  EXPECT_GE(resizes.size(), 3u) << "the low job should have shrunk and grown back";
  for (size_t i = 1; i < resizes.size(); ++i) {
    EXPECT_GE(resizes[i] - resizes[i - 1], kCooldownMs)
        << "resizes " << i << " and " << i + 1 << " of the low job";
  }
  for (size_t i = 0; i < highs.size(); ++i)
    expect_every_sample_once(queue.dir() + "/high-" + std::to_string(i) + ".out", 1);
}

}  // namespace
}  // namespace shoal::testing
