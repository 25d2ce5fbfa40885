// What the launcher (`shoal run --servers`, docs/ps.md, "Processes") needs of the parameter
// servers, and the one header through which it reaches them: the server process it starts
// (`shoal ps-server`), the consistency mode it checks and hands on (mode.h), and the calls that
// make a worker whose process ended leave the servers. Free of LibTorch and gRPC, so that the
// launcher's sources that include it stay cheap to compile.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mode.h"
#include "shoal/core/timeout.h"

namespace shoal::ps::detail {

// One server process of a job: the flags of `shoal ps-server`.
struct ServerProcessOptions {
  int index = 0;                 // the server's index in the job, 0 to S-1
  std::string host = "0.0.0.0";  // the interface to listen on
  int port = 0;                  // 0: any free port
  // Serve with the transport's test handler (SumHandler, which adds the pushes up) rather than
  // the parameter server's core.
  bool sum_handler = false;
  // The consistency mode as parse_mode reads it (checked by the caller); empty: the workers'
  // (Note [The mode comes with the workers] in src/ps/server_registry.cpp).
  std::string mode;
  // A backup publishes its address under backup_key(index) and is forwarded to; a primary with
  // `replicas` 2 forwards every update to its backup (docs/ps.md, "Replicas and snapshots").
  bool backup = false;
  int replicas = 1;
  // A primary writes its shards to `snapshot_dir` (none when empty) every `snapshot_every` steps;
  // `restore`: it was restarted, and loads the newest snapshot of its shards first.
  std::string snapshot_dir;
  int64_t snapshot_every = 100;
  bool restore = false;
};

// Runs server `options.index` of the job whose store the environment names (SHOAL_MASTER_ADDR,
// SHOAL_MASTER_PORT, SHOAL_RUN_ID; SHOAL_PS_SERVERS, SHOAL_PS_WORKERS and the job's token, which
// `shoal run --servers` sets): serves on its port, publishes "ps/server/<index>" = host:port in the
// store, and serves until SIGTERM, SIGINT or SIGHUP, or until the store is gone (the launcher
// ended); then it ends the process with exit code 0, without destructors. UsageError for what
// the environment lacks; CommError (or c10d's error) when the store cannot be reached.
[[noreturn]] void run_server_process(const ServerProcessOptions& options);

// The launcher's link to an elastic job's parameter servers (docs/ps.md, "Elastic workers"),
// through the job's store at host:port; it connects at its first call.
class MembershipClient {
 public:
  MembershipClient(const std::string& host, int port, int servers, const std::string& token);
  ~MembershipClient();
  MembershipClient(const MembershipClient&) = delete;
  MembershipClient& operator=(const MembershipClient&) = delete;

  // A worker whose process ended leaves the servers: fenced off on every server, then gone from
  // each with the highest clock any of them had sealed for it, which is returned. CommError when
  // a server does not answer within `timeout`, or the job's store is lost.
  int64_t leave(int worker, Duration timeout);

 private:
  int64_t leave_servers(int worker, Duration timeout);
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shoal::ps::detail
