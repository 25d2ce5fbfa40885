#include "cpu_weight.h"

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <linux/magic.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

namespace shoal::queue {

namespace {

bool write_file(const std::string& path, const std::string& text, std::string* error) {
  std::ofstream out(path);
  out << text << std::flush;
  if (out) return true;
  if (error != nullptr) *error = "cannot write '" + text + "' to " + path;
  return false;
}

bool is_directory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool filesystem_is(const std::string& path, int64_t magic) {
  struct statfs info {};
  return ::statfs(path.c_str(), &info) == 0 && static_cast<int64_t>(info.f_type) == magic;
}

// Whether `pid` is a process that has not ended: a zombie has (a killed agent whose parent
// ended too stays one until init reaps it, which not every init does).
bool runs(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && text[close + 2] != 'Z';
}

// An agent killed with SIGKILL left its groups behind (its workers died with it, so the groups
// are empty): each `shoal-agent-PID` under `parent` whose PID runs no more goes, with its jobs'
// groups. A group that still holds a process is not empty and stays (rmdir fails).
void remove_groups_of_dead_agents(const std::string& parent) {
  DIR* listing = ::opendir(parent.c_str());
  if (listing == nullptr) return;
  std::vector<std::string> stale;
  while (const dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (name.rfind("shoal-agent-", 0) != 0) continue;
    const pid_t pid = static_cast<pid_t>(std::atoll(name.c_str() + 12));
    if (pid > 0 && pid != ::getpid() && !runs(pid)) stale.push_back(parent + "/" + name);
  }
  ::closedir(listing);
  for (const std::string& agent : stale) {
    if (DIR* jobs = ::opendir(agent.c_str())) {
      std::vector<std::string> groups;
      while (const dirent* entry = ::readdir(jobs)) {
        const std::string name = entry->d_name;
        if (name.rfind("job-", 0) == 0) groups.push_back(agent + "/" + name);
      }
      ::closedir(jobs);
      for (const std::string& group : groups) ::rmdir(group.c_str());
    }
    ::rmdir(agent.c_str());
  }
}

}  // namespace

int64_t cpu_shares_for(int priority) {
  const double shares = 1024.0 * std::pow(2.0, static_cast<double>(priority) / 100.0);
  return static_cast<int64_t>(std::clamp(std::llround(shares), 2LL, 262144LL));
}

int nice_for(int priority) {
  const int steps = static_cast<int>(std::lround(static_cast<double>(priority) / 100.0));
  int nice = std::clamp(-steps, -20, 19);
  if (nice < 0 && ::geteuid() != 0) nice = 0;
  return nice;
}

CpuWeights::CpuWeights(std::string root) : root_(std::move(root)) {}

CpuWeights::~CpuWeights() {
  for (const auto& [job, group] : groups_) ::rmdir(group.c_str());
  if (!weight_file_.empty()) ::rmdir(root_.c_str());
}

void CpuWeights::probe() {
  probed_ = true;
  const std::string name = "shoal-agent-" + std::to_string(::getpid());
  if (root_.empty()) {
    if (filesystem_is("/sys/fs/cgroup", CGROUP2_SUPER_MAGIC)) {
      // cgroup v2: the cpu controller must be enabled in every parent of the groups; the root
      // group may enable it for its children whatever processes it holds.
      if (!write_file("/sys/fs/cgroup/cgroup.subtree_control", "+cpu", nullptr)) return;
      remove_groups_of_dead_agents("/sys/fs/cgroup");
      root_ = "/sys/fs/cgroup/" + name;
      if (::mkdir(root_.c_str(), 0755) != 0 && errno != EEXIST) return;
      if (!write_file(root_ + "/cgroup.subtree_control", "+cpu", nullptr)) return;
      weight_file_ = "cpu.weight";
      return;
    }
    if (is_directory("/sys/fs/cgroup/cpu") &&
        ::access("/sys/fs/cgroup/cpu/cpu.shares", R_OK) == 0) {
      remove_groups_of_dead_agents("/sys/fs/cgroup/cpu");
      root_ = "/sys/fs/cgroup/cpu/" + name;
      if (::mkdir(root_.c_str(), 0755) != 0 && errno != EEXIST) return;
      weight_file_ = "cpu.shares";
    }
    return;
  }
  if (::mkdir(root_.c_str(), 0755) != 0 && errno != EEXIST) return;
  weight_file_ = ::access((root_ + "/cpu.weight").c_str(), F_OK) == 0 ? "cpu.weight" : "cpu.shares";
}

std::string CpuWeights::place(pid_t pid, int64_t job, int priority) {
  if (!probed_) probe();
  std::string error = "no writable cgroup cpu controller";
  if (!weight_file_.empty()) {
    const std::string group = root_ + "/job-" + std::to_string(job);
    const int64_t shares = cpu_shares_for(priority);
    // cgroup v2's weight is 1..10000 with 100 the default, v1's shares 2..262144 with 1024.
    const int64_t weight =
        weight_file_ == "cpu.weight" ? std::clamp<int64_t>(shares * 100 / 1024, 1, 10000) : shares;
    if ((::mkdir(group.c_str(), 0755) == 0 || errno == EEXIST) &&
        write_file(group + "/" + weight_file_, std::to_string(weight), &error) &&
        write_file(group + "/cgroup.procs", std::to_string(pid), &error)) {
      groups_[job] = group;
      return "cgroup " + group + " " + weight_file_ + " " + std::to_string(weight);
    }
  }
  const int nice = nice_for(priority);
  if (::setpriority(PRIO_PROCESS, static_cast<id_t>(pid), nice) != 0) {
    return error + "; setpriority: " + std::strerror(errno);
  }
  return "nice " + std::to_string(nice) + " (" + error + ")";
}

void CpuWeights::forget(int64_t job) {
  auto it = groups_.find(job);
  if (it == groups_.end()) return;
  ::rmdir(it->second.c_str());
  groups_.erase(it);
}

std::string CpuWeights::group_of(int64_t job) const {
  auto it = groups_.find(job);
  return it == groups_.end() ? "" : it->second;
}

}  // namespace shoal::queue
