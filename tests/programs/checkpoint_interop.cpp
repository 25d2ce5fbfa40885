// The C++ half of tests/python/test_checkpoint.py: the program of tests/python/checkpoint_worker.py
// written with LibTorch, so that a checkpoint one of them writes is continued by the other.
//
//   checkpoint_interop layernorm|batchnorm STEPS OUT [IN]
//
// Builds Sequential(Linear(4, 8), LayerNorm or BatchNorm1d, ReLU, Linear(8, 1)) with Adam (a batch
// norm's statistics are each worker's, so only one process equals one process), resumes from IN
// (model, optimizer, sampler, the step count as the extra "step") when given, trains with
// DataParallel on the global batches of 12 of a sampler over the 48 rows until STEPS steps are
// done in all, and saves the same four to OUT.
#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/torch.h>

#include "shoal/checkpoint/checkpoint.h"
#include "shoal/data/sampler.h"
#include "shoal/dp/data_parallel.h"
#include "shoal/init.h"

namespace {

constexpr int64_t kRows = 48;

// The rows, computed by the same LibTorch kernels as the Python worker's.
std::pair<torch::Tensor, torch::Tensor> dataset() {
  torch::Tensor x = (torch::arange(kRows * 4, torch::kFloat32).reshape({kRows, 4}) * 0.01).sin();
  torch::Tensor y = x.sum(1, /*keepdim=*/true).cos();
  return {x, y};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::cerr << "usage: checkpoint_interop layernorm|batchnorm STEPS OUT [IN]\n";
    return 2;
  }
  const bool batch_norm = std::string(argv[1]) == "batchnorm";
  const int64_t steps = std::atoll(argv[2]);
  shoal::init();
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(4, 8));
  if (batch_norm) {
    net->push_back(torch::nn::BatchNorm1d(8));
  } else {
    net->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Linear(8, 1));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(0.01));
  shoal::data::SamplerOptions options;
  options.batch_size = 12;
  options.shuffle = true;
  options.seed = 7;
  shoal::data::Sampler sampler(kRows, options);
  int64_t step = 0;
  if (argc == 5) {
    shoal::CheckpointExtras extras;
    shoal::LoadOptions load;
    load.extras = &extras;
    shoal::load(argv[4], *net, optimizer, sampler, load);
    step = extras.at("step").item<int64_t>();
  }
  shoal::DataParallel model(net);
  auto [x, y] = dataset();
  for (int64_t epoch = sampler.epoch(); step < steps; ++epoch) {
    sampler.set_epoch(epoch);
    for (; !sampler.epoch_done() && step < steps; ++step) {
      auto rows = sampler.batch();
      torch::Tensor index = torch::tensor(std::vector<int64_t>(rows.begin(), rows.end()), torch::kInt64);
      sampler.advance();
      optimizer.zero_grad();
      torch::mse_loss(model(x.index_select(0, index)), y.index_select(0, index)).backward();
      optimizer.step();
    }
  }
  shoal::SaveOptions save;
  save.extras["step"] = torch::tensor(step);
  shoal::save(argv[3], *net, optimizer, sampler, save);
  return 0;
}
