#include "optimizer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "shoal/core/error.h"

namespace shoal::ps::detail {

// The loops below follow LibTorch's tensor expressions operation by operation, in float with
// float-cast scalars as LibTorch's CPU kernels compute them, so that results agree with
// torch::optim (and PyTorch's sparse optimizers) to rounding.

int state_width(const OptimizerSpec& spec) {
  switch (spec.kind) {
    case OptimizerSpec::Kind::kSgd:
      return spec.momentum != 0 ? 1 : 0;
    case OptimizerSpec::Kind::kAdagrad:
      return 1;
    case OptimizerSpec::Kind::kAdam:
      return spec.amsgrad ? 3 : 2;
  }
  return 0;
}

void check_optimizer(const OptimizerSpec& spec, bool sparse, const std::string& table) {
  auto fail = [&](const std::string& what) {
    throw UsageError("parameter servers: table '" + table + "': " + what);
  };
  auto at_least_zero = [&](double value, const char* name) {
    if (!(value >= 0)) fail(std::string(name) + " is " + std::to_string(value) + "; expected >= 0");
  };
  at_least_zero(spec.lr, "lr");
  at_least_zero(spec.weight_decay, "weight_decay");
  switch (spec.kind) {
    case OptimizerSpec::Kind::kSgd:
      at_least_zero(spec.momentum, "momentum");
      if (spec.nesterov && (spec.momentum <= 0 || spec.dampening != 0))
        fail("nesterov needs momentum > 0 and dampening 0 (as torch::optim::SGD)");
      return;
    case OptimizerSpec::Kind::kAdagrad:
      at_least_zero(spec.lr_decay, "lr_decay");
      at_least_zero(spec.initial_accumulator_value, "initial_accumulator_value");
      at_least_zero(spec.eps, "eps");
      if (sparse && spec.weight_decay != 0)
        fail("Adagrad's weight_decay " + std::to_string(spec.weight_decay) +
             " is not compatible with sparse gradients (as in PyTorch); expected 0");
      return;
    case OptimizerSpec::Kind::kAdam:
      at_least_zero(spec.eps, "eps");
      if (!(spec.beta1 >= 0 && spec.beta1 < 1) || !(spec.beta2 >= 0 && spec.beta2 < 1))
        fail("betas are (" + std::to_string(spec.beta1) + ", " + std::to_string(spec.beta2) +
             "); expected each in [0, 1)");
      if (sparse && (spec.weight_decay != 0 || spec.amsgrad))
        fail(
            "a sparse table's Adam is PyTorch's SparseAdam, which has no weight_decay or amsgrad;"
            " expected weight_decay 0 and amsgrad false");
      return;
  }
  fail("unknown optimizer kind " + std::to_string(static_cast<int>(spec.kind)) +
       "; expected SGD (0), Adagrad (1) or Adam (2)");
}

void init_state(const OptimizerSpec& spec, float* state, int64_t n) {
  const float first = spec.kind == OptimizerSpec::Kind::kAdagrad
                          ? static_cast<float>(spec.initial_accumulator_value)
                          : 0.f;
  std::fill(state, state + static_cast<size_t>(state_width(spec)) * static_cast<size_t>(n), first);
}

namespace {

// torch::optim::SGD::step (and the lazy row-wise version: the same rule on a touched row).
void sgd(const OptimizerSpec& spec, float* p, float* buf, int64_t step, const float* g, int64_t n) {
  const auto wd = static_cast<float>(spec.weight_decay);
  const auto momentum = static_cast<float>(spec.momentum);
  const auto keep = static_cast<float>(1 - spec.dampening);
  const auto minus_lr = static_cast<float>(-1 * spec.lr);
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if (spec.weight_decay != 0) d = d + wd * p[i];
    if (spec.momentum != 0) {
      buf[i] = step == 1 ? d : buf[i] * momentum + keep * d;
      d = spec.nesterov ? d + momentum * buf[i] : buf[i];
    }
    p[i] = p[i] + minus_lr * d;
  }
}

// torch::optim::Adagrad::step on a dense gradient; PyTorch's sparse Adagrad computes the same
// per touched row (sum += g * g; std = sqrt(sum) + eps; p -= clr * g / std).
void adagrad(const OptimizerSpec& spec, float* p, float* sum, int64_t step, const float* g,
             int64_t n) {
  const auto wd = static_cast<float>(spec.weight_decay);
  const double clr = spec.lr / (1 + static_cast<double>(step - 1) * spec.lr_decay);
  const auto minus_clr = static_cast<float>(-clr);
  const auto eps = static_cast<float>(spec.eps);
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if (spec.weight_decay != 0) d = d + wd * p[i];
    sum[i] = sum[i] + d * d;
    const float std = std::sqrt(sum[i]) + eps;
    p[i] = p[i] + minus_clr * (d / std);
  }
}

// torch::optim::Adam::step.
void adam(const OptimizerSpec& spec, float* p, float* state, int64_t step, const float* g,
          int64_t n) {
  float* exp_avg = state;
  float* exp_avg_sq = state + n;
  float* max_exp_avg_sq = spec.amsgrad ? state + 2 * n : nullptr;
  const double bias_correction1 = 1 - std::pow(spec.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(spec.beta2, static_cast<double>(step));
  const auto wd = static_cast<float>(spec.weight_decay);
  const auto beta1 = static_cast<float>(spec.beta1);
  const auto beta2 = static_cast<float>(spec.beta2);
  const auto one_minus_beta1 = static_cast<float>(1 - spec.beta1);
  const auto one_minus_beta2 = static_cast<float>(1 - spec.beta2);
  const auto sqrt_bc2 = static_cast<float>(std::sqrt(bias_correction2));
  const auto eps = static_cast<float>(spec.eps);
  const auto minus_step_size = static_cast<float>(-(spec.lr / bias_correction1));
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if (spec.weight_decay != 0) d = d + wd * p[i];
    exp_avg[i] = exp_avg[i] * beta1 + one_minus_beta1 * d;
    exp_avg_sq[i] = exp_avg_sq[i] * beta2 + one_minus_beta2 * (d * d);
    float second = exp_avg_sq[i];
    if (max_exp_avg_sq != nullptr) {
      max_exp_avg_sq[i] = std::max(max_exp_avg_sq[i], exp_avg_sq[i]);
      second = max_exp_avg_sq[i];
    }
    const float denom = std::sqrt(second) / sqrt_bc2 + eps;
    p[i] = p[i] + minus_step_size * (exp_avg[i] / denom);
  }
}

// PyTorch 1.13's torch.optim._functional.sparse_adam on one touched row, with the row's own
// step count (docs/ps.md, "Optimizers").
void sparse_adam(const OptimizerSpec& spec, float* p, float* state, int64_t step, const float* g,
                 int64_t n) {
  float* exp_avg = state;
  float* exp_avg_sq = state + n;
  const auto one_minus_beta1 = static_cast<float>(1 - spec.beta1);
  const auto one_minus_beta2 = static_cast<float>(1 - spec.beta2);
  const auto eps = static_cast<float>(spec.eps);
  const double bias_correction1 = 1 - std::pow(spec.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(spec.beta2, static_cast<double>(step));
  const auto minus_step_size =
      static_cast<float>(-(spec.lr * std::sqrt(bias_correction2) / bias_correction1));
  for (int64_t i = 0; i < n; ++i) {
    const float old_avg = exp_avg[i];
    const float avg_update = (g[i] - old_avg) * one_minus_beta1;
    exp_avg[i] = old_avg + avg_update;
    const float old_sq = exp_avg_sq[i];
    const float sq_update = (g[i] * g[i] - old_sq) * one_minus_beta2;
    exp_avg_sq[i] = old_sq + sq_update;
    const float numer = avg_update + old_avg;
    const float denom = std::sqrt(sq_update + old_sq) + eps;
    p[i] = p[i] + minus_step_size * (numer / denom);
  }
}

}  // namespace

void apply_dense(const OptimizerSpec& spec, float* values, float* state, int64_t& step,
                 const float* grad, int64_t n) {
  ++step;
  switch (spec.kind) {
    case OptimizerSpec::Kind::kSgd:
      return sgd(spec, values, state, step, grad, n);
    case OptimizerSpec::Kind::kAdagrad:
      return adagrad(spec, values, state, step, grad, n);
    case OptimizerSpec::Kind::kAdam:
      return adam(spec, values, state, step, grad, n);
  }
}

void apply_row(const OptimizerSpec& spec, float* values, float* state, int64_t& step,
               const float* grad, int64_t dim) {
  ++step;
  switch (spec.kind) {
    case OptimizerSpec::Kind::kSgd:
      return sgd(spec, values, state, step, grad, dim);
    case OptimizerSpec::Kind::kAdagrad:
      return adagrad(spec, values, state, step, grad, dim);
    case OptimizerSpec::Kind::kAdam:
      return sparse_adam(spec, values, state, step, grad, dim);
  }
}

}  // namespace shoal::ps::detail
