// shoal programs under a real Open MPI `mpirun` (Debian's openmpi-bin): the job is found from
// Open MPI's own environment, with no address given (docs/runtime.md). Skips with a message
// where mpirun is missing.
#include <unistd.h>

#include <map>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>

#include "harness.h"
#include "slurm_cluster.h"
#include "test_paths.h"

namespace {

using shoal::testing::Command;
using shoal::testing::CommandResult;
using shoal::testing::launched_results;

const std::string kWorker = std::string(SHOAL_TEST_PROGRAMS_DIR) + "/launched_worker";

std::vector<std::string> mpirun(int n, std::vector<std::string> extra = {}) {
  // As root Open MPI wants to be told; --oversubscribe: more ranks than this machine's cores.
  std::vector<std::string> argv{"mpirun", "--allow-run-as-root", "--oversubscribe", "-n",
                                std::to_string(n)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(kWorker);
  return argv;
}

#define SKIP_WITHOUT_MPIRUN()                 \
  if (::access("/usr/bin/mpirun", X_OK) != 0) \
  GTEST_SKIP() << "mpirun is not installed (scripts/setup.sh installs openmpi-bin)"

TEST(OpenMpi, MpirunAloneIsEnough) {
  SKIP_WITHOUT_MPIRUN();
  Command run(mpirun(3));
  const CommandResult result = run.wait(std::chrono::seconds(120));
  ASSERT_EQ(result.exit_code, 0) << describe(result);
  auto by_rank = launched_results(result.out);
  ASSERT_EQ(by_rank.size(), 3u) << describe(result);
  const std::regex job_id(R"(Open MPI job \d+)");
  for (const auto& [rank, r] : by_rank) {
    EXPECT_EQ(r.world, 3);
    EXPECT_EQ(r.sum, 6);  // 1 + 2 + 3
    EXPECT_EQ(r.local, rank);
    EXPECT_EQ(r.local_size, 3);
    EXPECT_TRUE(std::regex_match(r.job, job_id)) << r.job;
    EXPECT_EQ(r.job, by_rank.at(0).job);
    // One node: the job meets on this host, at the port derived from its id.
    EXPECT_EQ(r.master.rfind("127.0.0.1:", 0), 0u) << r.master;
  }
}

TEST(OpenMpi, AnAddressGivenWins) {
  SKIP_WITHOUT_MPIRUN();
  const std::string port = std::to_string(shoal::testing::free_port());
  Command run(mpirun(2, {"-x", "SHOAL_MASTER=127.0.0.1:" + port}));
  const CommandResult result = run.wait(std::chrono::seconds(120));
  ASSERT_EQ(result.exit_code, 0) << describe(result);
  auto by_rank = launched_results(result.out);
  ASSERT_EQ(by_rank.size(), 2u) << describe(result);
  for (const auto& [rank, r] : by_rank) {
    EXPECT_EQ(r.sum, 3);
    EXPECT_EQ(r.master, "127.0.0.1:" + port);
  }
}

}  // namespace
