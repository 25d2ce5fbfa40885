// Dynamic loss scaling (PyTorch's torch.cuda.amp.GradScaler, for LibTorch), for gradients that
// travel in float16 (DataParallelOptions::mixed_precision.reduce = at::kHalf, or
// fp16_compress_hook): float16 holds magnitudes from 6e-5 (6e-8 with lost precision) to 65504,
// so a small gradient rounds to zero on its way. The loss is multiplied by a large scale before
// backward, which lifts every gradient by it; the gradients are divided by it again before the
// optimizer's step; a step whose gradients overflowed (inf or NaN on any worker) is skipped and
// the scale halved, and after `growth_interval` good steps it doubles.
//
//   shoal::GradScaler scaler;
//   scaler.scale(loss).backward();
//   scaler.unscale(optimizer);          // only to clip, then: model.clip_grad_norm(1.0)
//   scaler.step(optimizer);             // unscales if not done, skips on overflow
//   scaler.update();
//
// With DataParallel at every ZeRO stage: the optimizer's parameters are what it holds (whole
// parameters or slices), and whether any worker's gradients overflowed is agreed over the group
// (one all-reduce of one number), so every worker skips the same steps. See docs/memory.md.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "shoal/comm/group.h"

namespace shoal {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  // The workers that agree whether a step overflowed: those of the DataParallel. Empty:
  // shoal::world() at each step when the job is initialized (an elastic job's world as it is),
  // else this process alone.
  std::optional<comm::Group> group;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // The loss times the scale, to call backward on.
  at::Tensor scale(const at::Tensor& loss) const;
  // Divides the gradients of the optimizer's parameters by the scale and agrees over the group
  // whether any is inf or NaN (a collective). Once per step, before clipping; step() does it
  // when the program has not.
  void unscale(torch::optim::Optimizer& optimizer);
  // The optimizer's step, unless this step's gradients overflowed. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // After step(): the scale for the next step (backed off after an overflow, grown after
  // growth_interval steps without one).
  void update();

  double get_scale() const { return scale_; }
  // The scale and the count of steps since the last overflow, as a double tensor of 2 (to
  // commit in an elastic::State's value() or keep in a checkpoint's extras), and back.
  at::Tensor state() const;
  void load_state(const at::Tensor& state);

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t good_steps_ = 0;
  enum class Stage { kReady, kUnscaled, kStepped };
  Stage stage_ = Stage::kReady;
  bool found_inf_ = false;
};

}  // namespace shoal
