// An optimizer's per-parameter state keyed by parameter name, as whole values, so that it follows
// the parameters to another plan (a global model's pieces, a pipeline's stages). Private to
// src/checkpoint; the layout is Note [Optimizer state by name] in optimizer_state.cpp.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace shoal::checkpoint {

using StateMap =
    ska::flat_hash_map<std::string, std::unique_ptr<torch::optim::OptimizerParamState>>;

// Where a parameter's state lives in one optimizer type's state object.
struct StateRefs {
  int64_t* step = nullptr;  // null: the type counts no steps (SGD)
  std::vector<at::Tensor*> fields;
};

// An optimizer type's per-parameter state: the fields shaped like the parameter, and how to reach
// them in its state object.
struct StateKind {
  std::vector<std::string> fields;
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>()> make;
  std::function<StateRefs(torch::optim::OptimizerParamState&)> refs;
};

// SGD, Adam, AdamW, Adagrad and RMSprop's; null for another optimizer type.
const StateKind* state_kind_of(const torch::optim::Optimizer& optimizer);

// "the optimizer is torch::optim::LBFGS; expected ..." when state_kind_of is null, else empty.
std::string unsupported_optimizer(const torch::optim::Optimizer& optimizer);

// The optimizer's C++ type, as the file records it.
std::string optimizer_type(const torch::optim::Optimizer& optimizer);

// The key of a parameter's entry in optimizer.state(), as LibTorch's optimizers make it.
std::string state_key(const at::Tensor& parameter);

// The state the optimizer holds for `parameter`, or null (no step yet, or not its parameter).
torch::optim::OptimizerParamState* state_of(torch::optim::Optimizer& optimizer,
                                            const at::Tensor& parameter);

// One parameter's state, whole.
struct NamedState {
  std::string name;
  int64_t step = 0;
  std::vector<std::pair<std::string, at::Tensor>> fields;  // the defined ones
};

void write_state_by_name(torch::serialize::OutputArchive& archive,
                         const std::vector<NamedState>& states);

// UsageError unless the file holds optimizer state by name (`has_by_name`); `saved_type` is the
// type of the state it holds otherwise, empty for none.
void require_state_by_name(const std::string& path, bool has_by_name,
                           const std::string& saved_type);

// A parameter whose state the file may hold: its names (a tied weight has several; the first with
// an entry is taken), the whole value's shape, this worker's tensor (the optimizer's key) and its
// piece of a whole value.
struct StateTarget {
  std::vector<std::string> names;
  std::vector<int64_t> shape;
  at::Tensor tensor;
  std::function<at::Tensor(const at::Tensor& whole)> piece;
};

// The optimizer's new state from the file's state by name (`archive`, saved from an optimizer of
// type `saved_type`): an entry for each target the optimizer holds and the file has state for.
// With `all_names`, a file entry for another name is an error (without, it belongs to a
// parameter this worker doesn't hold). Checks everything; UsageError naming the first mismatch.
StateMap plan_state_by_name(const std::string& path, torch::serialize::InputArchive& archive,
                            const std::string& saved_type, const torch::optim::Optimizer& optimizer,
                            const std::vector<StateTarget>& targets,
                            const std::set<std::string>* all_names);

}  // namespace shoal::checkpoint
