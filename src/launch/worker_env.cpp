#include "worker_env.h"

namespace shoal::launch {

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

std::vector<std::string> to_envp(const env::Environment& env) {
  std::vector<std::string> entries;
  entries.reserve(env.size());
  for (const auto& [name, value] : env) entries.push_back(name + "=" + value);
  return entries;
}

}  // namespace shoal::launch
