// The queue across hosts (docs/queue.md): two network namespaces joined by a veth pair, the
// scheduler and its local agent on host A, `shoal agent` on host B. A job's workers span both
// hosts, find each other through the agents' memberships, shrink and grow back.
#include <sched.h>

#include "queue_support.h"

namespace shoal::testing {
namespace {

// This test's process (its thread, and every process it forks) moves into a host's network
// namespace, so that the scheduler it starts and its own REST calls live on that host.
bool enter_network_namespace(const std::string& name) {
  const int fd = ::open(("/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool entered = ::setns(fd, CLONE_NEWNET) == 0;
  ::close(fd);
  return entered;
}

TEST(QueueMultiHost, AJobAcrossTwoHostsShrinksForAHighPriorityOneAndGrowsBackLosingNoSample) {
  TwoHosts hosts;
  if (auto why = hosts.create()) GTEST_SKIP() << *why;
  ASSERT_TRUE(enter_network_namespace(hosts.name(0))) << "setns into " << hosts.name(0);
  constexpr double kCooldown = 8;
  Queue queue("multihost", {"--host", TwoHosts::kAddressA, "--slots", "2", "--cooldown", "8",
                            "--grow-idle", "2"});
  const std::string hosts_path = queue.dir() + "/hosts";
  std::ofstream(hosts_path) << hosts.hosts_file();
  Agent agent_b(queue, queue.dir() + "/agent-b", {"--slots", "2"}, {}, hosts.on_host(1, hosts_path),
                TwoHosts::kAddressA);
  ASSERT_TRUE(eventually(
      [&] {
        int alive_hosts = 0;
        for (const auto& node : json(queue.client().get("/nodes").at("nodes"))) {
          alive_hosts += node.at("alive").get<bool>() ? 1 : 0;
        }
        return alive_hosts == 2;
      },
      30s))
      << queue.client().get("/nodes").dump(1) << agent_b.log();

  // Each worker's log, wherever its agent keeps it.
  const auto logs = [&](int64_t job) {
    std::map<int64_t, std::string> out;
    for (const auto& w : json(queue.job(job).at("worker_list"))) {
      const std::string dir = w.at("host") == hosts.name(1) ? "/agent-b" : "/agent";
      out[w.at("id")] = read_text(queue.dir() + dir + "/job-" + std::to_string(job) + "/worker-" +
                                  std::to_string(w.at("id").get<int64_t>()) + ".log");
    }
    return out;
  };
  const auto any_log_has = [&](int64_t job, const std::string& text) {
    for (const auto& [worker, log] : logs(job)) {
      if (log.find(text) != std::string::npos) return true;
    }
    return false;
  };
  const auto hosts_of = [&](int64_t job) {
    std::set<std::string> out;
    for (const auto& w : json(queue.job(job).at("worker_list"))) {
      if (w.at("state") == "running" && !w.at("leave").get<bool>()) out.insert(w.at("host"));
    }
    return out;
  };

  const int64_t low =
      queue.submit("--min 2 --max 4 --name low " + kWorker + " " + queue.dir() + "/low.out 16 80");
  ASSERT_TRUE(eventually(
      [&] { return queue.staying(low).size() == 4 && any_log_has(low, "world=4 step="); }, 60s))
      << queue.job(low).dump(1);
  EXPECT_EQ(hosts_of(low).size(), 2u) << "the job's four workers should span both hosts";
  const auto before = queue.staying(low);

  const auto submitted = Clock::now();
  const int64_t high = queue.submit("--priority 10 --min 2 --max 2 --name high " + kWorker + " " +
                                    queue.dir() + "/high.out 2 50");
  ASSERT_TRUE(eventually([&] { return any_log_has(high, "step 1 world 2"); }, 30s))
      << queue.job(high).dump(1);
  expect_first_step_soon(submitted, "");

  // The low job kept its two oldest workers, the very same processes.
  const auto kept = queue.staying(low);
  ASSERT_EQ(kept.size(), 2u) << queue.job(low).dump(1);
  expect_the_oldest_kept(before, kept);

  ASSERT_TRUE(eventually([&] { return queue.state(high) == "done"; }, 60s))
      << queue.job(high).dump(1);
  const auto high_done = Clock::now();
  ASSERT_TRUE(eventually([&] { return queue.staying(low).size() == 4; }, 60s))
      << queue.job(low).dump(1);
  const double regrown = seconds_since(high_done);
  EXPECT_LT(regrown, kCooldown + 5)
      << "the low job was back to 4 workers " << regrown << " s after the high one ended";
  EXPECT_EQ(hosts_of(low).size(), 2u) << "the job should span both hosts again";
  for (const auto& [id, pid] : kept) EXPECT_EQ(queue.staying(low).at(id), pid);

  ASSERT_TRUE(eventually([&] { return queue.state(low) == "done"; }, 180s))
      << queue.job(low).dump(1);
  expect_every_sample_once(queue.dir() + "/low.out", 16);
  expect_every_sample_once(queue.dir() + "/high.out", 2);
  EXPECT_EQ(queue.job(low).at("resizes"), 2);
}

}  // namespace
}  // namespace shoal::testing
