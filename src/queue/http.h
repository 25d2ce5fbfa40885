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
  HttpClient(const std::string& host, int port, std::string token);
  ~HttpClient();

  // Raise CommError when the scheduler cannot be reached or does not answer within 5 s, and
  // UsageError with the scheduler's one-line reason when it refuses the request (4xx).
  nlohmann::json get(const std::string& path);
  nlohmann::json post(const std::string& path, const nlohmann::json& body);
  nlohmann::json del(const std::string& path);

 private:
  std::string where_;
  std::string token_;
  std::unique_ptr<httplib::Client> client_;
};

}  // namespace shoal::queue
