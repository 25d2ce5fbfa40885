// The demo's model (examples/fashion_mnist.cpp): a small CNN for 28x28 grey images, 10 classes.
// Also trained by bench/ddp.cpp, so that the benchmark's "demo CNN" is this one.
#pragma once

#include <torch/torch.h>

namespace fashion_mnist {

struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 5).padding(2)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 5).padding(2)))),
        fc1(register_module("fc1", torch::nn::Linear(16 * 7 * 7, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

}  // namespace fashion_mnist
