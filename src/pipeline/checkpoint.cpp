// A pipeline's checkpoint: the whole Sequential's file, gathered from the stages' workers on save
// and taken apart by each worker on load. See docs/checkpoint.md, "Pipelines".
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize/output-archive.h>

#include "../checkpoint/collective.h"
#include "../checkpoint/contents.h"
#include "../checkpoint/optimizer_state.h"
#include "pipeline_state.h"
#include "shoal/checkpoint/checkpoint.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal {
namespace pipeline {
struct Access {
  static Pipeline::State& state(const Pipeline& pipe) { return *pipe.state_; }
};
}  // namespace pipeline

namespace {

using torch::serialize::OutputArchive;

// Note [Pipeline checkpoint pieces]
// Each worker sends the tensors of the layers it holds as a flat list in the order Module::save
// walks them (a module's parameters, its buffers, then each child), each named by its path in the
// whole Sequential and marked 'p' (parameter; 'g' when it requires grad), 'b' (buffer) or 'm' (a
// child module, so that one without tensors still appears). The first worker rebuilds the nested
// archive of the whole model from the pieces, which is what Module::save of the Sequential writes.
// With an optimizer, each parameter's state follows as 't' (its step, a scalar) and 's:<field>'
// entries under the parameter's name (see Note [Optimizer state by name], src/checkpoint).
struct Piece {
  std::vector<std::string> kinds, names;
  std::vector<at::Tensor> tensors;  // undefined for 'm'
};

void flatten(const torch::nn::Module& module, const std::string& prefix, Piece& piece) {
  // 'm' entries carry an empty tensor: a pickled tensor list holds no None.
  auto add = [&](const char* kind, const std::string& name, const at::Tensor& tensor) {
    piece.kinds.emplace_back(kind);
    piece.names.push_back(name);
    piece.tensors.push_back(tensor.defined() ? tensor.detach() : at::empty({0}));
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    // 'g': a parameter that requires grad; the file records the flag as Module::save writes it.
    add(item.value().requires_grad() ? "g" : "p", prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false))
    add("b", prefix + item.key(), item.value());
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    add("m", prefix + child.key(), at::Tensor());
    flatten(*child.value(), prefix + child.key() + ".", piece);
  }
}

std::string encode(const Piece& piece) {
  c10::List<std::string> kinds(piece.kinds), names(piece.names);
  c10::List<at::Tensor> tensors;
  for (const auto& t : piece.tensors) tensors.push_back(t.defined() ? t : at::empty({0}));
  auto bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create({kinds, names, tensors}));
  return std::string(bytes.begin(), bytes.end());
}

void decode(const std::string& bytes, Piece& piece) {
  auto tuple = torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toTuple();
  for (const auto& k : tuple->elements()[0].toListRef()) piece.kinds.push_back(k.toStringRef());
  for (const auto& n : tuple->elements()[1].toListRef()) piece.names.push_back(n.toStringRef());
  for (const auto& t : tuple->elements()[2].toListRef()) piece.tensors.push_back(t.toTensor());
}

// A module of the archive being rebuilt: its tensors, then its children, in first-seen order.
struct Node {
  std::vector<std::pair<std::string, std::pair<at::Tensor, bool>>> tensors;
  std::vector<std::pair<std::string, std::unique_ptr<Node>>> children;
  Node& child(const std::string& key) {
    for (auto& [name, node] : children) {
      if (name == key) return *node;
    }
    children.emplace_back(key, std::make_unique<Node>());
    return *children.back().second;
  }
  void write(OutputArchive& archive) const {
    for (const auto& [key, value] : tensors) {
      if (value.first.defined()) archive.write(key, value.first, /*is_buffer=*/value.second);
    }
    for (const auto& [key, node] : children) {
      OutputArchive child_archive(archive.compilation_unit());
      node->write(child_archive);
      archive.write(key, child_archive);
    }
  }
};

void insert(Node& root, const std::string& kind, const std::string& name,
            const at::Tensor& tensor) {
  Node* node = &root;
  size_t start = 0;
  for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
    node = &node->child(name.substr(start, dot - start));
    start = dot + 1;
  }
  const std::string last = name.substr(start);
  if (kind == "m") {
    node->child(last);
  } else {
    at::Tensor value = tensor;
    if (kind == "g") value.set_requires_grad(true);
    node->tensors.push_back({last, {value, kind == "b"}});
  }
}

void check_world(const std::optional<comm::Group>& group, const char* operation) {
  if (group) {
    throw UsageError(std::string(operation) +
                     " of a pipeline: options.group is set; expected it empty (a pipeline's "
                     "workers are the world)");
  }
  if (!is_initialized())
    throw UsageError(std::string(operation) + " of a pipeline: call shoal::init() first");
}

// Sends `bytes` from `root` to every member (a length, then the bytes).
void broadcast_bytes(comm::Group& group, std::string& bytes, int root, Duration timeout) {
  comm::BroadcastOptions options;
  options.root = root;
  options.timeout = timeout;
  auto size = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
  group.broadcast(size, options);
  if (group.rank() != root) bytes.assign(static_cast<size_t>(size.item<int64_t>()), '\0');
  if (bytes.empty()) return;
  auto view = at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte);
  group.broadcast(view, options);
}

int first_layer(const pipeline::Pipeline::State& state, int stage) {
  int first = 0;
  for (int s = 0; s < stage; ++s) first += state.split[s];
  return first;
}

std::string shape_text(const at::Tensor& tensor) {
  std::ostringstream text;
  text << tensor.sizes();
  return text.str();
}

int layer_count(const pipeline::Pipeline::State& state) {
  int count = 0;
  for (int layers : state.split) count += layers;
  return count;
}

// This worker's layers with their indices in the whole Sequential.
std::map<int, torch::nn::Module*> held_layers(const pipeline::Pipeline::State& state) {
  std::map<int, torch::nn::Module*> layers;
  for (int s = 0; s < state.stages(); ++s) {
    int index = first_layer(state, s);
    for (const auto& layer : state.layers[s]) layers[index++] = layer.ptr().get();
  }
  return layers;
}

// The held layers' parameters, each with its names in the whole Sequential (a weight tied
// between two layers this worker holds has two).
std::vector<checkpoint::StateTarget> held_parameters(const pipeline::Pipeline::State& state) {
  std::map<const c10::TensorImpl*, checkpoint::StateTarget> by_tensor;
  std::vector<const c10::TensorImpl*> order;
  for (const auto& [index, layer] : held_layers(state)) {
    for (const auto& item : layer->named_parameters()) {
      const auto* impl = item.value().unsafeGetTensorImpl();
      if (!by_tensor.count(impl)) order.push_back(impl);
      auto& target = by_tensor[impl];
      target.names.push_back(std::to_string(index) + "." + item.key());
      target.shape = item.value().sizes().vec();
      target.tensor = item.value();
      target.piece = [](const at::Tensor& whole) { return whole.detach().clone(); };
    }
  }
  std::vector<checkpoint::StateTarget> targets;
  for (const auto* impl : order) targets.push_back(std::move(by_tensor[impl]));
  return targets;
}

// What this worker can tell is wrong with the optimizer alone; empty when nothing is.
std::string check_optimizer(const pipeline::Pipeline::State& state,
                            const torch::optim::Optimizer& optimizer, const char* operation) {
  const std::string prefix = std::string(operation) + " of a pipeline: ";
  if (const std::string unsupported = checkpoint::unsupported_optimizer(optimizer);
      !unsupported.empty())
    return prefix + unsupported;
  std::set<const c10::TensorImpl*> held;
  for (const auto& target : held_parameters(state))
    held.insert(target.tensor.unsafeGetTensorImpl());
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (!held.count(p.unsafeGetTensorImpl())) {
        return prefix + "the optimizer holds a tensor of shape " + shape_text(p) +
               " that is not a parameter of this worker's stages; expected an optimizer over "
               "pipe.parameters()";
      }
    }
  }
  return "";
}

// This worker's optimizer state of its layers' parameters, as Piece entries.
void add_state(const pipeline::Pipeline::State& state, torch::optim::Optimizer& optimizer,
               Piece& piece) {
  const checkpoint::StateKind& kind = *checkpoint::state_kind_of(optimizer);
  for (const auto& target : held_parameters(state)) {
    auto* saved = checkpoint::state_of(optimizer, target.tensor);
    if (saved == nullptr) continue;
    const checkpoint::StateRefs refs = kind.refs(*saved);
    for (const auto& name : target.names) {
      piece.kinds.emplace_back("t");
      piece.names.push_back(name);
      piece.tensors.push_back(at::tensor(refs.step != nullptr ? *refs.step : 0, at::kLong));
      for (size_t f = 0; f < kind.fields.size(); ++f) {
        if (!refs.fields[f]->defined()) continue;
        piece.kinds.push_back("s:" + kind.fields[f]);
        piece.names.push_back(name);
        piece.tensors.push_back(refs.fields[f]->detach());
      }
    }
  }
}

void save_pipeline(const std::string& path, const pipeline::Pipeline& pipe,
                   torch::optim::Optimizer* optimizer, const SaveOptions& options) {
  check_world(options.group, "shoal::save");
  if (pipe.is_global()) {
    // Its layers' parameters are global tensors: the global model saves and loads whole.
    throw UsageError("shoal::save(path, pipeline): the pipeline's layers are global; save the global "
                     "model itself (shoal::save(path, model), docs/checkpoint.md, \"Global models\")");
  }
  comm::Group group = checkpoint::checkpoint_group(std::nullopt, path, "shoal::save");
  const auto& state = pipeline::Access::state(pipe);
  if (optimizer != nullptr)
    checkpoint::agree(group, check_optimizer(state, *optimizer, "shoal::save"), options.timeout);
  // See Note [Pipeline checkpoint pieces]. A replicated stage is sent by its first replica.
  Piece mine;
  std::vector<int64_t> held;
  if (state.me >= 0 && state.replica == 0) {
    for (int s = 0; s < state.stages(); ++s) {
      int index = first_layer(state, s);
      for (const auto& layer : state.layers[s]) {
        held.push_back(index);
        flatten(*layer.ptr(), std::to_string(index) + ".", mine);
        ++index;
      }
    }
    if (optimizer != nullptr) add_state(state, *optimizer, mine);
  }
  // Layer markers come first, so that a layer without tensors is in the file too.
  Piece piece;
  for (int64_t index : held) {
    piece.kinds.emplace_back("m");
    piece.names.push_back(std::to_string(index));
    piece.tensors.push_back(at::empty({0}));
  }
  piece.kinds.insert(piece.kinds.end(), mine.kinds.begin(), mine.kinds.end());
  piece.names.insert(piece.names.end(), mine.names.begin(), mine.names.end());
  piece.tensors.insert(piece.tensors.end(), mine.tensors.begin(), mine.tensors.end());

  const Duration timeout = options.timeout;
  std::map<int, Piece> by_layer;  // on the first worker: each layer's tensors
  std::map<std::string, checkpoint::NamedState> states;  // and each parameter's state, by name
  for (int r = 0; r < group.size(); ++r) {
    std::string bytes = group.rank() == r ? encode(piece) : std::string();
    broadcast_bytes(group, bytes, r, timeout);
    if (group.rank() != 0) continue;
    Piece received;
    decode(bytes, received);
    std::set<std::string> named_here;  // a name's state comes from one worker
    for (size_t i = 0; i < received.names.size(); ++i) {
      const std::string& name = received.names[i];
      const std::string& kind = received.kinds[i];
      if (kind == "t") {
        if (states.count(name)) continue;
        named_here.insert(name);
        states[name] = {name, received.tensors[i].item<int64_t>(), {}};
        continue;
      }
      if (kind.rfind("s:", 0) == 0) {
        if (named_here.count(name))
          states[name].fields.emplace_back(kind.substr(2), received.tensors[i]);
        continue;
      }
      const int layer = std::stoi(name.substr(0, name.find('.')));
      auto& target = by_layer[layer];
      target.kinds.push_back(kind);
      target.names.push_back(name);
      target.tensors.push_back(received.tensors[i]);
    }
  }
  checkpoint::save_payload(
      path, group,
      [&] {
        Node root;
        for (const auto& [layer, entries] : by_layer) {
          for (size_t i = 0; i < entries.names.size(); ++i) {
            insert(root, entries.kinds[i], entries.names[i], entries.tensors[i]);
          }
        }
        auto write_module = [&root](OutputArchive& archive) { root.write(archive); };
        if (optimizer == nullptr)
          return checkpoint::serialize_contents(write_module, options.extras);
        std::vector<checkpoint::NamedState> list;
        for (auto& item : states) list.push_back(std::move(item.second));
        return checkpoint::serialize_contents(
            write_module,
            [&list](OutputArchive& archive) { checkpoint::write_state_by_name(archive, list); },
            checkpoint::optimizer_type(*optimizer), nullptr, options.extras);
      },
      timeout);
}

void load_pipeline(const std::string& path, pipeline::Pipeline& pipe,
                   torch::optim::Optimizer* optimizer, const LoadOptions& options) {
  check_world(options.group, "shoal::load");
  if (pipe.is_global()) {
    // Its layers' parameters are global tensors: the global model saves and loads whole.
    throw UsageError("shoal::load(path, pipeline): the pipeline's layers are global; load the global "
                     "model itself (shoal::load(path, model), docs/checkpoint.md, \"Global models\")");
  }
  comm::Group group = checkpoint::checkpoint_group(std::nullopt, path, "shoal::load");
  auto& state = pipeline::Access::state(pipe);
  if (optimizer != nullptr)
    checkpoint::agree(group, check_optimizer(state, *optimizer, "shoal::load"), options.timeout);
  const std::string payload = checkpoint::read_payload(path, group, options.timeout);
  std::function<void()> apply;
  checkpoint::StateMap optimizer_state;
  std::string error;
  try {
    apply = checkpoint::plan_layers(path, payload, held_layers(state), layer_count(state),
                                    options.extras);
    if (optimizer != nullptr) {
      auto parts = checkpoint::read_parts(path, payload, /*with_extras=*/false);
      checkpoint::require_state_by_name(path, parts.has_optimizer_by_name, parts.optimizer_type);
      // Entries for layers held elsewhere are those workers'.
      optimizer_state =
          checkpoint::plan_state_by_name(path, parts.optimizer_by_name, parts.optimizer_type,
                                         *optimizer, held_parameters(state), nullptr);
    }
  } catch (const UsageError& e) {
    error = e.what();
  }
  // Every worker learns whether all can load before any changes: the first failing worker's
  // message goes to all.
  checkpoint::agree(group, error, options.timeout);
  if (optimizer != nullptr) optimizer->state() = std::move(optimizer_state);
  apply();
}

}  // namespace

void save(const std::string& path, const pipeline::Pipeline& pipe, const SaveOptions& options) {
  save_pipeline(path, pipe, nullptr, options);
}

void save(const std::string& path, const pipeline::Pipeline& pipe,
          const torch::optim::Optimizer& optimizer, const SaveOptions& options) {
  // Only read; the state map is reached through the non-const accessor.
  save_pipeline(path, pipe, const_cast<torch::optim::Optimizer*>(&optimizer), options);
}

void load(const std::string& path, pipeline::Pipeline& pipe, const LoadOptions& options) {
  load_pipeline(path, pipe, nullptr, options);
}

void load(const std::string& path, pipeline::Pipeline& pipe, torch::optim::Optimizer& optimizer,
          const LoadOptions& options) {
  load_pipeline(path, pipe, &optimizer, options);
}

}  // namespace shoal
