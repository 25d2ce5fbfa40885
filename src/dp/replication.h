// What an elastic commit may ask of the DataParallel that replicates a parameter: whether one
// does, how many of its backwards completed, a call before each optimizer step may change the
// parameters, and the gradient noise it measures. Internal to shoal: the dp part implements it,
// the elastic part reads it, each DataParallel has its own (Note [Commits without copies],
// src/elastic/snapshot.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include <ATen/ATen.h>

#include "dp/noise_meter.h"

namespace shoal::dp {

// Note [Copying a commit in the background]
// elastic::State::commit() copies the parameters and the optimizer's state, which only the
// optimizer's step changes. A DataParallel calls before_parameters_change() at the end of each
// synchronized backward, before the program's optimizer.step(); so for a module whose
// parameters a DataParallel replicates, commit() leaves the copy to a background thread, which
// overlaps the next step's forward and backward, and registers a waiter here that joins it.
class Replication {
 public:
  // `noise`: the DataParallel's meter (DataParallelOptions::measure_gradient_noise), else null.
  explicit Replication(std::shared_ptr<NoiseMeter> noise = nullptr) : noise_(std::move(noise)) {}

  // The meter of the gradient noise, null when the DataParallel does not measure it. It lasts
  // as long as the DataParallel, across changes of the world.
  const std::shared_ptr<NoiseMeter>& noise() const { return noise_; }

  // Backwards of this DataParallel whose collectives all returned: the program's optimizer step
  // may have followed each (Note [Commits without copies]).
  uint64_t synchronized_backwards() const { return backwards_.load(); }

  // `wait` runs at the end of every synchronized backward, before the optimizer's step may
  // change the parameters. Returns an id for remove_waiter.
  int add_waiter(std::function<void()> wait);
  void remove_waiter(int id);

  // For the Reducer: at the end of a synchronized backward, and once all its collectives
  // returned.
  void before_parameters_change();
  void count_synchronized_backward() { ++backwards_; }

 private:
  std::mutex mutex_;
  std::map<int, std::function<void()>> waiters_;
  int last_id_ = 0;
  std::atomic<uint64_t> backwards_{0};
  std::shared_ptr<NoiseMeter> noise_;
};

// The Replication of the DataParallel that averages `parameter`'s gradient, found on the
// parameter itself (DataParallel's hook on its gradient accumulator); null when none does (no
// DataParallel, a job of one, or GradientSync, whose parameters are global, not replicated).
std::shared_ptr<Replication> replication_of(const at::Tensor& parameter);

}  // namespace shoal::dp
