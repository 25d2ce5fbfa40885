#include "engine.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/close_range.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <set>

#include "proc/process.h"
#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::queue::local {

namespace {

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Everything the child needs is made before fork: the agent has other threads (the
// memberships'), and the child may only make async-signal-safe calls.
pid_t spawn(WorkerLaunch launch) {
  auto args = c_strings(launch.argv);
  auto envp = c_strings(launch.env);
  const int log_fd = ::open(launch.log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) throw UsageError("cannot open " + launch.log + ": " + std::strerror(errno));
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  std::vector<gid_t> groups;
  if (launch.user) groups.assign(launch.user->groups.begin(), launch.user->groups.end());
  const pid_t agent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    ::close(null_fd);
    throw UsageError(std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != agent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(null_fd, 0);
    ::dup2(log_fd, 1);
    ::dup2(log_fd, 2);
    ::syscall(SYS_close_range, 3, ~0U, 0);
    // The job's user, before anything of the job's runs: groups first, the uid last (after it,
    // no way back).
    if (launch.user && (::setgroups(groups.size(), groups.data()) != 0 ||
                        ::setgid(launch.user->gid) != 0 || ::setuid(launch.user->uid) != 0)) {
      const char message[] = "shoal agent: cannot become the job's user\n";
      (void)!::write(2, message, sizeof(message) - 1);
      ::_exit(127);
    }
    if (::chdir(launch.cwd.c_str()) != 0) {
      const char message[] = "shoal agent: cannot change to the job's directory\n";
      (void)!::write(2, message, sizeof(message) - 1);
      ::_exit(127);
    }
    ::execve(args[0], args.data(), envp.data());
    const char message[] = "shoal agent: cannot execute the job's program\n";
    (void)!::write(2, message, sizeof(message) - 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(log_fd);
  ::close(null_fd);
  return pid;
}

}  // namespace

Capacity LocalEngine::capacity() const {
  return Capacity{static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)), 0};
}

int64_t LocalEngine::start(const WorkerLaunch& launch) {
  const pid_t pid = spawn(launch);
  running_[launch.worker] = Running{pid, launch.job};
  // Placed while the child still loads its program, before it starts any thread of its own
  // (and a cgroup move takes every thread of the process anyway).
  const std::string how = weights_.place(pid, launch.job, launch.priority);
  log::info(log::line("shoal agent: worker ", launch.worker, " of job ", launch.job, " (pid ", pid,
                      ", priority ", launch.priority, "): ", how));
  return pid;
}

void LocalEngine::signal(int64_t worker, int signal) {
  auto it = running_.find(worker);
  if (it != running_.end()) proc::signal_group(it->second.pid, signal);
}

std::vector<WorkerChange> LocalEngine::poll() {
  std::vector<WorkerChange> changes;
  std::set<int64_t> ended_jobs;
  for (auto it = running_.begin(); it != running_.end();) {
    int status = 0;
    if (::waitpid(it->second.pid, &status, WNOHANG) != it->second.pid) {
      ++it;
      continue;
    }
    const auto exit = proc::ExitStatus::from_wait_status(status);
    changes.push_back(
        WorkerChange{it->first, it->second.pid, true, exit.describe(), exit.success()});
    ended_jobs.insert(it->second.job);
    it = running_.erase(it);
  }
  for (const auto& [worker, running] : running_) ended_jobs.erase(running.job);
  for (int64_t job : ended_jobs) weights_.forget(job);
  return changes;
}

}  // namespace shoal::queue::local
