#include "dp/reducer.h"

#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "dp/compressed_scatter.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"

namespace shoal::dp {
namespace {

// A flat bucket as an operand of at::dot, which takes floating types of 32 bits and more.
at::Tensor as_dot_operand(const at::Tensor& flat) {
  return flat.scalar_type() == at::kFloat || flat.scalar_type() == at::kDouble ? flat : flat.to(at::kFloat);
}

double squared_norm(const at::Tensor& flat) {
  const at::Tensor x = as_dot_operand(flat);
  return at::dot(x, x).item<double>();
}

}  // namespace

struct Reducer::State {
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;  // where each parameter's gradient starts in `buffer`, in elements
    at::Tensor buffer;
    size_t pending = 0;  // parameters whose gradient has not arrived in this backward
    comm::Work work;
    Shards::Layout layout;       // with shards: Note [Buckets cut by member]
    int64_t numel = 0;
    at::Tensor result;  // with shards: this member's part of the average, once settled
    std::shared_ptr<at::Tensor> compressed;  // where a CompressedScatter leaves it
    bool settled = true;
    timeline::AsyncSlice slice;  // from its all-reduce's start until finalize() has waited for it
  };

  std::vector<at::Tensor> params;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::vector<unsigned> weight_hooks;  // with weigh_by_batch_share: one per parameter
  std::vector<size_t> bucket_of;
  std::vector<size_t> slot_of;
  std::vector<const void*> slice_data;  // where each parameter's slice of its bucket starts
  std::vector<Bucket> buckets;
  // Note [Buckets in shared memory]: the buckets of each dtype are consecutive parts of one
  // tensor made once by comm::Group::empty_shared, which on the shared-memory path the members
  // share: a bucket's all-reduce then reduces every member's bucket where it lies, without copying
  // it through the group's segment (docs/comm.md, "Shared buffers"). Cutting the buckets again
  // (rebuild) re-cuts the same memory; every member cuts the same way, so each bucket lies at the
  // same place on all. Elsewhere it is an ordinary tensor.
  std::map<at::ScalarType, at::Tensor> arenas;
  std::vector<bool> ready;
  std::vector<size_t> ready_order;  // this backward's gradients, in the order they arrived
  comm::Group group;
  ReducerOptions options;
  // Note [Averaging a bucket]: with no hook, a bucket is averaged. Over Gloo, gradients are
  // scaled by 1/n on their way into the bucket (prescale) and the bucket is summed, one pass fewer
  // than summing and then dividing, and done during backward, while the network works. The
  // shared-memory paths divide in the reduction's own pass (ReduceOp::kAvg), which costs nothing,
  // so there a bucket is all-reduced with kAvg and no gradient is scaled (a pass over every
  // gradient less: 23 MB a step on bench/ddp's MLP).
  bool prescale = false;
  bool rebuilt = false;
  std::function<void()> after_backward;
  bool sync = true;
  bool in_backward = false;
  size_t next_bucket = 0;  // the first bucket not yet started

  // The last forward's batch (Note [Weighing gradients by batch share]): this worker's rows and,
  // once `count` is waited for, the group's, in `rows`.
  std::mutex batch_mutex;
  at::Tensor rows;  // int64 [1]
  int64_t local_rows = 0;
  comm::Work count;
  bool counting = false;
  double weight = 1.0;
  int64_t step_rows = 0;  // the group's samples since the last synchronized backward

  // The measurement of the gradient noise (Note [Measuring the gradient noise]), when the
  // replication holds a meter: this step's sum of |local gradient|^2, bucket by bucket, and
  // with one worker the previous step's gradient, bucket by bucket, and its samples.
  NoiseMeter* noise = nullptr;
  // ZeRO (ReducerOptions::shards), else null.
  Shards* shards = nullptr;
  std::optional<CompressedScatter> scatter;  // with ReducerOptions::wire
  // Note [Sharded buckets live only while they travel]
  // Under ZeRO a bucket's buffer is made when its first gradient arrives and dropped once its
  // reduce-scatter has returned, and at most two reduce-scatters travel at once (starting a third
  // waits for the oldest): the full gradients then never lie in memory all at once, which is what
  // stages 2 and 3 save. The buckets started and not yet waited for, oldest first:
  std::deque<size_t> traveling;
  double local_sqr = 0.0;
  std::vector<at::Tensor> previous;
  int64_t previous_rows = 0;

  // Waits for the count in flight, if any; with batch_mutex held.
  void settle_count() {
    if (!counting) return;
    counting = false;
    count.wait();
    const int64_t global = rows.item<int64_t>();
    weight = global > 0 ? static_cast<double>(local_rows) * group.size() / static_cast<double>(global) : 1.0;
    step_rows += global;
  }

  // The factor this worker's gradient is weighed by in this backward: n * local / global, 1 when
  // no forward counted its batch. Waits for the count when it is still in flight.
  double batch_weight() {
    std::lock_guard<std::mutex> lock(batch_mutex);
    settle_count();
    return weight;
  }

  // Runs `work` inside backward: an exception leaves through options.on_backward_error.
  template <typename Work>
  void in_backward_hook(Work work) {
    try {
      work();
    } catch (...) {
      if (options.on_backward_error) options.on_backward_error(std::current_exception());
      throw;
    }
  }

  void assign(const std::vector<size_t>& order);
  void begin_backward(const std::shared_ptr<State>& self);
  void on_grad_ready(size_t index, const std::shared_ptr<State>& self);
  void start_ready_buckets();
  // Starts the bucket's average, or with `sum` that all-reduce (sum_gradients()).
  void start(Bucket& bucket, const comm::AllReduceOptions* sum = nullptr);
  void finalize();
  // With shards: waits for the bucket's reduce-scatter and keeps only its result (the Work holds
  // the buffers it moved: the bucket and what it received).
  void settle(Bucket& bucket) {
    if (bucket.settled) return;
    bucket.work.wait();
    bucket.slice.end();
    bucket.result =
        bucket.compressed ? *std::exchange(bucket.compressed, nullptr) : bucket.work.result();
    bucket.work = comm::Work();
    if (!noise || group.size() > 1) bucket.buffer = at::Tensor();  // one worker's noise reads it
    bucket.settled = true;
  }
  // With shards, after the buckets' reduce-scatters returned: each slice's part of the average
  // into its .grad (skipping the parameters `used` marks as unused everywhere).
  void give_slices_gradients(const at::Tensor& used);
  void rebuild();
  // After finalize() waited for the buckets (`sum`: the workers' local_sqr summed): gives the
  // meter this step's estimate.
  void measure_noise(const at::Tensor& sum);

  at::Tensor slice(const Bucket& bucket, size_t slot) const {
    const auto& p = params[bucket.params[slot]];
    return bucket.buffer.narrow(0, bucket.offsets[slot], p.numel());
  }

  // The parameter's slice of its bucket shaped like the parameter, to serve as its .grad. Made
  // with set_ on the bucket's storage rather than as an autograd view: Optimizer::zero_grad()
  // detaches every .grad in place, which autograd refuses for views.
  at::Tensor grad_alias(size_t index) const {
    const Bucket& bucket = buckets[bucket_of[index]];
    const at::Tensor& p = params[index];
    auto alias = at::empty({0}, bucket.buffer.options());
    alias.set_(bucket.buffer.storage(), bucket.buffer.storage_offset() + bucket.offsets[slot_of[index]], p.sizes());
    return alias;
  }

  // Whether the parameter's .grad is its slice of its bucket. Asked for every parameter in every
  // backward, twice: a comparison of addresses, where making the slice's tensor cost a few
  // microseconds each time (tens a step on a small model).
  bool is_alias(size_t index) const {
    if (shards) return false;
    const at::Tensor& grad = params[index].grad();
    return grad.defined() && grad.data_ptr() == slice_data[index] && grad.is_contiguous();
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
    if (auto state = state_.lock()) state->in_backward_hook([&] { state->on_grad_ready(index_, state); });
    return outputs;
  }
  std::shared_ptr<Reducer::State> state() const { return state_.lock(); }

 private:
  std::weak_ptr<Reducer::State> state_;
  size_t index_;
};

}  // namespace

// Cuts the parameters, walked in `order`, into buckets of one dtype each, as PyTorch's
// compute_bucket_assignment_by_size does: a bucket closes once it holds at least its cap, the
// first one's cap being small so that communication starts early.
void Reducer::State::assign(const std::vector<size_t>& order) {
  std::vector<std::vector<size_t>> groups;
  int64_t bytes = 0;
  bool open = false;
  for (size_t k : order) {
    const at::Tensor& p = params[k];
    if (!open || params[groups.back().front()].scalar_type() != p.scalar_type()) {
      groups.emplace_back();
      bytes = 0;
      open = true;
    }
    groups.back().push_back(k);
    bytes += p.numel() * static_cast<int64_t>(p.element_size());
    const int64_t cap =
        groups.size() == 1 ? std::min(options.first_bucket_bytes, options.bucket_bytes) : options.bucket_bytes;
    if (bytes >= cap) open = false;
  }

  // Gradients that live in the old buckets move to the new ones with their values.
  std::vector<at::Tensor> aliased(params.size());
  if (!buckets.empty()) {
    for (size_t k = 0; k < params.size(); ++k) {
      if (is_alias(k)) aliased[k] = params[k].grad().clone();
    }
  }
  std::vector<Bucket> fresh(groups.size());
  std::map<at::ScalarType, int64_t> used;
  for (size_t b = 0; b < groups.size(); ++b) {
    Bucket& bucket = fresh[b];
    int64_t total = 0;
    for (size_t k : groups[b]) {
      bucket_of[k] = b;
      slot_of[k] = bucket.params.size();
      bucket.params.push_back(k);
      bucket.offsets.push_back(total);
      total += params[k].numel();
    }
    const at::ScalarType dtype = params[groups[b].front()].scalar_type();
    bucket.numel = total;
    if (shards) {
      // Note [Sharded buckets live only while they travel].
      bucket.layout = shards->layout(bucket.params);
      continue;
    }
    bucket.buffer = arenas.at(dtype).narrow(0, used[dtype], total);
    bucket.buffer.zero_();
    used[dtype] += total;
  }
  buckets = std::move(fresh);
  for (size_t k = 0; k < params.size() && !shards; ++k)
    slice_data[k] = slice(buckets[bucket_of[k]], slot_of[k]).data_ptr();
  for (size_t k = 0; k < params.size(); ++k) {
    if (!aliased[k].defined()) continue;
    auto alias = grad_alias(k);
    alias.copy_(aliased[k]);
    params[k].mutable_grad() = alias;
  }
}

void Reducer::State::begin_backward(const std::shared_ptr<State>& self) {
  in_backward = true;
  next_bucket = 0;
  std::fill(ready.begin(), ready.end(), false);
  ready_order.clear();
  for (auto& bucket : buckets) bucket.pending = bucket.params.size();
  std::weak_ptr<State> weak = self;
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) state->in_backward_hook([&] { state->finalize(); });
  });
}

void Reducer::State::on_grad_ready(size_t index, const std::shared_ptr<State>& self) {
  if (!sync) return;
  if (!in_backward) begin_backward(self);
  if (ready[index]) return;
  ready[index] = true;
  ready_order.push_back(index);
  Bucket& bucket = buckets[bucket_of[index]];
  at::Tensor& grad = params[index].mutable_grad();
  if (shards) {
    if (!bucket.buffer.defined()) bucket.buffer = at::empty({bucket.numel}, grad.options());
    shards->pack(index, grad, bucket.layout.offsets[slot_of[index]], bucket.buffer,
                 prescale ? 1.0 / group.size() : 1.0);
    // The parameter's own .grad has served: its average arrives in the slice's.
    if (shards->stage() >= 2) {
      grad.reset();
    } else {
      grad.zero_();
    }
  } else if (is_alias(index)) {
    // Backward accumulated straight into the bucket.
    if (prescale) grad.mul_(1.0 / group.size());
  } else {
    auto view = slice(bucket, slot_of[index]);
    if (prescale) {
      at::mul_out(view, grad.reshape(-1), at::scalar_tensor(1.0 / group.size(), view.options()));
    } else {
      view.copy_(grad.reshape(-1));
    }
    if (options.gradient_as_bucket_view) grad = grad_alias(index);
  }
  if (--bucket.pending == 0) start_ready_buckets();
}

void Reducer::State::start_ready_buckets() {
  while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) start(buckets[next_bucket++]);
}

void Reducer::State::start(Bucket& bucket, const comm::AllReduceOptions* sum) {
  if (timeline::enabled()) {
    const auto index = static_cast<int64_t>(&bucket - buckets.data());
    bucket.slice = timeline::AsyncSlice(
        "bucket " + std::to_string(index), "dp",
        {{"bucket", index},
         {"params", static_cast<int64_t>(bucket.params.size())},
         {"bytes", static_cast<int64_t>(bucket.buffer.nbytes())}});
  }
  // The last bucket is the one finalize() waits for next, with nothing left to overlap it: it
  // runs there, on the thread that waits (comm::RunOnWaiter).
  std::optional<comm::RunOnWaiter> promise;
  if (&bucket == &buckets.back()) promise.emplace();
  if (sum) {
    bucket.work = group.all_reduce_async(bucket.buffer, *sum);
    return;
  }
  const comm::ReduceOp op =
      prescale || !options.average ? comm::ReduceOp::kSum : comm::ReduceOp::kAvg;
  if (noise) {
    // The bucket holds this worker's gradients (divided by n when prescaled) until it starts.
    const double n = group.size();
    local_sqr += squared_norm(bucket.buffer) * (prescale ? n * n : 1.0);
  }
  if (shards) {
    // Note [Sharded buckets live only while they travel]: at most two in flight.
    while (traveling.size() >= 2) {
      settle(buckets[traveling.front()]);
      traveling.pop_front();
    }
    bucket.settled = false;
    traveling.push_back(static_cast<size_t>(&bucket - buckets.data()));
    if (scatter) {
      auto started = scatter->start(group, bucket.buffer, bucket.layout.segments);
      bucket.work = std::move(started.work);
      bucket.compressed = std::move(started.result);
      return;
    }
    comm::ReduceScatterOptions by_member;
    by_member.op = op;
    by_member.sizes = bucket.layout.segments;
    bucket.work = group.reduce_scatter_async(bucket.buffer, by_member);
    return;
  }
  bucket.work = options.hook ? options.hook(group, bucket.buffer)
                             : group.all_reduce_async(bucket.buffer, {op});
}

void Reducer::State::finalize() {
  // The program's optimizer step comes next. See Note [Copying a commit in the background].
  if (options.replication) options.replication->before_parameters_change();
  // Buckets with parameters that got no gradient here: their share of the average is zero. A
  // .grad that is the bucket's slice keeps its value apart, in case it is to stay untouched.
  for (; next_bucket < buckets.size(); ++next_bucket) {
    Bucket& bucket = buckets[next_bucket];
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t index = bucket.params[slot];
      if (ready[index]) continue;
      if (options.find_unused_parameters && is_alias(index)) params[index].mutable_grad() = params[index].grad().clone();
      if (shards) {
        if (!bucket.buffer.defined())
          bucket.buffer = at::empty({bucket.numel}, params[index].options());
        shards->pack(index, at::zeros({params[index].numel()}, bucket.buffer.options()),
                     bucket.layout.offsets[slot], bucket.buffer, 1.0);
      } else {
        slice(bucket, slot).zero_();
      }
    }
    start(bucket);
  }
  // The workers' sums of squares, added while the buckets are: one number.
  at::Tensor noise_sum;
  comm::Work noise_work;
  if (noise) {
    noise_sum = at::full({1}, local_sqr, at::kDouble);
    local_sqr = 0.0;
    noise_work = group.all_reduce_async(noise_sum, {comm::ReduceOp::kSum});
  }
  at::Tensor used;
  if (options.find_unused_parameters) {
    used = at::empty({static_cast<int64_t>(params.size())}, at::kFloat);
    for (size_t i = 0; i < params.size(); ++i) used.data_ptr<float>()[i] = ready[i] ? 1.0f : 0.0f;
  }
  in_backward = false;
  for (auto& bucket : buckets) {
    if (shards) {
      settle(bucket);
      continue;
    }
    bucket.work.wait();
    bucket.slice.end();
  }
  traveling.clear();
  if (noise) {
    noise_work.wait();
    measure_noise(noise_sum);
  }
  if (used.defined()) group.all_reduce(used, {comm::ReduceOp::kMax});
  if (shards) {
    give_slices_gradients(used);
    // The reduce-scatters' results: at stage 1 copied into the full gradients; at 2 and 3 what
    // the slices' .grad do not hold goes.
    for (auto& bucket : buckets) bucket.result = at::Tensor();
  }
  for (size_t index = 0; index < params.size() && !shards; ++index) {
    if (used.defined() && used.data_ptr<float>()[index] == 0.0f) continue;
    if (is_alias(index)) continue;
    at::Tensor& param = params[index];
    if (options.gradient_as_bucket_view) {
      param.mutable_grad() = grad_alias(index);
    } else {
      auto average = slice(buckets[bucket_of[index]], slot_of[index]).view_as(param);
      if (param.grad().defined()) {
        param.mutable_grad().copy_(average);
      } else {
        param.mutable_grad() = average.clone();
      }
    }
  }
  if (!rebuilt) rebuild();
  if (after_backward) after_backward();
  // Counted only once every collective of this backward has returned (the rebuild's broadcast and
  // the buffers' included): a worker whose backward raised never reaches the optimizer's step, so
  // an elastic commit must still find its parameters unchanged (Note [Commits without copies]).
  if (options.replication) options.replication->count_synchronized_backward();
}

void Reducer::State::give_slices_gradients(const at::Tensor& used) {
  for (auto& bucket : buckets) {
    shards->give_gradients(bucket.params, bucket.layout, bucket.result, [&](size_t index) {
      return used.defined() && used.data_ptr<float>()[index] == 0.0f;
    });
  }
}

void Reducer::State::measure_noise(const at::Tensor& sum) {
  int64_t batch = 0;
  {
    std::lock_guard<std::mutex> lock(batch_mutex);
    settle_count();
    batch = std::exchange(step_rows, 0);
  }
  const int n = group.size();
  if (n > 1) {
    double average_sqr = 0.0;
    if (shards) {
      // Each member holds its part of the average: the parts' squares, summed over the group.
      for (const auto& bucket : buckets) average_sqr += squared_norm(bucket.result);
      auto total = at::full({1}, average_sqr, at::kDouble);
      group.all_reduce(total, {comm::ReduceOp::kSum});
      average_sqr = total.item<double>();
    } else {
      for (const auto& bucket : buckets) average_sqr += squared_norm(bucket.buffer);
    }
    // A step whose forwards DataParallel did not see (the module called directly) has no batch.
    if (batch >= n) {
      const double big = static_cast<double>(batch);
      noise->add(sum.item<double>() / n, average_sqr, big / n, big, batch);
    }
    return;
  }
  // One worker: this step's gradient and the previous one's are the two means.
  double current = 0.0, before = 0.0, both = 0.0;
  const bool paired = previous.size() == buckets.size() && previous_rows > 0 && batch > 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const at::Tensor& buffer = buckets[b].buffer;
    current += squared_norm(buffer);
    if (paired) {
      before += squared_norm(previous[b]);
      both += at::dot(as_dot_operand(previous[b]), as_dot_operand(buffer)).item<double>();
    }
  }
  if (paired) {
    const double mean_local_sqr = (before + current) / 2.0;
    const double average_sqr = (before + 2.0 * both + current) / 4.0;
    noise->add(mean_local_sqr, average_sqr, static_cast<double>(batch), static_cast<double>(batch + previous_rows),
               batch + previous_rows);
  }
  previous.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (previous[b].defined() && previous[b].sizes() == buckets[b].buffer.sizes()) {
      previous[b].copy_(buckets[b].buffer);
    } else {
      previous[b] = buckets[b].buffer.clone();
    }
  }
  previous_rows = batch;
}

// After the first synchronized backward, the buckets are cut again in the order the first
// worker's gradients arrived (PyTorch's rebuild_buckets), so that a bucket fills as early as
// backward allows. Every worker takes the first worker's order, as the buckets must agree.
void Reducer::State::rebuild() {
  rebuilt = true;
  std::vector<size_t> order = ready_order;
  for (size_t k = params.size(); k-- > 0;) {
    if (!ready[k]) order.push_back(k);  // no gradient this time: last, in reverse registration order
  }
  auto shared = at::empty({static_cast<int64_t>(order.size())}, at::kLong);
  for (size_t i = 0; i < order.size(); ++i) shared.data_ptr<int64_t>()[i] = static_cast<int64_t>(order[i]);
  group.broadcast(shared, {0});
  std::vector<size_t> current;
  for (const auto& bucket : buckets) current.insert(current.end(), bucket.params.begin(), bucket.params.end());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<size_t>(shared.data_ptr<int64_t>()[i]);
  if (order != current) {
    assign(order);
    previous.clear();  // the previous step's gradient, bucket by bucket, was cut the old way
  }
}

Reducer::Reducer(std::vector<at::Tensor> parameters, comm::Group group, ReducerOptions options)
    : state_(std::make_shared<State>()) {
  if (options.bucket_bytes < 1) {
    throw UsageError("DataParallel: bucket_bytes must be positive, got " + std::to_string(options.bucket_bytes));
  }
  State& state = *state_;
  state.params = std::move(parameters);
  state.group = std::move(group);
  state.prescale = !options.hook && options.wire == at::kFloat && options.average &&
                   state.group.path() == "gloo";
  state.options = std::move(options);
  state.shards = state.options.shards.get();
  SHOAL_CHECK(state.options.average || (state.shards && state.options.wire == at::kFloat))
      << "a reducer sums (average = false) only under shards, in the gradients' dtype";
  if (state.shards && state.options.wire != at::kFloat) state.scatter.emplace(state.options.wire);
  SHOAL_CHECK(!state.shards || (state.options.during_backward && !state.options.hook))
      << "a sharding reducer sums during backward, with no communication hook";
  if (state.options.replication && state.options.during_backward)
    state.noise = state.options.replication->noise().get();
  const size_t n = state.params.size();
  state.bucket_of.resize(n);
  state.slot_of.resize(n);
  state.slice_data.resize(n);
  state.ready.assign(n, false);
  std::map<at::ScalarType, int64_t> numel;
  for (const auto& p : state.params) numel[p.scalar_type()] += p.numel();
  for (const auto& [dtype, count] : numel) {
    if (!state.shards) state.arenas[dtype] = state.group.empty_shared(count, dtype);
  }
  // Reverse registration order approximates the order in which backward produces gradients
  // until the first backward tells (rebuild()).
  std::vector<size_t> reverse(n);
  for (size_t k = 0; k < n; ++k) reverse[k] = n - 1 - k;
  state.assign(reverse);
  if (!state.options.during_backward) return;

  for (size_t k = 0; k < n; ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(state.params[k]);
    SHOAL_CHECK(accumulator != nullptr) << "parameter " << k << " is not a leaf that requires grad";
    state.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<GradReady>(state_, k)));
    state.accumulators.push_back(std::move(accumulator));
  }
  if (state.options.weigh_by_batch_share) {
    // Before accumulation, so that no_sync steps of different shares accumulate exactly too.
    std::weak_ptr<State> weak = state_;
    for (auto& param : state.params) {
      state.weight_hooks.push_back(param.register_hook([weak](const at::Tensor& grad) -> at::Tensor {
        auto self = weak.lock();
        double weight = 1.0;
        if (self) self->in_backward_hook([&] { weight = self->batch_weight(); });
        if (weight == 1.0) return {};
        if (weight == 0.0) return at::zeros_like(grad);  // not 0 * NaN from a mean over no rows
        return grad * weight;
      }));
    }
  }
}

Reducer::~Reducer() {
  {
    // A count in flight writes into `rows`: let it end before the state can go.
    std::lock_guard<std::mutex> lock(state_->batch_mutex);
    if (state_->counting) {
      try {
        state_->count.wait();
      } catch (const std::exception&) {
        // the group broke; nothing waits for this count
      }
    }
  }
  for (size_t k = 0; k < state_->weight_hooks.size(); ++k) state_->params[k].remove_hook(state_->weight_hooks[k]);
  for (size_t k = 0; k < state_->accumulators.size(); ++k) state_->accumulators[k]->del_post_hook(state_->hook_keys[k]);
}

void Reducer::count_batch(int64_t rows) {
  State& state = *state_;
  if (!state.options.weigh_by_batch_share && !state.noise) return;
  std::lock_guard<std::mutex> lock(state.batch_mutex);
  // A count no backward asked for (a forward whose loss was not used) ends first: every member
  // started it, and it has long completed. Without weights no backward asks for counts: then it
  // is one of this step's forwards.
  if (state.counting) {
    if (state.options.weigh_by_batch_share) {
      state.count.wait();
    } else {
      state.settle_count();
    }
  }
  state.local_rows = rows;
  state.rows = at::full({1}, rows, at::kLong);
  state.count = state.group.all_reduce_async(state.rows, {comm::ReduceOp::kSum});
  state.counting = true;
}

void Reducer::sum_gradients(const std::vector<at::Tensor>& since, Duration timeout) {
  State& state = *state_;
  SHOAL_CHECK(!state.options.during_backward) << "sum_gradients() on a reducer that sums during backward";
  SHOAL_CHECK(since.empty() || since.size() == state.params.size())
      << "sum_gradients() given " << since.size() << " earlier gradients for " << state.params.size() << " parameters";
  const auto earlier = [&](size_t index) { return since.empty() ? at::Tensor() : since[index]; };
  const comm::AllReduceOptions sum{comm::ReduceOp::kSum, timeout};
  // Each bucket is filled with the gains and started before the next is filled.
  for (auto& bucket : state.buckets) {
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t index = bucket.params[slot];
      const at::Tensor& param = state.params[index];
      auto view = state.slice(bucket, slot);
      const at::Tensor before = earlier(index);
      if (param.is_meta() || !param.grad().defined()) {
        view.zero_();
      } else if (state.is_alias(index)) {
        if (before.defined()) view.sub_(before.reshape(-1));  // backward accumulated in the bucket
      } else if (before.defined()) {
        at::sub_out(view, param.grad().reshape(-1), before.reshape(-1));
      } else {
        view.copy_(param.grad().reshape(-1));
      }
    }
    state.start(bucket, &sum);
  }
  for (auto& bucket : state.buckets) {
    bucket.work.wait();
    bucket.slice.end();
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t index = bucket.params[slot];
      at::Tensor& param = state.params[index];
      if (param.is_meta()) continue;
      auto view = state.slice(bucket, slot);
      const at::Tensor before = earlier(index);
      if (before.defined()) view.add_(before.reshape(-1));
      if (state.is_alias(index)) continue;
      if (state.options.gradient_as_bucket_view) {
        param.mutable_grad() = state.grad_alias(index);
      } else if (param.grad().defined()) {
        param.mutable_grad().copy_(view.view_as(param));
      } else {
        param.mutable_grad() = view.view_as(param).clone();
      }
    }
  }
}

void Reducer::set_sync(bool sync) { state_->sync = sync; }
bool Reducer::sync() const { return state_->sync; }
void Reducer::set_after_backward(std::function<void()> callback) { state_->after_backward = std::move(callback); }

std::shared_ptr<Replication> replication_of(const at::Tensor& parameter) {
  for (const auto& hook : torch::autograd::impl::hooks(parameter)) {
    if (const auto* mark = dynamic_cast<const ReplicatedBy*>(hook.get()))
      return mark->replication();
  }
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(parameter);
  if (!accumulator) return nullptr;
  for (const auto& hook : accumulator->post_hooks()) {
    if (const auto* ready = dynamic_cast<const GradReady*>(hook.get())) {
      if (auto state = ready->state()) return state->options.replication;
    }
  }
  return nullptr;
}

std::vector<std::vector<size_t>> Reducer::bucket_assignment() const {
  std::vector<std::vector<size_t>> assignment;
  for (const auto& bucket : state_->buckets) assignment.push_back(bucket.params);
  return assignment;
}

}  // namespace shoal::dp
