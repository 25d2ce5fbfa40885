// The queue's tests share this harness (docs/queue.md): the real `shoal queue serve` with its
// local agent in a directory of the test's own, and the checks on elastic_worker's output.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
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

inline const std::string kWorker = test_programs_dir() + "/elastic_worker";

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
    agent_dirs_ = {dir_ + "/agent"};
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
  int agent_port() const { return agent_port_; }  // the agents' heartbeats
  bool tls() const { return tls_; }
  // The scheduler's certificate, which its clients verify it by (when tls()).
  std::string ca_file() const { return dir_ + "/tls/cert.pem"; }
  // [https://]HOST:PORT of its agents' port, from `host`'s side.
  std::string agent_address(const std::string& host) const {
    return (tls_ ? "https://" : "") + host + ":" + std::to_string(agent_port_);
  }
  pid_t pid() const { return pid_; }

  // Starts the scheduler on `port` and `agent_port` (0: any) and waits until it listens. The
  // tests run as root, and their jobs with them (--allow-root-jobs; tests/queue_service_test.cpp
  // checks the queue that refuses it).
  void start(int port, int agent_port = 0) {
    ::unlink((dir_ + "/address").c_str());
    std::vector<std::string> args = {shoal_bin(),   "queue", "serve", "--state-dir",
                                     dir_,          "--port", std::to_string(port),
                                     "--agent-port", std::to_string(agent_port)};
    if (::geteuid() == 0 &&
        std::find(flags_.begin(), flags_.end(), "--run-as") == flags_.end()) {
      args.push_back("--allow-root-jobs");
    }
    args.insert(args.end(), flags_.begin(), flags_.end());
    const std::string log = dir_ + "/serve.log";
    pid_ = spawn_logged(args, {}, log);
    ASSERT_TRUE(eventually([&] { return !read_text(dir_ + "/address").empty(); }, 15s))
        << read_text(log);
    // https://HOST:PORT when the queue speaks TLS (on any address but loopback, by default).
    std::string address = read_text(dir_ + "/address");
    tls_ = address.rfind("https://", 0) == 0;
    if (tls_) address = address.substr(8);
    host_ = address.substr(0, address.find(':'));
    port_ = std::stoi(address.substr(address.find(':') + 1));
    const std::string agents = read_text(dir_ + "/agent-address");
    agent_port_ = std::stoi(agents.substr(agents.rfind(':') + 1));
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
    if (tls_) return queue::HttpClient("https://" + host_ + ":" + std::to_string(port_), token, ca_file());
    return queue::HttpClient(host_, port_, token);
  }

  // `shoal queue ARGS` with this queue's directory; its exit code, and stdout and stderr in `out`.
  int cli(const std::string& args, std::string* out) const {
    return shell("env SHOAL_QUEUE_DIR=" + dir_ + " " + shoal_bin() + " queue " + args, out);
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

  // Another agent's --dir (on another host) whose workers' logs logs() reads too.
  void read_logs_from(const std::string& agent_dir) { agent_dirs_.push_back(agent_dir); }

  // The log of each worker of the job so far, read from the agents' directories (so that it
  // works while the scheduler is down).
  std::map<int64_t, std::string> logs(int64_t id) const {
    std::map<int64_t, std::string> out;
    for (const std::string& agent_dir : agent_dirs_) {
      const std::string dir = agent_dir + "/job-" + std::to_string(id);
      DIR* listing = ::opendir(dir.c_str());
      if (listing == nullptr) continue;
      while (const dirent* entry = ::readdir(listing)) {
        const std::string name = entry->d_name;
        // worker-ID.log; beside it the agent keeps worker-ID.left and worker-ID.progress.
        if (name.rfind("worker-", 0) != 0 || name.size() < 4 ||
            name.compare(name.size() - 4, 4, ".log") != 0) {
          continue;
        }
        out[std::atoll(name.c_str() + 7)] = read_text(dir + "/" + name);
      }
      ::closedir(listing);
    }
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
  std::vector<std::string> agent_dirs_;
  pid_t pid_ = -1;
  std::string host_ = "127.0.0.1";  // where it listens, from its address file
  int port_ = 0;
  int agent_port_ = 0;
  bool tls_ = false;
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

// Whether the job is done and every one of its workers' ends is recorded. The scheduler calls a
// job done at the first exit 0 of a worker it did not ask to leave, which may come before the
// first worker (elastic_worker's rank 0) has written OUT; that one writes OUT before it exits.
inline bool finished(const Queue& queue, int64_t job) {
  const json view = queue.job(job);
  return view.at("state") == "done" && view.at("workers") == 0;
}

// One `shoal agent --queue HOST:AGENT_PORT --token-file QUEUE/agent-token ARGS...`, for queues served with
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
         {shoal_bin(), std::string("agent"), std::string("--queue"),
          queue.agent_address(host), std::string("--token-file"), queue.dir() + "/agent-token",
          std::string("--dir"), dir_}) {
      argv.push_back(arg);
    }
    if (queue.tls()) {
      argv.push_back("--ca-cert");
      argv.push_back(queue.ca_file());
    }
    // As the queue's own jobs, which run as the tests' user (Queue::start).
    if (::geteuid() == 0) argv.push_back("--allow-root-workers");
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

// The hosts of the job's workers that run and are not asked to leave, in `job` (a /jobs/ID view).
inline std::set<std::string> hosts_of(const json& job) {
  std::set<std::string> out;
  for (const auto& w : job.at("worker_list")) {
    if (w.at("state") == "running" && !w.at("leave").get<bool>()) out.insert(w.at("host"));
  }
  return out;
}

// Test 3 of docs/queue.md on `queue`, whatever its hosts: a killed worker of a job of 3 is
// replaced after its back-off, and after more failures than --max-restarts the job fails with the
// reason, leaving no process behind. Each kill takes the newest worker on a host other than the
// last victim's, where there is one. Returns the hosts the victims were on.
inline std::set<std::string> expect_killed_workers_replaced_then_the_job_failed(Queue& queue) {
  std::set<std::string> victim_hosts;
  const int64_t id = queue.submit("--min 2 --max 3 --max-restarts 2 " + kWorker + " " +
                                  queue.dir() + "/out 200 50");
  EXPECT_TRUE(eventually([&] { return queue.staying(id).size() == 3 && queue.steps(id) > 0; }, 60s))
      << queue.job(id).dump(1);

  std::set<int64_t> pids;
  std::string last_host;
  for (int failure = 1; failure <= 3; ++failure) {
    const auto workers = queue.staying(id);
    EXPECT_FALSE(workers.empty());
    if (workers.empty()) return victim_hosts;
    for (const auto& [worker, pid] : workers) pids.insert(pid);
    // The newest worker off the last victim's host; the newest of all when every one is on it.
    int64_t victim = 0;
    int64_t victim_id = -1;
    std::string victim_host;
    for (const auto& w : json(queue.job(id).at("worker_list"))) {
      const int64_t worker = w.at("id");
      if (workers.count(worker) == 0) continue;
      const bool off = w.at("host") != last_host;
      const bool best_off = victim_id >= 0 && victim_host != last_host;
      if (victim_id < 0 || (off && !best_off) || (off == best_off && worker > victim_id)) {
        victim = w.at("pid");
        victim_id = worker;
        victim_host = w.at("host");
      }
    }
    last_host = victim_host;
    victim_hosts.insert(victim_host);
    const auto killed = Clock::now();
    EXPECT_EQ(::kill(static_cast<pid_t>(victim), SIGKILL), 0);
    if (failure == 3) break;
    // A replacement (a worker that did not exist before) trains: the target is 5 s, the
    // test's bound generous (the measured time is printed; see expect_first_step_soon).
    const bool replaced_in_time = eventually(
        [&] {
          for (const auto& [worker, log] : queue.logs(id)) {
            if (workers.count(worker) == 0 && worker > workers.rbegin()->first &&
                log.find("train pid=") != std::string::npos) {
              return true;
            }
          }
          return false;
        },
        30s);
    EXPECT_TRUE(replaced_in_time) << queue.job(id).dump(1);
    if (!replaced_in_time) return victim_hosts;
    const double replaced = seconds_since(killed);
    std::cout << "[ measured ] failure " << failure << " (on " << victim_host
              << "): a replacement trains " << replaced << " s after the kill (target 5 s)"
              << std::endl;
    EXPECT_LT(replaced, kFirstStepBound) << "failure " << failure;
    EXPECT_TRUE(eventually([&] { return queue.staying(id).size() == 3; }, 30s));
  }
  EXPECT_TRUE(eventually([&] { return queue.state(id) == "failed"; }, 30s))
      << queue.job(id).dump(1);
  const std::string reason = queue.job(id).at("reason");
  EXPECT_NE(reason.find("was killed by signal 9 (SIGKILL); 3 failures, more than --max-restarts 2"),
            std::string::npos)
      << reason;
  for (const auto& w : json(queue.job(id).at("worker_list")))
    pids.insert(w.at("pid").get<int64_t>());
  EXPECT_TRUE(eventually(
      [&] {
        for (int64_t pid : pids) {
          if (alive(pid)) return false;
        }
        return true;
      },
      20s))
      << "a process of the failed job is left";
  EXPECT_TRUE(eventually([&] { return queue.job(id).at("workers") == 0; }, 10s));
  return victim_hosts;
}

// The last `count` lines of each of the job's worker logs, for a failure's message: what the
// workers were doing when the job stopped making progress.
inline std::string last_lines_of_logs(const Queue& queue, int64_t job, size_t count) {
  std::string out;
  for (const auto& [worker, log] : queue.logs(job)) {
    std::vector<std::string> lines;
    std::istringstream in(log);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    out += "worker " + std::to_string(worker) + ":\n";
    for (size_t i = lines.size() > count ? lines.size() - count : 0; i < lines.size(); ++i)
      out += "  " + lines[i] + "\n";
  }
  return out;
}

// Test 5 of docs/queue.md on `queue`, whatever its hosts: the scheduler SIGKILLed mid-run leaves
// a job of 3 training; started again on its database, it finds the same workers, its events go on
// without a gap, and it schedules a second job. Returns the first job as it was before the kill.
inline json expect_a_killed_scheduler_to_leave_jobs_training(Queue& queue) {
  const int64_t first =
      queue.submit("--min 3 --max 3 " + kWorker + " " + queue.dir() + "/a.out 200 50");
  EXPECT_TRUE(
      eventually([&] { return queue.staying(first).size() == 3 && queue.steps(first) > 0; }, 60s))
      << queue.job(first).dump(1);
  const json before = queue.job(first);
  const auto workers = queue.staying(first);
  const int port = queue.port();
  const int agent_port = queue.agent_port();

  queue.kill9();
  const int steps = queue.steps(first);
  EXPECT_TRUE(eventually([&] { return queue.steps(first) >= steps + 10; }, 20s))
      << "the job did not train on while the scheduler was down; its workers' logs, last lines:\n"
      << last_lines_of_logs(queue, first, 15);
  EXPECT_THROW(queue.client().get("/jobs"), CommError);

  queue.start(port, agent_port);
  EXPECT_EQ(queue.staying(first), workers);  // the same workers, the same processes
  const int64_t second =
      queue.submit("--min 1 --max 1 " + kWorker + " " + queue.dir() + "/b.out 2 50");
  EXPECT_TRUE(eventually([&] { return finished(queue, second); }, 60s))
      << queue.job(second).dump(1);
  expect_every_sample_once(queue.dir() + "/b.out", 2);
  EXPECT_EQ(queue.staying(first), workers);  // reconciled with the agents: nothing was restarted

  // One scheduler's events follow the other's with no gap.
  const json events = queue.client().get("/events?since=0").at("events");
  int64_t expected = 1;
  int starts = 0;
  for (const auto& e : events) {
    EXPECT_EQ(e.at("id").get<int64_t>(), expected++);
    starts += e.at("message").get<std::string>().rfind("scheduler started", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(starts, 2);

  std::string out;
  EXPECT_EQ(queue.cli("cancel " + std::to_string(first), &out), 0) << out;
  EXPECT_EQ(out, "cancelled job " + std::to_string(first) + "\n");
  EXPECT_TRUE(eventually(
      [&] {
        for (const auto& [id, pid] : workers) {
          if (alive(pid)) return false;
        }
        return true;
      },
      20s));
  EXPECT_EQ(queue.state(first), "cancelled");
  return before;
}

// Tests 1 and 2 of docs/queue.md for whatever runs the workers (the local engine on one host or
// several, the Slurm engine); what differs is what else the engine checks. The queue must run
// with --cooldown `cooldown` and --grow-idle 2, have 4 free slots, and read the logs of every
// agent's workers (Queue::read_logs_from).
struct ShrinkAndGrowBack {
  // What a failure shows about a job; the job's JSON when unset.
  std::function<std::string(int64_t job)> diagnose;
  // The hosts the low job's four workers span, before the shrink and after the grow.
  size_t hosts = 1;
  double cooldown = 8;
  std::string low_priority;  // --priority of the low job ("": the queue's default)
  std::string high_start;    // printed after the high job's first step: " (two leaves, ...)"
  // The engine's own checks: once the low job trains on 4 workers; once the high one trained
  // its first step; once both are done.
  std::function<void(int64_t low)> at_full;
  std::function<void(int64_t low, int64_t high)> at_shrunk;
  std::function<void(int64_t low, int64_t high)> at_end;
};

// A low-priority job of --min 2 --max 4 trains on 4 workers; a high-priority job of 2 arrives and
// trains its first step within kFirstStepBound while the low one keeps its two oldest workers
// (the same processes; two left at a commit); once the high job is done the low one is back to 4
// within cooldown + 5 s (the bound), its new workers train in a world of 4, and every
// sample of both jobs is trained on once per epoch. Check HasFatalFailure() after it.
inline void expect_shrink_and_grow_back(const Queue& queue, const ShrinkAndGrowBack& test) {
  const auto diagnose = [&](int64_t job) {
    return test.diagnose ? test.diagnose(job) : queue.job(job).dump(1);
  };
  const std::string priority =
      test.low_priority.empty() ? "" : "--priority " + test.low_priority + " ";

  const auto low_submitted = Clock::now();
  const int64_t low = queue.submit(priority + "--min 2 --max 4 --name low " + kWorker + " " +
                                   queue.dir() + "/low.out 16 80");
  ASSERT_TRUE(eventually(
      [&] { return queue.staying(low).size() == 4 && queue.any_log_has(low, "world=4 step="); },
      60s))
      << diagnose(low);
  std::cout << "[ measured ] the low job's first step in a world of 4 "
            << seconds_since(low_submitted) << " s after its submission" << std::endl;
  EXPECT_EQ(hosts_of(queue.job(low)).size(), test.hosts) << "hosts of the low job's 4 workers";
  if (test.at_full) test.at_full(low);
  const auto before = queue.staying(low);

  const auto submitted = Clock::now();
  const int64_t high = queue.submit("--priority 10 --min 2 --max 2 --name high " + kWorker + " " +
                                    queue.dir() + "/high.out 2 50");
  ASSERT_TRUE(eventually([&] { return queue.any_log_has(high, "step 1 world 2"); }, 30s))
      << diagnose(high);
  expect_first_step_soon(submitted, test.high_start);

  // The low job kept its two oldest workers, the very same processes; the two others left.
  const auto kept = queue.staying(low);
  ASSERT_EQ(kept.size(), 2u) << diagnose(low);
  expect_the_oldest_kept(before, kept);
  int left = 0;
  for (const auto& e : json(queue.job(low).at("events"))) {
    left +=
        e.at("message").get<std::string>().find("left at a commit") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(left, 2) << diagnose(low);
  if (test.at_shrunk) test.at_shrunk(low, high);

  ASSERT_TRUE(eventually([&] { return queue.state(high) == "done"; }, 60s)) << diagnose(high);
  const auto high_done = Clock::now();
  ASSERT_TRUE(eventually([&] { return queue.staying(low).size() == 4; }, 60s)) << diagnose(low);
  const double regrown = seconds_since(high_done);
  std::cout << "[ measured ] the low job back to 4 workers " << regrown
            << " s after the high one ended (--cooldown " << test.cooldown << ", --grow-idle 2)"
            << std::endl;
  EXPECT_LT(regrown, test.cooldown + 5)
      << "the low job was back to 4 workers " << regrown << " s after the high one ended";
  const auto regrown_workers = queue.staying(low);
  for (const auto& [id, pid] : kept) EXPECT_EQ(regrown_workers.at(id), pid);
  EXPECT_EQ(hosts_of(queue.job(low)).size(), test.hosts)
      << "hosts of the low job's 4 workers again";
  // The new workers train in a world of 4.
  ASSERT_TRUE(eventually(
      [&] {
        const auto logs = queue.logs(low);
        for (const auto& [id, pid] : regrown_workers) {
          if (kept.count(id) == 0 &&
              (logs.count(id) == 0 || logs.at(id).find("world=4 step=") == std::string::npos)) {
            return false;
          }
        }
        return true;
      },
      30s))
      << diagnose(low);

  ASSERT_TRUE(eventually([&] { return finished(queue, low); }, 180s)) << diagnose(low);
  expect_every_sample_once(queue.dir() + "/low.out", 16);
  expect_every_sample_once(queue.dir() + "/high.out", 2);
  const json job = queue.job(low);
  EXPECT_EQ(job.at("resizes"), 2);
  EXPECT_EQ(job.at("cycles"), 1);
  EXPECT_EQ(job.at("failures"), 0);
  if (test.at_end) test.at_end(low, high);
}

// A gtest fixture of two hosts (tests/netns.h), each with an agent: the scheduler and its local
// agent on host A, `shoal agent` on host B. The test's thread (and every process it forks) is in
// host A's network namespace while the queue lives, so that the scheduler it starts and its own
// REST calls live on that host.
class QueueOnTwoHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = hosts_.create()) GTEST_SKIP() << *why;
    on_a_ = std::make_unique<InNetworkNamespace>(hosts_.name(0));
  }
  void TearDown() override {
    agent_b_.reset();
    queue_.reset();
    on_a_.reset();
  }

  // The queue on host A (2 slots) and the agent on host B (2 slots), both alive.
  Queue& start(const std::string& name, std::vector<std::string> flags = {}) {
    std::vector<std::string> all = {"--host", TwoHosts::kAddressA, "--slots", "2"};
    all.insert(all.end(), flags.begin(), flags.end());
    queue_ = std::make_unique<Queue>(name, all);
    const std::string hosts_path = queue_->dir() + "/hosts";
    std::ofstream(hosts_path) << hosts_.hosts_file();
    agent_b_ = std::make_unique<Agent>(*queue_, queue_->dir() + "/agent-b",
                                       std::vector<std::string>{"--slots", "2"},
                                       std::map<std::string, std::string>{},
                                       hosts_.on_host(1, hosts_path), TwoHosts::kAddressA);
    queue_->read_logs_from(agent_b_->dir());
    const bool both = eventually(
        [&] {
          int alive_hosts = 0;
          for (const auto& node : json(queue_->client().get("/nodes").at("nodes"))) {
            alive_hosts += node.at("alive").get<bool>() ? 1 : 0;
          }
          return alive_hosts == 2;
        },
        30s);
    EXPECT_TRUE(both) << queue_->client().get("/nodes").dump(1) << agent_b_->log();
    return *queue_;
  }

  TwoHosts hosts_;
  std::unique_ptr<InNetworkNamespace> on_a_;
  std::unique_ptr<Queue> queue_;
  std::unique_ptr<Agent> agent_b_;
};

}  // namespace shoal::testing
