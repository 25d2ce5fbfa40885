// GlobalTensor: one logical tensor spread over a placement's workers by an SBP per mesh axis.
// Every worker runs the same program (SPMD); each holds its own piece, the local tensor, and
// workers outside the placement hold an empty placeholder that keeps their autograd graph in
// step with the others'. See docs/global.md.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "shoal/global/placement.h"

namespace shoal::global {

class GlobalTensor {
 public:
  GlobalTensor() = default;

  // Assembles a global tensor from the pieces the workers hold. `local` is this worker's piece
  // for (placement, sbp); workers outside the placement pass anything, or nothing. Every
  // worker of the job calls it (the pieces' sizes are exchanged to find the global shape).
  // UsageError when the pieces do not fit together (their split sizes must be those of
  // comm::split_sizes, the other dims equal).
  static GlobalTensor from_local(const at::Tensor& local, const Placement& placement,
                                 const NdSbp& sbp);
  // The same without communication: the caller knows the global shape.
  static GlobalTensor from_local(const at::Tensor& local, const Placement& placement,
                                 const NdSbp& sbp, at::IntArrayRef shape);
  // `full` is the whole value, the same on every worker; each keeps its piece. No communication.
  // For partial_sum axes the first worker along the axis keeps the value, the others zeros.
  static GlobalTensor from_full(const at::Tensor& full, const Placement& placement,
                                const NdSbp& sbp);

  bool defined() const { return local_.defined(); }
  // The global (logical) shape.
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t dim) const;
  int64_t numel() const;
  at::ScalarType dtype() const { return local_.scalar_type(); }
  const Placement& placement() const { return placement_; }
  const NdSbp& sbp() const { return sbp_; }
  // Whether this worker holds a piece.
  bool is_local() const;

  // This worker's piece (an empty tensor outside the placement). Differentiable.
  const at::Tensor& to_local() const { return local_; }
  // The whole value on every worker of the job, as one process would hold it. Collective among
  // all workers; differentiable.
  at::Tensor full() const;
  // The same value with another placement and SBP: the communication that needs (boxing), as
  // a differentiable op whose backward is the adjoint communication. Collective among the
  // workers of both placements; every worker of the job calls it.
  GlobalTensor to_global(const Placement& placement, const NdSbp& sbp) const;
  // The same placement, another SBP.
  GlobalTensor to_global(const NdSbp& sbp) const { return to_global(placement_, sbp); }

  // Autograd: as on a torch tensor. requires_grad_ also marks the placeholders of workers
  // outside the placement, so that their graphs stay in step.
  GlobalTensor& requires_grad_(bool requires_grad = true);
  bool requires_grad() const { return local_.requires_grad(); }
  // The gradient after backward(), with the dual SBP: a broadcast tensor's gradient is a
  // partial_sum. Undefined before backward.
  GlobalTensor grad() const;
  // Backward from this value (a scalar: numel() == 1), seeded so that the global gradient is 1:
  // partial_sum axes get 1 on every worker, broadcast axes 1 on the first worker along the
  // axis and 0 elsewhere. Every worker of the job calls it, members or not.
  void backward() const;
  // The local gradient backward() starts this worker's piece from (its shape): ones where the
  // piece counts once toward the global value, zeros elsewhere and outside the placement. For
  // callers that run the pieces' backward themselves (a pipeline's last stage).
  at::Tensor backward_seed() const;
  // Backward with a gradient of the same placement and the dual SBP.
  void backward(const GlobalTensor& gradient) const;
  GlobalTensor detach() const;

  // "GlobalTensor of shape [4, 5], float, on [0, 1] as split(0)", or on a mesh
  // "GlobalTensor of shape [4, 5], float, on the 2x2 mesh [0, 1, 2, 3] as (split(0), broadcast)"
  std::string describe() const;

  // For ops: a global tensor made of its parts. `local` must be this worker's piece (or the
  // placeholder outside the placement).
  GlobalTensor(at::Tensor local, Placement placement, NdSbp sbp, std::vector<int64_t> shape);

 private:
  at::Tensor local_;
  Placement placement_{std::vector<int>{0}};
  NdSbp sbp_{std::vector<Sbp>{}};
  std::vector<int64_t> shape_;
};

// Creation with a global value equal to what the same torch call gives in one process after the
// same torch::manual_seed: every worker draws (or makes) the whole value and keeps its piece, so
// the random streams of all workers stay alike and programs on 1 or N workers are comparable.
GlobalTensor randn(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                   const at::TensorOptions& options = {});
GlobalTensor rand(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                  const at::TensorOptions& options = {});
GlobalTensor zeros(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                   const at::TensorOptions& options = {});
GlobalTensor ones(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                  const at::TensorOptions& options = {});
GlobalTensor full(at::IntArrayRef shape, const at::Scalar& value, const Placement& placement,
                  const NdSbp& sbp, const at::TensorOptions& options = {});
GlobalTensor arange(int64_t end, const Placement& placement, const NdSbp& sbp,
                    const at::TensorOptions& options = at::kLong);

// Bytes this worker has sent in global tensors' communication since the process started (boxing
// and the ops' own collectives, forward and backward), counted as ring algorithms send them: an
// all-reduce of T bytes among n workers sends 2T(n-1)/n, an all-gather or reduce-scatter
// T(n-1)/n of the whole, a send T. For comparing parallel plans (bench/global).
int64_t sent_bytes();

}  // namespace shoal::global
