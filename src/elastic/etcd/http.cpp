#include "http.h"

#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include <httplib.h>

#include "shoal/core/error.h"

namespace shoal::elastic::etcd {
namespace {

using namespace std::chrono_literals;

// A watch is quiet for as long as no key under its prefix changes, so its reads wait with no
// timeout worth the name; a lost etcd shows in the session's renewals, which then drop the watch.
constexpr auto kQuietWatch = std::chrono::hours(24);

// "etcd at 127.0.0.1:2379: POST /v3/kv/range: no response within 2.00 s".
[[noreturn]] void fail_request(const Endpoint& endpoint, const std::string& path, const std::string& what) {
  throw CommError("etcd at " + endpoint.text() + ": POST " + path + ": " + what);
}

// One request a client: without keep-alive, cpp-httplib closes the connection after it.
httplib::Client client_for(const Endpoint& endpoint, Duration timeout, Duration read_timeout) {
  httplib::Client client(endpoint.host, endpoint.port);
  client.set_address_family(AF_INET);
  client.set_connection_timeout(timeout);
  client.set_write_timeout(timeout);
  client.set_read_timeout(read_timeout);
  return client;
}

httplib::Request post_request(const std::string& path, const std::string& body) {
  httplib::Request request;
  request.method = "POST";
  request.path = path;
  request.body = body;
  request.set_header("Content-Type", "application/json");
  return request;
}

// cpp-httplib says which step failed, not the system's reason; a step that ends after the
// deadline ran out of time.
std::string what_failed(httplib::Error error, const Deadline& deadline) {
  const std::string within = format_duration(deadline.timeout());
  switch (error) {
    case httplib::Error::Connection:
      return "could not connect (nothing listens there, or the host is unknown or unreachable)";
    case httplib::Error::ConnectionTimeout:
      return "no connection within " + within;
    case httplib::Error::Write:
      return deadline.expired() ? "could not send the request within " + within
                                : "the connection broke while the request was sent";
    case httplib::Error::Read:
    case httplib::Error::Canceled:
      return deadline.expired() ? "no response within " + within
                                : "the connection ended before the whole response came (closed, reset, or not HTTP)";
    default:
      return httplib::to_string(error);
  }
}

}  // namespace

// Note [etcd's errors end with trailers]
// The gateway sends a gRPC error (a lease not found, a compacted revision) as a chunked body
// followed by trailers (Grpc-Trailer-Content-Type: application/grpc), and cpp-httplib 0.11 fails
// on a chunked body's trailers, after it has handed over the body. So for a status other than
// 200, the status and the body that came are the answer even when the read failed at the end:
// the caller judges the status and shows the message. A 200 comes without trailers, and one
// whose read failed is a failure.

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
  const Deadline deadline(timeout);
  httplib::Client client = client_for(endpoint, timeout, timeout);
  httplib::Request request = post_request(path, body);
  HttpResponse response;
  request.response_handler = [&](const httplib::Response& header) {
    response.status = header.status;
    return true;
  };
  request.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    response.body.append(data, size);
    return !deadline.expired();
  };
  const httplib::Result result = client.send(request);
  // See Note [etcd's errors end with trailers].
  if (!result && (response.status == 0 || response.status == 200)) {
    fail_request(endpoint, path, what_failed(result.error(), deadline));
  }
  if (result) response.status = result->status;
  return response;
}

struct HttpStream::Impl {
  Impl(const Endpoint& endpoint, Duration timeout, std::function<void()> arrived)
      : client(client_for(endpoint, timeout, kQuietWatch)), arrived(std::move(arrived)) {}
  ~Impl() { stop(); }

  // The thread: the request, until its response ends, fails or stop() cuts it.
  void run(httplib::Request request) {
    // cpp-httplib sends without MSG_NOSIGNAL, and a send after stop() shut the connection down
    // (while this thread still sends the request) raises SIGPIPE, which would end the process.
    // The thread is the stream's own, so it blocks SIGPIPE for good (a pending one ends with it).
    // http_post needs no such care: nothing shuts its connection down, and a connection that
    // breaks raises SIGPIPE only on the write after the failed one, where cpp-httplib has stopped.
    sigset_t sigpipe;
    sigemptyset(&sigpipe);
    sigaddset(&sigpipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &sigpipe, nullptr);
    request.response_handler = [this](const httplib::Response& response) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        status = response.status;
      }
      changed.notify_all();
      return !stopping;
    };
    request.content_receiver = [this](const char* data, size_t size, uint64_t, uint64_t) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        body.append(data, size);
      }
      if (arrived) arrived();
      return !stopping;
    };
    httplib::Error failure = httplib::Error::Canceled;
    if (!stopping) {
      failure = httplib::Error::Success;
      httplib::Response response;
      client.send(request, response, failure);
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      ended = true;
      error = failure;
    }
    changed.notify_all();
    if (arrived) arrived();
  }

  // cpp-httplib's stop() shuts the connection down only while a request is under way (and waits
  // for a connect in progress): called until the thread ends, it also catches a request that was
  // just starting.
  void stop() {
    if (!thread.joinable()) return;
    stopping = true;
    std::unique_lock<std::mutex> lock(mutex);
    while (!ended) {
      lock.unlock();
      client.stop();
      lock.lock();
      changed.wait_for(lock, 10ms, [&] { return ended; });
    }
    lock.unlock();
    thread.join();
  }

  httplib::Client client;
  const std::function<void()> arrived;
  std::atomic<bool> stopping{false};

  std::mutex mutex;
  std::condition_variable changed;  // status or ended
  int status = 0;                   // once the header is in
  std::string body;                 // arrived, not yet read()
  bool ended = false;
  httplib::Error error = httplib::Error::Success;

  std::thread thread;
};

HttpStream::HttpStream(const Endpoint& endpoint, const std::string& path, const std::string& body, Duration timeout,
                       std::function<void()> arrived)
    : impl_(std::make_unique<Impl>(endpoint, timeout, std::move(arrived))) {
  const Deadline deadline(timeout);
  impl_->thread = std::thread([impl = impl_.get(), request = post_request(path, body)]() mutable {
    impl->run(std::move(request));
  });
  std::unique_lock<std::mutex> lock(impl_->mutex);
  impl_->changed.wait_for(lock, timeout, [&] { return impl_->status == 200 || impl_->ended; });
  if (impl_->status == 200) return;
  std::string what;
  if (impl_->status != 0) {
    what = "status " + std::to_string(impl_->status) + ": " + impl_->body;
  } else if (impl_->ended) {
    what = what_failed(impl_->error, deadline);
  } else {
    what = "no response within " + format_duration(timeout);
  }
  lock.unlock();
  impl_->stop();
  fail_request(endpoint, path, what);
}

HttpStream::~HttpStream() = default;

bool HttpStream::read(std::string& out) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  out += impl_->body;
  impl_->body.clear();
  return !impl_->ended;
}

}  // namespace shoal::elastic::etcd
