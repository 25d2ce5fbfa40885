// Notes [The step-time model] and [Choosing the batch by goodput] (shoal/dp/goodput.h), and the
// gradient noise's gain and efficiency (shoal/dp/gradient_noise.h), which both the library and
// the queue's policy weigh. No LibTorch here.
#include "shoal/dp/goodput.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <sstream>

#include "shoal/core/error.h"

namespace shoal {

double GradientNoise::noise_scale() const {
  if (variance <= 0.0) return 0.0;
  if (gradient_sqr <= 0.0) return std::numeric_limits<double>::infinity();
  return variance / gradient_sqr;
}

double GradientNoise::gain(double batch, double base_batch) const {
  if (!(batch > 0.0) || !(base_batch > 0.0)) {
    std::ostringstream message;
    message << "GradientNoise::gain(" << batch << ", " << base_batch
            << "): expected two batch sizes > 0";
    throw UsageError(message.str());
  }
  if (measurements == 0) return 1.0;
  const double scale = batch / base_batch;
  const double noise = noise_scale();
  // All noise: every sample counts (linear scaling); no noise: one step is one step.
  const double gain = noise == std::numeric_limits<double>::infinity()
                          ? scale
                          : (noise / base_batch + 1.0) / (noise / batch + 1.0);
  return std::clamp(gain, std::min(1.0, scale), std::max(1.0, scale));
}

double GradientNoise::efficiency(double batch, double base_batch) const {
  return gain(batch, base_batch) * base_batch / batch;
}

GradientNoise GradientNoise::of_scale(double noise_scale) {
  GradientNoise noise;
  if (noise_scale > 0) {
    noise.measurements = 1;
    noise.gradient_sqr = std::isfinite(noise_scale) ? 1.0 : 0.0;
    noise.variance = std::isfinite(noise_scale) ? noise_scale : 1.0;
  }
  return noise;
}

namespace {

constexpr int kTerms = 4;  // fixed, per_sample, sync, per_worker
using Row = std::array<double, kTerms>;

Row terms_of(const StepSample& step) {
  const bool exchange = step.world > 1;
  const double k = step.accumulation;
  return {k, k * step.local_batch, exchange ? 1.0 : 0.0, exchange ? step.world - 1.0 : 0.0};
}

// Least squares of `rows` (already weighted) against `targets` over the terms in `mask`;
// false when they are not independent. Normal equations: at most 4 unknowns.
bool solve(const std::vector<Row>& rows, const std::vector<double>& targets, unsigned mask,
           Row& solution, double& residual) {
  std::array<int, kTerms> index{};
  int n = 0;
  for (int t = 0; t < kTerms; ++t)
    if (mask & (1u << t)) index[n++] = t;
  std::array<std::array<double, kTerms + 1>, kTerms> a{};
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) a[i][j] += rows[r][index[i]] * rows[r][index[j]];
      a[i][n] += rows[r][index[i]] * targets[r];
    }
  }
  for (int col = 0; col < n; ++col) {
    int pivot = col;
    for (int i = col + 1; i < n; ++i)
      if (std::abs(a[i][col]) > std::abs(a[pivot][col])) pivot = i;
    std::swap(a[col], a[pivot]);
    // The diagonal of the normal equations is a column's squared norm: a pivot that small
    // against it is a column the others already span.
    double norm = 0;
    for (const auto& row : rows) norm += row[index[col]] * row[index[col]];
    if (!(std::abs(a[col][col]) > 1e-9 * norm) || norm == 0) return false;
    for (int i = 0; i < n; ++i) {
      if (i == col) continue;
      const double factor = a[i][col] / a[col][col];
      for (int j = col; j <= n; ++j) a[i][j] -= factor * a[col][j];
    }
  }
  solution = {};
  for (int i = 0; i < n; ++i) solution[index[i]] = a[i][n] / a[i][i];
  residual = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    double predicted = 0;
    for (int t = 0; t < kTerms; ++t) predicted += rows[r][t] * solution[t];
    residual += (predicted - targets[r]) * (predicted - targets[r]);
  }
  return true;
}

}  // namespace

StepTimeModel StepTimeModel::fit(const std::vector<StepSample>& steps, double overhead_prior) {
  std::vector<StepSample> valid;
  for (const auto& step : steps) {
    if (step.world >= 1 && step.local_batch > 0 && step.seconds > 0 &&
        std::isfinite(step.seconds) && step.accumulation >= 1)
      valid.push_back(step);
  }
  StepTimeModel model;
  if (valid.empty()) {
    model.per_sample = 1.0;
    return model;
  }
  bool one_batch = true, one_world_beyond_one = true, beyond_one = false;
  int exchange_world = 0;
  for (const auto& step : valid) {
    one_batch &= step.local_batch == valid.front().local_batch;
    if (step.world > 1) {
      beyond_one = true;
      if (exchange_world != 0 && step.world != exchange_world) one_world_beyond_one = false;
      exchange_world = step.world;
    }
  }
  // Relative errors: each row is divided by its own seconds. At one batch size, fixed and
  // per_sample fold into one term, fixed = per_sample * that batch (Note [The step-time model]).
  const double batch = valid.front().local_batch;
  std::vector<Row> rows;
  std::vector<double> targets;
  for (const auto& step : valid) {
    Row row = terms_of(step);
    if (one_batch) {
      row[1] += row[0] * batch;  // per_sample's column carries both
      row[0] = 0;
    }
    for (double& value : row) value /= step.seconds;
    rows.push_back(row);
    targets.push_back(1.0);
  }
  unsigned allowed = 0b1111;
  if (one_batch) allowed &= ~1u;
  if (!beyond_one) allowed &= ~0b1100u;
  if (beyond_one && one_world_beyond_one) allowed &= ~0b1000u;
  Row best{};
  double least = std::numeric_limits<double>::infinity();
  // Larger subsets first: of two equally good fits, the one that explains more.
  for (int size = kTerms; size >= 1; --size) {
    for (unsigned mask = 1; mask < (1u << kTerms); ++mask) {
      if ((mask & ~allowed) || __builtin_popcount(mask) != size) continue;
      Row solution;
      double residual;
      if (!solve(rows, targets, mask, solution, residual)) continue;
      if (std::any_of(solution.begin(), solution.end(), [](double c) { return c < 0; })) continue;
      if (residual < least - 1e-12) {
        least = residual;
        best = solution;
      }
    }
  }
  if (!std::isfinite(least)) {  // nothing fits with coefficients >= 0: time per sample, on average
    double sum = 0;
    for (const auto& step : valid) sum += step.seconds / step.local_batch;
    best = {0, sum / valid.size(), 0, 0};
  }
  if (one_batch) best[0] = best[1] * batch;
  model.fixed = best[0];
  model.per_sample = best[1];
  model.sync = best[2];
  model.per_worker = best[3];
  if (!beyond_one) {
    double sum = 0;
    for (const auto& step : valid) sum += step.local_batch;
    model.per_worker = overhead_prior * model.seconds(1, sum / static_cast<double>(valid.size()));
  }
  return model;
}

double StepTimeModel::seconds(int world, double local_batch, int accumulation) const {
  const double compute = accumulation * (fixed + per_sample * local_batch);
  return world > 1 ? compute + sync + per_worker * (world - 1) : compute;
}

double StepTimeModel::throughput(int world, double local_batch, int accumulation) const {
  const double time = seconds(world, local_batch, accumulation);
  return time > 0 ? world * local_batch * accumulation / time : 0.0;
}

void BatchLimits::check(const char* what) const {
  std::ostringstream message;
  if (base_batch < 1) {
    message << what << ": base_batch is " << base_batch << "; expected a global batch >= 1";
  } else if (max_batch < base_batch) {
    message << what << ": max_batch is " << max_batch << "; expected at least base_batch ("
            << base_batch << ")";
  } else if (min_local < 1 || (max_local != 0 && max_local < min_local)) {
    message << what << ": each worker's batch lies in [" << min_local << ", " << max_local
            << "]; expected 1 <= min_local <= max_local (or max_local 0: no bound)";
  } else if (max_accumulation < 1) {
    message << what << ": max_accumulation is " << max_accumulation
            << "; expected backward passes per step >= 1 (1: no accumulation)";
  } else {
    return;
  }
  throw UsageError(message.str());
}

BatchChoice best_batch(const StepTimeModel& model, const GradientNoise& noise, int world,
                       const BatchLimits& limits) {
  limits.check("best_batch()");
  if (world < 1)
    throw UsageError("best_batch(): world is " + std::to_string(world) + "; expected >= 1");
  const double w = world;
  // The share of each worker cut into the fewest backward passes within the limits.
  const auto choice_of = [&](double global) {
    const double share = std::max(global / w, static_cast<double>(limits.min_local));
    int passes = 1;
    if (limits.max_local > 0) {
      passes = static_cast<int>(std::ceil(share / static_cast<double>(limits.max_local) - 1e-9));
      passes = std::clamp(passes, 1, limits.max_accumulation);
    }
    BatchChoice choice;
    choice.accumulation = passes;
    choice.local_batch =
        std::max(limits.min_local, static_cast<int64_t>(std::ceil(share / passes - 1e-9)));
    if (limits.max_local > 0) choice.local_batch = std::min(choice.local_batch, limits.max_local);
    // Rounding up must not pass max_batch, where the limits leave room.
    while (choice.local_batch > limits.min_local &&
           world * choice.local_batch * passes > limits.max_batch &&
           world * (choice.local_batch - 1) * passes >= limits.base_batch)
      --choice.local_batch;
    choice.global_batch = world * choice.local_batch * passes;
    const auto local = static_cast<double>(choice.local_batch);
    choice.throughput = model.throughput(world, local, passes);
    choice.efficiency = noise.efficiency(static_cast<double>(choice.global_batch),
                                         static_cast<double>(limits.base_batch));
    choice.goodput = choice.throughput * choice.efficiency;
    return choice;
  };
  const double low =
      std::max(static_cast<double>(limits.base_batch), static_cast<double>(limits.min_local) * w);
  double high = static_cast<double>(limits.max_batch);
  if (limits.max_local > 0)
    high = std::min(high, static_cast<double>(limits.max_local) * limits.max_accumulation * w);
  if (low > high)
    return choice_of(std::min(low, std::max(high, static_cast<double>(limits.min_local) * w)));
  constexpr int kTries = 64;
  BatchChoice best;
  for (int i = 0; i < kTries; ++i) {
    const BatchChoice choice = choice_of(low * std::pow(high / low, i / (kTries - 1.0)));
    if (best.local_batch == 0 || choice.goodput > best.goodput * (1 + 1e-12)) best = choice;
  }
  return best;
}

}  // namespace shoal
