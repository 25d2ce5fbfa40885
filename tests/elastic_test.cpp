// Elastic jobs end to end: `shoal run --min/--max` with tests/programs/elastic_worker, workers
// SIGKILLed, SIGSTOPped, joining and leaving mid-epoch. Oracles: the final parameters equal a
// one-process run over the same global batches, and every sample of every epoch was trained on
// exactly once in committed steps (the program keeps that count in its elastic state).
#include <signal.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <shoal/shoal.h>
#include <torch/torch.h>

#include "etcd_server.h"
#include "netns.h"
#include "shoal_run.h"
#include "test_paths.h"

namespace {

using shoal::testing::RunResult;
using shoal::testing::ShoalRun;
using namespace std::chrono_literals;

const std::string kWorker = std::string(SHOAL_TEST_PROGRAMS_DIR) + "/elastic_worker";
constexpr int kSamples = 240;

struct Outcome {
  std::vector<double> parameters;
  std::vector<int64_t> counts;
};

Outcome read_outcome(const std::string& path) {
  Outcome outcome;
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  std::istringstream values(line);
  double v;
  while (values >> v) outcome.parameters.push_back(v);
  std::getline(file, line);
  std::istringstream counts(line);
  std::string word;
  counts >> word;
  int64_t c;
  while (counts >> c) outcome.counts.push_back(c);
  return outcome;
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/elastic_" + std::to_string(::getpid()) + "_" + name;
}

// "train pid=P rank=R world=W step=S" lines, in order.
struct Start {
  int pid, rank, world;
  int64_t step;
};
std::vector<Start> starts(const std::string& out) {
  std::vector<Start> result;
  static const std::regex line(R"(train pid=(\d+) rank=(\d+) world=(\d+) step=(\d+))");
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    result.push_back({std::stoi((*it)[1]), std::stoi((*it)[2]), std::stoi((*it)[3]), std::stoll((*it)[4])});
  }
  return result;
}

// The last "step S world W" line: {S, W}, or {-1, 0}.
std::pair<int64_t, int> last_step(const std::string& out) {
  static const std::regex line(R"(step (\d+) world (\d+))");
  std::pair<int64_t, int> last{-1, 0};
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    last = {std::stoll((*it)[1]), std::stoi((*it)[2])};
  }
  return last;
}

// The address and token file that the first launcher prints for --join.
std::pair<std::string, std::string> join_hint(const std::string& err) {
  static const std::regex line(R"(to add workers: shoal run --join (\S+) --token-file (\S+))");
  std::smatch match;
  if (!std::regex_search(err, match, line)) return {};
  return {match[1], match[2]};
}

// The flags that the first launcher prints for adding workers: what goes between `shoal run` and
// PROGRAM (--join and --token-file, and --rendezvous with etcd).
std::vector<std::string> join_flags(const std::string& err) {
  static const std::regex line(R"(to add workers: shoal run (.+) PROGRAM)");
  std::smatch match;
  if (!std::regex_search(err, match, line)) return {};
  std::istringstream words(match[1].str());
  std::vector<std::string> flags;
  for (std::string word; words >> word;) flags.push_back(word);
  return flags;
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The membership a test's job runs on: gossip among its processes (no service), or a real etcd
// server (Debian's etcd-server) that the test starts and may stop.
class Backend {
 public:
  explicit Backend(const std::string& name) {
    if (name == "etcd") etcd_ = std::make_unique<shoal::testing::EtcdServer>();
  }
  // The first launcher's flags for it.
  std::vector<std::string> flags() const {
    if (!etcd_) return {};
    return {"--rendezvous", "etcd://" + etcd_->endpoint()};
  }
  shoal::testing::EtcdServer& etcd() { return *etcd_; }

 private:
  std::unique_ptr<shoal::testing::EtcdServer> etcd_;
};

std::string backend_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

// The pids of the workers in the newest round of `size` workers, by rank.
std::map<int, int> ranks_of_round(const std::vector<Start>& all, int size) {
  std::map<int, int> pids;
  for (const auto& s : all) {
    if (s.world == size) pids[s.rank] = s.pid;
  }
  return pids;
}

// A worker that is not one of `first` started training in a world of `size`.
bool newcomer_in(const std::string& out, const std::map<int, int>& first, int size) {
  for (const auto& s : starts(out)) {
    bool known = false;
    for (const auto& [rank, pid] : first) known = known || pid == s.pid;
    if (s.world == size && !known) return true;
  }
  return false;
}

bool step_at_least(ShoalRun& run, int64_t step, int world, std::chrono::milliseconds timeout) {
  return run.wait_until(
      [&](const RunResult& so_far) {
        auto [s, w] = last_step(so_far.out);
        return s >= step && (world == 0 || w == world);
      },
      timeout);
}

void expect_each_sample_once(const Outcome& outcome, int epochs) {
  ASSERT_EQ(outcome.counts.size(), static_cast<size_t>(epochs * kSamples));
  int wrong = 0;
  for (size_t i = 0; i < outcome.counts.size(); ++i) {
    if (outcome.counts[i] != 1 && wrong++ < 5) {
      ADD_FAILURE() << "epoch " << i / kSamples << " sample " << i % kSamples << " was trained on "
                    << outcome.counts[i] << " times in committed steps";
    }
  }
  EXPECT_EQ(wrong, 0);
}

Outcome one_process(int epochs) {
  const std::string out = temp_path("reference_" + std::to_string(epochs));
  auto result = shoal::testing::run_shoal({"-n", "1", kWorker, out, std::to_string(epochs)}, 120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  return read_outcome(out);
}

void expect_same_parameters(const Outcome& got, const Outcome& want) {
  ASSERT_EQ(got.parameters.size(), want.parameters.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.parameters.size(); ++i) {
    diff += std::pow(got.parameters[i] - want.parameters[i], 2);
    norm += std::pow(want.parameters[i], 2);
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-4) << "relative difference of the final parameters";
}

// The issue's oracle: 3 workers, one SIGKILLed mid-epoch, one joining later, one leaving with
// SIGTERM; the global batch stays, so the result is the one-process run's. On both backends.
class ElasticOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(ElasticOracle, KillJoinLeaveEndsWithTheOneProcessParameters) {
  constexpr int kEpochs = 8;
  const Outcome reference = one_process(kEpochs);
  expect_each_sample_once(reference, kEpochs);

  Backend backend(GetParam());
  const std::string out = temp_path("oracle_" + GetParam());
  const std::string token = temp_path("oracle_" + GetParam() + ".token");
  ShoalRun job(backend.flags() + std::vector<std::string>{"--min", "1", "--max", "3", "-n", "3", "--token-file", token,
                                                          kWorker, out, std::to_string(kEpochs), "80"});
  ASSERT_TRUE(step_at_least(job, 15, 3, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 3);
  ASSERT_EQ(first.size(), 3u);
  struct stat info {};
  ASSERT_EQ(::stat(token.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);

  // SIGKILL the second worker; the other two go on.
  ASSERT_EQ(::kill(first[1], SIGKILL), 0);
  const int64_t killed_at = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, killed_at + 5, 2, 30s)) << job.so_far().out << job.so_far().err;

  // A worker joins as the first launcher says.
  const auto join = join_flags(job.so_far().err);
  ASSERT_FALSE(join.empty()) << job.so_far().err;
  EXPECT_NE(std::find(join.begin(), join.end(), token), join.end()) << job.so_far().err;
  ShoalRun joiner(join + std::vector<std::string>{"-n", "1", kWorker, out, std::to_string(kEpochs), "80"});
  const int64_t joined_from = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, joined_from + 1, 3, 60s)) << job.so_far().out << job.so_far().err
                                                            << joiner.so_far().err;

  // The third worker of the first round leaves with SIGTERM.
  const int64_t left_at = last_step(job.so_far().out).first + 5;
  ASSERT_TRUE(step_at_least(job, left_at, 3, 30s));
  ASSERT_EQ(::kill(first[2], SIGTERM), 0);
  ASSERT_TRUE(step_at_least(job, left_at + 1, 2, 30s)) << job.so_far().out << job.so_far().err;

  const RunResult joined = joiner.wait(120s);
  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(joined.exit_code, 0) << joined.err;
  EXPECT_NE(result.err.find("was killed by signal 9 (SIGKILL); the job goes on without it"), std::string::npos)
      << result.err;
  EXPECT_NE(result.err.find("leaves the job after step"), std::string::npos) << result.err;
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, kEpochs);
  expect_same_parameters(outcome, reference);
  EXPECT_NE(::stat(token.c_str(), &info), 0) << "the token file outlived the job";
}

INSTANTIATE_TEST_SUITE_P(Backends, ElasticOracle, ::testing::Values("gossip", "etcd"), backend_name);

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
  ShoalRun job(backend.flags() + std::vector<std::string>{"--min", "1", "--max", std::to_string(std::max(n, 2)), "-n",
                                                          std::to_string(n), "--max-restarts", "1", "--token-file",
                                                          token, kWorker, out, std::to_string(kEpochs), "60"});
  ASSERT_TRUE(step_at_least(job, 10, n, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), n);
  ASSERT_EQ(first.size(), static_cast<size_t>(n));
  std::unique_ptr<ShoalRun> joiner;
  if (n == 1) {
    // One worker: another joins, then the first leaves; the newcomer finishes the job.
    joiner = std::make_unique<ShoalRun>(join_flags(job.so_far().err) +
                                        std::vector<std::string>{"-n", "1", kWorker, out, std::to_string(kEpochs), "60"});
    const int64_t from = last_step(job.so_far().out).first;
    ASSERT_TRUE(step_at_least(job, from + 1, 2, 60s)) << job.so_far().out << job.so_far().err;
    ASSERT_EQ(::kill(first[0], SIGTERM), 0);
    ASSERT_TRUE(joiner->wait_until([](const RunResult& r) { return last_step(r.out).second == 1; }, 60s))
        << joiner->so_far().out << joiner->so_far().err << job.so_far().err;
  } else {
    // SIGKILL the last worker: it is restarted after 1 s and joins again (the others train on
    // without it meanwhile, or take it in at once when their round closed after its start).
    ASSERT_EQ(::kill(first[n - 1], SIGKILL), 0);
    ASSERT_TRUE(job.wait_until([&](const RunResult& r) { return newcomer_in(r.out, first, n); }, 60s))
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

INSTANTIATE_TEST_SUITE_P(WorldSizes, ElasticAccounting,
                         ::testing::Values(std::make_tuple("gossip", 1), std::make_tuple("gossip", 2),
                                           std::make_tuple("gossip", 3), std::make_tuple("gossip", 4),
                                           std::make_tuple("etcd", 1), std::make_tuple("etcd", 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_n" + std::to_string(std::get<1>(info.param));
                         });

// A SIGSTOPped worker is declared dead by the membership and the others go on; after SIGCONT it
// joins again as a new worker.
TEST(Elastic, StoppedWorkerIsExcludedAndRejoinsAfterContinue) {
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
TEST(Elastic, JoinWithoutTheTokenIsRefused) {
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

TEST(Elastic, BadFlagsAreUsageErrors) {
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
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", token, kWorker, out, std::to_string(kEpochs),
                "20"});
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
    EXPECT_NE(result.err.find("no worker holds the parameters of commit 10: they changed after it (the optimizer "
                              "stepped) and a collective failed before the next commit(); commit right after the "
                              "optimizer's step, or set StateOptions::copy_parameters"),
              std::string::npos)
        << result.err;
  }
}

INSTANTIATE_TEST_SUITE_P(Commits, ElasticChangedParameters, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? std::string("copied") : std::string("not_copied"); });

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
  ShoalRun job({"--min", "1", "--max", "3", "-n", "3", "--token-file", token, kWorker, out, std::to_string(kEpochs),
                "60", policy});
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
        << first_rate << "\n" << result.out;
    EXPECT_NEAR(seen[shrunk_at + 3].second, 0.10, 1e-9) << result.out;
  } else {
    EXPECT_NEAR(seen[shrunk_at].second, 0.10, 1e-9) << result.out;
  }
  EXPECT_NEAR(seen.back().second, 0.10, 1e-9);
  expect_each_sample_once(read_outcome(out), kEpochs);
}

INSTANTIATE_TEST_SUITE_P(Policies, ElasticScaling, ::testing::Values("scale", "warmup"),
                         [](const auto& info) { return info.param; });

// Above --max, a newcomer waits; it joins when a place frees up.
TEST(Elastic, NewcomersAboveMaxWaitForRoom) {
  constexpr int kEpochs = 8;
  const std::string out = temp_path("max");
  const std::string token = temp_path("max.token");
  ShoalRun job({"--min", "1", "--max", "2", "-n", "2", "--token-file", token, kWorker, out, std::to_string(kEpochs),
                "60"});
  ASSERT_TRUE(step_at_least(job, 5, 2, 60s)) << job.so_far().out << job.so_far().err;
  auto first = ranks_of_round(starts(job.so_far().out), 2);
  auto [address, token_file] = join_hint(job.so_far().err);
  ShoalRun joiner({"--join", address, "--token-file", token_file, "-n", "1", kWorker, out, std::to_string(kEpochs),
                   "60"});
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
                 "elastic::State: BatchPolicy::keep_global_batch() needs a sampler whose batch_size is the global "
                 "batch; this one is per_worker");
  }
  try {
    shoal::elastic::State state(*net, optimizer, global_sampler,
                                {shoal::elastic::BatchPolicy::scale_learning_rate()});
    ADD_FAILURE() << "expected UsageError";
  } catch (const shoal::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("scale_learning_rate() needs a per_worker sampler"), std::string::npos)
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
  state.restore();
  EXPECT_TRUE(net->weight.detach().equal(weight));
  EXPECT_EQ(sampler.cursor(), cursor);
  EXPECT_EQ(state.value("seen").item<int64_t>(), 7);
  EXPECT_EQ(state.version(), 1);
  // The optimizer's state too: the same step from the commit gives the same weights.
  torch::manual_seed(5);
  step();
  const auto once = net->weight.detach().clone();
  state.restore();
  torch::manual_seed(5);
  step();
  EXPECT_TRUE(net->weight.detach().equal(once));
}

}  // namespace
