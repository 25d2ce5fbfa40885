// What the launchers of an elastic job (`shoal run`, the queue's agents) do in its membership, and
// the one header through which they reach elastic's backends (docs/elastic.md, "shoal run for
// elastic jobs"). A launcher takes part in no round: with gossip it is a member of the job's
// membership (an agent) whose address is the job's, for launchers that join and for the workers
// it starts, and whose metadata carries the job's settings; with etcd it opens the job's record,
// which carries them, and its workers register themselves.
//
// Each class is implemented beside its backend and in its library (gossip/membership.cpp in
// shoal_gossip, etcd/membership.cpp in shoal_etcd), so that a program links only the backend it
// uses, and neither needs LibTorch.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "shoal/core/timeout.h"

namespace shoal::elastic {

namespace gossip {
class Gossip;
}
namespace etcd {
class Client;
}

struct GossipAgentOptions {
  // "HOST:PORT" of members already in the job; empty: this agent starts the job's membership.
  std::vector<std::string> seeds;
  // Where its UDP socket binds (empty: every interface), on `port` (0: any free port).
  std::string bind_host;
  int port = 0;
  // The address the job's other members reach it on; empty: the local address on the route to the
  // first seed, or 127.0.0.1 without seeds.
  std::string advertise_host;
  std::string token;  // the job's; may not be empty
  std::string meta;   // its metadata, for the launchers that join
  // How long joining keeps trying the seeds; kUnsetTimeout: the membership's default.
  Duration join_timeout = kUnsetTimeout;
};

// A launcher's agent in the job's gossip membership (gossip/swim.h).
class GossipAgent {
 public:
  // Joins the membership through its seeds, or starts it. UsageError: a bad seed address, an
  // empty token, a port that can't be bound, or a seed that refused the token; CommError: no seed
  // answered within the join timeout.
  explicit GossipAgent(const GossipAgentOptions& options);
  // Leaves the membership: every member is told at once.
  ~GossipAgent();
  GossipAgent(const GossipAgent&) = delete;
  GossipAgent& operator=(const GossipAgent&) = delete;

  // "IP:PORT": what launchers that join, and the workers, name as their seed.
  const std::string& address() const;
  // Replaces its metadata and tells every member at once.
  void set_meta(const std::string& meta);
  // The metadata of every other member known here, whatever its status.
  std::vector<std::string> others_meta() const;

 private:
  std::unique_ptr<gossip::Gossip> gossip_;
};

// The settings the launchers of a job share, from its first: --min, --max, --quorum and the last
// call of its rounds.
struct JobSettings {
  int min_workers = 1;
  int max_workers = 1;
  bool quorum = false;
  Duration last_call{0};
};

// A launcher's hold on the job's record in etcd (etcd/job.h): its settings, and the digest of its
// token that whoever joins must match.
class EtcdJob {
 public:
  // Opens the record of the job `run_id` in etcd at `endpoint` ("HOST:PORT"), creating it with
  // `settings` when there is none and `create`, and trying again while etcd does not answer, for
  // up to `timeout`. UsageError: an endpoint that is not HOST:PORT, a token that is not the job's,
  // or no record without `create`; CommError (the last attempt's): etcd did not answer in time.
  EtcdJob(const std::string& endpoint, const std::string& run_id, const std::string& token,
          const JobSettings& settings, bool create, Duration timeout);
  ~EtcdJob();
  EtcdJob(const EtcdJob&) = delete;
  EtcdJob& operator=(const EtcdJob&) = delete;

  // The job's settings, as its record holds them.
  const JobSettings& settings() const { return settings_; }
  // Deletes every key of the job once no worker is registered in it any more (best effort). Only
  // for a job whose training finished: one whose workers all died keeps its recorded commits
  // (Note [The job's recorded commits] in src/elastic/rendezvous.h).
  void forget_if_done() const;

 private:
  std::unique_ptr<etcd::Client> client_;
  std::string prefix_;
  JobSettings settings_;
};

}  // namespace shoal::elastic
