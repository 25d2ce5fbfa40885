// Elastic jobs end to end, the membership's side: a SIGSTOPped worker left out and taken back, a
// joiner without the token refused, usage errors, etcd stopped mid-job, and a network partition
// with and without --quorum. Oracle: every sample of every epoch trained on once in committed steps.
#include <signal.h>
#include <sys/stat.h>

#include <thread>

#include <gtest/gtest.h>
#include <shoal/shoal.h>
#include <torch/torch.h>

#include "elastic_support.h"
#include "netns.h"

namespace {

using namespace shoal::testing::elastic;
using shoal::testing::RunResult;
using shoal::testing::ShoalRun;
using namespace std::chrono_literals;

// A SIGSTOPped worker is declared dead by the membership and the others go on; after SIGCONT it
// joins again as a new worker.
TEST(ElasticMembership, StoppedWorkerIsExcludedAndRejoinsAfterContinue) {
  constexpr int kEpochs = 8;
  const std::string out = temp_path("stopped");
  const std::string token = temp_path("stopped.token");
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", token, kWorker, out, std::to_string(kEpochs),
                "60"});
  ASSERT_TRUE(step_at_least(job, 10, 3, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 3);
  ASSERT_EQ(::kill(first[2], SIGSTOP), 0);
  const auto stopped = std::chrono::steady_clock::now();
  const int64_t stopped_at = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, stopped_at + 1, 2, 30s)) << job.so_far().out << job.so_far().err;
  const double excluded_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  std::printf("a SIGSTOPped worker was left out after %.2f s\n", excluded_after);
  ASSERT_EQ(::kill(first[2], SIGCONT), 0);
  const int64_t continued_at = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, continued_at + 1, 3, 60s)) << job.so_far().out << job.so_far().err;
  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.err.find("joins again as a new worker"), std::string::npos) << result.err;
  expect_each_sample_once(read_outcome(out), kEpochs);
}

// A process without the job's token is refused, says so, and the job never notices.
TEST(ElasticMembership, JoinWithoutTheTokenIsRefused) {
  constexpr int kEpochs = 6;
  const std::string out = temp_path("token");
  const std::string token = temp_path("token.token");
  ShoalRun job({"--min", "2", "--max", "3", "-n", "2", "--token-file", token, kWorker, out, std::to_string(kEpochs),
                "60"});
  ASSERT_TRUE(step_at_least(job, 5, 2, 60s)) << job.so_far().out << job.so_far().err;
  auto [address, token_file] = join_hint(job.so_far().err);
  const std::string wrong = temp_path("wrong.token");
  {
    std::ofstream file(wrong);
    file << "0123456789abcdef0123456789abcdef\n";
  }
  ::chmod(wrong.c_str(), 0600);
  auto refused = shoal::testing::run_shoal({"--join", address, "--token-file", wrong, "-n", "1", kWorker, out}, 60s);
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("refused this process: its token does not match"), std::string::npos) << refused.err;
  EXPECT_EQ(shoal::testing::split_lines(refused.err).size(), 1u) << refused.err;

  ::chmod(wrong.c_str(), 0644);
  auto readable = shoal::testing::run_shoal({"--join", address, "--token-file", wrong, "-n", "1", kWorker, out}, 60s);
  EXPECT_EQ(readable.exit_code, 2);
  EXPECT_NE(readable.err.find("can be read by other users (mode 644); expected mode 600"), std::string::npos)
      << readable.err;

  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.err.find("lacks the job's token"), std::string::npos) << result.err;
  static const std::regex line(R"(step \d+ world (\d+))");
  for (std::sregex_iterator it(result.out.begin(), result.out.end(), line), end; it != end; ++it) {
    ASSERT_EQ((*it)[1], "2") << "the world changed: " << result.out;
  }
  expect_each_sample_once(read_outcome(out), kEpochs);
}

TEST(ElasticMembership, BadFlagsAreUsageErrors) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--min", "3", "--max", "2", kWorker}, "--min 3 is more than --max 2: expected min <= max"},
      {{"--min", "2", kWorker}, "--min needs --max"},
      {{"--max", "2", kWorker}, "--max needs --min"},
      {{"--min", "0", "--max", "2", kWorker}, "--min: expected a number of workers from 1, got '0'"},
      {{"--min", "1", "--max", "2", "-n", "3", kWorker}, "-n 3 is more than --max 2"},
      {{"--join", "127.0.0.1:9", "--min", "1", kWorker}, "--join takes the job's --min, --max and --quorum"},
      {{"--quorum", kWorker}, "--quorum is for elastic jobs"},
      {{"--max-restarts", "2", kWorker}, "--max-restarts is for elastic jobs"},
      {{"--min", "1", "--max", "2", "--nnodes", "2", "--master", "127.0.0.1:9", kWorker}, "--nnodes/--node-rank are for static jobs"},
      {{"--min", "1", "--max", "2", "--rendezvous", "consul://127.0.0.1:9", kWorker},
       "--rendezvous consul://127.0.0.1:9 is not a rendezvous backend; expected gossip or etcd://HOST:PORT"},
      {{"--rendezvous", "etcd://127.0.0.1:9", "--join", "127.0.0.1:9", kWorker},
       "--join '127.0.0.1:9': with --rendezvous etcd:// it takes the job's run id"},
      {{"--rendezvous", "etcd://127.0.0.1:9", kWorker}, "--rendezvous is for elastic jobs"},
      {{"--checkpoint", "/tmp/x.ckpt", kWorker}, "--checkpoint is for elastic jobs"},
      {{"--min", "1", "--max", "2", "--checkpoint-every", "5", kWorker},
       "--checkpoint-every needs --checkpoint PATH"},
      {{"--min", "1", "--max", "2", "--checkpoint", "/tmp/x.ckpt", "--checkpoint-every", "0", kWorker},
       "--checkpoint-every: expected a number of commits from 1, got '0'"},
  };
  for (const auto& [args, message] : cases) {
    auto result = shoal::testing::run_shoal(args, 30s);
    EXPECT_EQ(result.exit_code, 2) << result.err;
    EXPECT_NE(result.err.find(message), std::string::npos) << "got: " << result.err << "expected: " << message;
    EXPECT_EQ(shoal::testing::split_lines(result.err).size(), 1u) << result.err;
  }
  ::unsetenv("SHOAL_JOB_TOKEN");
  auto no_token = shoal::testing::run_shoal({"--join", "127.0.0.1:9", kWorker}, 30s);
  EXPECT_EQ(no_token.exit_code, 2);
  EXPECT_NE(no_token.err.find("--join needs the job's token"), std::string::npos) << no_token.err;
}

}  // namespace

namespace {

// etcd stops while the job trains and a worker is SIGKILLed meanwhile; etcd starts again on its
// data: the job recovers, the restarted worker joins again, and every sample is still trained on
// once. A joiner with a wrong token is refused by the job's record in etcd, which it never alters.
TEST(ElasticEtcd, JobOutlivesAnEtcdRestart) {
  constexpr int kEpochs = 8;
  Backend backend("etcd");
  const std::string out = temp_path("etcd_restart");
  const std::string token = temp_path("etcd_restart.token");
  ShoalRun job(backend.flags() + std::vector<std::string>{"--min", "1", "--max", "3", "-n", "3", "--max-restarts",
                                                          "1", "--token-file", token, kWorker, out,
                                                          std::to_string(kEpochs), "60"});
  ASSERT_TRUE(step_at_least(job, 10, 3, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 3);
  ASSERT_EQ(first.size(), 3u);

  auto join = join_flags(job.so_far().err);
  ASSERT_FALSE(join.empty()) << job.so_far().err;
  const std::string wrong = temp_path("etcd_wrong.token");
  {
    std::ofstream file(wrong);
    file << "0123456789abcdef0123456789abcdef\n";
  }
  ::chmod(wrong.c_str(), 0600);
  auto wrong_join = join;
  *(std::find(wrong_join.begin(), wrong_join.end(), "--token-file") + 1) = wrong;
  auto refused = shoal::testing::run_shoal(wrong_join + std::vector<std::string>{"-n", "1", kWorker, out}, 60s);
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("refused: the token is not the job's"), std::string::npos) << refused.err;
  EXPECT_EQ(shoal::testing::split_lines(refused.err).size(), 1u) << refused.err;

  // etcd away: the workers train on from what they last saw.
  backend.etcd().stop();
  const int64_t stopped_at = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, stopped_at + 10, 3, 30s)) << job.so_far().out << job.so_far().err;
  // A worker dies while etcd is away; the survivors' round waits for etcd.
  ASSERT_EQ(::kill(first[2], SIGKILL), 0);
  std::this_thread::sleep_for(2s);
  job.wait_until([](const RunResult&) { return false; }, 10ms);  // takes in what has arrived
  const int64_t restarted_at = last_step(job.so_far().out).first;
  const auto started = std::chrono::steady_clock::now();
  backend.etcd().start();
  ASSERT_TRUE(step_at_least(job, restarted_at + 1, 0, 60s)) << job.so_far().out << job.so_far().err;
  std::printf("the job trained again %.2f s after etcd was started\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  // The launcher restarted the killed worker (after 1 s), and it joins again: in the survivors'
  // round when it came in time, or in the next one.
  ASSERT_TRUE(job.wait_until([&](const RunResult& r) { return newcomer_in(r.out, first, 3); }, 60s))
      << job.so_far().out << job.so_far().err;

  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  expect_each_sample_once(read_outcome(out), kEpochs);
}

}  // namespace

namespace {

// Two hosts (network namespaces) cut apart mid-job, 2 workers on one side and 1 on the other.
// With --quorum only the majority side trains on; the other gives up at its rendezvous timeout
// and says why. Without it both sides go on, each with its own copy of the job (docs/elastic.md,
// "--quorum and partitions"); neither hangs.
class ElasticPartition : public ::testing::TestWithParam<bool> {};

TEST_P(ElasticPartition, OnlyTheMajorityTrainsWithQuorum) {
  const bool quorum = GetParam();
  shoal::testing::TwoHosts hosts;
  if (auto problem = hosts.create()) GTEST_SKIP() << "cannot build two hosts: " << *problem;
  constexpr int kEpochs = 8;
  const std::string name = quorum ? "quorum" : "noquorum";
  const std::string out_a = temp_path(name + "_a"), out_b = temp_path(name + "_b");
  const std::string token = temp_path(name + ".token");
  const std::string address = std::string(shoal::testing::TwoHosts::kAddressA) + ":29410";
  std::vector<std::string> args = {"--min", "1", "--max", "3", "-n", "2", "--master", address,
                                   "--token-file", token, "--rendezvous-timeout", "8"};
  if (quorum) args.push_back("--quorum");
  args.insert(args.end(), {kWorker, out_a, std::to_string(kEpochs), "60"});
  ShoalRun a(args, hosts.name(0));
  ASSERT_TRUE(step_at_least(a, 3, 2, 60s)) << a.so_far().out << a.so_far().err;
  ShoalRun b({"--join", address, "--token-file", token, "--rendezvous-timeout", "8", "-n", "1", kWorker, out_b,
              std::to_string(kEpochs), "60"},
             hosts.name(1));
  const int64_t joined_from = last_step(a.so_far().out).first;
  ASSERT_TRUE(step_at_least(a, joined_from + 1, 3, 60s)) << a.so_far().out << a.so_far().err << b.so_far().err;
  const int64_t cut_at = last_step(a.so_far().out).first + 3;
  ASSERT_TRUE(step_at_least(a, cut_at, 3, 30s));

  ASSERT_TRUE(hosts.set_link(false));
  const auto cut = std::chrono::steady_clock::now();
  ASSERT_TRUE(step_at_least(a, cut_at + 1, 2, 30s)) << a.so_far().out << a.so_far().err;
  std::printf("the majority side went on after %.2f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - cut).count());
  const RunResult side_b = b.wait(90s);
  const RunResult side_a = a.wait(120s);
  EXPECT_FALSE(side_a.timed_out);
  EXPECT_FALSE(side_b.timed_out);
  EXPECT_EQ(side_a.exit_code, 0) << side_a.err;
  expect_each_sample_once(read_outcome(out_a), kEpochs);
  if (quorum) {
    EXPECT_NE(side_b.exit_code, 0) << side_b.out << side_b.err;
    EXPECT_NE(side_b.err.find("a quorum (--quorum): more than half of the 3 workers"), std::string::npos)
        << side_b.err;
    EXPECT_EQ(last_step(side_b.out).second, 0) << "the minority side trained: " << side_b.out;
  } else {
    EXPECT_EQ(side_b.exit_code, 0) << side_b.err;
    EXPECT_EQ(last_step(side_b.out).second, 1) << side_b.out;
    expect_each_sample_once(read_outcome(out_b), kEpochs);
  }
}

INSTANTIATE_TEST_SUITE_P(Quorum, ElasticPartition, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? std::string("on") : std::string("off"); });

}  // namespace
