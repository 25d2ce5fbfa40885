// A parameter server's core (docs/ps.md, "Consistency"): the virtual shards one server holds and
// how it answers the requests of messages.h, with no network: the Handler (handler.h) the
// transport (rpc.*) calls from many threads at once; every method is thread-safe. Every request is
// checked whole before any of it is applied: a bad one raises UsageError and changes nothing.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "handler.h"
#include "ledger.h"
#include "messages.h"
#include "server_leases.h"
#include "server_membership.h"
#include "server_registry.h"
#include "server_snapshots.h"
#include "server_steps.h"
#include "shard_map.h"
#include "shoal/core/timeout.h"
#include "table.h"

namespace shoal::ps::detail {

enum class Consistency {
  // Step c is applied once every live worker's push for c has arrived (or the first
  // replicas_to_aggregate of them): sum_w rows_w * grad_w / sum_w rows_w, in worker order.
  kSync,
  // Each push is applied as it arrives; a pull at clock c waits until the slowest live worker's
  // clock is at least c - staleness. Staleness 0 is kSync.
  kBoundedStaleness,
  // Each push is applied as it arrives; pulls never wait.
  kAsync,
};

struct ServerCoreOptions {
  Consistency consistency = Consistency::kSync;
  int64_t staleness = 0;              // kBoundedStaleness: the bound s
  // Note [The mode comes with the workers]: when set, consistency and staleness are the first
  // registration's mode (RegisterRequest::mode) rather than the two fields above; every later
  // registration must name the same. When not set, a registration naming another mode is refused.
  bool mode_from_workers = false;
  int32_t replicas_to_aggregate = 0;  // kSync: pushes a step takes (0: all live workers)
  std::vector<int32_t> workers;       // the live workers at the start
  std::vector<int32_t> shards;        // the virtual shards this server holds
  int32_t virtual_shards = kVirtualShards;
  // Snapshots (docs/ps.md, "Replicas and snapshots"): every `snapshot_every` steps applied (sync;
  // pushes applied in the other modes), on_snapshot gets the step and every held shard's bytes
  // (save_shard's), all taken under the core's lock so that they are one step's values. It is
  // called with that lock held: it must only hand the bytes on (to a writer thread).
  int64_t snapshot_every = 0;
  std::function<void(int64_t step, std::map<int32_t, std::string> shards)> on_snapshot;
  // A restarted server (Note [Clocks after a reload]): called once, when the first registration
  // has created the tables; returns the snapshot to load (its step and its shards' bytes) or
  // nullopt. on_adopted(snapshot step, adopted step) is called once every live worker's clock is
  // known, under the core's lock.
  struct Restored {
    int64_t step = 0;
    std::map<int32_t, std::string> shards;
  };
  std::function<std::optional<Restored>()> restore;
  std::function<void(int64_t snapshot_step, int64_t adopted_step)> on_adopted;
  // Note [Sealed pushes] (server_membership.cpp): a push counts only once its worker has sealed it.
  // Elastic jobs set it: a worker may die between its pushes to two servers.
  bool sealed_pushes = false;
  // Threads a sync step's dense sum runs on when it is large (Note [A step's sum on two
  // threads], server_sum.cpp): 1 or 2.
  int sum_threads = 2;
  // Keep the dense values in shared memory too, for pulls from this host to copy from (Note [The
  // values' mirror], mirror.h): a server process's, not the in-process core of a job of one.
  bool mirror_values = false;
};

// What a worker that leaves does to its push of a step not yet applied (sync): counted with the
// step (its samples were trained on), or discarded (its samples go back into the epoch).
enum class LeaverPush { kCount, kDiscard };

class ServerCore : public Handler {
 public:
  explicit ServerCore(ServerCoreOptions options);

  // Note [Who creates the tables]: the registration that carries `initial` creates the tables
  // (the client sends it from the first worker only, as DDP broadcasts the first worker's
  // parameters, so that every server starts from one worker's values); one without `initial`
  // waits for it until `deadline` (CommError after), unless this server holds no dense chunk.
  // Later registrations must match the first exactly (UsageError naming the first difference).
  void register_tables(const RegisterRequest& request, const Deadline& deadline) override;

  // Waits as the consistency mode says, until `deadline`; CommError after it, naming the workers
  // waited for and their clocks.
  PullReply pull(const PullRequest& request, const Deadline& deadline) override;
  // The same, written into `reply`, whose vectors keep their storage: a caller that pulls the
  // same chunks every step with one reply allocates nothing after the first.
  void pull_into(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                 DenseOut& out) override;
  void pull(const PullRequest& request, const Deadline& deadline, PullReply& reply) override;

  // Sync: buffers the push until its step is complete, then applies the step; with
  // replicas_to_aggregate, a push to a step already full is answered counted = false and
  // dropped. Bounded staleness and async: applies it at once. Never waits, so its deadline
  // cannot pass.
  //
  // Note [Retried pushes]: a push is known by (worker, clock). The push of a worker's last step,
  // sent again, is answered with the reply it got the first time and changes nothing: a client
  // that lost a server's answer (the server died after applying or forwarding it, docs/ps.md
  // "Replicas and snapshots") retries on its replica, which may already hold it. Any other step
  // but the worker's next is refused.
  PushReply push(const PushRequest& request, const Deadline& deadline) override;
  // The same; a sync push that waits for its step takes the request's dense values' storage
  // instead of copying them (Note [Taking a push's storage]).
  PushReply push_taking(PushRequest& request, const Deadline& deadline) override;

  // Workers leave and join. A joiner's clock starts at the server's step (sync) or at the slowest
  // staying worker's clock (the others), so it neither blocks steps already closed nor lags.
  void set_live_workers(const std::vector<int32_t>& workers, LeaverPush leavers);

  // With sealed_pushes: the worker's sealed clock (its pushes of earlier steps are sealed here),
  // and its leaving. `sealed` is the highest sealed clock any server reported for it: its pushes
  // of steps before it count (they reached every server), later ones are dropped, and its
  // ledger batches that no counted push carries go back to the ledger.
  int64_t sealed_clock(int32_t worker) const;
  void leave(int32_t worker, int64_t sealed);

  // Note [Joins and leaves] (server_membership.cpp), with sealed_pushes: a worker joins at a clock
  // (returns the clock it is live from), and a lost one is fenced off before it leaves (returns
  // its sealed clock); after that the server takes no request of it and it cannot join again.
  int64_t join(int32_t worker, int64_t clock);
  int64_t fence(int32_t worker);
  MembershipReply membership(const MembershipRequest& request, const Deadline& deadline) override;

  // The epoch's ledger (ledger.h), on the server that keeps it: opened by the first worker that
  // asks for a batch (later workers must name the same data set and batch size); a lease is for a
  // live worker. Never waits.
  LeaseReply lease(const LeaseRequest& request, const Deadline& deadline) override;
  // The ledger's counts, for tests and the job's progress: (epoch, batches done, batches out).
  std::optional<std::array<int64_t, 3>> ledger_counts() const;

  // The fastest live worker's clock minus the slowest's (a worker's clock: steps it pushed).
  int64_t staleness() const;
  // Steps applied (sync) or pushes applied (the others).
  int64_t step() const;
  int64_t clock_of(int32_t worker) const;
  // Pulls waiting now (for a step or for the slowest worker).
  int64_t pulls_waiting() const;
  // Sparse rows held in memory (rows a push updated), over all shards.
  size_t row_count() const;

  // One virtual shard as bytes (its chunks and rows with their optimizer state, by table name),
  // and back: a shard saved by any server loads onto whichever server holds it under another
  // server count, once the same tables are registered there. load_shard replaces the shard's
  // contents whole, after checking every byte (a bad snapshot is a UsageError and changes nothing).
  std::string save_shard(int32_t shard) const;
  void load_shard(int32_t shard, const std::string& bytes);

 private:
  // The options, checked (UsageError naming the first that does not fit), with bounded staleness
  // 0 taken as sync.
  static ServerCoreOptions checked(ServerCoreOptions options);
  // push and push_taking: `take` is the request itself when its storage may be taken.
  PushReply accept_push(const PushRequest& request, PushRequest* take);
  // pull and pull_into.
  void answer_pull(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                   DenseOut* out);
  // Note [Clocks after a reload] (server_snapshots.cpp): takes worker w's clock from its first
  // request after a reload.
  void adopt(int32_t w, int64_t clock);
  // Sealed pushes: worker w's clock is sealed up to `clock`; applies what that completes.
  void seal(int32_t w, int64_t clock);
  int64_t slowest_clock() const;

  // The locked façade: every public method takes mutex_ and calls the parts below, which take no
  // lock of their own; changed_ wakes the requests that wait (pulls, registrations) whenever a
  // step, a clock or the live set changes. options_ comes first: the parts keep a reference.
  ServerCoreOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  int64_t pulls_waiting_ = 0;
  ServerRegistry registry_;      // the tables and shards, registration, the mode
  ServerMembership membership_;  // live workers, clocks, sealed clocks, joins and fences
  ServerLeases leases_;          // the epoch's ledger
  ServerSnapshots snapshots_;    // snapshots, and a restarted server's reload
  ServerSteps steps_;            // the step, the pushes waiting for it, and its sum
};

}  // namespace shoal::ps::detail
