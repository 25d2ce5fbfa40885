#include "slurm_cluster.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "harness.h"

extern char** environ;

namespace shoal::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool on_path(const std::string& name) {
  for (const char* dir : {"/usr/sbin", "/usr/bin", "/sbin", "/bin"}) {
    if (::access((std::string(dir) + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// Forks `argv` as a child that dies with the test; `as_user` (when not empty) drops root first.
pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& log, const std::string& as_user = "") {
  std::vector<std::string> entries;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    if (env.count(text.substr(0, text.find('='))) == 0) entries.push_back(text);
  }
  for (const auto& [name, value] : env) entries.push_back(name + "=" + value);
  const passwd* user = as_user.empty() ? nullptr : ::getpwnam(as_user.c_str());
  if (!as_user.empty() && user == nullptr) throw std::runtime_error("no user " + as_user);
  const uid_t uid = user ? user->pw_uid : 0;
  const gid_t gid = user ? user->pw_gid : 0;
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::setpgid(0, 0);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    ::dup2(null_fd, STDIN_FILENO);
    if (user != nullptr &&
        (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0)) {
      ::_exit(126);
    }
    std::vector<char*> c_argv, c_env;
    for (const auto& arg : argv) c_argv.push_back(const_cast<char*>(arg.c_str()));
    c_argv.push_back(nullptr);
    for (const auto& entry : entries) c_env.push_back(const_cast<char*>(entry.c_str()));
    c_env.push_back(nullptr);
    ::execvpe(c_argv[0], c_argv.data(), c_env.data());
    ::_exit(127);
  }
  return pid;
}

// Stops a daemon: SIGTERM, then SIGKILL after `grace`; always reaps it.
void stop_process(pid_t pid, std::chrono::milliseconds grace) {
  ::kill(pid, SIGTERM);
  const auto deadline = Clock::now() + grace;
  while (::waitpid(pid, nullptr, WNOHANG) == 0) {
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Every process (other than this one) whose environment holds `entry`.
std::vector<pid_t> processes_with(const std::string& entry) {
  std::vector<pid_t> found;
  for (const auto& item : std::filesystem::directory_iterator("/proc")) {
    const std::string name = item.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (pid == ::getpid()) continue;
    const std::string environ_text = read_file(item.path().string() + "/environ");
    size_t at = 0;
    while (at < environ_text.size()) {
      const size_t end = environ_text.find('\0', at);
      if (environ_text.compare(at, (end == std::string::npos ? environ_text.size() : end) - at,
                               entry) == 0) {
        found.push_back(pid);
        break;
      }
      if (end == std::string::npos) break;
      at = end + 1;
    }
  }
  return found;
}

// A number that no other cluster of these tests took recently: a counter in /tmp shared by the
// test processes (ctest may run several at once), under an exclusive lock.
int next_cluster_number() {
  const int fd = ::open("/tmp/shoal-slurm-clusters", O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0 || ::flock(fd, LOCK_EX) != 0)
    throw std::runtime_error("cannot lock /tmp/shoal-slurm-clusters");
  char text[32] = {};
  const ssize_t got = ::pread(fd, text, sizeof(text) - 1, 0);
  const int number = got > 0 ? std::atoi(text) : 0;
  const std::string next = std::to_string(number + 1) + "\n";
  (void)!::ftruncate(fd, 0);
  (void)!::pwrite(fd, next.data(), next.size(), 0);
  ::close(fd);  // releases the lock
  return number;
}

}  // namespace

Command::Command(const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& env)
    : start_(Clock::now()) {
  char directory_template[] = "/tmp/shoal-command-XXXXXX";
  const std::string directory = ::mkdtemp(directory_template);
  out_path_ = directory + "/out";
  err_path_ = directory + "/err";
  std::vector<std::string> entries;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    if (env.count(text.substr(0, text.find('='))) == 0) entries.push_back(text);
  }
  for (const auto& [name, value] : env) entries.push_back(name + "=" + value);
  pid_ = ::fork();
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::setpgid(0, 0);
    const int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    ::dup2(null_fd, STDIN_FILENO);
    std::vector<char*> c_argv, c_env;
    for (const auto& arg : argv) c_argv.push_back(const_cast<char*>(arg.c_str()));
    c_argv.push_back(nullptr);
    for (const auto& entry : entries) c_env.push_back(const_cast<char*>(entry.c_str()));
    c_env.push_back(nullptr);
    ::execvpe(c_argv[0], c_argv.data(), c_env.data());
    ::_exit(127);
  }
}

Command::~Command() {
  if (!reaped_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  std::error_code ignored;
  std::filesystem::remove_all(std::filesystem::path(out_path_).parent_path(), ignored);
}

bool Command::finished() {
  if (!reaped_ && ::waitpid(pid_, &status_, WNOHANG) == pid_) {
    reaped_ = true;
    seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
  }
  return reaped_;
}

CommandResult Command::wait(std::chrono::milliseconds timeout) {
  CommandResult result;
  const auto deadline = start_ + timeout;
  while (!finished()) {
    if (Clock::now() >= deadline) {
      result.timed_out = true;
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, &status_, 0);
      reaped_ = true;
      seconds_ = std::chrono::duration<double>(Clock::now() - start_).count();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int status = status_;
  result.exit_code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  result.seconds = seconds_;
  result.out = read_file(out_path_);
  result.err = read_file(err_path_);
  return result;
}

std::string SlurmCluster::unavailable() {
  if (::geteuid() != 0) return "a real Slurm needs root (munged, slurmd)";
  for (const char* tool :
       {"munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo"}) {
    if (!on_path(tool)) {
      return std::string(tool) +
             " is not installed (scripts/setup.sh installs munge, slurmctld, slurmd "
             "and slurm-client)";
    }
  }
  if (::getpwnam("munge") == nullptr) return "the munge user is missing (package munge)";
  return "";
}

SlurmCluster::SlurmCluster(const std::vector<SlurmNode>& nodes,
                           const SlurmClusterOptions& options) {
  // Jobs' ports derive from their ids (29500 + 8J + S mod 3000): clusters 16 ids apart use
  // different ports for their first 16 jobs.
  first_job_id_ = 1 + (next_cluster_number() % 23) * 16;
  char directory_template[] = "/tmp/shoal-slurm-XXXXXX";
  dir_ = ::mkdtemp(directory_template);
  conf_ = dir_ + "/slurm.conf";
  // munged refuses a socket directory that others may write, and runs as the munge user.
  ::chmod(dir_.c_str(), 0755);
  const std::string munge_dir = dir_ + "/munge";
  std::filesystem::create_directories(munge_dir);
  std::filesystem::create_directories(dir_ + "/state");
  std::filesystem::create_directories(dir_ + "/log");
  const passwd* munge = ::getpwnam("munge");
  if (munge == nullptr || ::chown(munge_dir.c_str(), munge->pw_uid, munge->pw_gid) != 0) {
    throw std::runtime_error("cannot give " + munge_dir + " to the munge user");
  }
  const std::string key = munge_dir + "/munge.key";
  Command make_key({"mungekey", "--create", "--keyfile=" + key});
  if (make_key.wait(std::chrono::seconds(20)).exit_code != 0 ||
      ::chown(key.c_str(), munge->pw_uid, munge->pw_gid) != 0) {
    throw std::runtime_error("mungekey failed");
  }
  const std::string socket = munge_dir + "/munge.socket";
  daemons_.push_back(
      spawn({"munged", "--foreground", "--socket=" + socket, "--key-file=" + key,
             "--log-file=" + munge_dir + "/munged.log", "--pid-file=" + munge_dir + "/munged.pid",
             "--seed-file=" + munge_dir + "/munged.seed"},
            {}, dir_ + "/log/munged.out", "munge"));

  const TwoHosts* hosts = options.hosts;
  if (hosts != nullptr && nodes.size() > 2) {
    throw std::runtime_error("two namespaced hosts hold at most two nodes, not " +
                             std::to_string(nodes.size()));
  }
  // Each daemon's host: its name, its address, and how to start a program there.
  std::string hosts_path;
  if (hosts != nullptr) {
    hosts_path = dir_ + "/hosts";
    std::ofstream(hosts_path) << hosts->hosts_file();
    client_prefix_ = {"nsenter", "--net=/run/netns/" + hosts->name(0)};
  }
  char this_host[256] = {};
  ::gethostname(this_host, sizeof(this_host) - 1);
  const auto host_name = [&](size_t i) { return hosts ? hosts->name(i) : std::string(this_host); };
  const auto host_address = [&](size_t i) {
    return std::string(hosts ? (i == 0 ? TwoHosts::kAddressA : TwoHosts::kAddressB) : "127.0.0.1");
  };
  const auto on_host = [&](size_t i, std::vector<std::string> argv) {
    if (hosts == nullptr) return argv;
    std::vector<std::string> full = hosts->on_host(static_cast<int>(i), hosts_path);
    full.insert(full.end(), argv.begin(), argv.end());
    return full;
  };

  std::ostringstream conf;
  conf << "ClusterName=shoaltest\n"
       << "FirstJobId=" << first_job_id_ << "\n"
       << "SlurmctldHost=" << host_name(0) << "(" << host_address(0) << ")\n"
       << "SlurmctldPort=" << free_port() << "\n"
       << "AuthType=auth/munge\nCredType=cred/munge\n"
       << "AuthInfo=socket=" << socket << "\n"
       << "SlurmUser=root\nSlurmdUser=root\n"
       << "StateSaveLocation=" << dir_ << "/state\n"
       << "SlurmdSpoolDir=" << dir_ << "/spool/%n\n"
       << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\n"
       << "SlurmdPidFile=" << dir_ << "/slurmd-%n.pid\n"
       << "SlurmctldLogFile=" << dir_ << "/log/slurmctld.log\n"
       << "SlurmdLogFile=" << dir_ << "/log/slurmd-%n.log\n"
       << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
       << "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
       << "SlurmdParameters=config_overrides\n"
       << "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n"
       << "JobCompType=jobcomp/none\nMpiDefault=none\nReturnToService=2\n"
       << "SchedulerType=sched/builtin\nInactiveLimit=0\nKillWait=" << options.kill_wait
       << "\nMinJobAge=5\n";
  if (!options.scheduler_parameters.empty()) {
    conf << "SchedulerParameters=" << options.scheduler_parameters << "\n";
  }
  std::string names;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const SlurmNode& node = nodes[i];
    std::filesystem::create_directories(dir_ + "/spool/" + node.name);
    conf << "NodeName=" << node.name << " NodeHostname=" << host_name(i)
         << " NodeAddr=" << host_address(i) << " Port=" << free_port() << " CPUs=" << node.cpus
         << " State=UNKNOWN\n";
    names += (names.empty() ? "" : ",") + node.name;
  }
  conf << "PartitionName=test Nodes=" << names << " Default=YES MaxTime=INFINITE State=UP\n";
  std::ofstream(conf_) << conf.str();

  const std::map<std::string, std::string> env = client_env();
  // On hosts, each daemon is that host's own program (nsenter, unshare and sh all exec it), so
  // that the pid kept here is the daemon's.
  daemons_.push_back(spawn(on_host(0, {"slurmctld", "-D", "-i", "-f", conf_}), env,
                           dir_ + "/log/slurmctld.out"));
  for (size_t i = 0; i < nodes.size(); ++i) {
    daemons_.push_back(spawn(on_host(i, {"slurmd", "-D", "-f", conf_, "-N", nodes[i].name}), env,
                             dir_ + "/log/slurmd-" + nodes[i].name + ".out"));
  }

  // Up when every node is idle; slurmctld takes a moment to listen, so early sinfo calls fail.
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  for (;;) {
    std::vector<std::string> sinfo_argv = client_prefix_;
    for (const char* arg : {"sinfo", "-h", "-N", "-o", "%t"}) sinfo_argv.emplace_back(arg);
    Command sinfo(sinfo_argv, env);
    const CommandResult state = sinfo.wait(std::chrono::seconds(10));
    size_t idle = 0;
    std::istringstream lines(state.out);
    for (std::string line; std::getline(lines, line);) idle += line == "idle";
    if (state.exit_code == 0 && idle == nodes.size()) return;
    if (Clock::now() >= deadline) {
      const std::string logs_text = logs();
      stop();
      throw std::runtime_error("Slurm did not come up within 30 s (sinfo: " + state.out +
                               state.err + "); logs:\n" + logs_text);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

SlurmCluster::~SlurmCluster() {
  stop();
}

void SlurmCluster::stop() {
  if (daemons_.empty()) return;
  // Daemons first (slurmctld, slurmd), so that nothing starts more tasks; munged last.
  for (size_t i = daemons_.size(); i-- > 1;) stop_process(daemons_[i], std::chrono::seconds(3));
  // slurmstepd and the tasks of a job cut short carry this cluster's SLURM_CONF.
  for (int round = 0; round < 3; ++round) {
    const auto left = processes_with("SLURM_CONF=" + conf_);
    if (left.empty()) break;
    for (pid_t pid : left) ::kill(pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  stop_process(daemons_[0], std::chrono::seconds(3));
  daemons_.clear();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

std::map<std::string, std::string> SlurmCluster::client_env() const {
  return {{"SLURM_CONF", conf_}};
}

std::string SlurmCluster::logs() const {
  std::string text;
  for (const auto& item : std::filesystem::directory_iterator(dir_ + "/log")) {
    text += "--- " + item.path().filename().string() + "\n" + read_file(item.path().string());
  }
  return text;
}

std::string describe(const CommandResult& r) {
  return "exit " + std::to_string(r.exit_code) + (r.timed_out ? " (timed out)" : "") +
         "\nstdout:\n" + r.out + "stderr:\n" + r.err;
}

std::map<int, LaunchedResult> launched_results(const std::string& out) {
  static const std::regex line(
      R"(result rank=(\d+) world=(\d+) local=(\d+)/(\d+) job=(.*) master=(\S+) sum=(\S+))");
  std::map<int, LaunchedResult> found;
  std::istringstream lines(out);
  for (std::string text; std::getline(lines, text);) {
    std::smatch m;
    if (!std::regex_search(text, m, line)) continue;
    found[std::stoi(m[1])] = {
        std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), std::stoi(m[4]), m[5], m[6],
        std::stod(m[7])};
  }
  return found;
}

}  // namespace shoal::testing
