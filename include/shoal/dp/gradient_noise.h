// The gradient noise scale, measured during training: how large a batch can grow before more
// samples per step stop buying progress. DataParallel measures it when asked
// (DataParallelOptions::measure_gradient_noise); elastic::BatchPolicy::adascale() and the job
// queue read it. See docs/dp.md, "Gradient noise".
//
// Note [Measuring the gradient noise]
// Let G be the true gradient and Sigma the covariance of one sample's gradient. A mean gradient
// over B samples has E|g_B|^2 = |G|^2 + tr(Sigma) / B (McCandlish et al., "An Empirical Model of
// Large-Batch Training", 2018). A synchronized step of n workers holds two such means at once:
// each worker's own gradient over its b samples, and their average over n b. With S the mean of
// the workers' |g_i|^2 and L = |average|^2, for batches b and B = n b:
//   |G|^2     ~ (B L - b S) / (B - b)
//   tr(Sigma) ~ b B (S - L) / (B - b)
// both unbiased (AdaptDL's estimator, Pollux, OSDI'21). Neither needs a pass of its own: S is
// summed from the buckets just before their all-reduce starts, L from them after it ends, and the
// workers' S are added by one more all-reduce of one number. One worker has no second mean in a
// step, so it pairs each step's gradient with the previous step's (b and 2 b samples); the
// parameters moved in between, which the estimate ignores. Each step's estimates are noisy, and
// may be negative; they are smoothed by exponential moving averages (debiased for their start)
// before their ratio, the noise scale B_noise = tr(Sigma) / |G|^2, is taken.
//
// From B_noise follow AdaScale's gain (Johnson et al., ICML'20) for a batch M against a base
// batch M0,
//   gain(M, M0) = (B_noise / M0 + 1) / (B_noise / M + 1),
// the number of base-batch steps one step at M is worth (between 1 and M / M0), and Pollux's
// statistical efficiency, gain / (M / M0): the progress per sample at M relative to M0.
#pragma once

#include <cstdint>

namespace shoal {

struct GradientNoise {
  // Steps measured so far, across the job's history (the estimate outlives changes of the world).
  int64_t measurements = 0;
  // The global batch of the last step measured, in samples.
  int64_t batch = 0;
  // |G|^2 and tr(Sigma) (per sample), smoothed; either may be <= 0 early on.
  double gradient_sqr = 0.0;
  double variance = 0.0;

  // B_noise = variance / gradient_sqr, in samples; 0 when variance <= 0, infinity when only
  // gradient_sqr is.
  double noise_scale() const;
  // AdaScale's gain of a batch of `batch` samples against `base_batch` (both > 0): between 1 and
  // batch / base_batch (the other way round when batch is the smaller). 1 before any
  // measurement.
  double gain(double batch, double base_batch) const;
  // gain(batch, base_batch) / (batch / base_batch).
  double efficiency(double batch, double base_batch) const;

  // The noise of scale `noise_scale` (in samples; infinity: all noise), as a measurement that
  // gives only that, such as the queue has of a job; <= 0: nothing measured.
  static GradientNoise of_scale(double noise_scale);
};

}  // namespace shoal
