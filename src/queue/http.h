// The queue's REST client: JSON over HTTP with the queue's token (docs/queue.md, "REST API").
// One small adapter over cpp-httplib, used by the agent and by `shoal queue` commands.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace httplib {
class Client;
}

namespace shoal::queue {

class HttpClient {
 public:
  // Plain HTTP to HOST:PORT.
  HttpClient(const std::string& host, int port, std::string token);
  // `address` is HOST:PORT (plain HTTP) or https://HOST:PORT, whose certificate must be the one in
  // `ca_file` (the scheduler's STATE_DIR/tls/cert.pem or a copy; docs/queue.md, "Security").
  HttpClient(const std::string& address, std::string token, const std::string& ca_file);
  ~HttpClient();

  // Raise CommError when the scheduler cannot be reached or does not answer within 5 s, and
  // UsageError with the scheduler's one-line reason when it refuses the request (4xx).
  nlohmann::json get(const std::string& path);
  nlohmann::json post(const std::string& path, const nlohmann::json& body);
  nlohmann::json del(const std::string& path);

 private:
  void configure();

  std::string where_;
  bool tls_ = false;
  std::string token_;
  std::unique_ptr<httplib::Client> client_;
};

}  // namespace shoal::queue
