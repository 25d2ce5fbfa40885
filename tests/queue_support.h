// The queue's tests share this harness (docs/queue.md): the real `shoal queue serve` with its
// local agent in a directory of the test's own, and the checks on elastic_worker's output.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "netns.h"
#include "queue/http.h"
#include "shoal/core/error.h"
#include "test_paths.h"

namespace shoal::testing {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

inline const std::string kWorker = std::string(SHOAL_TEST_PROGRAMS_DIR) + "/elastic_worker";

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Polls `ready` every 100 ms until it holds or `timeout` passes.
inline bool eventually(const std::function<bool()>& ready, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (ready()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(100ms);
  }
}

inline bool alive(int64_t pid) {
  if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) != 0) return false;
  const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() || stat[close + 2] != 'Z';
}

// Forks `argv` (argv[0] an absolute path, or a name on PATH) with `env` as its whole environment
// (empty: this process's), its stdout and stderr appended to `log`; it dies with the test.
inline pid_t spawn_logged(std::vector<std::string> argv, std::vector<std::string> env,
                          const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> c_argv, c_env;
    for (auto& arg : argv) c_argv.push_back(arg.data());
    c_argv.push_back(nullptr);
    for (auto& entry : env) c_env.push_back(entry.data());
    c_env.push_back(nullptr);
    if (env.empty()) {
      ::execvp(c_argv[0], c_argv.data());
    } else {
      ::execvpe(c_argv[0], c_argv.data(), c_env.data());
    }
    ::_exit(127);
  }
  return pid;
}

// `shoal queue serve` on this machine with its local agent, in a directory of the test's own.
class Queue {
 public:
  Queue(const std::string& name, std::vector<std::string> flags) : flags_(std::move(flags)) {
    dir_ = std::string(::testing::TempDir()) + "shoal-queue-" + name + "-" +
           std::to_string(::getpid());
    shell("rm -rf " + dir_);
    ::mkdir(dir_.c_str(), 0700);
    start(0);
  }
  ~Queue() {
    stop();
    // The agent outlives a SIGKILLed scheduler by design; the test's own ends with the test.
    const int64_t agent = std::atoll(read_text(dir_ + "/agent.pid").c_str());
    if (alive(agent)) ::kill(static_cast<pid_t>(agent), SIGKILL);
  }

  const std::string& dir() const { return dir_; }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }

  // Starts the scheduler on `port` (0: any) and waits until it listens.
  void start(int port) {
    ::unlink((dir_ + "/address").c_str());
    std::vector<std::string> args = {
        SHOAL_BIN, "queue", "serve", "--state-dir", dir_, "--port", std::to_string(port)};
    args.insert(args.end(), flags_.begin(), flags_.end());
    const std::string log = dir_ + "/serve.log";
    pid_ = spawn_logged(args, {}, log);
    ASSERT_TRUE(eventually([&] { return !read_text(dir_ + "/address").empty(); }, 15s))
        << read_text(log);
    const std::string address = read_text(dir_ + "/address");
    host_ = address.substr(0, address.find(':'));
    port_ = std::stoi(address.substr(address.find(':') + 1));
  }

  void kill9() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + 30s;
    while (::waitpid(pid_, nullptr, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(50ms);
    }
    pid_ = -1;
  }

  queue::HttpClient client() const {
    std::string token = read_text(dir_ + "/token");
    while (!token.empty() && token.back() == '\n') token.pop_back();
    return queue::HttpClient(host_, port_, token);
  }

  // `shoal queue ARGS` with this queue's directory; its exit code, and stdout and stderr in `out`.
  int cli(const std::string& args, std::string* out) const {
    return shell("env SHOAL_QUEUE_DIR=" + dir_ + " " + SHOAL_BIN + " queue " + args, out);
  }

  int64_t submit(const std::string& args) const {
    std::string out;
    const int code = cli("submit " + args, &out);
    EXPECT_EQ(code, 0) << out;
    const auto at = out.find("submitted job ");
    if (at == std::string::npos) return 0;
    return std::stoll(out.substr(at + 14));
  }

  // A copy, by value: a range-for over a member of it (`for (... : json(queue.job(id).at(...)))`)
  // must iterate a copy too, since the temporary itself ends before the loop's body runs.
  json job(int64_t id) const { return client().get("/jobs/" + std::to_string(id)); }

  // The job's workers that run and are not asked to leave: id -> pid.
  std::map<int64_t, int64_t> staying(int64_t id) const {
    std::map<int64_t, int64_t> out;
    for (const auto& w : json(job(id).at("worker_list"))) {
      if (w.at("state") == "running" && !w.at("leave").get<bool>() && !w.at("stop").get<bool>()) {
        out[w.at("id")] = w.at("pid");
      }
    }
    return out;
  }

  // The log of each worker of the job so far, read from the local agent's directory (so that it
  // works while the scheduler is down).
  std::map<int64_t, std::string> logs(int64_t id) const {
    std::map<int64_t, std::string> out;
    const std::string dir = dir_ + "/agent/job-" + std::to_string(id);
    DIR* listing = ::opendir(dir.c_str());
    if (listing == nullptr) return out;
    while (const dirent* entry = ::readdir(listing)) {
      const std::string name = entry->d_name;
      if (name.rfind("worker-", 0) != 0) continue;
      out[std::atoll(name.c_str() + 7)] = read_text(dir + "/" + name);
    }
    ::closedir(listing);
    return out;
  }

  bool any_log_has(int64_t id, const std::string& text) const {
    for (const auto& [worker, log] : logs(id)) {
      if (log.find(text) != std::string::npos) return true;
    }
    return false;
  }

  // The steps the job's first worker has reported.
  int steps(int64_t id) const {
    int count = 0;
    for (const auto& [worker, log] : logs(id)) {
      std::istringstream lines(log);
      for (std::string line; std::getline(lines, line);)
        count += line.rfind("step ", 0) == 0 ? 1 : 0;
    }
    return count;
  }

  std::string state(int64_t id) const { return job(id).at("state"); }

 private:
  std::vector<std::string> flags_;
  std::string dir_;
  pid_t pid_ = -1;
  std::string host_ = "127.0.0.1";  // where it listens, from its address file
  int port_ = 0;
};

// elastic_worker's OUT: every sample of every epoch trained on exactly once, in committed steps.
inline void expect_every_sample_once(const std::string& out_path, int epochs) {
  const std::string text = read_text(out_path);
  const auto at = text.find("counts");
  ASSERT_NE(at, std::string::npos) << out_path << ": " << text;
  std::istringstream counts(text.substr(at + 6));
  int total = 0;
  int wrong = 0;
  for (int64_t count; counts >> count;) {
    ++total;
    wrong += count != 1 ? 1 : 0;
  }
  EXPECT_EQ(total, epochs * 240);
  EXPECT_EQ(wrong, 0) << "samples not trained on exactly once";
}

// One `shoal agent --queue HOST:PORT --token-file QUEUE/token ARGS...`, for queues served with
// --no-local-agent (tests/queue_slurm_test.cpp) or on other hosts (tests/queue_multihost_test.cpp,
// where `prefix` runs it in a network namespace and `host` is the scheduler's address there).
// Its log is DIR.log, beside its --dir DIR; `env` is added to the test's environment
// (SLURM_CONF, say). The destructor stops it as an operator would (SIGTERM: it stops its
// workers), then SIGKILLs it after 30 s.
class Agent {
 public:
  Agent(const Queue& queue, const std::string& dir, std::vector<std::string> args,
        const std::map<std::string, std::string>& env = {}, std::vector<std::string> prefix = {},
        const std::string& host = "127.0.0.1")
      : dir_(dir) {
    std::vector<std::string> argv = std::move(prefix);
    for (const std::string& arg :
         {std::string(SHOAL_BIN), std::string("agent"), std::string("--queue"),
          host + ":" + std::to_string(queue.port()), std::string("--token-file"),
          queue.dir() + "/token", std::string("--dir"), dir_}) {
      argv.push_back(arg);
    }
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<std::string> entries;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string text(*entry);
      if (env.count(text.substr(0, text.find('='))) == 0) entries.push_back(text);
    }
    for (const auto& [name, value] : env) entries.push_back(name + "=" + value);
    pid_ = spawn_logged(argv, entries, dir_ + ".log");
  }
  ~Agent() { stop(); }
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const std::string& dir() const { return dir_; }
  std::string log() const { return read_text(dir_ + ".log"); }
  pid_t pid() const { return pid_; }

  // Its exit code once it ended by itself (-1 while it runs).
  int exit_code() {
    if (pid_ > 0 && status_ < 0) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_)
        status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    return status_;
  }

  void stop() {
    if (pid_ <= 0 || exit_code() >= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + 30s;
    while (exit_code() < 0) {
      if (Clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        status_ = 128 + SIGKILL;
        break;
      }
      std::this_thread::sleep_for(50ms);
    }
  }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  int status_ = -1;
};

// After a shrink: the job's staying workers are its oldest ones, the very same processes.
inline void expect_the_oldest_kept(const std::map<int64_t, int64_t>& before,
                                   const std::map<int64_t, int64_t>& kept) {
  auto oldest = before.begin();
  for (const auto& [id, pid] : kept) {
    ASSERT_NE(oldest, before.end());
    EXPECT_EQ(id, oldest->first);
    EXPECT_EQ(pid, oldest->second);
    EXPECT_TRUE(alive(pid));
    ++oldest;
  }
}

// Test 1's target is a high-priority job's first step within 5 s of its submission. A test on a
// shared machine asserts a generous bound (a step at all, in bounded time) and prints the
// measured time (`[ measured ]`); bench/queue_first_step.sh measures the target itself
// (docs/testing.md: speed targets are benchmarks' to check, not tests').
constexpr double kFirstStepTarget = 5;
constexpr double kFirstStepBound = 20;

inline void expect_first_step_soon(Clock::time_point submitted, const std::string& what) {
  const double first_step = seconds_since(submitted);
  std::cout << "[ measured ] the high job's first step " << first_step << " s after its submission"
            << what << " (target " << kFirstStepTarget << " s)" << std::endl;
  EXPECT_LT(first_step, kFirstStepBound)
      << "the high-priority job's first step came " << first_step << " s after its submission";
}

}  // namespace shoal::testing
