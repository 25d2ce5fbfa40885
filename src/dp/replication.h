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
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>

#include "dp/noise_meter.h"

namespace shoal::dp {

// A DataParallel's slices at a ZeRO stage in an elastic job, which elastic::State re-cuts when the
// world changes (Note [Slices in an elastic job], src/elastic/slices.cpp). The DataParallel cuts
// its slices for the world it is built in but takes in no values: until filled() it holds none
// of the job's, and its forward refuses to run.
class Slicing {
 public:
  virtual ~Slicing() = default;
  // The trainable parameters, each once, and their slices (the optimizer's tensors), in the same
  // order on every worker.
  virtual const std::vector<at::Tensor>& parameters() const = 0;
  virtual const std::vector<at::Tensor>& slices() const = 0;
  // The cut whose values the slices hold: this worker's part of `size`; size 0 when they hold
  // none of the job's yet (the values are this worker's own, as the program built the model:
  // whole in parameters() at every stage).
  virtual int cut_rank() const = 0;
  virtual int cut_size() const = 0;
  // Cuts the slices for this worker of the current world (Shards::recut); they hold no values of
  // the job until filled(), which the caller calls once it has written them (and the optimizer's
  // state). filled() builds what averages gradients into them over that world.
  virtual void recut() = 0;
  virtual void filled() = 0;
};

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

  // The DataParallel's slices, in an elastic job at a ZeRO stage; null otherwise, or once the
  // DataParallel is gone.
  std::shared_ptr<Slicing> slicing() const { return slicing_.lock(); }
  void set_slicing(std::weak_ptr<Slicing> slicing) { slicing_ = std::move(slicing); }

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
  std::weak_ptr<Slicing> slicing_;
};

// The Replication of the DataParallel that averages `parameter`'s gradient, found on the
// parameter itself (DataParallel's hook on its gradient accumulator, or, at a ZeRO stage in an
// elastic job, a mark on the parameter that lasts across worlds); null when none does (no
// DataParallel, a job of one, or GradientSync, whose parameters are global, not replicated).
std::shared_ptr<Replication> replication_of(const at::Tensor& parameter);

// That mark: among the parameter's hooks (torch::autograd::impl::add_hook), passing gradients
// through unchanged.
class ReplicatedBy : public torch::autograd::FunctionPreHook {
 public:
  explicit ReplicatedBy(std::weak_ptr<Replication> replication)
      : replication_(std::move(replication)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    return grads;
  }
  std::shared_ptr<Replication> replication() const { return replication_.lock(); }

 private:
  std::weak_ptr<Replication> replication_;
};

}  // namespace shoal::dp
