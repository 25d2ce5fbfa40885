// The epoch's ledger (docs/ps.md, "Elastic workers"): which batches of an epoch are trained,
// which are out with a worker, and which are still to be handed out. One server keeps it; workers
// lease their batches from it instead of cutting the epoch among themselves, so that a worker may
// die, leave or join at any step, in any consistency mode, and every sample of the epoch is still
// trained exactly once.
//
// Note [Batches are leased]
// An epoch is its permutation of the data set (data::epoch_permutation: the same on every
// process) cut into batches of `batch_size` positions; with drop_last, a short last batch is not
// part of it. A batch is fresh, leased to one worker, or done. lease() hands out the lowest
// returned batch, else the next fresh one. A batch becomes done when the push that carries its
// gradient is applied (the server calls done()), and it is done once: a second done() of it is
// refused. A worker that leaves or dies gives its leases back (release()), and they go to the
// next workers that ask, before any fresh batch, so the epoch's order is kept as far as it can be.
// The epoch is over when every batch is done. One epoch is open at a time: a worker that asks for
// the next epoch while batches of this one are still out is told to wait (they may come back);
// once every batch is done, the first lease of the next epoch opens it.
#pragma once

#include <cstdint>
#include <map>
#include <set>

namespace shoal::ps::detail {

class Ledger {
 public:
  struct Options {
    int64_t dataset_size = 0;
    int64_t batch_size = 1;
    bool drop_last = false;
  };
  // UsageError for a negative dataset size or a batch size below 1.
  explicit Ledger(Options options);

  struct Lease {
    enum class Kind {
      kBatch,      // train positions [begin, end) of the epoch's permutation
      kWait,       // nothing to hand out now, but batches are still out: ask again later
      kEpochDone,  // every batch of the epoch is done
    };
    Kind kind = Kind::kWait;
    int64_t epoch = 0;
    int64_t batch = -1;
    int64_t begin = 0;
    int64_t end = 0;
  };
  // A batch of `epoch` for `worker`. An epoch before the open one is done; the one after it opens
  // when the open one is done (else kWait); one further ahead is a UsageError.
  Lease lease(int32_t worker, int64_t epoch);
  // The batch's gradient was applied. UsageError (changing nothing) unless it is out with `worker`.
  void done(int32_t worker, int64_t epoch, int64_t batch);
  // A batch whose gradient was not applied (a backup worker's late push) goes back, to be leased
  // again first. UsageError (changing nothing) unless it is out with `worker`.
  void give_back(int32_t worker, int64_t epoch, int64_t batch);
  // Whether `batch` of `epoch` is out with `worker` (a push may name it).
  bool is_out(int32_t worker, int64_t epoch, int64_t batch) const;
  // The worker's batches that are out come back (it left or died), but for those in `keep` (its
  // gradients of them still count); returns how many came back.
  int64_t release(int32_t worker, const std::set<int64_t>& keep = {});

  const Options& options() const { return options_; }
  int64_t epoch() const { return epoch_; }
  int64_t batches_per_epoch() const;
  int64_t done_count() const { return done_; }
  int64_t out_count() const { return static_cast<int64_t>(out_.size()); }
  bool epoch_done() const { return done_ == batches_per_epoch(); }

 private:
  // Takes `batch` off the batches out with `worker`; UsageError saying "worker W <verb> batch B of
  // epoch E<after>; expected ..." when it is not out with it.
  void take_back(int32_t worker, int64_t epoch, int64_t batch, const char* verb, const char* after);

  Options options_;
  int64_t epoch_ = 0;
  int64_t next_ = 0;                // the next fresh batch of the open epoch
  int64_t done_ = 0;                // batches of the open epoch done
  std::map<int64_t, int32_t> out_;  // batch -> the worker it is leased to
  std::set<int64_t> returned_;      // batches given back, to hand out first
};

}  // namespace shoal::ps::detail
