// `shoal ps-server`: one parameter server of a job, started by `shoal run --servers S` (internal;
// not in `shoal --help`). See docs/ps.md, "Processes". The server itself is the parameter
// servers' (ps::detail::run_server_process, src/ps/serve.h); this is its command line.
#pragma once

#include <string>
#include <vector>

namespace shoal::launch {

// Runs `shoal ps-server --index I [--port P] [--host H]`: joins the job's store (SHOAL_MASTER_ADDR,
// SHOAL_MASTER_PORT, SHOAL_RUN_ID), serves on P (0: any free port) with the job's token
// (SHOAL_JOB_TOKEN), publishes "ps/server/I" = host:port, and serves until SIGTERM, SIGINT or
// SIGHUP, or until the job's store is gone (the launcher ended). Returns the exit code: 0 when
// stopped so, 2 for bad arguments or environment, 1 when the store cannot be reached.
int ps_server_command(const std::vector<std::string>& args);

}  // namespace shoal::launch
