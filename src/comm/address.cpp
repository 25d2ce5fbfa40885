#include "shoal/comm/address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

namespace shoal::comm {

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
