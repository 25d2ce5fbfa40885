#include "shoal/dp/grad_scaler.h"

#include <cmath>
#include <string>

#include <ATen/core/grad_mode.h>

#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal {

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), scale_(options_.init_scale) {
  if (!(options_.init_scale > 0) || !std::isfinite(options_.init_scale)) {
    throw UsageError("GradScaler: init_scale is " + std::to_string(options_.init_scale) +
                     "; expected a positive finite number");
  }
  if (!(options_.growth_factor > 1) ||
      !(options_.backoff_factor > 0 && options_.backoff_factor < 1)) {
    throw UsageError("GradScaler: growth_factor " + std::to_string(options_.growth_factor) +
                     " and backoff_factor " + std::to_string(options_.backoff_factor) +
                     "; expected growth_factor > 1 and 0 < backoff_factor < 1");
  }
  if (options_.growth_interval < 1) {
    throw UsageError("GradScaler: growth_interval is " + std::to_string(options_.growth_interval) +
                     "; expected 1 or more");
  }
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  return loss * scale_;
}

void GradScaler::unscale(torch::optim::Optimizer& optimizer) {
  if (stage_ == Stage::kUnscaled) {
    throw UsageError(
        "GradScaler: unscale() called twice in one step; expected it once, before step()");
  }
  if (stage_ == Stage::kStepped) {
    throw UsageError("GradScaler: unscale() after step(); expected update() first");
  }
  torch::NoGradGuard no_grad;
  const double inverse = 1.0 / scale_;
  bool found = false;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      at::Tensor& grad = p.mutable_grad();
      if (!grad.defined()) continue;
      grad.mul_(inverse);
      if (!found && grad.numel() > 0) found = !at::isfinite(grad).all().item<bool>();
    }
  }
  // Under ZeRO each worker sees its slices only; at stage 0 the averages are the same everywhere,
  // and the agreement costs one number.
  auto flag = at::full({1}, found ? 1.0f : 0.0f, at::kFloat);
  if (options_.group) {
    if (options_.group->size() > 1) options_.group->all_reduce(flag, {comm::ReduceOp::kMax});
  } else if (shoal::is_initialized() && shoal::world_size() > 1) {
    shoal::world().all_reduce(flag, {comm::ReduceOp::kMax});
  }
  found_inf_ = flag.item<float>() > 0;
  stage_ = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (stage_ == Stage::kStepped) {
    throw UsageError("GradScaler: step() called twice in one step; expected update() between");
  }
  if (stage_ == Stage::kReady) unscale(optimizer);
  stage_ = Stage::kStepped;
  if (found_inf_) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (stage_ != Stage::kStepped) {
    throw UsageError("GradScaler: update() before step(); expected scale, backward, step, update");
  }
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    good_steps_ = 0;
  } else if (++good_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    good_steps_ = 0;
  }
  stage_ = Stage::kReady;
  found_inf_ = false;
}

at::Tensor GradScaler::state() const {
  return at::tensor({scale_, static_cast<double>(good_steps_)}, at::kDouble);
}

void GradScaler::load_state(const at::Tensor& state) {
  if (!state.defined() || state.numel() != 2) {
    throw UsageError(
        "GradScaler: load_state given " +
        std::string(state.defined() ? std::to_string(state.numel()) + " values" : "no tensor") +
        "; expected the 2 of state()");
  }
  const auto values = state.to(at::kDouble);
  const double scale = values[0].item<double>();
  if (!(scale > 0) || !std::isfinite(scale)) {
    throw UsageError("GradScaler: load_state given the scale " + std::to_string(scale) +
                     "; expected a positive finite number");
  }
  scale_ = scale;
  good_steps_ = static_cast<int64_t>(values[1].item<double>());
  stage_ = Stage::kReady;
  found_inf_ = false;
}

}  // namespace shoal
