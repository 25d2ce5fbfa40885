// What the extension's sources share (src/python): building a C++ module over a Python module's
// tensors, deadlines from Python, and each source's bindings.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include "shoal/core/timeout.h"
#include "shoal/global/nn.h"

namespace shoal::python {

using Named = std::vector<std::pair<std::string, at::Tensor>>;
using Placed = std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>;

// A C++ module that registers a Python module's very tensors (no copies) under their names,
// nested at each '.' in modules of its own kind, with a submodule for each of `modules` too,
// tensors or none (a ReLU's), as a C++ model of the same layers has, and the C++ modules of
// `placed` at their paths (a Python ps.Embedding's C++ table) (Note [A Python module's tensors in
// C++], bindings.cpp).
class Mirror : public torch::nn::Module {
 public:
  void fill(const Named& parameters, const Named& buffers, const std::vector<std::string>& modules = {},
            const Placed& placed = {});
};

// The module that holds dotted `path`'s last part under `root` (its parents made as empty modules
// where missing), and that last part: where a Python module's tree puts what `path` names.
std::pair<torch::nn::Module*, std::string> parent_at(torch::nn::Module& root, const std::string& path);
// Registers `module` at dotted `path` under `root`.
void place(torch::nn::Module& root, const std::string& path, std::shared_ptr<torch::nn::Module> module);

std::shared_ptr<torch::nn::Module> mirror(const Named& parameters, const Named& buffers,
                                          const std::vector<std::string>& modules = {}, const Placed& placed = {});

// BucketOptions::on_backward_error for a Python program's model (Note [Errors inside backward]).
void raise_in_python(std::exception_ptr thrown);

// A deadline from Python: seconds, or None for the group's. UsageError for a number not above 0.
Duration deadline(const std::optional<double>& seconds);

// A LibTorch optimizer of a Python optimizer's type over the same tensors, in the same param groups
// with the same options, whose state Python moves in and out by field name (Note [A Python
// optimizer's state in C++], checkpoint.cpp). Its type: "SGD", "Adam", "AdamW", "Adagrad" or
// "RMSprop"; each group: its parameters and its Python options dict.
class OptimizerMirror {
 public:
  using Groups = std::vector<std::pair<std::vector<at::Tensor>, pybind11::dict>>;
  OptimizerMirror(const std::string& type, const Groups& groups);

  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  // The state of `parameter` as (step or None, {field: tensor}), or None.
  pybind11::object state(const at::Tensor& parameter) const;
  // Takes the Python optimizer's state (its tensors, not copies; the steps) and its param groups'
  // learning rates, in one call: what a commit or a save needs of it.
  void give(const pybind11::handle& python_optimizer);
  // Each param group's learning rate.
  std::vector<double> learning_rates() const;
  void set_learning_rates(const std::vector<double>& rates);

 private:
  static std::unique_ptr<torch::optim::Optimizer> make(const std::string& type, const Groups& groups);
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// A torch.optim param group's options (a dict, e.g. {"lr": 0.1, "momentum": 0.9}) as LibTorch's;
// what the dict lacks takes torch's default.
torch::optim::SGDOptions sgd_options(const pybind11::dict& group);
torch::optim::AdagradOptions adagrad_options(const pybind11::dict& group);
torch::optim::AdamOptions adam_options(const pybind11::dict& group);

// shoal._C's checkpoint functions and OptimizerMirror (checkpoint.cpp).
void bind_checkpoint(pybind11::module_& m);

// shoal._C's elastic State and run (elastic.cpp).
void bind_elastic(pybind11::module_& m);

// shoal._C's parameter-server Optimizer and Embedding (ps.cpp).
void bind_ps(pybind11::module_& m);

// shoal._C.global_: Placement, Sbp, GlobalTensor and the ops, and global_.nn's layers (global.cpp).
void bind_global(pybind11::module_& m);

// A C++ global layer as Python holds it (shoal._C.global_.nn.GlobalLayer; Note [Global layers in
// Python], global.cpp): the layer, its forward, and how it joins a Sequential as its own type.
struct GlobalLayer {
  std::shared_ptr<global::nn::Module> module;
  std::function<global::GlobalTensor(const global::GlobalTensor&)> forward;
  std::function<void(torch::nn::Sequential&)> push_back;
};

// A list of (path, shoal._C.global_.nn.GlobalLayer) as the C++ layers at their paths, for a
// checkpoint's module (Note [Global layers in Python], global.cpp).
Placed placed_global_layers(const pybind11::handle& layers);

// shoal._C.pipeline: schedules as data, and the Pipeline over Python layers (pipeline.cpp).
void bind_pipeline(pybind11::module_& m);

// The whole model of a shoal._C.pipeline.Pipeline as a checkpoint sees it (Pipeline::module()),
// owned by the pipeline.
torch::nn::Module& pipeline_module(const pybind11::handle& pipeline);

}  // namespace shoal::python
