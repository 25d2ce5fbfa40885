// shoal::ps::Optimizer and shoal::ps::Embedding (docs/ps.md, "The program"). Real jobs: `shoal run
// --servers S -n 3` of tests/programs/ps_train.cpp, whose worker 0 checks the servers' values
// against one process training the whole batches with torch::optim (each table row its own
// parameter, so that torch keeps a state per row as the servers' lazy rules do). In-process: the
// API's errors, on a job of one without servers.
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <set>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "error_of.h"
#include "shoal/data/loader.h"
#include "shoal/ps/ps.h"
#include "shoal/init.h"
#include "shoal_run.h"
#include "test_paths.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;

const std::string kTrain = test_programs_dir() + "/ps_train";

TEST(PsTrain, SyncOnServersEqualsOneProcessForEveryOptimizer) {
  for (int servers : {1, 2, 3}) {
    for (const std::string kind : {"sgd", "adagrad", "adam"}) {
      const RunResult run =
          run_shoal({"--servers", std::to_string(servers), "-n", "3", kTrain, kind}, 120s);
      EXPECT_EQ(run.exit_code, 0) << servers << " servers, " << kind << "\n" << run.out << run.err;
      EXPECT_NE(run.out.find("[0] ps train ok: " + kind + ", 3 workers, 5 sync steps"),
                std::string::npos)
          << run.out;
    }
  }
}

// The same through shared memory: a branch of 65536 units beside the hidden layer makes 12 dense
// chunks of 64 Ki values or less, of which every server holds some, more than 16 Ki values each, so
// each worker's pushes and pulls cross through a segment per server (docs/ps.md, "Transport"): the
// server takes the pushes' storage and writes the pulls' values into the segment, and the worker
// reads them from there into its parameters (Notes [Taking a push's storage], [Pull replies in
// place], [Pulled values in place]).
TEST(PsTrain, SyncThroughSharedMemoryEqualsOneProcess) {
  ::setenv("PS_TRAIN_WIDE", "65536", 1);
  for (int servers : {1, 3}) {
    for (const std::string kind : {"sgd", "adam"}) {
      const RunResult run =
          run_shoal({"--servers", std::to_string(servers), "-n", "3", kTrain, kind}, 120s);
      EXPECT_EQ(run.exit_code, 0) << servers << " servers, " << kind << "\n" << run.out << run.err;
      EXPECT_NE(run.out.find("[0] ps train ok: " + kind + ", 3 workers, 5 sync steps, " +
                             std::to_string(servers) + " shared segments"),
                std::string::npos)
          << run.out;
    }
  }
  ::unsetenv("PS_TRAIN_WIDE");
}

// SHOAL_TIMELINE with servers (docs/ps.md, "A step's timeline"): each server's track beside its
// workers' in the one file, and in sync every pull a worker made after pushing c steps answered
// only once that server's sum of step c - 1 had ended.
TEST(PsTrain, TheTimelineShowsTheServersBesideTheirWorkers) {
  const std::string trace = (std::filesystem::temp_directory_path() /
                             ("shoal-ps-timeline-" + std::to_string(::getpid()) + ".json"))
                                .string();
  std::filesystem::remove(trace);
  ::setenv("SHOAL_TIMELINE", trace.c_str(), 1);
  const RunResult run = run_shoal({"--servers", "2", "-n", "2", kTrain, "sgd"}, 120s);
  ::unsetenv("SHOAL_TIMELINE");
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  std::ifstream in(trace);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto events = nlohmann::json::parse(text + "]");
  std::map<int64_t, std::string> tracks;  // pid -> "server S" / "worker R"
  const std::regex track(R"((server|worker) (\d+) \(pid \d+ on .+\))");
  for (const auto& e : events) {
    if (e.at("ph") != "M" || e.at("name") != "process_name") continue;
    const std::string name = e.at("args").at("name");
    std::smatch match;
    ASSERT_TRUE(std::regex_match(name, match, track)) << name;
    tracks[e.at("pid")] = match[1].str() + " " + match[2].str();
  }
  std::set<std::string> names;
  for (const auto& [pid, name] : tracks) names.insert(name);
  EXPECT_EQ(names, (std::set<std::string>{"server 0", "server 1", "worker 0", "worker 1"}));
  std::map<std::pair<std::string, int64_t>, int64_t> sum_end;  // (server, step) -> end (us)
  for (const auto& e : events) {
    if (e.at("ph") != "X") continue;
    const std::string name = e.at("name");
    if (name.rfind("sum step ", 0) == 0) {
      sum_end[{tracks[e.at("pid")], e.at("args").at("step").get<int64_t>()}] =
          e.at("ts").get<int64_t>() + e.at("dur").get<int64_t>();
    }
  }
  int checked = 0;
  for (const auto& e : events) {
    if (e.at("ph") != "X") continue;
    const std::string name = e.at("name");
    if (name.rfind("pull from server ", 0) != 0) continue;
    const int64_t clock = e.at("args").at("clock");
    if (clock == 0) continue;  // the first pull: the registration's values
    const std::string server = "server " + name.substr(std::string("pull from server ").size());
    const auto sum = sum_end.find({server, clock - 1});
    ASSERT_NE(sum, sum_end.end()) << server << " has no sum of step " << clock - 1;
    EXPECT_LE(sum->second, e.at("ts").get<int64_t>() + e.at("dur").get<int64_t>())
        << tracks[e.at("pid")] << "'s pull at clock " << clock << " from " << server
        << " answered before the step's sum ended";
    ++checked;
  }
  EXPECT_EQ(checked, 2 * 2 * 5) << "2 workers, 2 servers, a pull after each of 5 sync steps";
  std::filesystem::remove(trace);
}

// Without servers a job of one trains on the servers' rules in-process (docs/ps.md).
TEST(PsTrain, AJobOfOneTrainsWithoutServers) {
  for (const std::string kind : {"sgd", "adagrad", "adam"}) {
    const RunResult run = run_shoal({"-n", "1", kTrain, kind}, 60s);
    EXPECT_EQ(run.exit_code, 0) << kind << "\n" << run.out << run.err;
    EXPECT_NE(run.out.find("ps train ok: " + kind + ", 1 workers"), std::string::npos) << run.out;
  }
}

// A bad SHOAL_PS_MODE is one line however the job runs: a job of one (no servers) refuses it when
// its ps::Optimizer is made, before a step; `shoal run --servers` before it starts any process.
TEST(PsTrain, AnUnknownModeIsTheSameUsageErrorWithAndWithoutServers) {
  const std::string line =
      "SHOAL_PS_MODE=bogus; expected sync, async or ssp:S (bounded staleness of S steps)";
  ::setenv("SHOAL_PS_MODE", "bogus", 1);
  const RunResult alone = run_shoal({"-n", "1", kTrain, "sgd"}, 60s);
  const RunResult served = run_shoal({"--servers", "1", "-n", "2", kTrain, "sgd"}, 60s);
  ::unsetenv("SHOAL_PS_MODE");
  EXPECT_EQ(alone.exit_code, 1) << alone.out << alone.err;
  EXPECT_NE(alone.out.find("error: " + line + "\n"), std::string::npos) << alone.out;
  EXPECT_EQ(alone.out.find("ps train ok"), std::string::npos) << alone.out;
  EXPECT_EQ(served.exit_code, 2) << served.out << served.err;
  EXPECT_EQ(served.err, "shoal run: " + line + "\n");
  EXPECT_EQ(served.out, "");
}

// The oracle can fail: in async each push is applied alone, which is not the one process's step.
TEST(PsTrain, AsyncIsNotTheOneProcessRun) {
  ::setenv("SHOAL_PS_MODE", "async", 1);
  const RunResult run = run_shoal({"--servers", "2", "-n", "3", kTrain, "sgd"}, 120s);
  ::unsetenv("SHOAL_PS_MODE");
  EXPECT_EQ(run.exit_code, 1) << run.out << run.err;
  EXPECT_NE(run.out.find("[0] parameter "), std::string::npos) << run.out;
}

// The mode is the program's option (ps::ServerOptions::mode): the servers, started before any
// worker, take it from the workers' registration (Note [The mode comes with the workers]).
// async from the option is not the one-process run (as AsyncIsNotTheOneProcessRun through
// SHOAL_PS_MODE); SHOAL_PS_MODE=sync overrides the option, and the run is the one-process one
// again; workers that ask for different modes are refused with one line.
TEST(PsTrain, TheModeIsTheProgramsOptionAndTheEnvironmentOverridesIt) {
  ::setenv("PS_TRAIN_OPTION_MODE", "async", 1);
  const RunResult chosen = run_shoal({"--servers", "2", "-n", "3", kTrain, "sgd"}, 120s);
  ::setenv("SHOAL_PS_MODE", "sync", 1);
  const RunResult overridden = run_shoal({"--servers", "2", "-n", "3", kTrain, "sgd"}, 120s);
  ::unsetenv("SHOAL_PS_MODE");
  ::setenv("PS_TRAIN_OPTION_MODE", "sync,async", 1);
  const RunResult mixed = run_shoal({"--servers", "1", "-n", "2", kTrain, "sgd"}, 120s);
  ::unsetenv("PS_TRAIN_OPTION_MODE");
  EXPECT_EQ(chosen.exit_code, 1) << chosen.out << chosen.err;
  EXPECT_NE(chosen.out.find("[0] parameter "), std::string::npos) << chosen.out;
  EXPECT_EQ(overridden.exit_code, 0) << overridden.out << overridden.err;
  EXPECT_NE(overridden.out.find("ps train ok: sgd, 3 workers"), std::string::npos) << overridden.out;
  // Whichever worker registers first sets the mode; the other is refused (its line names the
  // server and the call, then the server's sentence).
  EXPECT_EQ(mixed.exit_code, 1) << mixed.out << mixed.err;
  const bool one_refused =
      mixed.out.find("parameter server: worker 1 trains in mode async, worker 0 in sync; "
                     "expected one mode for the whole job (ps::ServerOptions::mode, or "
                     "SHOAL_PS_MODE)\n") != std::string::npos ||
      mixed.out.find("parameter server: worker 0 trains in mode sync, worker 1 in async; "
                     "expected one mode for the whole job (ps::ServerOptions::mode, or "
                     "SHOAL_PS_MODE)\n") != std::string::npos;
  EXPECT_TRUE(one_refused) << mixed.out;
  EXPECT_EQ(mixed.out.find("ps train ok"), std::string::npos) << mixed.out;
}

// ps::Optimizer::train_on (docs/ps.md, "Leased batches"): three workers (one slowed) lease the
// batches of two epochs of 50 samples from the servers' ledger; worker 0 checks that every sample
// was trained once per epoch, in every mode, and in sync that the servers' values equal one
// process training each step's leased batches together (the last step's short batch weighs its
// rows; workers without a batch take idle steps).
TEST(PsTrain, LeasedBatchesTrainEverySampleOncePerEpochInEveryMode) {
  for (const std::string mode : {"sync", "async", "ssp:1"}) {
    const std::string dir =
        ::testing::TempDir() + "ps_leased_" + std::to_string(::getpid()) + "_" + mode.substr(0, 3);
    std::filesystem::create_directories(dir);
    ::setenv("SHOAL_PS_MODE", mode.c_str(), 1);
    const RunResult run =
        run_shoal({"--servers", "2", "-n", "3", kTrain, "leased", "2", dir}, 120s);
    ::unsetenv("SHOAL_PS_MODE");
    std::filesystem::remove_all(dir);
    EXPECT_EQ(run.exit_code, 0) << mode << "\n" << run.out << run.err;
    EXPECT_NE(run.out.find("[0] ps leased ok: " + mode + ", 3 workers, 2 epochs of 50 samples"),
              std::string::npos)
        << run.out;
  }
}

// The logs of an elastic run (tests/programs/ps_train.cpp, `elastic`): per worker process (its
// pid), the steps it confirmed, and whether it is inside a step (its last line begins one).
struct WorkerLog {
  int confirmed = 0;
  bool in_step = false;
};
std::map<std::string, WorkerLog> worker_logs(const std::string& dir) {
  std::map<std::string, WorkerLog> logs;
  for (const auto& file : std::filesystem::directory_iterator(dir)) {
    const std::string name = file.path().filename().string();
    if (name.rfind("log-", 0) != 0) continue;
    std::ifstream in(file.path());
    WorkerLog& log = logs[name.substr(4)];
    for (std::string line; std::getline(in, line);) {
      log.confirmed += line.rfind("c ", 0) == 0 ? 1 : 0;
      log.in_step = line.rfind("t ", 0) == 0;
    }
  }
  return logs;
}

// A fresh directory for a run's logs.
std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Checks the logs and values of a run in `dir` (ps_train elastic-check) and expects it to have
// had `workers` worker processes; returns the check's report.
std::string check_logs(const std::string& dir, const std::string& mode, int workers) {
  const RunResult check = run_shoal({"-n", "1", kTrain, "elastic-check", dir, mode}, 60s);
  EXPECT_EQ(check.exit_code, 0) << check.out << check.err;
  EXPECT_NE(check.out.find("ps elastic ok: " + mode + ", " + std::to_string(workers) + " workers"),
            std::string::npos)
      << check.out;
  std::cout << check.out;
  return check.out;
}

// docs/ps.md, "Elastic workers": `shoal run --servers 2 --min 1 --max 3 -n 3 --max-restarts 1`
// of workers leasing their batches. Once all three trained, one is SIGKILLed; the launcher makes
// it leave the servers and starts it again under a new id, which joins mid-epoch; once that one
// trained, another is SIGTERMed, and joins again likewise. Then the workers finish their epoch
// and stop. The logs show every epoch trained each sample exactly once in the steps that count
// (a dead worker's last step counts unless its batch was leased again), in every mode; in sync
// the servers' values also equal one process trained on the counted batches step by step, so a
// dead worker's gradient counted, or was dropped, together with its samples on both servers.
TEST(PsTrain, WorkersKilledAndJoinedMidEpochTrainEverySampleOnceInEveryMode) {
  for (const std::string mode : {"sync", "async", "ssp:1"}) {
    SCOPED_TRACE(mode);
    const std::string dir = fresh_dir("ps_elastic_" + mode.substr(0, 3));
    ::setenv("SHOAL_PS_MODE", mode.c_str(), 1);
    ShoalRun run({"--servers", "2", "--min", "1", "--max", "3", "-n", "3", "--max-restarts", "1",
                  kTrain, "elastic", dir});
    ::unsetenv("SHOAL_PS_MODE");
    // Waits until `count` worker processes have confirmed at least two steps each; returns them.
    auto trained = [&](size_t count) {
      std::vector<std::string> pids;
      const bool ready = run.wait_until(
          [&](const RunResult&) {
            pids.clear();
            for (const auto& [pid, log] : worker_logs(dir))
              if (log.confirmed >= 2) pids.push_back(pid);
            return pids.size() >= count;
          },
          120s);
      EXPECT_TRUE(ready) << "fewer than " << count << " workers trained two steps\n"
                         << run.so_far().out << run.so_far().err;
      return pids;
    };
    // Signals `pid` once it is inside a step with a batch (between its "t" and "c" lines).
    auto kill_in_step = [&](const std::string& pid, int signal) {
      EXPECT_TRUE(run.wait_until(
          [&](const RunResult&) { return worker_logs(dir)[pid].in_step; }, 60s))
          << "worker " << pid << " took no step";
      ::kill(std::stoi(pid), signal);
    };
    const auto first = trained(3);
    if (first.size() < 3) continue;
    kill_in_step(first[0], SIGKILL);
    if (trained(4).size() < 4) continue;  // its replacement joined and trained
    kill_in_step(first[1], SIGTERM);
    if (trained(5).size() < 5) continue;
    std::ofstream(dir + "/stop") << "stop\n";
    const RunResult result = run.wait(120s);
    EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
    EXPECT_NE(result.err.find(" was killed by signal 9 (SIGKILL); restarting it in "),
              std::string::npos)
        << result.err;
    check_logs(dir, mode, 5);
    std::filesystem::remove_all(dir);
  }
}

// docs/ps.md, "Elastic workers": a second launcher joins a running elastic job (`shoal run
// --servers 2 --join HOST:PORT -n 1`, the address the job's first launcher printed). Its worker
// joins the servers mid-epoch and trains; a launcher asking for more room than --max leaves, or
// naming other servers, is refused. The joined launcher is SIGKILLed: once it has been silent for
// 10 s the job's first launcher makes its worker leave the servers and frees its room, which a
// third launcher then takes. Once stopped, the launchers exit 0 and every sample was trained once
// per epoch, the servers' values equal to one process on the counted batches.
TEST(PsTrain, ALauncherJoinsARunningElasticJobMidEpoch) {
  const std::string dir = fresh_dir("ps_join");
  ShoalRun first(
      {"--servers", "2", "--min", "1", "--max", "3", "-n", "2", kTrain, "elastic", dir});
  std::string address;
  ASSERT_TRUE(first.wait_until(
      [&](const RunResult& r) {
        std::smatch m;
        if (!std::regex_search(r.err, m, std::regex("--join ([0-9.]+:[0-9]+) \\[-n K\\] PROGRAM")))
          return false;
        address = m[1].str();
        return true;
      },
      60s))
      << first.so_far().err;
  auto trained = [&](ShoalRun& run, size_t count) {
    return run.wait_until(
        [&](const RunResult&) {
          size_t n = 0;
          for (const auto& [pid, log] : worker_logs(dir)) n += log.confirmed >= 2 ? 1 : 0;
          return n >= count;
        },
        120s);
  };
  ASSERT_TRUE(trained(first, 2)) << first.so_far().err;
  ShoalRun joiner({"--servers", "2", "--join", address, "-n", "1", kTrain, "elastic", dir});
  ASSERT_TRUE(trained(joiner, 3)) << joiner.so_far().out << joiner.so_far().err;
  const RunResult full =
      run_shoal({"--servers", "2", "--join", address, "-n", "1", kTrain, "elastic", dir}, 60s);
  EXPECT_EQ(full.exit_code, 2);
  EXPECT_EQ(full.err, "shoal run: the job at " + address +
                          " runs its --max 3 workers; no room for 1 more\n");
  const RunResult other =
      run_shoal({"--servers", "1", "--join", address, "-n", "1", kTrain, "elastic", dir}, 60s);
  EXPECT_EQ(other.exit_code, 2);
  EXPECT_EQ(other.err, "shoal run: --servers 1, but the job at " + address +
                           " runs with --servers 2; expected the same\n");
  // The joined launcher dies with its worker: once silent for 10 s, its worker leaves the
  // servers and its room is free again.
  ::kill(joiner.pid(), SIGKILL);
  EXPECT_EQ(joiner.wait(30s).exit_code, 128 + SIGKILL);
  EXPECT_TRUE(first.wait_until(
      [](const RunResult& r) {
        return r.err.find("shoal run: a launcher that joined the job went silent for 10.00 s; "
                          "its workers (") != std::string::npos;
      },
      60s))
      << first.so_far().err;
  ShoalRun again({"--servers", "2", "--join", address, "-n", "1", kTrain, "elastic", dir});
  ASSERT_TRUE(trained(again, 4)) << again.so_far().out << again.so_far().err;
  std::ofstream(dir + "/stop") << "stop\n";
  const RunResult joined = again.wait(120s);
  const RunResult result = first.wait(120s);
  EXPECT_EQ(joined.exit_code, 0) << joined.out << joined.err;
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  check_logs(dir, "sync", 4);
  std::filesystem::remove_all(dir);
}

// Backup workers (shoal run --ps-backup-workers 1: each sync step applies the first two of three
// workers' pushes) on two servers. Worker 1, slowed, mostly comes late; server 0's answer decides
// on both servers (Note [Server 0 decides] in src/ps/server_steps.cpp), and a late push's batch
// goes back into the epoch. Every sample is trained once per epoch in the steps that count (each
// batch's last), and the servers' values equal one process trained on those batches step by step,
// which fails if one server applied a push the other dropped.
TEST(PsTrain, BackupWorkersDropLatePushesOnEveryServerAndLoseNoSample) {
  const std::string dir = fresh_dir("ps_backup");
  const RunResult run = run_shoal(
      {"--servers", "2", "-n", "3", "--ps-backup-workers", "1", kTrain, "backup", dir}, 180s);
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  const std::string report = check_logs(dir, "sync", 3);
  EXPECT_NE(report.find(", 3 epochs of 50 samples"), std::string::npos) << report;
  std::smatch dropped;
  ASSERT_TRUE(std::regex_search(report, dropped, std::regex(", (\\d+) dropped"))) << report;
  EXPECT_GT(std::stoi(dropped[1].str()), 0) << "no push came late: " << report;
  std::filesystem::remove_all(dir);
}

TEST(PsTrain, WorkersWithoutServersAreAUsageError) {
  const RunResult run = run_shoal({"-n", "2", kTrain, "sgd"}, 60s);
  EXPECT_EQ(run.exit_code, 1) << run.out << run.err;
  EXPECT_NE(run.out.find("error: shoal::ps::Optimizer: this job's 2 workers have no parameter "
                         "servers (SHOAL_PS_SERVERS is not set); expected a job started with "
                         "shoal run --servers S"),
            std::string::npos)
      << run.out;
}

// docs/ps.md, "Gradient noise": 2 and 3 workers measure the gradient noise through 1 and 3
// servers; at every step each worker's measurement equals the one-process estimate of all the
// workers' samples, and over 300 steps the closed form (tests/noise_problem.h; the checks are
// tests/programs/ps_train.cpp's, mode noise).
TEST(PsTrain, TheGradientNoiseMeasuredThroughTheServersEqualsItsOracles) {
  for (int servers : {1, 3}) {
    for (int workers : {2, 3}) {
      const RunResult run = run_shoal({"--servers", std::to_string(servers), "-n",
                                       std::to_string(workers), kTrain, "noise", "300"},
                                      120s);
      EXPECT_EQ(run.exit_code, 0) << servers << " servers\n" << run.out << run.err;
      EXPECT_NE(run.out.find("ps noise ok: " + std::to_string(workers) + " workers"),
                std::string::npos)
          << servers << " servers\n" << run.out;
    }
  }
}

struct TwoTables : torch::nn::Module {
  TwoTables() {
    bounded = register_module("bounded", ps::Embedding(10, 3));
    hashed = register_module("hashed", ps::Embedding(0, 2));
    linear = register_module("linear", torch::nn::Linear(3, 1));
  }
  ps::Embedding bounded{nullptr}, hashed{nullptr};
  torch::nn::Linear linear{nullptr};
};

TEST(PsClient, MisuseIsAUsageErrorSayingWhatWasExpected) {
  auto model = std::make_shared<TwoTables>();
  EXPECT_EQ(error_of([&] { ps::Optimizer again(*model, torch::optim::SGDOptions(0.1)); }),
            "shoal::ps::Optimizer before shoal::init(); expected shoal::init() first, as for "
            "DataParallel");
  EXPECT_EQ(error_of([&] { model->bounded->forward(torch::tensor({1})); }),
            "ps::Embedding: forward before a shoal::ps::Optimizer took the model (or after it was "
            "destroyed); expected the optimizer made first, as its rows live on the servers");
  EXPECT_EQ(
      error_of([] { ps::Embedding table(-1, 3); }),
      "ps::Embedding(-1, 3); expected num_embeddings >= 0 (0: any id) and embedding_dim >= 1");

  shoal::init();
  {
    ps::Optimizer optimizer(*model, torch::optim::AdagradOptions(0.1));
    EXPECT_EQ(error_of([&] {
                model->bounded->forward(torch::tensor({3, 10}));
              }),
              "ps::Embedding 'bounded': id 10 is out of range; expected 0 <= id < 10");
    EXPECT_EQ(error_of([&] {
                model->hashed->forward(torch::tensor(std::vector<int64_t>{-4, int64_t{1} << 40}));
              }),
              "ps::Embedding 'hashed': id -4 is out of range; expected 0 <= id");
    EXPECT_EQ(error_of([&] { model->bounded->forward(torch::tensor({1.5})); }),
              "ps::Embedding 'bounded': ids are float; expected an integer tensor");
    EXPECT_EQ(error_of([&] { ps::Optimizer again(*model, torch::optim::SGDOptions(0.1)); }),
              "shoal::ps::Optimizer: ps::Embedding 'bounded' already belongs to another "
              "shoal::ps::Optimizer; expected one per model");
    // Hashed ids of any size are rows like any other; a forward of no ids is empty.
    EXPECT_EQ(model->hashed
                  ->forward(torch::tensor(std::vector<int64_t>{7, int64_t{1} << 40}).view({1, 2}))
                  .sizes(),
              (std::vector<int64_t>{1, 2, 2}));
    EXPECT_EQ(model->hashed->forward(torch::empty({0}, torch::kLong)).sizes(),
              (std::vector<int64_t>{0, 2}));

    // Leased batches (a job of one leases from its in-process core).
    data::LoaderOptions options;
    options.batch_size = 4;
    auto loader = data::make_loader(
        torch::data::datasets::TensorDataset(torch::arange(10).view({10, 1})), options);
    optimizer.train_on(loader);
    EXPECT_EQ(error_of([&] { optimizer.train_on(loader); }),
              "shoal::ps::Optimizer::train_on: called twice; expected one loader per optimizer "
              "(the servers keep one ledger of batches)");
    auto epoch = loader.epoch(0);
    auto batch = epoch.begin();
    EXPECT_EQ(batch->data.size(0), 4);
    EXPECT_EQ(error_of([&] { ++batch; }),
              "shoal::ps::Optimizer::train_on: the loader handed out batch 0 of epoch 0 and no "
              "step() pushed its gradient; expected one step() per batch");
  }
  EXPECT_EQ(error_of([&] { model->bounded->forward(torch::tensor({1})); }),
            "ps::Embedding: forward before a shoal::ps::Optimizer took the model (or after it was "
            "destroyed); expected the optimizer made first, as its rows live on the servers");
  // The gradient noise (docs/ps.md, "Gradient noise"): sync only, in samples; a job of one
  // measures nothing.
  {
    auto linear = std::make_shared<torch::nn::LinearImpl>(3, 1);
    ps::ServerOptions noise;
    noise.measure_gradient_noise = true;
    noise.mode = "ssp:2";
    EXPECT_EQ(error_of([&] { ps::Optimizer o(*linear, torch::optim::SGDOptions(0.1), noise); }),
              "shoal::ps::Optimizer: measure_gradient_noise in mode ssp:2; expected sync, whose "
              "steps average every worker's gradient");
    noise.mode = "sync";
    noise.gradient_noise_smoothing = 1.0;
    EXPECT_EQ(error_of([&] { ps::Optimizer o(*linear, torch::optim::SGDOptions(0.1), noise); }),
              "shoal::ps::Optimizer: gradient_noise_smoothing is 1; expected a number in [0, 1)");
    noise.gradient_noise_smoothing = 0.9;
    ps::Optimizer optimizer(*linear, torch::optim::SGDOptions(0.1), noise);
    linear->forward(torch::ones({2, 3})).sum().backward();
    EXPECT_EQ(error_of([&] { optimizer.step(); }),
              "shoal::ps::Optimizer: measure_gradient_noise needs each worker's batch in samples; "
              "expected ServerOptions::batch_size > 0, or train_on(loader), whose leases carry it");
    noise.batch_size = 2;
    auto other = std::make_shared<torch::nn::LinearImpl>(3, 1);
    ps::Optimizer measured(*other, torch::optim::SGDOptions(0.1), noise);
    for (int step = 0; step < 3; ++step) {
      measured.zero_grad();
      other->forward(torch::ones({2, 3})).sum().backward();
      measured.step();
    }
    ASSERT_TRUE(measured.gradient_noise().has_value());
    EXPECT_EQ(measured.gradient_noise()->measurements, 0);
    EXPECT_FALSE(ps::Optimizer(*std::make_shared<torch::nn::LinearImpl>(3, 1),
                               torch::optim::SGDOptions(0.1))
                     .gradient_noise()
                     .has_value());
  }
  auto doubles = std::make_shared<torch::nn::LinearImpl>(2, 2);
  doubles->to(torch::kDouble);
  EXPECT_EQ(error_of([&] { ps::Optimizer optimizer(*doubles, torch::optim::SGDOptions(0.1)); }),
            "shoal::ps::Optimizer: parameter 'weight' is double on cpu; expected contiguous "
            "float32 on the CPU");
  shoal::shutdown();
}

}  // namespace
}  // namespace shoal::testing
