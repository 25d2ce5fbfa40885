// Starting one worker process, and saying how a process ended.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "fd.h"

namespace shoal::proc {

// How a process ended, from waitpid's status.
struct ExitStatus {
  bool signaled = false;
  int value = 0;  // the exit code, or the signal number when signaled

  static ExitStatus from_wait_status(int status);
  bool success() const { return !signaled && value == 0; }
  // What a shell would report: the code, or 128 + the signal.
  int shell_code() const { return signaled ? 128 + value : value; }
  // "exited with code 3", "was killed by signal 9 (SIGKILL)": the sentence stored under
  // comm::worker_exit_key and printed by the launcher; workers quote it verbatim.
  std::string describe() const;
};

// "SIGKILL", or "signal 77" for a number without a name.
std::string signal_name(int signal);

// Opens /dev/null on whichever of stdin, stdout and stderr are closed: with one closed, the next
// pipe would take its number and worker output would go astray. Called first in main().
void keep_standard_streams_open();

// The path to execute for `program`: itself when it contains a slash, else the first executable
// match on PATH, as a shell finds it. Raises a one-line UsageError when there is none, or when
// the file is a directory or not executable.
std::string resolve_program(const std::string& program);

struct ProcessSpec {
  std::string path;                // what to execute
  std::vector<std::string> argv;   // argv[0] is the program as the user typed it
  std::vector<std::string> env;    // "NAME=value", the whole environment
  sigset_t signal_mask;            // the mask the child starts with (the launcher's original)
};

// A started worker. It leads its own process group, so signalling the group reaches whatever it
// started too; its stdout and stderr are the read ends of pipes (non-blocking); its stdin is
// /dev/null; and the kernel SIGKILLs it if the launcher dies (PR_SET_PDEATHSIG).
struct ChildProcess {
  pid_t pid = -1;  // also its process group id
  Fd stdout_pipe;
  Fd stderr_pipe;
};

// `before_exec(pid)` runs in the launcher once the child leads its own process group and before
// the child may execute the program: whoever learns the group there (the guard, Note [No orphans]
// in watchdog.h) knows it before anything the program starts can exist.
// Raises UsageError when the program cannot be executed (the child's execve error, e.g.
// "Exec format error" for a script without #!), after reaping the child.
ChildProcess start_process(const ProcessSpec& spec, const std::function<void(pid_t)>& before_exec);

// The children of process `pid`, this one by default (from /proc/PID/task/*/children: every
// thread's; empty where the kernel lacks it or the process is gone).
std::vector<pid_t> child_processes(pid_t pid = ::getpid());

// kill(-pgid, signal), ignoring a group that is already gone.
void signal_group(pid_t pgid, int signal);

}  // namespace shoal::proc
