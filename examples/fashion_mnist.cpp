// Distributed training on Fashion-MNIST with shoal's collectives.
//
//   shoal run -n 2 build/examples/fashion_mnist [--epochs 2] [--batch-size 128] [--lr 0.05]
//
// Every worker draws the same permutation of the training set each epoch and trains on its
// share of every global batch; one all-reduce per step sums the workers' gradients, so the
// model follows exactly the single-process run on the global batch. The same program runs
// alone (./fashion_mnist) as a job of one.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <torch/torch.h>

#include "shoal/data/fashion_mnist.h"
#include "shoal/shoal.h"

namespace {

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

struct Options {
  int epochs = 2;
  int64_t batch_size = 128;
  double lr = 0.05;
  int64_t limit = 0;  // train on the first `limit` samples only (0: all)
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) throw shoal::UsageError(flag + " needs a value");
    const char* value = argv[++i];
    if (flag == "--epochs") options.epochs = std::atoi(value);
    else if (flag == "--batch-size") options.batch_size = std::atoll(value);
    else if (flag == "--lr") options.lr = std::atof(value);
    else if (flag == "--limit") options.limit = std::atoll(value);
    else throw shoal::UsageError("unknown flag " + flag + "; expected --epochs, --batch-size, --lr or --limit");
  }
  return options;
}

// This worker's rows of a batch of `count`: the shares of comm::split_sizes.
std::pair<int64_t, int64_t> my_share(int64_t count) {
  auto sizes = shoal::comm::split_sizes(count, shoal::world_size());
  int64_t begin = 0;
  for (int r = 0; r < shoal::rank(); ++r) begin += sizes[r];
  return {begin, sizes[shoal::rank()]};
}

double evaluate(Net& net, const shoal::data::FashionMnist& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  auto [begin, count] = my_share(test.images().size(0));
  auto correct = torch::zeros({1}, torch::kFloat64);
  for (int64_t i = begin; i < begin + count; i += 1000) {
    auto n = std::min<int64_t>(1000, begin + count - i);
    auto predicted = net->forward(test.images().narrow(0, i, n)).argmax(1);
    correct += predicted.eq(test.labels().narrow(0, i, n)).sum().to(torch::kFloat64);
  }
  shoal::world().all_reduce(correct);
  net->train();
  return correct.item<double>() / static_cast<double>(test.images().size(0));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options options = parse(argc, argv);
    shoal::init();
    torch::manual_seed(0);
    Net net;
    // Start from the main worker's parameters, whatever each worker's seed did.
    for (auto& p : net->parameters()) {
      torch::NoGradGuard no_grad;
      shoal::world().broadcast(p);
    }
    shoal::data::FashionMnist train(shoal::data::kFashionMnistRoot, shoal::data::FashionMnist::Split::kTrain);
    shoal::data::FashionMnist test(shoal::data::kFashionMnistRoot, shoal::data::FashionMnist::Split::kTest);
    const int64_t samples = options.limit > 0 ? std::min(options.limit, train.images().size(0)) : train.images().size(0);
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(options.lr).momentum(0.9));
    if (shoal::is_main()) {
      std::printf("training on %lld Fashion-MNIST images with %d worker(s), global batch %lld\n",
                  static_cast<long long>(samples), shoal::world_size(), static_cast<long long>(options.batch_size));
    }

    for (int epoch = 0; epoch < options.epochs; ++epoch) {
      auto start = std::chrono::steady_clock::now();
      auto order = torch::randperm(samples, torch::TensorOptions().dtype(torch::kInt64));
      double loss_sum = 0;
      for (int64_t first = 0; first < samples; first += options.batch_size) {
        const int64_t global = std::min(options.batch_size, samples - first);
        auto [begin, count] = my_share(global);
        auto indices = order.narrow(0, first + begin, count);
        optimizer.zero_grad();
        // Sum of this worker's losses over the global batch size: the gradients' sum over
        // workers is then the gradient of the global batch's mean loss.
        auto loss = torch::nn::functional::cross_entropy(
                        net->forward(train.images().index_select(0, indices)), train.labels().index_select(0, indices),
                        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                    static_cast<double>(global);
        loss.backward();
        loss_sum += loss.item<double>() * static_cast<double>(global);
        std::vector<torch::Tensor> grads;
        for (auto& p : net->parameters()) grads.push_back(p.grad().flatten());
        auto flat = torch::cat(grads);
        shoal::world().all_reduce(flat);
        int64_t offset = 0;
        for (auto& p : net->parameters()) {
          p.mutable_grad().copy_(flat.narrow(0, offset, p.numel()).view_as(p));
          offset += p.numel();
        }
        optimizer.step();
      }
      auto total_loss = torch::tensor({loss_sum}, torch::kFloat64);
      shoal::world().all_reduce(total_loss);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double accuracy = evaluate(net, test);
      if (shoal::is_main()) {
        std::printf("epoch %d/%d: loss %.4f, %.0f samples/s, test accuracy %.2f%% (%.1f s)\n", epoch + 1,
                    options.epochs, total_loss.item<double>() / static_cast<double>(samples),
                    static_cast<double>(samples) / seconds, 100.0 * accuracy, seconds);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const shoal::UsageError& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 2;
  }
}
