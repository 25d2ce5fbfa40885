// Activation checkpointing for LibTorch (PyTorch's torch.utils.checkpoint, which LibTorch's C++
// API lacks): a function or module whose activations are freed after forward and recomputed in
// backward. Named recompute here so as not to be taken for shoal::save's checkpoints.
//
//   x = shoal::recompute(*block, [&](const at::Tensor& h) { return block->forward(h); }, x);
//   auto seq = shoal::recompute_every(net, 2);   // a Sequential, every second block recomputed
//
// The recomputation replays the random state the forward saw (dropout draws the same mask) and
// its CPU autocast state, so gradients equal the plain run's, bit for bit on one thread. See
// docs/memory.md, "Recomputing activations".
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

namespace shoal {

using RecomputedFunction =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// Runs fn(inputs) without keeping its activations; backward runs it again, with the random and
// autocast state of the first run, and takes the gradients of its inputs and of `parameters`
// (the tensors fn reads that need gradients: those of the module it runs). A parameter that fn
// reads and `parameters` does not list gets no gradient. Outside grad mode (evaluation), or when
// nothing needs a gradient, it is fn(inputs). Inside backward, the parameters' gradients reach
// them through the outer backward, as any other's, so DataParallel's buckets, ZeRO's
// reduce-scatter and a pipeline's sums see them as usual.
std::vector<at::Tensor> recompute(const RecomputedFunction& fn,
                                  const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& parameters);

// The same for one module and one tensor: `parameters` are the module's.
at::Tensor recompute(const torch::nn::Module& module,
                     const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input);

// A module that runs the one it holds under recompute(): its forward is the held module's
// forward of one tensor. It holds the held module's children, parameters and buffers under their
// own names, so that saving, loading and optimizing it is saving, loading and optimizing the
// held module.
class RecomputeImpl : public torch::nn::Module {
 public:
  explicit RecomputeImpl(torch::nn::AnyModule held);
  at::Tensor forward(const at::Tensor& input);
  const torch::nn::AnyModule& held() const { return held_; }

 private:
  torch::nn::AnyModule held_;
};
TORCH_MODULE(Recompute);

// A Sequential of the same modules, under the same names, with every k-th one (the first, the
// (k+1)-th, ...) recomputed; k = 1: all of them. The modules are shared, not copied. Each must
// take and return one tensor.
torch::nn::Sequential recompute_every(const torch::nn::Sequential& sequential, int k);

}  // namespace shoal
