#include "job.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <nlohmann/json.hpp>

#include "../../core/hash.h"
#include "shoal/core/error.h"

namespace shoal::elastic::etcd {
namespace {

// HMAC-SHA256 of a fixed text keyed by the token: etcd's readers learn nothing they could join with.
std::string digest(const std::string& token) {
  static const std::string kText = "shoal elastic job token";
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), reinterpret_cast<const unsigned char*>(kText.data()),
       kText.size(), mac, &size);
  return shoal::detail::hex(mac, size);
}

}  // namespace

std::string job_prefix(const std::string& run_id) { return "/shoal/" + run_id + "/"; }

JobRecord open_job(const Client& client, const std::string& prefix, const std::string& token,
                   const JobRecord& record, bool create) {
  const std::string key = prefix + "job";
  if (create) {
    const nlohmann::json j{{"min", record.min_workers},
                           {"max", record.max_workers},
                           {"quorum", record.quorum},
                           {"last_call_ms", record.last_call.count()},
                           {"token_digest", digest(token)}};
    if (client.create(key, j.dump(), 0)) return record;
  }
  std::string value;
  for (const auto& kv : client.range_prefix(key).kvs) {
    if (kv.key == key) value = kv.value;
  }
  if (value.empty()) {
    throw UsageError("etcd at " + client.endpoint().text() + " has no elastic job under " + prefix +
                     "; expected the run id that the job's first shoal run printed");
  }
  JobRecord job;
  std::string expected;
  try {
    const auto j = nlohmann::json::parse(value);
    job.min_workers = j.at("min").get<int>();
    job.max_workers = j.at("max").get<int>();
    job.quorum = j.at("quorum").get<bool>();
    job.last_call = Duration(j.at("last_call_ms").get<int64_t>());
    expected = j.at("token_digest").get<std::string>();
  } catch (const std::exception& e) {
    throw UsageError("etcd at " + client.endpoint().text() + ": " + key + " is not a shoal job's record (" +
                     e.what() + ")");
  }
  if (digest(token) != expected) {
    throw UsageError("the job under " + prefix + " in etcd at " + client.endpoint().text() +
                     " refused: the token is not the job's (expected the token file the job's first shoal run "
                     "wrote)");
  }
  return job;
}

void forget_job_if_done(const Client& client, const std::string& prefix) {
  try {
    if (client.range_prefix(prefix + "workers/").kvs.empty()) client.erase_range(prefix, end_of(prefix));
  } catch (const CommError&) {
    // etcd is away: the keys stay (a later job has another run id)
  }
}

}  // namespace shoal::elastic::etcd
