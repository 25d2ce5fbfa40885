#include "signals.h"

#include <poll.h>
#include <sys/signalfd.h>

#include <cerrno>
#include <cstring>

#include "shoal/core/error.h"

namespace shoal::launch {
namespace {

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGTSTP};

}  // namespace

bool is_stopping_signal(int signal) {
  return signal == SIGINT || signal == SIGTERM || signal == SIGHUP;
}

SignalSet::SignalSet() {
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGCHLD);
  for (int signal : kForwarded) sigaddset(&handled, signal);
  if (::pthread_sigmask(SIG_BLOCK, &handled, &original_mask_) != 0) {
    throw Error("cannot block signals");
  }
  fd_.reset(::signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!fd_.valid()) {
    ::pthread_sigmask(SIG_SETMASK, &original_mask_, nullptr);
    throw Error(std::string("cannot create a signalfd: ") + std::strerror(errno));
  }
  // SIGCHLD inherited as ignored would have the kernel reap the workers before waitpid() could
  // say how they ended. (The other signals read here reach the signalfd even if inherited as
  // ignored, since they are blocked; workers get every default action back in start_process.)
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  ::sigaction(SIGCHLD, &fallback, nullptr);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &original_pipe_action_);
}

SignalSet::~SignalSet() {
  ::sigaction(SIGPIPE, &original_pipe_action_, nullptr);
  ::pthread_sigmask(SIG_SETMASK, &original_mask_, nullptr);
}

std::vector<int> SignalSet::take() {
  std::vector<int> signals;
  signalfd_siginfo info[16];
  for (;;) {
    ssize_t got = ::read(fd_.get(), info, sizeof(info));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    for (size_t i = 0; i < static_cast<size_t>(got) / sizeof(info[0]); ++i) {
      signals.push_back(static_cast<int>(info[i].ssi_signo));
    }
  }
  return signals;
}

int SignalSet::wait_for_stop(Duration timeout) {
  Deadline deadline(timeout);
  do {
    pollfd entry{fd_.get(), POLLIN, 0};
    ::poll(&entry, 1, static_cast<int>(deadline.remaining().count()));
    for (int signal : take()) {
      if (is_stopping_signal(signal)) return signal;
    }
  } while (!deadline.expired());
  return 0;
}

}  // namespace shoal::launch
