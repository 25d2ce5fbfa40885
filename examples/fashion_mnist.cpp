// Data-parallel training on Fashion-MNIST: a single-machine LibTorch program plus shoal's lines.
//
//   shoal run -n 2 build/examples/fashion_mnist [--epochs 10] [--batch-size 128] [--lr 0.05]
//                                               [--checkpoint PATH] [--resume] [--limit N]
//
// The lines marked "shoal" are all it takes: init() joins the job, DataParallel averages the
// gradients during backward, and the loader gives each worker its share of every global batch.
// The same binary runs alone (./fashion_mnist) as a job of one, with the same results.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/torch.h>

#include "cli.h"
#include "fashion_mnist_net.h"
#include "shoal/datasets/fashion_mnist.h"
#include "shoal/shoal.h"

namespace {

using fashion_mnist::Net;

struct Options {
  int epochs = 10;
  int64_t batch_size = 128;  // the global batch, whatever the number of workers
  double lr = 0.05;
  int64_t limit = 0;  // train on the first `limit` images only (0: all)
  std::string checkpoint = "fashion_mnist.ckpt";
  bool resume = false;
};

// One line per quarter of the epoch, printed by the main worker: a progress bar that reads the
// same in a terminal and in a log, with the job-wide mean loss.
class Progress {
 public:
  Progress(int64_t epoch, int epochs, int64_t batches)
      : epoch_(epoch), epochs_(epochs), batches_(batches) {}

  void step(int64_t samples, const torch::Tensor& loss) {
    ++done_;
    samples_ += samples;
    loss_sum_ += loss.detach() * samples;
    if (done_ * 4 / batches_ == (done_ - 1) * 4 / batches_) return;  // print as each quarter fills
    auto totals = torch::stack(
        {loss_sum_.to(torch::kFloat64), torch::tensor(double(samples_), torch::kFloat64)});
    shoal::world().all_reduce(totals);  // every worker takes part, one prints
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double rate = totals[1].item<double>() / seconds;
    const double fraction = double(done_) / double(batches_);
    if (!shoal::is_main()) return;
    const int width = 24, filled = int(fraction * width + 0.5);
    std::printf("epoch %lld/%d [%s%s] %3.0f%%  %6.0f samples/s  loss %.4f  ETA %3.0fs\n",
                static_cast<long long>(epoch_ + 1), epochs_, std::string(filled, '#').c_str(),
                std::string(width - filled, '.').c_str(), 100 * fraction, rate,
                totals[0].item<double>() / totals[1].item<double>(), seconds / fraction - seconds);
    std::fflush(stdout);
  }

 private:
  int64_t epoch_;
  int epochs_;
  int64_t batches_, done_ = 0, samples_ = 0;
  torch::Tensor loss_sum_ = torch::zeros({});
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Each worker scores its share of the test set; one all-reduce adds up the hits.
double test_accuracy(Net& net, const shoal::datasets::FashionMnist& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  const int64_t n = test.images().size(0);
  auto shares = shoal::comm::split_sizes(n, shoal::world_size());
  int64_t begin = 0;
  for (int r = 0; r < shoal::rank(); ++r) begin += shares[r];
  auto hits = torch::zeros({1}, torch::kFloat64);
  for (int64_t i = begin; i < begin + shares[shoal::rank()]; i += 1000) {
    const int64_t count = std::min<int64_t>(1000, begin + shares[shoal::rank()] - i);
    auto predicted = net->forward(test.images().narrow(0, i, count)).argmax(1);
    hits += predicted.eq(test.labels().narrow(0, i, count)).sum();
  }
  shoal::world().all_reduce(hits);
  net->train();
  return hits.item<double>() / double(n);
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"Data-parallel training on Fashion-MNIST; run alone or under `shoal run -n N`.",
               "fashion_mnist"};
  app.add_option("--epochs", options.epochs, "epochs to train")
      ->capture_default_str()
      ->check(examples::positive());
  app.add_option("--batch-size", options.batch_size, "the global batch, whatever the workers")
      ->capture_default_str()
      ->check(examples::positive());
  app.add_option("--lr", options.lr, "the first epoch's learning rate (cosine decay)")
      ->capture_default_str()
      ->check(examples::positive());
  app.add_option("--limit", options.limit, "train on the first N images only (0: all)")
      ->capture_default_str()
      ->check(examples::positive(true));
  app.add_option("--checkpoint", options.checkpoint, "written after every epoch")
      ->capture_default_str();
  app.add_flag("--resume", options.resume, "continue from --checkpoint, on any number of workers");
  if (const int code = examples::parse(app, argc, argv); code >= 0) return code;
  try {
    shoal::init();  // shoal
    torch::manual_seed(0);
    Net net;
    shoal::DataParallel model(net);  // shoal

    using shoal::datasets::FashionMnist;
    FashionMnist train(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTrain);
    FashionMnist test(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTest);
    if (options.limit > 0) train = train.head(options.limit);
    shoal::data::LoaderOptions loading;
    loading.batch_size = options.batch_size;  // the global batch
    loading.shuffle = true;
    auto loader = shoal::data::make_loader(train, loading);  // shoal
    torch::optim::SGD optimizer(net->parameters(),
                                torch::optim::SGDOptions(options.lr).momentum(0.9));

    if (shoal::is_main()) {
      std::printf("Fashion-MNIST: %lld training images on %d worker(s), global batch %lld\n",
                  static_cast<long long>(train.size().value()), shoal::world_size(),
                  static_cast<long long>(options.batch_size));
    }
    // --resume: parameters, momentum and the loader's place come back from the last epoch's
    // checkpoint, on however many workers this run has.
    int64_t first_epoch = 0;
    if (options.resume) {
      shoal::load(options.checkpoint, *net, optimizer, loader.sampler());  // shoal
      first_epoch = loader.sampler().epoch() + (loader.sampler().epoch_done() ? 1 : 0);
      if (shoal::is_main()) {
        std::printf("resumed from %s at epoch %lld\n", options.checkpoint.c_str(),
                    static_cast<long long>(first_epoch + 1));
      }
    }
    for (int64_t epoch = first_epoch; epoch < options.epochs; ++epoch) {
      // Cosine decay, one learning rate per epoch: a function of the epoch alone, so a resumed
      // run picks it up where it left off.
      const double lr = options.lr * 0.5 * (1 + std::cos(M_PI * double(epoch) / options.epochs));
      static_cast<torch::optim::SGDOptions&>(optimizer.param_groups()[0].options()).lr(lr);
      auto batches = loader.epoch(epoch);
      Progress progress(epoch, options.epochs, loader.sampler().batches_remaining());
      for (auto& batch : batches) {
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);  // shoal
        loss.backward();
        optimizer.step();
        progress.step(batch.data.size(0), loss);
      }
      shoal::save(options.checkpoint, *net, optimizer, loader.sampler());  // shoal
      const double accuracy = test_accuracy(net, test);
      if (shoal::is_main()) {
        std::printf("epoch %lld/%d: test accuracy %.2f%%, checkpoint %s\n",
                    static_cast<long long>(epoch + 1), options.epochs, 100 * accuracy,
                    options.checkpoint.c_str());
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const shoal::UsageError& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 2;
  }
}
