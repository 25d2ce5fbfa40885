// Samplers for torch's own data loader: a program built on torch::data::make_data_loader becomes
// data parallel by changing its sampler type, not its loop.
//
//   auto loader = torch::data::make_data_loader<shoal::data::RandomSampler>(dataset, 64);
//   for (auto& batch : *loader) { ... }   // this worker's share of each global batch of 64
//
// torch's loader asks the sampler for `batch_size` indices per step; these samplers read that as
// the GLOBAL batch and give back this worker's contiguous slice of it, as data::Sampler does
// (the same permutation for the same seed and epoch, cut by comm::split_sizes). Each begin() of
// the loader starts the next epoch (0, 1, ...) unless set_epoch() chose one, PyTorch's
// DistributedSampler.set_epoch. DataParallel weighs each worker's gradient by the rows of the
// batch that goes through its forward (Note [Weighing gradients by batch share],
// shoal/dp/data_parallel.h), so the result is one process's whatever torch's loader prefetches.
//
// Limits, beside data::Loader: torch's loader refuses an empty request, so when a last batch
// has fewer samples than there are workers, it is repeated until every worker has one (Note [A
// last batch smaller than the worker count], src/data/sampler.cpp): exact for a mean loss, but
// those samples count more than once in batch-norm statistics; its drop_last compares a
// worker's share with the global batch size and would drop every batch, so it must stay false
// (RandomSampler(size, /*drop_last=*/true) drops a short last batch instead); elastic jobs need
// data::Loader, which elastic::State re-shards. See docs/data.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <torch/data/samplers/base.h>

namespace shoal::data {

class DistributedSampler : public torch::data::samplers::Sampler<> {
 public:
  // A sampler over `size` samples for this worker of the job; calls shoal::init() if the
  // program has not.
  DistributedSampler(int64_t size, bool shuffle, bool drop_last = false, uint64_t seed = 0);

  // Starts an epoch: the one set_epoch() chose, else the one after the last (0 at first).
  // `new_size` changes the dataset's size.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  // This worker's share of the next global batch of `batch_size`; nullopt at the epoch's end.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  // The epoch and the position in it; after load(), the loader's next begin() goes on from there
  // (on any world size: the position counts global samples).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // The epoch the next reset() starts.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  int64_t size_;
  bool shuffle_;
  bool drop_last_;
  uint64_t seed_;
  int rank_;
  int world_size_;
  int64_t epoch_ = -1;  // none started yet
  std::optional<int64_t> next_epoch_;
  int64_t cursor_ = 0;
  bool restored_ = false;  // set by load(): the next reset() keeps the saved place
  std::vector<size_t> permutation_;
};

// torch::data::samplers::RandomSampler's distributed counterpart: a new permutation each epoch,
// the same on every worker.
class RandomSampler : public DistributedSampler {
 public:
  explicit RandomSampler(int64_t size, bool drop_last = false, uint64_t seed = 0)
      : DistributedSampler(size, true, drop_last, seed) {}
};

// torch::data::samplers::SequentialSampler's: 0, 1, ..., size - 1 every epoch.
class SequentialSampler : public DistributedSampler {
 public:
  explicit SequentialSampler(int64_t size, bool drop_last = false) : DistributedSampler(size, false, drop_last) {}
};

}  // namespace shoal::data
