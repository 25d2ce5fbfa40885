// Elastic jobs end to end, the training state's side: `shoal run --min/--max` with
// tests/programs/elastic_worker, workers SIGKILLed, joining and leaving mid-epoch on both
// backends, commits with and without copies, learning-rate policies, --max. Oracles: the final
// parameters equal a one-process run over the same global batches, and every sample of every
// epoch was trained on exactly once in committed steps (the program keeps that count in its
// elastic state). Membership cases are in elastic_membership_test.cpp.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <shoal/global/nn.h>
#include <shoal/shoal.h>
#include <torch/torch.h>

#include "elastic/etcd/client.h"
#include "elastic/state_access.h"
#include "elastic_support.h"

namespace {

using namespace shoal::testing::elastic;
using shoal::testing::RunResult;
using shoal::testing::ShoalRun;
using namespace std::chrono_literals;

// SIGTERM; the global batch stays, so the result is the one-process run's. On both backends.
class ElasticOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(ElasticOracle, KillJoinLeaveEndsWithTheOneProcessParameters) {
  constexpr int kEpochs = 8;
  const Outcome reference = one_process(kEpochs);
  expect_each_sample_once(reference, kEpochs);

  Backend backend(GetParam());
  const std::string out = temp_path("oracle_" + GetParam());
  const std::string token = temp_path("oracle_" + GetParam() + ".token");
  ShoalRun job(backend.flags() + std::vector<std::string>{"--min", "1", "--max", "3", "-n", "3",
                                                          "--token-file", token, kWorker, out,
                                                          std::to_string(kEpochs), "80"});
  ASSERT_TRUE(step_at_least(job, 15, 3, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 3);
  ASSERT_EQ(first.size(), 3u);
  struct stat info {};
  ASSERT_EQ(::stat(token.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);

  // The join flags the first launcher prints name the token file.
  const auto join = join_flags(job.so_far().err);
  EXPECT_NE(std::find(join.begin(), join.end(), token), join.end()) << job.so_far().err;
  // The second worker SIGKILLed, a worker joining, the third leaving with SIGTERM.
  kill_join_leave(job, first, {kWorker, out, std::to_string(kEpochs), "80"}, 5, out, kEpochs,
                  reference);
  if (HasFatalFailure()) return;
  EXPECT_NE(::stat(token.c_str(), &info), 0) << "the token file outlived the job";
}

INSTANTIATE_TEST_SUITE_P(Backends, ElasticOracle, ::testing::Values("gossip", "etcd"),
                         backend_name);

}  // namespace

namespace {

// Every sample once per epoch in committed steps, for 1 to 4 workers, across a kill (the worker
// is restarted and joins again), a join and a leave.
class ElasticAccounting : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ElasticAccounting, EachSampleOncePerEpoch) {
  const auto [backend_kind, n] = GetParam();
  constexpr int kEpochs = 6;
  Backend backend(backend_kind);
  const std::string name = "accounting_" + backend_kind + std::to_string(n);
  const std::string out = temp_path(name);
  const std::string token = temp_path(name + ".token");
  ShoalRun job(backend.flags() +
               std::vector<std::string>{"--min", "1", "--max", std::to_string(std::max(n, 2)), "-n",
                                        std::to_string(n), "--max-restarts", "1", "--token-file",
                                        token, kWorker, out, std::to_string(kEpochs), "60"});
  ASSERT_TRUE(step_at_least(job, 10, n, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), n);
  ASSERT_EQ(first.size(), static_cast<size_t>(n));
  std::unique_ptr<ShoalRun> joiner;
  if (n == 1) {
    // One worker: another joins, then the first leaves; the newcomer finishes the job.
    joiner = std::make_unique<ShoalRun>(
        join_flags(job.so_far().err) +
        std::vector<std::string>{"-n", "1", kWorker, out, std::to_string(kEpochs), "60"});
    const int64_t from = last_step(job.so_far().out).first;
    ASSERT_TRUE(step_at_least(job, from + 1, 2, 60s)) << job.so_far().out << job.so_far().err;
    ASSERT_EQ(::kill(first[0], SIGTERM), 0);
    ASSERT_TRUE(
        joiner->wait_until([](const RunResult& r) { return last_step(r.out).second == 1; }, 60s))
        << joiner->so_far().out << joiner->so_far().err << job.so_far().err;
  } else {
    // SIGKILL the last worker: it is restarted after 1 s and joins again (the others train on
    // without it meanwhile, or take it in at once when their round closed after its start).
    ASSERT_EQ(::kill(first[n - 1], SIGKILL), 0);
    ASSERT_TRUE(
        job.wait_until([&](const RunResult& r) { return newcomer_in(r.out, first, n); }, 60s))
        << job.so_far().out << job.so_far().err;
    // The first worker leaves.
    ASSERT_EQ(::kill(first[0], SIGTERM), 0);
    const int64_t regrown_at = last_step(job.so_far().out).first;
    ASSERT_TRUE(job.wait_until(
        [&](const RunResult& r) {
          auto [s, w] = last_step(r.out);
          return s > regrown_at && w == n - 1;
        },
        60s))
        << job.so_far().out << job.so_far().err;
  }
  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  if (joiner) {
    EXPECT_EQ(joiner->wait(120s).exit_code, 0);
  }
  expect_each_sample_once(read_outcome(out), kEpochs);
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizes, ElasticAccounting,
    ::testing::Values(std::make_tuple("gossip", 1), std::make_tuple("gossip", 2),
                      std::make_tuple("gossip", 3), std::make_tuple("gossip", 4),
                      std::make_tuple("etcd", 1), std::make_tuple("etcd", 3)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_n" + std::to_string(std::get<1>(info.param));
    });

}  // namespace

namespace {

// A worker dies right after its optimizer's step, and the others' next collective (before their
// commit) fails: every survivor's parameters changed since its commit. With
// StateOptions::copy_parameters they go back to the copy and end with the one-process
// parameters; without it (the default, Note [Commits without copies]) run() raises, in bounded
// time, an error that says what to do.
class ElasticChangedParameters : public ::testing::TestWithParam<bool> {};

TEST_P(ElasticChangedParameters, CopyOrClearError) {
  const bool copy = GetParam();
  constexpr int kEpochs = 4;
  const Outcome reference = copy ? one_process(kEpochs) : Outcome{};
  const std::string name = copy ? "changed_copy" : "changed_nocopy";
  const std::string out = temp_path(name);
  const std::string token = temp_path(name + ".token");
  ::setenv("ELASTIC_WORKER_LATE_COUNT", "1", 1);
  ::setenv("ELASTIC_WORKER_DIE_AFTER", "10", 1);
  ::setenv("ELASTIC_WORKER_COPY", copy ? "1" : "0", 1);
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", token, kWorker, out,
                std::to_string(kEpochs), "20"});
  ::unsetenv("ELASTIC_WORKER_LATE_COUNT");
  ::unsetenv("ELASTIC_WORKER_DIE_AFTER");
  ::unsetenv("ELASTIC_WORKER_COPY");
  const RunResult result = job.wait(120s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_NE(result.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << result.err;
  if (copy) {
    EXPECT_EQ(result.exit_code, 0) << result.err;
    const Outcome outcome = read_outcome(out);
    expect_each_sample_once(outcome, kEpochs);
    expect_same_parameters(outcome, reference);
  } else {
    EXPECT_NE(result.exit_code, 0) << result.out;
    EXPECT_NE(
        result.err.find(
            "no worker holds the parameters of commit 10: they changed after it (the optimizer "
            "stepped) and a collective failed before the next commit(); commit right after the "
            "optimizer's step, or set StateOptions::copy_parameters"),
        std::string::npos)
        << result.err;
  }
}

INSTANTIATE_TEST_SUITE_P(Commits, ElasticChangedParameters, ::testing::Values(true, false),
                         [](const auto& info) {
                           return info.param ? std::string("copied") : std::string("not_copied");
                         });

}  // namespace

namespace {

// A second model trains beside the committed one, under its own DataParallel (a GAN's other
// half) or as a global model under GradientSync, and a worker dies right after that model's
// step: the committed model has not changed since its commit on any survivor, so the job goes
// on from there without copies (Note [Commits without copies]) and ends with the one-process
// parameters. Whether a commit may skip its copy is asked of the committed model's own
// DataParallel: the backwards of the model beside do not count.
class ElasticBeside : public ::testing::TestWithParam<std::string> {};

TEST_P(ElasticBeside, AnotherModelsBackwardsDoNotMakeTheCommitStale) {
  const std::string beside = GetParam();
  constexpr int kEpochs = 3;
  const Outcome reference = one_process(kEpochs);
  const std::string out = temp_path("beside_" + beside);
  const std::string token = temp_path("beside_" + beside + ".token");
  ::setenv("ELASTIC_WORKER_BESIDE", beside.c_str(), 1);
  ::setenv("ELASTIC_WORKER_DIE_BESIDE", "10", 1);
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", token, kWorker, out,
                std::to_string(kEpochs), "20"});
  ::unsetenv("ELASTIC_WORKER_BESIDE");
  ::unsetenv("ELASTIC_WORKER_DIE_BESIDE");
  const RunResult result = job.wait(120s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_NE(result.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << result.err;
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, kEpochs);
  expect_same_parameters(outcome, reference);
}

INSTANTIATE_TEST_SUITE_P(Models, ElasticBeside, ::testing::Values("dp", "global"),
                         [](const auto& info) { return info.param; });

}  // namespace

namespace {

// "step S world W lr=L" lines: (world, lr) in order.
std::vector<std::pair<int, double>> rates(const std::string& out) {
  static const std::regex line(R"(step \d+ world (\d+) lr=(\S+))");
  std::vector<std::pair<int, double>> result;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    result.emplace_back(std::stoi((*it)[1]), std::stod((*it)[2]));
  }
  return result;
}

// Each worker's batch stays and the learning rate follows the world: 0.05 * world, at once or
// over 4 commits. Every sample is still trained on once per epoch.
class ElasticScaling : public ::testing::TestWithParam<std::string> {};

TEST_P(ElasticScaling, LearningRateFollowsTheWorld) {
  const std::string policy = GetParam();
  constexpr int kEpochs = 4;
  const std::string out = temp_path("scale_" + policy);
  const std::string token = temp_path("scale_" + policy + ".token");
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", token, kWorker, out,
                std::to_string(kEpochs), "60", policy});
  ASSERT_TRUE(step_at_least(job, 12, 3, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 3);
  ASSERT_EQ(::kill(first[1], SIGKILL), 0);
  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  const auto seen = rates(result.out);
  ASSERT_FALSE(seen.empty());
  int shrunk_at = -1;
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i].first == 2 && shrunk_at < 0) shrunk_at = static_cast<int>(i);
  }
  ASSERT_GE(shrunk_at, 4) << result.out;
  // In the first round (3 workers, from the start): 0.15 throughout, or reached over 4 commits.
  const size_t settled = policy == "warmup" ? 3 : 0;
  for (size_t i = settled; i < static_cast<size_t>(shrunk_at); ++i) {
    EXPECT_NEAR(seen[i].second, 0.15, 1e-9) << "step line " << i;
  }
  if (policy == "warmup") {
    EXPECT_NEAR(seen[0].second, 0.05 + (0.15 - 0.05) * 1 / 4, 1e-9);
    EXPECT_NEAR(seen[1].second, 0.05 + (0.15 - 0.05) * 2 / 4, 1e-9);
    // After the change: from 0.15 towards 0.10 over 4 commits.
    // (Two commits in when the epoch's own commit, which prints no step line, came first.)
    const double first_rate = seen[shrunk_at].second;
    EXPECT_TRUE(std::abs(first_rate - (0.15 + (0.10 - 0.15) * 1 / 4)) < 1e-9 ||
                std::abs(first_rate - (0.15 + (0.10 - 0.15) * 2 / 4)) < 1e-9)
        << first_rate << "\n"
        << result.out;
    EXPECT_NEAR(seen[shrunk_at + 3].second, 0.10, 1e-9) << result.out;
  } else {
    EXPECT_NEAR(seen[shrunk_at].second, 0.10, 1e-9) << result.out;
  }
  EXPECT_NEAR(seen.back().second, 0.10, 1e-9);
  expect_each_sample_once(read_outcome(out), kEpochs);
}

INSTANTIATE_TEST_SUITE_P(Policies, ElasticScaling, ::testing::Values("scale", "warmup"),
                         [](const auto& info) { return info.param; });

// Under each BatchPolicy the job shrinks (2 -> 1, a worker killed) and grows (1 -> 3, two
// newcomers) and finishes, every sample trained on once per epoch, its workers' parameters
// equal at the end. Under adascale() the rate
// is lr0 * gain, between lr0 and lr0 * world, and above lr0 once the world has grown: AdaScale's
// gain from the noise DataParallel measured. Under goodput() each world's batch is its own
// choice, within the limits, taken in backward passes where one worker's exceeds a pass.
class ElasticResizes : public ::testing::TestWithParam<std::string> {};

TEST_P(ElasticResizes, ShrinksAndGrowsAndSeesEverySampleOnce) {
  const std::string policy = GetParam();
  constexpr int kEpochs = 5;
  const std::string out = temp_path("resize_" + policy);
  const std::string token = temp_path("resize_" + policy + ".token");
  ::setenv("ELASTIC_WORKER_SPREAD", "1", 1);
  // The survivor, alone, trains 5 steps and then only commits until the newcomers join: the job
  // cannot end before they start, however loaded the machine.
  ::setenv("ELASTIC_WORKER_HOLD_ALONE_AFTER", "5", 1);
  ShoalRun job({"--min", "1", "--max", "3", "-n", "2", "--token-file", token, kWorker, out,
                std::to_string(kEpochs), "40", policy});
  ASSERT_TRUE(step_at_least(job, 10, 2, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 2);
  // The survivor holds this commit at least; its first step alone comes after it.
  const int64_t before_kill = last_step(job.so_far().out).first;
  ASSERT_EQ(::kill(first[1], SIGKILL), 0);
  ASSERT_TRUE(step_at_least(job, before_kill + 1, 1, 60s)) << job.so_far().out << job.so_far().err;
  auto [address, token_file] = join_hint(job.so_far().err);
  ASSERT_FALSE(address.empty()) << job.so_far().err;
  ShoalRun joiner({"--join", address, "--token-file", token_file, "-n", "2", kWorker, out,
                   std::to_string(kEpochs), "40", policy});
  ::unsetenv("ELASTIC_WORKER_SPREAD");
  ::unsetenv("ELASTIC_WORKER_HOLD_ALONE_AFTER");
  const RunResult joined = joiner.wait(120s);
  const RunResult result = job.wait(120s);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  ASSERT_EQ(joined.exit_code, 0) << joined.err;
  std::set<int> worlds;
  for (const auto& start : starts(result.out + joined.out)) worlds.insert(start.world);
  EXPECT_EQ(worlds, (std::set<int>{1, 2, 3})) << result.out << joined.out;
  expect_each_sample_once(read_outcome(out), kEpochs);
  // The last round's three workers end with the same parameters.
  EXPECT_NE((result.out + joined.out).find("parameter spread 0\n"), std::string::npos) << result.out << joined.out;
  if (policy == "goodput") {
    // Every step's batch within the limits, one worker's in two backward passes (its 8 samples
    // or more exceed 6 a pass), the rate lr0 times AdaScale's gain, and the batch following
    // the world (no batch of 3 workers is one of 8).
    static const std::regex line(
        R"(step \d+ world (\d+) lr=(\S+) batch=(\d+) passes=(\d+) gain=(\S+))");
    const std::string all = result.out + joined.out;
    std::set<int64_t> batches;
    int lines = 0;
    for (std::sregex_iterator it(all.begin(), all.end(), line), end; it != end; ++it, ++lines) {
      const int world = std::stoi((*it)[1]);
      const double lr = std::stod((*it)[2]), gain = std::stod((*it)[5]);
      const int64_t batch = std::stoll((*it)[3]);
      const int passes = std::stoi((*it)[4]);
      EXPECT_GE(batch, 8) << it->str();
      EXPECT_LE(batch, 48) << it->str();
      EXPECT_EQ(batch % world, 0) << it->str();
      EXPECT_LE(batch / world, 6 * passes) << it->str();
      if (world == 1) {
        EXPECT_EQ(passes, 2) << it->str();
      }
      EXPECT_NEAR(lr, 0.05 * gain, 1e-6) << it->str();
      EXPECT_GE(gain, 1.0 - 1e-9) << it->str();
      batches.insert(batch);
    }
    EXPECT_GT(lines, 10) << all;
    EXPECT_GE(batches.size(), 2u) << all;
    return;
  }
  if (policy != "adascale") return;
  bool gained = false;
  for (const auto& [world, lr] : rates(result.out + joined.out)) {
    EXPECT_GE(lr, 0.05 - 1e-9) << "world " << world;
    EXPECT_LE(lr, 0.05 * world + 1e-9) << "world " << world;
    if (world == 1) {
      EXPECT_NEAR(lr, 0.05, 1e-9);
    }
    if (world == 3 && lr > 0.05 * 1.5) gained = true;
  }
  EXPECT_TRUE(gained) << result.out << joined.out;
}

INSTANTIATE_TEST_SUITE_P(Policies, ElasticResizes,
                         ::testing::Values("global", "scale", "adascale", "goodput"),
                         [](const auto& info) { return info.param; });

// Above --max, a newcomer waits; it joins when a place frees up.
TEST(Elastic, NewcomersAboveMaxWaitForRoom) {
  constexpr int kEpochs = 8;
  const std::string out = temp_path("max");
  const std::string token = temp_path("max.token");
  ShoalRun job({"--min", "1", "--max", "2", "-n", "2", "--token-file", token, kWorker, out,
                std::to_string(kEpochs), "60"});
  ASSERT_TRUE(step_at_least(job, 5, 2, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 2);
  auto [address, token_file] = join_hint(job.so_far().err);
  ShoalRun joiner({"--join", address, "--token-file", token_file, "-n", "1", kWorker, out,
                   std::to_string(kEpochs), "60"});
  const int64_t from = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, from + 40, 2, 60s)) << job.so_far().out;
  EXPECT_TRUE(starts(joiner.so_far().out).empty()) << "joined above --max: " << joiner.so_far().out;
  ASSERT_EQ(::kill(first[0], SIGTERM), 0);
  // The newcomer takes the free place: a round of 2 with it.
  ASSERT_TRUE(joiner.wait_until([](const RunResult& r) { return !starts(r.out).empty(); }, 60s))
      << joiner.so_far().err << job.so_far().err;
  EXPECT_EQ(starts(joiner.so_far().out).front().world, 2);
  const RunResult joined = joiner.wait(120s);
  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(joined.exit_code, 0) << joined.err;
  expect_each_sample_once(read_outcome(out), kEpochs);
}

}  // namespace

namespace {

// A policy that does not fit the sampler is refused when the State is made, with what to change.
TEST(ElasticState, PolicyMustFitTheSampler) {
  auto net = torch::nn::Linear(2, 2);
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  shoal::data::SamplerOptions global;
  global.batch_size = 4;
  shoal::data::Sampler global_sampler(16, global, 0, 1);
  shoal::data::SamplerOptions per_worker = global;
  per_worker.per_worker = true;
  shoal::data::Sampler per_worker_sampler(16, per_worker, 0, 1);
  try {
    shoal::elastic::State state(*net, optimizer, per_worker_sampler);
    ADD_FAILURE() << "expected UsageError";
  } catch (const shoal::UsageError& e) {
    EXPECT_STREQ(e.what(),
                 "elastic::State: BatchPolicy::keep_global_batch() needs a sampler whose "
                 "batch_size is the global "
                 "batch; this one is per_worker");
  }
  try {
    shoal::elastic::State state(*net, optimizer, global_sampler,
                                {shoal::elastic::BatchPolicy::scale_learning_rate()});
    ADD_FAILURE() << "expected UsageError";
  } catch (const shoal::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("scale_learning_rate() needs a per_worker sampler"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(shoal::elastic::State(*net, optimizer, per_worker_sampler,
                                     {shoal::elastic::BatchPolicy::scale_learning_rate(0)}),
               shoal::UsageError);
}

// Outside an elastic job, commit() and restore() roll the module, the optimizer and the sampler
// back to the commit, and run() calls the function once.
TEST(ElasticState, RestoreReturnsToTheLastCommit) {
  torch::manual_seed(0);
  auto net = torch::nn::Linear(3, 2);
  torch::optim::Adam optimizer(net->parameters(), 0.1);
  shoal::data::SamplerOptions options;
  options.batch_size = 2;
  shoal::data::Sampler sampler(10, options, 0, 1);
  shoal::elastic::State state(*net, optimizer, sampler);
  auto step = [&] {
    optimizer.zero_grad();
    net->forward(torch::randn({4, 3})).sum().backward();
    optimizer.step();
    sampler.advance();
  };
  int calls = 0;
  shoal::elastic::run(state, [&] {
    ++calls;
    step();
    state.value("seen") = torch::tensor({7});
    state.commit();
  });
  EXPECT_EQ(calls, 1);
  const auto weight = net->weight.detach().clone();
  const auto cursor = sampler.cursor();
  step();
  step();
  state.value("seen") = torch::tensor({9});
  ASSERT_FALSE(net->weight.detach().equal(weight));
  shoal::elastic::StateAccess::restore(state);
  EXPECT_TRUE(net->weight.detach().equal(weight));
  EXPECT_EQ(sampler.cursor(), cursor);
  EXPECT_EQ(state.value("seen").item<int64_t>(), 7);
  EXPECT_EQ(state.version(), 1);
  // The optimizer's state too: the same step from the commit gives the same weights.
  torch::manual_seed(5);
  step();
  const auto once = net->weight.detach().clone();
  shoal::elastic::StateAccess::restore(state);
  torch::manual_seed(5);
  step();
  EXPECT_TRUE(net->weight.detach().equal(once));
}

}  // namespace

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  return shoal::testing::split_lines(text);
}

int count_of(const std::string& text, const std::string& what) {
  int count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
  return count;
}

// Starts a ShoalRun whose launcher inherits `signals` ignored, as a POSIX shell starts a
// background job of a script.
std::unique_ptr<ShoalRun> start_ignoring(const std::vector<int>& signals,
                                         const std::vector<std::string>& args) {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  std::vector<struct sigaction> previous(signals.size());
  for (size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &ignore, &previous[i]);
  auto run = std::make_unique<ShoalRun>(args);
  for (size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &previous[i], nullptr);
  return run;
}

// SIGINT (Ctrl-C) to an elastic launcher asks its workers to leave at a commit, as SIGTERM
// does, also when the launcher was started with SIGINT ignored; the last lines say how each
// worker ended.
TEST(ElasticSignals, SigintMakesWorkersLeaveAtACommit) {
  const std::string out = temp_path("sigint");
  const std::string token = temp_path("sigint.token");
  auto job = start_ignoring({SIGINT}, {"--min", "1", "--max", "2", "-n", "2", "--token-file", token,
                                       kWorker, out, "8", "60"});
  ASSERT_TRUE(step_at_least(*job, 5, 2, 60s)) << job->so_far().out << job->so_far().err;
  ASSERT_EQ(::kill(job->pid(), SIGINT), 0);
  const RunResult result = job->wait(60s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_EQ(result.exit_code, 130) << result.err;
  EXPECT_NE(result.err.find("received SIGINT; stopping the workers"), std::string::npos)
      << result.err;
  EXPECT_EQ(count_of(result.err, "leaves the job after step"), 2) << result.err;
  const auto lines = lines_of(result.err);
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(lines[lines.size() - 2], "shoal run: worker 0 exited with code 0") << result.err;
  EXPECT_EQ(lines[lines.size() - 1], "shoal run: worker 1 exited with code 0") << result.err;
}

// Note [The last to be stopped]: every worker is asked to leave, the last one's SIGTERM landing
// just after its vote at commit 6: it leaves with the others at commit 7 all the same, instead of
// training on alone, and keeps that commit on disk, where the job started again resumes.
TEST(ElasticSignals, AWorkerSignalledJustAfterItsVoteLeavesWithTheOthers) {
  const std::string checkpoint = temp_path("lateterm.ckpt");
  std::remove(checkpoint.c_str());
  ::setenv("ELASTIC_WORKER_TERM_AT", "6", 1);
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--checkpoint", checkpoint,
                "--checkpoint-every", "1000", "--token-file", temp_path("lateterm.token"), kWorker,
                temp_path("lateterm"), "4", "20"});
  ::unsetenv("ELASTIC_WORKER_TERM_AT");
  const RunResult result = job.wait(120s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_EQ(count_of(result.err, "leaves the job after step 7 (SIGTERM)"), 3) << result.err;
  EXPECT_EQ(count_of(result.err, "leaves the job after step"), 3) << result.err;

  ShoalRun again({"--min", "1", "--max", "2", "-n", "2", "--checkpoint", checkpoint,
                  "--token-file", temp_path("lateterm2.token"), kWorker,
                  temp_path("lateterm2"), "1", "0"});
  const RunResult resumed = again.wait(120s);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("resuming from step 7 (epoch 0)"), std::string::npos) << resumed.err;
}

// A worker started by a launcher that inherited SIGTERM ignored still gets the default action:
// the forwarded signal ends it at once instead of SIGKILL after the grace.
TEST(ElasticSignals, WorkersStartWithDefaultSignalActions) {
  const std::string token = temp_path("sleep.token");
  auto job = start_ignoring({SIGINT, SIGTERM}, {"--min", "1", "--max", "1", "-n", "1",
                                                "--token-file", token, "/bin/sleep", "60"});
  // Workers start after this line; a signal that comes first waits for them in the launcher.
  ASSERT_TRUE(job->wait_until(
      [](const RunResult& r) { return r.err.find("to add workers") != std::string::npos; }, 30s))
      << job->so_far().err;
  ASSERT_EQ(::kill(job->pid(), SIGINT), 0);
  const RunResult result = job->wait(60s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_NE(result.err.find("shoal run: worker 0 was killed by signal 15 (SIGTERM)"),
            std::string::npos)
      << result.err;
}

// A worker that crashes (exit code 3) is dropped and the job finishes without it: the job's
// last lines say so, and the exit code is the finished training's, 0.
TEST(ElasticEnd, LastLinesSayHowEachWorkerEnded) {
  constexpr int kEpochs = 3;
  const std::string out = temp_path("crash");
  const std::string token = temp_path("crash.token");
  ::setenv("ELASTIC_WORKER_EXIT_AT", "8", 1);
  ShoalRun job({"--min", "1", "--max", "2", "-n", "2", "--token-file", token, kWorker, out,
                std::to_string(kEpochs), "20"});
  ::unsetenv("ELASTIC_WORKER_EXIT_AT");
  const RunResult result = job.wait(120s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_EQ(result.exit_code, 0) << result.err;
  // The last rank of the first round crashed: local worker 0 or 1, whichever it was.
  const auto lines = lines_of(result.err);
  ASSERT_GE(lines.size(), 2u);
  const std::string last_two = lines[lines.size() - 2] + "\n" + lines[lines.size() - 1];
  EXPECT_TRUE(
      last_two ==
          "shoal run: worker 0 exited with code 0\nshoal run: worker 1 exited with code 3" ||
      last_two == "shoal run: worker 0 exited with code 3\nshoal run: worker 1 exited with code 0")
      << result.err;
  expect_each_sample_once(read_outcome(out), kEpochs);
}

// The only worker is SIGSTOPped past the failure timeout and a newcomer joins meanwhile: no
// member of its round holds a commit. The membership recorded that the job had committed (Note
// [The job's recorded commits]: gossip in the worker's metadata, etcd in a key with no lease), so
// the newcomer says so in one line and does not start the job again from step 0. After SIGCONT
// the woken worker goes on from its own commit (version() never goes back) and the job ends with
// the one-process parameters.
class ElasticHistory : public ::testing::TestWithParam<std::string> {};

// Every shoal key in the backend's etcd.
std::vector<std::string> job_keys(Backend& backend) {
  const shoal::elastic::etcd::Client client(
      shoal::elastic::etcd::Endpoint::parse(backend.etcd().endpoint()), std::chrono::seconds(5));
  std::vector<std::string> keys;
  for (const auto& kv : client.range_prefix("/shoal/").kvs) keys.push_back(kv.key);
  return keys;
}

bool has_key_with(const std::vector<std::string>& keys, const std::string& part) {
  return std::any_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return k.find(part) != std::string::npos; });
}

std::string describe_keys(const std::vector<std::string>& keys) {
  std::string text = "etcd's keys:";
  for (const auto& k : keys) text += " " + k;
  return text;
}

TEST_P(ElasticHistory, NoWorkerGoesBackToAnOlderCommit) {
  constexpr int kEpochs = 6;
  const Outcome reference = one_process(kEpochs);
  Backend backend(GetParam());
  const std::string out = temp_path("history_" + GetParam());
  const std::string token = temp_path("history_" + GetParam() + ".token");
  ShoalRun job(backend.flags() + std::vector<std::string>{"--min", "1", "--max", "2", "-n", "1",
                                                          "--token-file", token, kWorker, out,
                                                          std::to_string(kEpochs), "60"});
  ASSERT_TRUE(step_at_least(job, 20, 1, 60s)) << job.so_far().out << job.so_far().err;
  const auto first = ranks_of_round(starts(job.so_far().out), 1);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(::kill(first.at(0), SIGSTOP), 0);
  const int64_t stopped_at = last_step(job.so_far().out).first;
  ShoalRun joiner(join_flags(job.so_far().err) +
                  std::vector<std::string>{"-n", "1", kWorker, out, std::to_string(kEpochs), "60"});
  const RunResult refused = joiner.wait(120s);
  ASSERT_FALSE(refused.timed_out) << refused.err;
  EXPECT_EQ(refused.exit_code, 1) << refused.err;
  EXPECT_TRUE(starts(refused.out).empty()) << refused.out;
  EXPECT_EQ(count_of(refused.err,
                     "every worker holding the job's commits is gone (it had committed step "),
            1)
      << refused.err;
  if (GetParam() == "etcd") {
    // The record outlived the worker that wrote it, and the refused launcher, whose job did not
    // finish, left the job's keys alone.
    const auto keys = job_keys(backend);
    EXPECT_TRUE(has_key_with(keys, "/commits/")) << describe_keys(keys);
    EXPECT_TRUE(has_key_with(keys, "/job")) << describe_keys(keys);
  }
  ASSERT_EQ(::kill(first.at(0), SIGCONT), 0);
  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  const auto all = starts(result.out);
  ASSERT_GE(all.size(), 2u) << "the woken worker did not start again: " << result.out << result.err;
  for (const auto& s : all) {
    EXPECT_EQ(s.pid, first.at(0));
    if (&s != &all.front()) {
      EXPECT_GE(s.step, stopped_at) << "the woken worker went back: " << result.out;
    }
  }
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, kEpochs);
  expect_same_parameters(outcome, reference);
  if (GetParam() == "etcd") {
    // The job finished: its last launcher deleted its keys.
    EXPECT_TRUE(job_keys(backend).empty()) << describe_keys(job_keys(backend));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ElasticHistory, ::testing::Values("gossip", "etcd"),
                         backend_name);

// Durable commits: every worker of a job is SIGKILLed; the job started again resumes from the
// commit kept on disk (SHOAL_CHECKPOINT or --checkpoint, every 5 commits) and ends with the one-process
// parameters, every sample trained on once.
TEST(ElasticDurable, JobStartedAgainResumesFromTheDurableCommit) {
  constexpr int kEpochs = 4;
  const Outcome reference = one_process(kEpochs);
  const std::string out = temp_path("durable");
  const std::string checkpoint = temp_path("durable.ckpt");
  std::remove(checkpoint.c_str());
  ::setenv("SHOAL_CHECKPOINT", checkpoint.c_str(), 1);
  ::setenv("SHOAL_CHECKPOINT_EVERY", "5", 1);
  struct Unset {
    ~Unset() {
      ::unsetenv("SHOAL_CHECKPOINT");
      ::unsetenv("SHOAL_CHECKPOINT_EVERY");
    }
  } unset;
  ShoalRun first({"--min", "1", "--max", "2", "-n", "2", "--token-file",
                  temp_path("durable1.token"), kWorker, out, std::to_string(kEpochs), "60"});
  ASSERT_TRUE(step_at_least(first, 23, 2, 60s)) << first.so_far().out << first.so_far().err;
  const auto pids = ranks_of_round(starts(first.so_far().out), 2);
  ASSERT_EQ(pids.size(), 2u);
  for (const auto& [rank, pid] : pids) ASSERT_EQ(::kill(pid, SIGKILL), 0);
  const int64_t killed_at = last_step(first.so_far().out).first;
  const RunResult died = first.wait(60s);
  EXPECT_NE(died.exit_code, 0) << died.err;

  // The first run was given the checkpoint by the variables, this one by shoal run's flags.
  ::unsetenv("SHOAL_CHECKPOINT");
  ::unsetenv("SHOAL_CHECKPOINT_EVERY");
  ShoalRun again({"--min", "1", "--max", "2", "-n", "2", "--checkpoint", checkpoint,
                  "--checkpoint-every", "5", "--token-file", temp_path("durable2.token"), kWorker,
                  out, std::to_string(kEpochs), "20"});
  const RunResult result = again.wait(120s);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  std::smatch resumed;
  ASSERT_TRUE(std::regex_search(result.err, resumed,
                                std::regex(R"(resuming from step (\d+) \(epoch \d+\) of )")))
      << result.err;
  const int64_t step = std::stoll(resumed[1]);
  EXPECT_GT(step, 0);
  EXPECT_LE(step, killed_at + 1);
  EXPECT_EQ(step % 5, 0) << "the durable commits are every 5 commits";
  ASSERT_FALSE(starts(result.out).empty()) << result.out;
  EXPECT_EQ(starts(result.out).front().step, step) << result.out;
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, kEpochs);
  expect_same_parameters(outcome, reference);
}

// Global parameters are pieces that differ between workers, which elastic rounds would
// overwrite with the first worker's: refused when the State is made, wherever in the module.
struct WithGlobalLayer : torch::nn::Module {
  WithGlobalLayer() {
    namespace g = shoal::global;
    plain = register_module("plain", torch::nn::Linear(3, 3));
    sharded = register_module("sharded",
                              g::nn::Linear(3, 2, g::Placement::all(), g::nn::Layout{}.column()));
  }
  torch::nn::Linear plain{nullptr};
  shoal::global::nn::Linear sharded{nullptr};
};

// An elastic job's first round is formed by shoal::init(), above the parts that would join by
// themselves: DataParallel before it says so, at once, rather than joining as a static job.
TEST(ElasticState, DataParallelBeforeInitAsksForInit) {
  const std::string out = temp_path("no_init");
  const std::string token = temp_path("no_init.token");
  ::setenv("ELASTIC_WORKER_NO_INIT", "1", 1);
  ShoalRun job({"--min", "1", "--max", "2", "-n", "1", "--token-file", token, kWorker, out, "1"});
  ::unsetenv("ELASTIC_WORKER_NO_INIT");
  const RunResult result = job.wait(60s);
  ASSERT_FALSE(result.timed_out) << result.err;
  EXPECT_NE(result.exit_code, 0) << result.out;
  EXPECT_NE(result.err.find("DataParallel in an elastic job (shoal run --min/--max) before shoal::init(): call "
                            "shoal::init() first; it joins the job's first round"),
            std::string::npos)
      << result.err;
}

TEST(ElasticState, RefusesGlobalParameters) {
  // Global tensors need the job (a job of one here, nothing having started this process).
  if (!shoal::is_initialized()) shoal::init();
  WithGlobalLayer net;
  torch::optim::SGD optimizer(net.parameters(), 0.1);
  shoal::data::SamplerOptions options;
  options.batch_size = 4;
  shoal::data::Sampler sampler(16, options, 0, 1);
  try {
    shoal::elastic::State state(net, optimizer, sampler);
    ADD_FAILURE() << "expected UsageError";
  } catch (const shoal::UsageError& e) {
    EXPECT_STREQ(
        e.what(),
        "elastic::State: the module holds global parameters (weight, of shoal::global::nn); "
        "elastic jobs do "
        "not support them yet: expected a module of plain torch parameters (with DataParallel)");
  }
}

}  // namespace

namespace {

const std::string kExample =
    shoal::testing::test_programs_dir() + "/../examples/elastic_fashion_mnist";

// "after S steps: test accuracy A, parameter checksum C": {A, C}.
std::pair<double, double> example_result(const std::string& out) {
  static const std::regex line(
      R"(after \d+ steps: test accuracy ([0-9.]+), parameter checksum ([0-9.]+))");
  std::smatch match;
  if (!std::regex_search(out, match, line)) return {-1, -1};
  return {std::stod(match[1]), std::stod(match[2])};
}

// The elastic example (examples/elastic_fashion_mnist.cpp) on a slice of Fashion-MNIST: two
// workers, one SIGKILLed mid-job, end as one process does.
TEST(ElasticExample, FashionMnistLosesAWorkerAndEndsAsOneProcess) {
  if (::access("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", R_OK) != 0) {
    GTEST_SKIP()
        << "Fashion-MNIST is not installed (scripts/setup.sh installs dataset-fashion-mnist)";
  }
  const std::vector<std::string> args{kExample, "--epochs", "2", "--limit", "1280"};
  const RunResult one = shoal::testing::run_shoal(std::vector<std::string>{"-n", "1"} + args, 300s);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  const auto [one_accuracy, one_checksum] = example_result(one.out);
  ASSERT_GT(one_checksum, 0) << one.out;

  ShoalRun job(std::vector<std::string>{"--min", "1", "--max", "2", "-n", "2", "--token-file",
                                        temp_path("example.token")} +
               args);
  ASSERT_TRUE(job.wait_for_output("step 20 on 2 worker(s)", 300s))
      << job.so_far().out << job.so_far().err;
  // The launcher's children running the example (its guard is one too), in the order started.
  std::ifstream children("/proc/" + std::to_string(job.pid()) + "/task/" +
                         std::to_string(job.pid()) + "/children");
  std::vector<int> pids;
  for (int pid; children >> pid;) {
    std::ifstream cmdline("/proc/" + std::to_string(pid) + "/cmdline");
    std::string program;
    std::getline(cmdline, program, '\0');
    if (program.find("elastic_fashion_mnist") != std::string::npos) pids.push_back(pid);
  }
  ASSERT_EQ(pids.size(), 2u);
  ASSERT_EQ(::kill(pids[1], SIGKILL), 0);
  const RunResult result = job.wait(300s);
  ASSERT_EQ(result.exit_code, 0) << result.out << result.err;
  EXPECT_NE(result.out.find("training on 1 worker(s) from step"), std::string::npos) << result.out;
  const auto [accuracy, checksum] = example_result(result.out);
  EXPECT_NEAR(checksum / one_checksum, 1.0, 1e-4) << result.out << one.out;
  EXPECT_NEAR(accuracy, one_accuracy, 0.01) << result.out << one.out;
  EXPECT_GT(accuracy, 0.3) << "ten classes: chance is 0.1";
}

}  // namespace
