#include "process.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/close_range.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "shoal/core/error.h"

namespace shoal::proc {
namespace {

std::string check_executable(const std::string& path, const std::string& program) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    throw UsageError("program '" + program + "' does not exist");
  }
  if (S_ISDIR(info.st_mode)) throw UsageError("program '" + program + "' is a directory");
  if (::access(path.c_str(), X_OK) != 0) {
    throw UsageError("program '" + program + "' is not executable (no x permission)");
  }
  return path;
}

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (const auto& s : strings) pointers.push_back(const_cast<char*>(s.c_str()));
  pointers.push_back(nullptr);
  return pointers;
}

// Between fork and execve the child may only make async-signal-safe calls: the launcher has
// other threads (the store's), and any lock they held at the fork stays held in the child.
[[noreturn]] void become_worker(const ProcessSpec& spec, char* const* argv, char* const* envp,
                                pid_t launcher, int null_fd, int out_fd, int err_fd, int status_fd,
                                const Pipe& gate, int max_fd) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The launcher may have died before the line above; then nobody would kill us.
  if (::getppid() != launcher) ::_exit(127);
  // Wait until the launcher has run before_exec (told the guard our group). Without this, a
  // launcher SIGKILLed before it got to that left the program's children to live on. EOF instead
  // of the byte: the launcher gave up on us.
  ::close(gate.write.get());
  char go = 0;
  ssize_t got;
  do {
    got = ::read(gate.read.get(), &go, 1);
  } while (got < 0 && errno == EINTR);
  if (got != 1) ::_exit(127);
  ::dup2(null_fd, STDIN_FILENO);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  // Every signal back to its default action: the launcher ignores SIGPIPE, and a launcher
  // started in the background by a script inherits SIGINT and SIGQUIT ignored (POSIX shells do
  // that), which would make a worker deaf to the signals the launcher forwards. Handlers are
  // reset by execve anyway; ignored signals are not.
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  for (int signal = 1; signal < NSIG; ++signal) {
    if (signal != SIGKILL && signal != SIGSTOP) ::sigaction(signal, &fallback, nullptr);
  }
  ::sigprocmask(SIG_SETMASK, &spec.signal_mask, nullptr);
  // Descriptors the launcher inherited without O_CLOEXEC (or a library opened so) must not
  // reach the worker: a stray copy of a pipe's write end keeps its reader from seeing EOF.
  if (::syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) != 0) {
    for (int fd = 3; fd < max_fd; ++fd) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  ::execve(spec.path.c_str(), argv, envp);
  int error = errno;
  (void)!::write(status_fd, &error, sizeof(error));
  ::_exit(127);
}

}  // namespace

ExitStatus ExitStatus::from_wait_status(int status) {
  ExitStatus exit;
  if (WIFSIGNALED(status)) {
    exit.signaled = true;
    exit.value = WTERMSIG(status);
  } else {
    exit.value = WEXITSTATUS(status);
  }
  return exit;
}

std::string ExitStatus::describe() const {
  if (signaled) {
    return "was killed by signal " + std::to_string(value) + " (" + signal_name(value) + ")";
  }
  return "exited with code " + std::to_string(value);
}

void keep_standard_streams_open() {
  int fd;
  while ((fd = ::open("/dev/null", O_RDWR)) >= 0 && fd <= 2) {
  }
  if (fd > 2) ::close(fd);
}

std::string signal_name(int signal) {
  const char* abbrev = ::sigabbrev_np(signal);
  if (abbrev == nullptr) return "signal " + std::to_string(signal);
  return std::string("SIG") + abbrev;
}

std::string resolve_program(const std::string& program) {
  if (program.empty()) throw UsageError("the program name is empty");
  if (program.find('/') != std::string::npos) return check_executable(program, program);
  const char* path_env = std::getenv("PATH");
  const std::string path = path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin";
  std::string not_executable;
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(begin, end - begin);
    if (dir.empty()) dir = ".";
    std::string candidate = dir + "/" + program;
    struct stat info {};
    if (::stat(candidate.c_str(), &info) == 0 && !S_ISDIR(info.st_mode)) {
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
      if (not_executable.empty()) not_executable = candidate;
    }
    begin = end + 1;
  }
  if (!not_executable.empty()) {
    throw UsageError("program '" + program + "' was found at " + not_executable +
                     " but is not executable (no x permission)");
  }
  throw UsageError("program '" + program + "' was not found on PATH");
}

ChildProcess start_process(const ProcessSpec& spec, const std::function<void(pid_t)>& before_exec) {
  // Everything the child needs is prepared here: it must not allocate.
  std::vector<char*> argv = c_strings(spec.argv);
  std::vector<char*> envp = c_strings(spec.env);
  Fd null_fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!null_fd.valid()) throw Error(std::string("cannot open /dev/null: ") + std::strerror(errno));
  Pipe out = make_pipe();
  Pipe err = make_pipe();
  Pipe status = make_pipe();
  Pipe gate = make_pipe();
  struct rlimit files {};
  const int max_fd = ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < 65536
                         ? static_cast<int>(files.rlim_cur)
                         : 65536;
  const pid_t launcher = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) throw Error(std::string("cannot fork a worker: ") + std::strerror(errno));
  if (pid == 0) {
    become_worker(spec, argv.data(), envp.data(), launcher, null_fd.get(), out.write.get(),
                  err.write.get(), status.write.get(), gate, max_fd);
  }
  // Also here, so that the group exists before the launcher may signal it.
  ::setpgid(pid, pid);
  out.write.reset();
  err.write.reset();
  status.write.reset();
  gate.read.reset();
  before_exec(pid);
  const char go = 1;
  while (::write(gate.write.get(), &go, 1) < 0 && errno == EINTR) {
  }
  gate.write.reset();

  // EOF means execve succeeded (the status pipe closed on exec); otherwise the child sent errno.
  int error = 0;
  ssize_t got;
  do {
    got = ::read(status.read.get(), &error, sizeof(error));
  } while (got < 0 && errno == EINTR);
  if (got == static_cast<ssize_t>(sizeof(error))) {
    int wait_status = 0;
    while (::waitpid(pid, &wait_status, 0) < 0 && errno == EINTR) {
    }
    throw UsageError("cannot execute '" + spec.argv.front() + "': " + std::strerror(error));
  }
  ::fcntl(out.read.get(), F_SETFL, O_NONBLOCK);
  ::fcntl(err.read.get(), F_SETFL, O_NONBLOCK);
  return ChildProcess{pid, std::move(out.read), std::move(err.read)};
}

std::vector<pid_t> child_processes(pid_t pid) {
  std::vector<pid_t> children;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task/";
  DIR* tasks = ::opendir(dir.c_str());
  if (tasks == nullptr) return children;
  while (dirent* task = ::readdir(tasks)) {
    if (task->d_name[0] == '.') continue;
    std::ifstream list(dir + task->d_name + "/children");
    for (pid_t child; list >> child;) children.push_back(child);
  }
  ::closedir(tasks);
  return children;
}

void signal_group(pid_t pgid, int signal) {
  if (pgid > 0) ::kill(-pgid, signal);
}

}  // namespace shoal::proc
