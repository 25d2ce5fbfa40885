// A problem whose gradient noise is known, and the noise estimator computed on one process in
// double precision: the oracles of the gradient noise DataParallel measures
// (tests/gradient_noise_test.cpp) and the parameter servers measure (tests/programs/ps_train.cpp,
// mode noise). See Note [Measuring the gradient noise], shoal/dp/gradient_noise.h.
//
// The problem: linear regression y = x . w* + sigma e, with x ~ N(0, I_d) and e ~ N(0, 1), and
// the loss 0.5 (x . w - y)^2 at a fixed w = w* + delta. One sample's gradient is
// x (x . delta - sigma e): its mean is G = delta, and its covariance has trace
// (d + 1) |delta|^2 + d sigma^2 (Isserlis: E[(x . delta)^2 x x^T] = |delta|^2 I + 2 delta delta^T).
// With d = 16, |delta| = 1 and sigma = 1: |G|^2 = 1, tr(Sigma) = 33, a noise scale of 33 samples.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace shoal::testing::noise {

constexpr int64_t kDim = 16, kPerWorker = 32;
constexpr double kSigma = 1.0;
constexpr double kTrueSqr = 1.0, kTrueVariance = (kDim + 1) * 1.0 + kDim * kSigma * kSigma;

struct Problem {
  torch::Tensor w_star, w;  // [kDim], float64
};

// `zero_tail`: w's last zero_tail entries are 0 (w* moves instead), for a model whose weights
// there start at zero.
inline Problem problem(int64_t zero_tail = 0) {
  torch::manual_seed(5);
  Problem p;
  p.w_star = torch::randn({kDim}, torch::kDouble);
  auto delta = torch::randn({kDim}, torch::kDouble);
  p.w = p.w_star + delta / delta.norm();
  if (zero_tail > 0) {
    p.w.narrow(0, kDim - zero_tail, zero_tail).zero_();
    p.w_star = p.w - delta / delta.norm();
  }
  return p;
}

// Worker `worker`'s samples at `step`, the same wherever they are made.
inline std::pair<torch::Tensor, torch::Tensor> samples(const Problem& p, int64_t step, int worker) {
  torch::manual_seed(1000 * step + worker + 1);
  auto x = torch::randn({kPerWorker, kDim}, torch::kDouble);
  auto y = x.matmul(p.w_star) + kSigma * torch::randn({kPerWorker}, torch::kDouble);
  return {x, y};
}

// The gradient of the mean loss over the samples, in double precision.
inline torch::Tensor gradient(const Problem& p,
                              const std::pair<torch::Tensor, torch::Tensor>& data) {
  const auto& [x, y] = data;
  return x.t().matmul(x.matmul(p.w) - y) / kPerWorker;
}

struct Estimate {
  double sqr, variance;
};

// The estimator on the given means, each over kPerWorker samples.
inline Estimate estimate(const std::vector<torch::Tensor>& means) {
  const double m = static_cast<double>(means.size());
  double mean_local = 0;
  for (const auto& g : means) mean_local += g.dot(g).item<double>() / m;
  const auto average = torch::stack(means).mean(0);
  const double average_sqr = average.dot(average).item<double>();
  const double small = kPerWorker, big = kPerWorker * m;
  return {(big * average_sqr - small * mean_local) / (big - small),
          small * big * (mean_local - average_sqr) / (big - small)};
}

struct Standard {
  double mean, error;  // the mean and its standard error
};

inline Standard standard(const std::vector<double>& xs) {
  double mean = 0, square = 0;
  for (double x : xs) mean += x / xs.size();
  for (double x : xs) square += (x - mean) * (x - mean) / (xs.size() - 1);
  return {mean, std::sqrt(square / xs.size())};
}

}  // namespace shoal::testing::noise
