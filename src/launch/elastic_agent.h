// This launcher's part in an elastic job: its membership agent and the job's token file.
// Private to src/launch; see elastic_launch.cpp.
#pragma once

#include <unistd.h>

#include <memory>
#include <string>

#include "../elastic/gossip/swim.h"
#include "worker_env.h"

namespace shoal::launch {

class ElasticAgent {
 public:
  std::unique_ptr<elastic::gossip::Gossip> membership;
  std::string token_file;  // what workers read the token from
  bool owns_token_file = false;
  ElasticPlace place;

  ~ElasticAgent() {
    if (membership) membership->leave();
    if (owns_token_file) ::unlink(token_file.c_str());
  }
};

}  // namespace shoal::launch
