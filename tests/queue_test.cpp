// The job queue end to end (docs/queue.md): the real `shoal queue serve` with its local agent,
// real elastic training jobs (tests/programs/elastic_worker.cpp, which counts every sample it
// trains on in committed steps), the command line and the REST API.
#include "queue_support.h"

namespace shoal::testing {
namespace {

// Tests 1 and 2 of docs/queue.md: a low-priority elastic job shrinks for a high-priority
// arrival by a graceful leave of its newest workers (the others keep their processes), and grows
// back when the capacity is free again; no sample is lost or repeated.
TEST(Queue, AHighPriorityJobShrinksALowOneThatGrowsBackAfterItAndLosesNoSample) {
  Queue queue("shrink", {"--slots", "4", "--cooldown", "8", "--grow-idle", "2"});
  expect_shrink_and_grow_back(queue, {});
}

// The number after `prefix` in the first line of `text` that has it; -1 when none does.
int64_t number_after(const std::string& text, const std::string& prefix) {
  const auto at = text.find(prefix);
  return at == std::string::npos ? -1 : std::atoll(text.c_str() + at + prefix.size());
}

// A preemptible job that has no surplus to give is preempted whole: its workers leave at one
// commit, which the first of them keeps on disk, and once the high-priority job is done it
// starts again from that very commit, with every sample still trained on once.
TEST(Queue, APreemptedJobResumesFromTheCommitItLeftAt) {
  Queue queue("preempt", {"--slots", "2", "--grow-idle", "1"});
  const int64_t low = queue.submit("--min 2 --max 2 --preemptible --name low " + kWorker + " " +
                                   queue.dir() + "/low.out 6 80");
  ASSERT_TRUE(eventually([&] { return queue.steps(low) >= 10; }, 60s)) << queue.job(low).dump(1);
  const auto first = queue.staying(low);
  ASSERT_EQ(first.size(), 2u);

  const int64_t high = queue.submit("--priority 10 --min 2 --max 2 --name high " + kWorker + " " +
                                    queue.dir() + "/high.out 2 50");
  ASSERT_TRUE(eventually([&] { return finished(queue, high); }, 60s))
      << queue.job(high).dump(1) << queue.job(low).dump(1);
  ASSERT_TRUE(eventually([&] { return finished(queue, low); }, 120s))
      << queue.job(low).dump(1);

  // The first generation's workers left at one step; the second resumed from exactly there.
  const auto logs = queue.logs(low);
  std::set<int64_t> left_at;
  int64_t resumed_at = -1;
  for (const auto& [worker, log] : logs) {
    if (first.count(worker) > 0) {
      left_at.insert(number_after(log, "leaves the job after step "));
    } else if (resumed_at < 0) {
      resumed_at = number_after(log, "resuming from step ");
    }
  }
  ASSERT_EQ(left_at.size(), 1u) << "the preempted workers left at different steps";
  EXPECT_GT(*left_at.begin(), 0);
  EXPECT_EQ(resumed_at, *left_at.begin());
  expect_every_sample_once(queue.dir() + "/low.out", 6);
  expect_every_sample_once(queue.dir() + "/high.out", 2);
  const json job = queue.job(low);
  EXPECT_EQ(job.at("preemptions"), 1);
  EXPECT_EQ(job.at("cycles"), 1);
  EXPECT_EQ(job.at("failures"), 0);
  EXPECT_EQ(logs.size(), 4u) << "two workers, then two more after the preemption";
}

// The cgroup directory of `pid` for the cpu controller ("" when it is in none of ours): cgroup
// v1 lists "N:cpu,cpuacct:/path" (or "N:cpu:/path"), v2 "0::/path".
std::string cpu_group_of(int64_t pid) {
  std::istringstream lines(read_text("/proc/" + std::to_string(pid) + "/cgroup"));
  for (std::string line; std::getline(lines, line);) {
    const auto first = line.find(':');
    const auto second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    const std::string path = line.substr(second + 1);
    if (path.find("shoal-agent-") == std::string::npos) continue;
    if (controllers.find(",cpu,") != std::string::npos) return "/sys/fs/cgroup/cpu" + path;
    if (controllers == ",,") return "/sys/fs/cgroup" + path;
  }
  return "";
}

// Oversubscription: a host of C cores takes --oversubscribe x C workers, and each job's workers
// sit in a cgroup whose CPU weight follows the job's priority (high 2048, low 512 against
// 1024 for priority 0), so the low-priority job gets less of the cores it shares.
TEST(Queue, AnOversubscribedHostGivesLowerPriorityWorkersALowerCpuWeight) {
  Queue queue("oversubscribe", {"--oversubscribe", "2"});
  const int cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  ASSERT_TRUE(eventually([&] { return !queue.client().get("/nodes").at("nodes").empty(); }, 15s));
  EXPECT_EQ(queue.client().get("/nodes").at("nodes").at(0).at("capacity"), 2 * cores);

  const int64_t low = queue.submit("--priority low --min 2 --max 2 " + kWorker + " " + queue.dir() +
                                   "/low.out 500 20");
  const int64_t high = queue.submit("--priority high --min 2 --max 2 " + kWorker + " " +
                                    queue.dir() + "/high.out 500 20");
  ASSERT_TRUE(eventually(
      [&] { return queue.staying(low).size() == 2 && queue.staying(high).size() == 2; }, 60s))
      << queue.job(low).dump(1) << queue.job(high).dump(1);
  const std::map<int64_t, std::string> expected = {{low, "512"}, {high, "2048"}};
  std::set<std::string> groups;
  for (const auto& [job, shares] : expected) {
    for (const auto& [worker, pid] : queue.staying(job)) {
      const std::string group = cpu_group_of(pid);
      if (group.empty() && ::geteuid() != 0)
        GTEST_SKIP() << "no cgroup to place workers in without root";
      ASSERT_FALSE(group.empty()) << "worker " << worker << " (pid " << pid
                                  << ") is in no cgroup of the agent: "
                                  << read_text("/proc/" + std::to_string(pid) + "/cgroup");
      EXPECT_NE(group.find("/job-" + std::to_string(job)), std::string::npos) << group;
      std::string weight = read_text(group + "/cpu.shares");
      if (weight.empty())
        weight = std::to_string(std::stoll(read_text(group + "/cpu.weight")) * 1024 / 100);
      while (!weight.empty() && weight.back() == '\n') weight.pop_back();
      EXPECT_EQ(weight, shares) << group;
      groups.insert(group);
    }
  }
  EXPECT_EQ(groups.size(), 2u);
  std::string out;
  EXPECT_EQ(queue.cli("cancel " + std::to_string(low), &out), 0) << out;
  EXPECT_EQ(queue.cli("cancel " + std::to_string(high), &out), 0) << out;
  // The groups go with their jobs' last workers.
  EXPECT_TRUE(eventually(
      [&] {
        for (const auto& group : groups) {
          if (::access(group.c_str(), F_OK) == 0) return false;
        }
        return true;
      },
      30s));
}

// An agent SIGKILLed cannot remove its cgroups; its workers die with it, and the next agent on
// the host (here the one the scheduler starts again at once) removes the empty groups it left.
TEST(Queue, TheGroupsOfAKilledAgentAreRemovedByTheNextAgent) {
  Queue queue("stale-groups", {"--slots", "1"});
  const int64_t id =
      queue.submit("--min 1 --max 1 " + kWorker + " " + queue.dir() + "/a.out 500 20");
  ASSERT_TRUE(eventually([&] { return queue.staying(id).size() == 1; }, 60s))
      << queue.job(id).dump(1);
  const int64_t worker = queue.staying(id).begin()->second;
  const std::string group = cpu_group_of(worker);
  if (group.empty() && ::geteuid() != 0) GTEST_SKIP() << "no cgroup without root";
  ASSERT_FALSE(group.empty()) << read_text("/proc/" + std::to_string(worker) + "/cgroup");
  const std::string stale = group.substr(0, group.rfind('/'));  // the agent's own directory
  const auto agent = static_cast<pid_t>(std::atoll(read_text(queue.dir() + "/agent.pid").c_str()));
  ASSERT_EQ(::kill(agent, SIGKILL), 0);
  ASSERT_TRUE(eventually([&] { return !alive(worker); }, 10s)) << "the worker outlived its agent";
  ASSERT_TRUE(eventually(
      [&] {
        const int64_t next = std::atoll(read_text(queue.dir() + "/agent.pid").c_str());
        return next != agent && alive(next);
      },
      15s))
      << read_text(queue.dir() + "/serve.log");
  EXPECT_TRUE(eventually([&] { return ::access(stale.c_str(), F_OK) != 0; }, 15s))
      << stale << " is still there";
}

// Test 3: a killed worker is replaced after its back-off, and after more failures than
// --max-restarts the job fails with the reason, leaving no process behind.
TEST(Queue, AKilledWorkerIsReplacedAndRepeatedFailuresFailTheJobWithNoProcessLeft) {
  Queue queue("restart", {"--slots", "4"});
  expect_killed_workers_replaced_then_the_job_failed(queue);
}

// Test 5: the scheduler SIGKILLed mid-run leaves the jobs training; started again on its
// database, it finds the same workers, its events go on without a gap, and it schedules again.
TEST(Queue, ASchedulerKilledMidRunLeavesJobsTrainingAndResumesFromItsDatabase) {
  Queue queue("restart-scheduler", {"--slots", "4"});
  expect_a_killed_scheduler_to_leave_jobs_training(queue);
}

// Bad submissions are refused with one line, and change nothing in the queue's state; a request
// without the token is refused.
TEST(Queue, BadSubmissionsAndRequestsWithoutTheTokenAreRefusedAndChangeNothing) {
  Queue queue("refuse", {"--slots", "2"});
  // The local agent's first heartbeat is an event of its own ("host ... joined").
  ASSERT_TRUE(eventually([&] { return !queue.client().get("/nodes").at("nodes").empty(); }, 15s));
  const auto events_before = queue.client().get("/events?since=0").at("events").size();
  struct Case {
    std::string args;
    std::string error;
  };
  const std::vector<Case> cases = {
      {"--min 3 --max 2 " + kWorker,
       "shoal queue submit: --min 3 is above --max 2; expected --min <= --max\n"},
      {"/nonexistent/train", "shoal queue submit: program '/nonexistent/train' does not exist\n"},
      {"--priority urgent " + kWorker,
       "shoal queue submit: --priority expects an integer from -1000000 to 1000000 (higher first) "
       "or low, normal, high; not 'urgent'\n"},
      {"--min 0 " + kWorker, "shoal queue submit: --min must be at least 1, not 0\n"},
      {"",
       "shoal queue submit: expected the program to run: shoal queue submit [FLAGS] PROGRAM "
       "[ARGS...]\n"},
  };
  for (const auto& c : cases) {
    std::string out;
    EXPECT_EQ(queue.cli("submit " + c.args, &out), 2) << c.args;
    EXPECT_EQ(out, c.error);
  }
  // The REST API checks as well, for clients other than `shoal queue`.
  try {
    queue.client().post("/jobs", json{{"argv", {"/bin/true"}}, {"min", 2}, {"max", 1}});
    ADD_FAILURE() << "a job with --min above --max was taken";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(), "--min 2 is above --max 1; expected --min <= --max");
  }
  try {
    queue::HttpClient("127.0.0.1", queue.port(), "not-the-token").get("/jobs");
    ADD_FAILURE() << "a request with a wrong token was answered";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("the queue's token is missing or wrong"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(queue.client().get("/jobs").at("jobs").empty());
  EXPECT_EQ(queue.client().get("/events?since=0").at("events").size(), events_before);
  std::string out;
  EXPECT_EQ(queue.cli("show 7", &out), 2);
  EXPECT_EQ(out, "shoal queue show: no job 7\n");
  EXPECT_EQ(queue.cli("cancel x", &out), 2);
  EXPECT_EQ(out, "shoal queue cancel: expected a job id (a positive integer), not 'x'\n");
}

}  // namespace
}  // namespace shoal::testing
