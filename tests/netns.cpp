#include "netns.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <stdexcept>

namespace shoal::testing {

int shell(const std::string& command, std::string* output) {
  std::string text;
  FILE* pipe = ::popen(("timeout 10 " + command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) text += buffer;
  const int status = ::pclose(pipe);
  if (output != nullptr) *output = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::optional<std::string> TwoHosts::create(const std::string& other_network) {
  if (::geteuid() != 0) return "needs root to create network namespaces and a veth pair (ip netns add)";
  std::string output;
  if (shell("ip -V", &output) != 0) return "iproute2's `ip` does not run here: " + output;
  static int count = 0;
  const std::string id = std::to_string(::getpid()) + "-" + std::to_string(++count);
  names_ = {"shoal-mh-" + id + "-a", "shoal-mh-" + id + "-b"};
  // Interface names have at most 15 characters.
  veth_ = "mh" + std::to_string(::getpid() % 10000000) + "x" + std::to_string(count % 100);
  for (size_t i = 0; i < names_.size(); ++i) {
    if (shell("ip netns add " + names_[i], &output) != 0) {
      names_.resize(i);  // only those that exist are deleted
      return "`ip netns add` failed: " + output;
    }
  }
  std::vector<std::string> commands;
  if (!other_network.empty()) {
    // A veth pair with both ends in host 0: an interface whose network host 1 is not on.
    commands = {
        in(0, "ip link add " + veth_ + "o type veth peer name " + veth_ + "p"),
        in(0, "ip addr add " + other_network + " dev " + veth_ + "o"),
        in(0, "ip link set " + veth_ + "o up"),
        in(0, "ip link set " + veth_ + "p up"),
    };
  }
  const std::vector<std::string> link = {
      "ip link add " + veth_ + "a netns " + names_[0] + " type veth peer name " + veth_ + "b netns " + names_[1],
      in(0, "ip addr add " + std::string(kAddressA) + "/24 dev " + veth_ + "a"),
      in(1, "ip addr add " + std::string(kAddressB) + "/24 dev " + veth_ + "b"),
      in(0, "ip link set " + veth_ + "a up"),
      in(1, "ip link set " + veth_ + "b up"),
      // The processes of one host also talk among themselves over loopback.
      in(0, "ip link set lo up"),
      in(1, "ip link set lo up"),
  };
  commands.insert(commands.end(), link.begin(), link.end());
  for (const auto& command : commands) {
    if (shell(command, &output) != 0) return "`" + command + "` failed: " + output;
  }
  return std::nullopt;
}

TwoHosts::~TwoHosts() {
  for (const auto& name : names_) {
    std::string output;
    if (shell("ip netns del " + name, &output) != 0) {
      std::fprintf(stderr, "could not delete network namespace %s: %s\n", name.c_str(), output.c_str());
    }
  }
}

std::string TwoHosts::in(int host, const std::string& command) const {
  return "ip netns exec " + names_.at(host) + " " + command;
}

std::string TwoHosts::hosts_file() const {
  return "127.0.0.1 localhost\n" + std::string(kAddressA) + " " + names_.at(0) + "\n" +
         std::string(kAddressB) + " " + names_.at(1) + "\n";
}

std::vector<std::string> TwoHosts::on_host(int host, const std::string& hosts_path) const {
  // unshare --mount makes every mount private: the bind mount stays inside.
  return {"nsenter", "--net=/run/netns/" + names_.at(host), "unshare", "--uts", "--mount",
          "/bin/sh", "-c",
          "hostname \"$1\" && mount --bind \"$2\" /etc/hosts && shift 2 && exec \"$@\"", "sh",
          names_.at(host), hosts_path};
}

bool TwoHosts::set_link(bool up) {
  const std::string state = up ? " up" : " down";
  return shell(in(0, "ip link set " + veth_ + "a" + state)) == 0 &&
         shell(in(1, "ip link set " + veth_ + "b" + state)) == 0;
}

InNetworkNamespace::InNetworkNamespace(const std::string& name) {
  home_ = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  const int fd = ::open(("/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC);
  const bool entered = home_ >= 0 && fd >= 0 && ::setns(fd, CLONE_NEWNET) == 0;
  const int error = errno;
  if (fd >= 0) ::close(fd);
  if (!entered) {
    if (home_ >= 0) ::close(home_);
    throw std::runtime_error("cannot enter the network namespace " + name + ": " +
                             std::strerror(error));
  }
}

InNetworkNamespace::~InNetworkNamespace() {
  if (::setns(home_, CLONE_NEWNET) != 0) {
    std::cerr << "cannot return to the test's network namespace: " << std::strerror(errno)
              << std::endl;
  }
  ::close(home_);
}

}  // namespace shoal::testing
