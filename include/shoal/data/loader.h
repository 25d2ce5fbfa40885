// A loader over a torch::data dataset that gives this worker its share of every global batch:
//
//   shoal::data::LoaderOptions options;
//   options.batch_size = 64;
//   options.shuffle = true;
//   auto loader = shoal::data::make_loader(dataset, options);
//   for (int epoch = 0; epoch < 10; ++epoch)
//     for (auto& batch : loader.epoch(epoch)) { /* batch.data, batch.target */ }
//
// The batches come from a Sampler (sampler.h); in a job of one they are the batches a plain
// torch::data loader with the same batch size would give (a sequential one when shuffle is
// false). See docs/data.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/ArrayRef.h>
#include <torch/data/example.h>
#include <torch/data/transforms/stack.h>

#include "shoal/core/error.h"
#include "shoal/data/sampler.h"

namespace shoal::data {

// The loader has no options of its own (it loads in the calling thread): they are its sampler's.
using LoaderOptions = SamplerOptions;

namespace detail {

// A dataset's get_batch gives either single examples, stacked here along a new dim 0 as
// torch::data's Stack does, or a batch collated already (a dataset mapped with Stack, or a
// BatchDataset<Self, Example<>> gathering whole tensors with index_select: the fast path).
inline torch::data::Example<> collate(std::vector<torch::data::Example<>> examples) {
  return torch::data::transforms::Stack<torch::data::Example<>>().apply_batch(std::move(examples));
}
inline torch::data::TensorExample collate(std::vector<torch::data::TensorExample> examples) {
  return torch::data::transforms::Stack<torch::data::TensorExample>().apply_batch(std::move(examples));
}
inline torch::data::Example<> collate(torch::data::Example<> batch) { return batch; }
inline torch::data::TensorExample collate(torch::data::TensorExample batch) { return batch; }

// The same batch with no rows, keeping the other dimensions and the dtypes.
inline torch::data::Example<> without_rows(const torch::data::Example<>& batch) {
  return {batch.data.narrow(0, 0, 0), batch.target.narrow(0, 0, 0)};
}
inline torch::data::TensorExample without_rows(const torch::data::TensorExample& batch) {
  return batch.data.narrow(0, 0, 0);
}

template <typename Dataset>
int64_t dataset_size(const Dataset& dataset) {
  const auto size = dataset.size();
  if (!size.has_value()) {
    throw UsageError("make_loader: the dataset's size() is empty; expected a dataset of known size");
  }
  return static_cast<int64_t>(*size);
}

}  // namespace detail

template <typename Dataset>
class Loader {
  static_assert(std::is_same_v<typename Dataset::BatchRequestType, c10::ArrayRef<size_t>>,
                "shoal::data::Loader needs a map-style dataset (get_batch of indices), not a stream");

 public:
  using Batch = decltype(detail::collate(std::declval<Dataset&>().get_batch(c10::ArrayRef<size_t>())));

  // Hands out the batches left in the sampler's epoch. Input iterator: one pass.
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = Batch*;
    using reference = Batch&;

    Iterator() = default;  // the end
    explicit Iterator(Loader* loader) : loader_(loader) { fetch(); }

    Batch& operator*() { return *batch_; }
    Batch* operator->() { return &*batch_; }
    Iterator& operator++() {
      fetch();
      return *this;
    }
    // Only "is it the end" is compared, as for any input iterator.
    bool operator==(const Iterator& other) const { return batch_.has_value() == other.batch_.has_value(); }
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    // The cursor moves past a batch when it is handed out, and only once it has loaded: a
    // checkpoint taken in the loop's body, after the step, resumes with the next batch.
    void fetch() {
      batch_.reset();
      Sampler& sampler = loader_->sampler_;
      if (sampler.epoch_done()) return;
      batch_ = loader_->load(sampler.batch());
      sampler.advance();
    }

    Loader* loader_ = nullptr;
    std::optional<Batch> batch_;
  };

  // What loader.epoch(e) returns, for a range-for.
  class Epoch {
   public:
    explicit Epoch(Loader* loader) : loader_(loader) {}
    Iterator begin() { return Iterator(loader_); }
    Iterator end() { return Iterator(); }

   private:
    Loader* loader_;
  };

  // UsageError when the sampler was made for a dataset of another size.
  Loader(Dataset dataset, Sampler sampler) : dataset_(std::move(dataset)), sampler_(std::move(sampler)) {
    const int64_t size = detail::dataset_size(dataset_);
    if (size != sampler_.dataset_size()) {
      throw UsageError("Loader: the sampler is for a dataset of " + std::to_string(sampler_.dataset_size()) +
                       " samples; this one has " + std::to_string(size));
    }
  }

  // Sets the sampler's epoch (Sampler::set_epoch: from the start, or from a restored cursor)
  // and returns the batches of this worker left in it.
  Epoch epoch(int64_t epoch) {
    sampler_.set_epoch(epoch);
    return Epoch(this);
  }

  Sampler& sampler() { return sampler_; }
  const Sampler& sampler() const { return sampler_; }
  Dataset& dataset() { return dataset_; }
  int64_t batches_per_epoch() const { return sampler_.batches_per_epoch(); }

 private:
  // This worker's part of the global batch of the given dataset indices; a part with no
  // indices gives a batch of 0 rows, so that every worker takes the same number of steps.
  Batch load(const std::vector<size_t>& indices) {
    if (indices.empty()) {
      const size_t any = 0;
      return detail::without_rows(detail::collate(dataset_.get_batch(c10::ArrayRef<size_t>(&any, 1))));
    }
    return detail::collate(dataset_.get_batch(c10::ArrayRef<size_t>(indices)));
  }

  Dataset dataset_;
  Sampler sampler_;
};

// A loader over `dataset` for worker `rank` of `world_size`.
template <typename Dataset>
Loader<Dataset> make_loader(Dataset dataset, const LoaderOptions& options, int rank, int world_size) {
  Sampler sampler(detail::dataset_size(dataset), options, rank, world_size);
  return Loader<Dataset>(std::move(dataset), std::move(sampler));
}

// A loader over `dataset` for this worker of the job (needs shoal::init()).
template <typename Dataset>
Loader<Dataset> make_loader(Dataset dataset, const LoaderOptions& options = {}) {
  Sampler sampler(detail::dataset_size(dataset), options);
  return Loader<Dataset>(std::move(dataset), std::move(sampler));
}

}  // namespace shoal::data
