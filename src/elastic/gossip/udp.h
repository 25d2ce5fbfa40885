// The few UDP socket operations gossip needs (IPv4, Linux), with RAII for the descriptors.
#pragma once

#include <netinet/in.h>

#include <optional>
#include <string>

namespace shoal::elastic::gossip::udp {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { reset(); }
  Socket(Socket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  void reset();

 private:
  int fd_ = -1;
};

// "HOST:PORT" (HOST a name or an IPv4 address; with numeric_only, an address only) as an
// address; nullopt when it is not one.
std::optional<sockaddr_in> resolve(const std::string& host_port, bool numeric_only = false);
std::string to_string(const sockaddr_in& address);
bool same(const sockaddr_in& a, const sockaddr_in& b);

// A non-blocking socket bound to host:port; *error says why when the result holds no socket.
Socket bind(const std::string& host, int port, std::string* error);
sockaddr_in local_address(const Socket& socket);

// A non-blocking socket for one probe. It is not connect()ed, so that an ack is accepted from
// whichever address the target answers from (on a host with several interfaces that need not be
// the one pinged), but it has IP_RECVERR: an ICMP port-unreachable for what it sent then fails
// its next recv with ECONNREFUSED. It only ever sends to one target, so that error names it.
Socket probe_socket();

// The local IPv4 address of the route to `to` (no datagram is sent); nullopt without a route.
std::optional<std::string> route_source(const sockaddr_in& to);

void send(const Socket& socket, const sockaddr_in& to, const std::string& datagram);

enum class Received { kDatagram, kNone, kRefused };
// Reads one datagram without blocking. kRefused: an earlier send drew a port-unreachable.
Received receive(const Socket& socket, std::string* datagram, sockaddr_in* from);

}  // namespace shoal::elastic::gossip::udp
