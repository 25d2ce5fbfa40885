// What a checkpoint's payload holds, and restoring it with every check before the first change.
// Private to src/checkpoint; the payload's layout is described in docs/checkpoint.md.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "shoal/checkpoint/checkpoint.h"
#include "shoal/checkpoint/savable.h"

namespace shoal::checkpoint {

// How an error names a checkpoint file.
inline std::string where(const std::string& path) { return "checkpoint " + path; }

// The payload: a torch::serialize archive of the module (as Module::save writes it), and of
// the optimizer and the loader's state (a Stateful's state_dict()) when not null, and of the
// extras when not empty. UsageError for an undefined extra or loader tensor.
std::string serialize_contents(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer,
                               const StateDict* loader_state, const CheckpointExtras& extras);

// For a model whose tensors are pieces of whole values (a global model's parameters): the whole
// value's shape, and this worker's piece of a whole value (undefined: it holds none).
struct WholeValue {
  std::vector<int64_t> shape;
  std::function<at::Tensor(const at::Tensor& whole)> piece;
  at::Tensor target;  // where the piece goes when not into the module's tensor (Piece::slice)
};
using WholeValues = std::map<const c10::TensorImpl*, WholeValue>;

// The payload of a model saved by name, whole (checkpoint::Savable: a global model's, a pipeline's): the module's
// archive written by `write_module`, and when `write_optimizer` is set the optimizer's state by
// parameter name (Note [Optimizer state by name], optimizer_state.cpp) with its type.
std::string serialize_contents(
    const std::function<void(torch::serialize::OutputArchive&)>& write_module,
    const std::function<void(torch::serialize::OutputArchive&)>& write_optimizer,
    const std::string& optimizer_type, const StateDict* loader_state,
    const CheckpointExtras& extras);

// A payload read and checked against a model, with nothing of the caller's changed yet.
struct PlannedContents {
  std::function<void()> copy_module;  // copies the file's values (or this worker's pieces) in
  bool has_optimizer_by_name = false;
  torch::serialize::InputArchive optimizer_by_name;
  std::string optimizer_type;
  std::optional<StateDict> loader_state;
  CheckpointExtras extras;  // read only when asked for
};

// Checks the file's loader state against `loader` (not null): UsageError, naming the checkpoint,
// when the file has none or `loader` refuses it. Changes nothing.
void check_loader_state(const std::string& path, const std::optional<StateDict>& saved,
                        const Stateful& loader);

// The parts of `payload` other than the module: the optimizer's state by name and its type (or
// the type only, for LibTorch's format), the loader state, and the extras when asked for.
PlannedContents read_parts(const std::string& path, std::string_view payload, bool with_extras);

// Parses `payload` (of the checkpoint at `path`) and checks its module against `module` as
// restore_contents does, except that a tensor in `whole` is checked against its whole value's
// shape and receives its piece. UsageError naming the first mismatch; changes nothing.
PlannedContents plan_contents(const std::string& path, std::string_view payload,
                              torch::nn::Module& module, const WholeValues& whole,
                              bool with_extras);

// Runs `read` (parsing a payload's archive); an error of LibTorch's becomes the UsageError of a
// file whose content can't be read.
void read_guarded(const std::string& path, const std::function<void()>& read);

// Restores `module`, and `optimizer`, `extras` and `loader` when not null, from `payload`, a
// verified payload of the checkpoint at `path`. Everything is checked before anything changes:
// UsageError naming the first mismatch (a parameter's name and shapes, the optimizer's type, a
// missing part, a loader state the loader refuses), with nothing changed.
void restore_contents(const std::string& path, std::string_view payload, torch::nn::Module& module,
                      torch::optim::Optimizer* optimizer, CheckpointExtras* extras, Stateful* loader);

}  // namespace shoal::checkpoint
