// Checkpoints of models whose tensors are pieces of whole values (checkpoint::Savable: a global
// model's layers, wherever they sit in the module tree; a pipeline's whole model): each whole
// value gathered from its pieces on save, cut into this worker's piece again on load, so that a
// file crosses plans. See docs/checkpoint.md, "Global models" and "Pipelines".
#include "whole.h"

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/variable.h>
#include <torch/serialize/output-archive.h>

#include "collective.h"
#include "contents.h"
#include "file.h"
#include "optimizer_state.h"
#include "shoal/checkpoint/checkpoint.h"
#include "shoal/checkpoint/savable.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal::checkpoint {
namespace {

using torch::serialize::OutputArchive;

// One piece of the model, under its first name, and all its names as a parameter (a tied weight
// has several; a buffer none).
struct Parameter {
  std::string name;
  Piece piece;
  std::vector<std::string> names;
  const c10::TensorImpl* impl() const { return piece.local.unsafeGetTensorImpl(); }
  // What this worker holds of the value, the optimizer's key: the slice when there is one.
  const at::Tensor& held() const { return piece.slice.defined() ? piece.slice : piece.local; }
};

// What the model is called in errors: its first Savable's name for it.
std::string model_name_of(const torch::nn::Module& module) {
  for (const auto& item : module.named_modules()) {
    if (const auto* savable = dynamic_cast<const Savable*>(item.value().get())) return savable->model_name();
  }
  return "a model";
}

// The group of a save or load of whole values: the world.
comm::Group world_group(const std::optional<comm::Group>& group, const std::string& path,
                        const std::string& operation) {
  comm::Group chosen = checkpoint_group(group, path, operation.c_str());
  if (group && (!is_initialized() || chosen.members() != world().members())) {
    throw UsageError(operation +
                     ": options.group is not the world; expected it empty (every worker of the job "
                     "holds a part of the model)");
  }
  return chosen;
}

// What this worker can tell is wrong with the model and optimizer alone; empty when nothing is.
std::string check_model(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer,
                        const std::vector<Parameter>& parameters, const std::string& operation) {
  const std::string prefix = operation + ": ";
  std::set<const c10::TensorImpl*> pieces, held;
  for (const auto& parameter : parameters) {
    pieces.insert(parameter.impl());
    held.insert(parameter.held().unsafeGetTensorImpl());
    if (!parameter.piece.refusal.empty())
      return prefix + "parameter '" + parameter.name + "' " + parameter.piece.refusal;
  }
  for (const auto& item : module.named_parameters()) {
    if (!pieces.count(item.value().unsafeGetTensorImpl())) {
      return prefix + "parameter '" + item.key() +
             "' is a plain tensor; expected every parameter registered with "
             "register_global_parameter, so that its placement says how to gather it";
    }
  }
  if (optimizer == nullptr) return "";
  if (const std::string unsupported = unsupported_optimizer(*optimizer); !unsupported.empty())
    return prefix + unsupported;
  for (const auto& group : optimizer->param_groups()) {
    for (const auto& p : group.params()) {
      if (!held.count(p.unsafeGetTensorImpl())) {
        std::ostringstream shape;
        shape << p.sizes();
        return prefix + "the optimizer holds a tensor of shape " + shape.str() +
               " that is not a parameter of the model; expected an optimizer over the model's "
               "parameters";
      }
    }
  }
  return "";
}

std::set<const c10::TensorImpl*> held_by(const torch::optim::Optimizer& optimizer) {
  std::set<const c10::TensorImpl*> held;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) held.insert(p.unsafeGetTensorImpl());
  }
  return held;
}

// Gathers the optimizer's state of every parameter from the workers that hold its pieces (see
// Note [Optimizer state by name]). Collective among all workers.
std::vector<NamedState> gather_state(comm::Group& group, torch::optim::Optimizer& optimizer,
                                     const std::vector<Parameter>& parameters, const std::string& operation,
                                     Duration timeout) {
  const StateKind& kind = *state_kind_of(optimizer);
  const auto held = held_by(optimizer);
  const auto n = static_cast<int64_t>(parameters.size());
  const auto k = static_cast<int64_t>(kind.fields.size());
  // Per parameter: how many of its workers have state, how many have each field, and the step
  // of its first worker.
  at::Tensor table = at::zeros({n, k + 2}, at::kLong);
  auto counts = table.accessor<int64_t, 2>();
  std::vector<StateRefs> refs(parameters.size());
  for (int64_t i = 0; i < n; ++i) {
    const auto& parameter = parameters[static_cast<size_t>(i)];
    if (!parameter.piece.held_here || !held.count(parameter.held().unsafeGetTensorImpl())) continue;
    auto entry = optimizer.state().find(state_key(parameter.held()));
    if (entry == optimizer.state().end()) continue;
    refs[static_cast<size_t>(i)] = kind.refs(*entry->second);
    const StateRefs& mine = refs[static_cast<size_t>(i)];
    counts[i][0] = 1;
    for (int64_t f = 0; f < k; ++f)
      counts[i][f + 1] = mine.fields[static_cast<size_t>(f)]->defined();
    if (mine.step != nullptr && parameter.piece.first_holder) counts[i][k + 1] = *mine.step;
  }
  comm::AllReduceOptions sum;
  sum.timeout = timeout;
  group.all_reduce(table, sum);
  counts = table.accessor<int64_t, 2>();

  std::vector<NamedState> saved;
  for (int64_t i = 0; i < n; ++i) {
    const auto& parameter = parameters[static_cast<size_t>(i)];
    const int64_t holders = counts[i][0], members = parameter.piece.holders;
    if (holders == 0) continue;  // no step taken for it yet
    auto uneven = [&](const std::string& what, int64_t count) {
      return UsageError(operation + ": the optimizer has " + what +
                        " of parameter '" + parameter.name + "' on " + std::to_string(count) +
                        " of the " + std::to_string(members) +
                        " workers that hold it; expected every worker that holds a piece of a "
                        "parameter to optimize it, with the same options");
    };
    if (holders != members) throw uneven("state", holders);
    NamedState state{parameter.name, counts[i][k + 1], {}};
    for (int64_t f = 0; f < k; ++f) {
      const int64_t defined = counts[i][f + 1];
      if (defined == 0) continue;
      const std::string& field = kind.fields[static_cast<size_t>(f)];
      if (defined != holders) throw uneven("'" + field + "'", defined);
      const StateRefs& mine = refs[static_cast<size_t>(i)];
      const at::Tensor local =
          parameter.piece.held_here ? *mine.fields[static_cast<size_t>(f)] : at::Tensor();
      state.fields.emplace_back(field, parameter.piece.gather(local));
    }
    saved.push_back(std::move(state));
  }
  return saved;
}

// The module's archive as Module::save writes it, with each piece's whole value.
void write_whole(const torch::nn::Module& module, OutputArchive& archive,
                 const std::map<const c10::TensorImpl*, at::Tensor>& whole) {
  auto value_of = [&whole](const at::Tensor& tensor) {
    auto value = whole.find(tensor.unsafeGetTensorImpl());
    return value != whole.end() ? value->second : tensor;
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false))
    archive.write(item.key(), value_of(item.value()));
  for (const auto& item : module.named_buffers(/*recurse=*/false))
    archive.write(item.key(), value_of(item.value()), /*is_buffer=*/true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    OutputArchive child_archive(archive.compilation_unit());
    write_whole(*child.value(), child_archive, whole);
    archive.write(child.key(), child_archive);
  }
}

}  // namespace

std::vector<std::pair<std::string, Piece>> pieces_of(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, Piece>> found;
  std::set<const c10::TensorImpl*> seen;
  // Parameters marked by what holds them in pieces (PieceOf), under their first name.
  for (const auto& item : module.named_parameters()) {
    for (const auto& hook : torch::autograd::impl::hooks(item.value())) {
      const auto* marker = dynamic_cast<const PieceOf*>(hook.get());
      if (marker == nullptr) continue;
      Piece piece = marker->describe();
      if (piece.local.defined() && seen.insert(piece.local.unsafeGetTensorImpl()).second)
        found.emplace_back(item.key(), std::move(piece));
    }
  }
  for (const auto& item : module.named_modules()) {
    const auto* savable = dynamic_cast<const Savable*>(item.value().get());
    if (savable == nullptr) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (auto& [name, piece] : savable->pieces()) {
      if (seen.insert(piece.local.unsafeGetTensorImpl()).second)
        found.emplace_back(prefix + name, std::move(piece));
    }
  }
  return found;
}

namespace {

std::vector<Parameter> parameters_of(const torch::nn::Module& module) {
  std::map<const c10::TensorImpl*, std::vector<std::string>> names;
  for (const auto& item : module.named_parameters()) names[item.value().unsafeGetTensorImpl()].push_back(item.key());
  std::vector<Parameter> parameters;
  for (auto& [name, piece] : pieces_of(module)) {
    auto found = names.find(piece.local.unsafeGetTensorImpl());
    parameters.push_back({name, std::move(piece), found != names.end() ? found->second : std::vector<std::string>()});
  }
  return parameters;
}

}  // namespace

namespace {

// Gathers every whole value and the optimizer's state by name (a collective of `group`, the
// world); what it returns makes the payload, on the first worker.
std::function<std::string()> gather_whole(comm::Group& group, const torch::nn::Module& module,
                                          torch::optim::Optimizer* optimizer,
                                          const StateDict* loader_state,
                                          const CheckpointExtras& extras,
                                          const std::string& operation, Duration timeout) {
  const auto parameters = parameters_of(module);
  agree(group, check_model(module, optimizer, parameters, operation), timeout);
  std::map<const c10::TensorImpl*, at::Tensor> whole;  // on the first worker
  for (const auto& parameter : parameters) {
    at::Tensor value = parameter.piece.gather(parameter.held());
    // As Module::save writes it: the flag is part of the file.
    if (value.defined())
      whole[parameter.impl()] = value.set_requires_grad(parameter.piece.local.requires_grad());
  }
  std::vector<NamedState> state;
  if (optimizer != nullptr) state = gather_state(group, *optimizer, parameters, operation, timeout);
  return [&module, optimizer, loader_state, &extras, whole = std::move(whole),
          state = std::move(state)] {
    auto write_module = [&](OutputArchive& archive) { write_whole(module, archive, whole); };
    if (optimizer == nullptr) return serialize_contents(write_module, {}, "", loader_state, extras);
    return serialize_contents(
        write_module, [&](OutputArchive& archive) { write_state_by_name(archive, state); },
        optimizer_type(*optimizer), loader_state, extras);
  };
}

}  // namespace

void save_whole(const std::string& path, const torch::nn::Module& module,
                torch::optim::Optimizer* optimizer, const StateDict* loader_state,
                const SaveOptions& options) {
  const std::string operation = "shoal::save of " + model_name_of(module);
  comm::Group group = world_group(options.group, path, operation);
  save_payload(path, group,
               gather_whole(group, module, optimizer, loader_state, options.extras, operation,
                            options.timeout),
               options.timeout);
}

std::string encode_whole_payload(const torch::nn::Module& module,
                                 torch::optim::Optimizer& optimizer, const Stateful* loader,
                                 const CheckpointExtras& extras) {
  comm::Group group = world();
  const std::optional<StateDict> loader_state =
      loader != nullptr ? std::optional(loader->state_dict()) : std::nullopt;
  auto make = gather_whole(group, module, &optimizer, loader_state ? &*loader_state : nullptr,
                           extras, "a durable commit of " + model_name_of(module), kUnsetTimeout);
  return group.rank() == 0 ? make() : std::string();
}

namespace {

// The optimizer's new state: the file's, for the pieces this worker's optimizer holds. Checks
// everything first; UsageError naming the first mismatch.
StateMap plan_state(const std::string& path, PlannedContents& planned,
                    const torch::optim::Optimizer& optimizer, const std::vector<Parameter>& parameters) {
  require_state_by_name(path, planned.has_optimizer_by_name, planned.optimizer_type);
  std::set<std::string> names;
  std::vector<StateTarget> targets;
  for (const auto& parameter : parameters) {
    if (parameter.names.empty()) continue;  // a buffer
    names.insert(parameter.names.begin(), parameter.names.end());
    if (!parameter.piece.held_here) continue;  // a placeholder has no state to take
    targets.push_back(
        {parameter.names, parameter.piece.shape, parameter.held(), parameter.piece.cut});
  }
  return plan_state_by_name(path, planned.optimizer_by_name, planned.optimizer_type, optimizer, targets,
                            &names);
}

}  // namespace

void load_whole(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                Stateful* loader, const LoadOptions& options) {
  const std::string operation = "shoal::load of " + model_name_of(module);
  comm::Group group = world_group(options.group, path, operation);
  const auto parameters = parameters_of(module);
  agree(group, check_model(module, optimizer, parameters, operation), options.timeout);
  const std::string payload = read_payload(path, group, options.timeout);
  WholeValues whole;
  for (const auto& parameter : parameters)
    whole[parameter.impl()] = {parameter.piece.shape, parameter.piece.cut, parameter.piece.slice};
  // Every worker checks the file against its model and optimizer before any worker changes
  // anything.
  std::string error;
  PlannedContents planned;
  StateMap state;
  try {
    planned = plan_contents(path, payload, module, whole, options.extras != nullptr);
    if (optimizer != nullptr) state = plan_state(path, planned, *optimizer, parameters);
    if (loader != nullptr) check_loader_state(path, planned.loader_state, *loader);
  } catch (const UsageError& e) {
    error = e.what();
  }
  agree(group, error, options.timeout);
  // Exactly the file's state: a parameter without an entry starts afresh, as before a first step.
  // The state of placeholders (an optimizer over all of parameters() holds them) stays: it is
  // empty, and Adagrad expects an entry for every parameter it holds.
  if (optimizer != nullptr) {
    for (const auto& parameter : parameters) {
      if (parameter.piece.held_here) continue;
      auto entry = optimizer->state().find(state_key(parameter.held()));
      if (entry != optimizer->state().end()) state[entry->first] = std::move(entry->second);
    }
    optimizer->state() = std::move(state);
  }
  planned.copy_module();
  for (const auto& parameter : parameters) {
    if (parameter.piece.loaded) parameter.piece.loaded();
  }
  if (options.extras != nullptr) *options.extras = std::move(planned.extras);
  if (loader != nullptr) loader->load_state_dict(*planned.loader_state);
}

}  // namespace shoal::checkpoint
