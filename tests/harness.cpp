#include "harness.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

#include "netns.h"
#include "comm/store.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"
#include "shoal/init.h"

extern char** environ;

namespace shoal::testing {
namespace {

constexpr const char* kWorkerCall = "SHOAL_TEST_WORKER_CALL";

// Variables that would make a worker believe it belongs to another job. Not the settings a user
// sets around a launcher, which passes them on (docs/comm.md, docs/runtime.md): a test run with
// SHOAL_COMM=tcp (the Tcp.* tests) must have its workers on Gloo's TCP path.
bool is_job_variable(const std::string& name) {
  static const std::set<std::string> settings = {"SHOAL_COMM",     "SHOAL_COMM_FLAT_BELOW", "SHOAL_SHM_SPINS",
                                                 "SHOAL_TIMELINE", "SHOAL_TIMELINE_MAX_EVENTS",
                                                 "SHOAL_SOCKET_IFNAME", "SHOAL_ELASTIC_DEBUG", "SHOAL_LOG_LEVEL"};
  if (settings.count(name) > 0) return false;
  static const char* prefixes[] = {"SHOAL_", "OMPI_", "SLURM_", "TORCHELASTIC_"};
  for (auto* prefix : prefixes) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  static const std::set<std::string> names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                              "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                                              "OMP_NUM_THREADS"};
  return names.count(name) > 0;
}

std::map<std::string, std::string> job_environment(Launcher launcher, int rank, int n, int port,
                                                   const std::string& run_id) {
  const std::string r = std::to_string(rank), size = std::to_string(n), p = std::to_string(port);
  switch (launcher) {
    case Launcher::kShoal:
      return {{"SHOAL_RANK", r},
              {"SHOAL_WORLD_SIZE", size},
              {"SHOAL_LOCAL_RANK", r},
              {"SHOAL_LOCAL_WORLD_SIZE", size},
              {"SHOAL_MASTER_ADDR", "127.0.0.1"},
              {"SHOAL_MASTER_PORT", p},
              {"SHOAL_RUN_ID", run_id}};
    case Launcher::kTorchrun:
      return {{"RANK", r}, {"WORLD_SIZE", size}, {"LOCAL_RANK", r}, {"LOCAL_WORLD_SIZE", size},
              {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", p}};
    case Launcher::kOpenMpi:
      return {{"OMPI_COMM_WORLD_RANK", r}, {"OMPI_COMM_WORLD_SIZE", size},
              {"OMPI_COMM_WORLD_LOCAL_RANK", r}, {"OMPI_COMM_WORLD_LOCAL_SIZE", size},
              {"SHOAL_MASTER", "127.0.0.1:" + p}};
    case Launcher::kSlurm:
      return {{"SLURM_PROCID", r},
              {"SLURM_NTASKS", size},
              {"SLURM_LOCALID", r},
              {"SLURM_NTASKS_PER_NODE", size},
              {"SLURM_JOB_NODELIST", "localhost"},
              {"SLURM_STEP_ID", "0"},
              {"MASTER_PORT", p}};
    case Launcher::kNone:
      return {};
  }
  return {};
}

std::string current_test_name() {
  auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// The number of run_workers calls made so far by the current test.
int next_call_index() {
  static std::string test;
  static int calls = 0;
  auto name = current_test_name();
  if (name != test) {
    test = name;
    calls = 0;
  }
  return calls++;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (SIG" + sigabbrev_np(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

[[noreturn]] void run_body(const std::function<void()>& body, const WorkersOptions& options) {
  int code = 0;
  try {
    if (options.init) shoal::init();
    body();
    code = ::testing::Test::HasFailure() ? 1 : 0;
  } catch (const std::exception& e) {
    std::cout << "worker body threw: " << e.what() << std::endl;
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  shoal::timeline::flush();  // _exit skips the timeline's own flush at exit
  std::fflush(nullptr);
  _exit(code);  // skip static destructors: peers may still be connected
}

// Note [Workers forked from a copy made at start]
// Loading LibTorch costs a process about a second of CPU on the CI machine (symbol lookups over
// its few hundred shared libraries, then the registration of its operators), and the suite
// starts well over a thousand workers. So each test process forks a worker server first thing
// in main(): one thread, LibTorch loaded, no test started. The server waits on a socket.
// run_workers asks it for each worker, and it forks one. The worker sets its own environment,
// output and network namespace, and goes on in main() as an exec'd copy of the binary would,
// filtered to the current test. The workers are real processes, as before. The server is their
// parent, so run_workers asks it how they ended. SHOAL_TEST_EXEC_WORKERS=1 makes run_workers
// exec every worker afresh, as it did before.
struct WorkerServer {
  int fd = -1;  // the test process's end of the socket; -1: exec each worker
  std::mutex mutex;
};

WorkerServer& worker_server() {
  static WorkerServer server;
  return server;
}

std::string join_fields(const std::vector<std::string>& fields) {
  std::string message;
  for (const auto& field : fields) message.append(field).push_back('\0');
  return message;
}

std::vector<std::string> split_fields(const char* data, size_t size) {
  std::vector<std::string> fields;
  size_t start = 0;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] != '\0') continue;
    fields.emplace_back(data + start, i - start);
    start = i + 1;
  }
  return fields;
}

// The worker's side of a fork, in the child of either the server or the test process: raw calls
// only, as the test process has threads. Returns false when the child must end with 126.
bool enter_worker(const std::string& netns_path, const std::string& output) {
  if (!netns_path.empty()) {
    const int netns = open(netns_path.c_str(), O_RDONLY);
    if (netns < 0 || setns(netns, CLONE_NEWNET) != 0) return false;
    close(netns);
  }
  int fd = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dup2(fd, 1);
  dup2(fd, 2);
  close(fd);
  return true;
}

// The server's loop: "spawn NETNS OUTPUT FILTER ENV..." forks a worker and answers its pid;
// "wait PID block|poll" answers waitpid's result and status. Returns only in a worker, with its
// arguments; ends when the test process closes its end.
std::vector<std::string> serve(int fd, const std::string& program) {
  static char buffer[1 << 18];
  const pid_t self = getpid();
  for (;;) {
    const ssize_t size = recv(fd, buffer, sizeof(buffer), MSG_TRUNC);
    if (size <= 0) _exit(0);
    int64_t reply[2] = {-EINVAL, 0};
    if (static_cast<size_t>(size) > sizeof(buffer)) {  // cut short: not read
      reply[0] = -EMSGSIZE;
      send(fd, reply, sizeof(reply), MSG_NOSIGNAL);
      continue;
    }
    const auto fields = split_fields(buffer, static_cast<size_t>(size));
    if (fields.size() >= 4 && fields[0] == "spawn") {
      const pid_t pid = fork();
      if (pid == 0) {
        close(fd);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != self) _exit(127);
        if (!enter_worker(fields[1], fields[2])) _exit(126);
        clearenv();
        for (size_t i = 4; i < fields.size(); ++i) putenv(strdup(fields[i].c_str()));
        return {program, fields[3]};
      }
      reply[0] = pid < 0 ? -errno : pid;
    } else if (fields.size() == 3 && fields[0] == "wait") {
      int status = 0;
      reply[0] = waitpid(std::stoi(fields[1]), &status, fields[2] == "block" ? 0 : WNOHANG);
      reply[1] = status;
    }
    send(fd, reply, sizeof(reply), MSG_NOSIGNAL);
  }
}

// One request to the server and its answer.
std::pair<int64_t, int> ask_server(const std::vector<std::string>& fields) {
  WorkerServer& server = worker_server();
  std::lock_guard<std::mutex> lock(server.mutex);
  const std::string message = join_fields(fields);
  int64_t reply[2] = {0, 0};
  if (send(server.fd, message.data(), message.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(message.size())) {
    return {-errno, 0};
  }
  const ssize_t got = recv(server.fd, reply, sizeof(reply), 0);
  if (got != static_cast<ssize_t>(sizeof(reply))) return {got < 0 ? -errno : -EPIPE, 0};
  return {reply[0], static_cast<int>(reply[1])};
}

// waitpid for a worker, whoever its parent is.
pid_t wait_worker(pid_t pid, int* status, bool block) {
  if (worker_server().fd < 0) return waitpid(pid, status, block ? 0 : WNOHANG);
  const auto [result, code] = ask_server({"wait", std::to_string(pid), block ? "block" : "poll"});
  if (status != nullptr) *status = code;
  return static_cast<pid_t>(result);
}

}  // namespace

std::vector<std::string> start_worker_server(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  const char* exec = std::getenv("SHOAL_TEST_EXEC_WORKERS");
  if (is_worker() || (exec != nullptr && std::string(exec) == "1")) return args;
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) return args;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return args;
  }
  if (pid > 0) {
    close(fds[1]);
    worker_server().fd = fds[0];
    return args;
  }
  // The server: it ends with the test process, and keeps none of its output open.
  close(fds[0]);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(0);
  const int null = open("/dev/null", O_RDWR);
  dup2(null, 0);
  dup2(null, 1);
  dup2(null, 2);
  close(null);
  return serve(fds[1], args[0]);
}

bool is_worker() { return std::getenv(kWorkerCall) != nullptr; }

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

std::vector<WorkerExit> run_workers(int n, const std::function<void()>& body,
                                    const WorkersOptions& options) {
  const int call = next_call_index();
  if (is_worker()) {
    if (std::atoi(std::getenv(kWorkerCall)) == call) run_body(body, options);
    return {};
  }

  // The test process plays the launcher: it hosts the store (for launchers that do) and records
  // how each worker ended, as `shoal run` does.
  comm::StorePtr store;
  int port = free_port();
  const std::string run_id = "test" + std::to_string(getpid()) + "-" + std::to_string(call);
  const int hosts = static_cast<int>(options.hosts.size());
  if (hosts > 0 && options.launcher != Launcher::kShoal) {
    ADD_FAILURE() << "run_workers: WorkersOptions::hosts needs Launcher::kShoal";
    return {};
  }
  if (options.launcher == Launcher::kShoal) {
    comm::StoreOptions store_options;
    store_options.is_server = true;
    store_options.port = 0;
    store_options.job_id = "shoal run " + run_id;  // as shoal run names its job
    if (hosts == 0) {
      store = comm::open_store(store_options);
    } else {
      // Hosted inside the first host: a thread of its own enters that network namespace (setns
      // moves only the calling thread), and the store's sockets stay there.
      std::string problem;
      std::thread([&] {
        try {
          InNetworkNamespace host(options.hosts[0]);
          store = comm::open_store(store_options);
        } catch (const std::exception& e) {
          problem = e.what();
        }
      }).join();
      if (!store) {
        ADD_FAILURE() << "run_workers: cannot host the store in " << options.hosts[0] << ": "
                      << problem;
        return {};
      }
    }
    port = comm::hosted_port(store);
  }

  char directory_template[] = "/tmp/shoal-test-XXXXXX";
  const std::string directory = mkdtemp(directory_template);
  std::vector<pid_t> pids(n);
  for (int rank = 0; rank < n; ++rank) {
    std::vector<std::string> env_strings;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      std::string text(*entry);
      if (!is_job_variable(text.substr(0, text.find('=')))) env_strings.push_back(text);
    }
    auto job = job_environment(options.launcher, rank, n, port, run_id);
    const int host = hosts > 0 ? rank * hosts / n : 0;
    if (hosts > 0) {
      int first = 0, last = 0;  // this host's ranks: [first, last)
      while (first * hosts / n < host) ++first;
      for (last = first; last < n && last * hosts / n == host; ++last) {
      }
      job["SHOAL_LOCAL_RANK"] = std::to_string(rank - first);
      job["SHOAL_LOCAL_WORLD_SIZE"] = std::to_string(last - first);
      job["SHOAL_MASTER_ADDR"] = options.master_address;
    }
    for (auto& [key, value] : job) env_strings.push_back(key + "=" + value);
    for (auto& [key, value] : options.env) env_strings.push_back(key + "=" + value);
    env_strings.push_back(std::string(kWorkerCall) + "=" + std::to_string(call));
    const std::string filter = "--gtest_filter=" + current_test_name();
    const std::string output = directory + "/worker" + std::to_string(rank) + ".log";
    const std::string netns_path = hosts > 0 ? "/run/netns/" + options.hosts[host] : "";

    if (worker_server().fd >= 0) {
      std::vector<std::string> request{"spawn", netns_path, output, filter};
      request.insert(request.end(), env_strings.begin(), env_strings.end());
      const int64_t pid = ask_server(request).first;
      if (pid <= 0) {
        ADD_FAILURE() << "run_workers: the worker server could not start worker " << rank << ": "
                      << std::strerror(static_cast<int>(-pid));
        for (int started = 0; started < rank; ++started) {
          kill(pids[started], SIGKILL);
          wait_worker(pids[started], nullptr, true);
        }
        rmdir(directory.c_str());
        return {};
      }
      pids[rank] = static_cast<pid_t>(pid);
      continue;
    }
    std::vector<char*> argv{const_cast<char*>("/proc/self/exe"), const_cast<char*>(filter.c_str()), nullptr};
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(const_cast<char*>(s.c_str()));
    envp.push_back(nullptr);
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (!enter_worker(netns_path, output)) _exit(126);
      execve("/proc/self/exe", argv.data(), envp.data());
      _exit(127);
    }
    pids[rank] = pid;
  }

  std::vector<WorkerExit> exits(n);
  std::vector<bool> running(n, true);
  int left = n;
  Deadline deadline(options.timeout);
  while (left > 0) {
    bool reaped = false;
    for (int rank = 0; rank < n; ++rank) {
      int status = 0;
      if (!running[rank] || wait_worker(pids[rank], &status, false) != pids[rank]) continue;
      running[rank] = false;
      --left;
      reaped = true;
      exits[rank].rank = rank;
      exits[rank].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      exits[rank].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      if (store) comm::put(store, comm::worker_exit_key(rank), describe_exit(status));
    }
    // Stragglers go once everyone else is done.
    int others_left = 0;
    for (int rank = 0; rank < n; ++rank) others_left += running[rank] && !options.stragglers.count(rank);
    if (others_left == 0) {
      for (int rank : options.stragglers) if (running[rank]) kill(pids[rank], SIGKILL);
    }
    if (deadline.expired()) {
      for (int rank = 0; rank < n; ++rank) {
        if (running[rank]) {
          ADD_FAILURE() << "worker " << rank << " still running after " << format_duration(options.timeout);
          kill(pids[rank], SIGKILL);
        }
      }
      for (int rank = 0; rank < n; ++rank) {
        if (running[rank]) wait_worker(pids[rank], nullptr, true);
        exits[rank].rank = rank;
      }
      break;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }

  for (int rank = 0; rank < n; ++rank) {
    const std::string path = directory + "/worker" + std::to_string(rank) + ".log";
    exits[rank].output = read_file(path);
    std::remove(path.c_str());
    const bool ok = exits[rank].exit_code == 0;
    if (!ok && !options.may_fail.count(rank) && !options.stragglers.count(rank)) {
      ADD_FAILURE() << "worker " << rank << " of " << n << " failed (exit code " << exits[rank].exit_code
                    << ", signal " << exits[rank].signal << "); its output:\n" << exits[rank].output;
    }
  }
  rmdir(directory.c_str());
  return exits;
}

}  // namespace shoal::testing
