// Two "hosts" for multi-host tests: network namespaces joined by a veth pair (needs root).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace shoal::testing {

// Runs a short shell command (the `ip` calls), bounded by `timeout 10`; returns its exit code and
// puts its stdout and stderr in `output`.
int shell(const std::string& command, std::string* output = nullptr);

// Two network namespaces joined by a veth pair, with an address at each end and loopback up.
// The namespaces (and with them the veth pair) are deleted on destruction, whatever happened.
class TwoHosts {
 public:
  static constexpr const char* kAddressA = "10.78.0.1";
  static constexpr const char* kAddressB = "10.78.0.2";

  // Why the namespaces cannot be made here (not root, no `ip`, a failed command), or nullopt
  // when they were made. With `other_network` ("10.78.9.1/24"), host 0 also has that address, on
  // an interface made before the link between the hosts so that it is listed first: a host with
  // several networks.
  std::optional<std::string> create(const std::string& other_network = "");
  ~TwoHosts();

  const std::string& name(int host) const { return names_.at(host); }
  // `command` run inside host 0 or 1.
  std::string in(int host, const std::string& command) const;
  // An /etc/hosts that names both hosts: name(0) and name(1) at their veth addresses.
  std::string hosts_file() const;
  // The argv prefix that runs a program on host 0 or 1 as on a machine of its own: in the host's
  // network namespace, with UTS and mount namespaces of its own where the host name is name(host)
  // and `hosts_path` (a file with hosts_file()) is /etc/hosts. Not `ip netns exec`, which remounts
  // /sys (docs/testing.md).
  std::vector<std::string> on_host(int host, const std::string& hosts_path) const;
  // Takes the link between the hosts down (a network partition) or up again; false if `ip` failed.
  bool set_link(bool up);

 private:
  std::vector<std::string> names_;
  std::string veth_;
};

// This thread, and every process it forks from now on, in a host's network namespace
// (/run/netns/NAME, e.g. TwoHosts::name) until destruction, which takes it back to the namespace
// it was in: a test's scheduler and its REST calls, or the store of run_workers' workers on two
// hosts, then live on that host. Raises std::runtime_error when setns fails.
class InNetworkNamespace {
 public:
  explicit InNetworkNamespace(const std::string& name);
  ~InNetworkNamespace();
  InNetworkNamespace(const InNetworkNamespace&) = delete;
  InNetworkNamespace& operator=(const InNetworkNamespace&) = delete;

 private:
  int home_ = -1;
};

}  // namespace shoal::testing
