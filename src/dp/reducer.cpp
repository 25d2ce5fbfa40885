#include "shoal/dp/reducer.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "shoal/core/error.h"

namespace shoal::dp {

namespace {

struct Bucket {
  std::vector<size_t> params;
  std::vector<int64_t> offsets;  // where each parameter's gradient starts in `buffer`
  at::Tensor buffer;
  size_t pending = 0;  // parameters whose gradient has not arrived in this backward
  comm::Work work;
};

}  // namespace

struct Reducer::State {
  std::vector<at::Tensor> params;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::vector<size_t> bucket_of;
  std::vector<size_t> slot_of;
  std::vector<Bucket> buckets;
  std::vector<bool> ready;
  comm::Group group;
  ReducerOptions options;
  std::function<void()> after_backward;
  bool sync = true;
  bool in_backward = false;
  size_t next_bucket = 0;  // the first bucket not yet started

  void begin_backward(const std::shared_ptr<State>& self);
  void on_grad_ready(size_t index, const std::shared_ptr<State>& self);
  void start_ready_buckets();
  void start(Bucket& bucket);
  void finalize();

  at::Tensor slice(const Bucket& bucket, size_t slot) const {
    const auto& p = params[bucket.params[slot]];
    return bucket.buffer.narrow(0, bucket.offsets[slot], p.numel());
  }
};

namespace {

// Runs after AccumulateGrad has written a parameter's .grad: the gradient there is final for
// this backward, including what earlier no_sync steps accumulated.
class GradReady : public torch::autograd::FunctionPostHook {
 public:
  GradReady(std::weak_ptr<Reducer::State> state, size_t index) : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto state = state_.lock()) state->on_grad_ready(index_, state);
    return outputs;
  }

 private:
  std::weak_ptr<Reducer::State> state_;
  size_t index_;
};

}  // namespace

void Reducer::State::begin_backward(const std::shared_ptr<State>& self) {
  in_backward = true;
  next_bucket = 0;
  std::fill(ready.begin(), ready.end(), false);
  for (auto& bucket : buckets) bucket.pending = bucket.params.size();
  std::weak_ptr<State> weak = self;
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) state->finalize();
  });
}

void Reducer::State::on_grad_ready(size_t index, const std::shared_ptr<State>& self) {
  if (!sync) return;
  if (!in_backward) begin_backward(self);
  if (ready[index]) return;
  ready[index] = true;
  Bucket& bucket = buckets[bucket_of[index]];
  const at::Tensor& grad = params[index].grad();
  slice(bucket, slot_of[index]).copy_(grad.reshape(-1));
  if (--bucket.pending == 0) start_ready_buckets();
}

void Reducer::State::start_ready_buckets() {
  while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) start(buckets[next_bucket++]);
}

void Reducer::State::start(Bucket& bucket) {
  bucket.work = options.hook(group, bucket.buffer);
}

void Reducer::State::finalize() {
  // Buckets with parameters that got no gradient here: their share of the average is zero.
  for (; next_bucket < buckets.size(); ++next_bucket) {
    Bucket& bucket = buckets[next_bucket];
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      if (!ready[bucket.params[slot]]) slice(bucket, slot).zero_();
    }
    start(bucket);
  }
  at::Tensor used;
  if (options.find_unused_parameters) {
    used = at::empty({static_cast<int64_t>(params.size())}, at::kFloat);
    for (size_t i = 0; i < params.size(); ++i) used.data_ptr<float>()[i] = ready[i] ? 1.0f : 0.0f;
  }
  in_backward = false;
  for (auto& bucket : buckets) bucket.work.wait();
  if (used.defined()) group.all_reduce(used, {comm::ReduceOp::kMax});
  for (auto& bucket : buckets) {
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t index = bucket.params[slot];
      if (used.defined() && used.data_ptr<float>()[index] == 0.0f) continue;
      at::Tensor& param = params[index];
      auto average = slice(bucket, slot).view_as(param);
      if (param.grad().defined()) {
        param.mutable_grad().copy_(average);
      } else {
        param.mutable_grad() = average.clone();
      }
    }
  }
  if (after_backward) after_backward();
}

Reducer::Reducer(std::vector<at::Tensor> parameters, comm::Group group, ReducerOptions options)
    : state_(std::make_shared<State>()) {
  if (options.bucket_bytes < 1) {
    throw UsageError("DataParallel: bucket_bytes must be positive, got " + std::to_string(options.bucket_bytes));
  }
  if (!options.hook) options.hook = allreduce_hook();
  State& state = *state_;
  state.params = std::move(parameters);
  state.group = std::move(group);
  state.options = std::move(options);
  const size_t n = state.params.size();
  state.bucket_of.resize(n);
  state.slot_of.resize(n);
  state.ready.assign(n, false);

  // Reverse registration order approximates the order in which backward produces gradients.
  const auto cap_of = [&](size_t bucket) {
    return bucket == 0 ? std::min(state.options.first_bucket_bytes, state.options.bucket_bytes)
                       : state.options.bucket_bytes;
  };
  int64_t bytes = 0;
  for (size_t k = n; k-- > 0;) {
    const at::Tensor& p = state.params[k];
    const int64_t size = p.numel() * static_cast<int64_t>(p.element_size());
    const bool fits = !state.buckets.empty() && state.buckets.back().buffer.scalar_type() == p.scalar_type() &&
                      bytes + size <= cap_of(state.buckets.size() - 1);
    if (!fits) {
      state.buckets.emplace_back();
      state.buckets.back().buffer = at::empty({0}, p.options());
      bytes = 0;
    }
    Bucket& bucket = state.buckets.back();
    state.bucket_of[k] = state.buckets.size() - 1;
    state.slot_of[k] = bucket.params.size();
    bucket.offsets.push_back(bytes / static_cast<int64_t>(p.element_size()));
    bucket.params.push_back(k);
    bytes += size;
  }
  for (auto& bucket : state.buckets) {
    int64_t total = 0;
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) total += state.params[bucket.params[slot]].numel();
    bucket.buffer = at::zeros({total}, bucket.buffer.options());
  }

  for (size_t k = 0; k < n; ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(state.params[k]);
    SHOAL_CHECK(accumulator != nullptr) << "parameter " << k << " is not a leaf that requires grad";
    state.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<GradReady>(state_, k)));
    state.accumulators.push_back(std::move(accumulator));
  }
}

Reducer::~Reducer() {
  for (size_t k = 0; k < state_->accumulators.size(); ++k) state_->accumulators[k]->del_post_hook(state_->hook_keys[k]);
}

void Reducer::set_sync(bool sync) { state_->sync = sync; }
bool Reducer::sync() const { return state_->sync; }
void Reducer::set_after_backward(std::function<void()> callback) { state_->after_backward = std::move(callback); }

std::vector<std::vector<size_t>> Reducer::bucket_assignment() const {
  std::vector<std::vector<size_t>> assignment;
  for (const auto& bucket : state_->buckets) assignment.push_back(bucket.params);
  return assignment;
}

}  // namespace shoal::dp
