// A pipeline's checkpoint: the whole Sequential's file, gathered from the stages' workers on save
// and taken apart by each worker on load. See docs/checkpoint.md, "Pipelines".
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize/output-archive.h>

#include "../checkpoint/collective.h"
#include "../checkpoint/contents.h"
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

int layer_count(const pipeline::Pipeline::State& state) {
  int count = 0;
  for (int layers : state.split) count += layers;
  return count;
}

}  // namespace

void save(const std::string& path, const pipeline::Pipeline& pipe, const SaveOptions& options) {
  check_world(options.group, "shoal::save");
  comm::Group group = checkpoint::checkpoint_group(std::nullopt, path, "shoal::save");
  const auto& state = pipeline::Access::state(pipe);
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
  for (int r = 0; r < group.size(); ++r) {
    std::string bytes = group.rank() == r ? encode(piece) : std::string();
    broadcast_bytes(group, bytes, r, timeout);
    if (group.rank() != 0) continue;
    Piece received;
    decode(bytes, received);
    for (size_t i = 0; i < received.names.size(); ++i) {
      const std::string& name = received.names[i];
      const int layer = std::stoi(name.substr(0, name.find('.')));
      auto& target = by_layer[layer];
      target.kinds.push_back(received.kinds[i]);
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
        return checkpoint::serialize_contents(
            [&root](OutputArchive& archive) { root.write(archive); }, options.extras);
      },
      timeout);
}

void load(const std::string& path, pipeline::Pipeline& pipe, const LoadOptions& options) {
  check_world(options.group, "shoal::load");
  comm::Group group = checkpoint::checkpoint_group(std::nullopt, path, "shoal::load");
  auto& state = pipeline::Access::state(pipe);
  const std::string payload = checkpoint::read_payload(path, group, options.timeout);
  std::map<int, torch::nn::Module*> layers;
  for (int s = 0; s < state.stages(); ++s) {
    int index = first_layer(state, s);
    for (auto& layer : state.layers[s]) layers[index++] = layer.ptr().get();
  }
  std::function<void()> apply;
  std::string error;
  try {
    apply = checkpoint::plan_layers(path, payload, layers, layer_count(state), options.extras);
  } catch (const UsageError& e) {
    error = e.what();
  }
  // Every worker learns whether all can load before any changes: the first failing worker's
  // message goes to all.
  auto failing =
      at::tensor({static_cast<int64_t>(error.empty() ? group.size() : group.rank())}, at::kLong);
  comm::AllReduceOptions reduce;
  reduce.op = comm::ReduceOp::kMin;
  reduce.timeout = options.timeout;
  group.all_reduce(failing, reduce);
  const int first_failing = static_cast<int>(failing.item<int64_t>());
  if (first_failing < group.size()) {
    broadcast_bytes(group, error, first_failing, options.timeout);
    throw UsageError(error);
  }
  apply();
}

}  // namespace shoal
