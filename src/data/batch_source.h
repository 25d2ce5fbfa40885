// Where a data::Sampler's batches come from: cut from the epoch's permutation at the job's cursor,
// or leased from elsewhere (Sampler::lease_from). The Sampler holds one source and asks it for
// every batch; what the two share (the epoch, its permutation, the cursor, the world) stays in
// the Sampler. See docs/data.md, "Two sources of batches".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "shoal/data/sampler.h"

namespace shoal::data::detail {

// Each call is given the sampler it serves rather than holding a pointer to it: a Sampler is
// copied and moved (a Loader holds its own by value), which would leave such a pointer dangling.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // A source of its own for a copy of the sampler.
  virtual std::unique_ptr<BatchSource> clone() const = 0;
  virtual bool leased() const = 0;
  // set_epoch() started the sampler's epoch at its first batch (not when it resumed one).
  virtual void start_epoch() = 0;
  // Sampler's methods of the same names.
  virtual bool epoch_done(const Sampler& sampler) const = 0;
  virtual int64_t global_batch_at_cursor(const Sampler& sampler) const = 0;
  virtual std::vector<size_t> batch(const Sampler& sampler) const = 0;
  // Hands the batch at the cursor out; returns where the job's cursor stands after it.
  virtual int64_t advance(const Sampler& sampler) = 0;
};

// The job's walk through the permutation: the global batch at the cursor, cut among the workers
// by comm::split_sizes, and the cursor moves past all of it. It keeps nothing of its own.
class CursorSource final : public BatchSource {
 public:
  std::unique_ptr<BatchSource> clone() const override;
  bool leased() const override { return false; }
  void start_epoch() override {}
  bool epoch_done(const Sampler& sampler) const override;
  int64_t global_batch_at_cursor(const Sampler& sampler) const override;
  std::vector<size_t> batch(const Sampler& sampler) const override;
  int64_t advance(const Sampler& sampler) override;
};

// This worker's batches leased one at a time from a BatchLeases, as positions of the epoch's
// permutation. The cursor stays where it was: the leases' owner (the servers' ledger) keeps the
// epoch's progress. A kIdle lease is an empty batch.
class LeasedSource final : public BatchSource {
 public:
  LeasedSource(std::shared_ptr<BatchLeases> leases, int64_t lease_size, bool drop_last);
  std::unique_ptr<BatchSource> clone() const override;
  bool leased() const override { return true; }
  void start_epoch() override { lease_.reset(); }
  bool epoch_done(const Sampler& sampler) const override;
  int64_t global_batch_at_cursor(const Sampler& sampler) const override;
  std::vector<size_t> batch(const Sampler& sampler) const override;
  int64_t advance(const Sampler& sampler) override;

 private:
  const BatchLeases::Lease& current(const Sampler& sampler) const;

  std::shared_ptr<BatchLeases> leases_;
  int64_t lease_size_;
  bool drop_last_;
  // The lease the next batch() hands out. Taken by the first question about it (epoch_done(),
  // which a loader asks before each batch), so that one lease answers every question until
  // advance() or a new epoch lets it go.
  mutable std::optional<BatchLeases::Lease> lease_;
};

}  // namespace shoal::data::detail
