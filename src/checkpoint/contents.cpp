#include "contents.h"

#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <typeinfo>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/lbfgs.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/utils.h>

#include "optimizer_state.h"
#include "core/error_text.h"
#include "shoal/core/error.h"

namespace shoal::checkpoint {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// The payload archive's top-level entries.
constexpr const char* kModuleKey = "module";
constexpr const char* kOptimizerKey = "optimizer";
constexpr const char* kOptimizerTypeKey = "optimizer_type";
// A global model's optimizer state, by parameter name (whole.cpp).
constexpr const char* kOptimizerByNameKey = "optimizer_by_name";
constexpr const char* kLoaderKey = "loader";
constexpr const char* kExtrasKey = "extras";

std::string expected_this_model() { return "; expected a checkpoint of this model"; }

std::string shape_of(at::IntArrayRef shape) {
  std::ostringstream text;
  text << shape;
  return text.str();
}

std::string shape_of(const at::Tensor& tensor) {
  return shape_of(tensor.sizes());
}

std::string type_name(const torch::optim::Optimizer& optimizer) { return c10::demangle(typeid(optimizer).name()); }

// One tensor of the module and the value the file has for it.
struct Copy {
  at::Tensor target;
  at::Tensor value;
};

// Walks the module as Module::save does (own parameters, own buffers, then serializable
// children as nested archives) and pairs each tensor with the file's, checking names and shapes.
// A tensor in `whole` (when not null) is a piece: the file holds the whole value, of which it
// receives its piece.
void plan_module(const std::string& path, InputArchive& archive, torch::nn::Module& module,
                 const std::string& prefix, std::vector<Copy>& copies,
                 const WholeValues* whole = nullptr) {
  std::set<std::string> known;
  auto plan = [&](const char* kind, const torch::OrderedDict<std::string, at::Tensor>& tensors) {
    for (const auto& item : tensors) {
      known.insert(item.key());
      const std::string name = prefix + item.key();
      const at::Tensor& target = item.value();
      at::Tensor stored;
      const bool in_file = archive.try_read(item.key(), stored) && stored.defined();
      if (!target.defined()) {
        // e.g. the bias of a Linear built with bias(false)
        if (in_file) {
          throw UsageError(where(path) + ": " + kind + " '" + name + "' has shape " + shape_of(stored) +
                           " in the file but is undefined in the module" + expected_this_model());
        }
        continue;
      }
      if (!in_file) {
        throw UsageError(where(path) + ": the module has " + kind + " '" + name + "' of shape " + shape_of(target) +
                         ", which the file does not" + expected_this_model());
      }
      const auto piece = whole != nullptr ? whole->find(target.unsafeGetTensorImpl())
                                          : WholeValues::const_iterator();
      const bool is_piece = whole != nullptr && piece != whole->end();
      const at::IntArrayRef shape =
          is_piece ? at::IntArrayRef(piece->second.shape) : target.sizes();
      if (stored.sizes() != shape) {
        throw UsageError(where(path) + ": " + kind + " '" + name + "' has shape " +
                         shape_of(stored) + " in the file but " + shape_of(shape) +
                         " in the module" + expected_this_model());
      }
      if (!is_piece) {
        copies.push_back({target, stored});
      } else if (at::Tensor mine = piece->second.piece(stored); mine.defined()) {
        copies.push_back({piece->second.target.defined() ? piece->second.target : target, mine});
      }
    }
  };
  plan("parameter", module.named_parameters(/*recurse=*/false));
  plan("buffer", module.named_buffers(/*recurse=*/false));
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    known.insert(child.key());
    InputArchive child_archive;
    if (!archive.try_read(child.key(), child_archive)) {
      throw UsageError(where(path) + ": the module has submodule '" + prefix + child.key() +
                       "', which the file does not" + expected_this_model());
    }
    plan_module(path, child_archive, *child.value(), prefix + child.key() + ".", copies, whole);
  }
  for (const auto& key : archive.keys()) {
    if (!known.count(key)) {
      throw UsageError(where(path) + ": the file has '" + prefix + key + "', which the module does not" +
                       expected_this_model());
    }
  }
}

// The module's name for each parameter, for messages about the optimizer's state.
std::map<const void*, std::string> parameter_names(torch::nn::Module& module) {
  std::map<const void*, std::string> names;
  for (const auto& item : module.named_parameters()) names[item.value().unsafeGetTensorImpl()] = item.key();
  return names;
}

int64_t read_int(InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toInt();
}

// Checks what LibTorch's own Optimizer::load checks only by a failed assertion or not at all:
// the number of parameter groups and of their parameters, and that each per-parameter state
// tensor has its parameter's shape (a different parameter order would otherwise put one
// parameter's Adam moments on another). Reads the format of torch/optim/serialize.h.
void check_optimizer_state(const std::string& path, InputArchive& archive, torch::optim::Optimizer& optimizer,
                           torch::nn::Module& module) {
  c10::IValue version;
  InputArchive groups_archive, state_archive;
  if (!archive.try_read("pytorch_version", version) || !archive.try_read("param_groups", groups_archive) ||
      !archive.try_read("state", state_archive)) {
    return;  // an optimizer with a format of its own: its load() checks what it needs
  }
  auto& groups = optimizer.param_groups();
  at::Tensor group_count_tensor;
  const int64_t group_count = groups_archive.try_read("param_groups/size", group_count_tensor)
                                  ? group_count_tensor.item<int64_t>()
                                  : 0;
  if (group_count != static_cast<int64_t>(groups.size())) {
    throw UsageError(where(path) + ": its optimizer has " + std::to_string(group_count) +
                     " parameter groups; this one has " + std::to_string(groups.size()) +
                     "; expected an optimizer built the same way");
  }
  const bool per_parameter_state = dynamic_cast<const torch::optim::LBFGS*>(&optimizer) == nullptr;
  const auto names = parameter_names(module);
  for (size_t g = 0; g < groups.size(); ++g) {
    InputArchive group;
    groups_archive.read("param_groups/" + std::to_string(g), group);
    at::Tensor size;
    group.read("params/size", size);
    const auto& params = groups[g].params();
    if (size.item<int64_t>() != static_cast<int64_t>(params.size())) {
      throw UsageError(where(path) + ": parameter group " + std::to_string(g) + " of its optimizer has " +
                       std::to_string(size.item<int64_t>()) + " parameters; this optimizer's has " +
                       std::to_string(params.size()) + "; expected an optimizer over the same parameters");
    }
    if (!per_parameter_state) continue;
    for (size_t p = 0; p < params.size(); ++p) {
      c10::IValue key;
      group.read("params/" + std::to_string(p), key);
      InputArchive state;
      if (!state_archive.try_read(key.toStringRef(), state)) continue;  // no step taken for it yet
      for (const auto& field : state.keys()) {
        at::Tensor value;
        if (!state.try_read(field, value) || !value.defined() || value.dim() == 0) continue;
        if (value.sizes() != params[p].sizes()) {
          auto name = names.find(params[p].unsafeGetTensorImpl());
          const std::string which = name != names.end() ? "parameter '" + name->second + "'"
                                                        : "parameter " + std::to_string(p) + " of group " +
                                                              std::to_string(g);
          throw UsageError(where(path) + ": the optimizer's '" + field + "' for " + which + " has shape " +
                           shape_of(value) + " in the file but the parameter has shape " + shape_of(params[p]) +
                           "; expected an optimizer over the same parameters in the same order");
        }
      }
    }
  }
}

// Named tensors (extras, a loader's state) go in as values, not keys: keys of an archive can't
// be any string (a '.' nests).
void write_named(OutputArchive& archive, const std::map<std::string, at::Tensor>& named, const std::string& what) {
  archive.write("size", c10::IValue(static_cast<int64_t>(named.size())));
  int64_t i = 0;
  for (const auto& [name, value] : named) {
    if (!value.defined()) {
      throw UsageError("shoal::save: " + what + "[\"" + name + "\"] is an undefined tensor; expected a tensor");
    }
    archive.write("name/" + std::to_string(i), c10::IValue(name));
    archive.write("value/" + std::to_string(i), value.detach());
    ++i;
  }
}

std::map<std::string, at::Tensor> read_named(InputArchive& archive) {
  std::map<std::string, at::Tensor> named;
  const int64_t size = read_int(archive, "size");
  for (int64_t i = 0; i < size; ++i) {
    c10::IValue name;
    archive.read("name/" + std::to_string(i), name);
    at::Tensor value;
    archive.read("value/" + std::to_string(i), value);
    named[name.toStringRef()] = value;
  }
  return named;
}

// A loader's state. Files written before the loader was a checkpoint::Stateful hold the
// sampler's five fields as integers under their own keys; they read as the same names.
StateDict read_loader_state(InputArchive& archive) {
  c10::IValue size;
  if (archive.try_read("size", size)) return read_named(archive);
  StateDict state;
  for (const char* key : {"seed", "shuffle", "dataset_size", "epoch", "cursor"})
    state[key] = at::scalar_tensor(read_int(archive, key), at::kLong);
  return state;
}

}  // namespace

namespace {

// The optimizer's part: LibTorch's Optimizer::save of `optimizer`, or when `write_by_name` is set
// the state by parameter name it writes, as `optimizer_type`.
struct OptimizerPart {
  const torch::optim::Optimizer* optimizer = nullptr;
  std::function<void(OutputArchive&)> write_by_name;
  std::string optimizer_type;
};

std::string serialize(const std::function<void(OutputArchive&)>& write_module,
                      const OptimizerPart& optimizer, const StateDict* loader_state,
                      const CheckpointExtras& extras) {
  OutputArchive archive(std::make_shared<torch::jit::CompilationUnit>());
  OutputArchive module_archive(archive.compilation_unit());
  write_module(module_archive);
  archive.write(kModuleKey, module_archive);
  if (optimizer.optimizer != nullptr) {
    OutputArchive optimizer_archive(archive.compilation_unit());
    optimizer.optimizer->save(optimizer_archive);
    archive.write(kOptimizerKey, optimizer_archive);
    archive.write(kOptimizerTypeKey, c10::IValue(type_name(*optimizer.optimizer)));
  } else if (optimizer.write_by_name) {
    OutputArchive optimizer_archive(archive.compilation_unit());
    optimizer.write_by_name(optimizer_archive);
    archive.write(kOptimizerByNameKey, optimizer_archive);
    archive.write(kOptimizerTypeKey, c10::IValue(optimizer.optimizer_type));
  }
  if (loader_state != nullptr) {
    OutputArchive loader(archive.compilation_unit());
    write_named(loader, *loader_state, "the loader's state_dict()");
    archive.write(kLoaderKey, loader);
  }
  if (!extras.empty()) {
    OutputArchive extras_archive(archive.compilation_unit());
    write_named(extras_archive, extras, "extras");
    archive.write(kExtrasKey, extras_archive);
  }
  std::string payload;
  archive.save_to([&payload](const void* data, size_t size) {
    payload.append(static_cast<const char*>(data), size);
    return size;
  });
  return payload;
}

}  // namespace

std::string serialize_contents(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer,
                               const StateDict* loader_state, const CheckpointExtras& extras) {
  return serialize([&module](OutputArchive& archive) { module.save(archive); }, {optimizer, {}, {}},
                   loader_state, extras);
}

std::string serialize_contents(const std::function<void(OutputArchive&)>& write_module,
                               const std::function<void(OutputArchive&)>& write_optimizer,
                               const std::string& optimizer_type,
                               const StateDict* loader_state,
                               const CheckpointExtras& extras) {
  return serialize(write_module, {nullptr, write_optimizer, optimizer_type}, loader_state, extras);
}

void read_guarded(const std::string& path, const std::function<void()>& read) {
  try {
    read();
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& error) {
    throw UsageError(where(path) + ": its content can't be read (" + one_line(error) +
                     "); expected a file written by shoal::save");
  }
}

PlannedContents read_parts(const std::string& path, std::string_view payload, bool with_extras) {
  PlannedContents planned;
  read_guarded(path, [&] {
    InputArchive archive;
    archive.load_from(payload.data(), payload.size());
    planned.has_optimizer_by_name =
        archive.try_read(kOptimizerByNameKey, planned.optimizer_by_name);
    InputArchive torch_optimizer;
    if (planned.has_optimizer_by_name || archive.try_read(kOptimizerKey, torch_optimizer)) {
      c10::IValue saved_type;
      archive.read(kOptimizerTypeKey, saved_type);
      planned.optimizer_type = saved_type.toStringRef();
    }
    InputArchive loader_archive;
    if (archive.try_read(kLoaderKey, loader_archive))
      planned.loader_state = read_loader_state(loader_archive);
    InputArchive extras_archive;
    if (with_extras && archive.try_read(kExtrasKey, extras_archive))
      planned.extras = read_named(extras_archive);
  });
  return planned;
}

PlannedContents plan_contents(const std::string& path, std::string_view payload,
                              torch::nn::Module& module, const WholeValues& whole,
                              bool with_extras) {
  std::vector<Copy> copies;
  read_guarded(path, [&] {
    InputArchive archive, module_archive;
    archive.load_from(payload.data(), payload.size());
    if (!archive.try_read(kModuleKey, module_archive)) {
      throw UsageError(where(path) + " holds no module; expected a file written by shoal::save");
    }
    plan_module(path, module_archive, module, "", copies, &whole);
  });
  PlannedContents planned = read_parts(path, payload, with_extras);
  planned.copy_module = [copies = std::move(copies)]() mutable {
    torch::NoGradGuard no_grad;
    for (auto& copy : copies) copy.target.copy_(copy.value);
  };
  return planned;
}

void check_loader_state(const std::string& path, const std::optional<StateDict>& saved,
                        const Stateful& loader) {
  if (!saved) {
    throw UsageError(where(path) + " holds no loader state: it was saved without one; expected one saved "
                     "with shoal::save(path, module, optimizer, loader.sampler()), or load it without "
                     "the loader");
  }
  try {
    loader.check_state_dict(*saved);
  } catch (const UsageError& error) {
    throw UsageError(where(path) + ": " + error.what());
  }
}

void restore_contents(const std::string& path, std::string_view payload, torch::nn::Module& module,
                      torch::optim::Optimizer* optimizer, CheckpointExtras* extras, Stateful* loader) {
  // Reading: nothing of the caller's changes here. A payload that passed its checksum but does
  // not parse was written by something other than shoal::save (or a different LibTorch).
  InputArchive archive, module_archive, optimizer_archive;
  std::vector<Copy> copies;
  std::optional<StateMap> state_by_name;
  std::optional<StateDict> loader_state;
  CheckpointExtras saved_extras;
  try {
    archive.load_from(payload.data(), payload.size());
    if (!archive.try_read(kModuleKey, module_archive)) {
      throw UsageError(where(path) + " holds no module; expected a file written by shoal::save");
    }
    plan_module(path, module_archive, module, "", copies);
    InputArchive by_name;
    if (optimizer != nullptr && archive.try_read(kOptimizerByNameKey, by_name)) {
      // Saved by name (a global model's, a pipeline's): this module holds every parameter whole.
      c10::IValue saved_type;
      archive.read(kOptimizerTypeKey, saved_type);
      if (const std::string unsupported = unsupported_optimizer(*optimizer); !unsupported.empty())
        throw UsageError(where(path) + " holds optimizer state by parameter name, and " +
                         unsupported);
      std::set<std::string> names;
      std::map<const c10::TensorImpl*, StateTarget> targets;
      for (const auto& item : module.named_parameters()) {
        names.insert(item.key());
        StateTarget& target = targets[item.value().unsafeGetTensorImpl()];
        target.names.push_back(item.key());
        target.shape = item.value().sizes().vec();
        target.tensor = item.value();
        target.piece = [](const at::Tensor& whole) { return whole.detach().clone(); };
      }
      std::vector<StateTarget> list;
      for (auto& item : targets) list.push_back(std::move(item.second));
      state_by_name =
          plan_state_by_name(path, by_name, saved_type.toStringRef(), *optimizer, list, &names);
    } else if (optimizer != nullptr) {
      if (!archive.try_read(kOptimizerKey, optimizer_archive)) {
        throw UsageError(where(path) + " holds no optimizer state: it was saved without an optimizer; expected "
                         "one saved with shoal::save(path, module, optimizer, ...), or load it with "
                         "shoal::load(path, module)");
      }
      c10::IValue saved_type;
      archive.read(kOptimizerTypeKey, saved_type);
      if (saved_type.toStringRef() != type_name(*optimizer)) {
        throw UsageError(where(path) + ": its optimizer state is " + saved_type.toStringRef() + "'s; this optimizer is " +
                         type_name(*optimizer) + "; expected the same type of optimizer");
      }
      check_optimizer_state(path, optimizer_archive, *optimizer, module);
    }
    InputArchive loader_archive;
    if (archive.try_read(kLoaderKey, loader_archive)) loader_state = read_loader_state(loader_archive);
    if (loader != nullptr) check_loader_state(path, loader_state, *loader);
    InputArchive extras_archive;
    if (extras != nullptr && archive.try_read(kExtrasKey, extras_archive)) saved_extras = read_named(extras_archive);
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& error) {
    throw UsageError(where(path) + ": its content can't be read (" + one_line(error) +
                     "); expected a file written by shoal::save");
  }

  // Changing: the optimizer first, since its load() is the one step that can still fail.
  if (state_by_name) {
    optimizer->state() = std::move(*state_by_name);
  } else if (optimizer != nullptr) {
    // Optimizer::load adds the file's entries but keeps any other; starting empty makes the
    // state exactly the file's. On failure the old entries go back untouched.
    auto before = std::move(optimizer->state());
    optimizer->state().clear();
    try {
      optimizer->load(optimizer_archive);
    } catch (const std::exception& error) {
      optimizer->state() = std::move(before);
      throw UsageError(where(path) + ": its optimizer state does not fit this optimizer (" + one_line(error) +
                       "); expected an optimizer built the same way");
    }
  }
  {
    // Copied in place, so that whoever holds the tensors (optimizer, DataParallel) keeps them.
    torch::NoGradGuard no_grad;
    for (auto& copy : copies) copy.target.copy_(copy.value);
  }
  if (extras != nullptr) *extras = std::move(saved_extras);
  if (loader != nullptr) loader->load_state_dict(*loader_state);
}

}  // namespace shoal::checkpoint
