// One HTTP listener of the scheduler: the users' API and dashboard, or the agents' heartbeats
// (docs/queue.md, "Running the queue"), each on a port of its own so that no client of one can
// starve the other. It owns what every listener needs and nothing of what it serves: a thread
// per connection up to a bound (Note [Clients cannot stall the scheduler]), a port in use as an
// error, a body limit, and the API's one-line JSON error on answers no handler wrote.
#pragma once

#include <memory>
#include <string>

namespace httplib {
class Server;
}

namespace shoal::queue {

struct ListenerOptions {
  std::string host;         // the address to listen on
  int port = 0;             // 0: any free port
  std::string flag;         // the flag that set it, for the error ("--port", "--agent-port")
  size_t connections = 256;  // served at once; the accept loop waits beyond
  size_t max_body = size_t{1} << 20;
  std::string tls_cert;  // with tls_key: HTTPS (docs/queue.md, "Security"); empty: plain HTTP
  std::string tls_key;
};

class Listener {
 public:
  // Binds; UsageError with one line naming the address and `flag` when it cannot.
  explicit Listener(const ListenerOptions& options);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  httplib::Server& http() { return *server_; }
  int port() const { return port_; }
  // Serves until stop(); stop() may come from another thread or a signal handler.
  void serve();
  void stop();

 private:
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
};

}  // namespace shoal::queue
