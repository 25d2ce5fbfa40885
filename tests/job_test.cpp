// Job discovery: every launcher's environment, every bad environment (asserting the error
// text), and init() end to end in real processes under each launcher's conventions.
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <array>
#include <set>
#include <thread>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "comm/store.h"
#include "runtime/job_discovery.h"
#include "shoal/shoal.h"

namespace {

using shoal::JobSpec;
using shoal::discover_job;
using shoal::env::Environment;
using shoal::testing::Launcher;
using shoal::testing::run_workers;

void expect_usage_error(const Environment& env, const std::string& message, const std::string& master = "") {
  try {
    discover_job(env, master);
    ADD_FAILURE() << "expected UsageError: " << message;
  } catch (const shoal::UsageError& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

TEST(DiscoverJob, NothingSetIsAJobOfOne) {
  auto job = discover_job({{"HOME", "/root"}});
  EXPECT_EQ(job.launcher, "single");
  EXPECT_EQ(job.rank, 0);
  EXPECT_EQ(job.world_size, 1);
  EXPECT_TRUE(job.master_addr.empty());
}

TEST(DiscoverJob, ShoalRun) {
  auto job = discover_job({{"SHOAL_RANK", "3"}, {"SHOAL_WORLD_SIZE", "4"}, {"SHOAL_LOCAL_RANK", "1"},
                           {"SHOAL_LOCAL_WORLD_SIZE", "2"}, {"SHOAL_MASTER_ADDR", "10.0.0.1"},
                           {"SHOAL_MASTER_PORT", "4000"},
                           // shoal run exports torchrun's variables too; its own win.
                           {"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(job.launcher, "shoal");
  EXPECT_EQ(job.rank, 3);
  EXPECT_EQ(job.world_size, 4);
  EXPECT_EQ(job.local_rank, 1);
  EXPECT_EQ(job.local_world_size, 2);
  EXPECT_EQ(job.master_addr, "10.0.0.1");
  EXPECT_EQ(job.master_port, 4000);
  EXPECT_TRUE(job.store_hosted_by_launcher);
}

TEST(DiscoverJob, Torchrun) {
  Environment env{{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"},
                  {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"}};
  auto job = discover_job(env);
  EXPECT_EQ(job.launcher, "torchrun");
  EXPECT_EQ(job.rank, 2);
  EXPECT_EQ(job.world_size, 3);
  EXPECT_EQ(job.local_world_size, 1);
  EXPECT_EQ(job.master_addr, "node0");
  EXPECT_EQ(job.master_port, 29400);
  EXPECT_FALSE(job.store_hosted_by_launcher);  // rank 0 hosts it, as env:// does
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  EXPECT_TRUE(discover_job(env).store_hosted_by_launcher);
}

TEST(DiscoverJob, OpenMpiWithAddressFromVariableOrOption) {
  Environment env{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                  {"SHOAL_MASTER", "head:5000"}};
  auto job = discover_job(env);
  EXPECT_EQ(job.launcher, "openmpi");
  EXPECT_EQ(job.rank, 1);
  EXPECT_EQ(job.world_size, 2);
  EXPECT_EQ(job.local_world_size, 2);
  EXPECT_EQ(job.master_addr, "head");
  EXPECT_EQ(job.master_port, 5000);
  auto overridden = discover_job(env, "other:6000");
  EXPECT_EQ(overridden.master_addr, "other");
  EXPECT_EQ(overridden.master_port, 6000);
}

TEST(DiscoverJob, SlurmFirstHostOfTheNodeList) {
  Environment env{{"SLURM_PROCID", "5"},
                  {"SLURM_NTASKS", "8"},
                  {"SLURM_LOCALID", "1"},
                  {"SLURM_STEP_ID", "0"},
                  {"SLURM_TASKS_PER_NODE", "2(x4)"},
                  {"SLURM_JOB_NODELIST", "gpu[07-10],cpu1"}};
  auto job = discover_job(env);
  EXPECT_EQ(job.launcher, "slurm");
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.world_size, 8);
  EXPECT_EQ(job.local_rank, 1);
  EXPECT_EQ(job.local_world_size, 2);
  EXPECT_EQ(job.master_addr, "gpu07");
  EXPECT_EQ(job.master_port, 29500);  // no job id: torch.distributed's default
  EXPECT_TRUE(job.job_id.empty());
  EXPECT_FALSE(job.hosts_store);
  env["MASTER_PORT"] = "1234";
  EXPECT_EQ(discover_job(env).master_port, 1234);
  // The step's own node list wins over the job's: rank 0 runs on the step's first node.
  env["SLURM_STEP_NODELIST"] = "gpu[09-10]";
  EXPECT_EQ(discover_job(env).master_addr, "gpu09");
}

TEST(DiscoverJob, SlurmUnevenLayoutReadsThisNodesEntry) {
  // srun -N4 -n7: three nodes of 2 tasks and one of 1.
  Environment env{{"SLURM_JOB_ID", "42"},        {"SLURM_STEP_ID", "3"},
                  {"SLURM_NTASKS", "7"},         {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"},
                  {"SLURM_TASKS_PER_NODE", "9"}, {"SLURM_STEP_NODELIST", "n[1-4]"}};
  const std::vector<std::array<int, 4>> tasks = {// procid, nodeid, localid, tasks on the node
                                                 {0, 0, 0, 2},
                                                 {1, 0, 1, 2},
                                                 {2, 1, 0, 2},
                                                 {5, 2, 1, 2},
                                                 {6, 3, 0, 1}};
  for (auto [procid, nodeid, localid, local_size] : tasks) {
    env["SLURM_PROCID"] = std::to_string(procid);
    env["SLURM_NODEID"] = std::to_string(nodeid);
    env["SLURM_LOCALID"] = std::to_string(localid);
    auto job = discover_job(env);
    EXPECT_EQ(job.rank, procid);
    EXPECT_EQ(job.local_rank, localid);
    EXPECT_EQ(job.local_world_size, local_size) << "task " << procid;
    EXPECT_EQ(job.hosts_store, procid == 0);
    EXPECT_EQ(job.job_id, "Slurm job 42 step 3");
    EXPECT_EQ(job.master_addr, "n1");
  }
  env["SLURM_LOCALID"] = "1";
  expect_usage_error(env,
                     "SLURM_LOCALID=1 must be less than 1, the tasks of node SLURM_NODEID=3 in "
                     "SLURM_STEP_TASKS_PER_NODE='2(x3),1'");
  env["SLURM_NODEID"] = "4";
  expect_usage_error(env,
                     "SLURM_NODEID=4 must be less than the 4 nodes of "
                     "SLURM_STEP_TASKS_PER_NODE='2(x3),1'");
  // What every worker reads alike is checked alike on every worker.
  env["SLURM_NTASKS"] = "8";
  expect_usage_error(env,
                     "SLURM_STEP_TASKS_PER_NODE='2(x3),1' adds up to 7 tasks but SLURM_NTASKS=8");
}

TEST(DiscoverJob, SlurmTasksPerNode) {
  using V = std::vector<int>;
  EXPECT_EQ(shoal::expand_slurm_tasks_per_node("3", "T"), V({3}));
  EXPECT_EQ(shoal::expand_slurm_tasks_per_node("2(x3),1", "T"), V({2, 2, 2, 1}));
  EXPECT_EQ(shoal::expand_slurm_tasks_per_node("1,2", "T"), V({1, 2}));
  EXPECT_EQ(shoal::expand_slurm_tasks_per_node("4(x2),1(x2)", "T"), V({4, 4, 1, 1}));
  for (const char* bad : {"", "x", "2(3)", "2(x)", "2(x3", "2(x3)1", "0", "2,,1", "-1"}) {
    try {
      shoal::expand_slurm_tasks_per_node(bad, "SLURM_TASKS_PER_NODE");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const shoal::UsageError& e) {
      EXPECT_EQ(std::string(e.what()),
                "SLURM_TASKS_PER_NODE='" + std::string(bad) +
                    "' is not a Slurm task list; expected counts like '2(x3),1'");
    }
  }
}

TEST(DiscoverJob, SlurmBatchScriptIsNotATask) {
  // sbatch -n2 runs its script once, with SLURM_PROCID=0 and no step.
  expect_usage_error(
      {{"SLURM_JOB_ID", "7"},
       {"SLURM_PROCID", "0"},
       {"SLURM_NTASKS", "2"},
       {"SLURM_TASKS_PER_NODE", "2"},
       {"SLURM_JOB_NODELIST", "n1"}},
      "SLURM_PROCID is set but SLURM_STEP_ID is not: this is the batch script of a "
      "Slurm job of 2 tasks, not one of its tasks; start the workers with srun PROGRAM");
  // A one-task job's script is that task.
  auto job = discover_job({{"SLURM_JOB_ID", "7"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(job.world_size, 1);
  EXPECT_EQ(job.job_id, "Slurm job 7");
}

TEST(DiscoverJob, JobIdsAndTheirPorts) {
  Environment slurm{{"SLURM_JOB_ID", "12"},
                    {"SLURM_STEP_ID", "0"},
                    {"SLURM_PROCID", "1"},
                    {"SLURM_NTASKS", "2"},
                    {"SLURM_JOB_NODELIST", "n1"}};
  auto job = discover_job(slurm);
  EXPECT_EQ(job.job_id, "Slurm job 12 step 0");
  EXPECT_EQ(job.master_port, shoal::default_master_port("Slurm job 12 step 0"));
  // Two jobs, or two steps of one job, on the same first node get different ports.
  std::set<int> ports;
  for (int id = 1; id <= 20; ++id) {
    for (int step = 0; step < 3; ++step) {
      const int port = shoal::default_master_port("Slurm job " + std::to_string(id) + " step " +
                                                  std::to_string(step));
      EXPECT_GE(port, 29500);
      EXPECT_LT(port, 32500);  // below the ephemeral range
      ports.insert(port);
    }
  }
  EXPECT_EQ(ports.size(), 60u);
  EXPECT_EQ(shoal::default_master_port("Slurm job 3 step 1"), 29500 + 3 * 8 + 1);
  EXPECT_EQ(shoal::default_master_port(""), 29500);
  // Other ids are hashed into the same range, the same on every host.
  const int hashed = shoal::default_master_port("Open MPI job 1206517761");
  EXPECT_GE(hashed, 29500);
  EXPECT_LT(hashed, 32500);
  EXPECT_EQ(hashed, shoal::default_master_port("Open MPI job 1206517761"));
  // A port the user gives wins.
  slurm["MASTER_PORT"] = "4321";
  EXPECT_EQ(discover_job(slurm).master_port, 4321);

  EXPECT_EQ(discover_job({{"SHOAL_RANK", "0"},
                          {"SHOAL_WORLD_SIZE", "1"},
                          {"SHOAL_MASTER_ADDR", "h"},
                          {"SHOAL_MASTER_PORT", "1"},
                          {"SHOAL_RUN_ID", "00ff"}})
                .job_id,
            "shoal run 00ff");
  Environment torchrun{{"RANK", "0"},
                       {"WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "h"},
                       {"MASTER_PORT", "1"},
                       {"TORCHELASTIC_RUN_ID", "abc"}};
  job = discover_job(torchrun);
  EXPECT_EQ(job.job_id, "torchrun run abc");
  EXPECT_TRUE(job.hosts_store);
  EXPECT_TRUE(job.store_names_job);
  // torchrun's agent hosts a store that names no job: nothing to compare.
  torchrun["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  job = discover_job(torchrun);
  EXPECT_FALSE(job.hosts_store);
  EXPECT_FALSE(job.store_names_job);
}

TEST(DiscoverJob, OpenMpiFindsItsMasterFromMpirun) {
  Environment env{
      {"OMPI_COMM_WORLD_RANK", "1"},
      {"OMPI_COMM_WORLD_SIZE", "2"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
      {"OMPI_MCA_ess_base_jobid", "1206517761"},
      {"OMPI_MCA_orte_num_nodes", "1"},
      {"OMPI_MCA_orte_hnp_uri", "1206517760.0;tcp://192.0.2.2:37115;tcp6://[fd00::2]:32913"},
      {"OMPI_MCA_orte_local_daemon_uri",
       "1206517760.0;tcp://192.0.2.2:37115;tcp6://[fd00::2]:32913"}};
  // One node: the job meets on this host, on a port of its own.
  auto job = discover_job(env);
  EXPECT_EQ(job.job_id, "Open MPI job 1206517761");
  EXPECT_EQ(job.master_addr, "127.0.0.1");
  EXPECT_EQ(job.master_port, shoal::default_master_port("Open MPI job 1206517761"));
  EXPECT_FALSE(job.hosts_store);
  env["OMPI_COMM_WORLD_RANK"] = "0";
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
  EXPECT_TRUE(discover_job(env).hosts_store);
  // Several nodes: it meets at mpirun's host, where the first local worker hosts the store.
  env["OMPI_MCA_orte_num_nodes"] = "2";
  env["OMPI_MCA_orte_hnp_uri"] = "1.0;tcp://10.0.0.1,10.0.1.1:37115";
  env["OMPI_MCA_orte_local_daemon_uri"] = "1.0;tcp://10.0.0.1,10.0.1.1:37115";
  job = discover_job(env);
  EXPECT_EQ(job.master_addr, "10.0.0.1");
  EXPECT_EQ(job.master_described_as, "mpirun's host (OMPI_MCA_orte_hnp_uri)");
  EXPECT_TRUE(job.hosts_store);
  EXPECT_TRUE(job.on_master_host);
  // Every address of mpirun's, in Open MPI's order, for init() to settle on one.
  EXPECT_EQ(job.master_candidates, (std::vector<std::string>{"10.0.0.1", "10.0.1.1"}));
  // Rank 0 on another node than mpirun's does not host; the first worker on mpirun's does.
  env["OMPI_MCA_orte_local_daemon_uri"] = "1.1;tcp://10.0.0.2:41000";
  job = discover_job(env);
  EXPECT_FALSE(job.hosts_store);
  EXPECT_FALSE(job.on_master_host);
  env["OMPI_COMM_WORLD_RANK"] = "1";
  env["OMPI_MCA_orte_local_daemon_uri"] = env["OMPI_MCA_orte_hnp_uri"];
  EXPECT_TRUE(discover_job(env).hosts_store);
  // An address the user gives wins, and rank 0 hosts there.
  env["MASTER_ADDR"] = "head";
  job = discover_job(env);
  EXPECT_EQ(job.master_addr, "head");
  EXPECT_FALSE(job.hosts_store);
  EXPECT_TRUE(job.master_candidates.empty());
  // mpirun with one address names no candidates: there is nothing to settle.
  env.erase("MASTER_ADDR");
  env["OMPI_MCA_orte_hnp_uri"] = "1.0;tcp://10.0.0.1:37115";
  job = discover_job(env);
  EXPECT_EQ(job.master_addr, "10.0.0.1");
  EXPECT_TRUE(job.master_candidates.empty());
}

TEST(DiscoverJob, FirstSlurmHost) {
  EXPECT_EQ(shoal::first_slurm_host("node1"), "node1");
  EXPECT_EQ(shoal::first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(shoal::first_slurm_host("node[3-5]"), "node3");
  EXPECT_EQ(shoal::first_slurm_host("node[012,15-17],gpu2"), "node012");
  EXPECT_EQ(shoal::first_slurm_host("rack1-n[1-2]"), "rack1-n1");
  EXPECT_EQ(shoal::first_slurm_host("n[3-4]-ib,gpu1"), "n3-ib");
}

TEST(DiscoverJob, BadEnvironmentsNameTheVariable) {
  expect_usage_error({{"RANK", "1"}},
                     "RANK is set but WORLD_SIZE is not; a torchrun-style job needs RANK, WORLD_SIZE, "
                     "MASTER_ADDR and MASTER_PORT");
  expect_usage_error({{"WORLD_SIZE", "2"}},
                     "WORLD_SIZE is set but RANK is not; a torchrun-style job needs RANK, WORLD_SIZE, "
                     "MASTER_ADDR and MASTER_PORT");
  expect_usage_error({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}},
                     "RANK=4 must be less than WORLD_SIZE=4");
  expect_usage_error({{"RANK", "one"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}},
                     "RANK='one' is not an integer");
  expect_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}},
                     "WORLD_SIZE=0 is out of range: expected an integer at least 1");
  expect_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}},
                     "MASTER_ADDR is not set; a torchrun-style job of 2 workers needs the master's address");
  expect_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}},
                     "MASTER_PORT=70000 is out of range: expected an integer in [1, 65535]");
  expect_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                      {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}},
                     "LOCAL_RANK=2 must be less than LOCAL_WORLD_SIZE=2");
  expect_usage_error({{"SHOAL_RANK", "0"}},
                     "SHOAL_RANK is set but SHOAL_WORLD_SIZE is not; shoal run sets both (was this "
                     "process started by shoal run?)");
  expect_usage_error(
      {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},  // not from mpirun
      "an Open MPI job of 2 workers needs the master's address: set SHOAL_MASTER=HOST:PORT "
      "(or MASTER_ADDR and MASTER_PORT), or pass InitOptions::master");
  expect_usage_error({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SHOAL_MASTER", "head"}},
                     "SHOAL_MASTER='head' has no port; expected HOST:PORT with PORT in [1, 65535]");
  expect_usage_error({{"SLURM_PROCID", "0"}},
                     "SLURM_PROCID is set but SLURM_NTASKS is not; expected both from srun");
  expect_usage_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_ID", "0"}},
                     "SLURM_JOB_NODELIST is not set; a Slurm job of 2 workers needs it (or "
                     "SHOAL_MASTER=HOST:PORT) to find its master");
}

std::string launcher_name(Launcher launcher) {
  static const char* names[] = {"shoal", "torchrun", "openmpi", "slurm", "none"};
  return names[static_cast<int>(launcher)];
}

shoal::testing::WorkersOptions under(Launcher launcher, bool init = true) {
  shoal::testing::WorkersOptions options;
  options.launcher = launcher;
  options.init = init;
  return options;
}

// init() end to end: real processes, each launcher's variables, a working world group.
class InitUnder : public ::testing::TestWithParam<Launcher> {};

TEST_P(InitUnder, JoinsTheJobAndSplitsTheCores) {
  run_workers(2, [] {
    EXPECT_TRUE(shoal::is_initialized());
    EXPECT_EQ(shoal::world_size(), 2);
    EXPECT_EQ(shoal::is_main(), shoal::rank() == 0);
    EXPECT_EQ(shoal::local_rank(), shoal::rank());
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    EXPECT_EQ(at::get_num_threads(), std::max(1, cores / 2));
    auto t = torch::full({3}, float(shoal::rank() + 1));
    shoal::world().all_reduce(t);
    EXPECT_TRUE(torch::equal(t, torch::full({3}, 3.0f)));
  }, under(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Launchers, InitUnder,
                         ::testing::Values(Launcher::kShoal, Launcher::kTorchrun, Launcher::kOpenMpi,
                                           Launcher::kSlurm),
                         [](const auto& info) { return launcher_name(info.param); });

TEST(Init, UserThreadChoiceIsKept) {
  auto options = under(Launcher::kShoal);
  options.env = {{"SHOAL_NUM_THREADS", "3"}};
  run_workers(2, [] { EXPECT_EQ(at::get_num_threads(), 3); }, options);
}

TEST(Init, AJobOfOneNeedsNoLauncher) {
  run_workers(1, [] {
    EXPECT_EQ(shoal::job().launcher, "single");
    EXPECT_EQ(shoal::world_size(), 1);
    EXPECT_TRUE(shoal::is_main());
    auto t = torch::arange(4.0);
    shoal::world().all_reduce(t, {shoal::comm::ReduceOp::kAvg});
    EXPECT_TRUE(torch::equal(t, torch::arange(4.0)));
    EXPECT_TRUE(torch::equal(shoal::world().all_gather(t), t));
    EXPECT_THROW(shoal::init(), shoal::UsageError);
  }, under(Launcher::kNone));
}

TEST(Init, UnreachableMasterIsAUsageErrorInBoundedTime) {
  // Nobody listens on the port: the client keeps retrying until its connect timeout.
  const int port = shoal::testing::free_port();
  run_workers(1, [port] {
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    shoal::InitOptions options;
    options.connect_timeout = std::chrono::seconds(2);
    auto start = std::chrono::steady_clock::now();
    try {
      shoal::init(options);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      const std::string expected = "cannot reach the job's master at MASTER_ADDR:MASTER_PORT=127.0.0.1:" +
                                   std::to_string(port) + " after ";
      EXPECT_EQ(std::string(e.what()).rfind(expected, 0), 0u) << e.what();
    }
    // It kept trying for the whole connect timeout, and not much longer.
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(waited, 1.8);
    EXPECT_LT(waited, 15.0);  // a failure bound, far below the 60 s default
    EXPECT_FALSE(shoal::is_initialized());
    EXPECT_THROW(shoal::world_size(), shoal::UsageError);
  }, under(Launcher::kNone, false));
}

// Note [Job identity] (docs/runtime.md): the store's host names the job; a joiner compares first.
TEST(JobIdentity, AWorkerNeverJoinsAnotherJobsStore) {
  shoal::comm::StoreOptions host;
  host.is_server = true;
  host.port = 0;
  host.job_id = "Slurm job 1 step 0";
  auto store = shoal::comm::open_store(host);
  const int port = shoal::comm::hosted_port(store);

  shoal::comm::StoreOptions joiner;
  joiner.port = port;
  joiner.described_as = "MASTER_ADDR:MASTER_PORT";
  joiner.timeout = std::chrono::seconds(5);
  joiner.job_id = "Slurm job 2 step 0";
  try {
    shoal::comm::open_store(joiner);
    ADD_FAILURE() << "joined another job's store";
  } catch (const shoal::UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the store at MASTER_ADDR:MASTER_PORT=127.0.0.1:" + std::to_string(port) +
                  " belongs to Slurm job 1 step 0, not to this job (Slurm job 2 step 0); give each "
                  "job a port of its own");
  }
  joiner.job_id = "Slurm job 1 step 0";
  auto joined = shoal::comm::open_store(joiner);
  EXPECT_EQ(shoal::comm::try_get(joined, shoal::comm::kJobIdKey), "Slurm job 1 step 0");

  // A store that names no job (not a shoal job's): the joiner gives up within its timeout.
  shoal::comm::StoreOptions plain;
  plain.is_server = true;
  plain.port = 0;
  auto other = shoal::comm::open_store(plain);
  joiner.port = shoal::comm::hosted_port(other);
  joiner.timeout = std::chrono::seconds(1);
  const auto start = std::chrono::steady_clock::now();
  try {
    shoal::comm::open_store(joiner);
    ADD_FAILURE() << "joined a store that names no job";
  } catch (const shoal::UsageError& e) {
    const std::string expected =
        "the store at MASTER_ADDR:MASTER_PORT=127.0.0.1:" + std::to_string(joiner.port) +
        " gave no job id within ";
    EXPECT_EQ(std::string(e.what()).rfind(expected, 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("it is not a shoal job's store"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

TEST(JobIdentity, AMasterNameThatDoesNotResolveSaysSo) {
  run_workers(
      1,
      [] {
        // A two-node Slurm job whose node names do not resolve.
        setenv("SLURM_JOB_ID", "5", 1);
        setenv("SLURM_STEP_ID", "0", 1);
        setenv("SLURM_PROCID", "0", 1);
        setenv("SLURM_NTASKS", "2", 1);
        setenv("SLURM_JOB_NODELIST", "shoal-no-such-node[1-2].invalid", 1);
        shoal::InitOptions options;
        options.connect_timeout = std::chrono::seconds(5);
        try {
          shoal::init(options);
          ADD_FAILURE() << "expected UsageError";
        } catch (const shoal::UsageError& e) {
          const std::string what = e.what();
          EXPECT_EQ(
              what.rfind("cannot resolve the job's master host 'shoal-no-such-node1.invalid' (the "
                         "first host of SLURM_JOB_NODELIST): ",
                         0),
              0u)
              << what;
          EXPECT_NE(
              what.find("; set MASTER_ADDR (or SHOAL_MASTER=HOST:PORT) to a name or address of the "
                        "job's first node that every worker resolves"),
              std::string::npos)
              << what;
        }
      },
      under(Launcher::kNone, false));
}

TEST(JobIdentity, APortInUseIsOneLineWithoutC10dLogging) {
  auto exits = run_workers(
      1,
      [] {
        // Something else listens on the port rank 0 is told to host the store on.
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_addr.s_addr = htonl(INADDR_ANY);
        ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
        ASSERT_EQ(listen(fd, 1), 0);
        socklen_t length = sizeof(address);
        getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
        const int port = ntohs(address.sin_port);
        setenv("RANK", "0", 1);
        setenv("WORLD_SIZE", "2", 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        try {
          shoal::init();
          ADD_FAILURE() << "expected UsageError";
        } catch (const shoal::UsageError& e) {
          const std::string expected =
              "cannot host the job's store on MASTER_ADDR:MASTER_PORT (port " +
              std::to_string(port) + "): ";
          EXPECT_EQ(std::string(e.what()).rfind(expected, 0), 0u) << e.what();
          EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
        }
      },
      under(Launcher::kNone, false));
  ASSERT_EQ(exits.size(), 1u);
  // c10d logs failed binds through c10's logging ("[W socket.cpp:...] [c10d] ..."): none of it.
  EXPECT_EQ(exits[0].output.find("c10d"), std::string::npos) << exits[0].output;
  EXPECT_EQ(exits[0].output.find("socket.cpp"), std::string::npos) << exits[0].output;
}

// Note [A wrong environment fails every worker at once] (src/runtime/init.cpp), with the wrong
// worker hosting the store (rank 0) or joining it (rank 1).
class WrongEnvironment : public ::testing::TestWithParam<int> {};

TEST_P(WrongEnvironment, EveryWorkerLearnsItAtOnce) {
  const int wrong = GetParam();
  auto options = under(Launcher::kSlurm, false);
  options.env = {{"SLURM_JOB_ID", "77"}};
  run_workers(
      2,
      [wrong] {
        const int rank = std::atoi(std::getenv("SLURM_PROCID"));
        if (rank == wrong) setenv("SLURM_LOCALID", "7", 1);
        shoal::InitOptions init;
        init.connect_timeout = std::chrono::seconds(60);
        const auto start = std::chrono::steady_clock::now();
        const std::string cause = "SLURM_LOCALID=7 must be less than SLURM_NTASKS_PER_NODE=2";
        try {
          shoal::init(init);
          ADD_FAILURE() << "expected UsageError";
        } catch (const shoal::UsageError& e) {
          const std::string what = e.what();
          if (rank == wrong) {
            EXPECT_EQ(what, cause);
          } else {
            EXPECT_EQ(what.rfind("the job cannot start: a worker on host ", 0), 0u) << what;
            EXPECT_NE(what.find(" found: " + cause), std::string::npos) << what;
          }
        }
        // A failure bound only: far less than the connect timeout every worker would otherwise
        // wait.
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_LT(waited, 30.0);
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Rank, WrongEnvironment, ::testing::Values(0, 1));

}  // namespace
