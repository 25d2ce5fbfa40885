#include "optimizer_state.h"

#include <map>
#include <sstream>
#include <typeinfo>

#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "contents.h"
#include "shoal/checkpoint/param_state.h"
#include "shoal/core/error.h"

namespace shoal::checkpoint {
namespace {

using torch::optim::OptimizerParamState;

// Note [Optimizer state by name]
// LibTorch's Optimizer::save keys the state by each parameter's position in the param groups,
// which changes with the plan (a pipeline worker's optimizer holds only its stages' parameters,
// a global model's optimizer only pieces). Saved by parameter name instead, each tensor as the
// whole value, with the step: "size", then for entry i "name/i", "step/i" and "<field>/i" for
// each field the state has ("exp_avg", ...). Names are values, not keys: a key with a '.' would
// nest.

template <typename State, typename Refs>
StateKind state_kind(std::vector<std::string> fields, Refs refs) {
  return {std::move(fields), [] { return std::make_unique<State>(); },
          [refs](OptimizerParamState& state) { return refs(static_cast<State&>(state)); }};
}

std::string shape_text(at::IntArrayRef shape) {
  std::ostringstream text;
  text << shape;
  return text.str();
}

}  // namespace

const StateKind* state_kind_of(const torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;  // NOLINT: the five optimizers' names read best unqualified
  static const StateKind sgd = state_kind<SGDParamState>({"momentum_buffer"}, [](SGDParamState& s) {
    return StateRefs{nullptr, {&s.momentum_buffer()}};
  });
  static const StateKind adam = state_kind<AdamParamState>(
      {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, [](AdamParamState& s) {
        return StateRefs{&s.step(), {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()}};
      });
  static const StateKind adamw = state_kind<AdamWParamState>(
      {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, [](AdamWParamState& s) {
        return StateRefs{&s.step(), {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()}};
      });
  static const StateKind adagrad = state_kind<AdagradParamState>({"sum"}, [](AdagradParamState& s) {
    return StateRefs{&s.step(), {&s.sum()}};
  });
  static const StateKind rmsprop = state_kind<RMSpropParamState>(
      {"square_avg", "momentum_buffer", "grad_avg"}, [](RMSpropParamState& s) {
        return StateRefs{&s.step(), {&s.square_avg(), &s.momentum_buffer(), &s.grad_avg()}};
      });
  if (dynamic_cast<const SGD*>(&optimizer)) return &sgd;
  if (dynamic_cast<const Adam*>(&optimizer)) return &adam;
  if (dynamic_cast<const AdamW*>(&optimizer)) return &adamw;
  if (dynamic_cast<const Adagrad*>(&optimizer)) return &adagrad;
  if (dynamic_cast<const RMSprop*>(&optimizer)) return &rmsprop;
  return nullptr;
}

std::string unsupported_optimizer(const torch::optim::Optimizer& optimizer) {
  if (state_kind_of(optimizer) != nullptr) return "";
  return "the optimizer is " + optimizer_type(optimizer) +
         "; expected torch::optim::SGD, Adam, AdamW, Adagrad or RMSprop, whose state shoal saves "
         "by parameter name";
}

std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

std::string state_key(const at::Tensor& parameter) {
  return c10::guts::to_string(parameter.unsafeGetTensorImpl());
}

OptimizerParamState* state_of(torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
  auto entry = optimizer.state().find(state_key(parameter));
  return entry == optimizer.state().end() ? nullptr : entry->second.get();
}

void write_state_by_name(torch::serialize::OutputArchive& archive,
                         const std::vector<NamedState>& states) {
  archive.write("size", c10::IValue(static_cast<int64_t>(states.size())));
  for (size_t i = 0; i < states.size(); ++i) {
    const std::string index = std::to_string(i);
    archive.write("name/" + index, c10::IValue(states[i].name));
    archive.write("step/" + index, c10::IValue(states[i].step));
    for (const auto& [field, value] : states[i].fields) archive.write(field + "/" + index, value);
  }
}

void require_state_by_name(const std::string& path, bool has_by_name,
                           const std::string& saved_type) {
  if (has_by_name) return;
  if (!saved_type.empty()) {
    throw UsageError(where(path) +
                     " holds optimizer state by parameter order (saved from a torch::nn::Module); "
                     "expected it by name, as saved from a global model or a pipeline, or load the "
                     "module alone");
  }
  throw UsageError(where(path) +
                   " holds no optimizer state: it was saved without an optimizer; expected one "
                   "saved with its optimizer, or load the module alone");
}

StateMap plan_state_by_name(const std::string& path, torch::serialize::InputArchive& archive,
                            const std::string& saved_type, const torch::optim::Optimizer& optimizer,
                            const std::vector<StateTarget>& targets,
                            const std::set<std::string>* all_names) {
  if (saved_type != optimizer_type(optimizer)) {
    throw UsageError(where(path) + ": its optimizer state is " + saved_type +
                     "'s; this optimizer is " + optimizer_type(optimizer) +
                     "; expected the same type of optimizer");
  }
  const StateKind& kind = *state_kind_of(optimizer);
  std::map<std::string, const StateTarget*> by_name;
  for (const auto& target : targets) {
    for (const auto& name : target.names) by_name.emplace(name, &target);
  }
  std::set<const c10::TensorImpl*> held;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) held.insert(p.unsafeGetTensorImpl());
  }
  StateMap state;
  read_guarded(path, [&] {
    c10::IValue size;
    archive.read("size", size);
    for (int64_t i = 0; i < size.toInt(); ++i) {
      const std::string index = std::to_string(i);
      c10::IValue name, step;
      archive.read("name/" + index, name);
      archive.read("step/" + index, step);
      auto found = by_name.find(name.toStringRef());
      if (found == by_name.end()) {
        if (all_names == nullptr || all_names->count(name.toStringRef())) continue;
        throw UsageError(where(path) + ": its optimizer has state for '" + name.toStringRef() +
                         "', which is not a parameter of the model; expected a checkpoint of this "
                         "model");
      }
      const StateTarget& target = *found->second;
      const at::Tensor& tensor = target.tensor;
      // A tied weight's entry is saved once; another of its names is not a second entry.
      if (state.count(state_key(tensor))) continue;
      auto made = kind.make();
      StateRefs refs = kind.refs(*made);
      if (refs.step != nullptr) *refs.step = step.toInt();
      for (size_t f = 0; f < kind.fields.size(); ++f) {
        at::Tensor value;
        if (!archive.try_read(kind.fields[f] + "/" + index, value)) continue;
        if (value.sizes() != at::IntArrayRef(target.shape)) {
          throw UsageError(where(path) + ": the optimizer's '" + kind.fields[f] +
                           "' for parameter '" + name.toStringRef() + "' has shape " +
                           shape_text(value.sizes()) + " in the file but the parameter has shape " +
                           shape_text(target.shape) + "; expected a checkpoint of this model");
        }
        *refs.fields[f] = target.piece(value);
      }
      if (held.count(tensor.unsafeGetTensorImpl())) state[state_key(tensor)] = std::move(made);
    }
  });
  return state;
}

namespace {

const StateKind& kind_or_refuse(const torch::optim::Optimizer& optimizer) {
  const StateKind* kind = state_kind_of(optimizer);
  if (kind == nullptr) throw UsageError(unsupported_optimizer(optimizer));
  return *kind;
}

}  // namespace

std::vector<std::string> state_fields(const torch::optim::Optimizer& optimizer) {
  return kind_or_refuse(optimizer).fields;
}

std::optional<ParamState> param_state(const torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
  const StateKind& kind = kind_or_refuse(optimizer);
  auto entry = optimizer.state().find(state_key(parameter));
  if (entry == optimizer.state().end()) return std::nullopt;
  StateRefs refs = kind.refs(*entry->second);
  ParamState state;
  if (refs.step != nullptr) state.step = *refs.step;
  for (size_t f = 0; f < kind.fields.size(); ++f) {
    if (refs.fields[f]->defined()) state.fields[kind.fields[f]] = *refs.fields[f];
  }
  return state;
}

void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter, const ParamState& state) {
  const StateKind& kind = kind_or_refuse(optimizer);
  const std::string type = optimizer_type(optimizer);
  bool held = false;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) held = held || p.unsafeGetTensorImpl() == parameter.unsafeGetTensorImpl();
  }
  if (!held) throw UsageError("set_param_state: the tensor is not a parameter of the " + type + "; expected one of its parameters");
  auto made = kind.make();
  StateRefs refs = kind.refs(*made);
  if ((refs.step != nullptr) != state.step.has_value()) {
    throw UsageError("set_param_state: " + type + (refs.step ? " counts steps, and the state has no step" : " counts no steps, and the state has one") +
                     "; expected " + (refs.step ? "a step" : "none"));
  }
  if (refs.step != nullptr) *refs.step = *state.step;
  for (const auto& [field, value] : state.fields) {
    size_t f = 0;
    while (f < kind.fields.size() && kind.fields[f] != field) ++f;
    if (f == kind.fields.size()) {
      std::string known;
      for (const auto& name : kind.fields) known += (known.empty() ? "" : ", ") + name;
      throw UsageError("set_param_state: " + type + " has no state field '" + field + "'; expected one of " + known);
    }
    if (value.sizes() != parameter.sizes()) {
      throw UsageError("set_param_state: the field '" + field + "' has shape " + shape_text(value.sizes()) +
                       " and its parameter " + shape_text(parameter.sizes()) + "; expected the parameter's shape");
    }
    *refs.fields[f] = value;
  }
  optimizer.state()[state_key(parameter)] = std::move(made);
}

}  // namespace shoal::checkpoint
