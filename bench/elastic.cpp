// Elastic training for bench/elastic.py: the MLP of bench/ddp.cpp (784-2048-2048-10), random
// data, SGD with momentum, batch 64 per worker, one intra-op thread, under shoal::elastic::run.
//
//   shoal run --min 1 --max 3 -n 3 elastic [--steps 200] [--commit-every 1] [--batch 64] [--zero S]
//
// --commit-every 0 never commits (to measure what committing costs). --zero S shards the model at
// ZeRO stage S, whose commits copy each worker's slices to the next (docs/memory.md). The main
// worker prints "step S world W t=MS" after each step (MS: milliseconds since the epoch, to line up
// with the driver's clock) and at the end "elastic steps=S samples_per_s=X step_ms=Y" over the
// steps after the first 3 of the last round.
#include <chrono>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "shoal/shoal.h"

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Random samples, the same on every run: the dataset only sets the pace.
class RandomImages : public torch::data::datasets::Dataset<RandomImages> {
 public:
  explicit RandomImages(int64_t size) : size_(size) {
    torch::manual_seed(0);
    x_ = torch::randn({size, 784});
    y_ = torch::randint(10, {size});
  }
  torch::data::Example<> get(size_t i) override { return {x_[i], y_[i]}; }
  torch::optional<size_t> size() const override { return size_; }

 private:
  int64_t size_;
  torch::Tensor x_, y_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Elastic training of bench/ddp's MLP under shoal::elastic::run (bench/elastic.py)"};
  int64_t steps = 200;
  int commit_every = 1;
  int64_t batch = 64;
  app.add_option("--steps", steps, "Steps to train (default 200)")->check(CLI::PositiveNumber);
  app.add_option("--commit-every", commit_every, "Steps between commits; 0: none (default 1)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch", batch, "Samples per worker and step (default 64)")
      ->check(CLI::PositiveNumber);
  int zero_stage = 0;
  app.add_option("--zero", zero_stage, "ZeRO stage of the DataParallel (default 0)")
      ->check(CLI::Range(0, 3));
  CLI11_PARSE(app, argc, argv);
  shoal::InitOptions init;
  init.intra_op_threads = 1;
  shoal::init(init);
  torch::manual_seed(1);
  auto net = torch::nn::Sequential(torch::nn::Linear(784, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 2048),
                                   torch::nn::ReLU(), torch::nn::Linear(2048, 10));
  shoal::DataParallelOptions dp_options;
  dp_options.zero_stage = zero_stage;
  shoal::DataParallel model(net, dp_options);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  shoal::data::LoaderOptions options;
  options.batch_size = batch;
  options.per_worker = true;
  options.shuffle = true;
  auto loader = shoal::data::make_loader(RandomImages(4096), options);
  shoal::elastic::State state(net.ptr(), optimizer, loader,
                              {shoal::elastic::BatchPolicy::scale_learning_rate(1, 0)});

  double commit_seconds = 0;
  int64_t commits = 0;
  int64_t done = 0;  // steps taken; after a recovery, those committed
  state.on_reset([&] { done = state.version(); });
  std::chrono::steady_clock::time_point timed_from;
  int64_t timed_steps = 0;
  shoal::elastic::run(state, [&] {
    int64_t in_round = 0;
    // Without commits (--commit-every 0) the epoch is counted here, not committed.
    for (int64_t epoch = state.epoch(); done < steps; ++epoch) {
      for (auto& b : loader.epoch(epoch)) {
        if (done >= steps) break;
        optimizer.zero_grad();
        torch::nn::functional::cross_entropy(model(b.data), b.target).backward();
        optimizer.step();
        ++done;
        if (commit_every > 0 && done % commit_every == 0) {
          const auto before = std::chrono::steady_clock::now();
          state.commit();
          commit_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - before).count();
          ++commits;
        }
        if (++in_round == 3) {
          timed_from = std::chrono::steady_clock::now();
          timed_steps = 0;
        } else if (in_round > 3) {
          ++timed_steps;
        }
        if (shoal::is_main()) {
          std::printf("step %lld world %d t=%lld\n", static_cast<long long>(done), shoal::world_size(),
                      static_cast<long long>(now_ms()));
          std::fflush(stdout);
        }
      }
      if (commit_every > 0) state.next_epoch();
    }
  });
  if (shoal::is_main() && timed_steps > 0) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_from).count();
    std::printf("elastic steps=%lld samples_per_s=%.1f step_ms=%.1f commit_every=%d world=%d commit_ms=%.2f\n",
                static_cast<long long>(timed_steps), timed_steps * batch * shoal::world_size() / seconds,
                1000 * seconds / timed_steps, commit_every, shoal::world_size(),
                commits > 0 ? 1000 * commit_seconds / commits : 0.0);
  }
  return 0;
}
