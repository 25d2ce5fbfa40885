// Rendezvous rounds of an elastic job: which workers train together next, and in what order.
// Private to src/elastic. One interface, one implementation per membership backend (gossip/,
// etcd/), as gloo's transport/ has tcp/ and uv/.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "shoal/core/timeout.h"

namespace shoal::elastic {

// One worker of a round, as it described itself.
struct Peer {
  std::string id;    // the membership's id for it
  std::string host;  // its host name (local ranks count workers with the same one)
  int pid = 0;
  std::string store;  // "IP:PORT" of the store it hosts for forming groups
};

// A closed round: every member of it got the same members in the same order; rank is this
// worker's index.
struct View {
  int64_t round = 0;
  std::vector<Peer> members;
  int rank = 0;

  int size() const { return static_cast<int>(members.size()); }
  // "worker 2 (pid 812 on node1)"
  std::string describe(int rank) const;
};

struct RendezvousOptions {
  int min_workers = 1;
  int max_workers = 1;
  // A round goes on only with more than half of the newest round anyone here knows of.
  bool quorum = false;
  // How long the candidates of a round must stay the same before it closes, so that workers
  // starting together (or joining together) land in one round. A round of only the previous
  // round's survivors closes without it.
  Duration last_call = std::chrono::milliseconds(1000);
};

// A worker waiting for a round, as a backend sees it.
struct Candidate {
  std::string id;
  int64_t prev_round = -1;  // the last round it trained in; -1 for none
  int prev_rank = -1;       // its rank there
};

// The newest closed round a worker knows of: what --quorum counts a majority of.
struct Newest {
  int64_t round = -1;  // -1: none yet
  std::vector<std::string> members;
};

// Whether `ids` may form a round: more than half of `newest` are among them. Always true without
// --quorum or before any round closed.
bool has_quorum(const RendezvousOptions& options, const Newest& newest,
                const std::vector<std::string>& ids);

// Note [Choosing a round's view]
// Both backends decide alike who forms a round, given the candidates (the workers waiting for it,
// this one included) once nobody live is behind: survivors of the newest round first, by their
// rank there, then newcomers by id, cut at --max. It is time to propose that view when there are
// at least --min candidates, (with --quorum) a majority of the newest round, and they are settled:
// the same for the last call, or exactly survivors of this worker's previous round, or --max of
// them. A backend agrees on the view in its own way (gossip: everyone ready with it; etcd: the
// first transaction to create the round's key).
class ViewChooser {
 public:
  explicit ViewChooser(const RendezvousOptions& options) : options_(options) {}

  // The view to propose, in rank order, when it is time and it includes `me` (whose previous
  // round is `prev_round`); otherwise empty, and `waiting_for` says what the round waits for.
  std::vector<std::string> choose(const std::string& me, int64_t prev_round,
                                  std::vector<Candidate> candidates, const Newest& newest,
                                  std::string& waiting_for);
  // The round changed: the last call starts again with the next candidates.
  void restart() { candidates_.clear(); }

 private:
  RendezvousOptions options_;
  std::string candidates_;  // their ids, sorted: what must stay the same for the last call
  std::chrono::steady_clock::time_point since_;
};

// Whether the log shows debug lines (SHOAL_LOG_LEVEL=debug, or SHOAL_ELASTIC_DEBUG=1; core/log.h):
// the backends then log every phase a worker publishes.
bool debugging();

// The CommError of a round that did not close before next()'s deadline.
[[noreturn]] void round_timed_out(int64_t round, Duration waited, const std::string& waiting_for);

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;

  // Blocks until a round after `previous` (null: this worker's first) closes with this worker
  // in it, and returns it. CommError after `timeout`, naming what the round waited for (too
  // few workers for --min, no quorum, a member that never agreed).
  virtual View next(const View* previous, Duration timeout) = 0;

  // Why `current` should be formed again although no member of it failed: a worker waits to
  // join and the round has room. "" when nothing is pending. Cheap: no communication.
  virtual std::string pending_change(const View& current) = 0;

  // The members of `current` the membership knows are gone, as a sentence; "" when none. Also
  // non-empty when the others declared this worker dead: its group is no longer theirs.
  virtual std::string lost(const View& current) = 0;

  // True once after next() had this worker join again under a new identity (the others had
  // declared it dead): whatever it committed since it went silent is not the job's history.
  virtual bool take_rejoined() = 0;

  // A collective of `current` failed: find out now which members are gone.
  virtual void check(const View& current) = 0;

  // This worker leaves the job (after a graceful stop); the others are told at once.
  virtual void leave() = 0;

  // Note [The job's recorded commits]
  // A newcomer whose round holds no commit must not start a job that has history from step 0.
  // record_commit() notes (once per round, and every 100 commits: State::commit()) that this
  // worker committed `version`, where later
  // newcomers see it even after this worker is gone; recorded_commit() is the newest such
  // version of any worker of the job, alive or not (0: none). Gossip keeps it in the worker's
  // metadata, which the membership keeps for dead members too; etcd in a key per worker with no
  // lease, which the job's last launcher deletes only when the job's training finished.
  virtual void record_commit(int64_t version) = 0;
  virtual int64_t recorded_commit() = 0;
};

}  // namespace shoal::elastic
