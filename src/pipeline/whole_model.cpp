// A pipeline's whole model, as a checkpoint saves it: the whole Sequential's names and shapes on
// every worker, with the values where they live. See Note [A pipeline's whole model].
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "pipeline_state.h"
#include "shoal/checkpoint/savable.h"
#include "shoal/comm/group.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal::pipeline {
namespace whole_model {
namespace {

// Note [A pipeline's whole model]
// No worker holds a pipeline's whole model: each keeps its stages' layers. A checkpoint holds the
// whole Sequential's file, on any split, so the pipeline keeps, from its construction (when every
// worker has the whole model), a module of the whole Sequential's shape: child i is layer i itself
// where this worker holds it, and elsewhere an outline of it, a module with the same names whose
// tensors are meta tensors of the same shape, dtype and requires_grad (no storage). A tensor that
// several layers share (a tied weight) is one tensor in it too, the worker's own where it holds
// one of those layers, so that it has the same ties on every worker.
//
// That module is a checkpoint::Savable whose pieces are all its tensors, parameters and buffers:
// a tensor's whole value lives on every worker that holds a layer naming it (a replicated stage's
// replicas, the stages a tied weight joins), and is gathered from the lowest of their ranks (the
// first replica, as a data-parallel model is saved from its first worker). On load each worker
// takes the values of the tensors it holds. shoal::save and shoal::load then treat it as they
// treat a global model (src/checkpoint/whole.cpp).

// A layer this worker does not hold: its names and shapes, no values.
class Outline : public torch::nn::Module {
 public:
  explicit Outline(bool serializable) : serializable_(serializable) {}
  bool is_serializable() const override { return serializable_; }

 private:
  bool serializable_;
};

using Impl = const c10::TensorImpl*;

// The tensor of the whole model standing for `tensor` (the same for every name it has): the
// worker's own where a held layer has it, else a meta tensor of its shape and dtype.
at::Tensor stand_in(const at::Tensor& tensor, std::map<Impl, at::Tensor>& stand_ins) {
  if (!tensor.defined()) return tensor;
  auto found = stand_ins.find(tensor.unsafeGetTensorImpl());
  if (found != stand_ins.end()) return found->second;
  at::Tensor meta = at::empty(tensor.sizes(), tensor.options().device(at::kMeta));
  stand_ins.emplace(tensor.unsafeGetTensorImpl(), meta);
  return meta;
}

std::shared_ptr<torch::nn::Module> outline(const torch::nn::Module& layer,
                                           std::map<Impl, at::Tensor>& stand_ins) {
  auto module = std::make_shared<Outline>(layer.is_serializable());
  for (const auto& item : layer.named_parameters(/*recurse=*/false)) {
    const at::Tensor& p = item.value();
    module->register_parameter(item.key(), stand_in(p, stand_ins), p.defined() && p.requires_grad());
  }
  for (const auto& item : layer.named_buffers(/*recurse=*/false))
    module->register_buffer(item.key(), stand_in(item.value(), stand_ins));
  for (const auto& child : layer.named_children())
    module->register_module(child.key(), outline(*child.value(), stand_ins));
  return module;
}

class WholeModel : public torch::nn::Module, public checkpoint::Savable {
 public:
  std::vector<std::pair<std::string, checkpoint::Piece>> pieces() const override { return pieces_; }
  std::string model_name() const override { return "a pipeline"; }
  std::vector<std::pair<std::string, checkpoint::Piece>> pieces_;
};

// The piece standing for a tensor of the whole model that the workers `holders` (sorted world
// ranks) hold.
checkpoint::Piece piece_of(const at::Tensor& local, const std::vector<int>& holders, Duration timeout) {
  const int me = shoal::rank();
  const int source = holders.front();
  const bool held = std::binary_search(holders.begin(), holders.end(), me);
  checkpoint::Piece piece;
  piece.local = local;
  piece.held_here = held;
  piece.shape = local.sizes().vec();
  piece.holders = static_cast<int>(holders.size());
  piece.first_holder = me == source;
  const std::vector<int64_t> shape = piece.shape;
  const at::ScalarType dtype = local.scalar_type();
  piece.gather = [me, source, shape, dtype, timeout](const at::Tensor& like_local) {
    torch::NoGradGuard no_grad;
    at::Tensor value = me == source ? like_local.detach().contiguous() : at::empty(shape, at::TensorOptions().dtype(dtype));
    comm::BroadcastOptions options;
    options.root = source;
    options.timeout = timeout;
    shoal::world().broadcast(value, options);
    return me == 0 ? value : at::Tensor();
  };
  piece.cut = [held](const at::Tensor& whole) { return held ? whole.detach().clone() : at::Tensor(); };
  return piece;
}

}  // namespace
}  // namespace whole_model

namespace detail {

std::shared_ptr<torch::nn::Module> make_whole_model(const torch::nn::Sequential& net, const Pipeline::State& state,
                                                    const std::vector<int>& stage_of_layer) {
  using whole_model::Impl;
  const int layer_count = static_cast<int>(net->size());
  // Which layers are here, and which workers hold each tensor of the model.
  std::vector<bool> held(static_cast<size_t>(layer_count));
  std::map<Impl, std::set<int>> holders;
  std::map<Impl, at::Tensor> stand_ins;  // the worker's own tensors first
  for (int l = 0; l < layer_count; ++l) {
    const int worker = state.schedule.worker_of(stage_of_layer[static_cast<size_t>(l)]);
    held[static_cast<size_t>(l)] = worker == state.me;
    const torch::nn::Module& layer = *net->ptr(static_cast<size_t>(l));
    auto note = [&](const at::Tensor& tensor) {
      if (!tensor.defined()) return;
      auto& ranks = holders[tensor.unsafeGetTensorImpl()];
      ranks.insert(state.ranks[static_cast<size_t>(worker)].begin(), state.ranks[static_cast<size_t>(worker)].end());
      if (held[static_cast<size_t>(l)]) stand_ins.emplace(tensor.unsafeGetTensorImpl(), tensor);
    };
    for (const auto& p : layer.parameters()) note(p);
    for (const auto& b : layer.buffers()) note(b);
  }
  auto model = std::make_shared<whole_model::WholeModel>();
  for (int l = 0; l < layer_count; ++l) {
    const auto& layer = net->ptr(static_cast<size_t>(l));
    model->register_module(std::to_string(l),
                           held[static_cast<size_t>(l)] ? layer : whole_model::outline(*layer, stand_ins));
  }
  // The pieces, in the model's order (the same on every worker: it has the same ties on each).
  std::map<Impl, std::vector<int>> holders_of;  // by the whole model's tensor
  for (const auto& [original, ranks] : holders) {
    holders_of[stand_ins.at(original).unsafeGetTensorImpl()] = std::vector<int>(ranks.begin(), ranks.end());
  }
  std::set<Impl> seen;
  auto add = [&](const torch::OrderedDict<std::string, at::Tensor>& tensors) {
    for (const auto& item : tensors) {
      if (!item.value().defined() || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
      model->pieces_.emplace_back(
          item.key(), whole_model::piece_of(item.value(), holders_of.at(item.value().unsafeGetTensorImpl()),
                                            state.options.timeout));
    }
  };
  add(model->named_parameters());
  add(model->named_buffers());
  return model;
}

}  // namespace detail

namespace whole_model {
namespace {

torch::nn::Module& whole_or_refuse(const Pipeline::State& state) {
  if (state.global) {
    // Its layers' parameters are global tensors: the global model saves and loads whole.
    throw UsageError("pipeline.module(): the pipeline's layers are global; save and load the global model "
                     "itself (shoal::save(path, *model), docs/checkpoint.md, \"Global models\")");
  }
  return *state.whole;
}

}  // namespace
}  // namespace whole_model

torch::nn::Module& Pipeline::module() {
  return whole_model::whole_or_refuse(*state_);
}

const torch::nn::Module& Pipeline::module() const {
  return whole_model::whole_or_refuse(*state_);
}

}  // namespace shoal::pipeline
