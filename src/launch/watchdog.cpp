#include "watchdog.h"

#include <linux/close_range.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "shoal/core/error.h"
#include "shoal/core/timeout.h"

namespace shoal::launch {
namespace {

// One message on the pipe. Smaller than PIPE_BUF, so each write arrives whole.
struct Message {
  int32_t op;
  int32_t pgid;
};

constexpr int32_t kWatch = 'W';
constexpr int32_t kForget = 'F';
constexpr int32_t kGoodbye = 'Q';
constexpr int kMaxGroups = 65536;

// The guard's whole life. Plain system calls and a static table only.
[[noreturn]] void guard_main(int pipe_fd) {
  ::setpgid(0, 0);
  int null_fd = ::open("/dev/null", O_RDWR);
  // The guard must not hold the launcher's stdout or stderr open: whoever reads the launcher's
  // output until EOF would wait for the guard too.
  if (null_fd >= 0) {
    ::dup2(null_fd, STDIN_FILENO);
    ::dup2(null_fd, STDOUT_FILENO);
    ::dup2(null_fd, STDERR_FILENO);
  }
  if (pipe_fd != 3) {
    ::dup2(pipe_fd, 3);
    pipe_fd = 3;
  }
  ::syscall(SYS_close_range, 4U, ~0U, 0U);

  static pid_t groups[kMaxGroups];
  int count = 0;
  Message message{};
  for (;;) {
    ssize_t got = ::read(pipe_fd, &message, sizeof(message));
    if (got < 0 && errno == EINTR) continue;
    if (got != static_cast<ssize_t>(sizeof(message))) break;  // EOF: the launcher died
    if (message.op == kGoodbye) ::_exit(0);
    if (message.op == kWatch && count < kMaxGroups) groups[count++] = message.pgid;
    if (message.op == kForget) {
      for (int i = 0; i < count; ++i) {
        if (groups[i] == message.pgid) groups[i] = groups[--count];
      }
    }
  }
  for (int i = 0; i < count; ++i) ::kill(-groups[i], SIGKILL);
  ::_exit(0);
}

}  // namespace

Watchdog::Watchdog() {
  proc::Pipe pipe = proc::make_pipe();
  guard_ = ::fork();
  if (guard_ < 0) throw Error(std::string("cannot fork the guard process: ") + std::strerror(errno));
  if (guard_ == 0) {
    pipe.write.reset();
    guard_main(pipe.read.get());
  }
  pipe_ = std::move(pipe.write);
}

Watchdog::~Watchdog() {
  send(kGoodbye, 0);
  pipe_.reset();
  // Reap the guard, briefly: the launcher's own reaping (waitpid(-1)) may have done it already.
  Deadline deadline(std::chrono::seconds(1));
  while (!deadline.expired()) {
    int status = 0;
    pid_t got = ::waitpid(guard_, &status, WNOHANG);
    if (got == guard_ || (got < 0 && errno != EINTR)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void Watchdog::watch(pid_t pgid) { send(kWatch, pgid); }

void Watchdog::forget(pid_t pgid) { send(kForget, pgid); }

void Watchdog::send(char op, pid_t pgid) {
  if (!pipe_.valid()) return;
  Message message{op, static_cast<int32_t>(pgid)};
  ssize_t wrote;
  do {
    wrote = ::write(pipe_.get(), &message, sizeof(message));
  } while (wrote < 0 && errno == EINTR);
}

}  // namespace shoal::launch
