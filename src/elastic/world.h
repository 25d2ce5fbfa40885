// The world of an elastic job: this worker's membership, the store it hosts for forming groups,
// and the current round. Private to src/elastic; one per process.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "rendezvous.h"
#include "comm/store.h"
#include "shoal/core/env.h"
#include "runtime/world.h"

namespace shoal::elastic {

// What `shoal run --min/--max` (or the user) put in the environment. See docs/elastic.md.
struct Settings {
  RendezvousOptions rendezvous;
  std::vector<std::string> seeds;  // gossip: "HOST:PORT" of members already in the job
  std::string etcd;                // etcd: "HOST:PORT" of its client URL; empty for gossip
  std::string run_id;              // etcd: the job's keys are under "/shoal/<run id>/"
  std::string token;
  // How long a worker waits for a round to close before giving up.
  Duration rendezvous_timeout = std::chrono::minutes(10);
};

// UsageError naming the variable for anything missing or malformed.
Settings read_settings(const env::Environment& env);

class ElasticWorld {
 public:
  // The process's elastic world; UsageError when this is not an elastic job (init() not called,
  // or not started elastically).
  static ElasticWorld& get();

  // Joins the job: the first round this worker is part of. Called by shoal::init().
  static runtime::Round join(const JobSpec& discovered, const env::Environment& env, Duration connect_timeout,
                             Duration timeout);

  // Forms the next round and makes it shoal::world(). `failed`: the current round's group failed
  // (its members are probed first, so the dead are known quickly). Retries until a round's group
  // connects; CommError when no round closes within the rendezvous timeout.
  void reform(bool failed);

  Rendezvous& rendezvous() { return *rendezvous_; }
  // What the membership knows is gone from the current round ("" when nothing).
  std::string lost() const { return rendezvous_->lost(view_); }
  const View& view() const { return view_; }

 private:
  ElasticWorld() = default;
  runtime::Round form(const View& view);
  void next_round(const View* previous);

  Settings settings_;
  Duration connect_timeout_{0};
  Duration timeout_{0};
  std::string address_;  // this worker's address towards the job
  comm::StorePtr server_;
  std::unique_ptr<Rendezvous> rendezvous_;
  View view_;
  runtime::Round round_;
};

}  // namespace shoal::elastic
