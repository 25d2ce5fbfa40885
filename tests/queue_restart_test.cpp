// Resizing by checkpoint-restart (`shoal queue serve --resize-by restart`; docs/queue.md,
// "Policy", and Note [Resizing by restart] in src/queue/scheduler_jobs.cpp): the baseline that
// bench/queue_real runs beside shoal's own resizing. The policy decides as it does with leave;
// each shrink or grow stops every worker of the job at one commit and starts the job again at
// its new size from that commit.
#include <algorithm>
#include <vector>

#include "queue_support.h"

namespace shoal::testing {
namespace {

// The number after `prefix` in the first line of `text` that has it; -1 when none does.
int64_t number_after(const std::string& text, const std::string& prefix) {
  const auto at = text.find(prefix);
  return at == std::string::npos ? -1 : std::atoll(text.c_str() + at + prefix.size());
}

struct Generation {
  std::vector<json> workers;  // from worker_list, by id
  int64_t first_start_ms = INT64_MAX;
  int64_t last_end_ms = 0;
  int64_t left_at = -1;     // the last step any of them left after
  int64_t resumed_at = -1;  // the step the generation resumed from
};

// A low-priority job of 2 to 4 workers is shrunk to 2 for a high-priority one, then grown back
// to 4 when that one ends. By restart, each resize is a new generation of processes: none of the
// workers of before stays, the new ones start only once all of those have left, they resume from
// the step the last of them left after, and every sample is still trained on once per epoch.
TEST(QueueRestart, AJobResizedByRestartResumesFromItsCommitAndLosesNoSample) {
  Queue queue("restart",
              {"--slots", "4", "--cooldown", "4", "--grow-idle", "1", "--resize-by", "restart"});
  const int64_t low =
      queue.submit("--min 2 --max 4 --name low " + kWorker + " " + queue.dir() + "/low.out 16 80");
  ASSERT_TRUE(
      eventually([&] { return queue.staying(low).size() == 4 && queue.steps(low) > 0; }, 60s))
      << queue.job(low).dump(1);

  const int64_t high = queue.submit("--priority 10 --min 2 --max 2 --name high " + kWorker + " " +
                                    queue.dir() + "/high.out 2 50");
  ASSERT_TRUE(eventually([&] { return queue.state(high) == "done"; }, 90s))
      << queue.job(high).dump(1) << queue.job(low).dump(1);
  ASSERT_TRUE(eventually([&] { return finished(queue, low); }, 180s))
      << queue.job(low).dump(1);
  expect_every_sample_once(queue.dir() + "/low.out", 16);
  expect_every_sample_once(queue.dir() + "/high.out", 2);

  // Its workers by generation: 4, then 2 for the high job, then 4 again (ids only grow).
  const json job = queue.job(low);
  std::vector<json> list(job.at("worker_list").begin(), job.at("worker_list").end());
  std::sort(list.begin(), list.end(),
            [](const json& a, const json& b) { return a.at("id") < b.at("id"); });
  ASSERT_EQ(list.size(), 10u) << job.dump(1);
  const auto logs = queue.logs(low);
  std::vector<Generation> generations(3);
  const size_t sizes[] = {4, 2, 4};
  size_t next = 0;
  for (size_t g = 0; g < 3; ++g) {
    Generation& gen = generations[g];
    for (size_t i = 0; i < sizes[g]; ++i, ++next) {
      const json& w = list[next];
      gen.workers.push_back(w);
      gen.first_start_ms = std::min(gen.first_start_ms, w.at("started_ms").get<int64_t>());
      gen.last_end_ms = std::max(gen.last_end_ms, w.at("ended_ms").get<int64_t>());
      ASSERT_EQ(logs.count(w.at("id")), 1u) << "no log of worker " << w.at("id");
      const std::string& log = logs.at(w.at("id"));
      gen.left_at = std::max(gen.left_at, number_after(log, "leaves the job after step "));
      if (gen.resumed_at < 0) gen.resumed_at = number_after(log, "resuming from step ");
    }
  }
  for (size_t g = 1; g < 3; ++g) {
    SCOPED_TRACE("generation " + std::to_string(g + 1));
    const Generation& before = generations[g - 1];
    const Generation& now = generations[g];
    // The whole job stopped: every worker of before left at a commit (none stays, none failed)...
    for (const json& w : before.workers) {
      EXPECT_EQ(w.at("state"), "exited") << w.dump();
      EXPECT_NE(w.at("exit").get<std::string>().find("code 0"), std::string::npos) << w.dump();
    }
    // ...before any worker of the new generation started, which resumed from the last commit.
    EXPECT_GE(now.first_start_ms, before.last_end_ms);
    EXPECT_GT(before.left_at, 0);
    EXPECT_EQ(now.resumed_at, before.left_at);
  }
  // The last generation trains in a world of 4.
  bool four = false;
  for (const json& w : generations[2].workers) {
    four = four || logs.at(w.at("id")).find("world 4") != std::string::npos;
  }
  EXPECT_TRUE(four) << "the job did not train with 4 workers after it grew back";

  EXPECT_EQ(job.at("resizes"), 2);
  EXPECT_EQ(job.at("cycles"), 1);
  EXPECT_EQ(job.at("preemptions"), 0);
  EXPECT_EQ(job.at("failures"), 0);
  int restarts = 0;
  for (const auto& e : json(job.at("events"))) restarts += e.at("kind") == "restart" ? 1 : 0;
  EXPECT_EQ(restarts, 2);
}

TEST(QueueRestart, AnUnknownResizeModeIsRefusedWithOneLine) {
  std::string out;
  const int code = shell(shoal_bin() + " queue serve --resize-by stop 2>&1", &out);
  EXPECT_EQ(code, 2) << out;
  EXPECT_EQ(out, "shoal queue serve: --resize-by expects leave or restart, not 'stop'\n");
}

}  // namespace
}  // namespace shoal::testing
