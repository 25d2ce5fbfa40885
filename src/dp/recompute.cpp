#include "shoal/dp/recompute.h"

#include <mutex>
#include <string>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include "dp/autocast.h"
#include "shoal/core/error.h"

namespace shoal {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Held : torch::CustomClassHolder {
  explicit Held(RecomputedFunction f) : fn(std::move(f)) {}
  RecomputedFunction fn;
};

at::Tensor rng_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_rng_state(const at::Tensor& state) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Note [Recomputing in backward]
// forward runs fn without a graph and keeps only its inputs, the random state and the autocast
// state. backward puts those states back, runs fn again with a graph on detached copies of the
// inputs, and takes the gradients of its outputs with torch::autograd::grad, with respect to those
// copies and to the parameters (inputs of this node, so that their gradients leave through it
// into the outer backward, whose accumulation, hooks and DataParallel buckets they reach as any
// other gradient: a nested backward that accumulated into .grad itself would end the outer
// backward's bookkeeping early, as PyTorch's reentrant checkpoint does DDP's). The random state
// is the CPU generator's, put back for the recomputation and restored after it.
struct RecomputeNode : torch::autograd::Function<RecomputeNode> {
  static variable_list forward(AutogradContext* ctx, const c10::IValue& held, at::TensorList inputs,
                               at::TensorList parameters) {
    ctx->saved_data["held"] = held;
    ctx->saved_data["inputs"] = static_cast<int64_t>(inputs.size());
    ctx->saved_data["rng"] = rng_state();
    ctx->saved_data["autocast"] = at::autocast::is_cpu_enabled();
    ctx->saved_data["autocast_dtype"] =
        static_cast<int64_t>(at::autocast::get_autocast_cpu_dtype());
    std::vector<at::Tensor> saved(inputs.begin(), inputs.end());
    saved.insert(saved.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(saved);
    const auto& fn = static_cast<const Held&>(*held.toCapsule()).fn;
    return fn(std::vector<at::Tensor>(inputs.begin(), inputs.end()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto count = static_cast<size_t>(ctx->saved_data["inputs"].toInt());
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < count; ++i) {
      at::Tensor copy = saved[i].detach();
      copy.requires_grad_(saved[i].requires_grad());
      inputs.push_back(copy);
    }
    const auto held = ctx->saved_data["held"].toCapsule();
    const auto& fn = static_cast<const Held&>(*held).fn;

    std::vector<at::Tensor> outputs;
    {
      // The forward's random and autocast state for the recomputation, this one's after it.
      struct Replay {
        at::Tensor rng = rng_state();
        dp::AutocastState autocast;
        ~Replay() {
          set_rng_state(rng);
          dp::leave_autocast(autocast);
        }
      } restore;
      set_rng_state(ctx->saved_data["rng"].toTensor());
      restore.autocast = dp::enter_autocast(
          {ctx->saved_data["autocast"].toBool(),
           static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt())});
      at::AutoGradMode grad(true);
      outputs = fn(inputs);
    }
    SHOAL_CHECK(outputs.size() == grad_outputs.size())
        << "recompute: the function gave " << outputs.size() << " outputs in backward, "
        << grad_outputs.size() << " in forward";

    variable_list targets, target_grads, wrt;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        targets.push_back(outputs[i]);
        target_grads.push_back(grad_outputs[i]);
      }
    }
    std::vector<size_t> position;  // where each of wrt's gradients goes among the node's inputs
    for (size_t i = 0; i < saved.size(); ++i) {
      const at::Tensor& tensor = i < count ? inputs[i] : saved[i];
      if (!tensor.requires_grad()) continue;
      wrt.push_back(tensor);
      position.push_back(i);
    }
    variable_list result(1 + saved.size());  // the held function's slot stays undefined
    if (targets.empty() || wrt.empty()) return result;
    const auto grads = torch::autograd::grad(targets, wrt, target_grads, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t j = 0; j < grads.size(); ++j) result[1 + position[j]] = grads[j];
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> recompute(const RecomputedFunction& fn,
                                  const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& parameters) {
  if (!fn) throw UsageError("recompute: the function is empty");
  bool needs_grad = false;
  for (const auto& t : inputs) needs_grad = needs_grad || (t.defined() && t.requires_grad());
  std::vector<at::Tensor> trainable;  // each once: a tied weight listed twice gets one gradient
  for (const auto& p : parameters) {
    if (!p.defined() || !p.requires_grad()) continue;
    bool seen = false;
    for (const auto& q : trainable) seen = seen || q.is_same(p);
    if (!seen) trainable.push_back(p);
  }
  if (!at::GradMode::is_enabled() || (!needs_grad && trainable.empty())) return fn(inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      throw UsageError("recompute: input " + std::to_string(i) +
                       " is undefined; expected defined tensors");
    }
  }
  const c10::IValue held = c10::IValue::make_capsule(c10::make_intrusive<Held>(fn));
  return RecomputeNode::apply(held, at::TensorList(inputs), at::TensorList(trainable));
}

at::Tensor recompute(const torch::nn::Module& module,
                     const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input) {
  auto outputs = recompute(
      [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
      {input}, module.parameters());
  return outputs[0];
}

RecomputeImpl::RecomputeImpl(torch::nn::AnyModule held) : held_(std::move(held)) {
  if (held_.is_empty()) throw UsageError("Recompute: the module is empty");
  const auto& module = *held_.ptr();
  for (const auto& child : module.named_children()) register_module(child.key(), child.value());
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  for (const auto& b : module.named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
}

at::Tensor RecomputeImpl::forward(const at::Tensor& input) {
  return recompute(
      *held_.ptr(), [this](const at::Tensor& x) { return held_.forward<at::Tensor>(x); }, input);
}

torch::nn::Sequential recompute_every(const torch::nn::Sequential& sequential, int k) {
  if (k < 1) throw UsageError("recompute_every: k must be 1 or more, got " + std::to_string(k));
  torch::nn::Sequential out;
  const auto names = sequential->named_children().keys();
  size_t i = 0;
  for (const auto& any : *sequential) {
    if (i % static_cast<size_t>(k) == 0) {
      out->push_back(names[i], torch::nn::AnyModule(Recompute(any)));
    } else {
      out->push_back(names[i], any);
    }
    ++i;
  }
  return out;
}

}  // namespace shoal
