#include "step.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "proc/process.h"
#include "core/log.h"

extern char** environ;

namespace shoal::queue::slurm {

namespace {

// The signals a Slurm job's step receives from scancel --signal or Slurm itself, passed on.
constexpr int kForwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT};

void write_file(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << text << "\n";
  }
  std::rename(temporary.c_str(), path.c_str());
}

void write_exit(const std::string& prefix, const std::string& exit, bool success,
                const std::vector<std::string>& signals = {}) {
  write_file(prefix + ".exit",
             nlohmann::json{{"exit", exit}, {"success", success}, {"signals", signals}}.dump());
}

}  // namespace

int run_step(const std::string& prefix, const std::vector<std::string>& argv) {
  if (argv.empty()) {
    write_exit(prefix, "could not start: no program given to shoal-slurm-step", false);
    return 127;
  }
  // Ignored, SIGCHLD would reap the program by itself and never be reported.
  ::signal(SIGCHLD, SIG_DFL);
  sigset_t forwarded;
  sigemptyset(&forwarded);
  for (int signal : kForwarded) sigaddset(&forwarded, signal);
  sigaddset(&forwarded, SIGCHLD);
  sigset_t original;
  ::sigprocmask(SIG_BLOCK, &forwarded, &original);

  std::vector<std::string> args = argv;
  std::vector<char*> c_args;
  for (auto& arg : args) c_args.push_back(arg.data());
  c_args.push_back(nullptr);
  // The child tells why its execve failed through a pipe that closes on a successful exec.
  int status_pipe[2];
  if (::pipe2(status_pipe, O_CLOEXEC) != 0) {
    write_exit(prefix, std::string("could not start: pipe: ") + std::strerror(errno), false);
    return 127;
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    write_exit(prefix, std::string("could not start: fork: ") + std::strerror(errno), false);
    return 127;
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::sigprocmask(SIG_SETMASK, &original, nullptr);
    ::close(status_pipe[0]);
    ::execve(c_args[0], c_args.data(), environ);
    const int error = errno;
    (void)!::write(status_pipe[1], &error, sizeof(error));
    ::_exit(127);
  }
  ::close(status_pipe[1]);
  int error = 0;
  ssize_t got;
  do {
    got = ::read(status_pipe[0], &error, sizeof(error));
  } while (got < 0 && errno == EINTR);
  ::close(status_pipe[0]);
  if (got == static_cast<ssize_t>(sizeof(error))) {
    ::waitpid(pid, nullptr, 0);
    const std::string why =
        "could not start: cannot execute '" + argv[0] + "': " + std::strerror(error);
    log::error(log::line("shoal agent: ", why));
    write_exit(prefix, why, false);
    return 127;
  }
  write_file(prefix + ".pid", std::to_string(pid));

  std::vector<std::string> passed_on;  // each signal once, in the order first received
  for (;;) {
    siginfo_t info{};
    const int signal = ::sigwaitinfo(&forwarded, &info);
    if (signal < 0) continue;
    if (signal != SIGCHLD) {
      ::kill(pid, signal);
      const std::string name = proc::signal_name(signal);
      if (std::find(passed_on.begin(), passed_on.end(), name) == passed_on.end())
        passed_on.push_back(name);
      continue;
    }
    int status = 0;
    const pid_t ended = ::waitpid(pid, &status, WNOHANG);
    if (ended != pid) continue;
    const auto exit = proc::ExitStatus::from_wait_status(status);
    write_exit(prefix, exit.describe(), exit.success(), passed_on);
    return exit.shell_code();
  }
}

}  // namespace shoal::queue::slurm
