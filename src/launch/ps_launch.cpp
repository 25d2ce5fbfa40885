// `shoal run --servers S`: the launcher's side of the parameter servers (docs/ps.md, "Processes").
// Servers are processes of this same binary (`shoal ps-server`), supervised like workers (output
// forwarded with an "[ps I] " tag, stopped with the job); what differs is here: they start first,
// they are told to stop when the last worker has ended, and one that dies before then fails the
// job with its exit status named, unless the other process of its index (--ps-replicas 2: a
// primary and its backup) still runs and serves the index alone.
#include <algorithm>
#include <csignal>

#include "../elastic/token.h"
#include "job_store.h"
#include "launcher.h"
#include "nodes.h"
#include "process.h"
#include "ps_server.h"
#include "watchdog.h"
#include "worker.h"
#include "worker_env.h"

namespace shoal::launch {

// How often a server without a replica is restarted from its snapshot in one job.
constexpr int kServerRestarts = 1;

void Launcher::add_ps_environment(env::Environment& env) const {
  env["SHOAL_PS_SERVERS"] = std::to_string(options_.servers);
  // The servers' clocks start with every worker of the job live.
  env["SHOAL_PS_WORKERS"] = std::to_string(options_.nproc_per_node * options_.nnodes);
  env["SHOAL_JOB_TOKEN"] = ps_token_;
  // The servers seal pushes, and the workers join by themselves (docs/ps.md, "Elastic workers").
  if (ps_elastic()) env["SHOAL_PS_ELASTIC"] = "1";
}

void Launcher::start_servers(const std::string& run_id, int port) {
  // The token the servers ask of every call: the user's, when an enclosing job gave one.
  const env::Environment base = env::current();
  auto given = env::get(base, "SHOAL_JOB_TOKEN");
  ps_token_ = given && !given->empty() ? *given : elastic::make_token();
  env::Environment env = base;
  env["SHOAL_MASTER_ADDR"] = options_.master_addr();
  env["SHOAL_MASTER_PORT"] = std::to_string(port);
  env["SHOAL_RUN_ID"] = run_id;
  add_ps_environment(env);
  for (int i = 0; i < options_.servers; ++i) {
    // With replicas, index i is served by "[ps i] " (the primary) and "[ps ib] " (its backup),
    // the backup first: the primary waits for it before it publishes its own address.
    for (bool backup : {true, false}) {
      if (backup && options_.ps_replicas < 2) continue;
      const std::string tag = "[ps " + std::to_string(i) + (backup ? "b" : "") + "] ";
      auto server = std::make_unique<Worker>(i, i, tag, out_, err_);
      server->server = true;
      server->backup = backup;
      if (backup) server->server_args = {"--role", "backup"};
      if (!backup && options_.ps_replicas > 1) server->server_args = {"--replicas", "2"};
      if (!backup && !options_.ps_snapshot_dir.empty()) {
        server->server_args.insert(server->server_args.end(),
                                   {"--snapshot-dir", options_.ps_snapshot_dir, "--snapshot-every",
                                    std::to_string(options_.ps_snapshot_every)});
      }
      server->envp = to_envp(env);
      spawn(*server);
      workers_.push_back(std::move(server));
    }
  }
}

// "parameter server 1" or "the backup of parameter server 1".
std::string Launcher::server_name(const Worker& server) const {
  return std::string(server.backup ? "the backup of " : "") + "parameter server " +
         std::to_string(server.rank);
}

void Launcher::on_server_exit(Worker& server, const ExitStatus& status) {
  server.exit = status;
  drain(server);
  signal_group(server.pid, SIGKILL);
  watchdog_->forget(server.pid);
  if (stopping_ || (servers_stopping_ && status.success())) return;
  const std::string what = server_name(server) + " " + status.describe();
  if (servers_stopping_) {
    say(what + " when told to stop");
    if (exit_code_ == 0) exit_code_ = 1;
    return;
  }
  // The other process of its index, if it still runs, serves the index's shards alone.
  for (const auto& other : workers_) {
    if (other->server && other->rank == server.rank && other.get() != &server &&
        other->running()) {
      // Workers still waiting for this primary's address are told to take the backup's
      // (ps::detail::lost_primary_key in src/ps/connect.h, which this file cannot include).
      if (!server.backup) {
        store_->put("ps/server/" + std::to_string(server.rank) + "/lost", status.describe());
      }
      say(what + "; " + server_name(*other) + " serves its shards alone");
      return;
    }
  }
  // Without a replica but with snapshots, a server is restarted once from its newest snapshot;
  // the workers' clients find it under the same key (docs/ps.md, "Replicas and snapshots").
  if (!options_.ps_snapshot_dir.empty() && options_.ps_replicas < 2 &&
      server.restarts < kServerRestarts) {
    ++server.restarts;
    say(what + "; restarting it from its newest snapshot (restart " +
        std::to_string(server.restarts) + " of " + std::to_string(kServerRestarts) + ")");
    if (std::find(server.server_args.begin(), server.server_args.end(), "--restore") ==
        server.server_args.end()) {
      server.server_args.push_back("--restore");
    }
    try {
      spawn(server);
      return;
    } catch (const Error& e) {
      say(std::string("cannot restart parameter server ") + std::to_string(server.rank) + ": " +
          e.what());
    }
  }
  // The workers cannot train without it: the job fails.
  exit_code_ = status.success() ? 1 : status.shell_code();
  say(what + "; stopping the workers");
  nodes_->report_failure(what);
  begin_stop(SIGTERM);
}

void Launcher::stop_servers_after_workers() {
  if (servers_stopping_ || stopping_) return;
  for (const auto& worker : workers_) {
    if (!worker->server && (worker->running() || worker->restart_at)) return;
  }
  servers_stopping_ = true;
  for (auto& worker : workers_) {
    if (worker->server && worker->running()) signal_group(worker->pid, SIGTERM);
  }
  kill_at_ = std::chrono::steady_clock::now() + options_.stop_grace;
}

void Launcher::set_ps_worker(Worker& worker) {
  worker.ps_worker = worker.local_rank + options_.nproc_per_node * worker.restarts;
  auto& envp = worker.envp;
  envp.erase(std::remove_if(envp.begin(), envp.end(),
                            [](const std::string& variable) {
                              return variable.rfind("SHOAL_PS_WORKER=", 0) == 0 ||
                                     variable.rfind("SHOAL_PS_ELASTIC=", 0) == 0;
                            }),
             envp.end());
  envp.push_back("SHOAL_PS_ELASTIC=1");
  envp.push_back("SHOAL_PS_WORKER=" + std::to_string(worker.ps_worker));
}

// How long the launcher gives the servers to take a worker's leave.
constexpr Duration kLeaveTimeout{10000};

void Launcher::leave_servers(Worker& worker) {
  if (!ps_members_) {
    ps_members_ = std::make_unique<PsMembership>(options_.master_addr(), store_->port(),
                                                  options_.servers, ps_token_);
  }
  try {
    ps_members_->leave(worker.ps_worker, kLeaveTimeout);
  } catch (const Error& e) {
    // The others would wait for its pushes until their deadline: the job cannot go on.
    if (exit_code_ == 0) exit_code_ = 1;
    say("worker " + std::to_string(worker.local_rank) + " (worker " +
        std::to_string(worker.ps_worker) + " at the parameter servers) " +
        worker.exit->describe() + ", and the servers could not be told: " + e.what() +
        "; stopping the job");
    begin_stop(SIGTERM);
  }
}

void Launcher::check_min_workers(const Worker& lost, const ExitStatus& status) {
  int left = 0;
  for (const auto& worker : workers_) {
    if (!worker->server && (worker->running() || worker->restart_at)) ++left;
  }
  if (left >= options_.min_workers || stopping_) return;
  exit_code_ = status.shell_code();
  say("worker " + std::to_string(lost.local_rank) + " is lost and " + std::to_string(left) +
      " workers remain, fewer than --min " + std::to_string(options_.min_workers) +
      "; stopping the job");
  begin_stop(SIGTERM);
}

}  // namespace shoal::launch
