// A plain LibTorch training program, the starting point of docs/getting-started.md; its
// distributed version is distributed.cpp beside it.
//   plain DATA_DIR MODEL_OUT [EPOCHS]   (DATA_DIR: MNIST-format files, uncompressed)
#include <torch/torch.h>

#include <cstdlib>

struct Net : torch::nn::Module {
  Net() : fc1(register_module("fc1", torch::nn::Linear(784, 64))), fc2(register_module("fc2", torch::nn::Linear(64, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x.view({x.size(0), 784})))); }
  torch::nn::Linear fc1, fc2;
};

int main(int argc, char** argv) {
  const int epochs = argc > 3 ? std::atoi(argv[3]) : 5;
  torch::manual_seed(0);
  auto dataset = torch::data::datasets::MNIST(argv[1]).map(torch::data::transforms::Stack<>());
  auto loader = torch::data::make_data_loader(std::move(dataset), 64);
  auto net = std::make_shared<Net>();
  torch::optim::SGD optimizer(net->parameters(), 0.05);
  for (int epoch = 0; epoch < epochs; ++epoch) {
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target);
      loss.backward();
      optimizer.step();
    }
  }
  torch::save(net, argv[2]);
}
