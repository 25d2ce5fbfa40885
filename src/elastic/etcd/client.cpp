#include "client.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <nlohmann/json.hpp>

#include "shoal/core/error.h"

namespace shoal::elastic::etcd {
namespace {

using Json = nlohmann::json;

constexpr char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64(const std::string& bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t group = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) group |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) group |= static_cast<uint8_t>(bytes[i + 2]);
    out += kBase64[(group >> 18) & 63];
    out += kBase64[(group >> 12) & 63];
    out += i + 1 < bytes.size() ? kBase64[(group >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? kBase64[group & 63] : '=';
  }
  return out;
}

std::string unbase64(const std::string& text) {
  std::string out;
  uint32_t group = 0;
  int bits = 0;
  for (char c : text) {
    const char* at = c == '\0' ? nullptr : std::strchr(kBase64, c);
    if (at == nullptr) continue;  // '=' padding
    group = (group << 6) | static_cast<uint32_t>(at - kBase64);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((group >> bits) & 0xff);
    }
  }
  return out;
}

// The gateway writes int64 fields as strings and leaves out fields that hold their default.
int64_t number(const Json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end()) return 0;
  return it->is_string() ? std::stoll(it->get<std::string>()) : it->get<int64_t>();
}

KeyValue key_value(const Json& kv) { return {unbase64(kv.value("key", "")), unbase64(kv.value("value", ""))}; }

Json put_request(const std::string& key, const std::string& value, int64_t lease) {
  Json request{{"key", base64(key)}, {"value", base64(value)}};
  if (lease != 0) request["lease"] = std::to_string(lease);
  return {{"request_put", request}};
}

std::string message_of(const std::string& body) {
  try {
    auto j = Json::parse(body);
    if (j.contains("message")) return j["message"].get<std::string>();
    if (j.contains("error") && j["error"].is_object()) return j["error"].value("message", body);
  } catch (const std::exception&) {
  }
  return body;
}

}  // namespace

std::string end_of(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty() && static_cast<uint8_t>(end.back()) == 0xff) end.pop_back();
  if (end.empty()) return std::string(1, '\0');  // every key
  end.back() = static_cast<char>(end.back() + 1);
  return end;
}

Json Client::call(const std::string& path, const std::string& body) const {
  HttpResponse response = http_post(endpoint_, path, body, timeout_);
  if (response.status != 200) {
    throw CommError("etcd at " + endpoint_.text() + ": POST " + path + ": status " + std::to_string(response.status) +
                    ": " + message_of(response.body));
  }
  try {
    return Json::parse(response.body);
  } catch (const std::exception& e) {
    throw CommError("etcd at " + endpoint_.text() + ": POST " + path + ": the answer is not JSON: " + e.what());
  }
}

std::pair<int64_t, Duration> Client::grant(Duration ttl) const {
  const int64_t seconds = std::max<int64_t>(1, (ttl.count() + 999) / 1000);
  const Json j = call("/v3/lease/grant", Json{{"TTL", std::to_string(seconds)}}.dump());
  return {number(j, "ID"), std::chrono::seconds(number(j, "TTL"))};
}

Duration Client::keep_alive(int64_t lease) const {
  // A stream in gRPC; through the gateway one request gets one answer, then the stream ends.
  const Json j = call("/v3/lease/keepalive", Json{{"ID", std::to_string(lease)}}.dump());
  if (j.contains("error")) {
    throw CommError("etcd at " + endpoint_.text() + ": POST /v3/lease/keepalive: " + message_of(j.dump()));
  }
  return std::chrono::seconds(number(j.value("result", Json::object()), "TTL"));
}

void Client::revoke(int64_t lease) const {
  const std::string path = "/v3/lease/revoke";
  HttpResponse response = http_post(endpoint_, path, Json{{"ID", std::to_string(lease)}}.dump(), timeout_);
  const std::string message = response.status == 200 ? "" : message_of(response.body);
  if (response.status != 200 && message.find("not found") == std::string::npos) {
    throw CommError("etcd at " + endpoint_.text() + ": POST " + path + ": status " + std::to_string(response.status) +
                    ": " + message);
  }
}

Client::Range Client::range_prefix(const std::string& prefix) const {
  const Json j = call("/v3/kv/range", Json{{"key", base64(prefix)}, {"range_end", base64(end_of(prefix))}}.dump());
  Range range;
  range.revision = number(j.value("header", Json::object()), "revision");
  for (const auto& kv : j.value("kvs", Json::array())) range.kvs.push_back(key_value(kv));
  return range;
}

void Client::erase(const std::string& key) const { call("/v3/kv/deleterange", Json{{"key", base64(key)}}.dump()); }

void Client::erase_range(const std::string& from, const std::string& to) const {
  call("/v3/kv/deleterange", Json{{"key", base64(from)}, {"range_end", base64(to)}}.dump());
}

void Client::put(const std::string& key, const std::string& value, int64_t lease) const {
  call("/v3/kv/put", put_request(key, value, lease)["request_put"].dump());
}

std::optional<int64_t> Client::create(const std::string& key, const std::string& value, int64_t lease) const {
  Json txn{{"compare", {{{"key", base64(key)}, {"result", "EQUAL"}, {"target", "CREATE"}, {"create_revision", "0"}}}},
           {"success", {put_request(key, value, lease)}}};
  const Json j = call("/v3/kv/txn", txn.dump());
  if (j.value("succeeded", false)) return number(j.value("header", Json::object()), "revision");
  return std::nullopt;
}

bool Client::update(const std::string& key, const std::string& value, int64_t lease, int64_t create_revision) const {
  Json txn{{"compare",
            {{{"key", base64(key)},
              {"result", "EQUAL"},
              {"target", "CREATE"},
              {"create_revision", std::to_string(create_revision)}}}},
           {"success", {put_request(key, value, lease)}}};
  return call("/v3/kv/txn", txn.dump()).value("succeeded", false);
}

Watch::Watch(const Client& client, const std::string& prefix, int64_t start_revision, std::function<void()> arrived)
    : endpoint_(client.endpoint()),
      stream_(client.endpoint(), "/v3/watch",
              Json{{"create_request",
                    {{"key", base64(prefix)},
                     {"range_end", base64(end_of(prefix))},
                     {"start_revision", std::to_string(start_revision)}}}}
                  .dump(),
              client.timeout_, std::move(arrived)) {}

std::vector<Watch::Event> Watch::events() {
  const bool open = stream_.read(buffer_);
  std::vector<Event> events;
  // One JSON message a line.
  size_t start = 0;
  for (size_t end; (end = buffer_.find('\n', start)) != std::string::npos; start = end + 1) {
    Json j;
    try {
      j = Json::parse(buffer_.begin() + static_cast<std::ptrdiff_t>(start),
                      buffer_.begin() + static_cast<std::ptrdiff_t>(end));
    } catch (const std::exception& e) {
      throw CommError("etcd at " + endpoint_.text() + ": /v3/watch sent a malformed message: " + e.what());
    }
    if (j.contains("error")) {
      throw CommError("etcd at " + endpoint_.text() + ": /v3/watch failed: " + message_of(j.dump()));
    }
    const Json result = j.value("result", Json::object());
    if (result.value("canceled", false)) {
      throw CommError("etcd at " + endpoint_.text() + " canceled the watch (compacted at revision " +
                      std::to_string(number(result, "compact_revision")) + ")");
    }
    for (const auto& event : result.value("events", Json::array())) {
      events.push_back({event.value("type", "") == "DELETE", key_value(event.value("kv", Json::object()))});
    }
  }
  buffer_.erase(0, start);
  if (!open) throw CommError("etcd at " + endpoint_.text() + " closed the watch");
  return events;
}

}  // namespace shoal::elastic::etcd
