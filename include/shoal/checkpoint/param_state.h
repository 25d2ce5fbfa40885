// An optimizer's state for one parameter as named tensors, for LibTorch's SGD, Adam, AdamW,
// Adagrad and RMSprop. The names are those PyTorch's Python optimizers give the same fields
// ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg",
// "grad_avg"), and a checkpoint's state by name uses them too: shoal's Python front end moves a
// Python optimizer's state into a LibTorch optimizer of the same type over the same tensors to save
// it, and back after a load (docs/python.md, "Checkpoints").
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

namespace shoal::checkpoint {

struct ParamState {
  // The steps taken; none for SGD, whose state counts none.
  std::optional<int64_t> step;
  // The defined fields (an Adam without amsgrad has no "max_exp_avg_sq").
  std::map<std::string, at::Tensor> fields;
};

// The fields an optimizer of this type may hold per parameter, in LibTorch's order; UsageError
// ("the optimizer is torch::optim::LBFGS; expected ...") for another type.
std::vector<std::string> state_fields(const torch::optim::Optimizer& optimizer);

// The state `optimizer` holds for `parameter` (the tensors themselves, not copies); none before
// the parameter's first step, or for a tensor that is not one of its parameters.
std::optional<ParamState> param_state(const torch::optim::Optimizer& optimizer, const at::Tensor& parameter);

// Sets the state of `parameter`, one of the optimizer's, to `state`'s tensors (not copies),
// replacing what it held. UsageError, with nothing changed, for a tensor that is not one of its
// parameters, a field its type does not have, a field whose shape is not the parameter's, or a
// step given to SGD or missing for another type.
void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter, const ParamState& state);

}  // namespace shoal::checkpoint
