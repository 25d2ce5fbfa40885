// A small HTTP/1.1 client over TCP, enough for etcd's v3 JSON gateway: POST with a body,
// responses with Content-Length or chunked bodies, and one long response read as it streams
// (a watch). No TLS, no redirects, no proxies. Every call has a deadline.
#pragma once

#include <memory>
#include <string>

#include "shoal/core/timeout.h"

namespace shoal::elastic::etcd {

// "HOST:PORT": a name or an IPv4 address, and a port.
struct Endpoint {
  std::string host;
  int port = 0;

  // UsageError when `text` is not HOST:PORT.
  static Endpoint parse(const std::string& text);
  std::string text() const { return host + ":" + std::to_string(port); }
};

struct HttpResponse {
  int status = 0;
  std::string body;
};

// One POST on a connection of its own, closed afterwards. CommError naming the endpoint, the
// path and what failed (refused, reset, timed out after ...) when no whole response arrives
// within `timeout`. Any status is returned; the caller decides what a non-200 means.
HttpResponse http_post(const Endpoint& endpoint, const std::string& path, const std::string& body,
                       Duration timeout);

// A POST whose response body does not end (etcd's watch): the body is read as it comes, from a
// thread that polls fd().
class HttpStream {
 public:
  // Sends the request and waits, at most `timeout`, for the response's header. CommError when
  // that fails or the status is not 200.
  HttpStream(const Endpoint& endpoint, const std::string& path, const std::string& body, Duration timeout);
  ~HttpStream();
  HttpStream(const HttpStream&) = delete;
  HttpStream& operator=(const HttpStream&) = delete;

  // Readable when read() has something to add.
  int fd() const;
  // Appends the body's bytes that have arrived (chunked encoding removed) to `out`, without
  // blocking. False once the stream has ended or failed: etcd closed it or went away.
  bool read(std::string& out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::elastic::etcd
