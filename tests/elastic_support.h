// What the end-to-end elastic tests share (tests/elastic_test.cpp, tests/elastic_membership_test.cpp):
// reading tests/programs/elastic_worker's output and result, the one-process oracle, and the
// backend (gossip, or a real etcd the test starts) a job runs on.
#pragma once

#include <signal.h>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "etcd_server.h"
#include "shoal_run.h"
#include "test_paths.h"

namespace shoal::testing::elastic {

using namespace std::chrono_literals;

inline const std::string kWorker = test_programs_dir() + "/elastic_worker";
inline constexpr int kSamples = 240;

struct Outcome {
  std::vector<double> parameters;
  std::vector<int64_t> counts;
};

inline Outcome read_outcome(const std::string& path) {
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

inline std::string temp_path(const std::string& name) {
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

inline std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
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

inline std::string backend_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

// The pids of the workers in the newest round of `size` workers, by rank.
std::map<int, int> ranks_of_round(const std::vector<Start>& all, int size) {
  std::map<int, int> pids;
  for (const auto& s : all) {
    if (s.world == size) pids[s.rank] = s.pid;
  }
  return pids;
}

// A worker that is not one of `first` started training in a world of `size`.
inline bool newcomer_in(const std::string& out, const std::map<int, int>& first, int size) {
  for (const auto& s : starts(out)) {
    bool known = false;
    for (const auto& [rank, pid] : first) known = known || pid == s.pid;
    if (s.world == size && !known) return true;
  }
  return false;
}

inline bool step_at_least(ShoalRun& run, int64_t step, int world, std::chrono::milliseconds timeout) {
  return run.wait_until(
      [&](const RunResult& so_far) {
        auto [s, w] = last_step(so_far.out);
        return s >= step && (world == 0 || w == world);
      },
      timeout);
}

inline void expect_each_sample_once(const Outcome& outcome, int epochs) {
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

inline Outcome one_process(int epochs) {
  const std::string out = temp_path("reference_" + std::to_string(epochs));
  auto result = shoal::testing::run_shoal({"-n", "1", kWorker, out, std::to_string(epochs)}, 120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  return read_outcome(out);
}

inline void expect_same_parameters(const Outcome& got, const Outcome& want) {
  ASSERT_EQ(got.parameters.size(), want.parameters.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.parameters.size(); ++i) {
    diff += std::pow(got.parameters[i] - want.parameters[i], 2);
    norm += std::pow(want.parameters[i], 2);
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-4) << "relative difference of the final parameters";
}

// The oracles' changes to a running job of 3 workers (`first`: pids by rank): the second is
// SIGKILLed and the others go on; a worker joins as the first launcher says, running `program`;
// `lead` steps after it trained in the world of 3, the third leaves with SIGTERM. Then the job
// and the joiner end well, every sample of `epochs` was trained on once in committed steps, and
// the parameters in `out` are `reference`'s.
inline void kill_join_leave(ShoalRun& job, const std::map<int, int>& first,
                            const std::vector<std::string>& program, int lead,
                            const std::string& out, int epochs, const Outcome& reference) {
  ASSERT_EQ(::kill(first.at(1), SIGKILL), 0);
  const int64_t killed_at = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, killed_at + lead, 2, 60s)) << job.so_far().out << job.so_far().err;
  const auto join = join_flags(job.so_far().err);
  ASSERT_FALSE(join.empty()) << job.so_far().err;
  ShoalRun joiner(join + std::vector<std::string>{"-n", "1"} + program);
  const int64_t joined_from = last_step(job.so_far().out).first;
  ASSERT_TRUE(step_at_least(job, joined_from + 1, 3, 60s))
      << job.so_far().out << job.so_far().err << joiner.so_far().err;
  const int64_t left_at = last_step(job.so_far().out).first + lead;
  ASSERT_TRUE(step_at_least(job, left_at, 3, 30s)) << job.so_far().out << job.so_far().err;
  ASSERT_EQ(::kill(first.at(2), SIGTERM), 0);
  ASSERT_TRUE(step_at_least(job, left_at + 1, 2, 30s)) << job.so_far().out << job.so_far().err;
  const RunResult joined = joiner.wait(120s);
  const RunResult result = job.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(joined.exit_code, 0) << joined.err;
  EXPECT_NE(result.err.find("was killed by signal 9 (SIGKILL); the job goes on without it"),
            std::string::npos)
      << result.err;
  EXPECT_NE(result.err.find("leaves the job after step"), std::string::npos) << result.err;
  const Outcome outcome = read_outcome(out);
  expect_each_sample_once(outcome, epochs);
  expect_same_parameters(outcome, reference);
}

// The issue's oracle: 3 workers, one SIGKILLed mid-epoch, one joining later, one leaving with

}  // namespace shoal::testing::elastic
