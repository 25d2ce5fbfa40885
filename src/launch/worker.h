// One worker process of a launcher, across its restarts. Private to src/launch.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "proc/fd.h"
#include "launcher.h"
#include "output.h"
#include "proc/process.h"

namespace shoal::launch {

struct Launcher::Worker {
  Worker(int local_rank, int rank, const std::string& prefix, Sink& out, Sink& err)
      : local_rank(local_rank), rank(rank), out_lines(prefix, out), err_lines(prefix, err) {}

  int local_rank;
  int rank;
  pid_t pid = -1;  // also its process group
  proc::Fd out;
  proc::Fd err;
  LineForwarder out_lines;
  LineForwarder err_lines;
  std::optional<proc::ExitStatus> exit;
  std::vector<std::string> envp;  // kept for restarts
  int restarts = 0;
  bool server = false;  // a parameter server (`shoal ps-server --index <rank>`), not a worker
  std::vector<std::string> server_args;  // a server's further flags (--role backup, ...)
  bool backup = false;                   // a server that is its index's backup
  int ps_worker = -1;  // an elastic job's worker: its id at the parameter servers (SHOAL_PS_WORKER)
  std::optional<std::chrono::steady_clock::time_point> restart_at;

  bool running() const { return pid > 0 && !exit; }
};

}  // namespace shoal::launch
