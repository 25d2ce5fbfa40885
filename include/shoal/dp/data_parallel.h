// DataParallel: wraps a module so that backward averages its gradients across the job's workers.
// It joins the job (shoal::init()) if the program has not.
//
//   auto net = std::make_shared<Net>();        // or a TORCH_MODULE holder
//   shoal::DataParallel model(net);             // broadcasts, checks, hooks in
//   ... model(x) (or model.forward(x)), loss.backward(), optimizer.step() as before
//
// The module is the program's as before; DataParallel adds autograd hooks, keeps the workers'
// copies equal, and sees each batch as it goes through its forward. See docs/dp.md.
//
// Note [Weighing gradients by batch share]
// A global batch of B samples is cut among the n workers as b_0, ..., b_{n-1}, and worker i's
// loss is the mean over its b_i samples, with gradient g_i. One process on the whole batch gets
// the gradient of the mean over all B, which is sum_i (b_i / B) g_i. Averaging with equal
// weights, sum_i g_i / n, equals it only when every b_i = B / n; with 64 samples over 3 workers
// (22, 21, 21), or a last batch smaller than the worker count, it does not. So DataParallel's
// forward reads b_i from the batch itself (its first tensor argument's size along
// DataParallelOptions::batch_dim) and starts a one-number all-reduce that gives B while the
// forward computes; backward scales each incoming gradient by n * b_i / B before averaging:
// exactly the one-process gradient, with no change to the user's loss and whatever loader made
// the batch (one that prefetches, an evaluation loader beside training, a program's own
// tensors). When every share is equal the weight is 1 and nothing is scaled. A share of 0 weighs
// the gradient by 0 (not by multiplication, which would keep a NaN from an empty batch's mean).
// The weight is exact for losses reduced by a mean over the batch (every torch loss's default),
// and is applied before gradients accumulate, so no_sync() steps of different shares add up
// exactly too. Only forwards under grad mode count (an evaluation under torch::NoGradGuard does
// not), and such a forward is a collective: every worker makes it. A module called directly
// (net->forward(x)) is not seen, and its gradients are averaged with equal weights, as PyTorch's
// DDP does.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include "shoal/comm/group.h"
#include "shoal/dp/buckets.h"
#include "shoal/dp/comm_hooks.h"
#include "shoal/dp/gradient_noise.h"

namespace shoal {

// Mixed precision (docs/memory.md, "Mixed precision"): what DataParallel computes and reduces in,
// the parameters and the optimizer's state staying in their own dtype (float32).
struct MixedPrecision {
  // at::kBFloat16: the module's forward runs under LibTorch's CPU autocast in bfloat16 (matrix
  // products and convolutions in bfloat16, reductions and losses in float32, as autocast's op
  // lists say), and a tensor the forward returns in a lower precision is given back in float32,
  // so that the loss is computed as before. at::kFloat: off. LibTorch's CPU autocast computes in
  // bfloat16 only; float16 is refused.
  at::ScalarType compute = at::kFloat;
  // The dtype gradients travel in: at::kFloat (their own), at::kBFloat16 (float32's range, 8
  // bits of mantissa) or at::kHalf (float16: 11 bits, a range of 6e-5 to 65504, so small
  // gradients need loss scaling, shoal::GradScaler). Each member's part is summed in float32;
  // at zero_stage 0 the average comes back rounded to the wire's dtype (bf16_compress_hook and
  // fp16_compress_hook), under ZeRO each slice's average stays float32.
  at::ScalarType reduce = at::kFloat;
};

// bucket_bytes and first_bucket_bytes come from BucketOptions (shoal/dp/buckets.h), which
// GradientSync takes too.
struct DataParallelOptions : BucketOptions {
  // Agree after each backward on which parameters got a gradient on any worker, and leave the
  // .grad of those that got none anywhere untouched (as a single process would). One more small
  // all-reduce per step. Without it such parameters get a zero gradient.
  bool find_unused_parameters = false;
  // Each parameter's .grad is its slice of its bucket once the first synchronized backward has
  // run (PyTorch's gradient_as_bucket_view): backward accumulates into the bucket and the
  // average is left in place, two copies of every gradient fewer per step.
  bool gradient_as_bucket_view = true;
  // Broadcast buffers (e.g. batch-norm running statistics) from the first worker after each
  // synchronized backward, so every worker's next forward sees the same buffers.
  bool broadcast_buffers = true;
  // Weigh each worker's gradient by its share of the global batch that went through forward, so
  // that uneven shares still give the one-process gradient of a mean loss (Note [Weighing
  // gradients by batch share] above). Off: equal weights, as PyTorch's DDP (e.g. for a loss
  // summed rather than averaged over the batch).
  bool weigh_by_batch_share = true;
  // The dimension of the forward's first tensor argument that counts the batch's samples (1 for
  // a sequence-first input, [T, B, ...]).
  int64_t batch_dim = 0;
  // How a bucket is averaged; empty: an all-reduce in the gradients' dtype.
  dp::CommHook comm_hook;
  // The workers to replicate over; empty: shoal::world(), followed as an elastic job's world
  // changes (see docs/elastic.md).
  std::optional<comm::Group> group;
  // Measure the gradient noise scale during training (Note [Measuring the gradient noise],
  // shoal/dp/gradient_noise.h): two passes over each step's gradients and an all-reduce of one
  // number; in a job of one, a copy of the last step's gradients. Read it with gradient_noise();
  // elastic::BatchPolicy::adascale() needs it. It counts the batch of every forward made
  // through DataParallel.
  bool measure_gradient_noise = false;
  // The measurement's moving averages keep this much of the past at each step, in [0, 1): about
  // 1 / (1 - smoothing) steps count.
  double gradient_noise_smoothing = 0.99;
  // ZeRO (docs/memory.md): 0 replicates everything on every worker. 1 splits the optimizer's
  // state over the workers: each worker's optimizer updates its slice of every parameter
  // (DataParallel::parameters() gives the slices, which the optimizer must be built on), and the
  // next forward through the wrapper all-gathers the parameters; gradients are reduce-scattered
  // into the slices during backward. 2 also releases each full gradient once it is copied into
  // its bucket, so that a worker keeps only its slice's. 3 also frees the parameters' memory
  // between uses: each is gathered, with its unit, just before an operation reads it, in forward
  // and again in backward (Note [Gathering a parameter when an operation reads it],
  // src/dp/gatherer.h). The result equals the one-process run for optimizers that act on each
  // element alone (SGD, Adam, AdamW, RMSprop, Adagrad).
  int zero_stage = 0;
  // Stage 3: parameters are gathered in units of consecutive modules' parameters of about this
  // many bytes, and at most max_units units are whole (or on their way) at once: the one in use
  // and the next ones, gathered while it computes.
  int64_t unit_bytes = 1024 * 1024;
  int max_units = 2;
  // Computing and reducing in 16 bits (above); the default computes and reduces in float32.
  MixedPrecision mixed_precision{};
};

namespace dp {

// What DataParallel does for any module's type (src/dp/replicator.h); DataParallel<M> reaches it
// through these calls only.
class Replicator;
std::shared_ptr<Replicator> make_replicator(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options);
void set_sync(Replicator& replicator, bool sync);
bool sync(const Replicator& replicator);
// Before the module's forward, with its first tensor argument (null when it has none), and after
// it (raises what stage 3's gathers met during it): for a front end that calls the module itself
// (Python's).
void before_forward(Replicator& replicator, const at::Tensor* input);
void after_forward(Replicator& replicator);
// One forward through DataParallel<M>: sees the batch (its first tensor argument, null when it
// has none) and gathers what ZeRO needs on construction, computes under the mixed-precision
// policy's autocast until destroyed, and on finish() raises what stage 3's gathers met and
// gives a 16-bit output back in float32.
class ForwardScope {
 public:
  ForwardScope(Replicator& replicator, const at::Tensor* input);
  ~ForwardScope();
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  void finish();
  at::Tensor finish(at::Tensor output);

 private:
  void leave_autocast();
  Replicator& replicator_;
  bool autocast_ = false;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kBFloat16;
};
std::vector<std::vector<size_t>> bucket_assignment(const Replicator& replicator);
std::optional<GradientNoise> gradient_noise(const Replicator& replicator);
torch::OrderedDict<std::string, at::Tensor> named_parameters(const Replicator& replicator);
double clip_grad_norm(Replicator& replicator, double max_norm, double norm_type);
void gather_parameters(Replicator& replicator);

namespace detail {
inline const at::Tensor* first_tensor() { return nullptr; }
template <typename First, typename... Rest>
const at::Tensor* first_tensor(const First& first, const Rest&... rest) {
  if constexpr (std::is_convertible_v<const First*, const at::Tensor*>) {
    return &first;
  } else {
    return first_tensor(rest...);
  }
}
}  // namespace detail

}  // namespace dp

template <typename ModuleType>
class DataParallel {
 public:
  explicit DataParallel(std::shared_ptr<ModuleType> module, DataParallelOptions options = {})
      : module_(std::move(module)), replicator_(dp::make_replicator(module_, std::move(options))) {}

  explicit DataParallel(torch::nn::ModuleHolder<ModuleType> holder, DataParallelOptions options = {})
      : DataParallel(holder.ptr(), std::move(options)) {}

  ModuleType* operator->() { return module_.get(); }
  const ModuleType* operator->() const { return module_.get(); }
  ModuleType& operator*() { return *module_; }
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  // The buckets gradients are averaged in, as lists of parameter indices (in the order of the
  // parameters that require grad); empty in a job of one, where nothing is averaged (unless it
  // measures the gradient noise).
  std::vector<std::vector<size_t>> bucket_assignment() const { return dp::bucket_assignment(*replicator_); }

  // The gradient noise measured so far (DataParallelOptions::measure_gradient_noise), the same on
  // every worker; empty when not measured. See shoal/dp/gradient_noise.h.
  std::optional<GradientNoise> gradient_noise() const { return dp::gradient_noise(*replicator_); }

  // The tensors to build the optimizer on, each once (tied weights once, as PyTorch's
  // Module.parameters() in Python; LibTorch's lists a tied weight under each of its names). At
  // zero_stage 0 the module's parameters; at 1 and 2 this worker's slice of each trainable one
  // (Note [A parameter's slice], src/dp/shards.h), under the same names, and the frozen ones
  // themselves.
  std::vector<at::Tensor> parameters() const { return named_parameters().values(); }
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const {
    return dp::named_parameters(*replicator_);
  }

  // Scales the gradients of parameters() so that their norm over the whole model, on all
  // workers, is at most max_norm, as torch::nn::utils::clip_grad_norm_ does on one process;
  // returns the norm before clipping. Call it between backward and the optimizer's step. Under
  // ZeRO it is the only correct way: torch's own on parameters() would see one slice. A
  // collective at zero_stage 1 and 2 (every worker calls it).
  double clip_grad_norm(double max_norm, double norm_type = 2.0) {
    return dp::clip_grad_norm(*replicator_, max_norm, norm_type);
  }

  // At zero_stage 1 and 2: makes the module's parameters whole on every worker after the
  // optimizer's step (each worker's step updated its slices only). The next forward through
  // the wrapper does it by itself; call this to read the parameters before then (after the last
  // step, say). A collective when there is something to gather; nothing at stage 0. At stage 3:
  // every parameter whole until the next forward needs the room or the next backward ends.
  void gather_parameters() { dp::gather_parameters(*replicator_); }

  // Calls the module's forward, seeing the batch on the way (Note [Weighing gradients by batch
  // share]).
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    dp::ForwardScope scope(*replicator_, dp::detail::first_tensor(args...));
    using Result = decltype(module_->forward(std::forward<Args>(args)...));
    if constexpr (std::is_void_v<Result>) {
      module_->forward(std::forward<Args>(args)...);
      scope.finish();
    } else if constexpr (std::is_same_v<std::decay_t<Result>, at::Tensor>) {
      return scope.finish(module_->forward(std::forward<Args>(args)...));
    } else {
      Result result = module_->forward(std::forward<Args>(args)...);
      scope.finish();
      return result;
    }
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Within the returned guard's scope, backward accumulates gradients locally only; the first
  // backward after it averages everything accumulated (gradient accumulation, PyTorch's no_sync).
  class NoSync {
   public:
    explicit NoSync(dp::Replicator& replicator) : replicator_(&replicator), before_(dp::sync(replicator)) {
      dp::set_sync(replicator, false);
    }
    ~NoSync() {
      if (replicator_) dp::set_sync(*replicator_, before_);
    }
    NoSync(NoSync&& other) noexcept : replicator_(std::exchange(other.replicator_, nullptr)), before_(other.before_) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    dp::Replicator* replicator_;
    bool before_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*replicator_); }

 private:
  std::shared_ptr<ModuleType> module_;
  std::shared_ptr<dp::Replicator> replicator_;
};

template <typename ModuleType>
DataParallel(std::shared_ptr<ModuleType>, DataParallelOptions = {}) -> DataParallel<ModuleType>;
template <typename ModuleType>
DataParallel(torch::nn::ModuleHolder<ModuleType>, DataParallelOptions = {}) -> DataParallel<ModuleType>;

}  // namespace shoal
