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
  // when they were made.
  std::optional<std::string> create();
  ~TwoHosts();

  const std::string& name(int host) const { return names_.at(host); }
  // `command` run inside host 0 or 1.
  std::string in(int host, const std::string& command) const;
  // Takes the link between the hosts down (a network partition) or up again; false if `ip` failed.
  bool set_link(bool up);

 private:
  std::vector<std::string> names_;
  std::string veth_;
};

}  // namespace shoal::testing
