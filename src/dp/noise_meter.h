// The smoothed estimator of the gradient noise (Note [Measuring the gradient noise],
// shoal/dp/gradient_noise.h). Internal to shoal: the Reducer feeds it, DataParallel and
// elastic::State read it through the DataParallel's Replication (src/dp/replication.h), which
// holds it across changes of the world. A parameter server's client feeds one too, from the
// servers' parts of each sync step (Note [The gradient noise on servers], src/ps/server_sum.cpp).
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "shoal/dp/gradient_noise.h"

namespace shoal::dp {

// Thread-safe: the Reducer adds on the thread that runs backward.
class NoiseMeter {
 public:
  // `smoothing`: the moving averages' weight of the past, in [0, 1); `option` names it in the
  // error that refuses another value.
  explicit NoiseMeter(double smoothing,
                      const char* option = "DataParallel: gradient_noise_smoothing");

  // One step's S and L over batches of `small` and `big` samples (small < big).
  void add(double mean_local_sqr, double average_sqr, double small, double big, int64_t batch);
  GradientNoise value() const;

  // The meter's state as numbers, for an elastic commit: every worker of a new round takes the
  // same one, so that what follows from it (a learning rate) stays the same everywhere.
  std::vector<double> state() const;
  void set_state(const std::vector<double>& numbers);

 private:
  mutable std::mutex mutex_;
  double smoothing_;
  int64_t measurements_ = 0;
  int64_t batch_ = 0;
  double sqr_ = 0.0, variance_ = 0.0, weight_ = 0.0;  // weight_: what debiases the averages
};

}  // namespace shoal::dp
