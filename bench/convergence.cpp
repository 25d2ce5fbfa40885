// Convergence across resizes for bench/convergence.py (bench/RESULTS.md, "Convergence across
// resizes"): the demo's CNN (examples/fashion_mnist_net.h) on Fashion-MNIST under one of the
// elastic batch policies (docs/elastic.md, "Batch policies"), one intra-op thread per worker.
//
//   shoal run --min 1 --max 4 -n 1 convergence --policy global|scale|adascale [--batch 64]
//       [--lr 0.05] [--epochs 3] [--limit 12000] [--seed 0] [--eval-every 1500]
//       [--test-size N] [--start-when FILE]
//   convergence ...                                          # alone: the fixed run of one worker
//
// --batch is the reference run's batch b, one worker's. Under `global` (keep_global_batch) it is
// the global batch, cut over the workers; under `scale` (scale_learning_rate(1, 0)) and `adascale`
// (adascale(1)) it is each worker's, and the global batch follows the world. The training lasts
// T = epochs * ceil(limit / b) steps of the reference (one worker): it ends when
// state.scaled_steps() reaches T, and the learning rate follows a cosine decay over
// scaled_steps() / T (lr0 = --lr), times state.gain(). Under `global` and `scale` that is the
// reference's number of samples; under `adascale`, whose gain is below the linear one, it takes
// more samples (AdaScale's rule, docs/elastic.md).
//
// --start-when FILE makes the program load its data first and then wait for FILE to exist before
// it joins the job (shoal::init()): bench/convergence.py starts the joining workers ahead, so
// that their start-up does not delay the resize past the point it asks for.
//
// --seed sets the initial parameters and the data order. Every worker prints
// "train pid=P rank=R world=W step=S" when the training function (re)starts; the first worker
// prints after each commit "step S world W samples N scaled X lr L gain G loss Y" (the training
// loss of its share), each time the samples trained on pass a multiple of --eval-every
// "eval samples N scaled X commits C world W loss Y accuracy A" (on the first --test-size test
// images, default limit/6), and at the end the same with "final" in place of "eval".
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "../examples/fashion_mnist_net.h"
#include "shoal/datasets/fashion_mnist.h"
#include "shoal/shoal.h"

namespace {

using shoal::datasets::FashionMnist;

// The test set's mean loss and accuracy. Each worker scores its share; one all-reduce adds up.
std::pair<double, double> evaluate(fashion_mnist::Net& net, const FashionMnist& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  const int64_t n = test.images().size(0);
  const auto shares = shoal::comm::split_sizes(n, shoal::world_size());
  int64_t begin = 0;
  for (int r = 0; r < shoal::rank(); ++r) begin += shares[r];
  auto sums = torch::zeros({2}, torch::kFloat64);  // loss, hits
  // In chunks: the first convolution's output for 10,000 images would take 250 MB.
  constexpr int64_t kChunk = 500;
  for (int64_t at = begin; at < begin + shares[shoal::rank()]; at += kChunk) {
    const int64_t count = std::min(kChunk, begin + shares[shoal::rank()] - at);
    const auto logits = net->forward(test.images().narrow(0, at, count));
    const auto labels = test.labels().narrow(0, at, count);
    sums[0] += torch::nn::functional::cross_entropy(
        logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    sums[1] += logits.argmax(1).eq(labels).sum();
  }
  shoal::world().all_reduce(sums);
  net->train();
  return {sums[0].item<double>() / static_cast<double>(n),
          sums[1].item<double>() / static_cast<double>(n)};
}

}  // namespace

int main(int argc, char** argv) {
  std::string policy = "global";
  int64_t batch = 64;
  double lr = 0.05;
  int epochs = 3;
  int64_t limit = 12000;
  uint64_t seed = 0;
  int64_t eval_every = 1500;
  int64_t test_size = 0;
  std::string start_when;
  CLI::App app{
      "The demo CNN on Fashion-MNIST under an elastic batch policy (bench/convergence.py)"};
  app.add_option("--policy", policy, "global, scale or adascale (default global)")
      ->check(CLI::IsMember({"global", "scale", "adascale"}));
  app.add_option("--batch", batch, "the reference's batch, one worker's (default 64)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "lr0, the reference's rate before its cosine decay (default 0.05)")
      ->check(CLI::PositiveNumber);
  app.add_option("--epochs", epochs, "the reference's epochs (default 3)")
      ->check(CLI::PositiveNumber);
  app.add_option("--limit", limit, "training images, the first N (default 12000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "initial parameters and data order (default 0)");
  app.add_option("--eval-every", eval_every, "samples between evaluations (default 1500)")
      ->check(CLI::PositiveNumber);
  app.add_option("--test-size", test_size, "test images (default: limit/6)")
      ->check(CLI::PositiveNumber);
  app.add_option("--start-when", start_when,
                 "join the job once this file exists (default: at once)");
  CLI11_PARSE(app, argc, argv);

  FashionMnist train =
      FashionMnist(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTrain).head(limit);
  const FashionMnist test =
      FashionMnist(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTest)
          .head(test_size > 0 ? test_size : std::max<int64_t>(1, limit / 6));
  const int64_t dataset_size = train.images().size(0);
  while (!start_when.empty() && !std::filesystem::exists(start_when))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));

  shoal::InitOptions init;
  init.intra_op_threads = 1;
  shoal::init(init);
  torch::manual_seed(seed);
  fashion_mnist::Net net;
  shoal::DataParallelOptions dp_options;
  dp_options.measure_gradient_noise = policy == "adascale";
  shoal::DataParallel model(net, dp_options);

  shoal::data::LoaderOptions loader_options;
  loader_options.batch_size = batch;
  loader_options.shuffle = true;
  loader_options.seed = seed;
  shoal::elastic::StateOptions state_options;
  if (policy == "scale") {
    loader_options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::scale_learning_rate(1, 0);
  } else if (policy == "adascale") {
    loader_options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::adascale(1);
  }
  auto loader = shoal::data::make_loader(train, loader_options);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
  shoal::elastic::State state(net.ptr(), optimizer, loader, state_options);
  // The last multiple of --eval-every evaluated at: committed, so that a newcomer evaluates
  // (a collective) at the same steps as the others.
  state.value("evaluated") = torch::zeros({}, torch::kInt64);

  const double total = static_cast<double>(epochs * ((dataset_size + batch - 1) / batch));
  const auto& sampler = loader.sampler();
  auto samples = [&] { return sampler.epoch() * dataset_size + sampler.cursor(); };
  auto done = [&] { return state.scaled_steps() >= total - 1e-9; };
  shoal::elastic::run(state, [&] {
    std::printf("train pid=%d rank=%d world=%d step=%lld\n", static_cast<int>(::getpid()),
                shoal::rank(), shoal::world_size(), static_cast<long long>(state.version()));
    std::fflush(stdout);
    for (; !done(); state.next_epoch()) {
      for (auto& b : loader.epoch(state.epoch())) {
        // The reference's cosine decay over its progress; the policy's gain on top (set at once
        // by set_base_learning_rates).
        const double base =
            lr * 0.5 * (1 + std::cos(M_PI * std::min(1.0, state.scaled_steps() / total)));
        state.set_base_learning_rates({base});
        const double rate = optimizer.param_groups()[0].options().get_lr();
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(model(b.data), b.target);
        loss.backward();
        optimizer.step();
        state.commit();
        if (shoal::is_main()) {
          std::printf("step %lld world %d samples %lld scaled %.2f lr %.5f gain %.3f loss %.4f\n",
                      static_cast<long long>(state.version()), shoal::world_size(),
                      static_cast<long long>(samples()), state.scaled_steps(), rate, state.gain(),
                      loss.item<double>());
          std::fflush(stdout);
        }
        auto& evaluated = state.value("evaluated");
        if (samples() / eval_every > evaluated.item<int64_t>()) {
          evaluated.fill_(samples() / eval_every);
          const auto [test_loss, accuracy] = evaluate(net, test);
          if (shoal::is_main()) {
            std::printf(
                "eval samples %lld scaled %.2f commits %lld world %d loss %.4f accuracy %.4f\n",
                static_cast<long long>(samples()), state.scaled_steps(),
                static_cast<long long>(state.version()), shoal::world_size(), test_loss, accuracy);
            std::fflush(stdout);
          }
        }
        if (done()) break;
      }
    }
  });

  const auto [test_loss, accuracy] = evaluate(net, test);
  if (shoal::is_main()) {
    std::printf("final samples %lld scaled %.2f commits %lld world %d loss %.4f accuracy %.4f\n",
                static_cast<long long>(samples()), state.scaled_steps(),
                static_cast<long long>(state.version()), shoal::world_size(), test_loss, accuracy);
  }
  return 0;
}
