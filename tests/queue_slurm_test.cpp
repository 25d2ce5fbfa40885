// The job queue on a real Slurm (docs/queue.md, "Slurm"): `shoal queue serve --no-local-agent` and
// one `shoal agent --engine slurm --slurm-node nX` per node of a Slurm cluster that the test
// starts (tests/slurm_cluster.h: munged, slurmctld and one `slurmd -N nX` per node, on loopback).
// Every worker is a Slurm job; a shrink is `scancel --batch --signal=TERM`, a grow a new Slurm job.
// Skips with a message where root or the Slurm packages are missing.
#include "queue_support.h"
#include "slurm_cluster.h"

namespace shoal::testing {
namespace {

#define SKIP_WITHOUT_SLURM() \
  if (auto why = SlurmCluster::unavailable(); !why.empty()) GTEST_SKIP() << why

// Two nodes of 2 CPUs: 4 slots. Slurm may start a batch job up to batch_sched_delay (3 s by
// default) after its submission; the test times a start, so it starts them at once.
SlurmClusterOptions fast_start() {
  SlurmClusterOptions options;
  options.scheduler_parameters = "batch_sched_delay=0";
  return options;
}

// The queue and one Slurm agent per node, each in a directory of its own.
struct SlurmQueue {
  SlurmQueue(const std::string& name, const std::vector<SlurmNode>& nodes,
             std::vector<std::string> flags, std::vector<std::string> agent_flags = {})
      : cluster(nodes, fast_start()), queue(name, with_no_local_agent(std::move(flags))) {
    for (const auto& node : nodes) {
      std::vector<std::string> args = {"--engine", "slurm", "--slurm-node", node.name};
      args.insert(args.end(), agent_flags.begin(), agent_flags.end());
      agents.push_back(std::make_unique<Agent>(queue, queue.dir() + "/agent-" + node.name, args,
                                               cluster.client_env()));
    }
  }
  ~SlurmQueue() {
    // The agents first (they scancel their workers), then the scheduler, then Slurm.
    agents.clear();
    queue.stop();
  }

  static std::vector<std::string> with_no_local_agent(std::vector<std::string> flags) {
    flags.push_back("--no-local-agent");
    return flags;
  }

  // Every agent's host is known to the scheduler, alive, with its node's CPUs as slots.
  bool hosts_up(int slots_each) const {
    const json nodes = queue.client().get("/nodes").at("nodes");
    size_t up = 0;
    for (const auto& node : nodes) {
      up += node.at("alive").get<bool>() && node.at("capacity").get<int>() == slots_each ? 1 : 0;
    }
    return up == agents.size();
  }

  // The job's workers' logs, from whichever agent ran them.
  std::map<int64_t, std::string> logs(int64_t job) const {
    std::map<int64_t, std::string> out;
    for (const auto& w : json(queue.job(job).at("worker_list"))) {
      const int64_t worker = w.at("id");
      for (const auto& agent : agents) {
        out[worker] += read_text(agent->dir() + "/job-" + std::to_string(job) + "/worker-" +
                                 std::to_string(worker) + ".log");
      }
    }
    return out;
  }

  bool any_log_has(int64_t job, const std::string& text) const {
    for (const auto& [worker, log] : logs(job)) {
      if (log.find(text) != std::string::npos) return true;
    }
    return false;
  }

  int steps(int64_t job) const {
    int count = 0;
    for (const auto& [worker, log] : logs(job)) {
      std::istringstream lines(log);
      for (std::string line; std::getline(lines, line);)
        count += line.rfind("step ", 0) == 0 ? 1 : 0;
    }
    return count;
  }

  // What Slurm runs now: the queue's jobs' names ("shoal-jJ-wW") by node.
  std::map<std::string, std::set<std::string>> slurm_jobs() const {
    Command squeue({"squeue", "--noheader", "--states=running", "--format=%N %j"},
                   cluster.client_env());
    const CommandResult result = squeue.wait(10s);
    std::map<std::string, std::set<std::string>> out;
    std::istringstream lines(result.out);
    for (std::string node, name; lines >> node >> name;) out[node].insert(name);
    return out;
  }

  std::string diagnose(int64_t job) const {
    std::string text = queue.job(job).dump(1) + "\n";
    for (const auto& agent : agents) text += "--- " + agent->dir() + ".log\n" + agent->log();
    return text;
  }

  SlurmCluster cluster;
  Queue queue;
  std::vector<std::unique_ptr<Agent>> agents;
};

// Tests 1 and 2 of docs/queue.md on Slurm: a low-priority elastic job of 4 Slurm jobs shrinks for
// a high-priority arrival by a graceful leave of its two newest workers (scancel --batch
// --signal=TERM; the other two keep their processes), and grows back by new Slurm jobs that join
// when the capacity is free again; no sample is lost or repeated.
TEST(QueueSlurm, AHighPriorityJobShrinksALowOneThatGrowsBackAfterItAndLosesNoSample) {
  SKIP_WITHOUT_SLURM();
  constexpr double kCooldown = 8;
  SlurmQueue slurm("slurm-shrink", {{"n1", 2}, {"n2", 2}}, {"--cooldown", "8", "--grow-idle", "2"});
  Queue& queue = slurm.queue;
  ASSERT_TRUE(eventually([&] { return slurm.hosts_up(2); }, 20s))
      << queue.client().get("/nodes").dump(1) << slurm.agents[0]->log() << slurm.agents[1]->log();

  const auto low_submitted = Clock::now();
  const int64_t low = queue.submit("--priority low --min 2 --max 4 --name low " + kWorker + " " +
                                   queue.dir() + "/low.out 16 80");
  ASSERT_TRUE(
      eventually([&] { return queue.staying(low).size() == 4 && slurm.steps(low) > 0; }, 60s))
      << slurm.diagnose(low);
  std::cout << "[ measured ] the low job's first step " << seconds_since(low_submitted)
            << " s after its submission (4 Slurm jobs)" << std::endl;
  const auto before = queue.staying(low);
  // Four Slurm jobs, two on each node.
  const auto running = slurm.slurm_jobs();
  EXPECT_EQ(running.size(), 2u);
  for (const auto& [node, names] : running) EXPECT_EQ(names.size(), 2u) << node;

  const auto submitted = Clock::now();
  const int64_t high = queue.submit("--priority 10 --min 2 --max 2 --name high " + kWorker + " " +
                                    queue.dir() + "/high.out 2 50");
  ASSERT_TRUE(eventually([&] { return slurm.any_log_has(high, "step 1 world 2"); }, 30s))
      << slurm.diagnose(high);
  expect_first_step_soon(submitted, " (two leaves, two sbatch)");
  // Where the time went: Slurm's part is from sbatch (the batch script is written just before)
  // to the step's exec (its .pid file); the leave, from the shrink's event to the last "left".
  std::string slurm_part;
  for (const auto& w : json(queue.job(high).at("worker_list"))) {
    for (const auto& agent : slurm.agents) {
      const std::string prefix =
          agent->dir() + "/slurm/worker-" + std::to_string(w.at("id").get<int64_t>());
      struct stat script {
      }, pid{};
      if (::stat((prefix + ".sh").c_str(), &script) != 0 ||
          ::stat((prefix + ".pid").c_str(), &pid) != 0)
        continue;
      const double seconds = (pid.st_mtim.tv_sec - script.st_mtim.tv_sec) +
                             (pid.st_mtim.tv_nsec - script.st_mtim.tv_nsec) / 1e9;
      slurm_part += " " + std::to_string(seconds).substr(0, 4) + " s";
    }
  }
  int64_t shrink_ms = 0, left_ms = 0;
  for (const auto& e : json(queue.job(low).at("events"))) {
    const std::string message = e.at("message");
    if (message.find("shrinks from 4 to 2") != std::string::npos) shrink_ms = e.at("time_ms");
    if (message.find("left at a commit") != std::string::npos) left_ms = e.at("time_ms");
  }
  std::cout << "[ measured ] sbatch to the program's exec:" << slurm_part << "; shrink to the last "
            << "leave recorded: " << (left_ms - shrink_ms) / 1000.0 << " s" << std::endl;

  // The low job kept its two oldest workers, the very same processes.
  const auto kept = queue.staying(low);
  ASSERT_EQ(kept.size(), 2u) << slurm.diagnose(low);
  expect_the_oldest_kept(before, kept);
  int left = 0;
  for (const auto& e : json(queue.job(low).at("events"))) {
    left +=
        e.at("message").get<std::string>().find("left at a commit") != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(left, 2) << slurm.diagnose(low);

  ASSERT_TRUE(eventually([&] { return queue.state(high) == "done"; }, 60s)) << slurm.diagnose(high);
  const auto high_done = Clock::now();
  ASSERT_TRUE(eventually([&] { return queue.staying(low).size() == 4; }, 60s))
      << slurm.diagnose(low);
  const double regrown = seconds_since(high_done);
  std::cout << "[ measured ] the low job back to 4 workers " << regrown
            << " s after the high one ended (--cooldown 8, --grow-idle 2)" << std::endl;
  EXPECT_LT(regrown, kCooldown + 5)
      << "the low job was back to 4 workers " << regrown << " s after the high one ended";
  for (const auto& [id, pid] : kept) EXPECT_EQ(queue.staying(low).at(id), pid);
  // The new workers train in a world of 4.
  ASSERT_TRUE(eventually(
      [&] { return slurm.any_log_has(low, "world=4 step=") && slurm.steps(low) > 0; }, 30s));

  ASSERT_TRUE(eventually([&] { return queue.state(low) == "done"; }, 180s)) << slurm.diagnose(low);
  expect_every_sample_once(queue.dir() + "/low.out", 16);
  expect_every_sample_once(queue.dir() + "/high.out", 2);
  const json job = queue.job(low);
  EXPECT_EQ(job.at("resizes"), 2);
  EXPECT_EQ(job.at("cycles"), 1);
  EXPECT_EQ(job.at("failures"), 0);
  // Every Slurm job of the queue ended with its worker.
  EXPECT_TRUE(eventually([&] { return slurm.slurm_jobs().empty(); }, 20s));
}

// A worker Slurm refuses (sbatch fails) fails with sbatch's own one-line reason; one that waits in
// Slurm's queue (its node busy with a job of someone else's) stays "starting" until Slurm runs it,
// and a cancelled job withdraws it from Slurm.
TEST(QueueSlurm, SbatchRefusalsFailTheWorkerWithSlurmsReasonAndPendingWorkersWait) {
  SKIP_WITHOUT_SLURM();
  SlurmQueue slurm("slurm-refuse", {{"n1", 2}}, {});
  Queue& queue = slurm.queue;
  ASSERT_TRUE(eventually([&] { return slurm.hosts_up(2); }, 20s)) << slurm.agents[0]->log();
  const auto env = slurm.cluster.client_env();

  // Someone else's Slurm job holds both CPUs of n1: the queue's worker pends in Slurm.
  Command other(
      {"sbatch", "--parsable", "-w", "n1", "-n1", "--cpus-per-task=2", "--wrap", "sleep 600"}, env);
  const CommandResult submitted_other = other.wait(10s);
  ASSERT_EQ(submitted_other.exit_code, 0) << describe(submitted_other);
  const std::string other_id = submitted_other.out.substr(0, submitted_other.out.find('\n'));
  ASSERT_TRUE(eventually([&] { return !slurm.slurm_jobs()["n1"].empty(); }, 10s));
  const int64_t waiting =
      queue.submit("--min 1 --max 1 " + kWorker + " " + queue.dir() + "/w.out 1 50");
  ASSERT_TRUE(eventually(
      [&] { return slurm.agents[0]->log().find("is pending") != std::string::npos; }, 10s))
      << slurm.diagnose(waiting);
  const json pending = queue.job(waiting);
  ASSERT_EQ(pending.at("worker_list").size(), 1u);
  EXPECT_EQ(pending.at("worker_list")[0].at("state"), "starting") << pending.dump(1);
  // Cancelled, the job is withdrawn from Slurm before it ran.
  std::string out;
  ASSERT_EQ(queue.cli("cancel " + std::to_string(waiting), &out), 0) << out;
  EXPECT_TRUE(eventually([&] { return queue.job(waiting).at("workers") == 0; }, 15s))
      << slurm.diagnose(waiting);
  const std::string exit = queue.job(waiting).at("worker_list")[0].value("exit", "");
  EXPECT_NE(exit.find("was withdrawn from Slurm (job "), std::string::npos) << exit;
  Command(std::vector<std::string>{"scancel", other_id}, env).wait(10s);

  // The partition made inactive: sbatch is refused, and the worker fails with Slurm's reason.
  Command inactive({"scontrol", "update", "PartitionName=test", "State=INACTIVE"}, env);
  const CommandResult set_inactive = inactive.wait(10s);
  ASSERT_EQ(set_inactive.exit_code, 0) << describe(set_inactive);
  const int64_t refused = queue.submit("--min 1 --max 1 --max-restarts 0 " + kWorker + " " +
                                       queue.dir() + "/r.out 1 50");
  ASSERT_TRUE(eventually([&] { return queue.state(refused) == "failed"; }, 20s))
      << slurm.diagnose(refused);
  const std::string reason = queue.job(refused).at("reason");
  EXPECT_NE(reason.find("could not start: sbatch to node n1 failed: Batch job submission failed: "
                        "Required partition not available (inactive or drain)"),
            std::string::npos)
      << reason;
  EXPECT_EQ(reason.find('\n'), std::string::npos) << reason;
  std::cout << "[ reason ] " << reason << std::endl;
}

// The agent's flags: one line naming what is wrong and what was expected, exit code 2.
TEST(QueueSlurm, BadAgentFlagsAreRefusedWithOneLine) {
  struct Case {
    std::string args;
    std::string error;
  };
  std::vector<Case> cases = {
      {"--engine pbs", "shoal agent: --engine expects local or slurm, not 'pbs'\n"},
      {"--engine slurm",
       "shoal agent: --engine slurm needs --slurm-node NODE: the Slurm node this agent speaks "
       "for\n"},
      {"--slurm-node n1",
       "shoal agent: --slurm-node is for --engine slurm; this agent's engine is local\n"},
  };
  for (const auto& c : cases) {
    std::string out;
    EXPECT_EQ(shell(std::string(SHOAL_BIN) + " agent --queue 127.0.0.1:1 --token-file /dev/null " +
                        c.args,
                    &out),
              2)
        << c.args;
    EXPECT_EQ(out, c.error);
  }
  SKIP_WITHOUT_SLURM();
  SlurmCluster cluster({{"n1", 2}});
  std::string slurm_conf = cluster.client_env().at("SLURM_CONF");
  const std::string token = cluster.dir() + "/token";
  std::ofstream(token) << "secret\n";
  ::chmod(token.c_str(), 0600);
  const std::string agent = "env SLURM_CONF=" + slurm_conf + " " + SHOAL_BIN +
                            " agent --queue 127.0.0.1:1 --token-file " + token + " --engine slurm ";
  std::string out;
  EXPECT_EQ(shell(agent + "--slurm-node n9", &out), 2);
  EXPECT_EQ(out,
            "shoal agent: --slurm-node n9: Node n9 not found; expected a node of this Slurm "
            "cluster (see sinfo -N)\n");
  EXPECT_EQ(shell(agent + "--slurm-node n1 --partition gpu", &out), 2);
  EXPECT_EQ(out, "shoal agent: --partition gpu does not hold node n1 (its partitions: test)\n");
}

}  // namespace
}  // namespace shoal::testing
