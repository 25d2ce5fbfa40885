// `shoal run` from the outside: the real binary (shoal_bin()) runs shell-script workers written
// into a temporary directory, and each test asserts on its exit code, its two output streams,
// files the workers leave behind, and which processes are still alive.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"
#include "shoal_run.h"
#include "comm/store.h"

extern char** environ;

namespace shoal::launch {
namespace {

using testing::RunResult;
using testing::ShoalRun;
using testing::run_shoal;
using testing::split_lines;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Alive means: exists and is not a zombie (a zombie is dead, waiting for its parent to notice).
bool alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  auto close = line.rfind(')');
  return close == std::string::npos || line.size() < close + 3 || line[close + 2] != 'Z';
}

bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (!condition()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

std::vector<pid_t> read_pids(const std::string& path) {
  std::vector<pid_t> pids;
  std::ifstream file(path);
  for (pid_t pid; file >> pid;) pids.push_back(pid);
  return pids;
}

bool file_exists(const std::string& path) { return std::filesystem::exists(path); }

class LaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/shoal-launch-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes an executable script; "$DIR" in it is this test's directory.
  std::string script(const std::string& name, const std::string& body,
                     const std::string& shell = "/bin/sh") {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << "#!" << shell << "\nDIR=" << dir_ << "\n" << body << "\n";
    ::chmod(path.c_str(), 0755);
    return path;
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // Asserts that every pid in the file is dead within a few seconds.
  void expect_all_dead(const std::string& pid_file, size_t expected_count) {
    auto pids = read_pids(pid_file);
    EXPECT_EQ(pids.size(), expected_count);
    for (pid_t pid : pids) {
      EXPECT_TRUE(eventually([&] { return !alive(pid); }, 5s)) << "process " << pid << " outlived shoal run";
      if (alive(pid)) ::kill(pid, SIGKILL);
    }
  }

  std::string dir_;
};

// "[r] NAME=value" lines (from `env` in each worker) to one variable map per rank.
std::map<int, std::map<std::string, std::string>> environments(const std::string& out) {
  std::map<int, std::map<std::string, std::string>> by_rank;
  static const std::regex line_format(R"(\[(\d+)\] ([A-Za-z_][A-Za-z0-9_]*)=(.*))");
  for (const auto& line : split_lines(out)) {
    std::smatch match;
    if (std::regex_match(line, match, line_format)) by_rank[std::stoi(match[1])][match[2]] = match[3];
  }
  return by_rank;
}

TEST_F(LaunchTest, WorkersGetShoalAndTorchrunEnvironment) {
  const std::string env = script("env.sh", "exec env");
  for (int n = 1; n <= 3; ++n) {
    SCOPED_TRACE("-n " + std::to_string(n));
    RunResult run = run_shoal({"-n", std::to_string(n), "--tag-output", env});
    ASSERT_FALSE(run.timed_out);
    ASSERT_EQ(run.exit_code, 0) << run.err;
    auto by_rank = environments(run.out);
    ASSERT_EQ(by_rank.size(), static_cast<size_t>(n)) << run.out;
    const std::string port = by_rank[0]["SHOAL_MASTER_PORT"];
    const std::string run_id = by_rank[0]["SHOAL_RUN_ID"];
    EXPECT_GT(std::atoi(port.c_str()), 0);
    EXPECT_TRUE(std::regex_match(run_id, std::regex("[0-9a-f]{16}"))) << run_id;
    for (int r = 0; r < n; ++r) {
      auto& vars = by_rank[r];
      const std::string rank = std::to_string(r), size = std::to_string(n);
      const std::map<std::string, std::string> expected = {
          {"SHOAL_RANK", rank}, {"SHOAL_WORLD_SIZE", size}, {"SHOAL_LOCAL_RANK", rank},
          {"SHOAL_LOCAL_WORLD_SIZE", size}, {"SHOAL_NODE_RANK", "0"}, {"SHOAL_NNODES", "1"},
          {"SHOAL_MASTER_ADDR", "127.0.0.1"}, {"SHOAL_MASTER_PORT", port}, {"SHOAL_RUN_ID", run_id},
          {"RANK", rank}, {"WORLD_SIZE", size}, {"LOCAL_RANK", rank}, {"LOCAL_WORLD_SIZE", size},
          {"GROUP_RANK", "0"}, {"ROLE_RANK", rank}, {"ROLE_WORLD_SIZE", size},
          {"ROLE_NAME", "default"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RUN_ID", run_id},
          {"TORCHELASTIC_RESTART_COUNT", "0"}, {"TORCHELASTIC_MAX_RESTARTS", "0"}};
      for (const auto& [name, value] : expected) {
        ASSERT_EQ(vars.count(name), 1u) << "worker " << r << " lacks " << name;
        EXPECT_EQ(vars[name], value) << "worker " << r << ": " << name;
      }
      // Passed through as the user set it (or not), never invented by the launcher.
      const char* omp = std::getenv("OMP_NUM_THREADS");
      EXPECT_EQ(vars.count("OMP_NUM_THREADS"), omp ? 1u : 0u);
    }
  }
}

TEST_F(LaunchTest, MasterPortFlagSetsThePort) {
  const int port = shoal::testing::free_port();
  RunResult run = run_shoal({"-n", "2", "--master-port", std::to_string(port), script("env.sh", "exec env")});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto by_rank = environments(run.out);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(by_rank[r]["MASTER_PORT"], std::to_string(port));
    EXPECT_EQ(by_rank[r]["SHOAL_MASTER_PORT"], std::to_string(port));
  }
}

// The promise to torchrun users: a torch.distributed program runs under shoal run unchanged
// (env:// rendezvous, connecting to the launcher's store as TORCHELASTIC_USE_AGENT_STORE says).
TEST_F(LaunchTest, TorchrunProgramRunsUnchanged) {
  const std::string python = "/usr/bin/python3";
  if (!file_exists("/usr/lib/python3/dist-packages/torch/__init__.py")) {
    GTEST_SKIP() << "Debian's python3-torch is not installed";
  }
  std::ofstream(path("allreduce.py"))
      << "import torch, torch.distributed as dist\n"
         "dist.init_process_group('gloo')\n"
         "t = torch.tensor([float(dist.get_rank() + 1)])\n"
         "dist.all_reduce(t)\n"
         "print(f'{dist.get_rank()} of {dist.get_world_size()}: {t.item()}', flush=True)\n"
         "dist.destroy_process_group()\n";
  RunResult run = run_shoal({"-n", "2", python, path("allreduce.py")}, 60s);
  ASSERT_FALSE(run.timed_out);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto lines = split_lines(run.out);
  std::sort(lines.begin(), lines.end());
  EXPECT_EQ(lines, (std::vector<std::string>{"[0] 0 of 2: 3.0", "[1] 1 of 2: 3.0"})) << run.out;
}

// Each worker writes 1000 lines to stdout and 1000 to stderr, alternating, every line in two
// writes (so the launcher sees partial lines), then an unterminated last line on stdout.
std::string chatty_worker_body() {
  return "pad=$(printf '%0180d' 0)\n"
         "i=0\n"
         "while [ $i -lt 2000 ]; do\n"
         "  if [ $((i % 2)) -eq 0 ]; then printf 'w%s out %s ' $SHOAL_RANK $i; printf '%s\\n' $pad;\n"
         "  else printf 'w%s err %s ' $SHOAL_RANK $i >&2; printf '%s\\n' $pad >&2; fi\n"
         "  i=$((i + 1))\n"
         "done\n"
         "printf 'tail of w%s' $SHOAL_RANK";
}

// Checks that `text` holds, for each of 3 workers, exactly the lines it wrote to `stream`, whole
// and in order, each with the expected prefix.
void expect_lines(const std::string& text, const std::string& stream, bool tagged) {
  const std::string pad(180, '0');
  std::map<int, int> next;  // worker -> next expected i
  std::map<int, int> tails;
  const std::regex format(tagged ? R"(\[(\d)\] w(\d) (out|err) (\d+) (0+))" : R"(()w(\d) (out|err) (\d+) (0+))");
  const std::regex tail_format(tagged ? R"(\[(\d)\] tail of w(\d))" : R"(()tail of w(\d))");
  for (const auto& line : split_lines(text)) {
    std::smatch match;
    if (std::regex_match(line, match, tail_format)) {
      if (tagged) {
        EXPECT_EQ(match[1], match[2]) << line;
      }
      ++tails[std::stoi(match[2])];
      continue;
    }
    ASSERT_TRUE(std::regex_match(line, match, format)) << "mangled line on " << stream << ": " << line.substr(0, 300);
    const int worker = std::stoi(match[2]);
    if (tagged) {
      EXPECT_EQ(std::stoi(match[1]), worker) << line.substr(0, 40);
    }
    EXPECT_EQ(match[3], stream);
    EXPECT_EQ(match[5].length(), pad.size());
    const int i = std::stoi(match[4]);
    const int first = stream == "out" ? 0 : 1;
    EXPECT_EQ(i, next.count(worker) ? next[worker] : first) << "out of order for worker " << worker;
    next[worker] = i + 2;
  }
  for (int w = 0; w < 3; ++w) {
    EXPECT_EQ(next[w], (stream == "out" ? 2000 : 2001)) << "worker " << w << " on " << stream;
    EXPECT_EQ(tails[w], stream == "out" ? 1 : 0) << "worker " << w << " on " << stream;
  }
}

TEST_F(LaunchTest, TaggedOutputKeepsLinesWholeAndStreamsApart) {
  RunResult run = run_shoal({"-n", "3", script("chatty.sh", chatty_worker_body())});
  ASSERT_FALSE(run.timed_out);
  ASSERT_EQ(run.exit_code, 0) << run.err.substr(0, 2000);
  EXPECT_EQ(split_lines(run.out).size(), 3u * 1001);
  EXPECT_EQ(split_lines(run.err).size(), 3u * 1000);
  expect_lines(run.out, "out", true);
  expect_lines(run.err, "err", true);
}

TEST_F(LaunchTest, NoTagOutputForwardsRawLines) {
  RunResult run = run_shoal({"-n", "3", "--no-tag-output", script("chatty.sh", chatty_worker_body())});
  ASSERT_EQ(run.exit_code, 0) << run.err.substr(0, 2000);
  expect_lines(run.out, "out", false);
  expect_lines(run.err, "err", false);
  // One worker is not tagged unless asked.
  RunResult single = run_shoal({"echo", "hello"});
  EXPECT_EQ(single.out, "hello\n");
}

TEST_F(LaunchTest, FailingWorkerStopsTheOthers) {
  // Worker 2 fails once the other two have recorded their pids and gone to sleep.
  const std::string worker = script("fail.sh",
      "if [ $SHOAL_RANK = 2 ]; then\n"
      "  while [ $(cat $DIR/pids 2>/dev/null | wc -l) -lt 2 ]; do sleep 0.05; done\n"
      "  exit 3\n"
      "fi\n"
      "echo $$ >> $DIR/pids\n"
      "sleep 1000");
  RunResult run = run_shoal({"-n", "3", worker});
  ASSERT_FALSE(run.timed_out);
  EXPECT_EQ(run.exit_code, 3);
  EXPECT_LT(run.seconds, 30.0);  // a failure bound: the others sleep 1000 s
  EXPECT_EQ(run.err, "shoal run: worker 2 exited with code 3; stopping the other workers\n");
  expect_all_dead(path("pids"), 2);
}

TEST_F(LaunchTest, KilledWorkerIsReportedBySignal) {
  const std::string worker = script("killed.sh",
      "if [ $SHOAL_RANK = 1 ]; then sleep 0.2; kill -9 $$; fi\n"
      "echo $$ >> $DIR/pids\n"
      "sleep 1000");
  RunResult run = run_shoal({"-n", "2", worker});
  ASSERT_FALSE(run.timed_out);
  EXPECT_EQ(run.exit_code, 128 + SIGKILL);
  EXPECT_LT(run.seconds, 30.0);
  EXPECT_EQ(run.err, "shoal run: worker 1 was killed by signal 9 (SIGKILL); stopping the other workers\n");
  expect_all_dead(path("pids"), 1);
}

TEST_F(LaunchTest, SigtermReachesEveryWorker) {
  const std::string worker = script("trap.sh",
      "trap 'echo $SHOAL_RANK > $DIR/term.$SHOAL_RANK; exit 0' TERM\n"
      "sleep 1000 &\n"
      "echo $! >> $DIR/pids; echo $$ >> $DIR/pids\n"
      "touch $DIR/ready.$SHOAL_RANK\n"
      "wait");
  ShoalRun launcher({"-n", "2", worker});
  ASSERT_TRUE(eventually([&] { return file_exists(path("ready.0")) && file_exists(path("ready.1")); }, 15s));
  ::kill(launcher.pid(), SIGTERM);
  RunResult run = launcher.wait(15s);
  ASSERT_FALSE(run.timed_out);
  EXPECT_EQ(run.exit_code, 128 + SIGTERM);
  EXPECT_TRUE(file_exists(path("term.0")));
  EXPECT_TRUE(file_exists(path("term.1")));
  EXPECT_EQ(run.err, "shoal run: received SIGTERM; stopping the workers\n");
  expect_all_dead(path("pids"), 4);
}

// Every worker leaves a grandchild (`sleep 1000 &`) behind; all must die with the job.
const char* kGrandparentBody =
    "sleep 1000 &\n"
    "echo $! >> $DIR/pids; echo $$ >> $DIR/pids\n";

TEST_F(LaunchTest, NoOrphansAfterSuccess) {
  RunResult run = run_shoal({"-n", "2", script("spawn.sh", std::string(kGrandparentBody) + "exit 0")});
  ASSERT_FALSE(run.timed_out);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  expect_all_dead(path("pids"), 4);
}

TEST_F(LaunchTest, NoOrphansAfterFailure) {
  const std::string worker = script("spawn.sh", std::string(kGrandparentBody) +
      "if [ $SHOAL_RANK = 0 ]; then\n"
      "  while [ $(wc -l < $DIR/pids) -lt 6 ]; do sleep 0.05; done\n"
      "  exit 5\n"
      "fi\n"
      "wait");
  RunResult run = run_shoal({"-n", "3", worker});
  ASSERT_FALSE(run.timed_out);
  EXPECT_EQ(run.exit_code, 5);
  expect_all_dead(path("pids"), 6);
}

TEST_F(LaunchTest, NoOrphansAfterTheLauncherIsKilled) {
  const std::string worker = script("spawn.sh", std::string(kGrandparentBody) + "wait");
  ShoalRun launcher({"-n", "2", worker});
  ASSERT_TRUE(eventually([&] { return read_pids(path("pids")).size() == 4; }, 15s));
  ::kill(launcher.pid(), SIGKILL);
  RunResult run = launcher.wait(10s);
  EXPECT_EQ(run.exit_code, 128 + SIGKILL);
  expect_all_dead(path("pids"), 4);
}

TEST_F(LaunchTest, ExitSentenceIsRecordedInTheStore) {
  // Worker 1 ends at once; worker 0 publishes the store's port and waits to be released.
  const std::string worker = script("exit.sh",
      "if [ $SHOAL_RANK = 1 ]; then exit 0; fi\n"
      "echo $SHOAL_MASTER_PORT > $DIR/port.tmp; mv $DIR/port.tmp $DIR/port\n"
      "i=0; while [ ! -e $DIR/release ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i + 1)); done");
  ShoalRun launcher({"-n", "2", worker});
  ASSERT_TRUE(eventually([&] { return file_exists(path("port")); }, 15s));
  comm::StoreOptions options;
  options.port = read_pids(path("port")).at(0);
  options.timeout = 10s;
  auto store = comm::open_store(options);
  std::string how;
  EXPECT_TRUE(eventually([&] { return !(how = comm::try_get(store, comm::worker_exit_key(1))).empty(); }, 10s));
  EXPECT_EQ(how, "exited with code 0");
  std::ofstream(path("release")) << "\n";
  RunResult run = launcher.wait(15s);
  EXPECT_EQ(run.exit_code, 0) << run.err;
}

struct UsageCase {
  std::vector<std::string> args;
  std::string mentions;
};

// Each case: a one-line error on stderr, starting "shoal run: " and containing `mentions`, and
// exit code 2. The cases run side by side: each launcher spends most of its ~1 s loading LibTorch.
void expect_usage_errors(const std::vector<UsageCase>& cases) {
  std::vector<std::unique_ptr<ShoalRun>> runs;
  for (const auto& c : cases) runs.push_back(std::make_unique<ShoalRun>(c.args));
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string shown;
    for (const auto& arg : cases[i].args) shown += " " + arg;
    SCOPED_TRACE("shoal run" + shown);
    RunResult run = runs[i]->wait(30s);
    ASSERT_FALSE(run.timed_out);
    EXPECT_EQ(run.exit_code, 2);
    EXPECT_EQ(run.out, "");
    auto lines = split_lines(run.err);
    ASSERT_EQ(lines.size(), 1u) << run.err;
    EXPECT_EQ(lines[0].rfind("shoal run: ", 0), 0u) << lines[0];
    EXPECT_NE(lines[0].find(cases[i].mentions), std::string::npos) << lines[0];
  }
}

TEST_F(LaunchTest, BadInputIsOneLineAndExitCodeTwo) {
  const std::string ok = script("ok.sh", "exit 0");
  const std::string not_executable = path("plain.txt");
  std::ofstream(not_executable) << "hello\n";
  const std::string no_shebang = path("garbage");
  std::ofstream(no_shebang) << "\x7f" << "not an executable\n";
  ::chmod(no_shebang.c_str(), 0755);

  // A port that is taken: listen on it first.
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t length = sizeof(address);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  const std::string port = std::to_string(ntohs(address.sin_port));

  expect_usage_errors({
      {{"-n", "2"}, "no program given"},
      {{"/nonexistent/program"}, "'/nonexistent/program' does not exist"},
      {{"no-such-program-anywhere"}, "not found on PATH"},
      {{not_executable}, "is not executable"},
      {{no_shebang}, "cannot execute"},
      {{"-n", "0", ok}, "-n/--nproc-per-node"},
      {{"-n", "abc", ok}, "got 'abc'"},
      {{"--bogus", ok}, "unknown flag '--bogus'"},
      {{"-n"}, "-n needs a value"},
      {{"--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:1", ok}, "--node-rank 2"},
      {{"--master", "127.0.0.1", ok}, "has no port"},
      {{"--nnodes", "2", ok}, "needs --master"},
      {{"--master-port", port, ok}, "port " + port + " is already in use"},
      {{"--master", "127.0.0.1:" + port, ok}, "port " + port + " is already in use"},
  });
  ::close(listener);

  RunResult help = run_shoal({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Usage: shoal run [OPTIONS] PROGRAM [ARGS...]"), std::string::npos);
}

std::vector<std::string> node_args(int node, const std::string& master, const std::string& program) {
  return {"-n", "2", "--nnodes", "2", "--node-rank", std::to_string(node), "--master", master,
          "--connect-timeout", "20", program};
}

TEST_F(LaunchTest, TwoNodesOnLoopbackFormOneJob) {
  const std::string master = "127.0.0.1:" + std::to_string(shoal::testing::free_port());
  const std::string env = script("env.sh", "exec env");
  // Node 1 first: its launcher waits for node 0's store.
  ShoalRun node1(node_args(1, master, env));
  std::this_thread::sleep_for(300ms);
  ShoalRun node0(node_args(0, master, env));
  RunResult run0 = node0.wait(30s);
  RunResult run1 = node1.wait(30s);
  ASSERT_EQ(run0.exit_code, 0) << run0.err;
  ASSERT_EQ(run1.exit_code, 0) << run1.err;
  auto on0 = environments(run0.out);
  auto on1 = environments(run1.out);
  ASSERT_EQ(on0.size(), 2u);
  ASSERT_EQ(on1.size(), 2u);
  std::set<std::string> run_ids;
  for (auto* node : {&on0, &on1}) {
    for (auto& [rank, vars] : *node) {
      EXPECT_EQ(vars["RANK"], std::to_string(rank));
      EXPECT_EQ(vars["SHOAL_RANK"], std::to_string(rank));
      EXPECT_EQ(vars["WORLD_SIZE"], "4");
      EXPECT_EQ(vars["SHOAL_NNODES"], "2");
      EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank % 2));
      EXPECT_EQ(vars["GROUP_RANK"], std::to_string(rank / 2));
      EXPECT_EQ(vars["MASTER_ADDR"] + ":" + vars["MASTER_PORT"], master);
      run_ids.insert(vars["SHOAL_RUN_ID"]);
    }
  }
  EXPECT_EQ(on0.count(0) + on0.count(1) + on1.count(2) + on1.count(3), 4u);
  EXPECT_EQ(run_ids.size(), 1u);
}

TEST_F(LaunchTest, FailureOnOneNodeStopsTheOther) {
  const std::string master = "127.0.0.1:" + std::to_string(shoal::testing::free_port());
  const std::string worker = script("fail.sh",
      "echo $$ >> $DIR/pids\n"
      "if [ $RANK = 3 ]; then\n"
      "  while [ $(wc -l < $DIR/pids) -lt 4 ]; do sleep 0.05; done\n"
      "  exit 3\n"
      "fi\n"
      "sleep 1000");
  ShoalRun node0(node_args(0, master, worker));
  ShoalRun node1(node_args(1, master, worker));
  RunResult run1 = node1.wait(30s);
  RunResult run0 = node0.wait(30s);
  ASSERT_FALSE(run0.timed_out);
  ASSERT_FALSE(run1.timed_out);
  EXPECT_EQ(run1.exit_code, 3) << run1.err;
  EXPECT_EQ(run0.exit_code, 1) << run0.err;
  EXPECT_LT(run0.seconds, 10.0);
  EXPECT_NE(run0.err.find("worker 3 on node 1 exited with code 3"), std::string::npos) << run0.err;
  expect_all_dead(path("pids"), 4);
}

}  // namespace
}  // namespace shoal::launch
