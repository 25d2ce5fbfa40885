// What a module implements when its tensors are pieces of larger values, so that a checkpoint
// saves the whole values and loads each worker's piece of them (the idea of PyTorch's Stateful
// for distributed checkpoints: named whole tensors out, named whole tensors in). A global model's
// layers (shoal::global::nn::Module) implement it for their own parameters, and a pipeline's whole
// model (pipeline::Pipeline::module()) for every tensor of the layers it stands for. shoal::save
// and shoal::load find it on any module of the tree they are given, whatever holds those layers (a
// torch::nn::Sequential, a module of the program's) and through whatever reference. See
// docs/checkpoint.md.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>

namespace shoal::checkpoint {

// One parameter of a module that is this worker's piece of a whole value.
struct Piece {
  // The parameter, as the module registered it (also the optimizer's key for its state); a
  // placeholder on a worker that holds no piece of it.
  at::Tensor local;
  bool held_here = true;
  // The whole value's shape.
  std::vector<int64_t> shape;
  // How many workers hold a piece of it, and whether this one is the first of them (whose
  // optimizer step count is saved).
  int holders = 1;
  bool first_holder = true;
  // The whole value of a tensor laid out as `local` (the parameter itself, or a field of its
  // optimizer state). A collective of every worker of the job (one that holds no piece passes
  // anything); the job's first worker gets the value, the others an undefined tensor.
  std::function<at::Tensor(const at::Tensor& like_local)> gather;
  // This worker's piece of `whole`; undefined when it holds none.
  std::function<at::Tensor(const at::Tensor& whole)> cut;
  // Why its value cannot be saved whole (for instance, a partial sum that no worker holds), in a
  // phrase; empty when it can.
  std::string refusal;
  // When defined: what this worker holds of the value instead of `local`, which the module holds
  // whole or not at all (a sharded data-parallel worker's slice of a parameter; ZeRO,
  // docs/memory.md). The optimizer holds it and keys its state by it; gather and cut work on its
  // layout; the value is saved from it and loaded into it, and then `loaded` runs.
  at::Tensor slice;
  std::function<void()> loaded;
};

// What marks a parameter that something other than its module holds in pieces (DataParallel at
// a ZeRO stage): added among the parameter's autograd hooks (torch::autograd::impl::add_hook), it
// passes gradients through unchanged and tells shoal::save and shoal::load the parameter's piece,
// so that a program saves and loads such a model as any other. `describe` returns nothing (a
// Piece whose `local` is undefined) once its owner is gone.
class PieceOf : public torch::autograd::FunctionPreHook {
 public:
  explicit PieceOf(std::function<Piece()> describe) : describe_(std::move(describe)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    return grads;
  }
  Piece describe() const { return describe_(); }

 private:
  std::function<Piece()> describe_;
};

class Savable {
 public:
  virtual ~Savable() = default;
  // The pieces among this module's tensors, each named as named_parameters() or named_buffers()
  // of this module name it (a child's with its path, "0.weight"), in the same order on every
  // worker: a collective's order. A parameter of the tree that no Savable names is refused; a
  // buffer that none names is saved as the first worker holds it.
  virtual std::vector<std::pair<std::string, Piece>> pieces() const = 0;
  // What the model is called in an error message.
  virtual std::string model_name() const { return "a global model"; }
};

// Named tensors: what a Stateful thing saves and takes back.
using StateDict = std::map<std::string, at::Tensor>;

// What a thing other than the model implements to be saved beside it (PyTorch's Stateful, as
// DCP takes it): named tensors out, named tensors in. data::Sampler implements it, so that
// shoal::save(path, net, optimizer, loader.sampler()) saves where the data stands, and
// shoal::load(path, net, optimizer, loader.sampler()) puts it back. Every worker holds the same
// state; the first worker's is saved.
class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual StateDict state_dict() const = 0;
  // Checks `state` against this object; UsageError, one line naming the first thing wrong, and
  // nothing changed. shoal::load calls it on every worker before it changes anything.
  virtual void check_state_dict(const StateDict& state) const = 0;
  // Takes `state`, which check_state_dict accepted.
  virtual void load_state_dict(const StateDict& state) = 0;
};

}  // namespace shoal::checkpoint
