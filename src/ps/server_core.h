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
  // Note [Sealed pushes] (server_core.cpp): a push counts only once its worker has sealed it.
  // Elastic jobs set it: a worker may die between its pushes to two servers.
  bool sealed_pushes = false;
  // Threads a sync step's dense sum runs on when it is large (Note [A step's sum on two
  // threads], server_core.cpp): 1 or 2.
  int sum_threads = 2;
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

  // Note [Joins and leaves] (server_core.cpp), with sealed_pushes: a worker joins at a clock
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
  // push and push_taking: `take` is the request itself when its storage may be taken.
  PushReply accept_push(const PushRequest& request, PushRequest* take);
  // pull and pull_into.
  void answer_pull(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                   DenseOut* out);
  struct Table {
    TableSpec spec;
    int64_t numel = 0;  // dense
    int64_t dim = 0;    // sparse
  };

  void check_slices(const char* what, const std::vector<DenseSlice>& dense,
                    const std::vector<SparseSlice>& sparse, bool with_values) const;
  const Table& table_at(const char* what, int32_t index) const;
  std::vector<TableSpec> specs() const;
  bool holds_dense_chunks(const std::vector<TableSpec>& tables) const;
  VirtualShard* holder(int32_t shard);
  void apply(const std::vector<DenseSlice>& dense, const std::vector<SparseSlice>& sparse);
  // One dense chunk's optimizer step with the gradient `grad` (the chunk's length of values).
  void apply_chunk(int32_t table, int64_t chunk, const float* grad);
  void apply_ready_steps();  // sync: applies the open step while it is complete
  // Sync: applies one step's pushes (Note [Sync sum]); allocates nothing for dense tables once the
  // first step has sized the scratch buffers (Note [A step's sum without allocations]).
  void sum_step(const std::map<int32_t, PushRequest>& pushes);
  // Sync: holds a push in pending_ until its step, in storage reused from the worker's last one.
  // `take`: the request itself, whose dense slices' storage is swapped with the held push's
  // rather than copied (push_taking); null: copied.
  void buffer_push(const PushRequest& request, PushRequest* take);
  // The push as held (buffer_push's, and an elastic job's unsealed pushes).
  PushRequest hold(const PushRequest& request, PushRequest* take);
  // Keeps an applied step's pushes' storage for the workers' next pushes.
  void recycle(int32_t worker, PushRequest& push);
  void recycle(std::map<int32_t, PushRequest>& pushes);
  // `out`: where the dense values go when they fit (Note [Pull replies in place]), or null.
  void fill_reply(const PullRequest& request, PullReply& reply, DenseOut* out);
  void take_snapshot_when_due();  // see ServerCoreOptions::snapshot_every
  void load_shard_locked(int32_t shard, const std::string& bytes);
  // Note [Clocks after a reload]: takes worker w's clock from its first request after a reload.
  void adopt(int32_t w, int64_t clock);
  bool lost_push(int32_t w, int64_t clock) const;
  bool step_complete(int64_t clock) const;
  // Whether worker w joined after step `clock` (its push of that step is not waited for).
  bool joined_after(int32_t w, int64_t clock) const {
    auto it = joined_at_.find(w);
    return it != joined_at_.end() && it->second > clock;
  }
  // Sealed pushes: worker w's clock is sealed up to `clock`; applies what that completes.
  void seal(int32_t w, int64_t clock);
  // The ledger's batches of applied pushes are done.
  void finish_batch(int32_t worker, const PushRequest& push);
  void finish_batches(const std::map<int32_t, PushRequest>& pushes);
  // A leaver's ledger batches come back, but for those of its pushes still counted.
  void release_batches(int32_t w);
  int64_t slowest_clock() const;
  // UsageError naming the live workers, when `w` is not one of them.
  void check_live(const char* what, int32_t w) const;
  std::string describe_sync_wait(int64_t step) const;
  std::string describe_staleness_wait(int64_t needed) const;

  ServerCoreOptions options_;
  std::map<int32_t, VirtualShard> shards_;
  // By virtual shard: its entry in shards_ (map nodes do not move), or nullptr if not held here.
  std::vector<VirtualShard*> held_;
  bool holds(int32_t shard) const {
    return shard >= 0 && static_cast<size_t>(shard) < held_.size() &&
           held_[static_cast<size_t>(shard)] != nullptr;
  }
  std::vector<Table> tables_;
  // Note [A step's sum without allocations]: storage kept from step to step.
  std::map<int32_t, PushRequest> spare_;  // per worker: an applied push's, for its next push
  struct SumTerm {
    int32_t table;
    int64_t chunk;
    size_t order;   // the push's place in worker order
    double weight;  // its rows
    const float* grad;
  };
  std::vector<SumTerm> sum_terms_;
  struct SumScratch {
    std::vector<double> acc;  // one chunk's sum
    std::vector<float> out;   // one chunk's gradient, rounded
  };
  SumScratch sum_scratch_[2];  // one per thread (Note [A step's sum on two threads])
  // Where a step's dense sum has at least this many values, a second thread takes half.
  static constexpr size_t kSumSplitAtLeast = 1 << 20;
  // The term after the last one of sum_terms_[first]'s chunk.
  size_t next_chunk(size_t first) const;
  // Sums and applies the chunks of sum_terms_[first, end), which begins and ends at a chunk's
  // first term.
  void sum_chunks(size_t first, size_t end, double total, SumScratch& scratch);

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::set<int32_t> live_;
  std::map<int32_t, int64_t> clock_;  // pushes received, per worker ever live
  int64_t step_ = 0;
  int64_t pulls_waiting_ = 0;
  bool registered_ = false;
  std::map<int64_t, std::map<int32_t, PushRequest>> pending_;  // sync: step -> worker -> push
  std::map<int32_t, PushReply> last_reply_;  // per worker: the reply to its last push
  bool adopting_ = false;              // reloaded: the workers' clocks are not all known yet
  int64_t restored_step_ = -1;         // the snapshot's step
  std::map<int32_t, int64_t> adopted_;  // per worker: the clock it showed first after a reload
  std::map<int32_t, int64_t> sealed_;   // sealed_pushes: per worker, its sealed clock
  std::map<int32_t, int64_t> joined_at_;  // per worker: the step it joined at (0: from the start)
  std::set<int32_t> gone_;                // fenced off: no request of these is taken
  // sealed_pushes, not sync: pushes received and not yet sealed, per worker by clock.
  std::map<int32_t, std::map<int64_t, PushRequest>> unsealed_;
  std::optional<Ledger> ledger_;
};

}  // namespace shoal::ps::detail
