// Note [Measuring the gradient noise] (shoal/dp/gradient_noise.h): the estimator. What follows
// from it (the gain and the efficiency) is in goodput.cpp, which the queue's policy links too.
// No LibTorch here.
#include "shoal/dp/gradient_noise.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "dp/noise_meter.h"
#include "shoal/core/error.h"

namespace shoal::dp {

NoiseMeter::NoiseMeter(double smoothing, const char* option) : smoothing_(smoothing) {
  if (!(smoothing >= 0.0 && smoothing < 1.0)) {
    std::ostringstream message;
    message << option << " is " << smoothing << "; expected a number in [0, 1)";
    throw UsageError(message.str());
  }
}

void NoiseMeter::add(double mean_local_sqr, double average_sqr, double small, double big, int64_t batch) {
  SHOAL_CHECK(small > 0.0 && big > small) << "noise meter given batches " << small << " and " << big;
  const double sqr = (big * average_sqr - small * mean_local_sqr) / (big - small);
  const double variance = small * big * (mean_local_sqr - average_sqr) / (big - small);
  std::lock_guard<std::mutex> lock(mutex_);
  const double keep = smoothing_;
  sqr_ = keep * sqr_ + (1.0 - keep) * sqr;
  variance_ = keep * variance_ + (1.0 - keep) * variance;
  weight_ = keep * weight_ + (1.0 - keep);
  ++measurements_;
  batch_ = batch;
}

GradientNoise NoiseMeter::value() const {
  std::lock_guard<std::mutex> lock(mutex_);
  GradientNoise noise;
  noise.measurements = measurements_;
  noise.batch = batch_;
  if (weight_ > 0.0) {
    noise.gradient_sqr = sqr_ / weight_;
    noise.variance = variance_ / weight_;
  }
  return noise;
}

std::vector<double> NoiseMeter::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {static_cast<double>(measurements_), static_cast<double>(batch_), sqr_, variance_, weight_};
}

void NoiseMeter::set_state(const std::vector<double>& numbers) {
  SHOAL_CHECK(numbers.size() == 5) << "noise meter state of " << numbers.size() << " numbers";
  std::lock_guard<std::mutex> lock(mutex_);
  measurements_ = static_cast<int64_t>(numbers[0]);
  batch_ = static_cast<int64_t>(numbers[1]);
  sqr_ = numbers[2];
  variance_ = numbers[3];
  weight_ = numbers[4];
}

}  // namespace shoal::dp
