// `shoal run --servers S`: the launcher's side of the parameter servers (docs/ps.md, "Processes").
// Servers are processes of this same binary (`shoal ps-server`), supervised like workers (output
// forwarded with an "[ps I] " tag, stopped with the job); what differs is here: they start first,
// they are told to stop when the last worker has ended, and one that dies before then fails the
// job with its exit status named, unless the other process of its index (--ps-replicas 2: a
// primary and its backup) still runs and serves the index alone.
#include <algorithm>
#include <csignal>
#include <sstream>
#include <cstdlib>

#include "core/token.h"
#include "job_store.h"
#include "launcher.h"
#include "nodes.h"
#include "proc/process.h"
#include "ps/serve.h"
#include "watchdog.h"
#include "worker.h"
#include "proc/worker_env.h"

namespace shoal::launch {

// How often a server without a replica is restarted from its snapshot in one job.
constexpr int kServerRestarts = 1;

void Launcher::add_ps_environment(env::Environment& env) const {
  env["SHOAL_PS_SERVERS"] = std::to_string(options_.servers);
  // The servers' clocks start with every worker of the job live.
  env["SHOAL_PS_WORKERS"] = std::to_string(options_.nproc_per_node * options_.nnodes);
  env["SHOAL_JOB_TOKEN"] = ps_token_;
  // The servers seal pushes, and the workers join by themselves (docs/ps.md, "Elastic workers").
  // The workers share no group either: each is a world of its own (SHOAL_SEPARATE_WORKERS, which
  // shoal::init() reads).
  if (ps_elastic()) {
    env["SHOAL_PS_ELASTIC"] = "1";
    env["SHOAL_SEPARATE_WORKERS"] = "1";
  }
  if (options_.ps_backup_workers > 0)
    env["SHOAL_PS_BACKUP_WORKERS"] = std::to_string(options_.ps_backup_workers);
}

void Launcher::choose_ps_token() {
  // The token the servers ask of every call: the user's, when an enclosing job gave one.
  auto given = env::get(env::current(), "SHOAL_JOB_TOKEN");
  if (given && !given->empty()) {
    ps_token_ = *given;
  } else if (options_.hosts_store()) {
    ps_token_ = make_token();
  }
  // Several nodes: node 0's reaches the others through the job's store, before they join.
  if (options_.nnodes > 1 && options_.hosts_store()) store_->put(kTokenKey, ps_token_);
}

void Launcher::adopt_ps_token() {
  if (ps_token_.empty()) ps_token_ = store_->get(kTokenKey);
}

void Launcher::start_servers(const std::string& run_id, int port) {
  const env::Environment base = env::current();
  env::Environment env = base;
  env["SHOAL_MASTER_ADDR"] = options_.master_addr();
  env["SHOAL_MASTER_PORT"] = std::to_string(port);
  env["SHOAL_RUN_ID"] = run_id;
  add_ps_environment(env);
  for (int i = 0; i < options_.servers; ++i) {
    // Several nodes: server i runs on node i % nnodes, its backup beside it (docs/ps.md,
    // "Processes").
    if (i % options_.nnodes != options_.node_rank) continue;
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
      server->envp = proc::to_envp(env);
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

void Launcher::on_server_exit(Worker& server, const proc::ExitStatus& status) {
  server.exit = status;
  drain(server);
  proc::signal_group(server.pid, SIGKILL);
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
  if (ps_elastic()) {
    // Workers of launchers that joined may still run (looked at again every
    // NodeGroup::kCheckInterval).
    try {
      if (store_->add(kRunningKey, 0) > 0) return;
    } catch (const Error&) {
    }
  }
  if (options_.nnodes > 1) {
    // Other nodes' workers may still use this node's servers: stop them once every node's
    // workers are done (checked again with the other nodes, every NodeGroup::kCheckInterval).
    const std::string key = "ps/launch/workers_done";
    try {
      if (!workers_done_counted_) {
        store_->add(key, 1);
        workers_done_counted_ = true;
      }
      if (store_->add(key, 0) < options_.nnodes) return;
    } catch (const Error&) {
      // The store is gone: node 0's launcher ended, and the job with it.
    }
  }
  servers_stopping_ = true;
  for (auto& worker : workers_) {
    if (worker->server && worker->running()) proc::signal_group(worker->pid, SIGTERM);
  }
  kill_at_ = std::chrono::steady_clock::now() + options_.stop_grace;
}

std::string Launcher::servers_flags() const {
  const char* mode = std::getenv("SHOAL_PS_MODE");
  return "--servers " + std::to_string(options_.servers) + " --ps-replicas " +
         std::to_string(options_.ps_replicas) + " --ps-backup-workers " +
         std::to_string(options_.ps_backup_workers) +
         " SHOAL_PS_MODE=" + (mode != nullptr ? mode : "");
}

void Launcher::check_servers_flags() {
  const std::string first = store_->get(kServersKey);
  if (first != servers_flags()) {
    throw UsageError("node " + std::to_string(options_.node_rank) + " runs with " +
                     servers_flags() + ", node 0 with " + first +
                     "; expected the same parameter servers on every node");
  }
}

void Launcher::publish_ps_job() {
  ps_first_workers_ = options_.nproc_per_node;
  store_->put(kFirstWorkersKey, std::to_string(options_.nproc_per_node));
  store_->put(kMaxWorkersKey, std::to_string(options_.max_workers));
  store_->put(kServersKey, servers_flags());
  store_->put(kTokenKey, ps_token_);
  const char* mode = std::getenv("SHOAL_PS_MODE");
  // Empty: the program's (ps::ServerOptions::mode); joining launchers' workers get the same.
  store_->put(kModeKey, mode != nullptr ? mode : "");
  say("elastic parameter-server job; more workers join it with: shoal run --servers " +
      std::to_string(options_.servers) + " --join " + options_.master_addr() + ":" +
      std::to_string(store_->port()) + " [-n K] PROGRAM");
}

bool Launcher::reserve_workers(int count) {
  try {
    // A joining launcher's --max is the job's.
    const int max = options_.joins() ? std::stoi("0" + store_->get(kMaxWorkersKey))
                                     : options_.max_workers;
    if (store_->add(kRunningKey, count) <= max) {
      ps_held_ += count;
      return true;
    }
    store_->add(kRunningKey, -count);
  } catch (const Error&) {
    // The job's store is gone: its first launcher ended, and the job with it.
  }
  return false;
}

void Launcher::release_workers(int count) {
  ps_held_ -= count;
  try {
    store_->add(kRunningKey, -count);
  } catch (const Error&) {
  }
}

void Launcher::set_ps_worker(Worker& worker) {
  // The first launcher's first workers are the servers' workers 0..N-1; every later one (a
  // restart, a joiner) takes the next id of the job's counter.
  if (worker.restarts == 0 && !options_.joins()) {
    worker.ps_worker = worker.local_rank;
  } else {
    worker.ps_worker = ps_first_workers_ + static_cast<int>(store_->add(kIdsKey, 1)) - 1;
  }
  if (options_.joins()) {
    ps_live_ids_.insert(worker.ps_worker);
    publish_joiner();  // before the worker starts: the first launcher must know every id
  }
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
    ps_members_ = std::make_unique<ps::detail::MembershipClient>(
        options_.joins() ? options_.join_host : options_.master_addr(), store_->port(),
        options_.servers, ps_token_);
  }
  try {
    ps_members_->leave(worker.ps_worker, kLeaveTimeout);
    if (options_.joins()) {
      ps_live_ids_.erase(worker.ps_worker);
      publish_joiner();
    }
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

static std::string joiner_key(int joiner, const char* what) {
  return "ps/launch/joiner/" + std::to_string(joiner) + "/" + what;
}

void Launcher::publish_joiner() {
  if (ps_joiner_ == 0) return;
  std::string ids;
  for (int id : ps_live_ids_) ids += (ids.empty() ? "" : " ") + std::to_string(id);
  try {
    store_->put(joiner_key(ps_joiner_, "ids"), ids.empty() ? "-" : ids);
    store_->put(joiner_key(ps_joiner_, "running"), std::to_string(ps_held_));
    store_->add(joiner_key(ps_joiner_, "beat"), 1);
  } catch (const Error&) {
    // The job's store is gone: the job ended.
  }
}

void Launcher::watch_joiners() {
  try {
    const int64_t count = store_->add(kJoinersKey, 0);
    const TimePoint now = std::chrono::steady_clock::now();
    for (int j = 1; j <= count; ++j) {
      const int64_t beat = store_->add(joiner_key(j, "beat"), 0);
      auto [it, fresh] = joiners_.try_emplace(j, Joiner{beat, now, false});
      Joiner& joiner = it->second;
      if (fresh || joiner.gone) continue;
      if (beat != joiner.beat) {
        joiner.beat = beat;
        joiner.changed = now;
        continue;
      }
      if (now - joiner.changed < NodeGroup::kSilenceLimit) continue;
      // Its launcher is gone, and its workers with it (Note [No orphans], watchdog.h).
      joiner.gone = true;
      std::string ids = store_->get(joiner_key(j, "ids"));
      const int running = std::stoi("0" + store_->get(joiner_key(j, "running")));
      if (!ps_members_) {
        ps_members_ = std::make_unique<ps::detail::MembershipClient>(
            options_.master_addr(), store_->port(), options_.servers, ps_token_);
      }
      std::istringstream words(ids == "-" ? "" : ids);
      for (int id; words >> id;) ps_members_->leave(id, kLeaveTimeout);
      store_->add(kRunningKey, -running);  // their room is free again
      say("a launcher that joined the job went silent for " +
          format_duration(NodeGroup::kSilenceLimit) + "; its workers (" +
          (ids == "-" ? std::string("none") : ids) + " at the servers) left the servers");
    }
  } catch (const Error& e) {
    say("could not look after the launchers that joined: " + std::string(e.what()));
  }
}

void Launcher::check_min_workers(const Worker& lost, const proc::ExitStatus& status) {
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

// `shoal run --servers S --join HOST:PORT [-n K] PROGRAM` (docs/ps.md, "Elastic workers"): K
// more workers for the elastic parameter-server job whose store is at HOST:PORT. This launcher
// starts no server; its workers join the job's servers by themselves, and it makes them leave
// when they end and restarts the failed ones, as the job's first launcher does.
int Launcher::run_ps_join() {
  const std::string at = options_.join_host + ":" + std::to_string(options_.join_port);
  store_ = JobStore::connect(options_.join_host, options_.join_port, options_.connect_timeout,
                             "--join " + at);
  const std::string first = store_->get(kFirstWorkersKey);
  if (first.empty()) {
    throw UsageError("--join " + at +
                     ": no elastic parameter-server job there; expected the address its first "
                     "shoal run printed");
  }
  ps_first_workers_ = std::stoi(first);
  const std::string flags = store_->get(kServersKey);
  const std::string servers = "--servers " + std::to_string(options_.servers) + " ";
  if (flags.rfind(servers, 0) != 0) {
    throw UsageError("--servers " + std::to_string(options_.servers) + ", but the job at " + at +
                     " runs with " + flags.substr(0, flags.find(" --ps-replicas")) +
                     "; expected the same");
  }
  ps_token_ = store_->get(kTokenKey);
  const std::string run_id = store_->run_id();
  const std::string mode = store_->get(kModeKey);
  const int count = options_.nproc_per_node;
  if (!reserve_workers(count)) {
    throw UsageError("the job at " + at + " runs its --max " + store_->get(kMaxWorkersKey) +
                     " workers; no room for " + std::to_string(count) + " more");
  }
  ps_joiner_ = static_cast<int>(store_->add(kJoinersKey, 1));
  env::Environment base = env::current();
  add_ps_environment(base);
  if (mode.empty()) {
    base.erase("SHOAL_PS_MODE");
  } else {
    base["SHOAL_PS_MODE"] = mode;
  }
  for (int i = 0; i < count; ++i) {
    proc::WorkerPlace place;
    place.local_rank = i;
    place.local_world_size = count;
    place.master_addr = options_.join_host;
    place.master_port = options_.join_port;
    place.run_id = run_id;
    env::Environment env = proc::worker_environment(base, place);
    // Ranks after the first launcher's: shoal::is_main() stays its worker 0's.
    for (const char* name : {"SHOAL_RANK", "RANK", "ROLE_RANK"})
      env[name] = std::to_string(ps_first_workers_ + i);
    for (const char* name : {"SHOAL_WORLD_SIZE", "WORLD_SIZE", "ROLE_WORLD_SIZE"})
      env[name] = std::to_string(ps_first_workers_ + count);
    const std::string prefix = options_.tags_output() ? "[" + std::to_string(i) + "] " : "";
    auto worker = std::make_unique<Worker>(i, ps_first_workers_ + i, prefix, out_, err_);
    worker->envp = proc::to_envp(env);
    set_ps_worker(*worker);
    try {
      spawn(*worker);
    } catch (const Error& e) {
      release_workers(count - i);
      if (workers_.empty()) throw;
      say(std::string(e.what()) + "; stopping the other workers");
      exit_code_ = 2;
      begin_stop(SIGTERM);
      break;
    }
    workers_.push_back(std::move(worker));
  }
  supervise();
  kill_leftovers();
  if (!stopping_ && any_success_) return 0;
  return exit_code_;
}

}  // namespace shoal::launch
