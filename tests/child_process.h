// A forked child for the tests of parts without torch (gossip, etcd): it runs a body that reports
// lines through a pipe, dies with the test (PR_SET_PDEATHSIG) and is SIGKILLed when the object
// goes. Fork before the test starts threads: the child has only the forking thread.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>

namespace shoal::testing {

class ChildProcess {
 public:
  // What the body reports: one line each call.
  using Say = std::function<void(const std::string&)>;

  // Forks; the child runs body(say) and leaves with _exit (0, or 1 after saying "error: WHAT"
  // when the body threw), so that no destructor of the test's objects runs in it.
  explicit ChildProcess(const std::function<void(const Say&)>& body) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    std::fflush(stdout);
    std::fflush(stderr);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // nothing outlives a crashed test
      ::close(fds[0]);
      const int out = fds[1];
      const Say say = [out](const std::string& line) {
        const std::string text = line + "\n";
        (void)!::write(out, text.data(), text.size());
      };
      try {
        body(say);
      } catch (const std::exception& e) {
        say(std::string("error: ") + e.what());
        std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
        ::_exit(1);
      }
      ::_exit(0);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~ChildProcess() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    ::close(fd_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }

  // The child's next line, or "" when none came within `timeout` (or the child is gone).
  std::string read_line(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (auto end = buffer_.find('\n'); end != std::string::npos) {
        std::string line = buffer_.substr(0, end);
        buffer_.erase(0, end + 1);
        return line;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
      char chunk[4096];
      const ssize_t n = ::read(fd_, chunk, sizeof(chunk));
      if (n <= 0) return "";
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string buffer_;
};

}  // namespace shoal::testing
