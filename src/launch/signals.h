// The launcher's signals, read from a signalfd so that one poll() loop waits for worker output,
// worker exits (SIGCHLD) and the user's signals alike, and wakes at once for each.
#pragma once

#include <signal.h>

#include <exception>
#include <vector>

#include "proc/fd.h"
#include "shoal/core/timeout.h"

namespace shoal::launch {

// Signals the launcher passes on to every worker. SIGINT, SIGTERM and SIGHUP also stop the job;
// SIGUSR1 and SIGUSR2 are only forwarded (schedulers send them as a warning before a deadline);
// SIGTSTP (Ctrl-Z) pauses the workers and then the launcher, which resumes them on SIGCONT.
bool is_stopping_signal(int signal);

// A stopping signal arrived while the launcher was waiting before its workers started.
class Interrupted : public std::exception {
 public:
  explicit Interrupted(int signal) : signal_(signal) {}
  int signal() const { return signal_; }
  const char* what() const noexcept override { return "interrupted by a signal"; }

 private:
  int signal_;
};

class SignalSet {
 public:
  // Blocks SIGCHLD and the forwarded signals (in this thread, and so in every thread created
  // after: construct it before the store starts its threads) and ignores SIGPIPE, so that a
  // closed stdout cannot kill the launcher and leave its workers unwatched.
  SignalSet();
  ~SignalSet();
  SignalSet(const SignalSet&) = delete;
  SignalSet& operator=(const SignalSet&) = delete;

  int fd() const { return fd_.get(); }
  // The signals that arrived since the last call, in order; never blocks.
  std::vector<int> take();
  // Waits up to `timeout` for a signal that stops the job, and returns it (0 if none came).
  // SIGCHLD and forwarded-only signals are consumed. For waits before any worker exists.
  int wait_for_stop(Duration timeout);
  // The mask the process had before: workers start with it.
  const sigset_t& original_mask() const { return original_mask_; }

 private:
  proc::Fd fd_;
  sigset_t original_mask_;
  struct sigaction original_pipe_action_;
};

}  // namespace shoal::launch
