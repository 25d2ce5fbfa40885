// `shoal run --servers S`: the launcher's side of the parameter servers (docs/ps.md, "Processes").
// Servers are processes of this same binary (`shoal ps-server`), supervised like workers (output
// forwarded with an "[ps I] " tag, stopped with the job); what differs is here: they start first,
// they are told to stop when the last worker has ended, and one that dies before then fails the
// job with its exit status named.
#include <csignal>

#include "../elastic/token.h"
#include "launcher.h"
#include "nodes.h"
#include "process.h"
#include "watchdog.h"
#include "worker.h"
#include "worker_env.h"

namespace shoal::launch {

void Launcher::add_ps_environment(env::Environment& env) const {
  env["SHOAL_PS_SERVERS"] = std::to_string(options_.servers);
  // The servers' clocks start with every worker of the job live.
  env["SHOAL_PS_WORKERS"] = std::to_string(options_.nproc_per_node * options_.nnodes);
  env["SHOAL_JOB_TOKEN"] = ps_token_;
}

void Launcher::start_servers(const std::string& run_id, int port) {
  // The token the servers ask of every call: the user's, when an enclosing job gave one.
  const env::Environment base = env::current();
  auto given = env::get(base, "SHOAL_JOB_TOKEN");
  ps_token_ = given && !given->empty() ? *given : elastic::make_token();
  for (int i = 0; i < options_.servers; ++i) {
    env::Environment env = base;
    env["SHOAL_MASTER_ADDR"] = options_.master_addr();
    env["SHOAL_MASTER_PORT"] = std::to_string(port);
    env["SHOAL_RUN_ID"] = run_id;
    add_ps_environment(env);
    auto server = std::make_unique<Worker>(i, i, "[ps " + std::to_string(i) + "] ", out_, err_);
    server->server = true;
    server->envp = to_envp(env);
    spawn(*server);
    workers_.push_back(std::move(server));
  }
}

void Launcher::on_server_exit(Worker& server, const ExitStatus& status) {
  server.exit = status;
  drain(server);
  signal_group(server.pid, SIGKILL);
  watchdog_->forget(server.pid);
  if (stopping_ || (servers_stopping_ && status.success())) return;
  const std::string what =
      "parameter server " + std::to_string(server.rank) + " " + status.describe();
  if (servers_stopping_) {
    say(what + " when told to stop");
    if (exit_code_ == 0) exit_code_ = 1;
    return;
  }
  // The workers cannot train without it (replicas are not there yet): the job fails.
  exit_code_ = status.success() ? 1 : status.shell_code();
  say(what + "; stopping the workers");
  nodes_->report_failure(what);
  begin_stop(SIGTERM);
}

void Launcher::stop_servers_after_workers() {
  if (servers_stopping_ || stopping_) return;
  for (const auto& worker : workers_) {
    if (!worker->server && worker->running()) return;
  }
  servers_stopping_ = true;
  for (auto& worker : workers_) {
    if (worker->server && worker->running()) signal_group(worker->pid, SIGTERM);
  }
  kill_at_ = std::chrono::steady_clock::now() + options_.stop_grace;
}

}  // namespace shoal::launch
