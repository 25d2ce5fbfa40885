// Layers whose parameters are global tensors, and the gradient synchronization they need.
//
//   namespace g = shoal::global;
//   g::nn::Layout layout{g::Placement::all(), {0}};           // axis 0 is tensor-parallel
//   g::nn::Linear up(64, 256, layout.placement, layout.column()),  // column-parallel
//                 down(256, 64, layout.placement, layout.row());   // row-parallel
//   g::nn::GradientSync sync(model);                          // once, after building the model
//   torch::optim::AdamW optimizer(model->parameters());       // the local pieces
//
// A layer registers each global parameter's local piece as a torch parameter, so torch
// optimizers step on the pieces. The gradient of a broadcast parameter is a partial_sum
// (each worker holds its share); GradientSync sums those shares over the workers that hold the
// same piece, in buckets, while backward goes on (DataParallel's engine), so that after
// backward every .grad is the gradient of the piece. See docs/global.md.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shoal/checkpoint/savable.h"
#include "shoal/dp/buckets.h"
#include "shoal/global/ops.h"

namespace shoal::dp {
class Reducer;  // src/dp/reducer.h
}  // namespace shoal::dp

namespace shoal::global::detail {
class DataAxisZero;  // src/global/zero.h
}  // namespace shoal::global::detail

namespace shoal::global::nn {

// A torch module with global parameters. A checkpoint saves each whole (checkpoint::Savable):
// shoal::save of any module that holds such layers writes what one process would.
class Module : public torch::nn::Module, public checkpoint::Savable {
 public:
  using torch::nn::Module::Module;

  // The global parameters of this module and of its submodules, named as named_parameters()
  // names their local pieces.
  std::vector<std::pair<std::string, GlobalTensor>> named_global_parameters();

  // Its own global parameters as pieces of whole values (gathered and cut along their placement
  // and SBP); a partial_sum one is refused.
  std::vector<std::pair<std::string, checkpoint::Piece>> pieces() const override;

 protected:
  // Makes `value` a parameter that requires grad: its local piece joins parameters() under
  // `name`. Returns the global tensor, whose local piece is that parameter.
  GlobalTensor register_global_parameter(const std::string& name, const GlobalTensor& value);

 private:
  friend class global::detail::DataAxisZero;
  std::vector<std::pair<std::string, GlobalTensor>> globals_;
  // ZeRO on the data axes: how the checkpoint's piece of a parameter (by its local tensor) is
  // seen through this worker's slice of it (Note [Saving a sharded global model], nn.cpp).
  std::map<const c10::TensorImpl*, std::function<checkpoint::Piece(checkpoint::Piece)>> sliced_;
};

// How a transformer's weights are laid out: on `placement`, tensor-parallel (Megatron-style)
// along `tensor_axes` and replicated along the others (which data parallelism uses).
struct Layout {
  Placement placement = Placement::all();
  std::vector<int> tensor_axes;

  // broadcast on every axis: layer norms, biases of row-parallel layers.
  NdSbp replicated() const;
  // split(0) of a [out, in] weight on the tensor axes: each worker computes some outputs.
  NdSbp column() const;
  // split(1) on the tensor axes: each worker takes some inputs, the output is a partial_sum.
  NdSbp row() const;
};

// y = x weight^T + bias, with weight [out, in] in `weight_sbp` on `placement`: broadcast (data
// parallel), split(0) (column-parallel) or split(1) (row-parallel), per mesh axis. The bias is
// split(0) where the weight is, broadcast elsewhere. Initialized as torch::nn::Linear.
class LinearImpl : public Module {
 public:
  LinearImpl(int64_t in, int64_t out, const Placement& placement, const NdSbp& weight_sbp,
             bool bias = true);
  GlobalTensor forward(const GlobalTensor& x);
  GlobalTensor weight, bias;
};
TORCH_MODULE(Linear);

// Rows of weight [count, dim] in `weight_sbp`: split(0) is vocabulary-parallel, split(1) splits
// the embedding dim. Initialized as torch::nn::Embedding (standard normal).
class EmbeddingImpl : public Module {
 public:
  EmbeddingImpl(int64_t count, int64_t dim, const Placement& placement, const NdSbp& weight_sbp);
  GlobalTensor forward(const GlobalTensor& indices);
  GlobalTensor weight;
};
TORCH_MODULE(Embedding);

// Over the last dim, with weight and bias broadcast on `placement`, as torch::nn::LayerNorm.
class LayerNormImpl : public Module {
 public:
  LayerNormImpl(int64_t dim, const Placement& placement, double eps = 1e-5);
  GlobalTensor forward(const GlobalTensor& x);
  GlobalTensor weight, bias;
  double eps;
};
TORCH_MODULE(LayerNorm);

struct TransformerBlockOptions {
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t hidden = 0;  // of the MLP; 0: 4 * dim
  double dropout = 0;
  // Recompute the block in backward instead of keeping its activations (shoal::recompute,
  // docs/memory.md "Recomputing activations"): the dropout masks are drawn again alike, the
  // tensor axes' all-reduces run again, and at ZeRO stage 3 the weights are gathered again.
  bool recompute = false;
};

// A GPT-2 block: x + attention(layer_norm(x)), then x + mlp(layer_norm(x)), with causal
// self-attention. Query, key, value and the MLP's first layer are column-parallel on the
// layout's tensor axes, the attention's output and the MLP's second layer row-parallel, so a
// block needs Megatron's two all-reduces forward and two backward, which boxing inserts. The
// heads are split over the tensor axes' workers: heads must be a multiple of their count.
class TransformerBlockImpl : public Module {
 public:
  TransformerBlockImpl(const TransformerBlockOptions& options, const Layout& layout);
  // x [batch, time, dim].
  GlobalTensor forward(const GlobalTensor& x);
  // The block's computation, which forward() runs directly or under recompute.
  GlobalTensor compute(const GlobalTensor& x);

  TransformerBlockOptions options;
  Layout layout;
  LayerNorm norm1{nullptr}, norm2{nullptr};
  Linear query{nullptr}, key{nullptr}, value{nullptr}, projection{nullptr}, up{nullptr},
      down{nullptr};
};
TORCH_MODULE(TransformerBlock);

// The members of `parameter`'s placement that hold the same piece as this worker (those sharing
// its coordinates on every axis where the parameter is not broadcast), in placement order: the
// workers GradientSync sums its gradient over. This worker must be a member.
std::vector<int> piece_holders(const GlobalTensor& parameter);

struct GradientSyncOptions : BucketOptions {
  // ZeRO on the data axes (docs/memory.md, "Global models"): the workers that hold the same
  // piece of a parameter (along the mesh axes where its SBP is broadcast: the data axes) each
  // keep a slice of it (Note [A parameter's slice], src/dp/shards.h), the one their optimizer
  // updates. 1: the optimizer's state is the slices'; gradients are reduce-scattered into the
  // slices during backward, and each parameter is gathered whole again by the first operation
  // that reads it after the step. 2: the pieces' own gradients are also released once sent. 3:
  // the pieces' memory is also freed between uses, each gathered with its unit just before an
  // operation reads it, in forward and again in backward (Note [Gathering a parameter when an
  // operation reads it], src/dp/gatherer.h). Build the optimizer on GradientSync::parameters().
  int zero_stage = 0;
  // Parameters are gathered in units of consecutive modules' parameters of about unit_bytes; at
  // stage 3 at most max_units units are whole at once, at stages 1 and 2 at most max_units
  // gathers travel at once.
  int64_t unit_bytes = 1024 * 1024;
  int max_units = 2;
};

// Sums the partial_sum gradients of a module's broadcast parameters during backward. For each
// parameter, the workers summed over are those holding the same piece: along the mesh axes on
// which it is broadcast. Parameters with the same such workers share buckets. Construct it once
// the module is built, on every worker, on the thread that trains; UsageError for a parameter
// that is not global (a plain torch parameter has no layout to say how its gradient is shared).
class GradientSync {
 public:
  explicit GradientSync(const std::shared_ptr<Module>& module, GradientSyncOptions options = {});
  ~GradientSync();
  GradientSync(GradientSync&&) noexcept;
  GradientSync& operator=(GradientSync&&) noexcept;
  template <typename ModuleType>
  explicit GradientSync(const torch::nn::ModuleHolder<ModuleType>& holder,
                        GradientSyncOptions options = {})
      : GradientSync(std::static_pointer_cast<Module>(holder.ptr()), std::move(options)) {}

  // The workers each bucketed set of parameters is summed over (job ranks), one list per set.
  std::vector<std::vector<int>> groups() const;

  // The tensors to build the optimizer on, each once: the module's parameters (local pieces),
  // and under ZeRO this worker's slice in place of each piece it shares with other workers.
  std::vector<at::Tensor> parameters() const { return parameters_; }

  // Under ZeRO: every parameter's piece whole on this worker now (after the last step, to read
  // them all at once); the first operation that reads one does it by itself. A collective
  // among the workers of each group; nothing at stage 0.
  void gather_parameters();

 private:
  std::vector<std::vector<int>> groups_;
  std::vector<std::unique_ptr<dp::Reducer>> reducers_;
  std::vector<at::Tensor> parameters_;
  std::unique_ptr<global::detail::DataAxisZero> zero_;  // under ZeRO
};

}  // namespace shoal::global::nn
