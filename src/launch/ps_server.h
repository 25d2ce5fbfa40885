// `shoal ps-server`: one parameter server of a job, started by `shoal run --servers S` (internal;
// not in `shoal --help`). See docs/ps.md, "Processes".
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shoal/core/timeout.h"

namespace shoal::launch {

// Runs `shoal ps-server --index I [--port P] [--host H]`: joins the job's store (SHOAL_MASTER_ADDR,
// SHOAL_MASTER_PORT, SHOAL_RUN_ID), serves on P (0: any free port) with the job's token
// (SHOAL_JOB_TOKEN), publishes "ps/server/I" = host:port, and serves until SIGTERM, SIGINT or
// SIGHUP, or until the job's store is gone (the launcher ended). Returns the exit code: 0 when
// stopped so, 2 for bad arguments or environment, 1 when the store cannot be reached.
int ps_server_command(const std::vector<std::string>& args);

// The launcher's link to an elastic job's parameter servers (docs/ps.md, "Elastic workers"),
// through the job's store at host:port; it connects at its first call.
class PsMembership {
 public:
  PsMembership(const std::string& host, int port, int servers, const std::string& token);
  ~PsMembership();
  // A worker whose process ended leaves the servers: fenced off on every server, then gone from
  // each with the highest clock any of them had sealed for it, which is returned. CommError when
  // a server does not answer within `timeout`.
  int64_t leave(int worker, Duration timeout);

 private:
  int64_t leave_servers(int worker, Duration timeout);
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shoal::launch
