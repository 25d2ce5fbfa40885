#include "shoal/comm/store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "shoal/core/error.h"

namespace shoal::comm {

StorePtr open_store(const StoreOptions& options) {
  c10d::TCPStoreOptions tcp;
  tcp.port = static_cast<uint16_t>(options.port);
  tcp.isServer = options.is_server;
  tcp.waitWorkers = false;
  tcp.timeout = options.timeout;
  const std::string where = options.host + ":" + std::to_string(options.port);
  // c10d's client gives up on a refused connection before its timeout is over; keep trying
  // until ours is.
  Deadline deadline(options.timeout);
  for (;;) {
    try {
      if (!options.is_server) tcp.timeout = std::max(deadline.remaining(), Duration(100));
      auto store = c10::make_intrusive<c10d::TCPStore>(options.host, tcp);
      store->setTimeout(options.timeout);
      return store;
    } catch (const std::exception& e) {
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      if (options.is_server) {
        throw UsageError("cannot host the job's store on " + options.described_as + " (port " +
                         std::to_string(options.port) + "): " + what +
                         "; expected a free port, or 0 to pick one");
      }
      if (deadline.remaining() < Duration(200)) {
        throw UsageError("cannot reach the job's master at " + options.described_as + "=" + where +
                         " after " + format_duration(deadline.elapsed()) + ": " + what);
      }
    }
  }
}

int hosted_port(const StorePtr& store) {
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  SHOAL_CHECK(tcp != nullptr) << "hosted_port needs a TCPStore";
  return tcp->getPort();
}

std::string worker_exit_key(int rank) { return "shoal/exit/" + std::to_string(rank); }

void put(const StorePtr& store, const std::string& key, const std::string& value) {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string try_get(const StorePtr& store, const std::string& key) {
  if (!store->check({key})) return "";
  auto bytes = store->get(key);
  return std::string(bytes.begin(), bytes.end());
}

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &result) != 0 || !result) {
    return "127.0.0.1";
  }
  std::string address = "127.0.0.1";
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0) {
    if (::connect(fd, result->ai_addr, result->ai_addrlen) == 0) {
      sockaddr_in local{};
      socklen_t length = sizeof(local);
      char text[INET_ADDRSTRLEN];
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0 &&
          inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text))) {
        address = text;
      }
    }
    close(fd);
  }
  freeaddrinfo(result);
  return address;
}

}  // namespace shoal::comm
