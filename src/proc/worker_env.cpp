#include "worker_env.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace shoal::proc {

env::Environment worker_environment(const env::Environment& base, const WorkerPlace& place) {
  env::Environment env = base;
  const std::string rank = std::to_string(place.rank());
  const std::string world_size = std::to_string(place.world_size());
  const std::string local_rank = std::to_string(place.local_rank);
  const std::string local_world_size = std::to_string(place.local_world_size);
  const std::string node_rank = std::to_string(place.node_rank);
  const std::string port = std::to_string(place.master_port);

  env["SHOAL_RANK"] = rank;
  env["SHOAL_WORLD_SIZE"] = world_size;
  env["SHOAL_LOCAL_RANK"] = local_rank;
  env["SHOAL_LOCAL_WORLD_SIZE"] = local_world_size;
  env["SHOAL_NODE_RANK"] = node_rank;
  env["SHOAL_NNODES"] = std::to_string(place.nnodes);
  env["SHOAL_MASTER_ADDR"] = place.master_addr;
  env["SHOAL_MASTER_PORT"] = port;
  env["SHOAL_RUN_ID"] = place.run_id;

  // torchrun's, as torch.distributed.run 1.13 sets them for a static job with no restarts.
  env["RANK"] = rank;
  env["WORLD_SIZE"] = world_size;
  env["LOCAL_RANK"] = local_rank;
  env["LOCAL_WORLD_SIZE"] = local_world_size;
  env["GROUP_RANK"] = node_rank;
  env["ROLE_RANK"] = rank;
  env["ROLE_WORLD_SIZE"] = world_size;
  env["ROLE_NAME"] = "default";
  env["MASTER_ADDR"] = place.master_addr;
  env["MASTER_PORT"] = port;
  // The store at MASTER_ADDR:MASTER_PORT is already hosted (by node 0's launcher): workers
  // connect to it as clients and none of them may try to host it.
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_RUN_ID"] = place.run_id;
  env["TORCHELASTIC_RESTART_COUNT"] = "0";
  env["TORCHELASTIC_MAX_RESTARTS"] = "0";
  return env;
}

env::Environment elastic_worker_environment(const env::Environment& base, const ElasticPlace& place) {
  env::Environment env = base;
  for (const char* name : {"SHOAL_RANK", "SHOAL_WORLD_SIZE", "SHOAL_LOCAL_RANK", "SHOAL_NODE_RANK", "SHOAL_NNODES",
                           "SHOAL_MASTER_ADDR", "SHOAL_MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                           "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                           "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"}) {
    env.erase(name);
  }
  env["SHOAL_ELASTIC"] = "1";
  env["SHOAL_LOCAL_WORLD_SIZE"] = std::to_string(place.local_world_size);
  env["SHOAL_MIN_WORKERS"] = std::to_string(place.min_workers);
  env["SHOAL_MAX_WORKERS"] = std::to_string(place.max_workers);
  env["SHOAL_QUORUM"] = place.quorum ? "1" : "0";
  if (place.etcd.empty()) {
    env["SHOAL_RENDEZVOUS"] = "gossip";
    env["SHOAL_GOSSIP_SEEDS"] = place.seeds;
  } else {
    env["SHOAL_RENDEZVOUS"] = "etcd://" + place.etcd;
    env.erase("SHOAL_GOSSIP_SEEDS");
  }
  if (!place.token_file.empty()) env["SHOAL_JOB_TOKEN_FILE"] = place.token_file;
  env["SHOAL_LAST_CALL_MS"] = std::to_string(place.last_call.count());
  env["SHOAL_RENDEZVOUS_TIMEOUT"] = std::to_string(std::max<int64_t>(1, place.rendezvous_timeout.count() / 1000));
  env["SHOAL_RUN_ID"] = place.run_id;
  return env;
}

std::vector<std::string> to_envp(const env::Environment& env) {
  std::vector<std::string> entries;
  entries.reserve(env.size());
  for (const auto& [name, value] : env) entries.push_back(name + "=" + value);
  return entries;
}

std::string agent_metadata(const ElasticPlace& place) {
  return nlohmann::json{{"role", "agent"},
                        {"min", place.min_workers},
                        {"max", place.max_workers},
                        {"quorum", place.quorum},
                        {"last_call_ms", place.last_call.count()},
                        {"run_id", place.run_id}}
      .dump();
}

std::optional<ElasticPlace> parse_agent_metadata(const std::string& metadata) {
  const auto meta = nlohmann::json::parse(metadata, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object() || meta.value("role", "") != "agent") return std::nullopt;
  try {
    ElasticPlace place;
    place.min_workers = meta.at("min").get<int>();
    place.max_workers = meta.at("max").get<int>();
    place.quorum = meta.at("quorum").get<bool>();
    place.last_call = Duration(meta.at("last_call_ms").get<int64_t>());
    place.run_id = meta.at("run_id").get<std::string>();
    return place;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

}  // namespace shoal::proc
