// Goodput (shoal/dp/goodput.h): the step-time model fitted to steps drawn from a known model, its
// ambiguities resolved as Note [The step-time model] says, and the batch best_batch() picks
// against the closed-form optimum and against every batch tried one by one. No LibTorch.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "shoal/core/error.h"
#include "shoal/dp/goodput.h"

namespace {

using shoal::BatchLimits;
using shoal::GradientNoise;
using shoal::StepSample;
using shoal::StepTimeModel;

std::vector<StepSample> steps_of(const StepTimeModel& truth, const std::vector<int>& worlds,
                                 const std::vector<double>& batches) {
  std::vector<StepSample> steps;
  for (int w : worlds)
    for (double m : batches) steps.push_back({w, m, truth.seconds(w, m)});
  return steps;
}

void expect_model(const StepTimeModel& got, const StepTimeModel& want) {
  EXPECT_NEAR(got.fixed, want.fixed, 1e-9 + 1e-6 * want.fixed);
  EXPECT_NEAR(got.per_sample, want.per_sample, 1e-12 + 1e-6 * want.per_sample);
  EXPECT_NEAR(got.sync, want.sync, 1e-9 + 1e-6 * want.sync);
  EXPECT_NEAR(got.per_worker, want.per_worker, 1e-9 + 1e-6 * want.per_worker);
}

TEST(StepTimeModel, FitsTheModelItsStepsCameFrom) {
  const StepTimeModel truth{0.02, 0.001, 0.01, 0.002};
  expect_model(StepTimeModel::fit(steps_of(truth, {1, 2, 4, 8}, {16, 32, 64})), truth);
  // Any term may be absent.
  const StepTimeModel no_fixed{0, 0.003, 0.05, 0};
  expect_model(StepTimeModel::fit(steps_of(no_fixed, {1, 3, 6}, {8, 100})), no_fixed);
  // Measured noise around the truth: close, never negative.
  auto steps = steps_of(truth, {1, 2, 4, 8}, {16, 32, 64});
  for (size_t i = 0; i < steps.size(); ++i) steps[i].seconds *= i % 2 ? 1.03 : 0.97;
  const auto noisy = StepTimeModel::fit(steps);
  EXPECT_NEAR(noisy.seconds(4, 32) / truth.seconds(4, 32), 1.0, 0.03);
  EXPECT_GE(noisy.fixed, 0);
  EXPECT_GE(noisy.sync, 0);
}

TEST(StepTimeModel, FitsStepsThatAccumulatedGradients) {
  const StepTimeModel truth{0.05, 0.002, 0.3, 0.01};
  std::vector<StepSample> steps;
  for (int w : {1, 2, 8})
    for (double m : {4.0, 8.0})
      for (int k : {1, 3}) steps.push_back({w, m, truth.seconds(w, m, k), k});
  expect_model(StepTimeModel::fit(steps), truth);
  EXPECT_DOUBLE_EQ(truth.seconds(8, 4, 3), 3 * (0.05 + 0.008) + 0.3 + 0.07);
  EXPECT_DOUBLE_EQ(truth.throughput(8, 4, 3), 8 * 4 * 3 / truth.seconds(8, 4, 3));
}

TEST(StepTimeModel, CoefficientsStayAtLeastZero) {
  // Faster steps at larger batches and worlds: no model of >= 0 coefficients fits exactly.
  const std::vector<StepSample> steps{{1, 10, 0.5}, {1, 100, 0.4}, {2, 10, 0.45}, {4, 100, 0.3}};
  const auto model = StepTimeModel::fit(steps);
  EXPECT_GE(model.fixed, 0);
  EXPECT_GE(model.per_sample, 0);
  EXPECT_GE(model.sync, 0);
  EXPECT_GE(model.per_worker, 0);
  for (const auto& step : steps) EXPECT_GT(model.seconds(step.world, step.local_batch), 0);
}

TEST(StepTimeModel, ResolvesWhatItsStepsCannotTellApartAsTheNoteSays) {
  // One batch size: half fixed, half per sample, adding up to what was measured.
  const auto one_batch = StepTimeModel::fit({{1, 64, 0.4}, {2, 64, 0.5}, {4, 64, 0.6}});
  EXPECT_NEAR(one_batch.fixed, 0.2, 1e-9);
  EXPECT_NEAR(one_batch.per_sample * 64, 0.2, 1e-9);
  EXPECT_NEAR(one_batch.seconds(4, 64), 0.6, 1e-9);
  EXPECT_NEAR(one_batch.seconds(2, 64), 0.5, 1e-9);
  // One world beyond one: a constant exchange.
  const auto one_world = StepTimeModel::fit({{1, 16, 0.2}, {1, 64, 0.5}, {4, 16, 0.3}});
  EXPECT_EQ(one_world.per_worker, 0);
  EXPECT_NEAR(one_world.sync, 0.1, 1e-9);
  EXPECT_NEAR(one_world.fixed + 16 * one_world.per_sample, 0.2, 1e-9);
  // Never beyond one worker: the prior, per worker beyond the first.
  const auto alone = StepTimeModel::fit({{1, 16, 0.2}, {1, 64, 0.5}}, 0.1);
  EXPECT_EQ(alone.sync, 0);
  EXPECT_NEAR(alone.per_worker, 0.1 * alone.seconds(1, 40), 1e-12);
  // Nothing measured (or nothing usable): one second per sample.
  for (const auto& steps :
       {std::vector<StepSample>{}, std::vector<StepSample>{{0, 8, 1}, {1, 8, -1}}}) {
    const auto none = StepTimeModel::fit(steps);
    EXPECT_EQ(none.per_sample, 1.0);
    EXPECT_EQ(none.seconds(1, 8), 8.0);
  }
}

GradientNoise noise(double scale) {
  return GradientNoise::of_scale(scale);
}

TEST(BestBatch, MeetsTheClosedFormOptimum) {
  // One worker, t = f + p B: goodput B / (f + p B) * (Bn + B0) / (Bn + B) peaks at B* = sqrt(f Bn /
  // p).
  const StepTimeModel model{0.1, 0.001, 0, 0};
  const BatchLimits limits{100, 10000, 1, 0};
  for (const double scale : {1e4, 4e4, 2.5e5}) {
    const double optimum = std::sqrt(model.fixed * scale / model.per_sample);
    const auto choice = shoal::best_batch(model, noise(scale), 1, limits);
    const auto goodput = [&](double b) {
      return model.throughput(1, b) * noise(scale).efficiency(b, 100);
    };
    EXPECT_NEAR(choice.global_batch / optimum, 1.0, 0.08) << "noise scale " << scale;
    EXPECT_GE(choice.goodput, 0.998 * goodput(optimum));
    EXPECT_NEAR(choice.goodput, goodput(static_cast<double>(choice.global_batch)), 1e-9);
    EXPECT_DOUBLE_EQ(choice.goodput, choice.throughput * choice.efficiency);
  }
}

TEST(BestBatch, IsWithinOneStepOfTheBestOfEveryBatch) {
  const StepTimeModel model{0.03, 0.0004, 0.02, 0.004};
  const BatchLimits limits{64, 8192, 8, 512};
  for (int world : {1, 2, 3, 5, 8, 16}) {
    for (const double scale : {50.0, 2000.0, 1e5}) {
      const auto choice = shoal::best_batch(model, noise(scale), world, limits);
      double best = 0;
      for (int64_t m = 8; m <= 512 && m * world <= 8192; ++m) {
        if (m * world < 64) continue;
        best = std::max(best, model.throughput(world, m) * noise(scale).efficiency(m * world, 64));
      }
      EXPECT_GE(choice.goodput, 0.995 * best) << world << " workers, noise scale " << scale;
      EXPECT_LE(choice.goodput, best * (1 + 1e-12));
      EXPECT_GE(choice.global_batch, 64);
      EXPECT_LE(choice.global_batch, 8192);
      EXPECT_GE(choice.local_batch, 8);
      EXPECT_LE(choice.local_batch, 512);
    }
  }
}

TEST(BestBatch, AccumulatesWhereTheExchangeIsSlowAgainstABackward) {
  // Memory holds 8 samples a backward; the exchange takes as long as 5 of them.
  const StepTimeModel model{0.05, 0.03, 1.0, 0.05};
  BatchLimits limits{8, 512, 4, 8, 1};
  const auto plain = shoal::best_batch(model, noise(400), 8, limits);
  EXPECT_EQ(plain.accumulation, 1);
  limits.max_accumulation = 16;
  const auto accumulated = shoal::best_batch(model, noise(400), 8, limits);
  EXPECT_GT(accumulated.accumulation, 1);
  EXPECT_EQ(accumulated.global_batch, 8 * accumulated.local_batch * accumulated.accumulation);
  EXPECT_GT(accumulated.goodput, 1.2 * plain.goodput);
  // Against every (batch, passes) the limits allow.
  for (int world : {1, 3, 8}) {
    const auto choice = shoal::best_batch(model, noise(400), world, limits);
    double best = 0;
    for (int64_t m = 4; m <= 8; ++m)
      for (int k = 1; k <= 16; ++k) {
        const int64_t global = world * m * k;
        if (global < 8 || global > 512) continue;
        best = std::max(best, model.throughput(world, m, k) * noise(400).efficiency(global, 8));
      }
    EXPECT_GE(choice.goodput, 0.995 * best) << world << " workers";
    EXPECT_LE(choice.goodput, best * (1 + 1e-12)) << world << " workers";
  }
}

TEST(BestBatch, KeepsTheSmallestBatchUntilALargerOnePays) {
  const BatchLimits limits{128, 4096, 16, 0};
  const StepTimeModel fixed_heavy{0.2, 0.0001, 0, 0};
  // No noise measured: the smallest batch the world allows.
  EXPECT_EQ(shoal::best_batch(fixed_heavy, GradientNoise{}, 1, limits).global_batch, 128);
  EXPECT_EQ(shoal::best_batch(fixed_heavy, GradientNoise{}, 4, limits).local_batch, 32);
  EXPECT_EQ(shoal::best_batch(fixed_heavy, GradientNoise{}, 16, limits).local_batch, 16);
  // Time in proportion to the batch: no batch is faster, so a noisy gradient buys nothing either.
  EXPECT_EQ(shoal::best_batch(StepTimeModel{0, 0.001, 0, 0}, noise(1e6), 2, limits).global_batch,
            128);
  // Fixed costs and a large noise scale: a larger batch.
  EXPECT_GT(shoal::best_batch(fixed_heavy, noise(1e5), 1, limits).global_batch, 1000);
}

TEST(BestBatch, AWorldTheLimitsLeaveNoBatchForGetsTheNearest) {
  const StepTimeModel model{0.01, 0.001, 0.01, 0};
  // 64 workers of at least 16: 1024 > max 512.
  EXPECT_EQ(shoal::best_batch(model, noise(100), 64, {128, 512, 16, 64}).local_batch, 16);
  // One worker of at most 64 cannot hold the base batch of 128 ...
  EXPECT_EQ(shoal::best_batch(model, noise(100), 1, {128, 512, 16, 64}).local_batch, 64);
  // ... unless it accumulates.
  const auto two = shoal::best_batch(model, noise(100), 1, {128, 512, 16, 64, 2});
  EXPECT_EQ(two.global_batch, 128);
  EXPECT_EQ(two.accumulation, 2);
}

void expect_usage_error(const BatchLimits& limits, int world, const std::string& expected) {
  try {
    shoal::best_batch(StepTimeModel{}, GradientNoise{}, world, limits);
    ADD_FAILURE() << "no error; expected one saying " << expected;
  } catch (const shoal::UsageError& error) {
    EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
  }
}

TEST(BestBatch, BadLimitsAreAUsageErrorSayingWhatWasExpected) {
  expect_usage_error({0, 100, 1, 0}, 1, "base_batch is 0; expected a global batch >= 1");
  expect_usage_error({128, 64, 1, 0}, 1, "max_batch is 64; expected at least base_batch (128)");
  expect_usage_error({128, 256, 0, 0}, 1, "expected 1 <= min_local <= max_local");
  expect_usage_error({128, 256, 32, 16}, 1, "[32, 16]");
  expect_usage_error({128, 256, 1, 0}, 0, "world is 0; expected >= 1");
  expect_usage_error({128, 256, 1, 0, 0}, 1, "max_accumulation is 0; expected backward passes");
}

}  // namespace
