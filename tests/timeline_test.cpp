// SHOAL_TIMELINE: real workers write one Chrome trace, which is read back and checked against
// what the workers did (every operation with its bytes, one named track per worker, slices that
// nest on each thread), and the file's life: a stale file replaced, the cap, an unwritable path.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "harness.h"
#include "shoal/core/timeline.h"
#include "shoal/shoal.h"

namespace {

using json = nlohmann::json;
using shoal::testing::Launcher;
using shoal::testing::run_workers;
using shoal::testing::WorkersOptions;
namespace timeline = shoal::timeline;

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("shoal-timeline-" + std::to_string(getpid()) + "-" + name))
      .string();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The file's events, after closing its array as a viewer does. The first is the header.
std::vector<json> read_trace(const std::string& path) {
  const std::string text = read_text(path);
  EXPECT_EQ(text.rfind("[\n", 0), 0u) << "a trace starts with an array: " << text.substr(0, 80);
  json parsed = json::parse(text + "]");  // throws on invalid JSON
  EXPECT_TRUE(parsed.is_array());
  EXPECT_GE(parsed.size(), 1u);
  const json& header = parsed.at(0);
  EXPECT_EQ(header.at("name"), "shoal_timeline");
  EXPECT_EQ(header.at("ph"), "M");
  return parsed.get<std::vector<json>>();
}

std::string header_job(const std::vector<json>& events) {
  return events.at(0).at("args").at("job").get<std::string>();
}

// pid -> rank, from the process_name metadata ("worker R (pid P on HOST)"), checking the name.
std::map<int64_t, int> workers_of(const std::vector<json>& events) {
  std::map<int64_t, int> ranks;
  const std::regex name_pattern(R"(worker (\d+) \(pid (\d+) on .+\))");
  for (const json& e : events) {
    if (e.at("ph") != "M" || e.at("name") != "process_name") continue;
    const std::string name = e.at("args").at("name");
    std::smatch match;
    EXPECT_TRUE(std::regex_match(name, match, name_pattern)) << name;
    if (match.empty()) continue;
    const int64_t pid = e.at("pid");
    EXPECT_EQ(std::stoll(match[2]), pid) << name;
    const int rank = std::stoi(match[1]);
    auto [it, inserted] = ranks.emplace(pid, rank);
    EXPECT_EQ(it->second, rank) << "process " << pid << " named with two ranks";
  }
  return ranks;
}

// Complete events ('X') of one process, by thread.
std::map<int64_t, std::vector<json>> slices_by_thread(const std::vector<json>& events,
                                                      int64_t pid) {
  std::map<int64_t, std::vector<json>> threads;
  for (const json& e : events) {
    if (e.at("ph") == "X" && e.at("pid") == pid) threads[e.at("tid")].push_back(e);
  }
  return threads;
}

// On each thread, slices must nest or follow one another, with no negative duration.
void expect_well_formed(const std::vector<json>& events, int64_t pid) {
  for (auto& [tid, slices] : slices_by_thread(events, pid)) {
    std::sort(slices.begin(), slices.end(), [](const json& a, const json& b) {
      const double ta = a.at("ts"), tb = b.at("ts");
      const double da = a.at("dur"), db = b.at("dur");
      return ta != tb ? ta < tb : da > db;  // at one start, the enclosing slice first
    });
    std::vector<double> open_ends;  // ends of the enclosing slices
    for (const json& s : slices) {
      const double start = s.at("ts"), duration = s.at("dur");
      EXPECT_GE(duration, 0.0) << s.dump();
      const double end = start + duration;
      while (!open_ends.empty() && open_ends.back() <= start) open_ends.pop_back();
      if (!open_ends.empty()) {
        EXPECT_LE(end, open_ends.back() + 1e-3)
            << "on thread " << tid << " of process " << pid << ", " << s.dump()
            << " overlaps the end of the slice it starts in";
      }
      open_ends.push_back(end);
    }
  }
}

// (name, bytes, group size) of every "comm" slice of a process, counted.
using Op = std::tuple<std::string, int64_t, int64_t>;
std::map<Op, int> comm_ops(const std::vector<json>& events, int64_t pid) {
  std::map<Op, int> ops;
  for (const json& e : events) {
    if (e.at("ph") != "X" || e.at("pid") != pid || e.at("cat") != "comm") continue;
    ops[Op{e.at("name"), e.at("args").at("bytes"), e.at("args").at("group")}] += 1;
  }
  return ops;
}

int count_named(const std::vector<json>& events, int64_t pid, const std::string& name) {
  int count = 0;
  for (const json& e : events) {
    if (e.at("ph") == "X" && e.at("pid") == pid && e.at("name") == name) ++count;
  }
  return count;
}

constexpr int kSteps = 2;

// The operations every worker of kWorkers runs, with the bytes each records.
void run_operations() {
  auto& world = shoal::world();
  const int rank = world.rank(), n = world.size();
  auto sum = torch::full({1000}, rank + 1.0f);  // 4000 bytes
  world.all_reduce(sum);
  EXPECT_EQ(sum[0].item<float>(), n * (n + 1) / 2.0f);
  auto root = torch::full({10}, rank, torch::kDouble);  // 80 bytes
  world.broadcast(root, {1});
  EXPECT_EQ(root[0].item<double>(), 1.0);
  auto rows = world.all_gather(torch::full({3}, static_cast<float>(rank)));  // 12 bytes
  EXPECT_EQ(rows.size(0), 3 * n);
  auto part = world.reduce_scatter(torch::ones({2 * n}));  // 8n bytes
  EXPECT_EQ(part[0].item<float>(), n);
  // Point to point: 0 sends 100 bytes to 1; the last worker sends 56 bytes to 0.
  if (rank == 0) world.send(torch::ones({25}), 1);
  if (rank == 1) {
    auto in = torch::zeros({25});
    world.recv(in, 0);
    EXPECT_EQ(in.sum().item<float>(), 25.0f);
  }
  if (rank == n - 1) world.send(torch::arange(7), 0);
  if (rank == 0) {
    auto in = torch::zeros({7}, torch::kLong);
    world.recv(in, n - 1);
    EXPECT_EQ(in.sum().item<int64_t>(), 21);
  }
  world.barrier();

  // A DataParallel step loop: 15 parameters, one bucket of 60 bytes.
  torch::manual_seed(rank);
  auto net = torch::nn::Linear(4, 3);
  shoal::DataParallel model(net.ptr());
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  for (int step = 0; step < kSteps; ++step) {
    timeline::Slice slice("step " + std::to_string(step), "train", {{"step", step}});
    optimizer.zero_grad();
    {
      timeline::Slice forward("forward", "train");
      auto loss = net->forward(torch::randn({2, 4})).pow(2).mean();
      timeline::Slice backward("backward", "train");
      loss.backward();
    }
    optimizer.step();
  }
}

// The comm slices run_operations leaves on worker `rank` of `n` (at least these).
std::map<Op, int> expected_ops(int rank, int n) {
  std::map<Op, int> ops{{Op{"all_reduce", 4000, n}, 1}, {Op{"broadcast", 80, n}, 1},
                        {Op{"all_gather", 12, n}, 1},   {Op{"reduce_scatter", 8 * n, n}, 1},
                        {Op{"barrier", 0, n}, 1},       {Op{"all_reduce", 60, n}, kSteps}};
  if (rank == 0) ops[Op{"send", 100, n}] += 1;
  if (rank == 1) ops[Op{"recv", 100, n}] += 1;
  if (rank == n - 1) ops[Op{"send", 56, n}] += 1;
  if (rank == 0) ops[Op{"recv", 56, n}] += 1;
  return ops;
}

void check_worker_trace(const std::vector<json>& events, int64_t pid, int rank, int n) {
  SCOPED_TRACE("worker " + std::to_string(rank));
  const auto ops = comm_ops(events, pid);
  for (const auto& [op, count] : expected_ops(rank, n)) {
    auto found = ops.find(op);
    EXPECT_GE(found == ops.end() ? 0 : found->second, count)
        << std::get<0>(op) << " of " << std::get<1>(op) << " bytes on a group of "
        << std::get<2>(op);
  }
  // Point-to-point slices name the peer.
  for (const json& e : events) {
    if (e.at("ph") == "X" && e.at("pid") == pid &&
        (e.at("name") == "send" || e.at("name") == "recv")) {
      EXPECT_TRUE(e.at("args").contains("peer")) << e.dump();
    }
  }
  EXPECT_EQ(count_named(events, pid, "bucket 0"), kSteps);
  for (int step = 0; step < kSteps; ++step)
    EXPECT_EQ(count_named(events, pid, "step " + std::to_string(step)), 1);
  // The program's slices are on the main thread (tid = pid), named "main".
  const auto threads = slices_by_thread(events, pid);
  ASSERT_TRUE(threads.count(pid));
  EXPECT_EQ(count_named(threads.at(pid), pid, "forward"), kSteps);
  bool main_named = false;
  for (const json& e : events) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name" && e.at("pid") == pid &&
        e.at("tid") == pid)
      main_named = e.at("args").at("name") == "main";
  }
  EXPECT_TRUE(main_named);
  expect_well_formed(events, pid);
}

class Workers : public ::testing::TestWithParam<int> {};

TEST_P(Workers, OneTrackPerWorkerWithEveryOperation) {
  const int n = GetParam();
  const std::string path = temp_path("workers" + std::to_string(n) + ".json");
  std::filesystem::remove(path);
  WorkersOptions options;
  options.env["SHOAL_TIMELINE"] = path;
  run_workers(
      n,
      [] {
        EXPECT_TRUE(timeline::enabled());
        run_operations();
      },
      options);
  if (shoal::testing::is_worker()) return;

  const auto events = read_trace(path);
  EXPECT_EQ(header_job(events), "shoal run test" + std::to_string(getpid()) + "-0");
  const auto workers = workers_of(events);
  ASSERT_EQ(workers.size(), static_cast<size_t>(n));
  std::set<int> ranks;
  for (const auto& [pid, rank] : workers) {
    ranks.insert(rank);
    check_worker_trace(events, pid, rank, n);
  }
  EXPECT_EQ(ranks.size(), static_cast<size_t>(n));
  // Every event belongs to a worker's track (the header aside).
  for (size_t i = 1; i < events.size(); ++i)
    EXPECT_TRUE(workers.count(events[i].at("pid"))) << events[i].dump();
  std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Timeline, Workers, ::testing::Values(2, 3));

// Boxing a global tensor is a slice naming the change, around the collective it needs.
TEST(Timeline, Boxing) {
  const std::string path = temp_path("boxing.json");
  std::filesystem::remove(path);
  WorkersOptions options;
  options.env["SHOAL_TIMELINE"] = path;
  run_workers(
      2,
      [] {
        namespace g = shoal::global;
        auto x = g::randn({4, 3}, g::Placement::all(), g::split(0));
        auto whole = x.to_global(g::broadcast());
        EXPECT_EQ(whole.to_local().size(0), 4);
      },
      options);
  if (shoal::testing::is_worker()) return;
  const auto events = read_trace(path);
  const auto workers = workers_of(events);
  ASSERT_EQ(workers.size(), 2u);
  for (const auto& [pid, rank] : workers) {
    SCOPED_TRACE("worker " + std::to_string(rank));
    // Each worker's piece is 2 rows of 3 floats; the slice encloses the all-gather.
    const json* boxing = nullptr;
    const json* gather = nullptr;
    for (const json& e : events) {
      if (e.at("ph") != "X" || e.at("pid") != pid) continue;
      if (e.at("name") == "boxing split(0) -> broadcast") boxing = &e;
      if (e.at("name") == "all_gather" && e.at("args").at("bytes") == 24) gather = &e;
    }
    ASSERT_NE(boxing, nullptr);
    ASSERT_NE(gather, nullptr);
    EXPECT_EQ(boxing->at("cat"), "boxing");
    EXPECT_EQ(boxing->at("args").at("bytes"), 24);
    const double start = boxing->at("ts"), end = start + boxing->at("dur").get<double>();
    EXPECT_LE(start, gather->at("ts").get<double>());
    EXPECT_GE(end + 1e-3, gather->at("ts").get<double>() + gather->at("dur").get<double>());
  }
  std::filesystem::remove(path);
}

// A file from an earlier run (another job's header, or none) is replaced, not appended to.
TEST(Timeline, StaleFileIsReplaced) {
  const std::string path = temp_path("stale.json");
  if (!shoal::testing::is_worker()) {
    std::ofstream stale(path);
    stale << "[\n{\"name\":\"shoal_timeline\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{\"job\":"
             "\"shoal run earlier\"}}\n"
             ",{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":7,\"tid\":7,\"args\":{\"name\":"
             "\"worker 0 (pid 7 on elsewhere)\"}}\n"
             ",{\"name\":\"all_reduce\",\"cat\":\"comm\",\"ph\":\"X\",\"ts\":1,\"dur\":1,\"pid\":7,"
             "\"tid\":7,\"args\":{\"bytes\":4,\"group\":2}}\n";
  }
  WorkersOptions options;
  options.env["SHOAL_TIMELINE"] = path;
  auto body = [] {
    auto t = torch::ones({3});
    shoal::world().all_reduce(t);
  };
  run_workers(2, body, options);  // replaces the stale file
  run_workers(2, body, options);  // another run: replaces the first's
  if (shoal::testing::is_worker()) return;

  const auto events = read_trace(path);
  EXPECT_EQ(header_job(events), "shoal run test" + std::to_string(getpid()) + "-1");
  const auto workers = workers_of(events);
  ASSERT_EQ(workers.size(), 2u);
  for (const auto& [pid, rank] : workers) {
    EXPECT_NE(pid, 7);
    EXPECT_EQ((comm_ops(events, pid)[Op{"all_reduce", 12, 2}]), 1) << "worker " << rank;
  }
  std::filesystem::remove(path);
}

// With no launcher's job id (torchrun's variables alone), the workers agree on one name and
// share the file.
TEST(Timeline, UnnamedJobSharesOneFile) {
  const std::string path = temp_path("unnamed.json");
  std::filesystem::remove(path);
  WorkersOptions options;
  options.launcher = Launcher::kTorchrun;
  options.env["SHOAL_TIMELINE"] = path;
  run_workers(
      2,
      [] {
        auto t = torch::ones({5});
        shoal::world().all_reduce(t);
      },
      options);
  if (shoal::testing::is_worker()) return;
  const auto events = read_trace(path);
  EXPECT_EQ(header_job(events).rfind("unnamed job ", 0), 0u) << header_job(events);
  const auto workers = workers_of(events);
  ASSERT_EQ(workers.size(), 2u);
  for (const auto& [pid, rank] : workers)
    EXPECT_EQ((comm_ops(events, pid)[Op{"all_reduce", 20, 2}]), 1) << "worker " << rank;
  std::filesystem::remove(path);
}

// A job of one writes its track too; a second run of it replaces the first.
TEST(Timeline, JobOfOne) {
  const std::string path = temp_path("one.json");
  std::filesystem::remove(path);
  WorkersOptions options;
  options.launcher = Launcher::kNone;
  options.env["SHOAL_TIMELINE"] = path;
  auto body = [] {
    auto t = torch::ones({4});
    shoal::world().all_reduce(t);
    timeline::Slice("alone", "train");
  };
  run_workers(1, body, options);
  run_workers(1, body, options);
  if (shoal::testing::is_worker()) return;
  const auto events = read_trace(path);
  const auto workers = workers_of(events);
  ASSERT_EQ(workers.size(), 1u);
  const int64_t pid = workers.begin()->first;
  EXPECT_EQ(workers.begin()->second, 0);
  EXPECT_EQ((comm_ops(events, pid)[Op{"all_reduce", 16, 1}]), 1);
  EXPECT_EQ(count_named(events, pid, "alone"), 1);
  std::filesystem::remove(path);
}

// Files in `directory` that hold a timeline (other tests may write files there meanwhile).
std::set<std::string> traces_in(const std::filesystem::path& directory) {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path());
    std::string start(32, '\0');
    in.read(start.data(), static_cast<std::streamsize>(start.size()));
    if (start.find("shoal_timeline") != std::string::npos)
      names.insert(entry.path().filename().string());
  }
  return names;
}

// Unset or empty: nothing is recorded and no file is written (the workers run in this
// process's directory, where a default name would land).
TEST(Timeline, OffRecordsNothing) {
  const auto before = shoal::testing::is_worker() ? std::set<std::string>{}
                                                  : traces_in(std::filesystem::current_path());
  WorkersOptions options;
  auto body = [] {
    EXPECT_FALSE(timeline::enabled());
    timeline::Slice("nothing", "train");
    auto t = torch::ones({4});
    shoal::world().all_reduce(t);
    timeline::flush();
  };
  run_workers(2, body, options);
  options.env["SHOAL_TIMELINE"] = "";
  run_workers(2, body, options);
  if (shoal::testing::is_worker()) return;
  EXPECT_EQ(traces_in(std::filesystem::current_path()), before);
}

// At the cap, later events are dropped and the file says how many.
TEST(Timeline, CapDropsLaterEvents) {
  const std::string path = temp_path("cap.json");
  std::filesystem::remove(path);
  WorkersOptions options;
  options.launcher = Launcher::kNone;
  options.env["SHOAL_TIMELINE"] = path;
  options.env["SHOAL_TIMELINE_MAX_EVENTS"] = "50";
  run_workers(
      1,
      [] {
        for (int i = 0; i < 200; ++i) shoal::world().barrier();
      },
      options);
  if (shoal::testing::is_worker()) return;
  const auto events = read_trace(path);
  // The notices (one per write that followed drops) count 150 in all.
  int slices = 0, notices = 0;
  int64_t dropped = 0;
  for (const json& e : events) {
    if (e.at("ph") == "X") ++slices;
    if (e.at("ph") == "i") {
      ++notices;
      const int64_t count = e.at("args").at("dropped");
      EXPECT_EQ(e.at("name"), "timeline full: " + std::to_string(count) + " events dropped");
      dropped += count;
    }
  }
  EXPECT_EQ(slices, 50);
  EXPECT_GE(notices, 1);
  EXPECT_EQ(dropped, 150);
  std::filesystem::remove(path);
}

// A program ended by an uncaught error (std::terminate) still writes what it recorded.
TEST(Timeline, WrittenWhenAnErrorEndsTheProgram) {
  const std::string path = temp_path("terminate.json");
  std::filesystem::remove(path);
  WorkersOptions options;
  options.launcher = Launcher::kNone;
  options.env["SHOAL_TIMELINE"] = path;
  options.may_fail = {0};
  auto exits = run_workers(
      1,
      [] {
        auto t = torch::ones({8});
        shoal::world().all_reduce(t);
        std::terminate();
      },
      options);
  if (shoal::testing::is_worker()) return;
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].signal, SIGABRT);
  const auto events = read_trace(path);
  const auto workers = workers_of(events);
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ((comm_ops(events, workers.begin()->first)[Op{"all_reduce", 32, 1}]), 1);
  std::filesystem::remove(path);
}

// Events are written while the program runs, so a worker killed outright (SIGKILL, or a
// launcher's SIGTERM) keeps what it recorded before its last quarter second.
TEST(Timeline, WrittenBeforeAKill) {
  const std::string path = temp_path("kill.json");
  std::filesystem::remove(path);
  WorkersOptions options;
  options.launcher = Launcher::kNone;
  options.env["SHOAL_TIMELINE"] = path;
  options.may_fail = {0};
  auto exits = run_workers(
      1,
      [] {
        auto t = torch::ones({9});
        shoal::world().all_reduce(t);
        // Waits, with a deadline, for the slice to reach the file, with no flush of its own.
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        const std::string path = std::getenv("SHOAL_TIMELINE");
        while (read_text(path).find("\"bytes\":36") == std::string::npos &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        ::raise(SIGKILL);
      },
      options);
  if (shoal::testing::is_worker()) return;
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].signal, SIGKILL);
  const auto events = read_trace(path);
  const auto workers = workers_of(events);
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ((comm_ops(events, workers.begin()->first)[Op{"all_reduce", 36, 1}]), 1);
  std::filesystem::remove(path);
}

// A path that cannot be written fails init() on every worker with one line naming it.
TEST(Timeline, UnwritablePathFailsInit) {
  const std::string path = "/nonexistent-shoal-dir/trace.json";
  WorkersOptions options;
  options.init = false;
  options.env["SHOAL_TIMELINE"] = path;
  run_workers(
      2,
      [path] {
        const auto start = std::chrono::steady_clock::now();
        try {
          shoal::init();
          ADD_FAILURE() << "init() accepted SHOAL_TIMELINE=" << path;
        } catch (const shoal::UsageError& e) {
          const std::string message = e.what();
          EXPECT_NE(message.find("SHOAL_TIMELINE=" + path), std::string::npos) << message;
          EXPECT_NE(message.find("cannot write the timeline there"), std::string::npos) << message;
          EXPECT_EQ(message.find('\n'), std::string::npos) << message;
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
      },
      options);
}

}  // namespace
