// save and load of a model whose tensors are pieces of whole values (checkpoint::Savable on
// some module of its tree: a global model's layers, a pipeline's whole model). Private to
// src/checkpoint; checkpoint.cpp takes this way whenever pieces_of(module) is not empty.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "shoal/checkpoint/checkpoint.h"
#include "shoal/checkpoint/savable.h"

namespace shoal::checkpoint {

// The pieces of every module of the tree, named as named_parameters() or named_buffers() name
// them (a tensor registered under several names, a tied weight, under its first).
std::vector<std::pair<std::string, Piece>> pieces_of(const torch::nn::Module& module);

// Every worker of the job calls these (options.group must be empty or the world). save gathers
// each piece's whole value, and the optimizer's per-parameter state (SGD, Adam, AdamW, Adagrad,
// RMSprop) keyed by the parameter's name as a whole value too, from the workers that hold them;
// the first worker writes what the same model built on one process writes. load checks every
// name and shape against the model on every worker before any change (UsageError on every
// worker, naming the first mismatch, with nothing changed) and each worker keeps its piece of
// each value and the state of the parameters its own optimizer holds.
void save_whole(const std::string& path, const torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                const StateDict* loader_state, const SaveOptions& options);
void load_whole(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                Stateful* loader, const LoadOptions& options);

}  // namespace shoal::checkpoint
