// What the parts of src/global share: pieces of a global value (which slice of it a worker
// holds), the groups collectives along a placement's axes run in, and placeholders for workers
// outside a placement. Private to src/global.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "shoal/comm/group.h"
#include "shoal/global/placement.h"

namespace shoal::global::detail {

// "[2, 3]"
std::string shape_text(at::IntArrayRef shape);
// "float", "double", "long", "bfloat16": c10's name of the dtype in lower case, as the C++ type
// names read (torch::kFloat is a float).
std::string dtype_text(at::ScalarType dtype);

// This worker's rank in the job, and the job's size. Both raise shoal::rank()'s UsageError before
// shoal::init(): every entry point that needs the job reaches one of them first.
int my_rank();
int job_size();

// UsageError, naming `op` and the placement, when it names a worker outside the job, or when
// `sbp` does not fit it (one Sbp per mesh axis, split dims within the tensor's `ndim`; with
// ndim < 0 the placement only).
void check_layout(const std::string& op, const Placement& placement, const NdSbp& sbp,
                  int64_t ndim);

// The extent of `dim` that axis `axis` cuts, for the worker at `coordinate`: the global size
// after the splits of the axes before `axis`.
int64_t extent_before_axis(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                           const std::vector<int64_t>& coordinate, int axis, int64_t dim);

// The shape of the piece the worker at `coordinate` holds.
std::vector<int64_t> piece_shape(at::IntArrayRef shape, const Placement& placement,
                                 const NdSbp& sbp, const std::vector<int64_t>& coordinate);

// Where that piece starts along `dim` (0 for dims nobody splits).
int64_t piece_offset(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                     const std::vector<int64_t>& coordinate, int64_t dim);

// The piece of `full` (the whole value) for the worker at `coordinate`: slices for split axes,
// the value on the first worker along a partial_sum axis and zeros on the others.
// Differentiable.
at::Tensor take_piece(const at::Tensor& full, const Placement& placement, const NdSbp& sbp,
                      const std::vector<int64_t>& coordinate);

// Zeros of x's shape that depend on x for autograd (with a zero gradient), so that a worker whose
// share of a partial_sum is zero keeps the graph of the others. Not x * 0, which is NaN where x
// is infinite (an attention mask's -inf).
at::Tensor zeros_after(const at::Tensor& x);

// The group of these job ranks, in this order (made once per world and list, by its members).
comm::Group& group_of(const std::vector<int>& ranks);

// What a worker outside a placement holds: an empty tensor of the dtype, marked as requiring
// grad when the global tensor does, so that every worker's autograd graph has the same
// communicating nodes.
at::Tensor placeholder(at::ScalarType dtype, bool requires_grad);

// A placeholder that depends on `inputs` (for autograd), for an op this worker has no part in.
at::Tensor placeholder_after(const std::vector<at::Tensor>& inputs, at::ScalarType dtype);

// Boxing: `local` (this worker's piece for `from`) as its piece for `to`, by collectives among
// the workers of both placements; differentiable, with the adjoint collectives in backward.
// Every worker of the job calls it.
at::Tensor box(const at::Tensor& local, at::IntArrayRef shape, const Placement& from_placement,
               const NdSbp& from, const Placement& to_placement, const NdSbp& to);

// Sum over the workers along `axis` (this worker's), differentiable: backward sums the
// gradients the same way.
at::Tensor all_reduce_along(const at::Tensor& x, const Placement& placement, int axis);
// Maximum over the workers along `axis`, not differentiable (for shifts that cancel out).
at::Tensor all_reduce_max_along(const at::Tensor& x, const Placement& placement, int axis);

// Adds to shoal::global::sent_bytes().
void count_sent(int64_t bytes);

}  // namespace shoal::global::detail
