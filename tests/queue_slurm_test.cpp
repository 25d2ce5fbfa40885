// The job queue on a real Slurm (docs/queue.md, "Slurm"): `shoal queue serve --no-local-agent` and
// one `shoal agent --engine slurm --slurm-node nX` per node of a Slurm cluster that the test
// starts (tests/slurm_cluster.h: munged, slurmctld and one slurmd per node). The shrink and grow
// runs on two hosts (network namespaces, tests/netns.h), each with its slurmd and its agent; the
// other tests on loopback (`slurmd -N nX`). Every worker is a Slurm job; a shrink is
// `scancel --batch --signal=TERM`, a grow a new Slurm job.
// Skips with a message where root or the Slurm packages are missing.
#include <algorithm>

#include "queue_support.h"
#include "slurm_cluster.h"

namespace shoal::testing {
namespace {

#define SKIP_WITHOUT_SLURM() \
  if (auto why = SlurmCluster::unavailable(); !why.empty()) GTEST_SKIP() << why

// The queue and one Slurm agent per node, each in a directory of its own. With `hosts`, node i
// and its agent are on host i and the scheduler on host 0, where this thread stays while the
// SlurmQueue lives (its REST calls and Slurm commands then run there); without, all on loopback.
struct SlurmQueue {
  SlurmQueue(const std::string& name, const std::vector<SlurmNode>& nodes,
             std::vector<std::string> flags, std::vector<std::string> agent_flags = {},
             const TwoHosts* hosts = nullptr, int kill_wait = 2)
      : cluster(nodes, options(hosts, kill_wait)),
        on_host_a(hosts ? std::make_unique<InNetworkNamespace>(hosts->name(0)) : nullptr),
        queue(name, queue_flags(std::move(flags), hosts)) {
    const std::string hosts_path = queue.dir() + "/hosts";
    if (hosts != nullptr) std::ofstream(hosts_path) << hosts->hosts_file();
    for (size_t i = 0; i < nodes.size(); ++i) {
      std::vector<std::string> args = {"--engine", "slurm", "--slurm-node", nodes[i].name};
      args.insert(args.end(), agent_flags.begin(), agent_flags.end());
      const std::string dir = queue.dir() + "/agent-" + nodes[i].name;
      if (hosts == nullptr) {
        agents.push_back(std::make_unique<Agent>(queue, dir, args, cluster.client_env()));
      } else {
        agents.push_back(std::make_unique<Agent>(queue, dir, args, cluster.client_env(),
                                                 hosts->on_host(static_cast<int>(i), hosts_path),
                                                 TwoHosts::kAddressA));
      }
      queue.read_logs_from(dir);
    }
  }
  ~SlurmQueue() {
    // The agents first (they scancel their workers), then the scheduler, then (as members)
    // this thread's way home and Slurm.
    agents.clear();
    queue.stop();
  }

  // Slurm may start a batch job up to batch_sched_delay (3 s by default) after its submission;
  // the tests time a start, so they start them at once.
  static SlurmClusterOptions options(const TwoHosts* hosts, int kill_wait) {
    SlurmClusterOptions options;
    options.scheduler_parameters = "batch_sched_delay=0";
    options.hosts = hosts;
    options.kill_wait = kill_wait;
    return options;
  }

  // No local agent; on hosts, the scheduler listens on host A's address, which both reach.
  static std::vector<std::string> queue_flags(std::vector<std::string> flags,
                                              const TwoHosts* hosts) {
    flags.push_back("--no-local-agent");
    if (hosts != nullptr) {
      flags.push_back("--host");
      flags.push_back(TwoHosts::kAddressA);
    }
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
  std::unique_ptr<InNetworkNamespace> on_host_a;
  Queue queue;
  std::vector<std::unique_ptr<Agent>> agents;
};

// Tests 1 and 2 of docs/queue.md on Slurm across two hosts (issue 15's test 6): each host a
// network namespace with its slurmd and its agent, slurmctld and the scheduler on host A. A
// low-priority elastic job of 4 Slurm jobs, two on each host, whose workers find each other
// through the agents' gossip addresses, shrinks for a high-priority arrival by a graceful leave of
// its two newest workers (scancel --batch --signal=TERM; the other two keep their processes) and
// grows back by new Slurm jobs that join when the capacity is free again; no sample is lost or
// repeated.
TEST(QueueSlurm, AJobAcrossTwoHostsShrinksForAHighPriorityOneAndGrowsBackLosingNoSample) {
  SKIP_WITHOUT_SLURM();
  TwoHosts hosts;
  if (auto why = hosts.create()) GTEST_SKIP() << *why;
  SlurmQueue slurm("slurm-shrink", {{"n1", 2}, {"n2", 2}}, {"--cooldown", "8", "--grow-idle", "2"},
                   {}, &hosts);
  Queue& queue = slurm.queue;
  ASSERT_TRUE(eventually([&] { return slurm.hosts_up(2); }, 20s))
      << queue.client().get("/nodes").dump(1) << slurm.agents[0]->log() << slurm.agents[1]->log();

  ShrinkAndGrowBack test;
  test.diagnose = [&](int64_t job) { return slurm.diagnose(job); };
  test.hosts = 2;
  test.cooldown = 8;
  test.low_priority = "low";
  test.high_start = " (two leaves, two sbatch)";
  test.at_full = [&](int64_t low) {
    // Four Slurm jobs, two on each node.
    const auto running = slurm.slurm_jobs();
    EXPECT_EQ(running.size(), 2u);
    for (const auto& [node, names] : running) EXPECT_EQ(names.size(), 2u) << node;
    // Each worker runs on its node's host (in that network namespace) and finds its job through
    // that host's agent: its gossip seed is the agent's address there.
    for (const auto& w : json(queue.job(low).at("worker_list"))) {
      const int host = w.at("host") == "n1" ? 0 : 1;
      const std::string proc = "/proc/" + std::to_string(w.at("pid").get<int64_t>());
      struct stat in {
      }, expected{};
      ASSERT_EQ(::stat((proc + "/ns/net").c_str(), &in), 0) << proc;
      ASSERT_EQ(::stat(("/run/netns/" + hosts.name(host)).c_str(), &expected), 0);
      EXPECT_EQ(in.st_ino, expected.st_ino) << "worker " << w.at("id") << " is not on its host";
      std::string environ_text = read_text(proc + "/environ");
      std::replace(environ_text.begin(), environ_text.end(), '\0', '\n');
      const std::string seed = std::string("SHOAL_GOSSIP_SEEDS=") +
                               (host == 0 ? TwoHosts::kAddressA : TwoHosts::kAddressB) + ":";
      EXPECT_NE(environ_text.find("\n" + seed), std::string::npos)
          << "worker " << w.at("id") << " on " << w.at("host") << ":\n" << environ_text;
    }
  };
  test.at_shrunk = [&](int64_t low, int64_t high) {
    // Where the time went: Slurm's part is from sbatch (the batch script is written just
    // before) to the step's exec (its .pid file); the leave, from the shrink's event to the
    // last "left".
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
    std::cout << "[ measured ] sbatch to the program's exec:" << slurm_part
              << "; shrink to the last leave recorded: " << (left_ms - shrink_ms) / 1000.0 << " s"
              << std::endl;
  };
  test.at_end = [&](int64_t, int64_t) {
    // Every Slurm job of the queue ended with its worker.
    EXPECT_TRUE(eventually([&] { return slurm.slurm_jobs().empty(); }, 20s));
  };
  expect_shrink_and_grow_back(queue, test);
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

  // Someone else's Slurm job holds both CPUs of n1: the queue's worker pends in Slurm. Its output
  // goes to the cluster's directory (by default: slurm-J.out in the test's working directory).
  Command other({"sbatch", "--parsable", "-w", "n1", "-n1", "--cpus-per-task=2",
                 "--output=" + slurm.cluster.dir() + "/other.out", "--wrap", "sleep 600"},
                env);
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

// Slurm's own SIGTERM (a time limit, a preemption, someone's `scancel JOBID`) makes an elastic
// worker leave at its next commit and exit 0, as the agent's leave does. The agent did not ask
// that worker to leave, so the queue must not read its exit 0 as the end of the training: the
// worker is reported as ended by Slurm, a failure, a replacement joins after its back-off, and
// the job finishes with every sample trained on once. A real time limit takes a minute and more
// (one of a minute was seen to act 85 s after it was set, with this very outcome); an operator's
// scancel reaches the job's processes the same way: SIGTERM, then SIGKILL after KillWait, which
// is Slurm's default of 30 s here, so that the worker's leave does not race the SIGKILL.
TEST(QueueSlurm, SlurmsOwnSigtermFailsTheWorkerRatherThanEndingTheTraining) {
  SKIP_WITHOUT_SLURM();
  SlurmQueue slurm("slurm-term", {{"n1", 2}}, {}, {}, nullptr, /*kill_wait=*/30);
  Queue& queue = slurm.queue;
  ASSERT_TRUE(eventually([&] { return slurm.hosts_up(2); }, 20s)) << slurm.agents[0]->log();
  const int64_t job =
      queue.submit("--min 1 --max 2 " + kWorker + " " + queue.dir() + "/term.out 6 80");
  ASSERT_TRUE(eventually(
      [&] { return queue.staying(job).size() == 2 && queue.any_log_has(job, "world=2 step="); },
      60s))
      << slurm.diagnose(job);
  const int64_t victim = queue.staying(job).rbegin()->first;

  const std::string name = "shoal-j" + std::to_string(job) + "-w" + std::to_string(victim);
  Command cancel({"scancel", "--name=" + name}, slurm.cluster.client_env());
  const auto signalled = Clock::now();
  const CommandResult cancelled = cancel.wait(10s);
  ASSERT_EQ(cancelled.exit_code, 0) << describe(cancelled);
  ASSERT_TRUE(eventually([&] { return queue.job(job).at("failures") == 1; }, 20s))
      << slurm.diagnose(job);
  std::cout << "[ measured ] the worker's failure recorded " << seconds_since(signalled)
            << " s after the scancel" << std::endl;
  std::string exit;
  for (const auto& w : json(queue.job(job).at("worker_list"))) {
    if (w.at("id") == victim) exit = w.value("exit", "");
  }
  EXPECT_EQ(exit,
            "ended after a SIGTERM that the agent did not send (Slurm's: a time limit, a "
            "preemption or a scancel): exited with code 0");
  std::cout << "[ exit ] " << exit << std::endl;

  ASSERT_TRUE(eventually([&] { return finished(queue, job); }, 120s)) << slurm.diagnose(job);
  expect_every_sample_once(queue.dir() + "/term.out", 6);
  const json ended = queue.job(job);
  EXPECT_EQ(ended.at("failures"), 1);
  EXPECT_EQ(ended.at("worker_list").size(), 3u) << "two workers and one replacement";
}

// An agent SIGKILLed while its worker's Slurm job runs, and started again with the same --dir
// before the scheduler's --host-timeout (30 s here, so that the agent's own start, 1.5-3 s, never
// races it): the scheduler still lists the worker on the host, and the new agent follows the
// Slurm job its predecessor submitted (found through squeue by its batch script) rather than
// submitting the worker a second time. The worker's program trains on, the same process, and the
// job finishes with every sample trained on once.
TEST(QueueSlurm, ARestartedAgentFollowsTheSlurmJobsOfTheOneBeforeIt) {
  SKIP_WITHOUT_SLURM();
  SlurmQueue slurm("slurm-adopt", {{"n1", 2}}, {"--host-timeout", "30"});
  Queue& queue = slurm.queue;
  ASSERT_TRUE(eventually([&] { return slurm.hosts_up(2); }, 20s)) << slurm.agents[0]->log();
  const int64_t job =
      queue.submit("--min 1 --max 1 " + kWorker + " " + queue.dir() + "/adopt.out 8 80");
  ASSERT_TRUE(eventually([&] { return queue.steps(job) > 0; }, 60s)) << slurm.diagnose(job);
  const auto before = queue.staying(job);
  ASSERT_EQ(before.size(), 1u) << slurm.diagnose(job);

  const std::string dir = slurm.agents[0]->dir();
  ASSERT_EQ(::kill(slurm.agents[0]->pid(), SIGKILL), 0);
  slurm.agents[0]->stop();  // reaps it
  slurm.agents[0] = std::make_unique<Agent>(
      queue, dir, std::vector<std::string>{"--engine", "slurm", "--slurm-node", "n1"},
      slurm.cluster.client_env());
  ASSERT_TRUE(eventually(
      [&] { return slurm.agents[0]->log().find("not submitted again") != std::string::npos; },
      30s))
      << slurm.diagnose(job);
  // One Slurm job of that name ever (squeue lists ended jobs for MinJobAge, 5 s).
  const std::string name =
      "shoal-j" + std::to_string(job) + "-w" + std::to_string(before.begin()->first);
  Command named({"squeue", "--noheader", "--states=all", "--format=%i", "--name=" + name},
                slurm.cluster.client_env());
  const CommandResult listed = named.wait(10s);
  EXPECT_EQ(std::count(listed.out.begin(), listed.out.end(), '\n'), 1) << describe(listed);
  EXPECT_EQ(queue.staying(job), before);
  std::istringstream lines(slurm.agents[0]->log());
  for (std::string line; std::getline(lines, line);) {
    if (line.find("earlier agent") != std::string::npos) std::cout << "[ agent ] " << line << "\n";
  }

  ASSERT_TRUE(eventually([&] { return finished(queue, job); }, 120s)) << slurm.diagnose(job);
  expect_every_sample_once(queue.dir() + "/adopt.out", 8);
  EXPECT_EQ(queue.job(job).at("failures"), 0);
  const json workers = queue.job(job).at("worker_list");
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].at("pid"), before.begin()->second);
  EXPECT_EQ(workers[0].at("exit"), "exited with code 0");
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
    EXPECT_EQ(shell(shoal_bin() + " agent --queue 127.0.0.1:1 --token-file /dev/null " +
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
  const std::string agent = "env SLURM_CONF=" + slurm_conf + " " + shoal_bin() +
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
