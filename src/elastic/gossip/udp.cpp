#include "udp.h"

#include <arpa/inet.h>
#include <linux/errqueue.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace shoal::elastic::gossip::udp {

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Socket::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::optional<sockaddr_in> resolve(const std::string& host_port, bool numeric_only) {
  const auto colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == host_port.size()) return std::nullopt;
  const std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  if (port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5 || std::stoi(port) > 65535 ||
      std::stoi(port) == 0) {
    return std::nullopt;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = numeric_only ? AI_NUMERICHOST : 0;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr) return std::nullopt;
  sockaddr_in address;
  std::memcpy(&address, found->ai_addr, sizeof(address));
  ::freeaddrinfo(found);
  return address;
}

std::string to_string(const sockaddr_in& address) {
  char host[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, host, sizeof(host));
  return std::string(host) + ":" + std::to_string(ntohs(address.sin_port));
}

bool same(const sockaddr_in& a, const sockaddr_in& b) {
  return a.sin_addr.s_addr == b.sin_addr.s_addr && a.sin_port == b.sin_port;
}

Socket bind(const std::string& host, int port, std::string* error) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (port < 0 || port > 65535 || ::inet_pton(AF_INET, host.c_str(), &address.sin_addr) != 1) {
    *error = "bind_host \"" + host + "\" and port " + std::to_string(port) + " are not an IPv4 address and a port";
    return Socket();
  }
  Socket socket(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (socket.fd() < 0 || ::bind(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    *error = "cannot bind a UDP socket to " + host + ":" + std::to_string(port) + ": " + std::strerror(errno);
    return Socket();
  }
  // Room for bursts: a whole table arriving in chunks, pushes from every member at once.
  const int buffer = 4 << 20;
  ::setsockopt(socket.fd(), SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
  return socket;
}

sockaddr_in local_address(const Socket& socket) {
  sockaddr_in address{};
  socklen_t size = sizeof(address);
  ::getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&address), &size);
  return address;
}

Socket probe_socket() {
  Socket socket(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  const int on = 1;
  if (socket.fd() >= 0) ::setsockopt(socket.fd(), IPPROTO_IP, IP_RECVERR, &on, sizeof(on));
  return socket;
}

std::optional<std::string> route_source(const sockaddr_in& to) {
  Socket socket(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (socket.fd() < 0 || ::connect(socket.fd(), reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
    return std::nullopt;
  }
  sockaddr_in local = local_address(socket);
  char host[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &local.sin_addr, host, sizeof(host));
  return std::string(host);
}

void send(const Socket& socket, const sockaddr_in& to, const std::string& datagram) {
  // Best effort, as UDP is: a full buffer or an unreachable network is a lost datagram, which
  // the protocol tolerates by design.
  ::sendto(socket.fd(), datagram.data(), datagram.size(), MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&to),
           sizeof(to));
}

Received receive(const Socket& socket, std::string* datagram, sockaddr_in* from) {
  char buffer[65536];
  socklen_t size = sizeof(*from);
  const ssize_t n = ::recvfrom(socket.fd(), buffer, sizeof(buffer), 0, reinterpret_cast<sockaddr*>(from), &size);
  if (n >= 0) {
    datagram->assign(buffer, static_cast<size_t>(n));
    return Received::kDatagram;
  }
  bool refused = errno == ECONNREFUSED;
  // Read the queued ICMP reports (IP_RECVERR) too: an earlier sendto may have consumed the
  // socket's pending error, and a report left queued keeps poll() flagging the socket.
  char data[64];
  char control[512];
  iovec iov{data, sizeof(data)};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  while (::recvmsg(socket.fd(), &message, MSG_ERRQUEUE | MSG_DONTWAIT) >= 0) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
      if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_RECVERR) {
        sock_extended_err report;
        std::memcpy(&report, CMSG_DATA(c), sizeof(report));
        refused = refused || report.ee_errno == ECONNREFUSED;
      }
    }
    message.msg_controllen = sizeof(control);
  }
  return refused ? Received::kRefused : Received::kNone;
}

}  // namespace shoal::elastic::gossip::udp
