#include "dp/shards.h"

#include <cmath>
#include <deque>
#include <limits>
#include <string>
#include <utility>

#include <ATen/core/grad_mode.h>

#include "shoal/core/error.h"

namespace shoal::dp {

Shards::Shards(std::vector<at::Tensor> params, int rank, int size, int stage)
    : params_(std::move(params)), rank_(rank), size_(size), stage_(stage) {
  SHOAL_CHECK(size >= 1 && rank >= 0 && rank < size) << "rank " << rank << " of " << size;
  at::NoGradGuard no_grad;
  for (const auto& p : params_) {
    if (!p.is_contiguous()) {
      throw UsageError("zero_stage: sharding needs contiguous parameters; one of shape " +
                       std::to_string(p.dim()) +
                       "-d is not (make it contiguous before wrapping the model)");
    }
    starts_.push_back(comm::split_starts(p.numel(), size));
    index_of_[p.unsafeGetTensorImpl()] = slices_.size();
    const int64_t start = starts_.back()[rank];
    const int64_t length = starts_.back()[rank + 1] - start;
    // Note [A parameter's slice]: its own tensor, over the parameter's memory at stages 1 and 2,
    // in memory of its own at stage 3 (the parameter's is freed between uses).
    at::Tensor slice;
    if (stage >= 3) {
      slice = p.detach().view(-1).narrow(0, start, length).clone();
    } else {
      slice = at::empty({0}, p.options());
      slice.set_(p.storage(), p.storage_offset() + start, {length}, {1});
    }
    slice.requires_grad_(p.requires_grad());
    slices_.push_back(slice);
  }
  if (stage_ == 1) set_sums_apart();
}

void Shards::recut(int rank, int size) {
  SHOAL_CHECK(size >= 1 && rank >= 0 && rank < size) << "rank " << rank << " of " << size;
  at::NoGradGuard no_grad;
  rank_ = rank;
  size_ = size;
  for (size_t k = 0; k < params_.size(); ++k) {
    const at::Tensor& p = params_[k];
    starts_[k] = comm::split_starts(p.numel(), size);
    const int64_t start = starts_[k][rank], length = starts_[k][rank + 1] - start;
    at::Tensor& slice = slices_[k];
    slice.mutable_grad().reset();
    if (stage_ >= 3) {
      slice.set_(at::empty({length}, slice.options().requires_grad(false)));
    } else {
      slice.set_(p.storage(), p.storage_offset() + start, {length}, {1});
    }
    if (k < apart_.size()) {
      apart_[k] = at::Tensor();
      apart_open_[k] = true;
    }
  }
}

Shards::~Shards() {
  for (size_t k = 0; k < apart_hooks_.size(); ++k) params_[k].remove_hook(apart_hooks_[k]);
}

void Shards::set_sums_apart() {
  apart_.resize(params_.size());
  apart_open_.assign(params_.size(), true);
  for (size_t k = 0; k < params_.size(); ++k) {
    // Runs before the gradient accumulates into the parameter's .grad.
    apart_hooks_.push_back(params_[k].register_hook([this, k](const at::Tensor&) {
      // Once between two synchronized backwards: the first gradient after one.
      if (!apart_open_[k]) return at::Tensor();
      apart_open_[k] = false;
      at::Tensor& grad = slices_[k].mutable_grad();
      if (!grad.defined() || grad.numel() == 0) return at::Tensor();
      at::NoGradGuard no_grad;
      if (grad.count_nonzero().item<int64_t>() == 0) return at::Tensor();
      apart_[k] = grad.clone();
      grad.zero_();
      return at::Tensor();
    }));
  }
}

Shards::Layout Shards::layout(const std::vector<size_t>& bucket) const {
  Layout layout;
  layout.segments.assign(size_, 0);
  layout.offsets.assign(bucket.size(), std::vector<int64_t>(size_, 0));
  int64_t base = 0;
  for (int r = 0; r < size_; ++r) {
    for (size_t j = 0; j < bucket.size(); ++j) {
      layout.offsets[j][r] = base + layout.segments[r];
      layout.segments[r] += length(bucket[j], r);
    }
    base += layout.segments[r];
  }
  return layout;
}

void Shards::pack(size_t k, const at::Tensor& gradient, const std::vector<int64_t>& offsets,
                  at::Tensor& buffer, double scale) const {
  const at::Tensor flat = gradient.reshape(-1);
  for (int r = 0; r < size_; ++r) {
    const int64_t length = this->length(k, r);
    if (length == 0) continue;
    auto part = buffer.narrow(0, offsets[r], length);
    auto source = flat.narrow(0, start(k, r), length);
    if (scale == 1.0) {
      part.copy_(source);
    } else {
      at::mul_out(part, source, at::scalar_tensor(scale, part.options()));
    }
  }
}

void Shards::give_gradients(const std::vector<size_t>& bucket, const Layout& layout,
                            const at::Tensor& mine, const std::function<bool(size_t)>& skip) {
  at::NoGradGuard no_grad;
  const int64_t base = layout.offsets.empty() ? 0 : layout.offsets[0][rank_];
  for (size_t slot = 0; slot < bucket.size(); ++slot) {
    const size_t k = bucket[slot];
    if (skip(k)) continue;
    at::Tensor& grad = slices_[k].mutable_grad();
    const int64_t offset = layout.offsets[slot][rank_] - base, length = slices_[k].numel();
    const at::Tensor part = mine.narrow(0, offset, length);
    // A .grad over memory made with set_, not an autograd view: Optimizer::zero_grad() detaches
    // every .grad in place, which autograd refuses for views.
    const auto alias = [&](const at::Tensor& memory, int64_t at) {
      grad = at::empty({0}, memory.options());
      grad.set_(memory.storage(), memory.storage_offset() + at, {length}, {1});
    };
    if (stage_ == 1) {
      // Stage 1 keeps the full gradient: the slice's .grad is its part of the parameter's, which
      // held what accumulated before this backward (summed into the average).
      at::Tensor& full = params_[k].mutable_grad();
      if (!full.defined()) full = at::zeros_like(params_[k]);
      if (!grad.defined() ||
          grad.data_ptr() != full.view(-1).narrow(0, start(k, rank_), length).data_ptr()) {
        alias(full, start(k, rank_));
      }
      grad.copy_(part);
      if (k < apart_.size()) {
        if (apart_[k].defined()) grad.add_(std::exchange(apart_[k], at::Tensor()));
        apart_open_[k] = true;
      }
    } else if (grad.defined()) {
      grad.add_(part);
    } else {
      alias(mine, offset);
    }
  }
}

std::optional<size_t> Shards::index_of(const at::Tensor& parameter) const {
  const auto found = index_of_.find(parameter.unsafeGetTensorImpl());
  if (found == index_of_.end()) return std::nullopt;
  return found->second;
}

comm::Work Shards::start_gather(comm::Group& group, const std::vector<size_t>& bucket,
                                const Layout& layout) const {
  const int64_t base = layout.offsets.empty() ? 0 : layout.offsets[0][rank_];
  auto mine =
      at::empty({layout.segments[rank_]}, slices_[bucket.front()].options().requires_grad(false));
  for (size_t j = 0; j < bucket.size(); ++j) {
    const at::Tensor& slice = slices_[bucket[j]];
    if (slice.numel() > 0)
      mine.narrow(0, layout.offsets[j][rank_] - base, slice.numel()).copy_(slice);
  }
  comm::AllGatherOptions options;
  options.sizes = layout.segments;
  return group.all_gather_async(mine, options);
}

void Shards::unpack(const std::vector<size_t>& bucket, const Layout& layout, const at::Tensor& all,
                    const std::function<at::Tensor(size_t)>& flat, bool skip_own) const {
  for (size_t j = 0; j < bucket.size(); ++j) {
    const size_t k = bucket[j];
    at::Tensor memory = flat(k);
    for (int r = 0; r < size_; ++r) {
      const int64_t length = this->length(k, r);
      if (length == 0 || (skip_own && r == rank_)) continue;
      memory.narrow(0, start(k, r), length).copy_(all.narrow(0, layout.offsets[j][r], length));
    }
  }
}

std::vector<std::vector<size_t>> Shards::consecutive(int64_t bucket_bytes) const {
  std::vector<std::vector<size_t>> buckets;
  int64_t bytes = 0;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (buckets.empty() || bytes >= bucket_bytes ||
        params_[buckets.back().front()].scalar_type() != params_[k].scalar_type()) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(k);
    bytes += params_[k].numel() * static_cast<int64_t>(params_[k].element_size());
  }
  return buckets;
}

void Shards::sum_gradients(comm::Group& group, int64_t bucket_bytes, Duration timeout) {
  SHOAL_CHECK(group.size() == size_)
      << "shards for " << size_ << " members summed over " << group.size();
  at::NoGradGuard no_grad;
  for (const auto& bucket : consecutive(bucket_bytes)) {
    const Layout cut = layout(bucket);
    int64_t total = 0;
    for (auto segment : cut.segments) total += segment;
    auto buffer = at::zeros({total}, params_[bucket.front()].options().requires_grad(false));
    for (size_t j = 0; j < bucket.size(); ++j) {
      const size_t k = bucket[j];
      at::Tensor& grad = params_[k].mutable_grad();
      if (!grad.defined()) continue;
      pack(k, grad, cut.offsets[j], buffer, 1.0);
      if (stage_ >= 2) {
        grad.reset();
      } else {
        grad.zero_();
      }
    }
    comm::ReduceScatterOptions options;
    options.sizes = cut.segments;
    options.timeout = timeout;
    const at::Tensor mine = group.reduce_scatter(buffer, options);
    give_gradients(bucket, cut, mine, [](size_t) { return false; });
  }
}

void Shards::gather(comm::Group& group, int64_t bucket_bytes) {
  SHOAL_CHECK(group.size() == size_)
      << "shards for " << size_ << " members gathered over " << group.size();
  SHOAL_CHECK(stage_ < 3) << "stage 3 gathers by unit (src/dp/gatherer.h)";
  if (size_ == 1) return;  // the slices are the parameters
  // Consecutive parameters of one dtype, about bucket_bytes at a time, in registration order
  // (the order forward uses them).
  const auto buckets = consecutive(bucket_bytes);
  struct InFlight {
    const std::vector<size_t>* bucket;
    Layout layout;
    comm::Work work;
  };
  at::NoGradGuard no_grad;
  const auto launch = [&](const std::vector<size_t>& bucket) {
    InFlight flight{&bucket, layout(bucket), {}};
    flight.work = start_gather(group, bucket, flight.layout);
    return flight;
  };
  // Two in flight: the next bucket travels while this one is copied out, and the gathered
  // buffers alive at once stay two buckets' worth. This member's parts are in place already.
  std::deque<InFlight> flights;
  size_t next = 0;
  while (next < buckets.size() && flights.size() < 2) flights.push_back(launch(buckets[next++]));
  while (!flights.empty()) {
    InFlight flight = std::move(flights.front());
    flights.pop_front();
    flight.work.wait();
    if (next < buckets.size()) flights.push_back(launch(buckets[next++]));
    unpack(
        *flight.bucket, flight.layout, flight.work.result(),
        [this](size_t k) { return params_[k].view(-1); }, /*skip_own=*/true);
  }
}

double Shards::clip_grad_norm(comm::Group& group, double max_norm, double norm_type) {
  std::vector<at::Tensor> gradients;
  for (const auto& slice : slices_) {
    if (slice.grad().defined()) gradients.push_back(slice.grad());
  }
  return dp::clip_grad_norm(gradients, size_ > 1 ? &group : nullptr, max_norm, norm_type);
}

double clip_grad_norm(const std::vector<at::Tensor>& gradients, comm::Group* group, double max_norm,
                      double norm_type) {
  const bool infinite = std::isinf(norm_type) && norm_type > 0;
  if (!(norm_type > 0)) {
    throw UsageError("clip_grad_norm: norm_type must be positive or infinity, got " +
                     std::to_string(norm_type));
  }
  // This worker's sum of |g|^p (or its largest |g|), in double so that the workers' parts add
  // up as one process's norm does.
  double local = 0.0;
  for (const auto& g : gradients) {
    if (g.numel() == 0) continue;
    if (infinite) {
      local = std::max(local, g.abs().max().item<double>());
    } else {
      local += std::pow(g.norm(norm_type).item<double>(), norm_type);
    }
  }
  double total = local;
  if (group != nullptr) {
    auto sum = at::full({1}, local, at::kDouble);
    group->all_reduce(sum, {infinite ? comm::ReduceOp::kMax : comm::ReduceOp::kSum});
    total = sum.item<double>();
  }
  const double norm = infinite ? total : std::pow(total, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    at::NoGradGuard no_grad;
    for (at::Tensor g : gradients) g.mul_(coefficient);
  }
  return norm;
}

}  // namespace shoal::dp
