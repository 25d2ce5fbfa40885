// What other parts of shoal use of checkpoint's files without a collective save or load: an
// elastic job's durable commits (src/elastic/durable.cpp, state.cpp) write and read the same
// files as shoal::save, from one process, beside the training. Checkpoint's other headers under
// src/checkpoint are its own.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "shoal/checkpoint/checkpoint.h"
#include "shoal/checkpoint/savable.h"

namespace shoal::checkpoint {

// The payload shoal::save writes for `module`, and `optimizer` and `loader`'s state when not
// null, with `extras` (docs/checkpoint.md, "The file").
std::string encode_payload(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer,
                           const Stateful* loader, const CheckpointExtras& extras);

// For a model of pieces (checkpoint::Savable, or PieceOf marks: a DataParallel at a ZeRO stage):
// every worker of the job calls it, and the first gets the payload shoal::save writes (each
// value whole, the optimizer's state by name), the others an empty string.
std::string encode_whole_payload(const torch::nn::Module& module,
                                 torch::optim::Optimizer& optimizer, const Stateful* loader,
                                 const CheckpointExtras& extras);

// Restores `module`, and `optimizer`, `extras` and `loader` when not null, from `payload`
// (described as `what` in errors). Everything is checked before anything changes: UsageError
// naming the first mismatch, with nothing changed.
void decode_payload(const std::string& what, std::string_view payload, torch::nn::Module& module,
                    torch::optim::Optimizer* optimizer, CheckpointExtras* extras, Stateful* loader);

// Replaces the file at `path` with a checkpoint file of `payload` (header and payload), atomically
// under crashes: `path` holds the old file or the new one, never a part. UsageError naming the
// path and the OS error.
void write_file(const std::string& path, std::string_view payload);

// The verified payload of the checkpoint file at `path`. UsageError, one line naming the path,
// when it can't be read or is not a checkpoint, truncated or corrupt.
std::string read_file(const std::string& path);

}  // namespace shoal::checkpoint
