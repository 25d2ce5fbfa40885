// Elastic jobs whose model is sharded (DataParallel at a ZeRO stage; Note [Slices in an elastic
// job], src/elastic/slices.cpp), end to end with tests/programs/elastic_worker: workers SIGKILLed,
// joining and leaving, each worker starting from parameters of its own seed. Oracles: the final
// parameters equal a one-process run over the same global batches, and every sample of every
// epoch was trained on exactly once in committed steps.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <regex>
#include <tuple>

#include <gtest/gtest.h>

#include "elastic_support.h"

namespace {

using namespace shoal::testing::elastic;
using shoal::testing::RunResult;
using shoal::testing::ShoalRun;
using namespace std::chrono_literals;

// The worker's variables for a stage and optimizer, set for the jobs a test starts.
struct ZeroWorker {
  ZeroWorker(int stage, bool adam) {
    ::setenv("ELASTIC_WORKER_ZERO", std::to_string(stage).c_str(), 1);
    ::setenv("ELASTIC_WORKER_ADAM", adam ? "1" : "0", 1);
  }
  ~ZeroWorker() {
    for (const char* name : {"ELASTIC_WORKER_ZERO", "ELASTIC_WORKER_ADAM", "SHOAL_CHECKPOINT",
                             "SHOAL_CHECKPOINT_EVERY", "ELASTIC_WORKER_DIE_AFTER",
                             "ELASTIC_WORKER_DIE_BEFORE_BACKWARD"}) {
      ::unsetenv(name);
    }
  }
};

// The same program replicated on one process (its seed is the first worker's).
Outcome reference(int epochs, bool adam) {
  ::setenv("ELASTIC_WORKER_ADAM", adam ? "1" : "0", 1);
  Outcome outcome = one_process(epochs);
  ::unsetenv("ELASTIC_WORKER_ADAM");
  return outcome;
}

std::string case_name(int stage, bool adam) {
  return "stage" + std::to_string(stage) + (adam ? "_adam" : "_sgd");
}

// 3 workers; one SIGKILLed mid-epoch, one joining later, one leaving with SIGTERM; the slices are
// cut again at each change. Durable commits every 5: a kill that lands between a worker's
// optimizer step and its commit's copy (Note [Slices in an elastic job]) takes the job back to
// the last of them, anywhere else nothing is lost; the oracles hold either way.
class ElasticZero : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ElasticZero, KillJoinLeaveEndsAsOneProcess) {
  const auto [stage, adam] = GetParam();
  constexpr int kEpochs = 6;
  const Outcome want = reference(kEpochs, adam);
  const std::string name = "zero_" + case_name(stage, adam);
  const std::string out = temp_path(name), checkpoint = temp_path(name + ".ckpt");
  std::remove(checkpoint.c_str());
  ZeroWorker worker(stage, adam);
  ::setenv("SHOAL_CHECKPOINT", checkpoint.c_str(), 1);
  ::setenv("SHOAL_CHECKPOINT_EVERY", "5", 1);
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", temp_path(name + ".token"),
                kWorker, out, std::to_string(kEpochs), "60"});
  ASSERT_TRUE(step_at_least(job, 12, 3, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 3);
  ASSERT_EQ(first.size(), 3u);

  kill_join_leave(job, first, {kWorker, out, std::to_string(kEpochs), "60"}, 4, out, kEpochs, want);
}

INSTANTIATE_TEST_SUITE_P(Stages, ElasticZero,
                         ::testing::Values(std::make_tuple(1, false), std::make_tuple(2, true),
                                           std::make_tuple(3, true)),
                         [](const auto& info) {
                           return case_name(std::get<0>(info.param), std::get<1>(info.param));
                         });

// A worker SIGKILLed right before its backward, with no durable commit: the others' backward
// fails with their slices at the last commit, and the dead worker's come from the copy on the
// next one. Nothing is lost: the job ends as one process. The last worker of 3, then of 2, dies
// so: the second time the copy was made by the round's re-cut.
class ElasticZeroCopies : public ::testing::TestWithParam<int> {};

TEST_P(ElasticZeroCopies, AWorkerKilledBeforeItsBackwardLosesNothing) {
  const int stage = GetParam();
  constexpr int kEpochs = 3;
  const Outcome want = reference(kEpochs, true);
  const std::string name = "zero_copy_" + std::to_string(stage);
  const std::string out = temp_path(name);
  ZeroWorker worker(stage, true);
  ::setenv("ELASTIC_WORKER_DIE_BEFORE_BACKWARD", "10", 1);
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", temp_path(name + ".token"),
                kWorker, out, std::to_string(kEpochs), "20"});
  const RunResult result = job.wait(120s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << result.err;
  EXPECT_EQ(result.err.find("resuming from step"), std::string::npos) << result.err;
  // The last worker of each world dies at the same point: 3 workers, then 2, then 1, each round
  // from the last commit.
  const auto rounds = starts(result.out);
  ASSERT_EQ(rounds.size(), 6u) << result.out;
  for (size_t i = 3; i < rounds.size(); ++i) {
    EXPECT_EQ(rounds[i].step, 10) << result.out;
    EXPECT_EQ(rounds[i].world, i < 5 ? 2 : 1) << result.out;
  }
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, kEpochs);
  expect_same_parameters(outcome, want);
}

INSTANTIATE_TEST_SUITE_P(Stages, ElasticZeroCopies, ::testing::Values(1, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// A worker SIGKILLed right after its optimizer's step, before its commit's copy: its new slices
// are lost. Without a durable commit every worker stops, in bounded time, with an error that
// names the lost part and what to do; with one (every 5 commits) the job goes back to it and
// ends as one process.
class ElasticZeroLost : public ::testing::TestWithParam<bool> {};

TEST_P(ElasticZeroLost, DurableCommitOrClearError) {
  const bool durable = GetParam();
  constexpr int kEpochs = 3;
  const Outcome want = durable ? reference(kEpochs, true) : Outcome{};
  const std::string name = std::string("zero_lost_") + (durable ? "durable" : "none");
  const std::string out = temp_path(name), checkpoint = temp_path(name + ".ckpt");
  std::remove(checkpoint.c_str());
  ZeroWorker worker(2, true);
  ::setenv("ELASTIC_WORKER_DIE_AFTER", "12", 1);
  if (durable) {
    ::setenv("SHOAL_CHECKPOINT", checkpoint.c_str(), 1);
    ::setenv("SHOAL_CHECKPOINT_EVERY", "5", 1);
  }
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", temp_path(name + ".token"),
                kWorker, out, std::to_string(kEpochs), "20"});
  const RunResult result = job.wait(120s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_NE(result.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << result.err;
  if (!durable) {
    EXPECT_NE(result.exit_code, 0) << result.out;
    EXPECT_NE(result.err.find("elastic: part(s) 2 of the slices of step 13 were lost with their "
                              "workers"),
              std::string::npos)
        << result.err;
    EXPECT_NE(result.err.find("expected a durable commit (SHOAL_CHECKPOINT) to resume from"),
              std::string::npos)
        << result.err;
    return;
  }
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.err.find("resuming from step 10 (epoch 0) of " + checkpoint), std::string::npos)
      << result.err;
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, kEpochs);
  expect_same_parameters(outcome, want);
}

INSTANTIATE_TEST_SUITE_P(Durable, ElasticZeroLost, ::testing::Values(false, true),
                         [](const auto& info) {
                           return info.param ? std::string("durable") : std::string("none");
                         });

// An optimizer built on the module's parameters rather than the DataParallel's slices is refused
// when the State is made, in one line, on every worker.
TEST(ElasticZeroUsage, TheOptimizerMustHoldTheSlices) {
  ZeroWorker worker(2, false);
  ::setenv("ELASTIC_WORKER_OPTIMIZE_MODULE", "1", 1);
  const RunResult result = shoal::testing::run_shoal(
      {"--min", "1", "--max", "2", "-n", "2", "--token-file", temp_path("zero_usage.token"),
       kWorker, temp_path("zero_usage"), "1"},
      60s);
  ::unsetenv("ELASTIC_WORKER_OPTIMIZE_MODULE");
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.err.find("elastic::State: the optimizer does not hold the slices of the "
                            "DataParallel at a ZeRO stage; expected it built on the "
                            "DataParallel's parameters()"),
            std::string::npos)
      << result.err;
}

// Every worker of a sharded job (3 workers, stage 3) SIGKILLed: the job started again on 2 loads
// each worker's part of the durable commit (no member holds the job's values) and ends as one
// process.
TEST(ElasticZeroDurable, JobStartedAgainLoadsItsPartsOfTheDurableCommit) {
  constexpr int kEpochs = 3;
  const Outcome want = reference(kEpochs, true);
  const std::string out = temp_path("zero_durable"), checkpoint = temp_path("zero_durable.ckpt");
  std::remove(checkpoint.c_str());
  ZeroWorker worker(3, true);
  ::setenv("SHOAL_CHECKPOINT", checkpoint.c_str(), 1);
  ::setenv("SHOAL_CHECKPOINT_EVERY", "5", 1);
  ShoalRun first({"--min", "1", "--max", "3", "-n", "3", "--token-file",
                  temp_path("zero_durable1.token"), kWorker, out, std::to_string(kEpochs), "40"});
  ASSERT_TRUE(step_at_least(first, 12, 3, 60s)) << first.so_far().out << first.so_far().err;
  const auto pids = ranks_of_round(starts(first.so_far().out), 3);
  ASSERT_EQ(pids.size(), 3u);
  for (const auto& [rank, pid] : pids) ASSERT_EQ(::kill(pid, SIGKILL), 0);
  EXPECT_NE(first.wait(60s).exit_code, 0);

  ShoalRun again({"--min", "1", "--max", "2", "-n", "2", "--token-file",
                  temp_path("zero_durable2.token"), kWorker, out, std::to_string(kEpochs), "10"});
  const RunResult result = again.wait(120s);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  std::smatch resumed;
  ASSERT_TRUE(std::regex_search(result.err, resumed, std::regex(R"(resuming from step (\d+) )")))
      << result.err;
  const int64_t step = std::stoll(resumed[1]);
  EXPECT_GE(step, 10);
  EXPECT_EQ(step % 5, 0);
  ASSERT_FALSE(starts(result.out).empty()) << result.out;
  EXPECT_EQ(starts(result.out).front().step, step) << result.out;
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, kEpochs);
  expect_same_parameters(outcome, want);
}

}  // namespace
