// The gradient noise DataParallel measures (Note [Measuring the gradient noise],
// shoal/dp/gradient_noise.h), against two oracles: the same estimate computed on one process in
// double precision from every worker's data, and the closed form of a problem whose gradient
// noise is known (tests/noise_problem.h).
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dp/noise_meter.h"
#include "harness.h"
#include "noise_problem.h"
#include "shoal/shoal.h"

namespace {

using shoal::testing::run_workers;
using namespace shoal::testing::noise;

// Trains nothing (no optimizer: w stays) for `steps` steps of kPerWorker samples per worker,
// reads the measurement after each, and checks it against the one-process estimate of the same
// samples and, over all steps, against the closed form.
void measure_against_oracles(int64_t steps) {
  const Problem p = problem();
  const int n = shoal::world_size();
  auto linear = torch::nn::Linear(torch::nn::LinearOptions(kDim, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    linear->weight.copy_(p.w.to(torch::kFloat).reshape({1, kDim}));
  }
  shoal::DataParallelOptions options;
  options.measure_gradient_noise = true;
  options.gradient_noise_smoothing = 0.0;  // each step's own estimate
  shoal::DataParallel model(linear, options);
  ASSERT_TRUE(model.gradient_noise().has_value());
  EXPECT_EQ(model.gradient_noise()->measurements, 0);

  std::vector<double> sqrs, variances;
  torch::Tensor previous;  // one worker: the previous step's gradient
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<torch::Tensor> means;
    for (int worker = 0; worker < n; ++worker) means.push_back(gradient(p, samples(p, step, worker)));
    const auto [x, y] = samples(p, step, shoal::rank());
    linear->zero_grad();
    const auto prediction = model(x.to(torch::kFloat)).reshape({-1});
    (0.5 * (prediction - y.to(torch::kFloat)).pow(2).mean()).backward();

    const auto noise = model.gradient_noise();
    ASSERT_TRUE(noise.has_value());
    if (n == 1) {
      // The first step has no pair.
      ASSERT_EQ(noise->measurements, step);
      std::swap(previous, means[0]);
      if (step == 0) continue;
      means.push_back(previous);
      EXPECT_EQ(noise->batch, 2 * kPerWorker);
    } else {
      ASSERT_EQ(noise->measurements, step + 1);
      EXPECT_EQ(noise->batch, n * kPerWorker);
    }
    const Estimate oracle = estimate(means);
    const double scale = std::abs(oracle.sqr) + oracle.variance / kPerWorker;
    EXPECT_NEAR(noise->gradient_sqr, oracle.sqr, 1e-4 * scale) << "step " << step;
    EXPECT_NEAR(noise->variance, oracle.variance, 1e-4 * scale * kPerWorker * means.size()) << "step " << step;
    sqrs.push_back(noise->gradient_sqr);
    variances.push_back(noise->variance);
  }
  const Standard sqr = standard(sqrs), variance = standard(variances);
  // Enough steps that the comparison can tell (a standard error under 5% of the value) ...
  EXPECT_LT(sqr.error, 0.05 * kTrueSqr);
  EXPECT_LT(variance.error, 0.05 * kTrueVariance);
  // ... and the means within four standard errors of the closed form.
  EXPECT_NEAR(sqr.mean, kTrueSqr, 4 * sqr.error) << "|G|^2";
  EXPECT_NEAR(variance.mean, kTrueVariance, 4 * variance.error) << "tr(Sigma)";
  if (shoal::is_main()) {
    std::printf("%d workers: |G|^2 %.3f +- %.3f (closed form %.0f), tr(Sigma) %.2f +- %.2f (%.0f)\n", n, sqr.mean,
                sqr.error, kTrueSqr, variance.mean, variance.error, kTrueVariance);
  }
}

class NoiseScale : public ::testing::TestWithParam<int> {};

TEST_P(NoiseScale, EqualsTheOneProcessEstimateAndTheClosedForm) {
  run_workers(GetParam(), [] { measure_against_oracles(300); });
}

INSTANTIATE_TEST_SUITE_P(Workers, NoiseScale, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// Registered last layer first, so that backward's order differs from the reverse of the
// registration and the first backward cuts the buckets again.
struct BackwardsImpl : torch::nn::Module {
  BackwardsImpl() {
    last = register_module("last", torch::nn::Linear(8, 1));
    first = register_module("first", torch::nn::Linear(kDim, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return last(torch::tanh(first(x))); }
  torch::nn::Linear last{nullptr}, first{nullptr};
};
TORCH_MODULE(Backwards);

// One worker pairs each step's gradient with the previous one's, bucket by bucket: a step after
// the buckets were cut again is not paired with one cut the old way.
TEST(NoiseScale, OneWorkerPairsStepsAcrossTheFirstRebuild) {
  shoal::testing::WorkersOptions one;
  one.launcher = shoal::testing::Launcher::kNone;
  run_workers(1, [] {
    const Problem p = problem();
    torch::manual_seed(3);
    Backwards net;
    shoal::DataParallelOptions options;
    options.measure_gradient_noise = true;
    options.gradient_noise_smoothing = 0.0;
    options.bucket_bytes = 1;  // a bucket per parameter
    options.first_bucket_bytes = 1;
    shoal::DataParallel model(net, options);
    const auto order = [&] {
      std::vector<size_t> flat;
      for (const auto& bucket : model.bucket_assignment()) flat.insert(flat.end(), bucket.begin(), bucket.end());
      return flat;
    };
    const auto before = order();
    torch::Tensor previous;
    for (int64_t step = 0; step < 6; ++step) {
      const auto [x, y] = samples(p, step, 0);
      net->zero_grad();
      (0.5 * (model(x.to(torch::kFloat)).reshape({-1}) - y.to(torch::kFloat)).pow(2).mean()).backward();
      std::vector<torch::Tensor> grads;
      for (const auto& param : net->parameters()) grads.push_back(param.grad().reshape(-1).to(torch::kDouble));
      const auto current = torch::cat(grads);
      const auto noise = model.gradient_noise();
      // Step 0 has nothing before it; step 1's predecessor was cut before the rebuild.
      ASSERT_EQ(noise->measurements, std::max<int64_t>(0, step - 1)) << "step " << step;
      if (step >= 2) {
        const Estimate oracle = estimate({previous, current});
        const double scale = std::abs(oracle.sqr) + oracle.variance / kPerWorker;
        EXPECT_NEAR(noise->gradient_sqr, oracle.sqr, 1e-4 * scale) << "step " << step;
        EXPECT_NEAR(noise->variance, oracle.variance, 2e-4 * scale * kPerWorker) << "step " << step;
      }
      previous = current;
    }
    EXPECT_NE(order(), before) << "the buckets were not cut again: the case is not exercised";
  }, one);
}

// Smoothing: the moving averages, debiased, of steps that all measure the same are that value;
// the state carries them whole to another meter.
TEST(NoiseMeter, SmoothedAveragesAreDebiasedAndCarriedWhole) {
  shoal::dp::NoiseMeter meter(0.9);
  // S = 3, L = 2 over 10 and 20 samples: |G|^2 = (20 * 2 - 10 * 3) / 10 = 1,
  // tr(Sigma) = 10 * 20 * (3 - 2) / 10 = 20.
  for (int i = 0; i < 3; ++i) meter.add(3.0, 2.0, 10.0, 20.0, 20);
  auto noise = meter.value();
  EXPECT_EQ(noise.measurements, 3);
  EXPECT_EQ(noise.batch, 20);
  EXPECT_NEAR(noise.gradient_sqr, 1.0, 1e-12);
  EXPECT_NEAR(noise.variance, 20.0, 1e-12);
  EXPECT_NEAR(noise.noise_scale(), 20.0, 1e-12);
  // A step that measured |G|^2 = 0 and tr(Sigma) = 10 (S = 1, L = 0.5) moves each average a
  // tenth of the way there.
  meter.add(1.0, 0.5, 10.0, 20.0, 20);
  noise = meter.value();
  const double before = 1 - std::pow(0.9, 3), weight = 1 - std::pow(0.9, 4);
  EXPECT_NEAR(noise.gradient_sqr, 0.9 * before * 1.0 / weight, 1e-12);
  EXPECT_NEAR(noise.variance, (0.9 * before * 20.0 + 0.1 * 10.0) / weight, 1e-12);
  shoal::dp::NoiseMeter other(0.5);
  other.set_state(meter.state());
  EXPECT_EQ(other.value().measurements, 4);
  EXPECT_DOUBLE_EQ(other.value().gradient_sqr, noise.gradient_sqr);
  EXPECT_DOUBLE_EQ(other.value().variance, noise.variance);
  EXPECT_THROW(shoal::dp::NoiseMeter(1.0), shoal::UsageError);
}

// AdaScale's gain (B_noise / M0 + 1) / (B_noise / M + 1), bounded by 1 and M / M0.
TEST(GradientNoise, GainAndEfficiency) {
  shoal::GradientNoise noise;
  EXPECT_EQ(noise.gain(128, 32), 1.0);  // nothing measured yet
  noise.measurements = 10;
  noise.gradient_sqr = 1.0;
  noise.variance = 64.0;  // B_noise = 64
  EXPECT_DOUBLE_EQ(noise.gain(128, 32), (64.0 / 32 + 1) / (64.0 / 128 + 1));  // 2
  EXPECT_DOUBLE_EQ(noise.efficiency(128, 32), 2.0 / 4);
  EXPECT_DOUBLE_EQ(noise.gain(32, 32), 1.0);
  EXPECT_DOUBLE_EQ(noise.gain(16, 32), (64.0 / 32 + 1) / (64.0 / 16 + 1));  // a smaller batch: below 1
  noise.gradient_sqr = -0.5;  // only noise measured: linear scaling
  EXPECT_DOUBLE_EQ(noise.gain(128, 32), 4.0);
  EXPECT_EQ(noise.noise_scale(), std::numeric_limits<double>::infinity());
  noise.variance = -1.0;  // no noise: a step is a step
  EXPECT_DOUBLE_EQ(noise.gain(128, 32), 1.0);
  EXPECT_EQ(noise.noise_scale(), 0.0);
  try {
    noise.gain(0, 32);
    FAIL() << "no error";
  } catch (const shoal::UsageError& e) {
    EXPECT_STREQ(e.what(), "GradientNoise::gain(0, 32): expected two batch sizes > 0");
  }
}

}  // namespace
