// The pipeline's state and wire format, shared by its construction (pipeline.cpp) and its step
// (step.cpp). Private to src/pipeline.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <torch/nn/modules/container/any.h>
#include <torch/types.h>

#include "dp/reducer.h"
#include "global/zero.h"
#include "shoal/comm/group.h"
#include "shoal/global/placement.h"
#include "shoal/pipeline/pipeline.h"

namespace shoal::pipeline {
namespace detail {

// Note [Pipeline tags]
// Every transfer has its own tag: (channel, stage, micro-batch), from kTagBase up, so that a
// receive can only match the send meant for it. Gloo takes any 32-bit tag; shoal keeps tags from
// 2^24 up for DataParallel's communication hooks (docs/comm.md) and global tensors' boxing uses
// tag 0, so the pipeline's tags lie in [2^20, 2^24).
constexpr int kTagBase = 1 << 20;
constexpr int kTagLimit = 1 << 24;
enum Channel { kShapeHeader = 0, kActivation = 1, kGradient = 2, kChannels = 3 };

// Note [Shape headers]
// Each activation is preceded by a small header with its dtype and shape, so that a stage whose
// output shape changes fails on both sides of the transfer with the same UsageError instead of
// the receiver waiting for bytes that never fit. Gradients need none: a gradient's shape is its
// activation's, already checked. Header: {dtype, ndim, sizes..., 0...}; ndim -1 means more
// dimensions than a header holds. Between stages of global layers the header also carries what
// makes the receiver's piece a global tensor: {mesh axes, an Sbp code per axis..., the global
// sizes...} (a plain layer's header has 0 axes).
constexpr int kMaxDims = 16;
constexpr int kMaxAxes = 8;
constexpr int kGlobalAt = 2 + kMaxDims;                   // mesh axes, then their Sbp codes
constexpr int kGlobalSizesAt = kGlobalAt + 1 + kMaxAxes;  // the global sizes
constexpr int kHeaderLength = kGlobalSizesAt + kMaxDims;

inline std::string join(const std::vector<int>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

inline std::string shape_of(c10::IntArrayRef sizes) {
  std::ostringstream text;
  text << sizes;
  return text.str();
}

// An Sbp on the wire: split(d) is d, broadcast -1, partial_sum -2.
inline int64_t sbp_code(const global::Sbp& sbp) {
  return sbp.is_split() ? sbp.dim() : sbp.is_broadcast() ? -1 : -2;
}
inline global::Sbp sbp_of_code(int64_t code) {
  return code >= 0 ? global::split(code) : code == -1 ? global::broadcast() : global::partial_sum();
}

struct Shape {
  int64_t dtype = -1;
  std::vector<int64_t> sizes;  // of the tensor sent: a global tensor's piece
  // Global layers: the activation's layout and global shape.
  std::vector<global::Sbp> sbp;
  std::vector<int64_t> global_sizes;
  bool operator==(const Shape& other) const {
    return dtype == other.dtype && sizes == other.sizes && sbp == other.sbp &&
           global_sizes == other.global_sizes;
  }
  std::string describe() const {
    std::string text =
        shape_of(sizes) + " " + std::string(c10::toString(static_cast<c10::ScalarType>(dtype)));
    if (sbp.empty()) return text;
    return text + " (a piece of " + shape_of(global_sizes) + " as " +
           global::NdSbp(sbp).describe() + ")";
  }
};

// The header of `tensor`; for global layers, of the piece `tensor` of a global tensor laid out
// as `sbp`, of shape `global_sizes` (as many dimensions as the piece). Plain layers: both empty.
inline torch::Tensor header_of(const torch::Tensor& tensor, const std::vector<global::Sbp>& sbp,
                               const std::vector<int64_t>& global_sizes) {
  auto header = torch::zeros({kHeaderLength}, torch::kInt64);
  auto* data = header.data_ptr<int64_t>();
  data[0] = static_cast<int64_t>(tensor.scalar_type());
  if (tensor.dim() > kMaxDims || sbp.size() > kMaxAxes) {
    data[1] = -1;
    return header;
  }
  data[1] = tensor.dim();
  for (int64_t d = 0; d < tensor.dim(); ++d) data[2 + d] = tensor.size(d);
  data[kGlobalAt] = static_cast<int64_t>(sbp.size());
  for (size_t a = 0; a < sbp.size(); ++a) data[kGlobalAt + 1 + a] = sbp_code(sbp[a]);
  for (size_t d = 0; d < global_sizes.size(); ++d) data[kGlobalSizesAt + d] = global_sizes[d];
  return header;
}

// What header_of() wrote; nothing when it holds more dimensions or axes than a header can.
inline std::optional<Shape> shape_of_header(const torch::Tensor& header) {
  const auto* data = header.data_ptr<int64_t>();
  const int64_t axes = data[kGlobalAt];
  if (data[1] < 0 || data[1] > kMaxDims || axes < 0 || axes > kMaxAxes) return std::nullopt;
  Shape shape;
  shape.dtype = data[0];
  shape.sizes.assign(data + 2, data + 2 + data[1]);
  if (axes > 0) {
    for (int a = 0; a < axes; ++a) shape.sbp.push_back(sbp_of_code(data[kGlobalAt + 1 + a]));
    // The global tensor has as many dimensions as its piece.
    shape.global_sizes.assign(data + kGlobalSizesAt, data + kGlobalSizesAt + data[1]);
  }
  return shape;
}

inline int64_t parameter_count(const torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& p : module.parameters()) count += p.numel();
  return count;
}

}  // namespace detail

struct Pipeline::State {
  using Channel = detail::Channel;
  using Shape = detail::Shape;
  PipelineOptions options;
  Schedule schedule;
  std::vector<int> split;  // layers per stage
  // Schedule worker -> its replicas' ranks (one each without a data axis).
  std::vector<std::vector<int>> ranks;
  int replicas = 1;  // d: the workers of each stage's placement
  int replica = 0;   // which of them this worker is
  std::vector<std::vector<torch::nn::AnyModule>> layers;  // per stage; empty unless held here
  // Plain layers: the whole Sequential as a checkpoint sees it (Pipeline::module(), Note [A
  // pipeline's whole model] in whole_model.cpp).
  std::shared_ptr<torch::nn::Module> whole;
  int me = -1;  // this worker's index in the schedule, -1 when it holds no stage
  // Global layers (Pipeline::is_global()): each stage's placement (a mesh of the same shape for
  // every stage; `replica` is then this worker's member index in it), the micro-batches' layout,
  // and this worker's parameters by the workers holding the same piece (global::nn::
  // piece_holders, sorted), whose gradients are summed over those workers after the step.
  bool global = false;
  std::vector<global::Placement> stage_placements;
  std::vector<global::Sbp> batch;
  std::vector<std::pair<std::vector<int>, std::vector<torch::Tensor>>> holders;
  int world_size = 1;
  std::vector<torch::Tensor> parameters;
  // Weights used by stages on several workers: their gradients are summed across workers.
  // This worker's copies; where it holds none, a meta tensor of the weight's shape and dtype (a
  // dp::Reducer's placeholder: it adds zeros to the sum).
  std::vector<torch::Tensor> tied;
  // This worker's other parameters: summed among the stage's replicas (with a data axis).
  std::vector<torch::Tensor> replicated;
  // The step's sums, on dp's bucketed engine (src/dp/reducer.h, during_backward off): of `tied`
  // over the world, of each entry of `holders` over its workers (in that order), of `replicated`
  // over the stage's replicas. Each is made with its group at the first step that sums it (Note
  // [Summing a step's gradients], step.cpp).
  std::unique_ptr<dp::Reducer> tied_sum;
  std::vector<std::unique_ptr<dp::Reducer>> holder_sums;
  // PipelineOptions::zero_stage: the `holders` sets' slices and gathers, in the same order; their
  // sums are reduce-scatters into the slices (dp::Shards::sum_gradients) instead of holder_sums.
  std::unique_ptr<global::detail::DataAxisZero> zero;
  std::unique_ptr<dp::Reducer> replica_sum;
  // Shapes and receive buffers, by (batch rows, stage, micro-batch): learned at the first step
  // with that batch size (Note [Shape headers]).
  std::map<std::tuple<int64_t, int, int>, Shape> learned;
  std::map<std::tuple<int64_t, int, int>, torch::Tensor> activation_buffers, gradient_buffers;
  std::string broken;  // why an earlier step failed
  // What the last successful step stashed, per stage of this worker (last_step_stats()).
  std::vector<StageStepStats> last_stats;

  int stages() const { return schedule.stages; }
  // The rank of `stage` in this worker's replica of the pipeline.
  int rank_of(int stage) const { return ranks[schedule.worker_of(stage)][replica]; }
  // Rows of each micro-batch a worker needs: one per data replica (a split(0) axis's members).
  int64_t rows_per_micro_batch() const;
  int tag(Channel channel, int stage, int micro_batch) const {
    return detail::kTagBase + (channel * stages() + stage) * schedule.micro_batches + micro_batch;
  }
  comm::PointToPointOptions p2p(Channel channel, int stage, int micro_batch) const {
    comm::PointToPointOptions o;
    o.tag = tag(channel, stage, micro_batch);
    o.timeout = options.timeout;
    return o;
  }
};

namespace detail {

// The whole model of a pipeline of plain layers (Note [A pipeline's whole model]), made when the
// pipeline is, from the whole Sequential `net` every worker has then; `stage_of_layer` gives each
// layer's stage.
std::shared_ptr<torch::nn::Module> make_whole_model(const torch::nn::Sequential& net, const Pipeline::State& state,
                                                    const std::vector<int>& stage_of_layer);

}  // namespace detail

}  // namespace shoal::pipeline
