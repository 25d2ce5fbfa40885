// Pipeline parallelism: a torch::nn::Sequential cut into stages that sit on different workers and
// work at the same time on different micro-batches, under a schedule (schedule.h) picked by name.
//
//   namespace pp = shoal::pipeline;
//   torch::manual_seed(0);                         // the same whole model on every worker
//   auto net = torch::nn::Sequential(...);
//   pp::PipelineOptions opts;
//   opts.micro_batches = 8;
//   opts.schedule = shoal::pipeline::ScheduleKind::k1F1B;  // or kGPipe, kInterleaved1F1B, ...
//   pp::Pipeline pipe(net, opts);                  // stage s on worker s, split by parameter count
//   torch::optim::SGD opt(pipe.parameters(), 0.1); // this worker's stages' parameters
//   for (...) {
//     opt.zero_grad();
//     auto loss = pipe.step(x, y, [](auto& out, auto& y) { return torch::mse_loss(out, y); });
//     opt.step();                                  // loss: the batch's mean loss, on every worker
//   }
//
// Contract: every worker of the job builds the same whole model (same seed) and calls step() with
// the same global batch, in the same order, as every worker of a global-tensor program does. A
// worker keeps only its stages' layers. The gradients step() leaves in .grad are those of the
// mean loss over the whole batch, whatever the number of micro-batches. See docs/pipeline.md.
//
// Stages of global layers (3-D parallelism): when the Sequential's layers are global-tensor
// modules (shoal::global::nn, forward(GlobalTensor) -> GlobalTensor), each layer already sits on
// a placement, and the placements make the stages, as OneFlow's placement does: consecutive
// layers on one placement form a stage. A stage's placement may be a mesh whose axes are data
// and tensor parallel; every stage's mesh has the same shape, and member i of one stage sends its
// piece of the activation to member i of the next (Note [Member-wise transfers] in step.cpp).
//
//   auto net = torch::nn::Sequential(Embed(..., first), Block(..., first),   // first: 2x2 mesh
//                                    Block(..., second), Head(..., second)); // second: 2x2 mesh
//   opts.batch = g::NdSbp{g::split(0), g::broadcast()};  // the data axis, then the tensor axis
//   pp::Pipeline pipe(net, opts);
//   auto loss = pipe.step(ids, targets, [](const g::GlobalTensor& logits, const g::GlobalTensor& y)
//   {
//     return g::cross_entropy(logits, y);
//   });
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include "shoal/core/timeout.h"
#include "shoal/global/placement.h"
#include "shoal/global/tensor.h"
#include "shoal/pipeline/schedule.h"

namespace shoal::pipeline {

// The loss of one micro-batch: the mean over its rows (a mean-reduced torch loss, as
// torch::mse_loss or torch::nn::functional::cross_entropy give by default). The pipeline weighs
// each micro-batch's loss by its share of the batch's rows, which gives the batch's mean loss.
using LossFunction =
    std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
// The same for stages of global layers: the last stage's output and the micro-batch's target as
// global tensors on the last stage's placement; returns a global scalar (g::cross_entropy's).
using GlobalLossFunction = std::function<global::GlobalTensor(const global::GlobalTensor& output,
                                                              const global::GlobalTensor& target)>;

struct PipelineOptions {
  // The batch is cut along dim 0 into this many micro-batches (the first ones a row more when it
  // does not divide, as comm::split_sizes cuts).
  int micro_batches = 1;
  // Which generated schedule runs (schedule.h); parse_schedule_kind reads a name ("gpipe",
  // "1f1b", "interleaved", "zb"), as a --schedule flag takes it. custom_schedule below replaces it.
  ScheduleKind schedule = ScheduleKind::k1F1B;
  // Stages per worker (v). 0: 2 for "interleaved", 1 for the others.
  int stages_per_worker = 0;
  // Layers per stage, in order (their sum is the number of layers). Empty: as many stages as
  // workers times stages_per_worker (or placements), balanced by parameter count.
  std::vector<int> split;
  // Global layers only: how each micro-batch's input (on the first stage's placement) and target
  // (on the last's) are laid out, one Sbp per mesh axis: split(0) on the data axes, broadcast on
  // the others. Empty: broadcast on every axis.
  std::vector<global::Sbp> batch;
  // Plain layers only. Each stage's placement: a line of workers. One worker, or d that each run
  // the stage on their share of every micro-batch (a data axis: every stage needs d, and the
  // stage's gradients are summed among them). Empty: stage s on worker s % p, p the job's world
  // size. The schedule fixes which stages share a placement: stage s on the (s % p)-th of the
  // distinct placements named here; another placement is a UsageError.
  std::vector<global::Placement> placements;
  // Deadline of every transfer between stages; kUnsetTimeout: the world group's.
  Duration timeout = kUnsetTimeout;
  // A hand-written schedule instead of `schedule` (its workers, stages and micro_batches must
  // agree with the pipeline's). It is validated (validate()) when the pipeline is made, as the
  // generated ones are.
  std::shared_ptr<const Schedule> custom_schedule;
  // Global layers only: ZeRO on the data axes (docs/memory.md, "Global models: ZeRO on the data
  // axes"), as global::nn::GradientSyncOptions::zero_stage: each piece that several workers hold
  // is cut over them; parameters() gives this worker's slices; the step's sum over them is a
  // reduce-scatter into the slices, and a piece is gathered when an operation first reads it
  // after the optimizer's step (at stage 3 freed again between uses). unit_bytes and max_units as
  // there; the step's reduce-scatters go in buckets of unit_bytes.
  int zero_stage = 0;
  int64_t unit_bytes = 1024 * 1024;
  int max_units = 2;
};

// What one step stashed on one of this worker's stages (Pipeline::last_step_stats()).
struct StageStepStats {
  int stage = 0;
  // The most micro-batches forwarded and not yet fully backwarded (their B ended, or their W
  // when the backward is split): simulate()'s peak_in_flight, counted by the runtime.
  int peak_stashed = 0;
  // The most bytes of the stage's boundary tensors kept for those micro-batches: for each, the
  // stage's input and output as the forward left them (numel x element size; the last stage's
  // output is its weighted loss). The autograd graph's inner saved tensors are not counted.
  int64_t peak_stashed_bytes = 0;
};

class Pipeline {
 public:
  // Cuts `net` into stages and keeps this worker's. Raises UsageError for options that don't fit
  // (a split that doesn't sum to the layers, a stage with no layer, placements the schedule
  // forbids, a schedule validate() refuses). Needs shoal::init(). Does no communication.
  Pipeline(torch::nn::Sequential net, PipelineOptions options = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Forward and backward of the batch (`input`, `target`, cut along dim 0 into micro-batches)
  // under the schedule. Accumulates into the .grad of this worker's parameters the gradient of
  // the batch's mean loss (call the optimizer's zero_grad() between steps, as usual), with the
  // gradients of tied weights summed over their stages, and a replicated stage's over its
  // replicas. Returns the batch's mean loss (a float64 scalar) on every worker. Every worker must
  // call it. Raises CommError when a stage's worker is lost or a transfer passes its deadline,
  // UsageError when an activation's shape differs from the one learned at the first step with this
  // batch size (on both sides of the transfer). After an error the pipeline is unusable.
  //
  // `loss` is a LossFunction for plain layers and a GlobalLossFunction for global ones (write its
  // parameters' types, const g::GlobalTensor&, rather than auto).
  template <typename Loss>
  torch::Tensor step(const torch::Tensor& input, const torch::Tensor& target, const Loss& loss) {
    return dispatch(input, target, loss, /*train=*/true);
  }

  // The batch's mean loss, as step() computes it, without backward: each micro-batch goes
  // forward through the stages (no gradient is recorded, .grad is untouched), under no
  // schedule but the micro-batches in order. Put the model in eval mode first (net->eval()) for
  // layers that differ there (dropout). Same contract and errors as step().
  template <typename Loss>
  torch::Tensor evaluate(const torch::Tensor& input, const torch::Tensor& target,
                         const Loss& loss) {
    return dispatch(input, target, loss, /*train=*/false);
  }

  // This worker's stages' parameters (each tied weight once): what its optimizer steps.
  std::vector<torch::Tensor> parameters() const;
  // Layers per stage, and the stages this worker holds (in order).
  const std::vector<int>& split() const;
  std::vector<int> local_stages() const;
  int stages() const;
  // The workers that run `stage`.
  global::Placement placement(int stage) const;
  // Whether the layers are global-tensor modules (stages by their placements).
  bool is_global() const;
  const Schedule& schedule() const;
  // Per stage of this worker (in order), what the last successful step() stashed; empty before
  // the first.
  const std::vector<StageStepStats>& last_step_stats() const;

  // The whole model as a checkpoint sees it, for shoal::save and shoal::load
  // (shoal/checkpoint/checkpoint.h, docs/checkpoint.md, "Pipelines"):
  //
  //   shoal::save(path, pipe.module(), optimizer);   // every worker of the job calls it
  //   shoal::load(path, pipe.module(), optimizer);   // a pipeline of any split, workers, schedule
  //
  // The whole Sequential's names and shapes on every worker: this worker's layers themselves, and
  // in place of the others outlines with meta tensors (no storage), so that saving it writes the
  // file shoal::save(path, *net) writes for the whole Sequential on one process, each value sent
  // by a worker that holds it (a replicated stage's first replica), and loading it takes into
  // this worker's layers their values, checking every name and shape first. The optimizer's state
  // (SGD, Adam, AdamW, Adagrad, RMSprop; over pipe.parameters()) is saved by parameter name, so
  // that it follows the layers to another split, or to the plain Sequential on one process
  // (shoal::load(path, *net, optimizer)). For saving and loading only: its parameters() include
  // the placeholders; step with pipe.parameters(). UsageError for global layers: save the global
  // model itself.
  torch::nn::Module& module();
  const torch::nn::Module& module() const;

  struct State;

 private:
  template <typename Loss>
  torch::Tensor dispatch(const torch::Tensor& input, const torch::Tensor& target, const Loss& loss,
                         bool train) {
    if constexpr (std::is_invocable_r_v<torch::Tensor, const Loss&, const torch::Tensor&,
                                        const torch::Tensor&>) {
      return run_step(input, target, LossFunction(loss), nullptr, train);
    } else {
      return run_step(input, target, nullptr, GlobalLossFunction(loss), train);
    }
  }
  torch::Tensor run_step(const torch::Tensor& input, const torch::Tensor& target,
                         const LossFunction& loss, const GlobalLossFunction& global_loss,
                         bool train);
  std::unique_ptr<State> state_;
};

// How `weights` (e.g. the parameter counts of a model's layers) are cut into `parts` contiguous,
// non-empty groups so that the largest group's sum is as small as possible; returns each group's
// length. Each weight counts at least 1, so that layers without parameters are spread too.
// UsageError when there are fewer weights than parts.
std::vector<int> balanced_split(const std::vector<int64_t>& weights, int parts);

}  // namespace shoal::pipeline
