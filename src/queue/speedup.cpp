// A job's speed-up curve (Note [Speed-up curves], src/queue/policy.h): what the goodput policy
// weighs a worker by, apart from the plan that gives workers by it.
#include <algorithm>
#include <cmath>
#include <limits>

#include "policy.h"

namespace shoal::queue {
namespace {

// b / a of Note [Speed-up curves], fitted to the job's measured rates.
double overhead_ratio(const JobView& job, const PolicyOptions& options) {
  double n = 0, sx = 0, su = 0, sxx = 0, sxu = 0, least = std::numeric_limits<double>::infinity();
  for (const auto& [workers, rate] : job.throughput) {
    if (workers < 1 || !(rate > 0) || !std::isfinite(rate)) continue;
    const double x = workers - 1, u = workers / rate;
    n += 1;
    sx += x;
    su += u;
    sxx += x * x;
    sxu += x * u;
    least = std::min(least, u);
  }
  const double spread = n * sxx - sx * sx;
  if (n < 2 || spread <= 0) return options.overhead_prior;
  double b = (n * sxu - sx * su) / spread;
  double a = (su - b * sx) / n;
  if (b < 0) {  // faster per worker with more workers: modeled as linear
    b = 0;
    a = su / n;
  }
  a = std::max(a, 0.05 * least);  // a curve that would pass below zero at one worker
  return b / a;
}

}  // namespace

double speedup(const JobView& job, int workers, const PolicyOptions& options) {
  if (workers <= 0) return 0.0;
  const double w = workers;
  const auto noise = GradientNoise::of_scale(job.noise_scale);
  if (job.batch_limits.base_batch > 0) {
    const auto model = StepTimeModel::fit(job.steps, options.overhead_prior);
    const double one = best_batch(model, noise, 1, job.batch_limits).goodput;
    return one > 0 ? best_batch(model, noise, workers, job.batch_limits).goodput / one : w;
  }
  double efficiency = 1.0;
  if (job.batch_per_worker > 0 && job.noise_scale > 0) {
    const double batch = static_cast<double>(job.batch_per_worker);
    efficiency = noise.efficiency(w * batch, batch);
  }
  return w / (1.0 + overhead_ratio(job, options) * (w - 1.0)) * efficiency;
}

}  // namespace shoal::queue
