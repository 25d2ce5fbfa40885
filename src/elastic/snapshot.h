// What a commit keeps of an elastic::State (Note [Commits without copies] in snapshot.cpp).
// Private to src/elastic.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim.h>

#include "dp/replication.h"
#include "shoal/elastic/state.h"

namespace shoal::elastic {

struct State::Snapshot {
  std::vector<at::Tensor>
      tensors;  // the module's parameters (undefined when not copied), then its buffers
  std::vector<int64_t> parameter_versions;  // without a copy: the parameters' version counters,
  // the DataParallels that replicate them and the sum of their synchronized backwards
  std::vector<std::weak_ptr<dp::Replication>> replications;
  uint64_t backwards = 0;
  std::map<std::string, std::unique_ptr<torch::optim::OptimizerParamState>> optimizer_state;
  bool optimizer_serialized = false;  // not one of LibTorch's optimizers: optimizer_bytes instead
  std::string optimizer_bytes;
  std::vector<double> rates;
  data::SamplerState sampler;
  int64_t epoch = 0;
  int64_t version = 0;
  std::map<std::string, at::Tensor> values;
  std::vector<double> warmup_from;
  int64_t warmup_done = 0;
  std::vector<double> noise;  // the noise meter's state, when there is one
  double scaled_steps = 0.0;
  double gain = 1.0;
};

}  // namespace shoal::elastic
