// Elastic training on Fashion-MNIST: the demo's CNN (fashion_mnist_net.h), trained by a job that
// goes on when workers die, join or leave, and comes back from its durable commit when all died.
//
//   shoal run --min 1 --max 4 -n 2 build/examples/elastic_fashion_mnist [--epochs 3] [--limit N]
//   shoal run --join HOST:PORT --token-file FILE -n 1 build/examples/elastic_fashion_mnist ...
//   SHOAL_CHECKPOINT=ckpt SHOAL_CHECKPOINT_EVERY=50 shoal run --min 1 --max 4 -n 2 ...
//
// The lines marked "shoal" are what it adds to a single-machine LibTorch program: the training
// loop runs inside elastic::run, counts its epochs with the elastic state and commits after each
// step. When a worker is lost, the others go back to their last commit, re-cut what is left of
// the epoch over the workers that remain, and go on; the global batch stays, so the result is
// the one-process run's. See docs/elastic.md.
#include <cmath>
#include <cstdio>
#include <string>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "fashion_mnist_net.h"
#include "shoal/datasets/fashion_mnist.h"
#include "shoal/shoal.h"

namespace {

// The fraction of `test` that `net` gets right. Each worker scores its share; one all-reduce
// adds up the hits.
double test_accuracy(fashion_mnist::Net& net, const shoal::datasets::FashionMnist& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  const int64_t n = test.images().size(0);
  const auto shares = shoal::comm::split_sizes(n, shoal::world_size());
  int64_t begin = 0;
  for (int r = 0; r < shoal::rank(); ++r) begin += shares[r];
  auto hits = torch::zeros({1}, torch::kFloat64);
  if (shares[shoal::rank()] > 0) {
    auto predicted = net->forward(test.images().narrow(0, begin, shares[shoal::rank()])).argmax(1);
    hits += predicted.eq(test.labels().narrow(0, begin, shares[shoal::rank()])).sum();
  }
  shoal::world().all_reduce(hits);
  net->train();
  return hits.item<double>() / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 3;
  int64_t batch_size = 64;  // the global batch, whatever the number of workers
  double lr = 0.05;
  int64_t limit = 0;
  CLI::App app{"Elastic data-parallel training of a small CNN on Fashion-MNIST"};
  app.add_option("--epochs", epochs, "epochs to train")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "the global batch")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "the learning rate at the first epoch (cosine decay)")
      ->check(CLI::PositiveNumber);
  app.add_option("--limit", limit, "train on the first N images and test on the first N/6 (0: all)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  shoal::init();  // shoal
  torch::manual_seed(0);
  fashion_mnist::Net net;
  shoal::DataParallel model(net);  // shoal

  using shoal::datasets::FashionMnist;
  FashionMnist train(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTrain);
  FashionMnist test(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTest);
  if (limit > 0) {
    train = train.head(limit);
    test = test.head(std::max<int64_t>(1, limit / 6));
  }
  shoal::data::LoaderOptions loader_options;
  loader_options.batch_size = batch_size;
  loader_options.shuffle = true;
  auto loader = shoal::data::make_loader(train, loader_options);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));

  // What a failure rolls back to and what a newcomer receives: the parameters, the optimizer's
  // momentum, the loader's place and the epoch.
  shoal::elastic::State state(net.ptr(), optimizer, loader);  // shoal
  shoal::elastic::run(state, [&] {                            // shoal
    if (shoal::is_main()) {
      std::printf("training on %d worker(s) from step %lld (epoch %lld)\n", shoal::world_size(),
                  static_cast<long long>(state.version()),
                  static_cast<long long>(state.epoch() + 1));
    }
    for (; state.epoch() < epochs; state.next_epoch()) {  // shoal
      // Cosine decay, a function of the epoch alone, so that a round that starts mid-epoch
      // (or a job that resumes) has the right rate.
      const double rate =
          lr * 0.5 * (1 + std::cos(M_PI * static_cast<double>(state.epoch()) / epochs));
      static_cast<torch::optim::SGDOptions&>(optimizer.param_groups()[0].options()).lr(rate);
      for (auto& batch : loader.epoch(state.epoch())) {
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);  // shoal
        loss.backward();
        optimizer.step();
        state.commit();  // shoal
        if (shoal::is_main() && state.version() % 20 == 0) {
          std::printf("epoch %lld step %lld on %d worker(s): loss %.4f\n",
                      static_cast<long long>(state.epoch() + 1),
                      static_cast<long long>(state.version()), shoal::world_size(),
                      loss.item<double>());
          std::fflush(stdout);
        }
      }
    }
  });

  const double accuracy = test_accuracy(net, test);
  if (shoal::is_main()) {
    double checksum = 0;
    for (const auto& p : net->parameters()) checksum += p.detach().abs().sum().item<double>();
    std::printf("after %lld steps: test accuracy %.4f, parameter checksum %.6f\n",
                static_cast<long long>(state.version()), accuracy, checksum);
  }
  return 0;
}
