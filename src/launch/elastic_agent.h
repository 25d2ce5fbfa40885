// This launcher's part in an elastic job: its membership agent (or its hold on the job's record
// in etcd, src/elastic/membership.h) and the job's token file.
// Private to src/launch; see elastic_launch.cpp.
#pragma once

#include <unistd.h>

#include <memory>
#include <string>

#include "elastic/membership.h"
#include "proc/worker_env.h"

namespace shoal::launch {

class ElasticAgent {
 public:
  std::unique_ptr<elastic::GossipAgent> membership;  // gossip: this launcher's agent
  std::unique_ptr<elastic::EtcdJob> etcd;            // etcd: the job's record
  std::string token_file;  // what workers read the token from
  bool owns_token_file = false;
  proc::ElasticPlace place;
  // A worker of this launcher finished the training. Only then may it delete the job's keys in
  // etcd: a job whose workers all died keeps its recorded commits (Note [The job's recorded
  // commits]), so that a newcomer, or a launcher that joins it later, does not start it
  // from step 0.
  bool finished = false;

  ~ElasticAgent() {
    membership.reset();  // leaves the membership
    // The last launcher to end a finished job removes the job's keys.
    if (etcd && finished) etcd->forget_if_done();
    if (owns_token_file) ::unlink(token_file.c_str());
  }
};

}  // namespace shoal::launch
