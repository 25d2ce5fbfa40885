#include "shoal/pipeline/pipeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include <torch/autograd.h>
#include <torch/nn/modules/container/any.h>

#include "shoal/comm/group.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"
#include "shoal/runtime/init.h"
#include "split_backward.h"

namespace shoal::pipeline {
namespace {

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
// dimensions than a header holds.
constexpr int kMaxDims = 16;
constexpr int kHeaderLength = 2 + kMaxDims;

std::string join(const std::vector<int>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

std::string shape_of(c10::IntArrayRef sizes) {
  std::ostringstream text;
  text << sizes;
  return text.str();
}

struct Shape {
  int64_t dtype = -1;
  std::vector<int64_t> sizes;
  bool operator==(const Shape& other) const { return dtype == other.dtype && sizes == other.sizes; }
  std::string describe() const {
    return shape_of(sizes) + " " + std::string(c10::toString(static_cast<c10::ScalarType>(dtype)));
  }
};

torch::Tensor header_of(const torch::Tensor& tensor) {
  auto header = torch::zeros({kHeaderLength}, torch::kInt64);
  auto* data = header.data_ptr<int64_t>();
  data[0] = static_cast<int64_t>(tensor.scalar_type());
  if (tensor.dim() > kMaxDims) {
    data[1] = -1;
    return header;
  }
  data[1] = tensor.dim();
  for (int64_t d = 0; d < tensor.dim(); ++d) data[2 + d] = tensor.size(d);
  return header;
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& p : module.parameters()) count += p.numel();
  return count;
}

}  // namespace

std::vector<int> balanced_split(const std::vector<int64_t>& weights, int parts) {
  const int n = static_cast<int>(weights.size());
  if (parts < 1)
    throw UsageError("balanced_split: expected at least 1 part, got " + std::to_string(parts));
  if (n < parts) {
    throw UsageError("pipeline: cannot cut " + std::to_string(n) + " layers into " +
                     std::to_string(parts) + " stages: every stage needs at least one layer");
  }
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + std::max<int64_t>(weights[i], 1);
  // cost[k][j]: the smallest possible largest part when the first j weights form k parts.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> cost(parts + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  cost[0][0] = 0;
  for (int k = 1; k <= parts; ++k) {
    for (int j = k; j <= n; ++j) {
      for (int i = k - 1; i < j; ++i) {
        if (cost[k - 1][i] == kInf) continue;
        const int64_t largest = std::max(cost[k - 1][i], prefix[j] - prefix[i]);
        if (largest < cost[k][j]) {
          cost[k][j] = largest;
          cut[k][j] = i;
        }
      }
    }
  }
  std::vector<int> lengths(parts);
  for (int k = parts, j = n; k >= 1; --k) {
    lengths[k - 1] = j - cut[k][j];
    j = cut[k][j];
  }
  return lengths;
}

struct Pipeline::State {
  PipelineOptions options;
  Schedule schedule;
  std::vector<int> split;                                 // layers per stage
  std::vector<int> ranks;                                 // schedule worker -> job rank
  std::vector<std::vector<torch::nn::AnyModule>> layers;  // per stage; empty unless held here
  int me = -1;  // this worker's index in the schedule, -1 when it holds no stage
  int world_size = 1;
  std::vector<torch::Tensor> parameters;
  // Weights used by stages on several workers: their gradients are summed across workers.
  std::vector<torch::Tensor> tied;  // this worker's copies, undefined where it holds none
  std::vector<int64_t> tied_numel;
  std::vector<c10::ScalarType> tied_dtype;
  // Shapes and receive buffers, by (batch rows, stage, micro-batch): learned at the first step
  // with that batch size (Note [Shape headers]).
  std::map<std::tuple<int64_t, int, int>, Shape> learned;
  std::map<std::tuple<int64_t, int, int>, torch::Tensor> activation_buffers, gradient_buffers;
  std::string broken;  // why an earlier step failed

  int stages() const { return schedule.stages; }
  int rank_of(int stage) const { return ranks[schedule.worker_of(stage)]; }
  int tag(Channel channel, int stage, int micro_batch) const {
    return kTagBase + (channel * stages() + stage) * schedule.micro_batches + micro_batch;
  }
  comm::PointToPointOptions p2p(Channel channel, int stage, int micro_batch) const {
    comm::PointToPointOptions o;
    o.tag = tag(channel, stage, micro_batch);
    o.timeout = options.timeout;
    return o;
  }
};

namespace {

// How the stages sit on workers: the schedule (generated or the user's) and each stage's rank.
void place_stages(Pipeline::State& state, int layer_count) {
  const PipelineOptions& o = state.options;
  if (o.micro_batches < 1) {
    throw UsageError("pipeline: expected micro_batches >= 1, got " +
                     std::to_string(o.micro_batches));
  }
  const ScheduleKind kind = parse_schedule_kind(o.schedule);
  const bool interleaved = kind == ScheduleKind::kInterleaved1F1B;
  int v = o.stages_per_worker == 0 ? (interleaved ? 2 : 1) : o.stages_per_worker;
  if (v < 1) {
    throw UsageError(
        "pipeline: expected stages_per_worker >= 1 (or 0 for the schedule's "
        "default), got " +
        std::to_string(v));
  }
  if (o.custom_schedule) v = o.custom_schedule->stages / std::max(o.custom_schedule->workers, 1);
  if (!interleaved && !o.custom_schedule && v != 1) {
    throw UsageError("pipeline: the " + o.schedule +
                     " schedule runs one stage per worker; "
                     "stages_per_worker = " +
                     std::to_string(v) + " needs schedule \"interleaved\"");
  }

  // The stages' workers, in the order the schedule numbers them.
  std::vector<int> placements = o.placements;
  int stages = 0;
  if (!placements.empty()) {
    stages = static_cast<int>(placements.size());
  } else if (!o.split.empty()) {
    stages = static_cast<int>(o.split.size());
  } else if (o.custom_schedule) {
    stages = o.custom_schedule->stages;
  } else {
    stages = state.world_size * v;
  }
  if (!o.split.empty() && static_cast<int>(o.split.size()) != stages) {
    throw UsageError("pipeline: split has " + std::to_string(o.split.size()) +
                     " stages but placements has " + std::to_string(stages));
  }
  for (int rank : placements) {
    if (rank < 0 || rank >= state.world_size) {
      throw UsageError("pipeline: placement " + std::to_string(rank) + " in " + join(placements) +
                       " is not a worker of this job of " + std::to_string(state.world_size));
    }
  }
  std::vector<int> ranks;  // distinct, in order of first use
  for (int rank : placements) {
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) ranks.push_back(rank);
  }
  int p = placements.empty() ? (stages + v - 1) / v : static_cast<int>(ranks.size());
  if (placements.empty()) {
    if (stages % v != 0) {
      throw UsageError("pipeline: " + std::to_string(stages) + " stages don't fill " +
                       std::to_string(v) + " stages per worker");
    }
    if (p > state.world_size) {
      throw UsageError("pipeline: " + std::to_string(stages) + " stages at " + std::to_string(v) +
                       " per worker need " + std::to_string(p) + " workers; the job has " +
                       std::to_string(state.world_size));
    }
    for (int w = 0; w < p; ++w) ranks.push_back(w);
  } else if (stages != p * v) {
    // Two stages on one worker where the schedule runs one per worker (or v per worker).
    for (int s = 0; s < stages; ++s) {
      for (int t = s + 1; t < stages; ++t) {
        if (placements[s] == placements[t] && v == 1) {
          throw UsageError("pipeline: stages " + std::to_string(s) + " and " + std::to_string(t) +
                           " are both placed on worker " + std::to_string(placements[s]) +
                           ", but the " + o.schedule +
                           " schedule runs one stage per worker "
                           "(schedule \"interleaved\" runs several; placements " +
                           join(placements) + ")");
        }
      }
    }
    throw UsageError("pipeline: " + std::to_string(stages) + " stages on " + std::to_string(p) +
                     " workers " + join(ranks) + ", but the " + o.schedule + " schedule runs " +
                     std::to_string(v) + " stages on each worker (placements " + join(placements) +
                     ")");
  }

  if (o.custom_schedule) {
    state.schedule = *o.custom_schedule;
    if (state.schedule.workers != p || state.schedule.stages != stages ||
        state.schedule.micro_batches != o.micro_batches) {
      throw UsageError("pipeline: the custom schedule has " +
                       std::to_string(state.schedule.workers) + " workers, " +
                       std::to_string(state.schedule.stages) + " stages and " +
                       std::to_string(state.schedule.micro_batches) +
                       " micro-batches; the pipeline has " + std::to_string(p) + ", " +
                       std::to_string(stages) + " and " + std::to_string(o.micro_batches));
    }
  } else {
    state.schedule = make_schedule(kind, p, v, o.micro_batches);
  }
  validate(state.schedule);
  // The schedule decides which stages share a worker; the placements must agree.
  for (int s = 0; s < stages && !placements.empty(); ++s) {
    const int expected = ranks[state.schedule.worker_of(s)];
    if (placements[s] != expected) {
      throw UsageError("pipeline: the " + state.schedule.name + " schedule runs stage " +
                       std::to_string(s) + " on its worker " +
                       std::to_string(state.schedule.worker_of(s)) + " (rank " +
                       std::to_string(expected) + "), but placements put it on worker " +
                       std::to_string(placements[s]) + " (placements " + join(placements) + ")");
    }
  }
  state.ranks = ranks;
  const int my_rank = shoal::rank();
  for (int w = 0; w < p; ++w) {
    if (ranks[w] == my_rank) state.me = w;
  }
  const int64_t tags = int64_t{kChannels} * stages * o.micro_batches;
  if (kTagBase + tags > kTagLimit) {
    throw UsageError("pipeline: " + std::to_string(stages) + " stages x " +
                     std::to_string(o.micro_batches) +
                     " micro-batches need more transfer tags "
                     "than the pipeline has (" +
                     std::to_string(kTagLimit - kTagBase) + ")");
  }
  (void)layer_count;
}

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential net, PipelineOptions options)
    : state_(std::make_unique<State>()) {
  if (!shoal::is_initialized()) throw UsageError("pipeline: call shoal::init() first");
  State& state = *state_;
  state.options = std::move(options);
  state.world_size = shoal::world_size();
  const int layer_count = static_cast<int>(net->size());
  place_stages(state, layer_count);
  const int stages = state.stages();

  if (state.options.split.empty()) {
    std::vector<int64_t> weights;
    for (const auto& layer : *net) weights.push_back(parameter_count(*layer.ptr()));
    state.split = balanced_split(weights, stages);
  } else {
    state.split = state.options.split;
    int total = 0;
    for (int s = 0; s < stages; ++s) {
      if (state.split[s] < 1) {
        throw UsageError("pipeline: split " + join(state.split) + " gives stage " +
                         std::to_string(s) + " no layer; every stage needs at least one");
      }
      total += state.split[s];
    }
    if (total != layer_count) {
      throw UsageError("pipeline: split " + join(state.split) + " has " + std::to_string(total) +
                       " layers; the model has " + std::to_string(layer_count));
    }
  }

  // Keep this worker's layers; find the weights that stages on different workers share.
  state.layers.resize(stages);
  std::vector<int> stage_of_layer;
  for (int s = 0; s < stages; ++s) stage_of_layer.insert(stage_of_layer.end(), state.split[s], s);
  std::unordered_map<const void*, std::set<int>> workers_of;  // parameter -> workers using it
  std::vector<torch::Tensor> in_order;                        // every parameter, first use first
  int layer_index = 0;
  for (const auto& layer : *net) {
    const int s = stage_of_layer[layer_index++];
    if (state.schedule.worker_of(s) == state.me) state.layers[s].push_back(layer);
    for (const auto& p : layer.ptr()->parameters()) {
      auto& used = workers_of[p.unsafeGetTensorImpl()];
      if (used.empty()) in_order.push_back(p);
      used.insert(state.schedule.worker_of(s));
    }
  }
  for (const auto& p : in_order) {
    const auto& used = workers_of[p.unsafeGetTensorImpl()];
    const bool mine = used.count(state.me) > 0;
    if (mine) state.parameters.push_back(p);
    if (used.size() > 1) {
      state.tied.push_back(mine ? p : torch::Tensor());
      state.tied_numel.push_back(p.numel());
      state.tied_dtype.push_back(p.scalar_type());
    }
  }
}

namespace {

// One stage's work on one micro-batch, from its forward to its backward.
struct Slot {
  torch::Tensor input;        // the stage's input, a leaf (its .grad is what SG sends)
  torch::Tensor output;       // the stage's output; on the last stage, the weighted loss
  torch::Tensor grad_output;  // the gradient of the output, received (RG)
  torch::Tensor grad_input;   // the gradient of the input, after B or I
  bool has_grad_input = false;
  std::unique_ptr<detail::SplitBackward> split;  // between I and W
};

// A transfer in flight, waited on before the step ends.
struct PendingSend {
  comm::Work work;
  std::string what;
};

class StepRun {
 public:
  StepRun(Pipeline::State& state, const torch::Tensor& input, const torch::Tensor& target,
          const LossFunction& loss)
      : state_(state), loss_(loss), group_(shoal::world()) {
    rows_ = input.size(0);
    sizes_ = comm::split_sizes(rows_, state.schedule.micro_batches);
    const int last = state.stages() - 1;
    if (state.schedule.worker_of(0) == state.me) inputs_ = input.split_with_sizes(sizes_);
    if (state.schedule.worker_of(last) == state.me) targets_ = target.split_with_sizes(sizes_);
  }

  // Runs this worker's actions; returns this worker's part of the loss (0 unless it holds the
  // last stage).
  double run() {
    if (state_.me < 0) return 0;
    for (const Action& action : state_.schedule.actions[state_.me]) execute(action);
    for (auto& send : sends_) wait(send.work, send.what);
    return loss_sum_;
  }

  // After a UsageError on this worker: give the peer the header that tells it the same (Note
  // [Shape headers]), within the deadline, whatever becomes of it.
  void flush_header() {
    if (!header_send_) return;
    try {
      header_send_->wait();
    } catch (const std::exception&) {
    }
  }

 private:
  Slot& slot(int stage, int micro_batch) { return slots_[{stage, micro_batch}]; }
  bool here(int stage) const { return state_.schedule.worker_of(stage) == state_.me; }
  std::string where(int stage) const {
    return "stage " + std::to_string(stage) + " (worker " + std::to_string(state_.rank_of(stage)) +
           ")";
  }

  void wait(comm::Work& work, const std::string& what) {
    try {
      work.wait();
    } catch (const CommError& e) {
      throw CommError("pipeline: " + what + ": " + e.what());
    }
  }

  void execute(const Action& a) {
    std::optional<timeline::Slice> slice;
    if (timeline::enabled()) {
      slice.emplace(a.short_name(), "pipeline",
                    timeline::Args{{"stage", a.stage}, {"micro_batch", a.micro_batch}});
    }
    switch (a.kind) {
      case ActionKind::kForward:
        return forward(a.stage, a.micro_batch);
      case ActionKind::kBackward:
        return backward(a.stage, a.micro_batch);
      case ActionKind::kBackwardInput:
        return backward_input(a.stage, a.micro_batch);
      case ActionKind::kBackwardWeight:
        return backward_weight(a.stage, a.micro_batch);
      case ActionKind::kSendActivation:
        return send_activation(a.stage, a.micro_batch);
      case ActionKind::kRecvActivation:
        return recv_activation(a.stage, a.micro_batch);
      case ActionKind::kSendGradient:
        return send_gradient(a.stage, a.micro_batch);
      case ActionKind::kRecvGradient:
        return recv_gradient(a.stage, a.micro_batch);
    }
  }

  void forward(int stage, int mb) {
    Slot& own = slot(stage, mb);
    torch::Tensor source;
    if (stage == 0) {
      source = inputs_[mb];
    } else if (here(stage - 1)) {
      source = slot(stage - 1, mb).output;
    } else {
      source = own.input;  // received (RA)
    }
    SHOAL_CHECK(source.defined()) << "forward of stage " << stage << ", micro-batch " << mb
                                  << " has no input";
    own.input = source.detach();
    if (own.input.is_floating_point()) own.input.requires_grad_(true);
    torch::Tensor x = own.input;
    for (auto& layer : state_.layers[stage]) x = layer.forward(x);
    if (stage == state_.stages() - 1) {
      torch::Tensor loss = loss_(x, targets_[mb]);
      if (loss.dim() != 0) {
        throw UsageError("pipeline: the loss function returned shape " + shape_of(loss.sizes()) +
                         "; expected a scalar (the micro-batch's mean loss)");
      }
      // The micro-batch's share of the batch's mean loss (docs/pipeline.md, "Micro-batches").
      const double share = static_cast<double>(sizes_[mb]) / static_cast<double>(rows_);
      x = loss * share;
      loss_sum_ += x.item<double>();
    }
    own.output = x;
  }

  // The gradient of the stage's output: 1 for the last stage's weighted loss, else what the
  // next stage computed (here, or received by RG).
  torch::Tensor output_gradient(int stage, int mb) {
    Slot& own = slot(stage, mb);
    torch::Tensor grad;
    if (stage == state_.stages() - 1) {
      grad = torch::ones_like(own.output);
    } else if (here(stage + 1)) {
      Slot& next = slot(stage + 1, mb);
      SHOAL_CHECK(next.has_grad_input) << "stage " << stage + 1 << " has no input gradient";
      grad = next.grad_input;
      next.grad_input = torch::Tensor();
      next.has_grad_input = false;
    } else {
      grad = own.grad_output;
    }
    SHOAL_CHECK(grad.defined()) << "backward of stage " << stage << ", micro-batch " << mb
                                << " has no output gradient";
    return grad;
  }

  // B: the whole backward, input and weight gradients at once.
  void backward(int stage, int mb) {
    Slot& own = slot(stage, mb);
    const torch::Tensor grad = output_gradient(stage, mb);
    if (own.output.requires_grad()) torch::autograd::backward({own.output}, {grad});
    if (own.input.requires_grad()) {
      own.grad_input = own.input.grad();
      if (!own.grad_input.defined()) own.grad_input = torch::zeros_like(own.input);
      own.has_grad_input = true;
    }
    release(own);
  }

  // I: the input's gradient only; the weights' wait for W (detail::SplitBackward).
  void backward_input(int stage, int mb) {
    Slot& own = slot(stage, mb);
    const torch::Tensor grad = output_gradient(stage, mb);
    if (own.output.requires_grad()) {
      own.split = std::make_unique<detail::SplitBackward>(
          own.output, own.input.requires_grad() ? own.input : torch::Tensor());
      own.grad_input = own.split->input_gradient(grad);
    }
    if (own.input.requires_grad()) {
      if (!own.grad_input.defined()) own.grad_input = torch::zeros_like(own.input);
      own.has_grad_input = true;
    }
    release(own);
  }

  // W: the weights' gradients of a backward whose I ran.
  void backward_weight(int stage, int mb) {
    Slot& own = slot(stage, mb);
    if (own.split) own.split->weight_gradient();
    own.split.reset();
  }

  // The micro-batch's stash goes once its backward (or I) has run.
  static void release(Slot& own) {
    own.output = torch::Tensor();
    own.grad_output = torch::Tensor();
    own.input = torch::Tensor();
  }

  void send_activation(int stage, int mb) {
    const torch::Tensor out = slot(stage, mb).output.detach();
    const int dst = state_.rank_of(stage + 1);
    const std::string what = "sending " + where(stage) + "'s activation for micro-batch " +
                             std::to_string(mb) + " to " + where(stage + 1);
    torch::Tensor header = header_of(out);
    header_send_ = group_.send_async(header, dst, state_.p2p(kShapeHeader, stage, mb));
    sends_.push_back({*header_send_, what + " (its shape)"});
    check_shape(stage, mb, header);
    sends_.push_back({group_.send_async(out, dst, state_.p2p(kActivation, stage, mb)), what});
    header_send_.reset();
  }

  void recv_activation(int stage, int mb) {
    const int src = state_.rank_of(stage - 1);
    const std::string what = where(stage) + " receiving the activation for micro-batch " +
                             std::to_string(mb) + " from " + where(stage - 1);
    auto header = torch::empty({kHeaderLength}, torch::kInt64);
    wait_recv(header, src, state_.p2p(kShapeHeader, stage - 1, mb), what + " (its shape)");
    const Shape& shape = check_shape(stage - 1, mb, header);
    auto& buffer = state_.activation_buffers[{rows_, stage - 1, mb}];
    if (!buffer.defined()) {
      buffer = torch::empty(
          shape.sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(shape.dtype)));
    }
    wait_recv(buffer, src, state_.p2p(kActivation, stage - 1, mb), what);
    slot(stage, mb).input = buffer;
  }

  void send_gradient(int stage, int mb) {
    Slot& own = slot(stage, mb);
    SHOAL_CHECK(own.has_grad_input)
        << "stage " << stage << " micro-batch " << mb << " sends a gradient it has not computed";
    sends_.push_back({group_.send_async(own.grad_input, state_.rank_of(stage - 1),
                                        state_.p2p(kGradient, stage, mb)),
                      "sending " + where(stage) + "'s input gradient for micro-batch " +
                          std::to_string(mb) + " to " + where(stage - 1)});
    own.grad_input = torch::Tensor();
  }

  void recv_gradient(int stage, int mb) {
    // The gradient has the shape of the activation this worker sent (already checked).
    const Shape& shape = state_.learned.at({rows_, stage, mb});
    auto& buffer = state_.gradient_buffers[{rows_, stage, mb}];
    if (!buffer.defined()) {
      buffer = torch::empty(
          shape.sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(shape.dtype)));
    }
    wait_recv(buffer, state_.rank_of(stage + 1), state_.p2p(kGradient, stage + 1, mb),
              where(stage) + " receiving its output's gradient for micro-batch " +
                  std::to_string(mb) + " from " + where(stage + 1));
    slot(stage, mb).grad_output = buffer;
  }

  void wait_recv(torch::Tensor& buffer, int src, const comm::PointToPointOptions& options,
                 const std::string& what) {
    auto work = group_.recv_async(buffer, src, options);
    wait(work, what);
  }

  // The shape crossing the boundary after `stage`, against what the first step with this batch
  // size sent (Note [Shape headers]). Raised the same on both sides.
  const Shape& check_shape(int stage, int mb, const torch::Tensor& header) {
    const auto* data = header.data_ptr<int64_t>();
    const std::string crossing = "the activation from " + where(stage) + " to " + where(stage + 1) +
                                 " for micro-batch " + std::to_string(mb);
    if (data[1] < 0 || data[1] > kMaxDims) {
      throw UsageError("pipeline: " + crossing + " has more than " + std::to_string(kMaxDims) +
                       " dimensions");
    }
    Shape shape;
    shape.dtype = data[0];
    shape.sizes.assign(data + 2, data + 2 + data[1]);
    auto [known, added] = state_.learned.emplace(std::make_tuple(rows_, stage, mb), shape);
    if (!added && !(known->second == shape)) {
      throw UsageError("pipeline: " + crossing + " has shape " + shape.describe() +
                       ", but the first step with a batch of " + std::to_string(rows_) +
                       " rows sent " + known->second.describe() +
                       " (a stage's output shape may depend only on its input's)");
    }
    return known->second;
  }

  Pipeline::State& state_;
  const LossFunction& loss_;
  comm::Group& group_;
  int64_t rows_ = 0;
  comm::Sizes sizes_;
  std::vector<torch::Tensor> inputs_, targets_;
  std::map<std::pair<int, int>, Slot> slots_;
  std::vector<PendingSend> sends_;
  std::optional<comm::Work> header_send_;
  double loss_sum_ = 0;
};

}  // namespace

torch::Tensor Pipeline::step(const torch::Tensor& input, const torch::Tensor& target,
                             const LossFunction& loss) {
  State& state = *state_;
  if (!state.broken.empty()) {
    throw UsageError("pipeline: an earlier step failed (" + state.broken +
                     "); the pipeline cannot go on");
  }
  if (!input.defined() || input.dim() == 0 || !target.defined() || target.dim() == 0) {
    throw UsageError("pipeline: step() expects an input and a target with a batch dimension");
  }
  if (input.size(0) != target.size(0)) {
    throw UsageError("pipeline: the input has " + std::to_string(input.size(0)) +
                     " rows and the target " + std::to_string(target.size(0)) +
                     "; expected the same batch");
  }
  const int m = state.schedule.micro_batches;
  if (input.size(0) < m) {
    throw UsageError("pipeline: a batch of " + std::to_string(input.size(0)) +
                     " rows cannot be cut into " + std::to_string(m) +
                     " micro-batches; expected at least one row each");
  }
  if (!loss) throw UsageError("pipeline: step() needs a loss function");

  // Tied weights: remember what .grad held, so that only this step's part is summed.
  std::vector<torch::Tensor> before;
  for (const auto& p : state.tied) {
    before.push_back(p.defined() && p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }

  double loss_part = 0;
  StepRun run(state, input, target, loss);
  try {
    loss_part = run.run();
  } catch (const UsageError& e) {
    state.broken = e.what();
    run.flush_header();
    throw;
  } catch (const std::exception& e) {
    state.broken = e.what();
    throw;
  }

  auto& world = shoal::world();
  try {
    if (!state.tied.empty()) {
      // Sum the tied weights' gradients over the workers that use them, with one all-reduce
      // over the world (zeros from the others).
      int64_t total = 0;
      for (auto n : state.tied_numel) total += n;
      auto flat = torch::zeros({total}, torch::kFloat64);
      int64_t offset = 0;
      for (size_t t = 0; t < state.tied.size(); ++t) {
        const auto& p = state.tied[t];
        if (p.defined() && p.grad().defined()) {
          auto delta = before[t].defined() ? p.grad() - before[t] : p.grad();
          flat.narrow(0, offset, state.tied_numel[t]).copy_(delta.reshape(-1));
        }
        offset += state.tied_numel[t];
      }
      comm::AllReduceOptions options;
      options.timeout = state.options.timeout;
      world.all_reduce(flat, options);
      offset = 0;
      for (size_t t = 0; t < state.tied.size(); ++t) {
        auto& p = state.tied[t];
        if (p.defined()) {
          auto sum = flat.narrow(0, offset, state.tied_numel[t]).view(p.sizes()).to(p.dtype());
          p.mutable_grad() = before[t].defined() ? before[t] + sum : sum;
        }
        offset += state.tied_numel[t];
      }
    }
    // The loss lives on the last stage's worker; every worker returns it.
    auto value = torch::full({}, loss_part, torch::kFloat64);
    comm::BroadcastOptions options;
    options.root = state.rank_of(state.stages() - 1);
    options.timeout = state.options.timeout;
    world.broadcast(value, options);
    return value;
  } catch (const CommError& e) {
    state.broken = e.what();
    throw CommError(std::string("pipeline: ending the step: ") + e.what());
  }
}

Pipeline::~Pipeline() = default;

std::vector<torch::Tensor> Pipeline::parameters() const {
  return state_->parameters;
}
const std::vector<int>& Pipeline::split() const {
  return state_->split;
}
int Pipeline::stages() const {
  return state_->stages();
}
int Pipeline::worker_of(int stage) const {
  if (stage < 0 || stage >= stages()) {
    throw UsageError("pipeline: stage " + std::to_string(stage) + " is not one of the " +
                     std::to_string(stages()) + " stages");
  }
  return state_->rank_of(stage);
}
const Schedule& Pipeline::schedule() const {
  return state_->schedule;
}
std::vector<int> Pipeline::local_stages() const {
  std::vector<int> mine;
  for (int s = 0; s < stages(); ++s) {
    if (state_->schedule.worker_of(s) == state_->me) mine.push_back(s);
  }
  return mine;
}

}  // namespace shoal::pipeline
