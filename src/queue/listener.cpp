#include "listener.h"

#include <sys/socket.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "shoal/core/error.h"

namespace shoal::queue {

namespace {

// Note [Clients cannot stall the scheduler]
// cpp-httplib serves connections from a pool of 8 threads by default, and a connection holds its
// thread until its request is read or its read times out (5 s a read): eight clients that sent
// half a request stalled the API, and thirty starved the agents' heartbeats until the scheduler
// counted its own host lost. Here every connection gets a thread of its own, up to a bound (the
// accept loop waits beyond it), so a slow client holds only its own thread; and the agents beat
// on a listener of their own, which the users' clients cannot reach. The policy's rounds run on
// a thread of their own and take the scheduler's lock only between requests' reads and writes.
class ThreadPerConnection : public httplib::TaskQueue {
 public:
  explicit ThreadPerConnection(size_t bound) : bound_(bound) {}

  void enqueue(std::function<void()> serve) override {
    std::unique_lock<std::mutex> lock(mutex_);
    room_.wait(lock, [&] { return live_ < bound_; });
    ++live_;
    std::thread([this, serve = std::move(serve)] {
      serve();
      std::lock_guard<std::mutex> done(mutex_);
      --live_;
      room_.notify_all();
    }).detach();
  }

  // A connection's thread ends within its read timeout and keep-alive wait; the server waits for
  // them (at most 15 s), since each runs the server's code.
  void shutdown() override {
    std::unique_lock<std::mutex> lock(mutex_);
    room_.wait_for(lock, std::chrono::seconds(15), [&] { return live_ == 0; });
  }

 private:
  const size_t bound_;
  std::mutex mutex_;
  std::condition_variable room_;
  size_t live_ = 0;
};

}  // namespace

namespace {
std::unique_ptr<httplib::Server> make_server(const ListenerOptions& options) {
  if (options.tls_cert.empty()) return std::make_unique<httplib::Server>();
  auto server =
      std::make_unique<httplib::SSLServer>(options.tls_cert.c_str(), options.tls_key.c_str());
  if (!server->is_valid()) {
    throw UsageError("cannot serve TLS with the certificate " + options.tls_cert + " and key " +
                     options.tls_key + "; expected a PEM certificate and its PEM private key");
  }
  return server;
}
}  // namespace

Listener::Listener(const ListenerOptions& options) : server_(make_server(options)) {
  const size_t bound = options.connections;
  server_->new_task_queue = [bound] { return new ThreadPerConnection(bound); };
  server_->set_payload_max_length(options.max_body);
  // A port in use is an error (SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, with
  // which two schedulers both listened on 0.0.0.0:7460 and the kernel split the clients).
  server_->set_socket_options([](int fd) {
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const size_t max_body = options.max_body;
  server_->set_error_handler([max_body](const httplib::Request& request,
                                        httplib::Response& response) {
    if (!response.body.empty()) return;
    std::string why;
    if (response.status == 404) {
      why = "no such request: " + request.method + " " + request.path +
            "; the REST API is in docs/queue.md";
    } else if (response.status == 413) {
      why = "the request's body is over " + std::to_string(max_body) + " bytes";
    } else {
      why = "malformed HTTP request (status " + std::to_string(response.status) + ")";
    }
    response.set_content(nlohmann::json{{"error", why}}.dump(), "application/json");
  });
  port_ = options.port;
  if (port_ == 0) {
    port_ = server_->bind_to_any_port(options.host.c_str());
  } else if (!server_->bind_to_port(options.host.c_str(), port_)) {
    port_ = -1;
  }
  if (port_ <= 0) {
    throw UsageError("cannot listen on " + options.host + ":" + std::to_string(options.port) +
                     ": the port is in use or the address is not this host's; pass another " +
                     options.flag + " or --host");
  }
}

Listener::~Listener() = default;

void Listener::serve() {
  server_->listen_after_bind();
}

void Listener::stop() {
  server_->stop();
}

}  // namespace shoal::queue
