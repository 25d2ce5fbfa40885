// Fault injection: a peer SIGKILLed or SIGSTOPped during an all-reduce. The survivors must raise
// CommError naming the operation and the lost peer, within twice the timeout, and never hang.
// Durations asserted are failure bounds: at least the timeout where one must be waited for, and
// well short of the next longer wait (the group's timeout, the harness's) for the upper bound.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "netns.h"
#include "shoal/shoal.h"

namespace {

using shoal::testing::run_workers;
using shoal::testing::shoal_bin;
using shoal::testing::test_programs_dir;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = std::chrono::seconds(5);

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Element counts of the all-reduces that a peer dies or stops in, one of each size class of the
// shared-memory path (docs/comm.md): a few elements; a part that fits one piece of a slot; many
// pieces (4 MiB, through both buffers in turn).
const std::vector<int64_t> kSizeClasses = {7, 60000, 1 << 20};

std::string size_class_name(int64_t count) {
  return count < 100 ? "small" : count < 100000 ? "medium" : "large";
}

// (workers, elements)
class KilledPeer : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

// Worker 1 of n dies (SIGKILL) in the fourth all-reduce of `count` elements; every survivor raises
// CommError naming it, in bounded time, and its group stays broken.
void expect_killed_peer_named(int n, int64_t count, shoal::testing::WorkersOptions options) {
  const int victim = 1;
  options.may_fail = {victim};
  auto exits = run_workers(n, [victim, count = count] {
    auto& world = shoal::world();
    world.set_timeout(kTimeout);
    for (int step = 0;; ++step) {
      auto t = torch::ones({count});
      auto start = Clock::now();
      // A few elements' all-reduce can end within the microseconds between its launch and a
      // kill, and then rightly goes on: for those the victim dies just before its part, for the
      // larger ones while its part is in flight. A medium one can still end first on a loaded
      // machine (the victim's Gloo or lane thread runs its whole part before its main thread
      // raises the signal): then it holds the victim's ones, and the next all-reduce fails.
      const bool in_flight = count >= 60000;
      if (shoal::rank() == victim && step == 3 && !in_flight) raise(SIGKILL);
      auto work = world.all_reduce_async(t);
      if (shoal::rank() == victim && step == 3) raise(SIGKILL);
      try {
        work.wait();
      } catch (const shoal::CommError& e) {
        const double waited = seconds_since(start);
        const std::string message = e.what();
        std::printf("survivor %d: %.2f s: %s\n", shoal::rank(), waited, e.what());
        EXPECT_LT(waited, 2 * std::chrono::duration<double>(kTimeout).count());
        EXPECT_EQ(message.rfind("all_reduce on workers [0, 1, 2", 0), 0u) << message;
        EXPECT_NE(message.find("lost worker 1, which was killed by signal 9 (SIGKILL)"), std::string::npos)
            << message;
        EXPECT_TRUE(step == 3 || step == 4) << "step " << step;
        // The group is broken for good: the next operation fails at once.
        auto again = Clock::now();
        EXPECT_THROW(world.all_reduce(t), shoal::CommError);
        // At once, not after waiting for the group's timeout.
        EXPECT_LT(seconds_since(again), 0.5 * std::chrono::duration<double>(kTimeout).count());
        return;
      }
      if (step == 3) {
        ASSERT_TRUE(t.eq(static_cast<float>(world.size())).all().item<bool>())
            << "the all-reduce went on without worker " << victim << "'s part";
      }
      ASSERT_LT(step, 4) << "the all-reduce after worker " << victim << "'s death went on";
    }
  }, options);
  if (!shoal::testing::is_worker()) {
    EXPECT_EQ(exits[victim].signal, SIGKILL);
    for (const auto& exit : exits) {  // the survivors' lines, for the log
      for (size_t at = exit.output.find("survivor"); at != std::string::npos;
           at = exit.output.find("survivor", at + 1))
        std::printf("%s\n", exit.output.substr(at, exit.output.find('\n', at) - at).c_str());
    }
  }
}

TEST_P(KilledPeer, SurvivorsRaiseCommErrorNamingIt) {
  const auto [n, count] = GetParam();
  expect_killed_peer_named(n, count, {});
}

// Two hosts of two workers (tests/netns.h), whose all-reduce is hierarchical (docs/comm.md,
// "Across hosts"): worker 1 dies beside worker 0, which sees it through shared memory; host 1's
// workers, waiting on the network or on each other, learn of it from the launcher's record.
TEST(KilledPeerOnTwoHosts, SurvivorsOnBothHostsRaiseCommErrorNamingIt) {
  shoal::testing::TwoHosts hosts;
  shoal::testing::WorkersOptions options;
  if (!shoal::testing::is_worker()) {
    if (auto problem = hosts.create()) GTEST_SKIP() << "cannot build the two hosts: " << *problem;
    options.hosts = {hosts.name(0), hosts.name(1)};
    options.master_address = shoal::testing::TwoHosts::kAddressA;
  }
  for (int64_t count : {int64_t{60000}, int64_t{1} << 20}) expect_killed_peer_named(4, count, options);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, KilledPeer,
                         ::testing::Combine(::testing::Values(3, 4),
                                            ::testing::ValuesIn(kSizeClasses)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" +
                                  size_class_name(std::get<1>(info.param));
                         });

class StoppedPeer : public ::testing::TestWithParam<int64_t> {};

TEST_P(StoppedPeer, SurvivorsTimeOutNamingTheWait) {
  shoal::testing::WorkersOptions options;
  options.stragglers = {2};
  run_workers(3, [count = GetParam()] {
    auto& world = shoal::world();
    const auto timeout = std::chrono::seconds(2);
    world.set_timeout(timeout);
    auto t = torch::ones({count});
    world.all_reduce(t);  // all connected and working
    if (shoal::rank() == 2) raise(SIGSTOP);
    auto start = Clock::now();
    try {
      world.all_reduce(t);
      ADD_FAILURE() << "expected CommError";
    } catch (const shoal::CommError& e) {
      const double waited = seconds_since(start);
      std::printf("worker %d: %.2f s: %s\n", shoal::rank(), waited, e.what());
      EXPECT_GE(waited, 2.0);
      EXPECT_LT(waited, 6.0);  // three times the timeout
      const std::string expected = "all_reduce on workers [0, 1, 2] (this worker: " +
                                   std::to_string(shoal::rank()) + ") timed out after 2.";
      EXPECT_EQ(std::string(e.what()).rfind(expected, 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find("waiting for workers ["), std::string::npos) << e.what();
    }
  }, options);
}

INSTANTIATE_TEST_SUITE_P(SizeClasses, StoppedPeer, ::testing::ValuesIn(kSizeClasses),
                         [](const auto& info) { return size_class_name(info.param); });

TEST(StoppedPeerAnySize, PerOperationTimeoutOverridesTheGroups) {
  shoal::testing::WorkersOptions options;
  options.stragglers = {1};
  run_workers(2, [] {
    auto& world = shoal::world();
    auto t = torch::ones({10});
    world.barrier();
    if (shoal::rank() == 1) raise(SIGSTOP);
    auto start = Clock::now();
    EXPECT_THROW(world.all_reduce(t, {shoal::comm::ReduceOp::kSum, std::chrono::milliseconds(700)}),
                 shoal::CommError);
    const double waited = seconds_since(start);
    EXPECT_GE(waited, 0.7);
    EXPECT_LT(waited, 5.0);  // not the group's timeout (10 minutes)
  }, options);
}

volatile sig_atomic_t pipe_signals = 0;
void count_pipe_signal(int) { pipe_signals = pipe_signals + 1; }

// Note [Broken pipes] (src/comm/store.cpp): a worker whose peer died must not die of SIGPIPE on
// its next write to it, before Gloo can name the lost peer. Joining the job sets SIGPIPE to
// ignored where it had its default action (worker 1: a write into a pipe nobody reads then fails
// with EPIPE and the worker goes on), and keeps a program's own handler (worker 0).
TEST(BrokenPipes, JoiningIgnoresSigpipeButKeepsTheProgramsHandler) {
  shoal::testing::WorkersOptions options;
  options.init = false;
  run_workers(2, [] {
    const bool own_handler = std::string(std::getenv("SHOAL_RANK")) == "0";
    struct sigaction before {};
    ASSERT_EQ(sigaction(SIGPIPE, nullptr, &before), 0);
    ASSERT_EQ(before.sa_handler, SIG_DFL) << "a worker starts with SIGPIPE's default action";
    if (own_handler) {
      struct sigaction handler {};
      handler.sa_handler = count_pipe_signal;
      ASSERT_EQ(sigaction(SIGPIPE, &handler, nullptr), 0);
    }
    shoal::init();
    shoal::world().barrier();
    struct sigaction after {};
    ASSERT_EQ(sigaction(SIGPIPE, nullptr, &after), 0);
    EXPECT_EQ(after.sa_handler, own_handler ? count_pipe_signal : SIG_IGN);
    int ends[2];
    ASSERT_EQ(pipe(ends), 0);
    close(ends[0]);
    const char byte = 0;
    errno = 0;
    EXPECT_EQ(write(ends[1], &byte, 1), -1);
    EXPECT_EQ(errno, EPIPE);
    close(ends[1]);
    EXPECT_EQ(static_cast<int>(pipe_signals), own_handler ? 1 : 0);
    shoal::world().barrier();
  }, options);
}

// The same failure under the real launcher: shoal run exits non-zero, says which worker died
// and how, and leaves no process behind.
TEST(ShoalRun, KilledWorkerStopsTheJobWithNoOrphans) {
  namespace fs = std::filesystem;
  const fs::path pids = fs::temp_directory_path() / ("shoal-fault-" + std::to_string(getpid()));
  fs::create_directories(pids);
  const std::string command = shoal_bin() + " run -n 3 " + test_programs_dir() +
                              "/fault_worker 1 " + pids.string() + " 2>" + (pids / "stderr").string();
  auto start = Clock::now();
  int status = std::system(command.c_str());
  const double took = seconds_since(start);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGKILL);
  EXPECT_LT(took, 60.0);  // a failure bound: starting 3 workers on a loaded machine takes 20 s
  std::ifstream err(pids / "stderr");
  std::string text((std::istreambuf_iterator<char>(err)), {});
  EXPECT_NE(text.find("worker 1 was killed by signal 9 (SIGKILL)"), std::string::npos) << text;

  int workers = 0;
  for (auto& entry : fs::directory_iterator(pids)) {
    if (entry.path().filename() == "stderr") continue;
    ++workers;
    const pid_t pid = std::stoi(entry.path().filename().string());
    bool gone = false;
    for (int i = 0; i < 100 && !gone; ++i) {
      gone = kill(pid, 0) != 0;
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_TRUE(gone) << "worker process " << pid << " outlived shoal run";
  }
  EXPECT_EQ(workers, 3);
  fs::remove_all(pids);
}

}  // namespace
