// plain.cpp made data parallel (docs/getting-started.md): two lines added, three changed.
//   shoal run -n 4 distributed DATA_DIR MODEL_OUT [EPOCHS]
#include <torch/torch.h>
#include <shoal/shoal.h>

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
  auto loader = torch::data::make_data_loader<shoal::data::RandomSampler>(std::move(dataset), 64);
  auto net = std::make_shared<Net>();
  shoal::DataParallel model(net);
  torch::optim::SGD optimizer(net->parameters(), 0.05);
  for (int epoch = 0; epoch < epochs; ++epoch) {
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
      loss.backward();
      optimizer.step();
    }
  }
  if (shoal::is_main()) torch::save(net, argv[2]);
}
