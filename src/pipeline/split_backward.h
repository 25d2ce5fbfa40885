// One micro-batch's backward through one stage, in the two halves that zero-bubble schedules run
// at different times: I, the gradient of the stage's input (what the previous stage waits for),
// and W, the parameters' gradients (which nobody waits for, so W fills the pipeline's bubbles).
// It works on any LibTorch module, with no change to its layers: it cuts the autograd graph the
// forward recorded. See docs/pipeline.md, "Splitting the backward (zero bubble)".
//
//   SplitBackward split(output, input);       // after the stage's forward
//   at::Tensor dx = split.input_gradient(dy);  // I: send dx to the previous stage
//   ...                                        // other micro-batches' forwards and I's
//   split.weight_gradient();                   // W: every parameter's .grad, hooks included
//
// Contract: input_gradient() once, then weight_gradient() once, on one thread at a time. I then W
// accumulate exactly what output.backward(grad_output) would (W accumulates, I does not), and
// the graph is freed after W as backward() frees it. Between I and W the graph keeps only what W
// needs: the saved tensors of nodes that only carry the input's gradient are freed by I.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

namespace shoal::pipeline::detail {

class SplitBackward {
 public:
  // `output` is the stage's output (for the last stage: the micro-batch's weighted loss, a
  // scalar); `input` the stage's input leaf (detached, requires_grad when the stage is not the
  // first; may be undefined or not require grad for the first stage). UsageError when output
  // does not require grad or input requires grad but is not a leaf.
  SplitBackward(at::Tensor output, at::Tensor input);
  ~SplitBackward();
  SplitBackward(SplitBackward&&) noexcept;
  SplitBackward& operator=(SplitBackward&&) noexcept;

  // I: returns the gradient of `input` (undefined when the input needs none; zeros when the
  // output does not depend on it) and keeps what weight_gradient() needs; accumulates no
  // parameter's gradient and runs no hook of a parameter. An undefined grad_output means 1 for
  // a scalar output, as backward() takes it. UsageError when its shape or dtype is not the
  // output's.
  at::Tensor input_gradient(const at::Tensor& grad_output);

  // W: accumulates every parameter's gradient (as backward() would, so DataParallel's hooks on
  // the parameters' accumulators fire), then frees the graph.
  void weight_gradient();

  // The autograd nodes (by name) whose backward computed its parameters' gradients during I
  // because it computes all its gradients at once (a custom autograd Function that ignores
  // needs_input_grad): their W was computed in I and only its accumulation waits for W. Empty
  // for the LibTorch layers tested (Linear, LayerNorm, Embedding, GELU, attention's matmul and
  // softmax, cross-entropy). Known after input_gradient().
  const std::vector<std::string>& joint_nodes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shoal::pipeline::detail
