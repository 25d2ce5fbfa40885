// Checkpoints: a module, its optimizer and where the data loader stands, in one file.
//
//   shoal::save("ckpt.pt", *net, optimizer, loader.sampler());   // every worker calls it
//   ...
//   shoal::load("ckpt.pt", *net, optimizer, loader.sampler());   // on any number of workers
//
// Contract: save and load are collectives of shoal::world() (or of options.group): every
// worker calls them, in the same order as its other collectives. save is written by the
// group's first worker only (shoal::is_main() for the world), to a temporary file that is
// fsynced and renamed over `path`, so `path` always holds a complete checkpoint, the old one
// or the new one. load is read by the first worker, which checks it and broadcasts its bytes,
// so the other workers need not see the same filesystem. Both raise UsageError on every worker
// for a file that can't be written or read, or is truncated or corrupt; load raises it too
// where the file doesn't fit the worker's module or optimizer. load then has changed nothing.
// See docs/checkpoint.md.
#pragma once

#include <map>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "shoal/comm/group.h"
#include "shoal/checkpoint/savable.h"
#include "shoal/core/timeout.h"

namespace shoal {

// The program's own values, saved alongside: a step count, a learning rate, an RNG state.
// Tensors of any dtype and shape, e.g. extras["lr"] = torch::tensor(0.01).
using CheckpointExtras = std::map<std::string, at::Tensor>;

struct SaveOptions {
  CheckpointExtras extras;
  // The workers that call save together; empty: shoal::world(). comm::Group::single() saves
  // from a process on its own, also without shoal::init().
  std::optional<comm::Group> group;
  // How long the other workers wait for the first one to write the file; kUnsetTimeout: the
  // group's timeout.
  Duration timeout = kUnsetTimeout;
};

struct LoadOptions {
  // When set, receives the file's extras (empty when it has none).
  CheckpointExtras* extras = nullptr;
  // As in SaveOptions.
  std::optional<comm::Group> group;
  // How long the other workers wait for the first one to read and send the file.
  Duration timeout = kUnsetTimeout;
};

// Writes `path`: the module's parameters and buffers (what Module::save writes), the
// optimizer's state, the loader's state (what a checkpoint::Stateful gives: a data::Sampler, as
// loader.sampler()) and options.extras.
//
// A module some of whose parameters are pieces of larger values (checkpoint::Savable, which the
// layers of shoal::global::nn implement), anywhere in its tree and passed by any reference, is
// saved whole: every worker of the job calls save and load (options.group must be empty or the
// world). save gathers each whole value, and the optimizer's per-parameter state (SGD, Adam,
// AdamW, Adagrad, RMSprop) keyed by the parameter's name as a whole value too, from the workers
// that hold them; the first worker writes what the same model built on one process writes, so a
// one-process program loads it. load checks every name and shape against the model on every
// worker before any change (UsageError on every worker, naming the first mismatch, with nothing
// changed) and each worker keeps its piece of each value and the state of the parameters its own
// optimizer holds. The plan (placements, SBP, worker count) may differ between save and load.
// Such a model must hold no plain parameter beside its pieces, and a piece that cannot be whole
// (a partial_sum value) is refused. See docs/checkpoint.md, "Global models".
void save(const std::string& path, const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
          const checkpoint::Stateful& loader, const SaveOptions& options = {});
void save(const std::string& path, const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
          const SaveOptions& options = {});
void save(const std::string& path, const torch::nn::Module& module, const SaveOptions& options = {});

// Restores the module, the optimizer and the loader (loader.sampler(): the next batch is the one
// after the saved step, on any number of workers) from `path`. The file must hold a loader state
// that the loader accepts (saved for the same dataset size, seed and shuffle), checked with
// everything else before anything changes. The optimizer's state may also be one saved by
// parameter name (by a global model or a pipeline; docs/checkpoint.md).
// Values are copied into the module's tensors, so references to them (the optimizer's,
// DataParallel's) stay valid. Every parameter and buffer must be in the file with the module's
// shape, and nothing else may be; the file must have been saved with an optimizer of the same type
// over as many parameters. Param-group options (the learning rate) stay the program's, as in
// LibTorch's Optimizer::load; save them as extras when they change.
void load(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
          checkpoint::Stateful& loader, const LoadOptions& options = {});
// The same without the loader: the file's loader state, if it has one, is not used.
void load(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
          const LoadOptions& options = {});
// Restores the module only (for evaluation, or a new optimizer); the file's optimizer and
// loader state are not used.
void load(const std::string& path, torch::nn::Module& module, const LoadOptions& options = {});

// A model that a DataParallel shards (DataParallelOptions::zero_stage) is saved and loaded by
// these functions too, whole: its parameters carry their pieces (checkpoint::PieceOf), and the
// file is what the same model on one process writes (docs/memory.md, "Checkpoints").
// A pipeline's model (shoal::pipeline::Pipeline) is saved and loaded by the overloads that
// shoal/pipeline/pipeline.h declares beside it.

}  // namespace shoal
