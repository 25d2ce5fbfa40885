#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"
#include "proc/process.h"

namespace {

// What a case started, and what that started in turn (the worker server and its workers, `shoal
// run` and its workers, an etcd server): each stopped as soon as it is found, so that none starts
// another unseen or, orphaned, leaves the tree, until a walk finds nothing new; then killed.
void kill_descendants() {
  std::vector<pid_t> stopped;
  for (bool found = true; found;) {
    found = false;
    std::vector<pid_t> walk = shoal::proc::child_processes();
    for (size_t i = 0; i < walk.size(); ++i) {
      const pid_t pid = walk[i];
      if (std::find(stopped.begin(), stopped.end(), pid) == stopped.end()) {
        ::kill(pid, SIGSTOP);
        stopped.push_back(pid);
        found = true;
      }
      for (pid_t child : shoal::proc::child_processes(pid)) walk.push_back(child);
    }
  }
  for (pid_t pid : stopped) ::kill(pid, SIGKILL);
}

// Note [One ctest test per suite] (tests/suites.cmake): ctest runs a whole suite in one process,
// so its TIMEOUT bounds the suite; this bounds each case. A case still running `limit` after it
// started is named, and the process ends with everything it started.
class CaseWatchdog : public ::testing::EmptyTestEventListener {
 public:
  explicit CaseWatchdog(std::chrono::seconds limit) : limit_(limit), thread_([this] { watch(); }) {}
  CaseWatchdog(const CaseWatchdog&) = delete;
  CaseWatchdog& operator=(const CaseWatchdog&) = delete;
  ~CaseWatchdog() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }

  void OnTestStart(const ::testing::TestInfo& info) override {
    std::lock_guard<std::mutex> lock(mutex_);
    name_ = std::string(info.test_suite_name()) + "." + info.name();
    deadline_ = std::chrono::steady_clock::now() + limit_;
    running_ = true;
    changed_.notify_all();
  }

  void OnTestEnd(const ::testing::TestInfo&) override {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    changed_.notify_all();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (!running_) {
        changed_.wait(lock);
      } else if (std::chrono::steady_clock::now() < deadline_) {
        changed_.wait_until(lock, deadline_);
      } else {
        std::fflush(stdout);
        std::fprintf(stderr, "[  TIMEOUT ] %s is still running %lld s after it started (SHOAL_TEST_CASE_TIMEOUT)\n",
                     name_.c_str(), static_cast<long long>(limit_.count()));
        std::fflush(stderr);
        kill_descendants();
        std::_Exit(1);
      }
    }
  }

  const std::chrono::seconds limit_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::string name_;
  std::chrono::steady_clock::time_point deadline_;
  bool running_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// SHOAL_TEST_CASE_TIMEOUT, in seconds; 0 when unset (no watchdog).
long case_timeout() {
  const char* text = std::getenv("SHOAL_TEST_CASE_TIMEOUT");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long seconds = std::strtol(text, &end, 10);
  if (*end != '\0' || seconds <= 0) {
    std::fprintf(stderr, "SHOAL_TEST_CASE_TIMEOUT must be a positive number of seconds, got '%s'\n", text);
    std::exit(2);
  }
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  // Returns here in the test process and, with its own arguments, in every worker it starts.
  std::vector<std::string> args = shoal::testing::start_worker_server(argc, argv);
  std::vector<char*> pointers;
  for (auto& arg : args) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  int count = static_cast<int>(args.size());
  ::testing::InitGoogleTest(&count, pointers.data());
  if (shoal::testing::is_worker()) return RUN_ALL_TESTS();

  // After start_worker_server: the worker server is forked from a process of one thread.
  const long timeout = case_timeout();
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  std::unique_ptr<CaseWatchdog> watchdog;
  if (timeout > 0) {
    watchdog = std::make_unique<CaseWatchdog>(std::chrono::seconds(timeout));
    listeners.Append(watchdog.get());
  }
  const int result = RUN_ALL_TESTS();
  if (watchdog) listeners.Release(watchdog.get());
  // ctest's SKIP_RETURN_CODE: every case that was to run skipped (none failed).
  const auto& unit = *::testing::UnitTest::GetInstance();
  if (result == 0 && unit.skipped_test_count() > 0 && unit.skipped_test_count() == unit.test_to_run_count()) {
    return 77;
  }
  return result;
}
