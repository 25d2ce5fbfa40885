#include "client.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "proc/process.h"
#include "shoal/core/error.h"

namespace shoal::queue::slurm {

namespace {

using Clock = std::chrono::steady_clock;

// Reads what is there; false at end of file.
bool drain(int fd, std::string& into) {
  char buffer[4096];
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof(buffer));
    if (got > 0) {
      into.append(buffer, static_cast<size_t>(got));
      continue;
    }
    if (got == 0) return false;
    return errno == EAGAIN || errno == EINTR;
  }
}

}  // namespace

std::string ClientResult::error_line() const {
  // scontrol says "Node n9 not found" on stdout.
  const std::string& text = err.find_first_not_of(" \n") == std::string::npos ? out : err;
  std::string line;
  size_t end = text.size();
  while (end > 0) {
    const size_t start = text.rfind('\n', end - 1);
    const size_t from = start == std::string::npos ? 0 : start + 1;
    line = text.substr(from, end - from);
    if (!line.empty()) break;
    if (start == std::string::npos) break;
    end = start;
  }
  // "sbatch: error: Batch job submission failed: ..." -> "Batch job submission failed: ..."
  const auto marker = line.find(": error: ");
  if (marker != std::string::npos) line = line.substr(marker + 9);
  if (line.empty()) line = "exit code " + std::to_string(exit_code) + " and no message";
  return line;
}

ClientResult run_client(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                        std::chrono::milliseconds timeout) {
  proc::ProcessSpec spec;
  spec.path = argv.at(0);
  spec.argv = argv;
  spec.env = env;
  sigemptyset(&spec.signal_mask);
  const auto deadline = Clock::now() + timeout;
  proc::ChildProcess child = proc::start_process(spec, [](pid_t) {});
  ClientResult result;
  bool out_open = true;
  bool err_open = true;
  while (out_open || err_open) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      proc::signal_group(child.pid, SIGKILL);
      while (::waitpid(child.pid, nullptr, 0) < 0 && errno == EINTR) {
      }
      std::string command = argv[0].substr(argv[0].rfind('/') + 1);
      for (size_t i = 1; i < argv.size() && i < 4; ++i) command += " " + argv[i];
      throw CommError(command + (argv.size() > 4 ? " ..." : "") + " did not answer within " +
                      std::to_string(timeout.count() / 1000) + " s");
    }
    pollfd fds[2] = {{child.stdout_pipe.get(), POLLIN, 0}, {child.stderr_pipe.get(), POLLIN, 0}};
    fds[0].fd = out_open ? fds[0].fd : -1;
    fds[1].fd = err_open ? fds[1].fd : -1;
    ::poll(fds, 2, static_cast<int>(std::min<int64_t>(left, 100)));
    if (out_open && fds[0].revents != 0) out_open = drain(child.stdout_pipe.get(), result.out);
    if (err_open && fds[1].revents != 0) err_open = drain(child.stderr_pipe.get(), result.err);
  }
  int status = 0;
  while (::waitpid(child.pid, &status, WNOHANG) == 0) {
    if (Clock::now() >= deadline) {
      proc::signal_group(child.pid, SIGKILL);
      while (::waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    ::usleep(5000);
  }
  result.exit_code = proc::ExitStatus::from_wait_status(status).shell_code();
  return result;
}

}  // namespace shoal::queue::slurm
