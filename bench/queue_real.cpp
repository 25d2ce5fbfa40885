// The queue on this machine with tiny real training jobs: the half of bench/queue that
// bench/queue_sim.cpp simulates. One seeded trace of jobs (arrival times, priorities, --min,
// --max, preemptible, work) is replayed through the real `shoal queue serve` four times, one
// contender after the other, each on a fresh state directory:
//   elastic       `shoal queue serve` as it is: a shrink is a graceful leave, a grow a join;
//   fixed         no elasticity: every job submitted with --min = --max at the size queue_sim's
//                 --fixed-at uses (max by default), so the same code admits it and never resizes
//                 it; a higher priority still preempts preemptible jobs;
//   ckpt-restart  `shoal queue serve --resize-by restart`: the policy's decisions as for elastic,
//                 but every shrink and grow stops the whole job at a commit and starts it again
//                 at its new size from that commit (Note [Resizing by restart] in
//                 src/queue/scheduler_jobs.cpp), as Kubeflow's elastic PyTorchJob and Ray Train do;
//   goodput       elastic under `shoal queue serve --policy goodput` (Note [Giving workers where
//                 they speed training most], src/queue/policy.h); the others run the priority
//                 policy.
//
//   queue_real [--jobs 10] [--seed 1] [--slots 4] [--step-ms 150] [--load 1.5] ...
//
// The jobs are tests/programs/elastic_worker with its "scale" policy (4 samples per worker per
// step, so n workers go through an epoch of 240 samples n times faster) and a sleep of --step-ms
// in every step, which stands for the step's computation and leaves the 2 cores to the
// processes' start, the rendezvous and the commits. Each job's work is a whole number of epochs,
// from a run time at its --min drawn log-uniform in [--run-min, --run-max] (counting --step-ms a
// step). Every finished job's output is checked: each sample of each epoch trained on exactly
// once in committed steps, so that no contender finishes sooner by dropping work.
//
// It prints, per contender, jobs finished (and checked), completion time (submit to the
// scheduler's `done` event; mean, max, high and low priority), queueing delay (submit to first
// start), makespan (first submission to last completion), utilisation of the slots (worker
// processes' lifetimes, from /jobs/ID, over slots x makespan), resizes, preemptions, cycles and
// worker processes started, then the ratios elastic / fixed, elastic / ckpt-restart and
// goodput / elastic.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "queue/http.h"
#include "queue_contenders.h"
#include "shoal/core/error.h"

extern char** environ;

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kSamples = 240;  // elastic_worker's data set
constexpr int kPerWorker = 4;  // its "scale" policy's batch per worker
constexpr int kHighPriority = 100;

struct Options {
  int jobs = 10;
  uint64_t seed = 1;
  int slots = 4;
  int step_ms = 150;
  double load = 1.5;
  double high = 0.3;
  double preemptible = 0.5;
  double run_min = 10;
  double run_max = 40;
  double cooldown = 5;
  double grow_idle = 2;
  double deadline = 300;
  std::string fixed_at = "max";
  std::string dir = "/tmp/shoal-queue-real";
  std::string shoal = SHOAL_BIN;
  std::string worker = ELASTIC_WORKER;
};

struct TraceJob {
  int index = 0;
  int priority = 0;
  int min_workers = 1;
  int max_workers = 1;
  bool preemptible = false;
  double submitted = 0;  // seconds after the contender's start
  int epochs = 1;
  double seconds_at_min = 0;  // counting --step-ms a step
};

// As bench/queue_sim.cpp's make_trace, at this machine's scale: --min in {1, 2}, --max = --min x
// {1, 2}; Poisson arrivals at the rate that offers --load times the slots at each job's --min.
std::vector<TraceJob> make_trace(const Options& o) {
  std::mt19937_64 random(o.seed);
  std::uniform_real_distribution<double> unit(0, 1);
  const double step = o.step_ms / 1000.0;
  std::vector<TraceJob> trace;
  double slot_seconds = 0;
  for (int i = 0; i < o.jobs; ++i) {
    TraceJob job;
    job.index = i;
    job.priority = unit(random) < o.high ? kHighPriority : 0;
    job.min_workers = std::uniform_int_distribution<int>(1, 2)(random);
    job.max_workers =
        std::min(o.slots, job.min_workers * std::uniform_int_distribution<int>(1, 2)(random));
    job.preemptible = job.priority == 0 && unit(random) < o.preemptible;
    const double wanted = o.run_min * std::exp(unit(random) * std::log(o.run_max / o.run_min));
    const double epoch_at_min = step * kSamples / (kPerWorker * job.min_workers);
    job.epochs = std::max(1, static_cast<int>(std::lround(wanted / epoch_at_min)));
    job.seconds_at_min = job.epochs * epoch_at_min;
    slot_seconds += job.seconds_at_min * job.min_workers;
    trace.push_back(job);
  }
  const double rate = o.load * o.slots / (slot_seconds / o.jobs);
  std::exponential_distribution<double> gap(rate);
  double now = 0;
  for (auto& job : trace) {
    job.submitted = now;
    now += gap(random);
  }
  return trace;
}

using shoal::bench::Contender;
using shoal::bench::name_of;

struct Result {
  int finished = 0;  // done, with every sample once
  int unfinished = 0;
  double jct_mean = 0, jct_max = 0, high_jct_mean = 0, low_jct_mean = 0;
  double queue_mean = 0, high_queue_mean = 0;
  double makespan = 0;
  double util_held = 0;
  int resizes = 0, preemptions = 0, cycles = 0, processes = 0;
  double wall = 0;
  std::string load_before, load_after;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string load_average() {
  std::string text = read_text("/proc/loadavg");
  std::istringstream fields(text);
  std::string one, five, fifteen;
  fields >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

double mean(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v;
  return values.empty() ? 0 : sum / static_cast<double>(values.size());
}

// elastic_worker's OUT: "counts" then epochs x 240 counts, each 1 (as tests/queue_support.h's
// expect_every_sample_once). The reason it is not, or "".
std::string check_output(const std::string& path, int epochs) {
  const std::string text = read_text(path);
  const auto at = text.find("counts");
  if (at == std::string::npos) return path + " has no counts";
  std::istringstream counts(text.substr(at + 6));
  int total = 0, wrong = 0;
  for (int64_t count; counts >> count;) {
    ++total;
    wrong += count != 1 ? 1 : 0;
  }
  if (total != epochs * kSamples) {
    return path + " counts " + std::to_string(total) + " samples, not " +
           std::to_string(epochs * kSamples);
  }
  if (wrong > 0) return path + ": " + std::to_string(wrong) + " samples not trained on once";
  return "";
}

// `shoal queue serve` for one contender, stopped (SIGTERM: it stops its agent and the workers)
// when it goes out of scope.
class Serve {
 public:
  Serve(const Options& o, const std::string& dir, Contender contender) : dir_(dir) {
    std::vector<std::string> argv = {o.shoal,
                                     "queue",
                                     "serve",
                                     "--state-dir",
                                     dir,
                                     "--port",
                                     "0",
                                     "--agent-port",
                                     "0",
                                     "--slots",
                                     std::to_string(o.slots),
                                     "--cooldown",
                                     format(o.cooldown),
                                     "--grow-idle",
                                     format(o.grow_idle)};
    if (::geteuid() == 0) argv.push_back("--allow-root-jobs");  // its jobs run as its user
    if (contender == Contender::kCheckpointRestart) {
      argv.push_back("--resize-by");
      argv.push_back("restart");
    }
    if (contender == Contender::kGoodput) {
      argv.push_back("--policy");
      argv.push_back("goodput");
    }
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      const int fd = ::open((dir + "/serve.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> c_argv;
      for (auto& arg : argv) c_argv.push_back(arg.data());
      c_argv.push_back(nullptr);
      ::execv(c_argv[0], c_argv.data());
      ::_exit(127);
    }
    const auto deadline = Clock::now() + 30s;
    while (read_text(dir + "/address").empty()) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw shoal::Error("shoal queue serve exited at its start: " +
                           read_text(dir + "/serve.log"));
      }
      if (Clock::now() > deadline) {
        throw shoal::Error("shoal queue serve did not write " + dir + "/address within 30 s");
      }
      std::this_thread::sleep_for(50ms);
    }
    const std::string address = read_text(dir + "/address");
    std::string token = read_text(dir + "/token");
    while (!token.empty() && token.back() == '\n') token.pop_back();
    client_ = std::make_unique<shoal::queue::HttpClient>(
        address.substr(0, address.find(':')), std::stoi(address.substr(address.find(':') + 1)),
        token);
  }

  ~Serve() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + 30s;
    while (::waitpid(pid_, nullptr, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        std::fprintf(stderr,
                     "queue_real: shoal queue serve (pid %d) still runs 30 s after "
                     "SIGTERM; killing it and its agent\n",
                     pid_);
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        const int agent = std::atoi(read_text(dir_ + "/agent.pid").c_str());
        if (agent > 0) ::kill(agent, SIGKILL);
        break;
      }
      std::this_thread::sleep_for(50ms);
    }
  }

  shoal::queue::HttpClient& client() { return *client_; }

  static std::string format(double value) {
    std::ostringstream out;
    out << value;
    return out.str();
  }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  std::unique_ptr<shoal::queue::HttpClient> client_;
};

json environment() {
  json env = json::object();
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const auto eq = text.find('=');
    if (eq == std::string::npos) continue;
    const std::string name = text.substr(0, eq);
    // The queue gives each job its own durable commit (docs/queue.md, "Submitting").
    if (name == "SHOAL_CHECKPOINT") continue;
    env[name] = text.substr(eq + 1);
  }
  return env;
}

Result run(const Options& o, const std::vector<TraceJob>& trace, Contender contender) {
  const std::string dir = o.dir + "/" + name_of(contender);
  if (std::system(("rm -rf '" + dir + "'").c_str()) != 0 || ::mkdir(dir.c_str(), 0755) != 0) {
    throw shoal::UsageError("cannot make a fresh directory " + dir);
  }
  Result result;
  result.load_before = load_average();
  Serve serve(o, dir, contender);
  auto& client = serve.client();
  const json env = environment();

  // Replay the arrivals, then wait for every job to end.
  const auto start = Clock::now();
  std::map<int64_t, const TraceJob*> ids;
  size_t next = 0;
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(o.deadline));
  for (;;) {
    const double now = std::chrono::duration<double>(Clock::now() - start).count();
    while (next < trace.size() && trace[next].submitted <= now) {
      const TraceJob& job = trace[next++];
      int min_workers = job.min_workers, max_workers = job.max_workers;
      if (contender == Contender::kFixed) {
        min_workers = max_workers = o.fixed_at == "min" ? job.min_workers : job.max_workers;
      }
      const std::string out = dir + "/job-" + std::to_string(job.index) + ".out";
      const json body{
          {"argv", {o.worker, out, std::to_string(job.epochs), std::to_string(o.step_ms), "scale"}},
          {"cwd", dir},
          {"env", env},
          {"name", "t" + std::to_string(job.index)},
          {"priority", job.priority},
          {"min", min_workers},
          {"max", max_workers},
          {"preemptible", job.preemptible}};
      ids[client.post("/jobs", body).at("id").get<int64_t>()] = &job;
    }
    if (next == trace.size()) {
      bool ended = true;
      // A copy: a range-for over a member of the temporary answer would outlive it.
      const json jobs = client.get("/jobs").at("jobs");
      for (const auto& job : jobs) {
        const std::string state = job.at("state");
        ended = ended && (state == "done" || state == "failed" || state == "cancelled");
      }
      if (ended) break;
    }
    if (Clock::now() > deadline) {
      std::fprintf(stderr,
                   "queue_real: %s: not every job ended within --deadline %.0f s; "
                   "cancelling the rest\n",
                   name_of(contender), o.deadline);
      const json jobs = client.get("/jobs").at("jobs");
      for (const auto& job : jobs) {
        const std::string state = job.at("state");
        if (state == "waiting" || state == "running") {
          client.del("/jobs/" + std::to_string(job.at("id").get<int64_t>()));
        }
      }
      break;
    }
    std::this_thread::sleep_for(100ms);
  }
  result.wall = std::chrono::duration<double>(Clock::now() - start).count();

  // Completion: the scheduler's `done` event (the first worker's exit with code 0).
  std::map<int64_t, int64_t> done_ms;
  const json events = client.get("/events?since=0&limit=100000").at("events");
  for (const auto& e : events) {
    if (e.at("kind") == "done") done_ms[e.at("job").get<int64_t>()] = e.at("time_ms");
  }
  int64_t first_submit = INT64_MAX, last_done = 0;
  std::vector<json> jobs;
  for (const auto& [id, spec] : ids) {
    jobs.push_back(client.get("/jobs/" + std::to_string(id)));
    first_submit = std::min(first_submit, jobs.back().at("submitted_ms").get<int64_t>());
  }
  std::vector<double> all, high, low, queued, high_queued;
  for (const json& job : jobs) {
    const int64_t id = job.at("id");
    const TraceJob& spec = *ids.at(id);
    result.resizes += job.at("resizes").get<int>();
    result.preemptions += job.at("preemptions").get<int>();
    result.cycles += job.at("cycles").get<int>();
    result.processes += static_cast<int>(job.at("worker_list").size());
    const std::string why =
        job.at("state") != "done" || done_ms.count(id) == 0
            ? "ended " + job.at("state").get<std::string>() + ": " +
                  job.at("reason").get<std::string>()
            : check_output(dir + "/job-" + std::to_string(spec.index) + ".out", spec.epochs);
    if (!why.empty()) {
      std::fprintf(stderr, "queue_real: %s: job t%d (id %lld) does not count: %s\n",
                   name_of(contender), spec.index, static_cast<long long>(id), why.c_str());
      ++result.unfinished;
      continue;
    }
    ++result.finished;
    const int64_t submitted = job.at("submitted_ms");
    const double jct = (done_ms.at(id) - submitted) / 1000.0;
    const double wait = (job.at("started_ms").get<int64_t>() - submitted) / 1000.0;
    all.push_back(jct);
    (spec.priority > 0 ? high : low).push_back(jct);
    queued.push_back(wait);
    if (spec.priority > 0) high_queued.push_back(wait);
    last_done = std::max(last_done, done_ms.at(id));
  }
  result.jct_mean = mean(all);
  result.jct_max = all.empty() ? 0 : *std::max_element(all.begin(), all.end());
  result.high_jct_mean = mean(high);
  result.low_jct_mean = mean(low);
  result.queue_mean = mean(queued);
  result.high_queue_mean = mean(high_queued);
  result.makespan = last_done > first_submit ? (last_done - first_submit) / 1000.0 : 0;
  // Slot-seconds held: each worker process from its start to its exit, within the makespan.
  double held = 0;
  for (const json& job : jobs) {
    for (const auto& w : job.at("worker_list")) {
      const int64_t from = std::max(first_submit, w.at("started_ms").get<int64_t>());
      const int64_t ended = w.at("ended_ms");
      const int64_t to = std::min(last_done, ended > 0 ? ended : last_done);
      if (w.at("started_ms").get<int64_t>() > 0 && to > from) held += (to - from) / 1000.0;
    }
  }
  result.util_held = result.makespan > 0 ? held / (o.slots * result.makespan) : 0;
  result.load_after = load_average();
  return result;
}


void print_table(const std::vector<Result>& r) {
  struct Row {
    const char* metric;
    double (*value)(const Result&);
    int decimals;
  };
  const Row rows[] = {
      {"jobs finished, every sample once", [](const Result& x) { return double(x.finished); }, 0},
      {"JCT mean (s)", [](const Result& x) { return x.jct_mean; }, 1},
      {"JCT max (s)", [](const Result& x) { return x.jct_max; }, 1},
      {"high-priority JCT mean (s)", [](const Result& x) { return x.high_jct_mean; }, 1},
      {"low-priority JCT mean (s)", [](const Result& x) { return x.low_jct_mean; }, 1},
      {"queueing delay mean (s)", [](const Result& x) { return x.queue_mean; }, 1},
      {"high-priority queueing mean (s)", [](const Result& x) { return x.high_queue_mean; }, 1},
      {"makespan (s)", [](const Result& x) { return x.makespan; }, 1},
      {"utilisation, slots held", [](const Result& x) { return x.util_held; }, 3},
      {"resizes", [](const Result& x) { return double(x.resizes); }, 0},
      {"preemptions", [](const Result& x) { return double(x.preemptions); }, 0},
      {"cycles (lost workers, given back)", [](const Result& x) { return double(x.cycles); }, 0},
      {"worker processes started", [](const Result& x) { return double(x.processes); }, 0},
      {"contender wall time (s)", [](const Result& x) { return x.wall; }, 1},
  };
  std::vector<shoal::bench::ContenderRow> table;
  for (const auto& row : rows)
    table.push_back({row.metric, row.decimals,
                     {row.value(r[0]), row.value(r[1]), row.value(r[2]), row.value(r[3])}});
  shoal::bench::print_contender_table(table);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "The queue on this machine with tiny real training jobs: one trace through `shoal queue "
      "serve` as elastic, fixed-size and checkpoint-restart resizing"};
  app.add_option("--jobs", o.jobs, "jobs in the trace")->check(CLI::Range(1, 100));
  app.add_option("--seed", o.seed, "the trace generator's seed (std::mt19937_64)");
  app.add_option("--slots", o.slots, "the local agent's slots")->check(CLI::Range(2, 64));
  app.add_option("--step-ms", o.step_ms, "elastic_worker's sleep in every step, ms")
      ->check(CLI::Range(0, 10000));
  app.add_option("--load", o.load, "offered slot-seconds at --min over the slots")
      ->check(CLI::PositiveNumber);
  app.add_option("--high", o.high, "share of high-priority jobs")->check(CLI::Range(0.0, 1.0));
  app.add_option("--preemptible", o.preemptible, "share of low-priority jobs that are preemptible")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--run-min", o.run_min, "shortest run time at --min, seconds (log-uniform)")
      ->check(CLI::PositiveNumber);
  app.add_option("--run-max", o.run_max, "longest run time at --min, seconds")
      ->check(CLI::PositiveNumber);
  app.add_option("--cooldown", o.cooldown, "shoal queue serve --cooldown, seconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--grow-idle", o.grow_idle, "shoal queue serve --grow-idle, seconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--deadline", o.deadline,
                 "seconds a contender may take before its jobs are "
                 "cancelled (they then count as not finished)")
      ->check(CLI::PositiveNumber);
  app.add_option("--fixed-at", o.fixed_at, "the size of the fixed contender's jobs: max or min")
      ->check(CLI::IsMember({"max", "min"}));
  app.add_option("--dir", o.dir, "where each contender's state, logs and outputs go");
  app.add_option("--shoal", o.shoal, "the shoal command")->check(CLI::ExistingFile);
  app.add_option("--worker", o.worker, "tests/programs/elastic_worker")->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);
  if (o.run_max < o.run_min) {
    std::fprintf(stderr, "queue_real: --run-max %g is below --run-min %g\n", o.run_max, o.run_min);
    return 2;
  }
  // Private copies of the two programs: a build of the tree during the run (this machine is
  // shared) would otherwise replace them under the queue's feet.
  try {
    namespace fs = std::filesystem;
    fs::create_directories(o.dir + "/bin");
    for (std::string* program : {&o.shoal, &o.worker}) {
      const std::string copy = o.dir + "/bin/" + fs::path(*program).filename().string();
      fs::copy_file(*program, copy, fs::copy_options::overwrite_existing);
      fs::permissions(copy, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                fs::perms::others_read | fs::perms::others_exec);
      *program = copy;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "queue_real: cannot copy the programs into %s/bin: %s\n", o.dir.c_str(),
                 e.what());
    return 1;
  }

  const auto trace = make_trace(o);
  int high = 0, preemptible = 0;
  for (const auto& job : trace) {
    high += job.priority > 0 ? 1 : 0;
    preemptible += job.preemptible ? 1 : 0;
  }
  std::printf(
      "queue_real: %d slots on %u cores, %d jobs (%d high priority, %d preemptible), "
      "seed %llu; elastic_worker scale, %d ms a step; cooldown %g s, grow-idle %g s; "
      "fixed at --%s\n",
      o.slots, std::thread::hardware_concurrency(), o.jobs, high, preemptible,
      static_cast<unsigned long long>(o.seed), o.step_ms, o.cooldown, o.grow_idle,
      o.fixed_at.c_str());
  std::printf(
      "\n| job | arrival (s) | priority | min | max | preemptible | epochs | s at --min |\n"
      "|---|---:|---:|---:|---:|---|---:|---:|\n");
  for (const auto& job : trace) {
    std::printf("| t%d | %.1f | %d | %d | %d | %s | %d | %.1f |\n", job.index, job.submitted,
                job.priority, job.min_workers, job.max_workers, job.preemptible ? "yes" : "no",
                job.epochs, job.seconds_at_min);
  }
  std::printf("\n");
  std::fflush(stdout);

  std::vector<Result> results;
  int unfinished = 0;
  try {
    for (Contender c : {Contender::kElastic, Contender::kFixed, Contender::kCheckpointRestart,
                        Contender::kGoodput}) {
      results.push_back(run(o, trace, c));
      const Result& r = results.back();
      std::printf("%s: %d of %d jobs finished in %.1f s; load average %s before, %s after\n",
                  name_of(c), r.finished, o.jobs, r.wall, r.load_before.c_str(),
                  r.load_after.c_str());
      std::fflush(stdout);
      unfinished += r.unfinished;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "queue_real: %s\n", e.what());
    return 1;
  }
  std::printf("\n");
  print_table(results);
  // A contender that lost a job's work has no figures to compare: say so in the exit code.
  return unfinished == 0 ? 0 : 1;
}
