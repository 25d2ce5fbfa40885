// Pipeline::step(): one worker's actions of the schedule, in order.
#include <algorithm>
#include <map>
#include <optional>

#include <torch/autograd.h>

#include "dp/shards.h"
#include "pipeline_state.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"
#include "shoal/global/tensor.h"
#include "shoal/runtime/init.h"
#include "split_backward.h"

namespace shoal::pipeline {

using namespace detail;

namespace {

// One stage's work on one micro-batch, from its forward to its backward.
struct Slot {
  torch::Tensor input;        // the stage's input, a leaf (its .grad is what SG sends)
  torch::Tensor output;       // the stage's output; on the last stage, the weighted loss
  torch::Tensor grad_output;  // the gradient of the output, received (RG)
  torch::Tensor grad_input;   // the gradient of the input, after B or I
  bool has_grad_input = false;
  std::unique_ptr<detail::SplitBackward> split;  // between I and W
  // Global layers: the layout and global shape of the input (received) and of the output, whose
  // pieces `input` and `output` are; and the last stage's backward seed (GlobalTensor::backward's).
  std::vector<global::Sbp> input_sbp, output_sbp;
  std::vector<int64_t> input_shape, output_shape;
  torch::Tensor seed;
};

// A transfer in flight, waited on before the step ends.
struct PendingSend {
  comm::Work work;
  std::string what;
};

class StepRun {
 public:
  StepRun(Pipeline::State& state, const torch::Tensor& input, const torch::Tensor& target,
          const LossFunction& loss, const GlobalLossFunction& global_loss)
      : state_(state), loss_(loss), global_loss_(global_loss), group_(shoal::world()) {
    const int last = state.stages() - 1;
    if (state.global) {
      // Every member of a stage makes each micro-batch a global tensor from the whole of it, as
      // from_full does (Note [Member-wise transfers]).
      rows_ = input.size(0);
      sizes_ = comm::split_sizes(rows_, state.schedule.micro_batches);
      if (state.schedule.worker_of(0) == state.me) inputs_ = input.split_with_sizes(sizes_);
      if (state.schedule.worker_of(last) == state.me) targets_ = target.split_with_sizes(sizes_);
      return;
    }
    // With a data axis, replica j runs the j-th share of the batch's rows through its own copy
    // of the pipeline; each micro-batch's loss is weighed by its rows over the whole batch's.
    rows_ = input.size(0);
    const auto shares = comm::split_sizes(rows_, state.replicas);
    int64_t offset = 0;
    for (int j = 0; j < state.replica; ++j) offset += shares[j];
    sizes_ = comm::split_sizes(shares[state.replica], state.schedule.micro_batches);
    if (state.schedule.worker_of(0) == state.me) {
      inputs_ = input.narrow(0, offset, shares[state.replica]).split_with_sizes(sizes_);
    }
    if (state.schedule.worker_of(last) == state.me) {
      targets_ = target.narrow(0, offset, shares[state.replica]).split_with_sizes(sizes_);
    }
  }

  // Runs this worker's actions; returns this worker's part of the loss (0 unless it holds the
  // last stage).
  double run() {
    if (state_.me < 0) return 0;
    training_ = true;
    post_receives();
    for (const Action& action : state_.schedule.actions[state_.me]) {
      execute(action);
      count_stash(action);
    }
    for (auto& send : sends_) wait(send.work, send.what);
    return loss_sum_;
  }

  // Forwards only (Pipeline::evaluate()): each micro-batch through this worker's stages in
  // order, receiving before and sending after where the neighbouring stage is elsewhere. Every
  // worker goes through the micro-batches in the same order and sends without waiting, so a
  // receive always has its send coming. Returns this worker's part of the loss, as run().
  double run_forward() {
    if (state_.me < 0) return 0;
    const int last = state_.stages() - 1;
    for (int mb = 0; mb < state_.schedule.micro_batches; ++mb) {
      for (int s = 0; s <= last; ++s) {
        if (!here(s)) continue;
        if (s > 0 && !here(s - 1)) execute({ActionKind::kRecvActivation, s, mb});
        execute({ActionKind::kForward, s, mb});
        if (s < last && !here(s + 1)) execute({ActionKind::kSendActivation, s, mb});
      }
    }
    for (auto& send : sends_) wait(send.work, send.what);
    return loss_sum_;
  }

  // Per local stage, in order: the peaks count_stash() saw.
  std::vector<StageStepStats> stats() const {
    std::vector<StageStepStats> out;
    for (const auto& [stage, stash] : stash_) out.push_back(stash.peak);
    return out;
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

  // A micro-batch is stashed on its stage from its forward until its B, or W when split
  // (simulate()'s peak_in_flight); its bytes are the stage's input and output after the forward.
  void count_stash(const Action& a) {
    Stash& stash = stash_[a.stage];
    stash.peak.stage = a.stage;
    if (a.kind == ActionKind::kForward) {
      const Slot& own = slot(a.stage, a.micro_batch);
      const int64_t bytes = nbytes(own.input) + nbytes(own.output);
      stash.bytes[a.micro_batch] = bytes;
      ++stash.count;
      stash.total += bytes;
      stash.peak.peak_stashed = std::max(stash.peak.peak_stashed, stash.count);
      stash.peak.peak_stashed_bytes = std::max(stash.peak.peak_stashed_bytes, stash.total);
    } else if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) {
      --stash.count;
      stash.total -= stash.bytes.at(a.micro_batch);
    }
  }
  static int64_t nbytes(const torch::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  }

  void execute(const Action& a) {
    std::optional<timeline::Slice> slice;
    if (timeline::enabled()) {
      slice.emplace(a.short_name(), "pipeline",
                    timeline::Args{{"stage", a.stage}, {"micro_batch", a.micro_batch}});
    }
    try {
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
    } catch (const CommError& e) {
      // A transfer's error names it already; a computation's comes from the stage's own
      // collectives (global layers' boxing, a tensor axis's all-reduces).
      const bool transfer =
          a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvActivation ||
          a.kind == ActionKind::kSendGradient || a.kind == ActionKind::kRecvGradient;
      if (transfer) throw;
      throw CommError("pipeline: " + where(a.stage) + " in " + a.short_name() + ": " + e.what());
    }
  }

  void forward(int stage, int mb) {
    if (state_.global) return forward_global(stage, mb);
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
    // The first stage's input (the batch) needs no gradient: nobody receives it.
    if (stage > 0 && own.input.is_floating_point()) own.input.requires_grad_(true);
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

  // Note [Member-wise transfers]
  // Every stage of global layers sits on a mesh of one shape. Member i of a stage runs the
  // stage's actions on its pieces, and its collectives (the tensor axes' all-reduces, boxing)
  // involve only that stage's members, which run the same actions in the same order. Between
  // stages, member i sends its piece of the activation to member i of the next stage, with its
  // SBP and global shape in the header; the receiver makes it a global tensor on its own
  // placement with that SBP, and sends back the gradient of its piece. The transfer is the
  // identity on each piece, so the pieces' autograd stays exact: it is to_global() between two
  // placements of the same shape and SBP, done by the schedule's sends instead of boxing (which
  // every worker of the job would call).
  void forward_global(int stage, int mb) {
    Slot& own = slot(stage, mb);
    const int last = state_.stages() - 1;
    const global::NdSbp batch(state_.batch);
    global::GlobalTensor x;
    if (stage == 0) {
      x = global::GlobalTensor::from_full(inputs_[mb], state_.stage_placements[0], batch);
      own.input = x.to_local();
    } else {
      const bool local = here(stage - 1);
      Slot& source = local ? slot(stage - 1, mb) : own;
      const torch::Tensor piece = local ? source.output : own.input;
      SHOAL_CHECK(piece.defined())
          << "forward of stage " << stage << ", micro-batch " << mb << " has no input";
      own.input = piece.detach();
      if (own.input.is_floating_point()) own.input.requires_grad_(true);
      x = global::GlobalTensor(own.input, state_.stage_placements[stage],
                               global::NdSbp(local ? source.output_sbp : own.input_sbp),
                               local ? source.output_shape : own.input_shape);
    }
    int index = 0;
    for (auto& layer : state_.layers[stage]) {
      try {
        x = layer.forward<global::GlobalTensor>(x);
      } catch (const c10::Error& e) {
        throw UsageError(
            "pipeline: layer " + std::to_string(index) + " of stage " + std::to_string(stage) +
            " (" + layer.ptr()->name() +
            ") does not map a GlobalTensor to a GlobalTensor: " + e.what_without_backtrace());
      }
      ++index;
    }
    if (stage != last) {
      own.output = x.to_local();
      own.output_sbp = x.sbp().axes();
      own.output_shape = x.shape();
      return;
    }
    const auto target =
        global::GlobalTensor::from_full(targets_[mb], state_.stage_placements[last], batch);
    const global::GlobalTensor loss = global_loss_(x, target);
    if (!loss.defined() || loss.numel() != 1 || loss.placement() != state_.stage_placements[last]) {
      throw UsageError("pipeline: the loss function returned " + loss.describe() +
                       "; expected a scalar on the last stage's placement " +
                       state_.stage_placements[last].describe() + " (the micro-batch's mean loss)");
    }
    // The weighted loss's piece; seeded as GlobalTensor::backward() seeds, so that the pieces'
    // seeded sum is the global value (docs/pipeline.md, "Micro-batches").
    const double share = static_cast<double>(sizes_[mb]) / static_cast<double>(rows_);
    own.output = loss.to_local() * share;
    own.seed = loss.backward_seed();
    loss_sum_ += (own.output.detach() * own.seed).sum().item<double>();
  }

  // The gradient of the stage's output: 1 for the last stage's weighted loss (its seed, with
  // global layers), else what the next stage computed (here, or received by RG).
  torch::Tensor output_gradient(int stage, int mb) {
    Slot& own = slot(stage, mb);
    torch::Tensor grad;
    if (stage == state_.stages() - 1) {
      grad = own.seed.defined() ? own.seed : torch::ones_like(own.output);
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
    own.seed = torch::Tensor();
  }

  void send_activation(int stage, int mb) {
    const Slot& own = slot(stage, mb);
    const torch::Tensor out = own.output.detach();
    const int dst = state_.rank_of(stage + 1);
    const std::string what = "sending " + where(stage) + "'s activation for micro-batch " +
                             std::to_string(mb) + " to " + where(stage + 1);
    torch::Tensor header = header_of(out, own.output_sbp, own.output_shape);
    header_send_ = group_.send_async(header, dst, state_.p2p(kShapeHeader, stage, mb));
    sends_.push_back({*header_send_, what + " (its shape)"});
    const Shape& shape = check_shape(stage, mb, header);
    sends_.push_back({group_.send_async(out, dst, state_.p2p(kActivation, stage, mb)), what});
    header_send_.reset();
    if (training_) post(kGradient, stage, mb, shape);
  }

  void recv_activation(int stage, int mb) {
    const std::string what = where(stage) + " receiving the activation for micro-batch " +
                             std::to_string(mb) + " from " + where(stage - 1);
    if (!posted_.count({kShapeHeader, stage - 1, mb})) post_header(stage - 1, mb);
    Posted& header = posted_.at({kShapeHeader, stage - 1, mb});
    wait(header.work, what + " (its shape)");
    const Shape& shape = check_shape(stage - 1, mb, header.buffer);
    if (!posted_.count({kActivation, stage - 1, mb})) post(kActivation, stage - 1, mb, shape);
    Posted& payload = posted_.at({kActivation, stage - 1, mb});
    wait(payload.work, what);
    Slot& own = slot(stage, mb);
    own.input = payload.buffer;
    own.input_sbp = shape.sbp;
    own.input_shape = shape.global_sizes;
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
    // Posted when the activation went (send_activation).
    Posted& gradient = posted_.at({kGradient, stage, mb});
    wait(gradient.work, where(stage) + " receiving its output's gradient for micro-batch " +
                            std::to_string(mb) + " from " + where(stage + 1));
    slot(stage, mb).grad_output = gradient.buffer;
  }

  // Note [Receives posted early]
  // Gloo moves a message only once its receive is posted: the receiver's notice wakes the
  // sender's network thread, which on a core busy with the next micro-batch waits for a time
  // slice (up to 3 ms here, against 0.01 ms when posted ahead; docs/pipeline.md, "Transfers and
  // shapes"). So each receive is posted as soon as its size is known: every activation's header
  // at the step's start, and its payload too once the first step with this batch size learned
  // its shape; an output's gradient when its activation is sent (its shape is the activation's).
  // A receive's deadline runs from its post, as a send's does. A header whose shape differs from
  // the learned one fails both sides before the payload is sent (Note [Shape headers]), so a
  // payload posted ahead never meets bytes of another size.
  void post_receives() {
    for (const Action& a : state_.schedule.actions[state_.me]) {
      if (a.kind != ActionKind::kRecvActivation) continue;
      post_header(a.stage - 1, a.micro_batch);
      const auto known = state_.learned.find({rows_, a.stage - 1, a.micro_batch});
      if (known != state_.learned.end()) post(kActivation, a.stage - 1, a.micro_batch, known->second);
    }
  }

  // The header of the activation `stage` sends the next stage for micro-batch `mb`.
  void post_header(int stage, int mb) {
    Posted& header = posted_[{kShapeHeader, stage, mb}];
    header.buffer = torch::empty({kHeaderLength}, torch::kInt64);
    header.work =
        group_.recv_async(header.buffer, state_.rank_of(stage), state_.p2p(kShapeHeader, stage, mb));
  }

  // The activation crossing from `stage` to the next (kActivation), or its gradient coming back
  // (kGradient), for micro-batch `mb`, of `shape`: into a buffer kept from step to step.
  void post(Channel channel, int stage, int mb, const Shape& shape) {
    const bool activation = channel == kActivation;
    auto& buffers = activation ? state_.activation_buffers : state_.gradient_buffers;
    torch::Tensor& buffer = buffers[{rows_, stage, mb}];
    if (!buffer.defined()) {
      buffer = torch::empty(
          shape.sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(shape.dtype)));
    }
    const int sender = activation ? stage : stage + 1;
    Posted& posted = posted_[{channel, stage, mb}];
    posted.buffer = buffer;
    posted.work = group_.recv_async(buffer, state_.rank_of(sender), state_.p2p(channel, sender, mb));
  }

  // The shape crossing the boundary after `stage`, against what the first step with this batch
  // size sent (Note [Shape headers]). Raised the same on both sides.
  const Shape& check_shape(int stage, int mb, const torch::Tensor& header) {
    const std::string crossing = "the activation from " + where(stage) + " to " + where(stage + 1) +
                                 " for micro-batch " + std::to_string(mb);
    const std::optional<Shape> read = shape_of_header(header);
    if (!read) {
      throw UsageError("pipeline: " + crossing + " has more than " + std::to_string(kMaxDims) +
                       " dimensions (or its placement more than " + std::to_string(kMaxAxes) +
                       " axes)");
    }
    const Shape& shape = *read;
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
  const GlobalLossFunction& global_loss_;
  comm::Group& group_;
  int64_t rows_ = 0;
  comm::Sizes sizes_;
  std::vector<torch::Tensor> inputs_, targets_;
  std::map<std::pair<int, int>, Slot> slots_;
  // Per local stage: the micro-batches stashed now, their bytes, and the step's peaks.
  struct Stash {
    int count = 0;
    int64_t total = 0;
    std::map<int, int64_t> bytes;  // by micro-batch
    StageStepStats peak;
  };
  std::map<int, Stash> stash_;
  std::vector<PendingSend> sends_;
  std::optional<comm::Work> header_send_;
  // Receives posted ahead (Note [Receives posted early]), by (channel, the stage before the
  // boundary, micro-batch); and whether gradients come back (a training step, not evaluate()).
  struct Posted {
    torch::Tensor buffer;
    comm::Work work;
  };
  std::map<std::tuple<Channel, int, int>, Posted> posted_;
  bool training_ = false;
  double loss_sum_ = 0;
};

}  // namespace

namespace {

// Note [Summing a step's gradients]
// A weight's gradient is summed over the workers that hold parts of it (a tied weight's users, a
// global piece's holders, a stage's replicas) once per step, after every micro-batch's backward:
// on dp's bucketed engine, as DataParallel and GradientSync sum theirs, but with no hook in
// backward, which runs once per micro-batch here (dp::Reducer::sum_gradients). One reducer per
// set of workers, each made with its group just before its first sum (the pipeline's constructor
// does no communication, and a set's members make and use it together, as they did the group
// alone). Only what the step added is summed (what .grad held before it is given as `since`), so
// that gradients accumulated over steps are not summed again. The sum is in the parameters' dtype
// over a handful of workers, as DataParallel's buckets are; each .grad is afterwards its slice of
// its bucket.
std::unique_ptr<dp::Reducer> step_sum(std::vector<torch::Tensor> parameters, comm::Group group) {
  dp::ReducerOptions options;
  options.during_backward = false;
  return std::make_unique<dp::Reducer>(std::move(parameters), std::move(group), options);
}

std::vector<torch::Tensor> gradients_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    grads.push_back(p.defined() && p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  return grads;
}

// The sum of the loss parts over the world: the batch's mean loss, on every worker.
torch::Tensor total_loss(const Pipeline::State& state, double part) {
  auto value = torch::full({}, part, torch::kFloat64);
  comm::AllReduceOptions options;
  options.timeout = state.options.timeout;
  shoal::world().all_reduce(value, options);
  return value;
}

// Pipeline::evaluate(): forwards only, with no autograd graph.
torch::Tensor evaluate_step(Pipeline::State& state, const torch::Tensor& input,
                            const torch::Tensor& target, const LossFunction& loss,
                            const GlobalLossFunction& global_loss) {
  std::optional<timeline::Slice> slice;
  if (timeline::enabled()) slice.emplace("evaluate", "pipeline");
  double part = 0;
  if (state.zero) state.zero->start();
  StepRun run(state, input, target, loss, global_loss);
  try {
    torch::NoGradGuard no_grad;
    part = run.run_forward();
  } catch (const UsageError& e) {
    state.broken = e.what();
    run.flush_header();
    throw;
  } catch (const std::exception& e) {
    state.broken = e.what();
    throw;
  }
  try {
    return total_loss(state, part);
  } catch (const CommError& e) {
    state.broken = e.what();
    throw CommError(std::string("pipeline: ending the evaluation: ") + e.what());
  }
}

}  // namespace

torch::Tensor Pipeline::run_step(const torch::Tensor& input, const torch::Tensor& target,
                                 const LossFunction& loss, const GlobalLossFunction& global_loss,
                                 bool train) {
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
  const int64_t replicas = state.rows_per_micro_batch();
  if (input.size(0) < int64_t{m} * replicas) {
    throw UsageError(
        "pipeline: a batch of " + std::to_string(input.size(0)) + " rows cannot be cut into " +
        std::to_string(m) + " micro-batches" +
        (replicas > 1 ? " for each of " + std::to_string(replicas) + " replicas" : std::string()) +
        "; expected at least one row each");
  }
  if (state.global ? !global_loss : !loss) {
    throw UsageError(state.global
                         ? "pipeline: the layers are global; step() needs a loss function of "
                           "GlobalTensors (GlobalLossFunction)"
                         : "pipeline: step() needs a loss function of torch tensors");
  }

  if (!train) return evaluate_step(state, input, target, loss, global_loss);
  // Only this step's part of the gradients is summed across workers.
  const auto tied_before = gradients_of(state.tied);
  const auto replicated_before =
      state.replicas > 1 ? gradients_of(state.replicated) : std::vector<torch::Tensor>();
  // Under ZeRO a set's earlier sums lie in its slices apart from what the step adds (Note [Sums
  // set apart], src/dp/shards.h): nothing to keep.
  std::vector<std::vector<torch::Tensor>> holders_before;
  for (const auto& [holders, parameters] : state.holders)
    holders_before.push_back(state.zero ? std::vector<torch::Tensor>() : gradients_of(parameters));

  // ZeRO: from the first step on, pieces are gathered when the stages read them.
  if (state.zero) state.zero->start();
  // The whole step as one slice, around its actions' (docs/pipeline.md, "Timeline").
  std::optional<timeline::Slice> step_slice;
  if (timeline::enabled()) step_slice.emplace("step", "pipeline");

  double loss_part = 0;
  StepRun run(state, input, target, loss, global_loss);
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

  try {
    // See Note [Summing a step's gradients]. A tied weight's gradient: the sum over every worker
    // that uses it (all replicas too).
    auto& world = shoal::world();
    const Duration timeout = state.options.timeout;
    if (!state.tied.empty()) {
      if (!state.tied_sum) state.tied_sum = step_sum(state.tied, world);
      state.tied_sum->sum_gradients(tied_before, timeout);
    }
    // Global layers: each parameter's over the workers holding the same piece, in the sorted
    // order of those sets, so that two workers sharing two sets make and use them alike.
    for (size_t h = 0; h < state.holders.size(); ++h) {
      if (state.zero) {
        // ZeRO: into this worker's slices; the pieces are gathered again when next read.
        state.zero->shards(h)->sum_gradients(state.zero->group(h), state.options.unit_bytes,
                                             timeout);
        state.zero->slices_changed(h);
        continue;
      }
      if (state.holder_sums.size() == h) {
        std::vector<int> positions;
        const auto& members = world.members();
        for (int r : state.holders[h].first) {
          positions.push_back(
              static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin()));
        }
        state.holder_sums.push_back(step_sum(state.holders[h].second, world.subgroup(positions)));
      }
      state.holder_sums[h]->sum_gradients(holders_before[h], timeout);
    }
    // A stage's other gradients: the sum over its replicas.
    if (!state.global && state.replicas > 1 && state.me >= 0) {
      if (!state.replica_sum) {
        state.replica_sum = step_sum(state.replicated, world.subgroup(state.ranks[state.me]));
      }
      state.replica_sum->sum_gradients(replicated_before, timeout);
    }
    // The loss: the parts of the last stage's workers (one per replica); every worker returns it.
    auto value = total_loss(state, loss_part);
    state.last_stats = run.stats();
    return value;
  } catch (const CommError& e) {
    state.broken = e.what();
    throw CommError(std::string("pipeline: ending the step: ") + e.what());
  }
}

}  // namespace shoal::pipeline
