// Job discovery: every launcher's environment, every bad environment (asserting the error
// text), and init() end to end in real processes under each launcher's conventions.
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <thread>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
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
  Environment env{{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                  {"SLURM_TASKS_PER_NODE", "2(x4)"}, {"SLURM_JOB_NODELIST", "gpu[07-10],cpu1"}};
  auto job = discover_job(env);
  EXPECT_EQ(job.launcher, "slurm");
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.world_size, 8);
  EXPECT_EQ(job.local_rank, 1);
  EXPECT_EQ(job.local_world_size, 2);
  EXPECT_EQ(job.master_addr, "gpu07");
  EXPECT_EQ(job.master_port, 29500);
  env["MASTER_PORT"] = "1234";
  EXPECT_EQ(discover_job(env).master_port, 1234);
}

TEST(DiscoverJob, FirstSlurmHost) {
  EXPECT_EQ(shoal::first_slurm_host("node1"), "node1");
  EXPECT_EQ(shoal::first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(shoal::first_slurm_host("node[3-5]"), "node3");
  EXPECT_EQ(shoal::first_slurm_host("node[012,15-17],gpu2"), "node012");
  EXPECT_EQ(shoal::first_slurm_host("rack1-n[1-2]"), "rack1-n1");
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
  expect_usage_error({{"RANK", "one"}, {"WORLD_SIZE", "4"}}, "RANK='one' is not an integer");
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
  expect_usage_error({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
                     "an Open MPI job of 2 workers needs the master's address: set SHOAL_MASTER=HOST:PORT "
                     "(or MASTER_ADDR and MASTER_PORT), or pass InitOptions::master");
  expect_usage_error({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SHOAL_MASTER", "head"}},
                     "SHOAL_MASTER='head' has no port; expected HOST:PORT with PORT in [1, 65535]");
  expect_usage_error({{"SLURM_PROCID", "0"}},
                     "SLURM_PROCID is set but SLURM_NTASKS is not; expected both from srun");
  expect_usage_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}},
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
    EXPECT_LT(waited, 5.0);
    EXPECT_FALSE(shoal::is_initialized());
    EXPECT_THROW(shoal::world_size(), shoal::UsageError);
  }, under(Launcher::kNone, false));
}

}  // namespace
