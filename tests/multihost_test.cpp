// A static job over two "hosts": two network namespaces joined by a veth pair, one `shoal run`
// in each (--nnodes 2, --node-rank 0 and 1), as on two machines. Needs root; skips otherwise.
// The workers (programs/multihost_worker.cpp) all-reduce known values and print where they ran;
// the test checks the sums against the closed form and that node 1's workers reached node 0 over
// the veth addresses, from a network namespace of their own.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"
#include "netns.h"

namespace {

namespace fs = std::filesystem;
using shoal::testing::shell;
using shoal::testing::shoal_bin;
using shoal::testing::test_programs_dir;
using shoal::testing::TwoHosts;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Each launcher's deadline; a test runs its two launchers side by side, so this bounds it.
constexpr auto kLauncherDeadline = 25s;
// How long after a worker's failure both launchers have ended (MultiHostFailure).
constexpr double kAfterFailure = 5.0;
constexpr const char* kAddressA = TwoHosts::kAddressA;
constexpr const char* kAddressB = TwoHosts::kAddressB;
constexpr int kMasterPort = 29400;

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::string own_network_namespace() {
  std::error_code error;
  return fs::read_symlink("/proc/self/ns/net", error).string();
}

// A process started with `argv`, its stdout and stderr in files. Killed (SIGKILL) and reaped on
// destruction if still running; its `shoal run` watchdog then takes the workers along.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const fs::path& out, const fs::path& err)
      : out_(out), err_(err), start_(Clock::now()) {
    std::vector<char*> c_argv;
    std::vector<std::string> copy = argv;
    for (auto& arg : copy) c_argv.push_back(arg.data());
    c_argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      const int out_fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err_fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (out_fd < 0 || err_fd < 0) ::_exit(126);
      ::dup2(out_fd, STDOUT_FILENO);
      ::dup2(err_fd, STDERR_FILENO);
      ::execvp(c_argv[0], c_argv.data());
      ::_exit(127);
    }
  }

  ~Process() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // The exit code (128 + signal when killed), or nullopt if it is still running at `deadline`.
  std::optional<int> wait_until(Clock::time_point deadline) {
    while (!status_) {
      int status = 0;
      const pid_t done = ::waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
        ended_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
        break;
      }
      if (done < 0 || Clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(20ms);
    }
    return status_;
  }

  // Whether it has ended, without waiting.
  bool ended() { return wait_until(Clock::now()).has_value(); }
  double seconds() const { return seconds_; }
  int64_t ended_ms() const { return ended_ms_; }  // wall-clock, when it was seen to end
  std::string out() const { return read_file(out_); }
  std::string err() const { return read_file(err_); }

 private:
  pid_t pid_ = -1;
  fs::path out_, err_;
  Clock::time_point start_;
  std::optional<int> status_;
  double seconds_ = 0;
  int64_t ended_ms_ = 0;
};

struct Result {
  int rank = -1;
  int world = 0;
  int node = -1;
  std::string master, local, netns;
  double sum = 0;
  bool vector_ok = false;
};

std::vector<Result> parse_results(const std::string& out) {
  static const std::regex line(
      R"(result rank=(\d+) world=(\d+) node=(\d+) master=(\S+) local=(\S+) netns=(\S+) sum=(\S+) vector=(\w+))");
  std::vector<Result> results;
  std::istringstream stream(out);
  for (std::string text; std::getline(stream, text);) {
    std::smatch m;
    if (!std::regex_search(text, m, line)) continue;
    Result r;
    r.rank = std::stoi(m[1]);
    r.world = std::stoi(m[2]);
    r.node = std::stoi(m[3]);
    r.master = m[4];
    r.local = m[5];
    r.netns = m[6];
    r.sum = std::stod(m[7]);
    r.vector_ok = m[8] == "OK";
    results.push_back(r);
  }
  return results;
}

class MultiHost : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto problem = hosts_.create()) GTEST_SKIP() << "cannot build the two hosts: " << *problem;
    // Parameterised tests are named "Test/param": keep the directory flat.
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::temp_directory_path() / ("shoal-multihost-" + std::to_string(::getpid()) + "-" + name);
    fs::create_directories(dir_);
  }

  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) fs::remove_all(dir_);
  }

  // `shoal run` for node `node` in its namespace, with the worker and its arguments.
  std::vector<std::string> launcher(int node, const std::vector<std::string>& worker_args) const {
    std::vector<std::string> argv{"ip", "netns", "exec", hosts_.name(node), shoal_bin(), "run",
                                  "-n", "2", "--nnodes", "2", "--node-rank", std::to_string(node),
                                  "--master", std::string(kAddressA) + ":" + std::to_string(kMasterPort),
                                  "--connect-timeout", "15",
                                  test_programs_dir() + "/multihost_worker"};
    argv.insert(argv.end(), worker_args.begin(), worker_args.end());
    return argv;
  }

  std::unique_ptr<Process> start(int node, const std::vector<std::string>& worker_args) const {
    const std::string tag = "node" + std::to_string(node);
    return std::make_unique<Process>(launcher(node, worker_args), dir_ / (tag + ".out"),
                                     dir_ / (tag + ".err"));
  }

  TwoHosts hosts_;  // declared first: destroyed after the processes that run inside it
  fs::path dir_;
};

std::string describe(const Process& p) { return "stdout:\n" + p.out() + "stderr:\n" + p.err(); }

TEST_F(MultiHost, AllReduceAcrossTwoNamespaces) {
  auto node0 = start(0, {});
  auto node1 = start(1, {});
  const auto deadline = Clock::now() + kLauncherDeadline;
  const auto code0 = node0->wait_until(deadline);
  const auto code1 = node1->wait_until(deadline);
  ASSERT_TRUE(code0.has_value()) << "node 0's shoal run still runs after 25 s\n" << describe(*node0);
  ASSERT_TRUE(code1.has_value()) << "node 1's shoal run still runs after 25 s\n" << describe(*node1);
  EXPECT_EQ(*code0, 0) << describe(*node0);
  EXPECT_EQ(*code1, 0) << describe(*node1);

  const std::string master = std::string(kAddressA) + ":" + std::to_string(kMasterPort);
  const std::string here = own_network_namespace();
  std::set<int> ranks;
  std::map<int, std::set<std::string>> namespaces;  // node -> network namespaces of its workers
  for (int node : {0, 1}) {
    const Process& p = node == 0 ? *node0 : *node1;
    const auto results = parse_results(p.out());
    EXPECT_EQ(results.size(), 2u) << describe(p);
    for (const auto& r : results) {
      EXPECT_TRUE(ranks.insert(r.rank).second) << "rank " << r.rank << " reported twice";
      // shoal run numbers ranks node by node: node k has ranks 2k and 2k+1.
      EXPECT_EQ(r.rank / 2, node) << "rank " << r.rank << " ran on node " << node;
      EXPECT_EQ(r.node, node);
      EXPECT_EQ(r.world, 4);
      EXPECT_EQ(r.sum, 4 * 5 / 2) << "rank " << r.rank;
      EXPECT_TRUE(r.vector_ok) << "rank " << r.rank;
      EXPECT_EQ(r.master, master) << "rank " << r.rank;
      // The route to the master leaves through this node's end of the veth pair: node 1's
      // workers can only have reached node 0 over the link.
      EXPECT_EQ(r.local, node == 0 ? kAddressA : kAddressB) << "rank " << r.rank;
      EXPECT_NE(r.netns, here) << "rank " << r.rank << " ran in the test's own network namespace";
      namespaces[node].insert(r.netns);
    }
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(namespaces[0].size(), 1u);
  EXPECT_EQ(namespaces[1].size(), 1u);
  EXPECT_NE(namespaces[0], namespaces[1]) << "both nodes ran in the same network namespace";
}

// A worker of node 1 ends (exit code 3, or SIGKILL): node 1's launcher stops its other worker and
// reports the failure through the store, node 0's launcher sees it and stops its own workers;
// both exit non-zero, soon.
class MultiHostFailure : public MultiHost, public ::testing::WithParamInterface<const char*> {};

TEST_P(MultiHostFailure, BothLaunchersExitNonZero) {
  const std::string how = GetParam();
  const std::vector<std::string> args = {how == "exit" ? "--exit-rank" : "--kill-rank", "3"};
  auto node0 = start(0, args);
  auto node1 = start(1, args);
  // Both watched at once, so that each one's end is seen when it comes.
  const auto deadline = Clock::now() + kLauncherDeadline;
  while (!(node0->ended() && node1->ended()) && Clock::now() < deadline)
    std::this_thread::sleep_for(20ms);
  const auto code0 = node0->wait_until(deadline);
  const auto code1 = node1->wait_until(deadline);
  ASSERT_TRUE(code0.has_value()) << "node 0's shoal run still runs after 25 s\n" << describe(*node0);
  ASSERT_TRUE(code1.has_value()) << "node 1's shoal run still runs after 25 s\n" << describe(*node1);
  const std::string out1 = node1->out();
  const auto failing = out1.find("failing at ");
  ASSERT_NE(failing, std::string::npos) << describe(*node1);
  const int64_t failed_ms = std::atoll(out1.c_str() + failing + 11);
  const double after0 = (node0->ended_ms() - failed_ms) / 1000.0;
  const double after1 = (node1->ended_ms() - failed_ms) / 1000.0;
  std::printf("node 0: exit %d after %.2f s, %.2f s after the failure; node 1: exit %d after "
              "%.2f s, %.2f s after the failure\n",
              *code0, node0->seconds(), after0, *code1, node1->seconds(), after1);
  EXPECT_NE(*code0, 0) << describe(*node0);
  EXPECT_NE(*code1, 0) << describe(*node1);
  // Node 1's launcher passes on how its worker ended.
  EXPECT_EQ(*code1, how == "exit" ? 3 : 128 + SIGKILL) << describe(*node1);
  const std::string ended = how == "exit" ? "worker 3 exited with code 3"
                                          : "worker 3 was killed by signal 9 (SIGKILL)";
  EXPECT_NE(node1->err().find(ended), std::string::npos) << describe(*node1);
  // Well under the workers' 10 s collective timeout: the failure travels through the launchers
  // (and Gloo's closed sockets), not through a timeout. Timed from the failure, not from the
  // launchers' start, whose workers load LibTorch: on a busy machine that alone took 10 s.
  EXPECT_LT(after0, kAfterFailure) << describe(*node0);
  EXPECT_LT(after1, kAfterFailure) << describe(*node1);
  // All four workers had joined the job before one of them ended.
  EXPECT_EQ(parse_results(node0->out()).size() + parse_results(node1->out()).size(), 4u)
      << describe(*node0) << describe(*node1);
}

// docs/ps.md, "Processes": `shoal run --servers 2` on two hosts runs server 0 on node 0 and
// server 1 on node 1; the four workers of both nodes train on both servers, each checking every
// sync step against one process (tests/programs/ps_worker.cpp); the servers of each node wait for
// every node's workers, and both launchers exit 0.
TEST_F(MultiHost, ParameterServersOnBothHostsTrainAsOneProcess) {
  auto start_node = [&](int node, const std::string& servers) {
    const std::vector<std::string> argv{
        "ip", "netns", "exec", hosts_.name(node), shoal_bin(), "run", "-n", "2", "--nnodes", "2",
        "--node-rank", std::to_string(node), "--master",
        std::string(kAddressA) + ":" + std::to_string(kMasterPort), "--connect-timeout", "15",
        "--servers", servers, test_programs_dir() + "/ps_worker"};
    const std::string tag = "ps-node" + std::to_string(node);
    return std::make_unique<Process>(argv, dir_ / (tag + ".out"), dir_ / (tag + ".err"));
  };
  {
    auto node0 = start_node(0, "2");
    auto node1 = start_node(1, "2");
    const auto deadline = Clock::now() + 90s;
    const auto code0 = node0->wait_until(deadline);
    const auto code1 = node1->wait_until(deadline);
    ASSERT_TRUE(code0.has_value()) << describe(*node0);
    ASSERT_TRUE(code1.has_value()) << describe(*node1);
    EXPECT_EQ(*code0, 0) << describe(*node0);
    EXPECT_EQ(*code1, 0) << describe(*node1);
    for (int rank = 0; rank < 4; ++rank) {
      const Process& p = rank < 2 ? *node0 : *node1;
      EXPECT_NE(p.out().find("[" + std::to_string(rank) + "] ps ok 2 servers, 4 sync steps"),
                std::string::npos)
          << describe(p);
    }
    const std::regex at("\\[0\\] ps servers at ([0-9.]+):[0-9]+ ([0-9.]+):[0-9]+");
    const std::string out0 = node0->out();
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out0, m, at)) << describe(*node0);
    EXPECT_EQ(m[1].str(), kAddressA);
    EXPECT_EQ(m[2].str(), kAddressB);
  }
  // A node started with other servers than node 0's: both launchers fail, saying why.
  auto node0 = start_node(0, "2");
  auto node1 = start_node(1, "1");
  const auto deadline = Clock::now() + kLauncherDeadline;
  const auto code0 = node0->wait_until(deadline);
  const auto code1 = node1->wait_until(deadline);
  ASSERT_TRUE(code0.has_value()) << describe(*node0);
  ASSERT_TRUE(code1.has_value()) << describe(*node1);
  EXPECT_NE(*code0, 0) << describe(*node0);
  EXPECT_NE(*code1, 0) << describe(*node1);
  EXPECT_NE(node1->err().find("node 1 runs with --servers 1 --ps-replicas 1 --ps-backup-workers 0 "
                              "SHOAL_PS_MODE=, node 0 with --servers 2 --ps-replicas 1 "
                              "--ps-backup-workers 0 SHOAL_PS_MODE=; expected the same parameter "
                              "servers on every node"),
            std::string::npos)
      << describe(*node1);
}

INSTANTIATE_TEST_SUITE_P(Worker3, MultiHostFailure, ::testing::Values("exit", "kill"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
