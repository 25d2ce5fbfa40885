// ZeRO on the data axes of global parameters (GradientSyncOptions::zero_stage,
// PipelineOptions::zero_stage; docs/memory.md, "Global models: ZeRO on the data axes"): for each
// set of workers holding the same pieces, this worker's slices of them (dp::Shards), the gathers
// of a piece when an operation reads it (dp::Gatherer), and how a checkpoint sees a piece through
// its slice (Note [Saving a sharded global model], src/global/nn.cpp). Internal to shoal:
// GradientSync and the pipeline hold one.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "shoal/comm/group.h"

namespace shoal::dp {
class Shards;
}  // namespace shoal::dp

namespace shoal::global::detail {

class DataAxisZero {
 public:
  struct Set {
    std::vector<int> ranks;          // the workers holding the same pieces (job ranks, sorted)
    std::vector<at::Tensor> pieces;  // this worker's pieces, the local tensors of the parameters
  };
  // Cuts the slices, finds the units (consecutive modules of `root`) and tells the global layers
  // of `root` how checkpoints see their pieces. No communication.
  DataAxisZero(torch::nn::Module& root, std::vector<Set> sets, int stage, int64_t unit_bytes,
               int max_units);
  ~DataAxisZero();
  DataAxisZero(const DataAxisZero&) = delete;
  DataAxisZero& operator=(const DataAxisZero&) = delete;

  size_t sets() const;
  const std::vector<int>& ranks(size_t set) const;
  // The set's group (made at the first call, a collective among its members).
  comm::Group& group(size_t set) const;
  const std::shared_ptr<dp::Shards>& shards(size_t set) const;
  // What the optimizer updates for `parameter`: its slice when it is a sharded piece, else itself.
  at::Tensor optimizer_tensor(const at::Tensor& parameter) const;

  // From now on pieces are gathered when an operation of the calling thread reads them (at stage
  // 3 their memory is freed first). Makes the sets' groups, in order. Once; later calls return.
  void start();
  bool started() const;
  // The set's slices changed (its gradients arrived and the optimizer steps next, or a load wrote
  // them): its pieces are gathered again when next read. Raises what a gather met.
  void slices_changed(size_t set);
  // Every piece whole on this worker now. A collective among each set's members.
  void gather_all();

  struct State;

 private:
  std::shared_ptr<State> state_;  // the checkpoint's views hold it weakly
};

}  // namespace shoal::global::detail
