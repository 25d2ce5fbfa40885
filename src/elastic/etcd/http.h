// HTTP for etcd's v3 JSON gateway, through cpp-httplib (the library the queue speaks HTTP with):
// POST with a JSON body, and one long response read as it streams (a watch). No TLS, no
// redirects, no proxies. Every call has a deadline.
#pragma once

#include <functional>
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
// path and what failed (could not connect, no response within ..., the connection broke) when
// no whole response arrives in time: the connect, the sending and each wait for the response's
// bytes take `timeout` at most, and a response still arriving once `timeout` has passed since the
// call began is abandoned. Any status is returned; the caller decides what a non-200 means.
HttpResponse http_post(const Endpoint& endpoint, const std::string& path, const std::string& body,
                       Duration timeout);

// A POST whose response body does not end (etcd's watch), read by a thread of its own.
class HttpStream {
 public:
  // Sends the request and waits, at most `timeout`, for the response's header. CommError when
  // that fails or the status is not 200. From then on `arrived` is called from the stream's
  // thread whenever read() has something to add, and once more when the stream ends.
  HttpStream(const Endpoint& endpoint, const std::string& path, const std::string& body, Duration timeout,
             std::function<void()> arrived);
  // Closes the connection and joins the thread: at once, or within `timeout` while a connect
  // is under way.
  ~HttpStream();
  HttpStream(const HttpStream&) = delete;
  HttpStream& operator=(const HttpStream&) = delete;

  // Appends the body's bytes that have arrived (chunked encoding removed) to `out`, without
  // blocking. False once the stream has ended or failed: etcd closed it or went away.
  bool read(std::string& out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal::elastic::etcd
