// shoal programs under a real Slurm (srun, sbatch) that each test starts on this machine, with
// node names that do not resolve, as on a cluster with names of its own (docs/runtime.md).
// Skips with a message where root or the Slurm packages are missing.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "harness.h"
#include "slurm_cluster.h"
#include "test_paths.h"

namespace {

using shoal::testing::Command;
using shoal::testing::CommandResult;
using shoal::testing::launched_results;
using shoal::testing::SlurmCluster;
using shoal::testing::SlurmNode;
using shoal::testing::test_programs_dir;
using shoal::testing::tests_source_dir;

const std::string kWorker = test_programs_dir() + "/launched_worker";
constexpr std::chrono::seconds kRunLimit{120};  // a failure bound for one srun

#define SKIP_WITHOUT_SLURM() \
  if (auto why = SlurmCluster::unavailable(); !why.empty()) GTEST_SKIP() << why

std::map<std::string, std::string> with(std::map<std::string, std::string> env,
                                        const std::map<std::string, std::string>& more) {
  for (const auto& [name, value] : more) env[name] = value;
  return env;
}

// The node names don't resolve, so the workers are told where the first node is; the port is
// left to shoal (derived from the job id).
std::map<std::string, std::string> job_env(const SlurmCluster& cluster) {
  return with(cluster.client_env(), {{"MASTER_ADDR", "127.0.0.1"}});
}

TEST(Slurm, UnevenLayoutReadsEachNodesEntry) {
  SKIP_WITHOUT_SLURM();
  // n1 has room for one task: srun -N2 -n3 puts one there and two on n2
  // (SLURM_STEP_TASKS_PER_NODE=1,2), so the second node's tasks have SLURM_LOCALID 0 and 1.
  SlurmCluster cluster({{"n1", 1}, {"n2", 2}});
  Command srun({"srun", "-N2", "-n3", kWorker}, job_env(cluster));
  const CommandResult run = srun.wait(kRunLimit);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  auto by_rank = launched_results(run.out);
  ASSERT_EQ(by_rank.size(), 3u) << describe(run);
  std::set<std::pair<int, int>> places;
  for (const auto& [rank, r] : by_rank) {
    EXPECT_EQ(r.world, 3);
    EXPECT_EQ(r.sum, 6);  // 1 + 2 + 3: one world of three
    EXPECT_EQ(r.job, "Slurm job " + std::to_string(cluster.first_job_id()) + " step 0");
    places.insert({r.local, r.local_size});
  }
  // One task alone on its node, two sharing the other.
  EXPECT_EQ(places, (std::set<std::pair<int, int>>{{0, 1}, {0, 2}, {1, 2}})) << describe(run);
}

TEST(Slurm, TwoJobsOnOneNodeNeverMix) {
  SKIP_WITHOUT_SLURM();
  SlurmCluster cluster({{"n1", 4}});
  const std::string meet = cluster.dir() + "/meet";
  std::filesystem::create_directories(meet);
  // Two `srun -n 2` at once on the same first node, neither naming a port. Each worker waits
  // until all four have joined their jobs, so both jobs are alive at the same time.
  Command first({"srun", "-n2", kWorker, "--meet", meet, "4"}, job_env(cluster));
  Command second({"srun", "-n2", kWorker, "--meet", meet, "4"}, job_env(cluster));
  const CommandResult a = first.wait(kRunLimit);
  const CommandResult b = second.wait(kRunLimit);
  ASSERT_EQ(a.exit_code, 0) << describe(a);
  ASSERT_EQ(b.exit_code, 0) << describe(b);
  auto in_a = launched_results(a.out), in_b = launched_results(b.out);
  ASSERT_EQ(in_a.size(), 2u) << describe(a);
  ASSERT_EQ(in_b.size(), 2u) << describe(b);
  // Each job is a world of its own two workers, with its own id and its own store.
  for (auto* job : {&in_a, &in_b}) {
    for (const auto& [rank, r] : *job) {
      EXPECT_EQ(r.world, 2);
      EXPECT_EQ(r.sum, 3);
      EXPECT_EQ(r.job, job->at(0).job);
      EXPECT_EQ(r.master, job->at(0).master);
    }
  }
  EXPECT_NE(in_a.at(0).job, in_b.at(0).job);
  EXPECT_NE(in_a.at(0).master, in_b.at(0).master);
}

TEST(Slurm, AJobNeverJoinsAnotherJobsStore) {
  SKIP_WITHOUT_SLURM();
  SlurmCluster cluster({{"n1", 4}});
  // Both jobs are told the same port: one hosts its store there, the other must not join it.
  const std::string port = std::to_string(shoal::testing::free_port());
  const std::string release = cluster.dir() + "/release";
  auto env = with(job_env(cluster), {{"MASTER_PORT", port}});
  Command first({"srun", "-n2", kWorker, "--hold-until", release}, env);
  Command second({"srun", "-n2", kWorker, "--hold-until", release}, env);
  // The job that lost the port ends on its own, while the winner holds its store up; then the
  // winner is released.
  const auto start = std::chrono::steady_clock::now();
  while (!first.finished() && !second.finished()) {
    ASSERT_LT(std::chrono::steady_clock::now() - start, kRunLimit) << "neither job ended";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Command& loser = first.finished() ? first : second;
  Command& winner = first.finished() ? second : first;
  const CommandResult lost = loser.wait(kRunLimit);
  std::ofstream(release) << "go";
  const CommandResult won = winner.wait(kRunLimit);

  ASSERT_EQ(won.exit_code, 0) << describe(won);
  auto in_won = launched_results(won.out);
  ASSERT_EQ(in_won.size(), 2u) << describe(won);
  for (const auto& [rank, r] : in_won) {
    EXPECT_EQ(r.world, 2);
    EXPECT_EQ(r.sum, 3);  // only its own two workers
  }
  const std::string winner_id = in_won.at(0).job;
  EXPECT_NE(lost.exit_code, 0) << describe(lost);
  EXPECT_TRUE(launched_results(lost.out).empty()) << describe(lost);
  // Its rank 0 could not host the store; its rank 1 found the other job's and said whose.
  EXPECT_NE(lost.err.find(
                "launched_worker: cannot host the job's store on MASTER_ADDR:MASTER_PORT (port " +
                port + "): "),
            std::string::npos)
      << describe(lost);
  const std::regex foreign(
      "launched_worker: the store at MASTER_ADDR:MASTER_PORT=127\\.0\\.0\\.1:" + port +
      " belongs to " + winner_id +
      ", not to this job \\(Slurm job \\d+ step 0\\); give each job a port of its own");
  EXPECT_TRUE(std::regex_search(lost.err, foreign)) << describe(lost);
  // No raw c10d logging reaches the user.
  EXPECT_EQ(lost.err.find("c10d"), std::string::npos) << describe(lost);
  // At once, not at the 60 s connect timeout (a failure bound only).
  EXPECT_LT(lost.seconds, 30) << describe(lost);
}

TEST(Slurm, SbatchRunsTheWorkersWithSrun) {
  SKIP_WITHOUT_SLURM();
  SlurmCluster cluster({{"n1", 2}, {"n2", 2}});
  const std::string script = cluster.dir() + "/job.sh", output = cluster.dir() + "/job.out";
  // The program run by the batch script itself is not a task; under srun its tasks form the job.
  std::ofstream(script) << "#!/bin/sh\n"
                        << kWorker << "\n"
                        << "echo \"batch exit $?\"\n"
                        << "srun " << kWorker << "\n";
  Command sbatch({"sbatch", "--wait", "-N2", "-n4", "-o", output, script}, job_env(cluster));
  const CommandResult run = sbatch.wait(kRunLimit);
  std::stringstream text;
  text << std::ifstream(output).rdbuf();
  ASSERT_EQ(run.exit_code, 0) << describe(run) << "job output:\n" << text.str();
  const std::string out = text.str();
  EXPECT_NE(
      out.find("launched_worker: SLURM_PROCID is set but SLURM_STEP_ID is not: this is the "
               "batch script of a Slurm job of 4 tasks, not one of its tasks; start the workers "
               "with srun PROGRAM\nbatch exit 1\n"),
      std::string::npos)
      << out;
  auto by_rank = launched_results(out);
  ASSERT_EQ(by_rank.size(), 4u) << out;
  for (const auto& [rank, r] : by_rank) {
    EXPECT_EQ(r.world, 4);
    EXPECT_EQ(r.sum, 10);
    EXPECT_EQ(r.local_size, 2);
    EXPECT_EQ(r.job, "Slurm job " + std::to_string(cluster.first_job_id()) + " step 0");
  }
}

// A Python program is started as a C++ one: srun's tasks, and sbatch's through srun, join with
// shoal.init() (the C++ code that reads Slurm's variables) and all-reduce.
TEST(Slurm, SrunAndSbatchStartAPythonProgram) {
  SKIP_WITHOUT_SLURM();
  if (!std::filesystem::exists("/usr/lib/python3/dist-packages/torch/__init__.py")) {
    GTEST_SKIP() << "Debian's python3-torch is not installed (scripts/setup.sh installs it)";
  }
  SlurmCluster cluster({{"n1", 1}, {"n2", 2}});
  const std::string worker = tests_source_dir() + "/python/launched_worker.py";
  // The package of the build tree: build/python, beside build/bin/shoal.
  const auto build = std::filesystem::path(shoal::testing::shoal_bin()).parent_path().parent_path();
  const std::string package = build / "python";
  const auto env = with(job_env(cluster), {{"PYTHONPATH", package}});
  auto ranks_of = [](const std::string& out) {
    static const std::regex line(R"(launched rank=(\d+) world=(\d+) local=(\d+) sum=(\d+))");
    std::set<std::string> found;
    for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) found.insert(it->str());
    return found;
  };
  const std::set<std::string> three{"launched rank=0 world=3 local=0 sum=6", "launched rank=1 world=3 local=0 sum=6",
                                    "launched rank=2 world=3 local=1 sum=6"};
  Command srun({"srun", "-N2", "-n3", "/usr/bin/python3", worker}, env);
  const CommandResult run = srun.wait(kRunLimit);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(ranks_of(run.out), three) << describe(run);

  const std::string script = cluster.dir() + "/python_job.sh", output = cluster.dir() + "/python_job.out";
  std::ofstream(script) << "#!/bin/sh\nsrun /usr/bin/python3 " << worker << "\n";
  Command sbatch({"sbatch", "--wait", "-N2", "-n3", "-o", output, script}, env);
  const CommandResult batch = sbatch.wait(kRunLimit);
  std::stringstream text;
  text << std::ifstream(output).rdbuf();
  ASSERT_EQ(batch.exit_code, 0) << describe(batch) << "job output:\n" << text.str();
  EXPECT_EQ(ranks_of(text.str()), three) << text.str();
}

TEST(Slurm, NodeNamesThatDoNotResolveAreNamed) {
  SKIP_WITHOUT_SLURM();
  SlurmCluster cluster({{"n1", 1}, {"n2", 1}});
  // No MASTER_ADDR: the master would be n1, which no resolver knows.
  Command srun({"srun", "-N2", "-n2", kWorker}, cluster.client_env());
  const CommandResult run = srun.wait(kRunLimit);
  EXPECT_NE(run.exit_code, 0) << describe(run);
  const std::regex said(
      "launched_worker: cannot resolve the job's master host 'n1' \\(the first host of "
      "SLURM_STEP_NODELIST\\): [^\\n]*; set MASTER_ADDR \\(or SHOAL_MASTER=HOST:PORT\\) to a name "
      "or "
      "address of the job's first node that every worker resolves\\n");
  auto begin = std::sregex_iterator(run.err.begin(), run.err.end(), said);
  EXPECT_EQ(std::distance(begin, std::sregex_iterator()), 2) << describe(run);  // both workers
  EXPECT_LT(run.seconds, 30) << describe(run);
}

TEST(Slurm, AWrongEnvironmentFailsEveryWorkerAtOnce) {
  SKIP_WITHOUT_SLURM();
  SlurmCluster cluster({{"n1", 1}, {"n2", 2}});
  // Task 2 (the second on n2) is given a local id its node does not have.
  Command srun({"srun", "-N2", "-n3", "sh", "-c",
                "[ \"$SLURM_PROCID\" = 2 ] && export SLURM_LOCALID=5; exec " + kWorker},
               job_env(cluster));
  const CommandResult run = srun.wait(kRunLimit);
  EXPECT_NE(run.exit_code, 0) << describe(run);
  const std::string cause =
      "SLURM_LOCALID=5 must be less than 2, the tasks of node SLURM_NODEID=1 in "
      "SLURM_STEP_TASKS_PER_NODE='1,2'";
  EXPECT_NE(run.err.find("launched_worker: " + cause + "\n"), std::string::npos) << describe(run);
  const std::regex told(
      "launched_worker: the job cannot start: a worker on host \\S+ \\(pid \\d+\\) found: " +
      std::regex_replace(cause, std::regex(R"([()'.])"), R"(\$&)") + "\n");
  auto begin = std::sregex_iterator(run.err.begin(), run.err.end(), told);
  EXPECT_EQ(std::distance(begin, std::sregex_iterator()), 2) << describe(run);  // the other two
  // At once, not at the 60 s connect timeout (a failure bound only).
  EXPECT_LT(run.seconds, 30) << describe(run);
}

}  // namespace
