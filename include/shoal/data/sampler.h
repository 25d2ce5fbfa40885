// The data-parallel sampler: which samples each worker trains on, batch by batch.
//
// Every epoch has one global permutation of the dataset, a pure function of (seed, epoch); the
// job walks through it one global batch at a time, and each worker takes a contiguous slice of
// every global batch. Progress is one number shared by the whole job, the cursor: how many
// positions of the permutation completed global batches have consumed. That is what makes a
// restore or a change of the world exact (see docs/data.md).
//
// Contract: every worker builds its sampler with the same dataset size and options, and calls
// set_epoch / advance / reshard in the same order; then the workers' batches are disjoint and
// together cover each sample of an epoch exactly once (kPad adds repeats, kDrop leaves a tail).
//
// The batches come from one of two sources (src/data/batch_source.h): the cursor, or leases from
// parameter servers' ledger once lease_from() is called. Either way the sampler's state is the
// same five numbers, and it is a checkpoint::Stateful so that a checkpoint saves them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "shoal/checkpoint/savable.h"

namespace shoal::data {

// What happens to the last global batch of an epoch when it is smaller than the batch size.
enum class LastBatch {
  kKeep,  // it is kept, smaller; shares follow split_sizes, so some may be 0
  kDrop,  // it is skipped: every batch of the epoch is full
  kPad,   // it is filled up by wrapping around to the start of the permutation; those
          // samples are seen twice in that epoch (or more, when the dataset is smaller than a batch)
};

struct SamplerOptions {
  // The GLOBAL batch: samples the whole job consumes per step, cut among workers by
  // comm::split_sizes. With per_worker, the batch of each worker (global = batch_size * world).
  int64_t batch_size = 1;
  // False: the permutation is 0, 1, ..., n-1 every epoch.
  bool shuffle = false;
  LastBatch last_batch = LastBatch::kKeep;
  bool per_worker = false;
  // Must be the same on every worker; the default is.
  uint64_t seed = 0;
};

// Where a sampler stands; restoring it (on any world size) continues with the next batch.
struct SamplerState {
  uint64_t seed = 0;
  bool shuffle = false;
  int64_t dataset_size = 0;
  int64_t epoch = 0;
  // Positions of the epoch's permutation consumed by completed global batches.
  int64_t cursor = 0;
};

// Batches leased from elsewhere instead of cut from the epoch by the cursor: in an elastic
// parameter-server job, from the servers' ledger (docs/ps.md, "Elastic workers"), so that workers
// may come and go at any step and every sample of an epoch is still trained once.
class BatchLeases {
 public:
  struct Lease {
    enum class Kind {
      kBatch,      // positions [begin, end) of the epoch's permutation
      kIdle,       // nothing for this worker this step (the epoch's last batches are out)
      kEpochDone,  // every batch of the epoch is trained
    };
    Kind kind = Kind::kEpochDone;
    int64_t begin = 0;
    int64_t end = 0;
  };
  virtual ~BatchLeases() = default;
  // This worker's next batch of `epoch`, of at most `batch_size` positions of `dataset_size`.
  virtual Lease next(int64_t epoch, int64_t dataset_size, int64_t batch_size, bool drop_last) = 0;
};

namespace detail {
class BatchSource;  // src/data/batch_source.h
}  // namespace detail

class Sampler : public checkpoint::Stateful {
 public:
  // This worker's sampler in a job of `world_size` workers, as worker `rank`. UsageError for a
  // negative dataset_size, batch_size < 1, world_size < 1 or a rank outside [0, world_size).
  Sampler(int64_t dataset_size, const SamplerOptions& options, int rank, int world_size);
  // The same with shoal::rank() and shoal::world_size(); needs shoal::init().
  Sampler(int64_t dataset_size, const SamplerOptions& options);
  // A copy has a source of its own (a leased one shares the BatchLeases and copies the pending lease).
  Sampler(const Sampler& other);
  Sampler& operator=(const Sampler& other);
  Sampler(Sampler&& other) noexcept;
  Sampler& operator=(Sampler&& other) noexcept;
  ~Sampler() override;

  // Starts `epoch` at its first batch. Exception, so that a plain epoch loop resumes: the first
  // call after load_state() with the restored epoch keeps the restored cursor.
  void set_epoch(int64_t epoch);

  // Changes this worker's place in the job, keeping the epoch and the cursor: the rest of the
  // epoch is cut among the new workers. Every worker of the new world calls it (or builds a
  // sampler and load_state()s) before taking the next batch.
  void reshard(int rank, int world_size);

  // True when no batch is left in this epoch.
  bool epoch_done() const;
  // This worker's share of the global batch at the cursor, as dataset indices; empty when the
  // epoch is done, and also when this worker's share of a smaller last batch is 0.
  std::vector<size_t> batch() const;
  // Size of the global batch at the cursor (0 when the epoch is done).
  int64_t global_batch_at_cursor() const;
  // Moves the cursor past the global batch at the cursor (no-op when the epoch is done).
  // The loader calls it when it hands a batch out. See docs/data.md, "When the cursor moves".
  void advance();

  // Changes the batch (the options' batch_size: each worker's with per_worker) from the batch at
  // the cursor on. Every worker changes it at the same step (elastic::BatchPolicy::goodput() does,
  // at its commits); the cursor counts positions, so the epoch still gives every sample once.
  // UsageError for a batch_size < 1 and for a sampler that leases its batches.
  void set_batch_size(int64_t batch_size);
  // From now on, the batches are leased from `leases`, each of batch_size positions (per_worker)
  // or batch_size / world_size (rounded up); a kIdle lease is an empty batch. UsageError for
  // LastBatch::kPad, which leases cannot express. A null `leases` goes back to the cursor.
  void lease_from(std::shared_ptr<BatchLeases> leases);
  bool leased() const;

  SamplerState state() const;
  // Restores epoch and cursor. UsageError, changing nothing, when the state was saved for
  // another dataset size, seed or shuffle, or its epoch or cursor are out of range.
  void load_state(const SamplerState& state);

  // checkpoint::Stateful: state() as 0-dim int64 tensors named "seed" (the uint64's bits),
  // "shuffle" (0 or 1), "dataset_size", "epoch" and "cursor". check_state_dict raises UsageError
  // for a missing name, a value that is not a 0-dim integer tensor, or a state load_state()
  // refuses; load_state_dict(state) is load_state() of the same numbers.
  checkpoint::StateDict state_dict() const override;
  void check_state_dict(const checkpoint::StateDict& state) const override;
  void load_state_dict(const checkpoint::StateDict& state) override;

  // Global batches in a whole epoch, and those left from the cursor, at the current world.
  int64_t batches_per_epoch() const;
  int64_t batches_remaining() const;

  // The full global batch size: batch_size, or batch_size * world_size with per_worker.
  int64_t global_batch_size() const;
  int64_t epoch() const { return epoch_; }
  int64_t cursor() const { return cursor_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int64_t dataset_size() const { return dataset_size_; }
  const SamplerOptions& options() const { return options_; }
  // The current epoch's global permutation.
  const std::vector<size_t>& permutation() const { return permutation_; }

 private:
  int64_t batches_from(int64_t position) const;
  // load_state()'s checks, which check_state_dict() shares.
  void check_state(const SamplerState& state) const;

  SamplerOptions options_;
  int64_t dataset_size_ = 0;
  int rank_ = 0;
  int world_size_ = 1;
  int64_t epoch_ = 0;
  int64_t cursor_ = 0;
  // Set by load_state(), cleared by the next set_epoch(): see set_epoch.
  bool restored_ = false;
  std::vector<size_t> permutation_;
  // Where the batches come from; never null, except in a moved-from sampler.
  std::unique_ptr<detail::BatchSource> source_;
};

// The permutation of 0..size-1 for (seed, epoch): a Fisher-Yates shuffle driven by splitmix64,
// independent of torch's generators and of the platform. It is part of what a saved
// SamplerState means, so it must never change (a test pins its values).
std::vector<size_t> epoch_permutation(int64_t size, uint64_t seed, int64_t epoch);

}  // namespace shoal::data
