// Ops on global tensors. Each has a table of signatures: the SBP combinations of its inputs and
// output whose local computation is correct. An op picks, for each mesh axis, the row that
// needs the least communication for the inputs as they are, boxes the inputs that don't fit,
// computes on the local pieces with LibTorch, and returns the output with the row's SBP. Every
// op is differentiable across workers. All operands of an op must share one placement
// (UsageError naming the op and every operand's placement and SBP otherwise). Every worker of
// the job calls every op, members of the placement or not. The tables are in docs/global.md.
#pragma once

#include <vector>

#include "shoal/global/tensor.h"

namespace shoal::global {

// a [..., n, k] times b [k, m], or batched: b [..., k, m] with the same leading dims as a.
GlobalTensor matmul(const GlobalTensor& a, const GlobalTensor& b);
// x [..., in] times weight [out, in] transposed, plus bias [out] (when defined), as
// torch::nn::functional::linear. weight split(0) is column-parallel, split(1) row-parallel.
GlobalTensor linear(const GlobalTensor& x, const GlobalTensor& weight,
                    const GlobalTensor& bias = {});

// Element-wise, with torch's broadcasting.
GlobalTensor add(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor sub(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor mul(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor div(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor add(const GlobalTensor& a, const at::Scalar& b);
GlobalTensor mul(const GlobalTensor& a, const at::Scalar& b);
GlobalTensor operator+(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor operator-(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor operator*(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor operator/(const GlobalTensor& a, const GlobalTensor& b);
GlobalTensor operator+(const GlobalTensor& a, const at::Scalar& b);
GlobalTensor operator-(const GlobalTensor& a, const at::Scalar& b);
GlobalTensor operator*(const GlobalTensor& a, const at::Scalar& b);
GlobalTensor operator/(const GlobalTensor& a, const at::Scalar& b);
GlobalTensor operator-(const GlobalTensor& a);

GlobalTensor relu(const GlobalTensor& x);
// approximate: "none" or "tanh", as torch::gelu.
GlobalTensor gelu(const GlobalTensor& x, const std::string& approximate = "none");
GlobalTensor tanh(const GlobalTensor& x);
GlobalTensor sigmoid(const GlobalTensor& x);

// Over `dim`; a split along `dim` stays split, the workers along it sharing row statistics.
GlobalTensor softmax(const GlobalTensor& x, int64_t dim);
GlobalTensor log_softmax(const GlobalTensor& x, int64_t dim);

// Over every element, or over `dim`.
GlobalTensor sum(const GlobalTensor& x);
GlobalTensor sum(const GlobalTensor& x, int64_t dim, bool keepdim = false);
GlobalTensor mean(const GlobalTensor& x);
GlobalTensor mean(const GlobalTensor& x, int64_t dim, bool keepdim = false);
// The largest value (torch::max(x) / torch::amax(x, dim)); gradients go to the maxima as torch's.
GlobalTensor max(const GlobalTensor& x);
GlobalTensor max(const GlobalTensor& x, int64_t dim, bool keepdim = false);

// One dim may be -1. A split is carried to the output dim that holds the same elements; where
// pieces would not line up (a split dim merged with others and not divided evenly) it is boxed.
GlobalTensor reshape(const GlobalTensor& x, at::IntArrayRef shape);
GlobalTensor view(const GlobalTensor& x, at::IntArrayRef shape);
GlobalTensor transpose(const GlobalTensor& x, int64_t dim0, int64_t dim1);
GlobalTensor permute(const GlobalTensor& x, at::IntArrayRef dims);
GlobalTensor cat(const std::vector<GlobalTensor>& tensors, int64_t dim);
// Elements [start, end) of `dim` (negative values count from the end, as in Python).
GlobalTensor slice(const GlobalTensor& x, int64_t dim, int64_t start, int64_t end);

// Over the last normalized_shape.size() dims, with optional weight and bias of that shape.
GlobalTensor layer_norm(const GlobalTensor& x, at::IntArrayRef normalized_shape,
                        const GlobalTensor& weight = {}, const GlobalTensor& bias = {},
                        double eps = 1e-5);
// Rows of weight [vocabulary, dim] for the integer `indices`. weight split(0) is
// vocabulary-parallel (each worker looks up the ids in its rows; the output is a partial_sum).
GlobalTensor embedding(const GlobalTensor& indices, const GlobalTensor& weight);
// The mean over the batch of the cross entropy of logits [batch, classes] against class indices
// [batch], as torch::nn::functional::cross_entropy. Logits split(1) (classes) are computed on in
// place, as Megatron's vocabulary-parallel cross entropy.
GlobalTensor cross_entropy(const GlobalTensor& logits, const GlobalTensor& target);
// Zeroes elements with probability p and scales the rest by 1/(1-p), with the mask one process
// would draw after the same seed (every worker draws the whole mask and keeps its piece).
GlobalTensor dropout(const GlobalTensor& x, double p, bool training = true);

}  // namespace shoal::global
