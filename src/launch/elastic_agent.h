// This launcher's part in an elastic job: its membership agent (or etcd client) and the job's
// token file.
// Private to src/launch; see elastic_launch.cpp.
#pragma once

#include <unistd.h>

#include <memory>
#include <string>

#include "../elastic/etcd/client.h"
#include "../elastic/etcd/job.h"
#include "../elastic/gossip/swim.h"
#include "proc/worker_env.h"

namespace shoal::launch {

class ElasticAgent {
 public:
  std::unique_ptr<elastic::gossip::Gossip> membership;  // gossip: this launcher's agent
  std::unique_ptr<elastic::etcd::Client> etcd;          // etcd: the server's client
  std::string etcd_prefix;
  std::string token_file;  // what workers read the token from
  bool owns_token_file = false;
  proc::ElasticPlace place;
  // A worker of this launcher finished the training. Only then may it delete the job's keys in
  // etcd: a job whose workers all died keeps its recorded commits (Note [The job's recorded
  // commits]), so that a newcomer, or a launcher that joins it later, does not start it
  // from step 0.
  bool finished = false;

  ~ElasticAgent() {
    if (membership) membership->leave();
    // The last launcher to end a finished job removes the job's keys.
    if (etcd && finished) elastic::etcd::forget_job_if_done(*etcd, etcd_prefix);
    if (owns_token_file) ::unlink(token_file.c_str());
  }
};

}  // namespace shoal::launch
