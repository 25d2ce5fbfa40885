// DataParallel's ZeRO stages (DataParallelOptions::zero_stage; docs/memory.md): each parameter's
// slice on this worker, the tensors the program's optimizer updates, and the all-gather that
// makes the parameters whole again after the step. Internal to shoal: the Replicator holds one
// (src/dp/replicator.h) and gives it to its Reducer, which reduce-scatters gradients into the
// slices' .grad.
//
// Note [A parameter's slice]
// Parameter k, of m elements, is cut as its flattened form split(0) over the group's n members:
// member r holds elements [start(k, r), start(k, r) + length(k, r)) of p.view(-1), the lengths
// being comm::split_sizes(m, n) (the first m % n members one element more). So every shape
// divides: a [3, 5] weight over 4 workers is 4, 4, 4 and 3 elements, a scalar 1, 0, 0, 0. The
// slice is a one-dimensional tensor of its own (not an autograd view), made once and kept: the
// optimizer's state is keyed by it. At stages 1 and 2 it lies in the parameter's own memory, so
// the optimizer's step writes this worker's part of the parameter in place, and the all-gather
// writes the other members' parts. At stage 3 it has memory of its own, and the parameter's
// memory is freed between uses (src/dp/gatherer.h).
//
// Note [Sums set apart]
// At stage 1 a slice's .grad is its part of the parameter's .grad, where autograd accumulates the
// next backward's local gradient, onto the sum already there, which would then be summed over the
// members again. So each parameter has a hook (made with the Shards) that, as its first gradient
// after a sum arrives and before it accumulates, sets the slice's .grad apart and zeroes it, and
// give_gradients() adds it back to the new sum. Backwards without zero_grad() between them (under
// DataParallel and GradientSync, or a pipeline's steps) then accumulate their sums, as on one
// process; after zero_grad() (LibTorch's zeroes in place) nothing is copied. At stages 2 and 3
// the parameter's .grad is released once sent, and the slice's .grad is added to.
//
// Note [Buckets cut by member]
// The gradients of a bucket's parameters p_1..p_s are laid out member by member, so that a
// reduce-scatter gives each member its own slices, contiguous: the bucket is
// [segment_0 | ... | segment_{n-1}], segment_r being [p_1's part r | ... | p_s's part r].
// Segments differ in size by at most s elements (comm's collectives take uneven parts). The
// all-gather of the parameters uses the same layout: each member sends its segment, and every
// member copies the segments it receives into the parameters.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#include "shoal/comm/group.h"
#include "shoal/core/timeout.h"

namespace shoal::dp {

class Shards {
 public:
  // `params`: the trainable parameters, each once, contiguous; `stage` 1, 2 or 3.
  Shards(std::vector<at::Tensor> params, int rank, int size, int stage);
  ~Shards();
  Shards(const Shards&) = delete;
  Shards& operator=(const Shards&) = delete;

  int stage() const { return stage_; }
  int size() const { return size_; }
  int rank() const { return rank_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  // The optimizer's tensor for parameter k: this worker's slice.
  const at::Tensor& slice(size_t k) const { return slices_[k]; }
  const std::vector<at::Tensor>& slices() const { return slices_; }
  // The index in params() of `parameter` (the same tensor), if it is one.
  std::optional<size_t> index_of(const at::Tensor& parameter) const;
  int64_t start(size_t k, int member) const { return starts_[k][member]; }
  int64_t length(size_t k, int member) const { return starts_[k][member + 1] - starts_[k][member]; }

  // Note [Buckets cut by member], for the parameters `bucket` (indices into params()): each
  // member's segment size, and where parameter bucket[j]'s part r starts in the bucket.
  struct Layout {
    comm::Sizes segments;
    std::vector<std::vector<int64_t>> offsets;  // [j][r]
  };
  Layout layout(const std::vector<size_t>& bucket) const;

  // Writes `gradient` (parameter k's, any shape of its numel) into `buffer` at the parts that
  // `offsets` (a Layout's offsets[j]) says, each scaled by `scale` when it is not 1.
  void pack(size_t k, const at::Tensor& gradient, const std::vector<int64_t>& offsets,
            at::Tensor& buffer, double scale) const;

  // After a bucket's reduce-scatter (ReducerOptions::shards): `mine`, this member's segment of
  // the average of the parameters `bucket` (laid out by `layout`), into each slice's .grad, but
  // for the parameters `skip` names (no gradient anywhere: their .grad stays as it is).
  void give_gradients(const std::vector<size_t>& bucket, const Layout& layout,
                      const at::Tensor& mine, const std::function<bool(size_t)>& skip);

  // Starts the all-gather of the slices of `bucket` (laid out by `layout`): this member sends its
  // segment. Its result, once waited for, is every member's segment in member order.
  comm::Work start_gather(comm::Group& group, const std::vector<size_t>& bucket,
                          const Layout& layout) const;
  // Copies the parts in `all` (a finished start_gather's result) into each parameter's memory,
  // `flat(k)` (one-dimensional), this member's own parts too unless `skip_own`.
  void unpack(const std::vector<size_t>& bucket, const Layout& layout, const at::Tensor& all,
              const std::function<at::Tensor(size_t)>& flat, bool skip_own) const;

  // After the optimizer's step at stages 1 and 2: every member's slices into every member's
  // parameters, in all-gathers of about `bucket_bytes`, two in flight. A collective.
  void gather(comm::Group& group, int64_t bucket_bytes);

  // A pipeline's end-of-step sum (its backward runs once per micro-batch): the parameters' .grad
  // (what the step's backwards accumulated: Note [Sums set apart]) summed over the group and
  // reduce-scattered, in buckets of about `bucket_bytes`, into the slices' .grad (added to what
  // they hold). The parameters' own .grad are then released at stages 2 and 3, zeroed at stage 1
  // (whose slices' .grad are parts of them). A collective.
  void sum_gradients(comm::Group& group, int64_t bucket_bytes, Duration timeout);

  // Cuts every slice again, for member `rank` of `size` (an elastic job's new world): each keeps
  // its tensor (the optimizer's key), with the new length, and no gradient; its values are
  // whatever its memory holds (stages 1 and 2: the parameter's there; stage 3: new, unset) until
  // the caller writes them (Note [Slices in an elastic job], src/elastic/slices.cpp).
  void recut(int rank, int size);

  // The norm of the slices' gradients over the group (a collective), as
  // torch::nn::utils::clip_grad_norm_ computes it on one process, and the gradients scaled by
  // max_norm / (norm + 1e-6) when that is below 1. Returns the norm.
  double clip_grad_norm(comm::Group& group, double max_norm, double norm_type);

 private:
  // Note [Sums set apart]: the stage-1 hooks.
  void set_sums_apart();
  // Consecutive parameters of one dtype, about bucket_bytes at a time, in registration order.
  std::vector<std::vector<size_t>> consecutive(int64_t bucket_bytes) const;

  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> slices_;
  // Stage 1, Note [Sums set apart]: each slice's .grad set apart, whether the next gradient sets
  // it apart, and the hooks that do.
  std::vector<at::Tensor> apart_;
  std::vector<bool> apart_open_;
  std::vector<unsigned> apart_hooks_;
  std::vector<std::vector<int64_t>> starts_;  // [k][r], n + 1 entries
  std::unordered_map<const void*, size_t> index_of_;  // a parameter's TensorImpl -> k
  int rank_;
  int size_;
  int stage_;
};

// The norm of `gradients` as torch's clip_grad_norm_ takes it (norm_type may be infinity), with
// the local sum (or maximum) all-reduced over `group` when it is given. Scales them when the
// norm exceeds max_norm. For DataParallel at any stage.
double clip_grad_norm(const std::vector<at::Tensor>& gradients, comm::Group* group, double max_norm,
                      double norm_type);

}  // namespace shoal::dp
