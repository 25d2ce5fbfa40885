// shoal programs under a real Open MPI `mpirun` (Debian's openmpi-bin): the job is found from
// Open MPI's own environment, with no address given (docs/runtime.md), on this host and across
// two "hosts" made of network namespaces. Skips with a message where mpirun is missing, and the
// two-host tests also where namespaces cannot be made (not root).
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "harness.h"
#include "netns.h"
#include "slurm_cluster.h"
#include "test_paths.h"

namespace {

using shoal::testing::Command;
using shoal::testing::CommandResult;
using shoal::testing::launched_results;
using shoal::testing::test_programs_dir;
using shoal::testing::TwoHosts;

const std::string kWorker = test_programs_dir() + "/launched_worker";
const std::string kHostWorker = test_programs_dir() + "/host_worker";

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

// --- Two hosts ----------------------------------------------------------------------------
//
// mpirun runs on host 0 and starts its daemon on host 1 through an rsh agent that enters host
// 1's namespaces instead of ssh; each host has its own host name and /etc/hosts, and Open MPI's
// own traffic is kept to the veth subnet (but where host 0 has another network). The workers
// (programs/host_worker.cpp) see no SHOAL_MASTER, MASTER_ADDR or MASTER_PORT.

// What host_worker prints: its "result" line and its "trained" line.
struct HostResult {
  int rank = -1, world = 0, local = -1, local_size = 0;
  std::string host, netns, via, master, candidates;
  double sum = 0;
  bool vector_ok = false;
  int steps = 0;
  double loss = 0;
  std::vector<double> params;
};

std::vector<double> parse_numbers(const std::string& text) {
  std::vector<double> numbers;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) numbers.push_back(std::stod(item));
  return numbers;
}

std::map<int, HostResult> host_results(const std::string& out) {
  static const std::regex result(
      R"(result rank=(\d+) world=(\d+) local=(\d+)/(\d+) host=(\S+) netns=(\S+) via=(\S+) )"
      R"(master=(\S+) candidates=(\S+) sum=(\S+) vector=(\w+))");
  static const std::regex trained(R"(trained rank=(\d+) steps=(\d+) loss=(\S+) params=(\S+))");
  std::map<int, HostResult> found;
  std::istringstream lines(out);
  for (std::string text; std::getline(lines, text);) {
    std::smatch m;
    if (std::regex_search(text, m, result)) {
      HostResult& r = found[std::stoi(m[1])];
      r.rank = std::stoi(m[1]);
      r.world = std::stoi(m[2]);
      r.local = std::stoi(m[3]);
      r.local_size = std::stoi(m[4]);
      r.host = m[5];
      r.netns = m[6];
      r.via = m[7];
      r.master = m[8];
      r.candidates = m[9];
      r.sum = std::stod(m[10]);
      r.vector_ok = m[11] == "OK";
    } else if (std::regex_search(text, m, trained)) {
      HostResult& r = found[std::stoi(m[1])];
      r.steps = std::stoi(m[2]);
      r.loss = std::stod(m[3]);
      r.params = parse_numbers(m[4]);
    }
  }
  return found;
}

// The same program run alone (a job of one): the oracle for the trained parameters.
const HostResult& trained_alone() {
  static const HostResult alone = [] {
    Command run({"env", "-u", "SHOAL_MASTER", "-u", "MASTER_ADDR", kHostWorker});
    const CommandResult result = run.wait(std::chrono::seconds(60));
    EXPECT_EQ(result.exit_code, 0) << describe(result);
    auto by_rank = host_results(result.out);
    EXPECT_EQ(by_rank.size(), 1u) << describe(result);
    return by_rank.count(0) ? by_rank.at(0) : HostResult{};
  }();
  return alone;
}

std::string single_quoted(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

std::string own_network_namespace() {
  std::error_code error;
  return std::filesystem::read_symlink("/proc/self/ns/net", error).string();
}

// An address of host 0 on a network that host 1 routes to but cannot reach.
constexpr const char* kOtherNetwork = "10.78.9.1/24";
constexpr const char* kOtherAddress = "10.78.9.1";

class OpenMpiTwoHosts : public ::testing::Test {
 protected:
  // Host 0 with another network listed first, which host 1 routes through a gateway that does
  // not answer: connections there hang, as to a network of the head node's that compute nodes
  // cannot reach.
  virtual bool multi_homed() const { return false; }

  void SetUp() override {
    SKIP_WITHOUT_MPIRUN();
    if (auto problem = hosts_.create(multi_homed() ? kOtherNetwork : "")) {
      GTEST_SKIP() << "cannot build the two hosts: " << *problem;
    }
    if (multi_homed()) {
      const std::string route = hosts_.in(1, "ip route add 10.78.9.0/24 via 10.78.0.3");
      std::string output;
      ASSERT_EQ(shoal::testing::shell(route, &output), 0) << route << ": " << output;
    }
    char pattern[] = "/tmp/shoal-mpi-hosts-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    hosts_path_ = dir_ + "/hosts";
    std::ofstream(hosts_path_) << hosts_.hosts_file();
    // Open MPI calls the agent as ssh: HOST COMMAND..., the command's words to be run by a shell.
    agent_path_ = dir_ + "/rsh-agent";
    std::ostringstream agent;
    agent << "#!/bin/sh\n"
          << "# Open MPI's rsh agent for the test's hosts: HOST COMMAND... as ssh would run it.\n"
          << "case \"$1\" in\n";
    for (int host : {0, 1}) {
      agent << "  " << single_quoted(hosts_.name(host)) << ") shift; exec";
      for (const auto& word : hosts_.on_host(host, hosts_path_))
        agent << " " << single_quoted(word);
      agent << " /bin/sh -c \"$*\" ;;\n";
    }
    agent << "  *) echo \"rsh-agent: no host named $1\" >&2; exit 255 ;;\nesac\n";
    std::ofstream(agent_path_) << agent.str();
    ASSERT_EQ(::chmod(agent_path_.c_str(), 0755), 0);
  }

  void TearDown() override {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  // mpirun on host 0 with `slots[i]` ranks on host i, no address in the environment. Open MPI's
  // own traffic keeps to the link's subnet, except on a multi-homed host 0, where it is left to
  // find its way as shoal is.
  CommandResult run_mpirun(const std::vector<int>& slots) {
    const std::string subnet = std::string(TwoHosts::kAddressA) + "/24";
    std::vector<std::string> argv = hosts_.on_host(0, hosts_path_);
    std::vector<std::string> command = {"env",
                                        "-u",
                                        "SHOAL_MASTER",
                                        "-u",
                                        "MASTER_ADDR",
                                        "-u",
                                        "MASTER_PORT",  //
                                        "mpirun",
                                        "--allow-run-as-root",  //
                                        "--host",
                                        hosts_.name(0) + ":" + std::to_string(slots[0]) + "," +
                                            hosts_.name(1) + ":" + std::to_string(slots[1]),
                                        "-n",
                                        std::to_string(slots[0] + slots[1]),  //
                                        "--mca",
                                        "plm_rsh_agent",
                                        agent_path_,  //
                                        "--mca",
                                        "btl",
                                        "self,tcp"};
    if (!multi_homed()) {
      for (const char* option : {"oob_tcp_if_include", "btl_tcp_if_include"}) {
        command.insert(command.end(), {"--mca", option, subnet});
      }
    }
    command.push_back(kHostWorker);
    argv.insert(argv.end(), command.begin(), command.end());
    Command run(argv);
    return run.wait(std::chrono::seconds(120));
  }

  // Checks the world each worker saw (ranks by slot, host by host), the all-reduce, where the
  // workers met, and that training equals the job of one.
  void check_job(const CommandResult& result, const std::vector<int>& slots) {
    ASSERT_EQ(result.exit_code, 0) << describe(result);
    const auto by_rank = host_results(result.out);
    const int world = slots[0] + slots[1];
    ASSERT_EQ(by_rank.size(), static_cast<size_t>(world)) << describe(result);
    const HostResult& alone = trained_alone();
    ASSERT_FALSE(alone.params.empty());
    const std::string here = own_network_namespace();
    std::map<int, std::set<std::string>> namespaces;  // host -> its workers' network namespaces
    for (const auto& [rank, r] : by_rank) {
      ASSERT_EQ(r.rank, rank) << "rank " << rank << " printed no result line\n" << describe(result);
      // Open MPI maps by slot: host 0's ranks first.
      const int host = rank < slots[0] ? 0 : 1;
      EXPECT_EQ(r.world, world);
      EXPECT_EQ(r.host, hosts_.name(host)) << "rank " << rank;
      EXPECT_EQ(r.local, host == 0 ? rank : rank - slots[0]) << "rank " << rank;
      EXPECT_EQ(r.local_size, slots[host]) << "rank " << rank;
      EXPECT_EQ(r.sum, world * (world + 1) / 2) << "rank " << rank;
      EXPECT_TRUE(r.vector_ok) << "rank " << rank;
      // The job meets on mpirun's host at its veth address; host 1's workers reach it over the
      // link, from a network namespace of their own.
      EXPECT_EQ(r.master.rfind(std::string(TwoHosts::kAddressA) + ":", 0), 0u)
          << "rank " << rank << " met at " << r.master;
      EXPECT_EQ(r.via, host == 0 ? TwoHosts::kAddressA : TwoHosts::kAddressB) << "rank " << rank;
      EXPECT_EQ(r.master, by_rank.begin()->second.master);
      // With one address, mpirun's is the one to meet at; with several, the one host 1 reached.
      EXPECT_EQ(r.candidates,
                multi_homed() ? std::string(kOtherAddress) + "," + TwoHosts::kAddressA : "-")
          << "rank " << rank;
      EXPECT_NE(r.netns, here) << "rank " << rank << " ran in the test's network namespace";
      namespaces[host].insert(r.netns);
      // Training equals one process: the same steps, the same parameters up to summation order.
      EXPECT_EQ(r.steps, alone.steps) << "rank " << rank;
      EXPECT_NEAR(r.loss, alone.loss, 1e-5) << "rank " << rank;
      ASSERT_EQ(r.params.size(), alone.params.size()) << "rank " << rank;
      for (size_t i = 0; i < r.params.size(); ++i) {
        EXPECT_NEAR(r.params[i], alone.params[i], 1e-5) << "rank " << rank << ", parameter " << i;
      }
    }
    EXPECT_EQ(namespaces[0].size(), 1u);
    EXPECT_EQ(namespaces[1].size(), 1u);
    EXPECT_NE(namespaces[0], namespaces[1]) << "both hosts ran in the same network namespace";
  }

  TwoHosts hosts_;  // declared first: its namespaces outlive what runs in them
  std::string dir_, hosts_path_, agent_path_;
};

TEST_F(OpenMpiTwoHosts, TwoRanksOnEachHost) {
  const std::vector<int> slots = {2, 2};
  check_job(run_mpirun(slots), slots);
}

TEST_F(OpenMpiTwoHosts, TwoRanksOnOneHostAndOneOnTheOther) {
  const std::vector<int> slots = {2, 1};
  check_job(run_mpirun(slots), slots);
}

class OpenMpiMultiHomedHost : public OpenMpiTwoHosts {
 protected:
  bool multi_homed() const override { return true; }
};

// mpirun's URI lists the unreachable address first: host 1's workers try the next one, and
// mpirun's host learns which they reached before its workers bind the world group.
TEST_F(OpenMpiMultiHomedHost, TheJobMeetsAtTheAddressTheOtherHostReaches) {
  const std::vector<int> slots = {2, 1};
  check_job(run_mpirun(slots), slots);
}

}  // namespace
