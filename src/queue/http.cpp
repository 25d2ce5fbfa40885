#include "http.h"

#include <httplib.h>

#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

HttpClient::HttpClient(const std::string& host, int port, std::string token)
    : where_(host + ":" + std::to_string(port)),
      token_(std::move(token)),
      client_(std::make_unique<httplib::Client>(host, port)) {
  configure();
}

HttpClient::HttpClient(const std::string& address, std::string token, const std::string& ca_file)
    : where_(address), token_(std::move(token)) {
  tls_ = address.rfind("https://", 0) == 0;
  if (tls_) {
    if (ca_file.empty()) {
      throw UsageError("the queue at " + address +
                       " speaks TLS: pass --ca-cert with a copy of the scheduler's "
                       "STATE_DIR/tls/cert.pem, or set SHOAL_QUEUE_CA");
    }
    client_ = std::make_unique<httplib::Client>(address);
    client_->set_ca_cert_path(ca_file.c_str());
    client_->enable_server_certificate_verification(true);
  } else {
    const std::string plain = address.rfind("http://", 0) == 0 ? address.substr(7) : address;
    const auto colon = plain.rfind(':');
    if (colon == std::string::npos) throw UsageError("expected HOST:PORT, not '" + address + "'");
    client_ = std::make_unique<httplib::Client>(plain.substr(0, colon),
                                                std::atoi(plain.c_str() + colon + 1));
  }
  configure();
}

void HttpClient::configure() {
  client_->set_connection_timeout(2, 0);
  client_->set_read_timeout(5, 0);
  client_->set_write_timeout(5, 0);
  client_->set_default_headers({{"Authorization", "Bearer " + token_}});
}

HttpClient::~HttpClient() = default;

namespace {

json answer(const httplib::Result& result, const std::string& what, const std::string& where,
            bool tls) {
  if (!result) {
    // A queue served over TLS closes a plain connection without an answer.
    const std::string hint = !tls && result.error() == httplib::Error::Read
                                 ? "; if the queue speaks TLS, its address is https://" + where
                                 : "";
    std::string why = httplib::to_string(result.error());
    if (result.error() == httplib::Error::SSLServerVerification)
      why = "SSL server verification failed: its certificate is not the one --ca-cert names";
    throw CommError("cannot reach the queue at " + where + " (" + what + "): " + why + hint);
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
  return answer(client_->Get(path.c_str()), "GET " + path, where_, tls_);
}

json HttpClient::post(const std::string& path, const json& body) {
  return answer(client_->Post(path.c_str(), body.dump(), "application/json"), "POST " + path,
                where_, tls_);
}

json HttpClient::del(const std::string& path) {
  return answer(client_->Delete(path.c_str()), "DELETE " + path, where_, tls_);
}

}  // namespace shoal::queue
