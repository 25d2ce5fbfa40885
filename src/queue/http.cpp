#include "http.h"

#include <httplib.h>

#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

HttpClient::HttpClient(const std::string& host, int port, std::string token)
    : where_(host + ":" + std::to_string(port)),
      token_(std::move(token)),
      client_(std::make_unique<httplib::Client>(host, port)) {
  client_->set_connection_timeout(2, 0);
  client_->set_read_timeout(5, 0);
  client_->set_write_timeout(5, 0);
  client_->set_default_headers({{"Authorization", "Bearer " + token_}});
}

HttpClient::~HttpClient() = default;

namespace {

json answer(const httplib::Result& result, const std::string& what, const std::string& where) {
  if (!result) {
    throw CommError("cannot reach the queue at " + where + " (" + what +
                    "): " + httplib::to_string(result.error()));
  }
  json body;
  try {
    body = result->body.empty() ? json::object() : json::parse(result->body);
  } catch (const json::exception&) {
    throw CommError("the queue at " + where + " answered " + what +
                    " with something not JSON (HTTP " + std::to_string(result->status) + ")");
  }
  if (result->status >= 400) {
    const std::string reason = body.is_object() ? body.value("error", std::string()) : "";
    if (result->status >= 500) {
      throw CommError("the queue at " + where + " failed " + what + ": " + reason);
    }
    throw UsageError(reason.empty() ? what + ": HTTP " + std::to_string(result->status) : reason);
  }
  return body;
}

}  // namespace

json HttpClient::get(const std::string& path) {
  return answer(client_->Get(path.c_str()), "GET " + path, where_);
}

json HttpClient::post(const std::string& path, const json& body) {
  return answer(client_->Post(path.c_str(), body.dump(), "application/json"), "POST " + path,
                where_);
}

json HttpClient::del(const std::string& path) {
  return answer(client_->Delete(path.c_str()), "DELETE " + path, where_);
}

}  // namespace shoal::queue
