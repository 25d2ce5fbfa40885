#include "probe.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "http.h"
#include "shoal/core/error.h"

namespace shoal::elastic::etcd {

std::vector<bool> refusing(const std::vector<std::string>& addresses, Duration timeout) {
  constexpr size_t kBatch = 512;  // sockets open at once
  std::vector<bool> refused(addresses.size(), false);
  for (size_t first = 0; first < addresses.size(); first += kBatch) {
    const size_t last = std::min(addresses.size(), first + kBatch);
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = first; i < last; ++i) {
      sockaddr_in address{};
      try {
        const Endpoint endpoint = Endpoint::parse(addresses[i]);
        address.sin_family = AF_INET;
        address.sin_port = htons(static_cast<uint16_t>(endpoint.port));
        if (::inet_pton(AF_INET, endpoint.host.c_str(), &address.sin_addr) != 1) continue;
      } catch (const UsageError&) {
        continue;
      }
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      const bool at_once = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
      if (at_once || errno != EINPROGRESS) {
        refused[i] = !at_once && errno == ECONNREFUSED;
        ::close(fd);
        continue;
      }
      fds.push_back({fd, POLLOUT, 0});
      which.push_back(i);
    }
    Deadline deadline(timeout);
    size_t open = fds.size();
    while (open > 0 && !deadline.expired()) {
      if (::poll(fds.data(), fds.size(), static_cast<int>(deadline.remaining().count())) <= 0) continue;
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].fd < 0 || fds[k].revents == 0) continue;
        int error = 0;
        socklen_t size = sizeof(error);
        ::getsockopt(fds[k].fd, SOL_SOCKET, SO_ERROR, &error, &size);
        refused[which[k]] = error == ECONNREFUSED;
        ::close(fds[k].fd);
        fds[k].fd = -1;  // poll() skips it
        --open;
      }
    }
    for (const auto& p : fds) {
      if (p.fd >= 0) ::close(p.fd);
    }
  }
  return refused;
}

}  // namespace shoal::elastic::etcd
