// The server-side optimizers (docs/ps.md, "Optimizers"): the update rules of LibTorch 1.13's
// torch::optim::{SGD, Adagrad, Adam} for a dense chunk, and the lazy row-wise versions for a
// sparse row (PyTorch 1.13's SparseAdam and sparse Adagrad, with a step count per row).
// A chunk or a row is plain floats: its values, then its optimizer state (state_width(spec)
// vectors of the same length, one after the other), and a step count. The loops run over float*
// with no virtual call per element.
#pragma once

#include <cstdint>

#include "messages.h"

namespace shoal::ps::detail {

// How many state vectors, each as long as the values, an element of a chunk or row keeps:
// SGD 1 with momentum (its buffer) else 0; Adagrad 1 (the sum of squares); Adam 2 (exp_avg,
// exp_avg_sq), 3 with amsgrad (max_exp_avg_sq).
int state_width(const OptimizerSpec& spec);

// A UsageError naming the option when `spec` is not one the optimizer accepts (a negative rate,
// betas outside [0, 1), ...), or, for a sparse table, one PyTorch refuses with sparse gradients
// (Adagrad's weight_decay; Adam's weight_decay and amsgrad, which SparseAdam does not have).
void check_optimizer(const OptimizerSpec& spec, bool sparse, const std::string& table);

// The first value of the state of `n` elements (Adagrad: initial_accumulator_value; else 0).
void init_state(const OptimizerSpec& spec, float* state, int64_t n);

// One step of the dense rule on `n` elements: values, their state (state_width(spec) * n
// floats), the chunk's step count (incremented), and the gradient.
void apply_dense(const OptimizerSpec& spec, float* values, float* state, int64_t& step,
                 const float* grad, int64_t n);

// One step of the lazy row-wise rule on a row of `dim` elements that the gradient touched.
void apply_row(const OptimizerSpec& spec, float* values, float* state, int64_t& step,
               const float* grad, int64_t dim);

}  // namespace shoal::ps::detail
