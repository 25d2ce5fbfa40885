// Parameter servers that survive (docs/ps.md, "Replicas and snapshots"): a retried push is
// answered as before by the core; under `shoal run --servers 2 --ps-replicas 2` a SIGKILLed
// primary hands its shards to its backup and every worker's per-step check against one process
// still passes across the kill (no acknowledged update lost); both processes of an index gone
// fail the job.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "error_of.h"
#include "ps/connect.h"
#include "ps/replica.h"
#include "ps/rpc.h"
#include "ps/server_core.h"
#include "ps/shard_map.h"
#include "ps/snapshot.h"
#include "ps_support.h"
#include "comm/store.h"
#include "shoal_run.h"
#include "test_paths.h"

namespace shoal::ps::detail {
namespace {

using namespace std::chrono_literals;
using shoal::UsageError;
using shoal::testing::error_of;
using shoal::testing::test_programs_dir;

constexpr int64_t kValues = 8;

std::unique_ptr<ServerCore> registered_core(Consistency consistency, int32_t aggregate = 0) {
  ServerCoreOptions options;
  options.consistency = consistency;
  options.replicas_to_aggregate = aggregate;
  options.workers = {0, 1, 2};
  options.shards = ShardMap(1).shards_of(0);
  auto core = std::make_unique<ServerCore>(options);
  OptimizerSpec sgd;
  sgd.lr = 0.5;
  sgd.momentum = 0.9;
  RegisterRequest request{0, {shoal::testing::dense_spec("w", {kValues}, sgd)}, {}, ""};
  request.initial = {{0, {0}, std::vector<float>(kValues, 1.0f)}};
  core->register_tables(request, Deadline(10s));
  return core;
}

PushRequest push_of(int32_t worker, int64_t clock) {
  std::vector<float> grad(kValues);
  for (int64_t i = 0; i < kValues; ++i) grad[i] = 0.1f * (worker + 1) + 0.01f * i - 0.03f * clock;
  return {worker, clock, worker + 1, {{0, {0}, grad}}, {}};
}

std::vector<float> values_of(ServerCore& core, int32_t worker, int64_t clock) {
  return core.pull({worker, clock, {{0, {0}, {}}}, {}}, Deadline(10s)).dense.at(0).values;
}

// Note [Retried pushes]: a core that gets every push twice holds bit for bit what a core that got
// each once holds, and answers the second as it answered the first; in every mode, and with
// backup workers, where the retry of a push that was not counted is again not counted.
TEST(PsReplicaCore, ARetriedPushIsAnsweredAsBeforeAndAppliedOnce) {
  struct Mode {
    Consistency consistency;
    int32_t aggregate;
    const char* name;
  };
  for (const Mode& mode :
       {Mode{Consistency::kSync, 0, "sync"}, Mode{Consistency::kSync, 2, "sync, 2 of 3 aggregated"},
        Mode{Consistency::kAsync, 0, "async"}}) {
    SCOPED_TRACE(mode.name);
    auto once = registered_core(mode.consistency, mode.aggregate);
    auto twice = registered_core(mode.consistency, mode.aggregate);
    int uncounted = 0;
    for (int64_t t = 0; t < 3; ++t) {
      for (int32_t w : {2, 0, 1}) {
        const PushReply first = once->push(push_of(w, t), Deadline(10s));
        const PushReply original = twice->push(push_of(w, t), Deadline(10s));
        const PushReply retried = twice->push(push_of(w, t), Deadline(10s));
        EXPECT_EQ(original.counted, first.counted);
        EXPECT_EQ(retried.counted, original.counted) << "worker " << w << " step " << t;
        EXPECT_EQ(retried.clock, original.clock) << "worker " << w << " step " << t;
        uncounted += original.counted ? 0 : 1;
      }
      EXPECT_EQ(twice->step(), once->step());
      EXPECT_EQ(twice->clock_of(0), t + 1);
      EXPECT_EQ(values_of(*twice, 0, t + 1), values_of(*once, 0, t + 1)) << "after step " << t;
    }
    EXPECT_EQ(uncounted, mode.aggregate > 0 ? 3 : 0);  // the last pusher of each step
  }
}

TEST(PsReplicaCore, OnlyTheLastStepIsRetriedAnyOtherIsRefused) {
  auto core = registered_core(Consistency::kSync);
  for (int64_t t = 0; t < 2; ++t)
    for (int32_t w = 0; w < 3; ++w) core->push(push_of(w, t), Deadline(10s));
  EXPECT_EQ(error_of<UsageError>([&] { core->push(push_of(1, 0), Deadline(10s)); }),
            "parameter server: push: worker 1 pushed step 0; expected its next step 2");
  EXPECT_EQ(error_of<UsageError>([&] { core->push(push_of(1, 3), Deadline(10s)); }),
            "parameter server: push: worker 1 pushed step 3; expected its next step 2");
  // A worker that left and joined again starts anew: its old last push is no retry.
  core->set_live_workers({0, 2}, LeaverPush::kDiscard);
  core->set_live_workers({0, 1, 2}, LeaverPush::kDiscard);
  EXPECT_EQ(error_of<UsageError>([&] { core->push(push_of(1, 1), Deadline(10s)); }),
            "parameter server: push: worker 1 pushed step 1; expected its next step 2");
}

// Note [Clocks after a reload]: a core restarted from the snapshot of step 2, whose workers are at
// step 3 (worker 1, which had not pushed it) and 4 (workers 0 and 2, whose pushes of step 3 died
// with the old server), takes step 3 with worker 1's push alone, on the snapshot's values.
TEST(PsReplicaCore, AReloadedCoreAdoptsTheWorkersClocksAndLosesTheStepsSinceItsSnapshot) {
  auto original = registered_core(Consistency::kSync);
  for (int64_t t = 0; t < 2; ++t)
    for (int32_t w = 0; w < 3; ++w) original->push(push_of(w, t), Deadline(10s));
  std::map<int32_t, std::string> saved;
  for (int32_t shard : ShardMap(1).shards_of(0)) saved[shard] = original->save_shard(shard);

  ServerCoreOptions options;
  options.workers = {0, 1, 2};
  options.shards = ShardMap(1).shards_of(0);
  options.restore = [&] { return std::optional<ServerCoreOptions::Restored>({2, saved}); };
  std::vector<std::pair<int64_t, int64_t>> adopted;
  options.on_adopted = [&](int64_t from, int64_t at) { adopted.emplace_back(from, at); };
  ServerCore restarted(options);
  OptimizerSpec sgd;
  sgd.lr = 0.5;
  sgd.momentum = 0.9;
  RegisterRequest request{0, {shoal::testing::dense_spec("w", {kValues}, sgd)}, {}, ""};
  request.initial = {{0, {0}, std::vector<float>(kValues, 1.0f)}};
  restarted.register_tables(request, Deadline(10s));

  auto first = std::async(std::launch::async, [&] {
    return restarted.pull({0, 4, {{0, {0}, {}}}, {}}, Deadline(30s));
  });
  EXPECT_TRUE(restarted.push(push_of(1, 3), Deadline(10s)).counted);
  const PullReply last = restarted.pull({2, 4, {{0, {0}, {}}}, {}}, Deadline(30s));
  EXPECT_EQ(adopted, (std::vector<std::pair<int64_t, int64_t>>{{2, 3}}));
  EXPECT_EQ(restarted.step(), 4);

  // The same step on the snapshot's values, with worker 1's gradient as the whole step's.
  ServerCoreOptions alone;
  alone.workers = {1};
  alone.shards = ShardMap(1).shards_of(0);
  ServerCore expected(alone);
  request.worker = 1;
  expected.register_tables(request, Deadline(10s));
  for (const auto& [shard, bytes] : saved) expected.load_shard(shard, bytes);
  PushRequest push = push_of(1, 3);
  push.clock = 0;
  expected.push(push, Deadline(10s));
  const auto want = values_of(expected, 1, 1);
  EXPECT_EQ(first.get().dense.at(0).values, want);
  EXPECT_EQ(last.dense.at(0).values, want);
  EXPECT_NE(want, values_of(*original, 0, 2));  // it did step, from the snapshot
}

// ---------------------------------------------------------------------------------------------
// A primary and its backup in this process, over the real transport: the primary's handler
// forwards to the backup's server, and one client knows both.

const std::string kToken = "replica-test-token";

struct Pair {
  std::unique_ptr<ServerCore> primary_core = registered_core(Consistency::kSync);
  std::unique_ptr<ServerCore> backup_core = unregistered_core();
  std::unique_ptr<RpcServer> backup_server = serve(*backup_core);
  std::unique_ptr<ReplicatedHandler> replicated = std::make_unique<ReplicatedHandler>(
      *primary_core, std::make_unique<RpcClient>(0, address(*backup_server), kToken));
  std::unique_ptr<RpcServer> primary_server = serve(*replicated);

  static std::unique_ptr<ServerCore> unregistered_core() {
    ServerCoreOptions options;
    options.workers = {0, 1, 2};
    options.shards = ShardMap(1).shards_of(0);
    return std::make_unique<ServerCore>(options);
  }
  static std::unique_ptr<RpcServer> serve(Handler& handler) {
    RpcServerOptions options;
    options.host = "127.0.0.1";
    options.token = kToken;
    return std::make_unique<RpcServer>(handler, options);
  }
  static std::string address(const RpcServer& server) {
    return "127.0.0.1:" + std::to_string(server.port());
  }
};

RegisterRequest registration() {
  OptimizerSpec sgd;
  sgd.lr = 0.5;
  sgd.momentum = 0.9;
  RegisterRequest request{0, {shoal::testing::dense_spec("w", {kValues}, sgd)}, {}, ""};
  request.initial = {{0, {0}, std::vector<float>(kValues, 1.0f)}};
  return request;
}

// The primary registered its tables itself (registered_core): the backup gets them as the
// primary forwards a worker's registration.
TEST(PsReplicaPair, AClientFailsOverToTheBackupWhichAnswersAForwardedPushAsBefore) {
  Pair pair;
  auto once = registered_core(Consistency::kSync);
  RpcClient client(0, {Pair::address(*pair.primary_server), Pair::address(*pair.backup_server)},
                   kToken);
  client.register_tables(registration(), 10s);
  for (int32_t w = 0; w < 3; ++w) {
    EXPECT_TRUE(client.push(push_of(w, 0), 10s).counted);
    once->push(push_of(w, 0), Deadline(10s));
  }
  EXPECT_EQ(pair.backup_core->step(), 1);  // acknowledged: both hold it
  EXPECT_EQ(values_of(*pair.backup_core, 0, 1), values_of(*pair.primary_core, 0, 1));

  // Worker 0's push of step 1 reached the backup (forwarded) but the primary died before it
  // answered: the worker's client sends it again, to the backup.
  const PushReply forwarded = pair.backup_core->push(push_of(0, 1), Deadline(10s));
  pair.primary_server->shutdown(Duration(0));
  const PushReply retried = client.push(push_of(0, 1), 10s);
  EXPECT_EQ(client.failovers(), 1);
  EXPECT_EQ(client.address(), Pair::address(*pair.backup_server));
  EXPECT_EQ(retried.counted, forwarded.counted);
  EXPECT_EQ(retried.clock, forwarded.clock);
  once->push(push_of(0, 1), Deadline(10s));
  for (int32_t w = 1; w < 3; ++w) {
    client.push(push_of(w, 1), 10s);
    once->push(push_of(w, 1), Deadline(10s));
  }
  const PullReply pulled = client.pull({0, 2, {{0, {0}, {}}}, {}}, 10s);
  EXPECT_EQ(pulled.dense.at(0).values, values_of(*once, 0, 2));  // bit for bit
  EXPECT_EQ(client.failovers(), 1);
}

TEST(PsReplicaPair, APrimaryWhoseBackupIsGoneServesAlone) {
  Pair pair;
  RpcClient client(0, {Pair::address(*pair.primary_server), Pair::address(*pair.backup_server)},
                   kToken);
  client.register_tables(registration(), 10s);
  client.push(push_of(0, 0), 10s);
  EXPECT_TRUE(pair.replicated->has_backup());
  pair.backup_server->shutdown(Duration(0));
  EXPECT_TRUE(client.push(push_of(1, 0), 10s).counted);
  EXPECT_FALSE(pair.replicated->has_backup());
  client.push(push_of(2, 0), 10s);
  EXPECT_EQ(pair.primary_core->step(), 1);
  EXPECT_EQ(client.failovers(), 0);
}

// A server that answers, even with an error, is not failed over from (Note [Which UNAVAILABLE
// fails over] in src/ps/rpc_client.cpp).
TEST(PsReplicaPair, ARefusalIsNotAFailover) {
  Pair pair;
  RpcClient client(0, {Pair::address(*pair.primary_server), Pair::address(*pair.backup_server)},
                   kToken);
  client.register_tables(registration(), 10s);
  EXPECT_EQ(error_of<UsageError>([&] { client.push(push_of(0, 5), 10s); }),
            "parameter server 0 (" + Pair::address(*pair.primary_server) +
                ") refused Push: Push: parameter server: push: worker 0 pushed step 5; expected "
                "its next step 0");
  EXPECT_EQ(client.failovers(), 0);
}

// A primary that died before it published its address: the launcher marks it lost, and a worker
// still connecting takes its backup's address instead of waiting for it.
TEST(PsReplicaPair, ConnectingTakesTheBackupOfAPrimaryThatDiedBeforePublishing) {
  comm::StoreOptions options;
  options.is_server = true;
  const comm::StorePtr store = comm::open_store(options);
  auto core = Pair::unregistered_core();
  auto backup = Pair::serve(*core);
  comm::put(store, backup_key(0), Pair::address(*backup));
  const auto start = std::chrono::steady_clock::now();
  auto waiting =
      std::async(std::launch::async, [&] { return connect_servers(store, 1, kToken, 30s); });
  EXPECT_EQ(waiting.wait_for(300ms), std::future_status::timeout);  // the primary may yet come
  comm::put(store, lost_primary_key(0), "was killed by signal 9 (SIGKILL)");
  const auto clients = waiting.get();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);  // a failure bound
  ASSERT_EQ(clients.size(), 1u);
  EXPECT_EQ(clients[0]->address(), Pair::address(*backup));
  clients[0]->register_tables(registration(), 10s);
  EXPECT_TRUE(clients[0]->push(push_of(0, 0), 10s).counted);
  EXPECT_EQ(core->clock_of(0), 1);
}

// ---------------------------------------------------------------------------------------------
// Snapshot files (src/ps/snapshot.h).

std::string fresh_dir(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "ps_replica_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::map<int32_t, std::string> fake_shards(const std::vector<int32_t>& shards, int64_t step) {
  std::map<int32_t, std::string> out;
  for (int32_t shard : shards)
    out[shard] = "shard " + std::to_string(shard) + " at " + std::to_string(step);
  return out;
}

TEST(PsSnapshotFiles, TheNewestCompleteStepIsReadAndDamagedFilesAreSkipped) {
  const std::string dir = fresh_dir("files");
  const ShardMap three(3);
  for (int64_t step : {2, 4, 6}) {
    for (int s = 0; s < 3; ++s) {
      // Server 2's snapshot of step 6 never completes (a crash before the rename).
      if (step == 6 && s == 2) continue;
      write_snapshot(dir, s, 3, step, fake_shards(three.shards_of(s), step));
    }
  }
  std::ofstream(dir + "/snapshot-000000000006-server-2-of-3.bin.tmp") << "half";
  // Each server kept its two newest files.
  EXPECT_FALSE(std::filesystem::exists(dir + "/snapshot-000000000002-server-0-of-3.bin"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/snapshot-000000000004-server-0-of-3.bin"));

  // Server 0 of 3 has step 6; every shard of server 0 of 2 only step 4 (step 6 lacks server 2's).
  auto own = read_newest_snapshot(dir, three.shards_of(0));
  ASSERT_TRUE(own);
  EXPECT_EQ(own->step, 6);
  EXPECT_EQ(own->shards, fake_shards(three.shards_of(0), 6));
  const ShardMap two(2);
  for (int s = 0; s < 2; ++s) {
    auto moved = read_newest_snapshot(dir, two.shards_of(s));
    ASSERT_TRUE(moved);
    EXPECT_EQ(moved->step, 4);
    EXPECT_EQ(moved->shards, fake_shards(two.shards_of(s), 4));
  }

  // A flipped byte fails the checksum: that file is skipped and the older step is read.
  const std::string path = dir + "/snapshot-000000000006-server-0-of-3.bin";
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[bytes.size() / 2] ^= 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  auto older = read_newest_snapshot(dir, three.shards_of(0));
  ASSERT_TRUE(older);
  EXPECT_EQ(older->step, 4);
  // Truncated files too; and nothing at all is nullopt, not an error.
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    std::filesystem::resize_file(entry.path(), 10);
  EXPECT_FALSE(read_newest_snapshot(dir, three.shards_of(0)));
  EXPECT_FALSE(read_newest_snapshot(dir + "/none", three.shards_of(0)));
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Real processes: `shoal run --servers 2 --ps-replicas 2 -n 3 ps_worker`.

const std::string kWorker = test_programs_dir() + "/ps_worker";

int64_t monotonic_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return now.tv_sec * 1000000000LL + now.tv_nsec;
}

// The pid of the launcher's child `shoal ps-server --index <index>` whose command line has
// `role_flag` ("--replicas" for a primary, "--role" for a backup).
pid_t find_server(pid_t launcher, int index, const std::string& role_flag) {
  return shoal::testing::find_child(
      launcher, std::string("--index") + '\0' + std::to_string(index) + '\0' + role_flag + '\0');
}

// The monotonic times of worker `rank`'s "ps step T at NS" lines.
std::vector<int64_t> step_times(const std::string& out, int rank) {
  std::vector<int64_t> times;
  const std::string tag = "[" + std::to_string(rank) + "] ps step ";
  for (const auto& line : shoal::testing::split_lines(out)) {
    if (line.rfind(tag, 0) != 0) continue;
    const auto at = line.find(" at ");
    if (at != std::string::npos) times.push_back(std::stoll(line.substr(at + 4)));
  }
  return times;
}

bool has_step(const shoal::testing::RunResult& run, int rank, int step) {
  return run.out.find("[" + std::to_string(rank) + "] ps step " + std::to_string(step) + " at ") !=
         std::string::npos;
}

constexpr int kSteps = 30;

TEST(PsReplicaLaunch, AKilledPrimaryHandsOverToItsBackupAndNoAcknowledgedUpdateIsLost) {
  shoal::testing::ShoalRun run({"--servers", "2", "--ps-replicas", "2", "-n", "3", kWorker,
                                "--steps", std::to_string(kSteps), "--pause-ms", "50"});
  ASSERT_TRUE(run.wait_until(
      [](const shoal::testing::RunResult& r) {
        return has_step(r, 0, 5) && has_step(r, 1, 5) && has_step(r, 2, 5);
      },
      120s))
      << run.so_far().out << run.so_far().err;
  const pid_t primary = find_server(run.pid(), 1, "--replicas");
  ASSERT_GT(primary, 0);
  const int64_t killed = monotonic_ns();
  ::kill(primary, SIGKILL);
  const shoal::testing::RunResult result = run.wait(120s);
  // Each worker checked every step against one process (ps_worker.cpp): across the kill too.
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  for (int r = 0; r < 3; ++r) {
    const std::string ok =
        "[" + std::to_string(r) + "] ps ok 2 servers, " + std::to_string(kSteps) + " sync steps";
    EXPECT_NE(result.out.find(ok), std::string::npos) << result.out;
  }
  EXPECT_NE(result.err.find("shoal run: parameter server 1 was killed by signal 9 (SIGKILL); the "
                            "backup of parameter server 1 serves its shards alone"),
            std::string::npos)
      << result.err;
  // The failover time: from the kill to the first step any worker completed after it, and to
  // the first step every worker completed after it (each step sleeps 50 ms besides).
  int64_t first = INT64_MAX, all = 0;
  for (int r = 0; r < 3; ++r) {
    int64_t next = INT64_MAX;
    for (int64_t t : step_times(result.out, r))
      if (t > killed) next = std::min(next, t);
    ASSERT_NE(next, INT64_MAX) << "worker " << r << " completed no step after the kill";
    first = std::min(first, next);
    all = std::max(all, next);
  }
  std::cout << "failover: first step after the SIGKILL " << (first - killed) / 1e6
            << " ms later, every worker's " << (all - killed) / 1e6 << " ms later" << std::endl;
  EXPECT_LT(all - killed, 10 * 1000000000LL);  // a failure bound; docs/ps.md says what is usual
}

TEST(PsReplicaLaunch, BothProcessesOfAnIndexGoneFailTheJob) {
  shoal::testing::ShoalRun run(
      {"--servers", "2", "--ps-replicas", "2", "-n", "2", kWorker, "--hold"});
  ASSERT_TRUE(run.wait_until(
      [](const shoal::testing::RunResult& r) {
        return r.out.find("[0] ps ready") != std::string::npos &&
               r.out.find("[1] ps ready") != std::string::npos;
      },
      60s))
      << run.so_far().out << run.so_far().err;
  const pid_t primary = find_server(run.pid(), 0, "--replicas");
  const pid_t backup = find_server(run.pid(), 0, "--role");
  ASSERT_GT(primary, 0);
  ASSERT_GT(backup, 0);
  ::kill(primary, SIGKILL);
  ASSERT_TRUE(run.wait_until(
      [](const shoal::testing::RunResult& r) {
        return r.err.find("serves its shards alone") != std::string::npos;
      },
      30s))
      << run.so_far().err;
  ::kill(backup, SIGKILL);
  const shoal::testing::RunResult result = run.wait(30s);
  EXPECT_EQ(result.exit_code, 128 + SIGKILL) << result.err;
  EXPECT_NE(result.err.find("shoal run: the backup of parameter server 0 was killed by signal 9 "
                            "(SIGKILL); stopping the workers"),
            std::string::npos)
      << result.err;
}

TEST(PsReplicaLaunch, ReplicaAndSnapshotFlagsAreCheckedAtOnce) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--servers", "2", "--ps-replicas", "3", kWorker},
       "shoal run: --ps-replicas: expected 1 or 2 processes per parameter server, got '3'"},
      {{"--ps-replicas", "2", kWorker}, "shoal run: --ps-replicas needs --servers S; add it"},
      {{"--ps-snapshot-dir", "/tmp", kWorker},
       "shoal run: --ps-snapshot-dir needs --servers S; add it"},
      {{"--servers", "1", "--ps-snapshot-dir", "/tmp", "--ps-snapshot-every", "0", kWorker},
       "shoal run: --ps-snapshot-every: expected a number of steps from 1, got '0'"},
  };
  for (const auto& [args, message] : cases) {
    const shoal::testing::RunResult run = shoal::testing::run_shoal(args, 30s);
    EXPECT_EQ(run.exit_code, 2);
    EXPECT_EQ(run.err, message + "\n");
  }
}

// `shoal run --servers 3 --ps-snapshot-dir`: the servers' snapshot of the last step, loaded onto
// 1, 2 or 3 cores, holds what one process holds after it (tests/programs/ps_worker.cpp's
// reference, dumped by worker 0), and the same bits whatever the count it was loaded onto.
TEST(PsSnapshotLaunch, SnapshotsOfThreeServersLoadOntoAnyCountAndEqualOneProcess) {
  const std::string dir = fresh_dir("launch");
  const std::string snapshots = dir + "/snapshots";
  const std::string dump = dir + "/reference.bin";
  const shoal::testing::RunResult run = shoal::testing::run_shoal(
      {"--servers", "3", "--ps-snapshot-dir", snapshots, "--ps-snapshot-every", "2", "-n", "2",
       kWorker, "--steps", "4", "--dump-dense", dump},
      120s);
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;

  // ps_worker.cpp's tables.
  constexpr int64_t kDense = 2 * kChunkElements + 1000;
  TableSpec dense{"w", false, {kDense}, {}, {}, 0};
  dense.optimizer.lr = 0.5;
  dense.optimizer.momentum = 0.9;
  TableSpec sparse{"emb", true, {0, 4}, {}, {}, 11};
  sparse.optimizer.lr = 0.25;
  sparse.init = {InitSpec::Kind::kNormal, 0, 1};

  std::vector<float> reference(kDense);
  {
    std::ifstream in(dump, std::ios::binary);
    in.read(reinterpret_cast<char*>(reference.data()), kDense * sizeof(float));
    ASSERT_EQ(in.gcount(), static_cast<std::streamsize>(kDense * sizeof(float)));
  }
  std::vector<float> first;
  for (int servers : {1, 2, 3}) {
    SCOPED_TRACE(std::to_string(servers) + " servers");
    const ShardMap map(servers);
    std::vector<float> values(kDense, NAN);
    for (int s = 0; s < servers; ++s) {
      const auto snapshot = read_newest_snapshot(snapshots, map.shards_of(s));
      ASSERT_TRUE(snapshot);
      EXPECT_EQ(snapshot->step, 4);
      ServerCoreOptions options;
      options.workers = {0};
      options.shards = map.shards_of(s);
      ServerCore core(options);
      DenseSlice held{0, {}, {}};
      for (int64_t k = 0; k < chunk_count(kDense); ++k) {
        if (map.owner(chunk_shard("w", k)) != s) continue;
        held.chunks.push_back(k);
        held.values.resize(held.values.size() + chunk_length(kDense, k), 0.0f);
      }
      core.register_tables({0, {dense, sparse}, {held}, ""}, Deadline(10s));
      for (const auto& [shard, bytes] : snapshot->shards) core.load_shard(shard, bytes);
      held.values.clear();
      const PullReply pulled = core.pull({0, 0, {held}, {}}, Deadline(10s));
      size_t at = 0;
      for (int64_t k : pulled.dense.at(0).chunks) {
        std::copy_n(pulled.dense[0].values.begin() + static_cast<std::ptrdiff_t>(at),
                    chunk_length(kDense, k), values.begin() + chunk_begin(k));
        at += static_cast<size_t>(chunk_length(kDense, k));
      }
    }
    EXPECT_TRUE(shoal::testing::near_relative(values, reference, 1e-5));
    if (first.empty()) first = values;
    EXPECT_EQ(values, first);
  }
  std::filesystem::remove_all(dir);
}

// Without replicas: a SIGKILLed server is restarted once, reloads the newest snapshot of its
// shards and adopts the workers' clocks; the job finishes, says how many steps the server lost,
// and the values the workers pull right after the restart are the snapshot's (updates since the
// snapshot are lost: they are not the one-process run's).
TEST(PsSnapshotLaunch, AKilledServerIsRestartedFromItsSnapshotAndTheJobSaysWhatWasLost) {
  const std::string dir = fresh_dir("restart");
  const std::string snapshots = dir + "/snapshots";
  const std::string rollback = dir + "/rollback.bin";
  const std::string go = dir + "/go";  // the workers wait for it after pushing step 12
  shoal::testing::ShoalRun run({"--servers", "2", "--ps-snapshot-dir", snapshots,
                                "--ps-snapshot-every", "10", "-n", "2", kWorker, "--steps", "16",
                                "--rollback", rollback, "--wait-after", "12", go});
  const std::string file = snapshots + "/snapshot-000000000010-server-1-of-2.bin";
  ASSERT_TRUE(run.wait_until(
      [&](const shoal::testing::RunResult& r) {
        return has_step(r, 0, 12) && has_step(r, 1, 12) && std::filesystem::exists(file);
      },
      120s))
      << run.so_far().out << run.so_far().err;
  const pid_t server = find_server(run.pid(), 1, "--snapshot-dir");
  ASSERT_GT(server, 0);
  ::kill(server, SIGKILL);
  std::ofstream(go) << "go";
  const shoal::testing::RunResult result = run.wait(120s);
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  EXPECT_NE(result.err.find("shoal run: parameter server 1 was killed by signal 9 (SIGKILL); "
                            "restarting it from its newest snapshot (restart 1 of 1)"),
            std::string::npos)
      << result.err;
  const std::regex lost(
      R"(\[ps 1\] parameter server 1 restarted from step 10; (\d+) steps of its shards lost)");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.err, match, lost)) << result.err;
  // Killed with every worker's push of step 12 applied: steps 10, 11 and 12 are lost, and the
  // restarted server's first step is 13.
  EXPECT_EQ(match[1], "3");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(result.out.find("[" + std::to_string(r) + "] ps rolled back at step "),
              std::string::npos)
        << result.out;
    EXPECT_NE(result.out.find("[" + std::to_string(r) + "] ps ok 2 servers, 16 sync steps"),
              std::string::npos)
        << result.out;
  }

  // Server 1's chunks as pulled after the restart are the step-10 snapshot's, bit for bit.
  constexpr int64_t kDense = 2 * kChunkElements + 1000;
  std::vector<float> pulled(kDense);
  {
    std::ifstream in(rollback, std::ios::binary);
    in.read(reinterpret_cast<char*>(pulled.data()), kDense * sizeof(float));
    ASSERT_EQ(in.gcount(), static_cast<std::streamsize>(kDense * sizeof(float)));
  }
  const ShardMap map(2);
  const auto snapshot = read_newest_snapshot(snapshots, map.shards_of(1));
  ASSERT_TRUE(snapshot);
  ASSERT_EQ(snapshot->step, 10);
  TableSpec dense{"w", false, {kDense}, {}, {}, 0};
  dense.optimizer.lr = 0.5;
  dense.optimizer.momentum = 0.9;
  TableSpec sparse{"emb", true, {0, 4}, {}, {}, 11};
  sparse.optimizer.lr = 0.25;
  sparse.init = {InitSpec::Kind::kNormal, 0, 1};
  ServerCoreOptions options;
  options.workers = {0};
  options.shards = map.shards_of(1);
  ServerCore core(options);
  DenseSlice held{0, {}, {}};
  for (int64_t k = 0; k < chunk_count(kDense); ++k) {
    if (map.owner(chunk_shard("w", k)) != 1) continue;
    held.chunks.push_back(k);
    held.values.resize(held.values.size() + chunk_length(kDense, k), 0.0f);
  }
  ASSERT_FALSE(held.chunks.empty());
  core.register_tables({0, {dense, sparse}, {held}, ""}, Deadline(10s));
  for (const auto& [shard, bytes] : snapshot->shards) core.load_shard(shard, bytes);
  held.values.clear();
  const PullReply loaded = core.pull({0, 0, {held}, {}}, Deadline(10s));
  size_t at = 0;
  for (int64_t k : loaded.dense.at(0).chunks) {
    const std::vector<float> expected(
        loaded.dense[0].values.begin() + static_cast<std::ptrdiff_t>(at),
        loaded.dense[0].values.begin() + static_cast<std::ptrdiff_t>(at + chunk_length(kDense, k)));
    const std::vector<float> got(pulled.begin() + chunk_begin(k),
                                 pulled.begin() + chunk_begin(k) + chunk_length(kDense, k));
    EXPECT_EQ(got, expected) << "chunk " << k;
    at += static_cast<size_t>(chunk_length(kDense, k));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shoal::ps::detail
