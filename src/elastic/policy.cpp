// The batch policies' side of elastic::State: the learning rates each policy sets, and the batch
// BatchPolicy::goodput() chooses from the step times the workers agree on.
#include "policy.h"

#include <chrono>

#include "shoal/comm/group.h"
#include "shoal/elastic/state.h"
#include "shoal/runtime/init.h"

namespace shoal::elastic {

at::Tensor pack_step_times(const StepTimes& step_times) {
  std::vector<double> numbers;
  for (const auto& [shape, mean] : step_times) {
    const auto& [world, batch, passes] = shape;
    numbers.insert(numbers.end(),
                   {static_cast<double>(world), static_cast<double>(batch),
                    static_cast<double>(passes), mean.first, static_cast<double>(mean.second)});
  }
  return at::tensor(numbers, at::kDouble);
}

StepTimes unpack_step_times(const at::Tensor& tensor) {
  const auto numbers = tensor.to(at::kDouble).contiguous();
  const double* n = numbers.data_ptr<double>();
  StepTimes step_times;
  for (int64_t i = 0; i + 5 <= numbers.numel(); i += 5) {
    step_times[{static_cast<int>(n[i]), static_cast<int64_t>(n[i + 1]),
                static_cast<int>(n[i + 2])}] = {n[i + 3], static_cast<int64_t>(n[i + 4])};
  }
  return step_times;
}

std::vector<StepSample> samples_of(const StepTimes& step_times) {
  std::vector<StepSample> steps;
  for (const auto& [shape, mean] : step_times) {
    const auto& [world, batch, passes] = shape;
    steps.push_back({world, static_cast<double>(batch), mean.first, passes});
  }
  return steps;
}

namespace {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void State::apply_policy() {
  const auto& policy = options_.policy;
  if (policy.kind == BatchPolicy::Kind::kGoodput) {
    // This worker's steps of the last round are not agreed on: dropped. A member whose last
    // agreement failed where others' succeeded holds other times: the first worker's stand.
    pending_seconds_ = 0;
    pending_steps_ = 0;
    last_commit_s_ = -1;
    if (shoal::is_initialized() && shoal::world_size() > 1) {
      comm::Group& group = shoal::world();
      auto times = pack_step_times(step_times_);
      auto count = at::tensor({times.numel()}, at::kLong);
      group.broadcast(count);
      if (shoal::rank() != 0) times = at::zeros({count.item<int64_t>()}, at::kDouble);
      group.broadcast(times);
      step_times_ = unpack_step_times(times);
    }
    choose();
  }
  if (policy.kind == BatchPolicy::Kind::kAdaScale) apply_gain();
  if (policy.kind != BatchPolicy::Kind::kScaleLearningRate) return;
  const int world = shoal::is_initialized() ? shoal::world_size() : 1;
  gain_ = static_cast<double>(world) / policy.reference_world_size;
  auto& groups = optimizer_.param_groups();
  warmup_from_.clear();
  for (size_t i = 0; i < groups.size() && i < base_rates_.size(); ++i) {
    const double target = base_rates_[i] * world / policy.reference_world_size;
    warmup_from_.push_back(groups[i].options().get_lr());
    if (policy.warmup_steps == 0) groups[i].options().set_lr(target);
  }
  warmup_done_ = 0;
}

void State::set_base_learning_rates(std::vector<double> rates) {
  base_rates_ = std::move(rates);
  const BatchPolicy& policy = options_.policy;
  if (policy.kind == BatchPolicy::Kind::kScaleLearningRate && warmup_done_ < policy.warmup_steps)
    return;  // the warmup's commits reach base * world / reference
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < base_rates_.size(); ++i)
    groups[i].options().set_lr(base_rates_[i] * gain_);
}

void State::apply_gain() {
  const int world = shoal::is_initialized() ? shoal::world_size() : 1;
  const double per_worker = static_cast<double>(sampler_.options().batch_size);
  const auto& policy = options_.policy;
  gain_ =
      policy.kind == BatchPolicy::Kind::kGoodput
          ? noise_->value().gain(world * per_worker, static_cast<double>(policy.limits.base_batch))
          : noise_->value().gain(world * per_worker, policy.reference_world_size * per_worker);
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < base_rates_.size(); ++i)
    groups[i].options().set_lr(base_rates_[i] * gain_);
}

// Note [Choosing the batch in an elastic job]
// Every worker must cut the same batch at the same step, so BatchPolicy::goodput() chooses from
// what every worker holds the same: the gradient noise (summed over the workers, committed with
// the rest) and the agreed step times. Each worker times its own steps, commit to commit (not
// next_epoch()'s, which ends none, nor a round's first, which pays for the round); every
// choose_every commits one all-reduce of two numbers sums them over the workers, and the mean is
// merged into the agreed time of the current (world, batch per backward, backward passes). The
// agreed times are committed, so that a newcomer and a job resumed from disk choose alike. After
// a change of the world the unagreed steps of the last round are dropped and the new world's
// batch is chosen from the agreed times alone: a world never run at is modeled (shoal/dp/
// goodput.h). The learning rates follow AdaScale's gain for the global batch chosen.
void State::time_step() {
  const double now = steady_seconds();
  if (last_commit_s_ >= 0 && !epoch_commit_) {
    pending_seconds_ += now - last_commit_s_;
    ++pending_steps_;
  }
  last_commit_s_ = now;
  if (++commits_since_choice_ < options_.policy.choose_every) return;
  auto sums = at::tensor({pending_seconds_, static_cast<double>(pending_steps_)}, at::kDouble);
  if (shoal::is_initialized() && shoal::world_size() > 1) shoal::world().all_reduce(sums);
  const double seconds = sums[0].item<double>();
  const auto steps = static_cast<int64_t>(sums[1].item<double>());
  pending_seconds_ = 0;
  pending_steps_ = 0;
  if (steps > 0) {
    const int world = shoal::is_initialized() ? shoal::world_size() : 1;
    auto& [mean, count] = step_times_[{world, choice_.local_batch, choice_.accumulation}];
    mean = (mean * static_cast<double>(count) + seconds) / static_cast<double>(count + steps);
    count += steps;
  }
  choose();
}

void State::choose() {
  commits_since_choice_ = 0;
  const int world = shoal::is_initialized() ? shoal::world_size() : 1;
  choice_ = best_batch(StepTimeModel::fit(samples_of(step_times_)), noise_->value(), world,
                       options_.policy.limits);
  sampler_.set_batch_size(choice_.local_batch * choice_.accumulation);
  apply_gain();
}

}  // namespace shoal::elastic
