#include "shoal_run.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>

#include <gtest/gtest.h>

#include "test_paths.h"

namespace shoal::testing {

using Clock = std::chrono::steady_clock;

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

ShoalRun::ShoalRun(const std::vector<std::string>& args) : ShoalRun(args, "") {}

ShoalRun::ShoalRun(const std::vector<std::string>& args, const std::string& netns)
    : start_(Clock::now()) {
  std::vector<std::string> argv{"shoal", "run"};
  // Read before the fork: the child only calls execv.
  const std::string& shoal = shoal_bin();
  if (!netns.empty()) argv = {"ip", "netns", "exec", netns, shoal, "run"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> c_argv;
  for (auto& arg : argv) c_argv.push_back(arg.data());
  c_argv.push_back(nullptr);
  int out[2], err[2];
  EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
  EXPECT_EQ(::pipe2(err, O_CLOEXEC), 0);
  pid_ = ::fork();
  if (pid_ == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    if (netns.empty()) {
      ::execv(shoal.c_str(), c_argv.data());
    } else {
      ::execvp("ip", c_argv.data());
    }
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  out_ = out[0];
  err_ = err[0];
}

ShoalRun::~ShoalRun() {
  if (!reaped_) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (out_ >= 0) ::close(out_);
  if (err_ >= 0) ::close(err_);
}

void ShoalRun::pump(int poll_ms) {
  if (!reaped_) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      result_.exit_code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      result_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    }
  }
  pollfd fds[2] = {{out_, POLLIN, 0}, {err_, POLLIN, 0}};
  ::poll(fds, 2, poll_ms);
  auto read_into = [](int& fd, short revents, std::string& text) {
    if (fd < 0 || revents == 0) return;
    char buffer[65536];
    const ssize_t got = ::read(fd, buffer, sizeof(buffer));
    if (got > 0) {
      text.append(buffer, static_cast<size_t>(got));
    } else {
      ::close(fd);
      fd = -1;
    }
  };
  read_into(out_, fds[0].revents, result_.out);
  read_into(err_, fds[1].revents, result_.err);
}

bool ShoalRun::wait_for_output(const std::string& text, std::chrono::milliseconds timeout) {
  return wait_until(
      [&](const RunResult& so_far) { return so_far.out.find(text) != std::string::npos; }, timeout);
}

bool ShoalRun::wait_until(const std::function<bool(const RunResult&)>& ready,
                          std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!ready(result_)) {
    if ((out_ < 0 && err_ < 0) || Clock::now() > deadline) return false;
    pump(20);
  }
  return true;
}

RunResult ShoalRun::wait(std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  bool killed = false;
  while (out_ >= 0 || err_ >= 0 || !reaped_) {
    if (Clock::now() > deadline) {
      if (killed) break;  // a stream stays open even after SIGKILL: give up on it
      result_.timed_out = killed = true;
      ::kill(pid_, SIGKILL);
      deadline = Clock::now() + std::chrono::seconds(2);
    }
    pump(20);
  }
  return result_;
}

RunResult run_shoal(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  return ShoalRun(args).wait(timeout);
}

pid_t find_child(pid_t parent, const std::string& part) {
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return -1;
  pid_t found = -1;
  while (dirent* entry = ::readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(entry->d_name));
    if (pid <= 0) continue;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    char state = 0;
    std::istringstream(line.substr(close + 2)) >> state >> ppid;
    if (ppid != parent) continue;
    std::ifstream cmdline_file("/proc/" + std::to_string(pid) + "/cmdline");
    const std::string cmdline((std::istreambuf_iterator<char>(cmdline_file)), {});
    if (cmdline.find(part) != std::string::npos) found = pid;
  }
  ::closedir(proc);
  return found;
}

}  // namespace shoal::testing
