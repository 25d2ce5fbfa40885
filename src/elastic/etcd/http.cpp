#include "http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "shoal/core/error.h"

namespace shoal::elastic::etcd {
namespace {

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

// Fails a request: "etcd at 127.0.0.1:2379: POST /v3/kv/range: connection refused".
struct Failure {
  const Endpoint& endpoint;
  const std::string& path;
  [[noreturn]] void operator()(const std::string& what) const {
    throw CommError("etcd at " + endpoint.text() + ": POST " + path + ": " + what);
  }
};

int poll_ms(const Deadline& deadline) {
  return static_cast<int>(std::min<int64_t>(deadline.remaining().count(), 1 << 30));
}

// Waits until `fd` is ready for `events`; false when the deadline passed first.
bool wait_for(int fd, short events, const Deadline& deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, poll_ms(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return false;
  }
}

std::unique_ptr<Socket> connect_to(const Endpoint& endpoint, const Deadline& deadline, const Failure& fail) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(endpoint.port));
  if (::inet_pton(AF_INET, endpoint.host.c_str(), &address.sin_addr) != 1) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(endpoint.host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
      fail("cannot resolve host \"" + endpoint.host + "\"");
    }
    address.sin_addr = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
    ::freeaddrinfo(found);
  }
  auto socket = std::make_unique<Socket>(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (socket->fd() < 0) fail(std::string("cannot open a socket: ") + std::strerror(errno));
  if (::connect(socket->fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    if (errno != EINPROGRESS) fail(std::strerror(errno));
    if (!wait_for(socket->fd(), POLLOUT, deadline)) {
      fail("no connection within " + format_duration(deadline.timeout()));
    }
    int error = 0;
    socklen_t size = sizeof(error);
    ::getsockopt(socket->fd(), SOL_SOCKET, SO_ERROR, &error, &size);
    if (error != 0) fail(std::strerror(error));
  }
  return socket;
}

void send_request(int fd, const Endpoint& endpoint, const std::string& path, const std::string& body,
                  const Deadline& deadline, const Failure& fail) {
  const std::string request = "POST " + path + " HTTP/1.1\r\nHost: " + endpoint.text() +
                              "\r\nContent-Type: application/json\r\nContent-Length: " +
                              std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
      fail(std::string("cannot send the request: ") + std::strerror(errno));
    } else if (!wait_for(fd, POLLOUT, deadline)) {
      fail("could not send the request within " + format_duration(deadline.timeout()));
    }
  }
}

// One response, parsed as its bytes arrive: status line and header, then the body, delimited by
// Content-Length, by chunks, or by the end of the connection.
class ResponseParser {
 public:
  // Throws std::runtime_error when the bytes are not HTTP.
  void feed(const char* data, size_t size) {
    pending_.append(data, size);
    size_t at = 0;
    for (bool progress = true; progress && state_ != State::kDone;) {
      progress = step(at);
    }
    pending_.erase(0, at);
    if (state_ == State::kHeader && pending_.size() > (64 << 10)) throw std::runtime_error("header too long");
  }
  // The connection ended.
  void close() {
    if (state_ == State::kUntilClose) state_ = State::kDone;
  }
  bool has_header() const { return state_ != State::kHeader; }
  bool done() const { return state_ == State::kDone; }
  int status() const { return status_; }
  std::string& body() { return body_; }

 private:
  enum class State { kHeader, kLength, kChunkSize, kChunkData, kChunkEnd, kTrailer, kUntilClose, kDone };

  // Consumes what it can from pending_ at `at`; false when it needs more bytes.
  bool step(size_t& at) {
    const size_t available = pending_.size() - at;
    switch (state_) {
      case State::kHeader: {
        const size_t end = pending_.find("\r\n\r\n", at);
        if (end == std::string::npos) return false;
        parse_header(pending_.substr(at, end - at));
        at = end + 4;
        return true;
      }
      case State::kLength:
      case State::kChunkData:
      case State::kUntilClose: {
        const size_t n = state_ == State::kUntilClose ? available : std::min(left_, available);
        body_.append(pending_, at, n);
        at += n;
        left_ -= state_ == State::kUntilClose ? 0 : n;
        if (state_ != State::kUntilClose && left_ == 0) {
          state_ = state_ == State::kLength ? State::kDone : State::kChunkEnd;
          return true;
        }
        return false;
      }
      case State::kChunkEnd:
        if (available < 2) return false;
        if (pending_.compare(at, 2, "\r\n") != 0) throw std::runtime_error("malformed chunk");
        at += 2;
        state_ = State::kChunkSize;
        return true;
      case State::kChunkSize:
      case State::kTrailer: {
        const size_t end = pending_.find("\r\n", at);
        if (end == std::string::npos) return false;
        const std::string line = pending_.substr(at, end - at);
        at = end + 2;
        if (state_ == State::kTrailer) {
          if (line.empty()) state_ = State::kDone;
          return true;
        }
        left_ = std::stoul(line.substr(0, line.find(';')), nullptr, 16);
        state_ = left_ == 0 ? State::kTrailer : State::kChunkData;
        return true;
      }
      case State::kDone:
        return false;
    }
    return false;
  }

  void parse_header(const std::string& header) {
    if (header.compare(0, 5, "HTTP/") != 0) throw std::runtime_error("not an HTTP response");
    const size_t space = header.find(' ');
    status_ = std::stoi(header.substr(space + 1, 3));
    state_ = State::kUntilClose;
    size_t line = header.find("\r\n");
    while (line != std::string::npos) {
      const size_t start = line + 2;
      line = header.find("\r\n", start);
      std::string field = header.substr(start, line == std::string::npos ? std::string::npos : line - start);
      std::transform(field.begin(), field.end(), field.begin(), [](unsigned char c) { return std::tolower(c); });
      const size_t colon = field.find(':');
      if (colon == std::string::npos) continue;
      const std::string name = field.substr(0, colon);
      const std::string value = field.substr(field.find_first_not_of(' ', colon + 1));
      if (name == "transfer-encoding" && value.find("chunked") != std::string::npos) {
        state_ = State::kChunkSize;
      } else if (name == "content-length" && state_ == State::kUntilClose) {
        left_ = std::stoul(value);
        state_ = left_ == 0 ? State::kDone : State::kLength;
      }
    }
  }

  State state_ = State::kHeader;
  std::string pending_;
  size_t left_ = 0;
  int status_ = 0;
  std::string body_;
};

// Reads into `parser` until `ready()` holds. Throws through `fail` on a timeout or a broken connection.
template <typename Ready>
void read_until(int fd, ResponseParser& parser, Ready ready, const Deadline& deadline, const Failure& fail) {
  char buffer[64 << 10];
  while (!ready()) {
    if (!wait_for(fd, POLLIN, deadline)) fail("no response within " + format_duration(deadline.timeout()));
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n < 0) fail(std::strerror(errno));
    if (n == 0) {
      parser.close();
      if (!ready()) fail("the connection closed before the response was complete");
      return;
    }
    try {
      parser.feed(buffer, static_cast<size_t>(n));
    } catch (const std::exception& e) {
      fail(std::string("malformed response: ") + e.what());
    }
  }
}

}  // namespace

Endpoint Endpoint::parse(const std::string& text) {
  const auto colon = text.rfind(':');
  const std::string port = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (colon == 0 || port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(port) == 0 || std::stoi(port) > 65535) {
    throw UsageError("etcd endpoint \"" + text + "\" is not HOST:PORT");
  }
  return {text.substr(0, colon), std::stoi(port)};
}

HttpResponse http_post(const Endpoint& endpoint, const std::string& path, const std::string& body,
                       Duration timeout) {
  Deadline deadline(timeout);
  Failure fail{endpoint, path};
  auto socket = connect_to(endpoint, deadline, fail);
  send_request(socket->fd(), endpoint, path, body, deadline, fail);
  ResponseParser parser;
  read_until(socket->fd(), parser, [&] { return parser.done(); }, deadline, fail);
  return {parser.status(), std::move(parser.body())};
}

struct HttpStream::Impl {
  std::unique_ptr<Socket> socket;
  ResponseParser parser;
  bool ended = false;
};

HttpStream::HttpStream(const Endpoint& endpoint, const std::string& path, const std::string& body, Duration timeout)
    : impl_(std::make_unique<Impl>()) {
  Deadline deadline(timeout);
  Failure fail{endpoint, path};
  impl_->socket = connect_to(endpoint, deadline, fail);
  send_request(impl_->socket->fd(), endpoint, path, body, deadline, fail);
  read_until(impl_->socket->fd(), impl_->parser, [&] { return impl_->parser.has_header(); }, deadline, fail);
  if (impl_->parser.status() != 200) {
    fail("status " + std::to_string(impl_->parser.status()) + ": " + impl_->parser.body());
  }
}

HttpStream::~HttpStream() = default;

int HttpStream::fd() const { return impl_->socket->fd(); }

bool HttpStream::read(std::string& out) {
  char buffer[64 << 10];
  while (!impl_->ended) {
    const ssize_t n = ::recv(impl_->socket->fd(), buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    if (n <= 0) {
      impl_->ended = true;
      break;
    }
    try {
      impl_->parser.feed(buffer, static_cast<size_t>(n));
    } catch (const std::exception&) {
      impl_->ended = true;
    }
    if (impl_->parser.done()) impl_->ended = true;
  }
  out += impl_->parser.body();
  impl_->parser.body().clear();
  return !impl_->ended;
}

}  // namespace shoal::elastic::etcd
