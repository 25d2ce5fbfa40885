// Cleans up the workers' process groups if the launcher itself is killed.
//
// Note [No orphans]: a worker gets PR_SET_PDEATHSIG, so the kernel kills it when the launcher
// dies, but that setting is not inherited across fork: whatever the worker started (a shell
// script's `sleep 1000 &`, a data-loading helper) would live on. So before starting workers the
// launcher forks a guard process holding the read end of a pipe whose only write end the
// launcher keeps. The launcher tells the guard each worker's process group; if the guard reads
// EOF without a goodbye, the launcher is gone (even by SIGKILL) and the guard SIGKILLs every
// group it knows. The guard is in a process group of its own, so a signal to the launcher's
// group does not take it along.
// The guard must hear of a group before the worker executes its program, so a forked worker
// waits for start_process's before_exec. Telling it once execve had succeeded was a race: on a
// loaded machine the worker's script could start its children before the launcher next ran, and
// a launcher killed in between left them alive.
#pragma once

#include <sys/types.h>

#include "proc/fd.h"

namespace shoal::launch {

class Watchdog {
 public:
  // Forks the guard. Call it before the process has other threads: the guard runs on after the
  // fork without exec.
  Watchdog();
  // Says goodbye: the guard exits without killing anything.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void watch(pid_t pgid);
  // The group is gone (its leader was reaped and the rest SIGKILLed): forget it, so that a
  // later reuse of the number is never killed.
  void forget(pid_t pgid);
  pid_t guard_pid() const { return guard_; }

 private:
  void send(char op, pid_t pgid);

  pid_t guard_ = -1;
  proc::Fd pipe_;
};

}  // namespace shoal::launch
