// Goodput: how fast a job makes progress at a world size and a batch size, and the batch that
// makes it fastest (Pollux, OSDI'21). elastic::BatchPolicy::goodput() picks each world's batch by
// it, and the job queue's goodput policy weighs a worker by it. No LibTorch here: the queue's
// policy builds without it. See docs/elastic.md, "Batch policies".
//
// Note [The step-time model]
// A synchronized step of w workers, each taking k backward passes of m samples (gradient
// accumulation: k - 1 under DataParallel::no_sync(), then one that averages), is modeled as
//   t(w, m, k) = k (fixed + per_sample m) + [w > 1] (sync + per_worker (w - 1))
// seconds: the compute, linear in the batch of each backward, then the gradients' exchange, once
// per step, which only a job of more than one worker pays, and which grows with the world (a
// ring's latency, a slower link among more hosts); the same form as Pollux's. The four coefficients
// are fitted to the steps a job measured by least squares on the relative error, each >= 0 (the
// best of the fits of every subset of them whose unconstrained solution is >= 0). What the steps
// cannot tell apart is resolved as Pollux's fit resolves it, the optimistic way, so that the job
// tries what would pay and its measurements correct the model: steps at one batch size only are
// modeled as half fixed cost, half per sample (so a larger batch is expected to pay, until it is
// measured); steps at one world of several only, as a constant exchange (per_worker = 0). A job
// never measured beyond one worker is modeled as paying `overhead_prior` of its step per worker
// beyond the first (the queue's prior, PolicyOptions::overhead_prior).
//
// Note [Choosing the batch by goodput]
// Goodput is throughput times statistical efficiency: samples per second, each worth
// GradientNoise::efficiency(B, base) of a sample at the base batch (shoal/dp/gradient_noise.h).
// For a world of w, the global batches from max(base, w min_local) to
// min(max_batch, w max_local max_accumulation) are tried at 64 geometric steps (Pollux tries 50),
// each cut into w equal shares, each share into the fewest backward passes of at most max_local
// samples (rounded up), and the one of the highest goodput wins; the smallest on a tie.
// Accumulating pays where the exchange is slow against a backward: it is paid once for k of
// them. A larger batch pays when the step's fixed costs are large against its per-sample cost and
// the gradient's noise scale is large against the batch. Before any noise is measured the gain is
// 1, the efficiency falls as fast as the batch grows, and the smallest batch the world allows
// wins.
#pragma once

#include <cstdint>
#include <vector>

#include "shoal/dp/gradient_noise.h"

namespace shoal {

// One synchronized step, measured: the world, each worker's batch per backward pass, its seconds
// (or the mean over steps of the same shape), and the backward passes it took (accumulation).
struct StepSample {
  int world = 1;
  double local_batch = 1;
  double seconds = 0;
  int accumulation = 1;
};

// Note [The step-time model].
struct StepTimeModel {
  double fixed = 0.0;
  double per_sample = 0.0;
  double sync = 0.0;
  double per_worker = 0.0;

  // Fitted to `steps` (those with world >= 1, local_batch > 0, seconds > 0 and accumulation >=
  // 1); with none, the model of one second per sample.
  static StepTimeModel fit(const std::vector<StepSample>& steps, double overhead_prior = 0.05);

  double seconds(int world, double local_batch, int accumulation = 1) const;
  // Samples per second: world * local_batch * accumulation / seconds.
  double throughput(int world, double local_batch, int accumulation = 1) const;
};

// What a job's batch may be (elastic::BatchPolicy::goodput(), the queue's JobView).
struct BatchLimits {
  // The global batch the learning rates were set for: the smallest global batch, and the one
  // statistical efficiency is measured against.
  int64_t base_batch = 0;
  // The largest global batch (at least base_batch).
  int64_t max_batch = 0;
  // Each worker's batch per backward pass lies in [min_local, max_local] (max_local 0: no bound
  // but max_batch), and a step takes at most max_accumulation of them (1: no accumulation).
  int64_t min_local = 1;
  int64_t max_local = 0;
  int max_accumulation = 1;

  // UsageError naming `what` when they do not fit together.
  void check(const char* what) const;
};

struct BatchChoice {
  int64_t local_batch = 0;   // each worker's batch per backward pass
  int accumulation = 1;      // backward passes per step
  int64_t global_batch = 0;  // world * local_batch * accumulation
  double throughput = 0.0;   // samples per second
  double efficiency = 1.0;   // of a sample, against one at the base batch
  double goodput = 0.0;      // throughput * efficiency
};

// Note [Choosing the batch by goodput]. A world the limits leave no batch for (world * min_local >
// max_batch, or world * max_local * max_accumulation < base_batch) gets the batch nearest to
// them. UsageError
// for limits that do not fit together and for world < 1.
BatchChoice best_batch(const StepTimeModel& model, const GradientNoise& noise, int world,
                       const BatchLimits& limits);

}  // namespace shoal
