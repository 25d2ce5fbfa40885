// Rendezvous rounds over an etcd server (v3 API, through its JSON gateway): for jobs too big for
// gossip, or sites that run etcd anyway. Same rounds as gossip/rendezvous.h; see docs/elastic.md,
// "The etcd backend", and Note [Rounds in etcd] in rendezvous.cpp.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../rendezvous.h"

namespace shoal::elastic::etcd {

struct EtcdOptions {
  std::string endpoint;  // "HOST:PORT" of etcd's client URL
  std::string prefix;    // where the job's keys go, e.g. "/shoal/<run id>/"
  // A worker whose lease is not renewed for this long (stopped, cut off, dead) is gone. etcd
  // counts whole seconds (rounded up) and has a minimum (1.5 election timeouts).
  Duration lease_ttl = std::chrono::seconds(5);
  Duration request_timeout = std::chrono::seconds(2);  // each request to etcd
  Duration connect_timeout =
      std::chrono::seconds(10);  // the constructor's, for an etcd that does not answer
  Duration probe_timeout =
      std::chrono::milliseconds(200);  // check(): connecting to a member's store
};

class Session;

// Thread-safe: lost() may be called from another thread than the one running next().
class EtcdRendezvous : public Rendezvous {
 public:
  // Registers this worker (self.id is set here). CommError naming the endpoint when etcd does
  // not answer within options.connect_timeout; UsageError for a malformed endpoint.
  EtcdRendezvous(EtcdOptions options, Peer self, RendezvousOptions rendezvous);
  // Stops the background thread. Says nothing to etcd: this worker's key stays until its lease
  // expires or another worker's check() finds its store closed (see leave()).
  ~EtcdRendezvous() override;

  View next(const View* previous, Duration timeout) override;
  std::string pending_change(const View& current) override;
  std::string lost(const View& current) override;
  bool take_rejoined() override;
  void check(const View& current) override;
  void leave() override;
  // Under commits/<id>, with no lease (Note [The job's recorded commits]). CommError from
  // recorded_commit() when etcd does not answer; record_commit() tries again next time.
  void record_commit(int64_t version) override;
  int64_t recorded_commit() override;

  // This worker's id (it changes when the worker joins again).
  std::string id() const;

 private:
  struct Table;

  std::shared_ptr<Session> session() const;
  // The workers and closed rounds under the prefix, parsed from the session's copy of the keys
  // (again only when that changed).
  std::shared_ptr<const Table> table() const;
  void publish(const std::string& phase, int64_t round);
  // After etcd dropped this worker's key (it was silent longer than its lease), it registers
  // again under a new id, as a newcomer. False when etcd does not answer within `timeout`.
  bool rejoin(Duration timeout);
  // Who to propose for `round` now, in rank order; empty when it is not time (`waiting_for` says
  // why). See Note [Choosing a round's view] in ../rendezvous.h.
  std::vector<std::string> proposal(int64_t round, const Table& table, ViewChooser& chooser,
                                    std::string& waiting_for) const;
  View close(int64_t round, const std::vector<Peer>& members);
  // Deletes the keys of the members check() found gone; those etcd did not take stay in gone_.
  void erase_gone();
  bool has_gone() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !gone_.empty();
  }
  // Deletes the keys of closed rounds before `round`: nobody reads them any more (a worker that
  // waits for an old round follows the job to a later one). Best effort.
  void forget_rounds_before(int64_t round);

  EtcdOptions options_;
  RendezvousOptions rendezvous_;
  mutable std::mutex
      mutex_;  // guards what lost() and pending_change() read: self_, session_, the table
  Peer self_;  // its id changes when the worker joins again
  std::shared_ptr<Session> session_;
  uint64_t generation_ = 0;  // raised with each new session
  mutable std::shared_ptr<const Table> table_;
  mutable uint64_t table_generation_ = 0;
  mutable uint64_t table_version_ = 0;
  // This worker's last round, its rank in it and its members (for ordering and --quorum).
  int64_t prev_round_ = -1;
  int prev_rank_ = -1;
  std::vector<std::string> prev_view_;
  bool rejoined_ = false;
  bool left_ = false;
  int64_t recorded_ = 0;  // the newest commit record_commit() wrote (the training thread's)
  std::vector<std::string> gone_;  // ids of members whose stores refused, still to delete in etcd
};

}  // namespace shoal::elastic::etcd
