#include "ps_server.h"

#include <signal.h>
#include <cstdlib>

#include <map>
#include <optional>

#include <CLI/CLI.hpp>
#include <iostream>
#include <thread>

#include "../ps/connect.h"
#include "../ps/mode.h"
#include "../ps/replica.h"
#include "../ps/rpc.h"
#include "../ps/server_core.h"
#include "../ps/shard_map.h"
#include "../ps/snapshot.h"
#include "../ps/sum_handler.h"
#include "comm/store.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::launch {
namespace {

// How often the server checks that its job's store is still there.
constexpr Duration kStoreCheck{1000};
// How long a primary waits for its backup to publish its address and answer.
constexpr Duration kBackupWait{60000};

std::string required(const env::Environment& env, const std::string& name, const char* what) {
  auto value = env::get(env, name);
  if (!value || value->empty()) {
    throw UsageError(name + " is not set; expected " + what + " (shoal run --servers sets it)");
  }
  return *value;
}

// The handler a server runs: the parameter server's core (docs/ps.md, "Consistency") over the
// virtual shards the shard map gives server `index` of SHOAL_PS_SERVERS, with every worker of
// SHOAL_PS_WORKERS live; or, with --handler sum, the transport's own test handler, which adds the
// pushes up (the transport's tests use it to see exactly what crossed).
std::unique_ptr<ps::detail::Handler> make_handler(const std::string& kind, const std::string& mode,
                                                  int index, const env::Environment& env,
                                                  ps::detail::SnapshotWriter* snapshots) {
  if (kind == "sum") return std::make_unique<ps::detail::SumHandler>();
  const int servers = ps::detail::server_count(env);
  if (servers < 1 || index >= servers) {
    throw UsageError("SHOAL_PS_SERVERS = " + std::to_string(servers) + " for server --index " +
                     std::to_string(index) + "; expected more than the index");
  }
  const auto workers = env::get_int(env, "SHOAL_PS_WORKERS", 1, 1 << 20);
  if (!workers) {
    throw UsageError("SHOAL_PS_WORKERS is not set; expected the job's worker count");
  }
  ps::detail::ServerCoreOptions options;
  if (mode.empty()) {
    // The workers' (Note [The mode comes with the workers] in src/ps/server_registry.cpp).
    options.mode_from_workers = true;
  } else {
    const ps::Mode parsed = ps::parse_mode(mode, "--mode");  // checked at the flags
    options.consistency = parsed.kind == ps::Mode::kSync    ? ps::detail::Consistency::kSync
                          : parsed.kind == ps::Mode::kAsync ? ps::detail::Consistency::kAsync
                                                            : ps::detail::Consistency::kBoundedStaleness;
    options.staleness = parsed.staleness;
  }
  for (int w = 0; w < *workers; ++w) options.workers.push_back(w);
  // An elastic job's workers die, leave and join (docs/ps.md, "Elastic workers").
  options.sealed_pushes = env::get_bool(env, "SHOAL_PS_ELASTIC").value_or(false);
  // shoal run --ps-backup-workers B: a sync step takes the first W - B pushes (docs/ps.md,
  // "Consistency").
  if (auto backup = env::get_int(env, "SHOAL_PS_BACKUP_WORKERS", 0, *workers - 1); backup && *backup > 0)
    options.replicas_to_aggregate = static_cast<int32_t>(*workers - *backup);
  options.shards = ps::detail::ShardMap(servers).shards_of(index);
  if (snapshots != nullptr) {
    options.snapshot_every = snapshots->every();
    options.on_snapshot = [snapshots](int64_t step, std::map<int32_t, std::string> shards) {
      snapshots->hand(step, std::move(shards));
    };
  }
  if (snapshots != nullptr && snapshots->restore()) {
    // A restarted server: the newest complete snapshot of its shards, once the tables exist.
    options.restore =
        [snapshots,
         shards = options.shards]() -> std::optional<ps::detail::ServerCoreOptions::Restored> {
      auto snapshot = ps::detail::read_newest_snapshot(snapshots->dir(), shards);
      if (!snapshot) {
        log::warn(log::line("no complete snapshot of this server's shards in ", snapshots->dir(),
                            "; starting from the first registration's values"));
        return std::nullopt;
      }
      return ps::detail::ServerCoreOptions::Restored{snapshot->step, std::move(snapshot->shards)};
    };
    options.on_adopted = [index](int64_t snapshot_step, int64_t adopted_step) {
      log::warn(log::line("parameter server ", index, " restarted from step ", snapshot_step, "; ",
                          std::max<int64_t>(adopted_step - snapshot_step, 0),
                          " steps of its shards lost"));
    };
  }
  return std::make_unique<ps::detail::ServerCore>(std::move(options));
}

// Waits (until `timeout`) for the address of server `index`'s backup and returns a client of
// it that has answered a Ping.
std::unique_ptr<ps::detail::RpcClient> connect_backup(const comm::StorePtr& store, int index,
                                                      const std::string& token, Duration timeout) {
  const Deadline deadline(timeout);
  const std::string key = ps::detail::backup_key(index);
  std::string address;
  while ((address = comm::try_get(store, key)).empty()) {
    if (deadline.expired()) {
      throw CommError("the backup of parameter server " + std::to_string(index) +
                      " did not publish its address (" + key + " in the job's store) within " +
                      format_duration(timeout));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto backup = std::make_unique<ps::detail::RpcClient>(index, address, token);
  backup->ping(std::max(deadline.remaining(), Duration(1)));
  return backup;
}

// `role`: "primary" (the default; with `replicas` 2 it forwards every update to its backup) or
// "backup" (publishes backup_key(index) instead, and is forwarded to). See docs/ps.md,
// "Replicas and snapshots".
int serve(int index, const std::string& host, int port, const std::string& handler_kind,
          const std::string& mode, const std::string& role, int replicas,
          const std::string& snapshot_dir, int64_t snapshot_every, bool restore) {
  const env::Environment env = env::current();
  comm::StoreOptions store_options;
  store_options.host = required(env, "SHOAL_MASTER_ADDR", "the address of the job's store");
  store_options.port =
      static_cast<int>(env::get_int(env, "SHOAL_MASTER_PORT", 1, 65535).value_or(0));
  if (store_options.port == 0) {
    throw UsageError("SHOAL_MASTER_PORT is not set; expected the port of the job's store");
  }
  store_options.described_as = "SHOAL_MASTER_ADDR:SHOAL_MASTER_PORT";
  if (auto id = env::get(env, "SHOAL_RUN_ID"); id && !id->empty()) {
    store_options.job_id = "shoal run " + *id;
  }
  const std::string token = ps::detail::job_token(env);

  // Signals are taken with sigtimedwait: block them before gRPC starts its threads.
  sigset_t stop;
  sigemptyset(&stop);
  for (int signal : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stop, signal);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  // A backup holds what its primary holds: the primary's snapshots are the index's.
  std::unique_ptr<ps::detail::SnapshotWriter> snapshots;
  if (!snapshot_dir.empty() && role == "primary") {
    snapshots = std::make_unique<ps::detail::SnapshotWriter>(
        snapshot_dir, snapshot_every, index, ps::detail::server_count(env), restore);
  }
  auto core = make_handler(handler_kind, mode, index, env, snapshots.get());
  const comm::StorePtr store = comm::open_store(store_options);
  std::unique_ptr<ps::detail::Handler> replicated;
  if (role == "primary" && replicas > 1) {
    try {
      replicated = std::make_unique<ps::detail::ReplicatedHandler>(
          *core, connect_backup(store, index, token, kBackupWait));
    } catch (const CommError& e) {
      // Workers find no backup either (it never published), so they never fail over to it.
      log::warn(log::line(e.what(), "; serving alone"));
    }
  }
  ps::detail::RpcServerOptions options;
  options.host = host;
  options.port = port;
  options.index = index;
  options.token = token;
  ps::detail::RpcServer server(replicated ? *replicated : *core, options);
  const std::string address = comm::local_address_towards(store_options.host, store_options.port) +
                              ":" + std::to_string(server.port());
  comm::put(store, role == "backup" ? ps::detail::backup_key(index) : ps::detail::server_key(index),
            address);

  for (;;) {
    const timespec wait{kStoreCheck.count() / 1000, (kStoreCheck.count() % 1000) * 1000000L};
    const int signal = ::sigtimedwait(&stop, nullptr, &wait);
    if (signal > 0) break;
    try {
      comm::try_get(store, comm::kJobIdKey);
    } catch (const std::exception&) {
      break;  // the launcher, which hosts the store, is gone: so is the job
    }
  }
  server.shutdown(Duration(1000));
  // Every call has ended and the last snapshot is written (the writer joins): the process ends
  // here, without destructors. The tables go back to the system with it (freeing millions of rows
  // one by one took longer than the launcher's stop grace of 3 s on a loaded machine), and gRPC's
  // global teardown in ~Server can wait ~10 s for an executor thread still polling, which got
  // the server SIGKILLed at the job's end about every other time.
  snapshots.reset();
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(0);
}

}  // namespace

struct PsMembership::State {
  std::string host;
  int port = 0;
  int servers = 0;
  std::string token;
  std::vector<std::unique_ptr<ps::detail::RpcClient>> clients;
};

PsMembership::PsMembership(const std::string& host, int port, int servers,
                           const std::string& token)
    : state_(std::make_unique<State>()) {
  state_->host = host;
  state_->port = port;
  state_->servers = servers;
  state_->token = token;
}

PsMembership::~PsMembership() = default;

int64_t PsMembership::leave(int worker, Duration timeout) {
  try {
    return leave_servers(worker, timeout);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // c10d's, from the job's store
    const std::string what = e.what();
    throw CommError("lost the job's store at " + state_->host + ":" + std::to_string(state_->port) +
                    ": " + what.substr(0, what.find('\n')));
  }
}

int64_t PsMembership::leave_servers(int worker, Duration timeout) {
  using ps::detail::MembershipRequest;
  const Deadline deadline(timeout);
  auto left = [&] { return std::max(deadline.remaining(), Duration(1)); };
  if (state_->clients.empty()) {
    comm::StoreOptions options;
    options.host = state_->host;
    options.port = state_->port;
    options.timeout = left();
    state_->clients =
        ps::detail::connect_servers(comm::open_store(options), state_->servers, state_->token, left());
  }
  // Note [Joins and leaves] (src/ps/server_membership.cpp): fenced off everywhere first, so that no
  // seal of the dead process lands after its sealed clock was read.
  int64_t sealed = 0;
  for (auto& client : state_->clients) {
    sealed = std::max(
        sealed, client->membership({MembershipRequest::Op::kFence, worker, 0}, left()).clock);
  }
  for (auto& client : state_->clients) {
    client->membership({MembershipRequest::Op::kLeave, worker, sealed}, left());
  }
  return sealed;
}

int ps_server_command(const std::vector<std::string>& args) {
  int index = -1;
  int port = 0;
  std::string host = "0.0.0.0";
  std::string handler = "core";
  std::string role = "primary";
  int replicas = 1;
  std::string snapshot_dir;
  int64_t snapshot_every = 100;
  bool restore = false;
  std::string mode = env::get(env::current(), "SHOAL_PS_MODE").value_or("");
  CLI::App app("Serves one parameter server of a job (started by shoal run --servers).",
               "shoal ps-server");
  app.add_option("--index", index, "The server's index in the job, 0 to S-1")->required();
  app.add_option("--port", port, "The port to serve on (default 0: any free port)");
  app.add_option("--host", host, "The interface to listen on (default 0.0.0.0)");
  app.add_option("--handler", handler,
                 "core (the parameter server) or sum (the transport's test handler)")
      ->check(CLI::IsMember({"core", "sum"}));
  app.add_option("--role", role, "primary (the default) or backup (docs/ps.md, replicas)")
      ->check(CLI::IsMember({"primary", "backup"}));
  app.add_option("--replicas", replicas,
                 "Processes serving this index: 1 (the default) or 2 (a primary forwards every "
                 "update to its backup)")
      ->check(CLI::Range(1, 2));
  app.add_option("--snapshot-dir", snapshot_dir,
                 "Write the server's shards to DIR every --snapshot-every steps (docs/ps.md)");
  app.add_option("--snapshot-every", snapshot_every, "Steps between snapshots (default 100)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_flag("--restore", restore,
               "Restarted: load the newest snapshot of this server's shards from --snapshot-dir");
  app.add_option("--mode", mode,
                 "sync, async or ssp:S (bounded staleness S); default SHOAL_PS_MODE, else the "
                 "workers' (ps::ServerOptions::mode)");
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    app.parse(reversed);
    if (!mode.empty()) ps::parse_mode(mode, app.count("--mode") > 0 ? "--mode" : "SHOAL_PS_MODE");
    if (index < 0) throw UsageError("--index " + std::to_string(index) + "; expected 0 or more");
    if (port < 0 || port > 65535) {
      throw UsageError("--port " + std::to_string(port) + "; expected 0 to 65535");
    }
    return serve(index, host, port, handler, mode, role, replicas, snapshot_dir, snapshot_every,
                 restore);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "shoal ps-server: " << e.what() << std::endl;
    return 2;
  } catch (const UsageError& e) {
    std::cerr << "shoal ps-server: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shoal ps-server: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace shoal::launch
