// Rendezvous rounds over the gossip membership: no service, only the job's processes.
// See docs/elastic.md, "Rendezvous rounds", for the protocol.
#pragma once

#include <memory>

#include "../rendezvous.h"
#include "swim.h"

namespace shoal::elastic::gossip {

class GossipRendezvous : public Rendezvous {
 public:
  // `membership` has this worker's gossip options; `self` its description (id filled in here).
  GossipRendezvous(Options membership, Peer self, RendezvousOptions options);
  ~GossipRendezvous() override;

  View next(const View* previous, Duration timeout) override;
  std::string pending_change(const View& current) override;
  std::string lost(const View& current) override;
  bool take_rejoined() override;
  void check(const View& current) override;
  void leave() override;
  void record_commit(int64_t version) override;
  int64_t recorded_commit() override;

  // This worker's membership (for tests and logs).
  const Gossip& membership() const { return *gossip_; }

 private:
  void publish(const std::string& phase, int64_t round, const std::vector<std::string>& view);
  // A worker declared dead (it was silent too long) can't go on under its id: it starts over
  // in the membership as a newcomer, and its state is replaced by a survivor's.
  void rejoin_if_declared_dead();

  Options membership_options_;
  Peer self_;
  RendezvousOptions options_;
  std::unique_ptr<Gossip> gossip_;
  // This worker's last round, its rank in it and its members (for ordering and --quorum).
  int64_t prev_round_ = -1;
  int prev_rank_ = -1;
  std::vector<std::string> prev_view_;
  bool rejoined_ = false;
  // What publish() last said, and the commit recorded in it (Note [The job's recorded commits]).
  std::string phase_ = "wait";
  int64_t round_ = 0;
  std::vector<std::string> view_;
  int64_t committed_ = 0;
};

}  // namespace shoal::elastic::gossip
