#include "serve.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "comm/store.h"
#include "connect.h"
#include "core/log.h"
#include "core/timeline_start.h"
#include "replica.h"
#include "rpc.h"
#include "server_core.h"
#include "shard_map.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"
#include "snapshot.h"
#include "sum_handler.h"

namespace shoal::ps::detail {
namespace {

// How often the server checks that its job's store is still there.
constexpr Duration kStoreCheck{1000};
// How long a primary waits for its backup to publish its address and answer.
constexpr Duration kBackupWait{60000};

std::string required_variable(const env::Environment& env, const std::string& name,
                              const char* what) {
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
std::unique_ptr<Handler> make_handler(bool sum_handler, const std::string& mode, int index,
                                      const env::Environment& env, SnapshotWriter* snapshots) {
  if (sum_handler) return std::make_unique<SumHandler>();
  const int servers = server_count(env);
  if (servers < 1 || index >= servers) {
    throw UsageError("SHOAL_PS_SERVERS = " + std::to_string(servers) + " for server --index " +
                     std::to_string(index) + "; expected more than the index");
  }
  const auto workers = env::get_int(env, "SHOAL_PS_WORKERS", 1, 1 << 20);
  if (!workers) {
    throw UsageError("SHOAL_PS_WORKERS is not set; expected the job's worker count");
  }
  ServerCoreOptions options;
  if (mode.empty()) {
    // The workers' (Note [The mode comes with the workers] in src/ps/server_registry.cpp).
    options.mode_from_workers = true;
  } else {
    const Mode parsed = parse_mode(mode, "--mode");  // checked at the flags
    options.consistency = parsed.kind == Mode::kSync    ? Consistency::kSync
                          : parsed.kind == Mode::kAsync ? Consistency::kAsync
                                                        : Consistency::kBoundedStaleness;
    options.staleness = parsed.staleness;
  }
  for (int w = 0; w < *workers; ++w) options.workers.push_back(w);
  options.mirror_values = true;  // Note [The values' mirror] (src/ps/mirror.h)
  // An elastic job's workers die, leave and join (docs/ps.md, "Elastic workers").
  options.sealed_pushes = env::get_bool(env, "SHOAL_PS_ELASTIC").value_or(false);
  // shoal run --ps-backup-workers B: a sync step takes the first W - B pushes (docs/ps.md,
  // "Consistency").
  if (auto backup = env::get_int(env, "SHOAL_PS_BACKUP_WORKERS", 0, *workers - 1);
      backup && *backup > 0)
    options.replicas_to_aggregate = static_cast<int32_t>(*workers - *backup);
  options.shards = ShardMap(servers).shards_of(index);
  if (snapshots != nullptr) {
    options.snapshot_every = snapshots->every();
    options.on_snapshot = [snapshots](int64_t step, std::map<int32_t, std::string> shards) {
      snapshots->hand(step, std::move(shards));
    };
  }
  if (snapshots != nullptr && snapshots->restore()) {
    // A restarted server: the newest complete snapshot of its shards, once the tables exist.
    options.restore = [snapshots,
                       shards = options.shards]() -> std::optional<ServerCoreOptions::Restored> {
      auto snapshot = read_newest_snapshot(snapshots->dir(), shards);
      if (!snapshot) {
        log::warn(log::line("no complete snapshot of this server's shards in ", snapshots->dir(),
                            "; starting from the first registration's values"));
        return std::nullopt;
      }
      return ServerCoreOptions::Restored{snapshot->step, std::move(snapshot->shards)};
    };
    options.on_adopted = [index](int64_t snapshot_step, int64_t adopted_step) {
      log::warn(log::line("parameter server ", index, " restarted from step ", snapshot_step, "; ",
                          std::max<int64_t>(adopted_step - snapshot_step, 0),
                          " steps of its shards lost"));
    };
  }
  return std::make_unique<ServerCore>(std::move(options));
}

// Waits (until `timeout`) for the address of server `index`'s backup and returns a client of
// it that has answered a Ping.
std::unique_ptr<RpcClient> connect_backup(const comm::StorePtr& store, int index,
                                          const std::string& token, Duration timeout) {
  const Deadline deadline(timeout);
  const std::string key = backup_key(index);
  std::string address;
  while ((address = comm::try_get(store, key)).empty()) {
    if (deadline.expired()) {
      throw CommError("the backup of parameter server " + std::to_string(index) +
                      " did not publish its address (" + key + " in the job's store) within " +
                      format_duration(timeout));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto backup = std::make_unique<RpcClient>(index, address, token);
  backup->ping(std::max(deadline.remaining(), Duration(1)));
  return backup;
}

}  // namespace

void run_server_process(const ServerProcessOptions& process) {
  const int index = process.index;
  const env::Environment env = env::current();
  comm::StoreOptions store_options;
  store_options.host =
      required_variable(env, "SHOAL_MASTER_ADDR", "the address of the job's store");
  store_options.port =
      static_cast<int>(env::get_int(env, "SHOAL_MASTER_PORT", 1, 65535).value_or(0));
  if (store_options.port == 0) {
    throw UsageError("SHOAL_MASTER_PORT is not set; expected the port of the job's store");
  }
  store_options.described_as = "SHOAL_MASTER_ADDR:SHOAL_MASTER_PORT";
  if (auto id = env::get(env, "SHOAL_RUN_ID"); id && !id->empty()) {
    store_options.job_id = "shoal run " + *id;
    // SHOAL_TIMELINE: the server's track beside its workers' (docs/runtime.md, "Timeline"), in
    // the file of their job, which shoal run names (without it, the server records nothing).
    timeline::start(env, index, store_options.job_id, process.backup ? "backup server" : "server");
  }
  const std::string token = job_token(env);

  // Signals are taken with sigtimedwait: block them before gRPC starts its threads.
  sigset_t stop;
  sigemptyset(&stop);
  for (int signal : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stop, signal);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  // A backup holds what its primary holds: the primary's snapshots are the index's.
  std::unique_ptr<SnapshotWriter> snapshots;
  if (!process.snapshot_dir.empty() && !process.backup) {
    snapshots = std::make_unique<SnapshotWriter>(process.snapshot_dir, process.snapshot_every,
                                                 index, server_count(env), process.restore);
  }
  auto core = make_handler(process.sum_handler, process.mode, index, env, snapshots.get());
  const comm::StorePtr store = comm::open_store(store_options);
  std::unique_ptr<Handler> replicated;
  if (!process.backup && process.replicas > 1) {
    try {
      replicated = std::make_unique<ReplicatedHandler>(
          *core, connect_backup(store, index, token, kBackupWait));
    } catch (const CommError& e) {
      // Workers find no backup either (it never published), so they never fail over to it.
      log::warn(log::line(e.what(), "; serving alone"));
    }
  }
  RpcServerOptions options;
  options.host = process.host;
  options.port = process.port;
  options.index = index;
  options.token = token;
  RpcServer server(replicated ? *replicated : *core, options);
  const std::string address = comm::local_address_towards(store_options.host, store_options.port) +
                              ":" + std::to_string(server.port());
  comm::put(store, process.backup ? backup_key(index) : server_key(index), address);

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
  timeline::flush();  // _Exit runs no atexit handler
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(0);
}

struct MembershipClient::State {
  std::string host;
  int port = 0;
  int servers = 0;
  std::string token;
  std::vector<std::unique_ptr<RpcClient>> clients;
};

MembershipClient::MembershipClient(const std::string& host, int port, int servers,
                                   const std::string& token)
    : state_(std::make_unique<State>()) {
  state_->host = host;
  state_->port = port;
  state_->servers = servers;
  state_->token = token;
}

MembershipClient::~MembershipClient() = default;

int64_t MembershipClient::leave(int worker, Duration timeout) {
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

int64_t MembershipClient::leave_servers(int worker, Duration timeout) {
  const Deadline deadline(timeout);
  auto left = [&] { return std::max(deadline.remaining(), Duration(1)); };
  if (state_->clients.empty()) {
    comm::StoreOptions options;
    options.host = state_->host;
    options.port = state_->port;
    options.timeout = left();
    state_->clients =
        connect_servers(comm::open_store(options), state_->servers, state_->token, left());
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

}  // namespace shoal::ps::detail
