// Convergence across resizes for bench/convergence.py (bench/RESULTS.md, "Convergence across
// resizes"): the demo's CNN (examples/fashion_mnist_net.h) on Fashion-MNIST, or a character-level
// GPT on the GNU GPL's text, under one of the elastic batch policies (docs/elastic.md, "Batch
// policies"), one intra-op thread per worker.
//
//   shoal run --min 1 --max 4 -n 1 convergence --policy global|scale|adascale|goodput
//       [--model cnn|gpt]
//       [--batch 64] [--lr 0.05] [--epochs 3] [--limit 12000] [--seed 0] [--eval-every 1500]
//       [--test-size N] [--start-when FILE]
//   convergence ...                                          # alone: the fixed run of one worker
//   convergence ... --precision fp32|bf16|bf16-reduce|bf16-all|fp16-reduce  # mixed_precision
//
// --model gpt: the GPT of examples/global_gpt.cpp (2 blocks of 4 heads, width 64, 32 characters
// of context, dropout 0.1), built of plain LibTorch modules, since an elastic job's model cannot
// be global yet (docs/elastic.md), and trained with AdamW (weight decay 0.01). A sample is a
// window of 33 characters (the input and, one further, its targets), at a stride of 32 over the
// first 90% of the text; the test windows are those of the last 10%. --limit and --test-size
// count windows; "accuracy" is the share of test characters predicted exactly.
//
// --batch is the reference run's batch b, one worker's. Under `global` (keep_global_batch) it is
// the global batch, cut over the workers; under `scale` (scale_learning_rate(1, 0)) and `adascale`
// (adascale(1)) it is each worker's, and the global batch follows the world; under `goodput`
// (BatchPolicy::goodput) it is the base batch lr0 is meant for, and the job picks its batch for its
// world every 20 commits, from b/4 to 2b a worker and at most 8b in all, one backward pass a step
// (Pollux's rule: the batch of the highest throughput times statistical efficiency), with lr0
// times AdaScale's gain of that batch over b. The training lasts
// T = epochs * ceil(limit / b) steps of the reference (one worker): it ends when
// state.scaled_steps() reaches T, and the learning rate follows a cosine decay over
// scaled_steps() / T (lr0 = --lr), times state.gain(). Under `global` and `scale` that is the
// reference's number of samples; under `adascale` and `goodput`, whose gain is below the linear
// one, it takes more samples (AdaScale's rule, docs/elastic.md).
//
// --start-when FILE makes the program load its data first and then wait for FILE to exist before
// it joins the job (shoal::init()): bench/convergence.py starts the joining workers ahead, so
// that their start-up does not delay the resize past the point it asks for.
//
// --precision sets DataParallelOptions::mixed_precision (bench/precision.sh compares them in
// fixed runs): bf16 computes the forward in bfloat16, bf16-reduce sends gradients in bfloat16,
// bf16-all does both, fp16-reduce sends them in float16 under shoal::GradScaler's loss scaling.
//
// --seed sets the initial parameters and the data order. Every worker prints
// "train pid=P rank=R world=W step=S" when the training function (re)starts; the first worker
// prints after each commit "step S world W samples N scaled X lr L gain G loss Y batch B" (the
// training loss of its share, and the global batch of the step); each time the samples trained
// on pass a multiple of --eval-every, "eval samples N scaled X commits C world W loss Y accuracy
// A" (on the first --test-size test images, default limit/6); and at the end the same with
// "final" in place of "eval".
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "../examples/fashion_mnist_net.h"
#include "shoal/datasets/fashion_mnist.h"
#include "shoal/shoal.h"

namespace {

using shoal::datasets::FashionMnist;

// The GPT of examples/global_gpt.cpp in plain LibTorch modules: token and position embeddings,
// pre-norm blocks of causal self-attention and a GELU MLP, a final norm and the head.
struct GptConfig {
  int64_t vocabulary = 0, time = 32, dim = 64, heads = 4, layers = 2;
  double dropout = 0.1;
};

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptConfig& c) : config_(c) {
    norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    qkv_ = register_module("qkv", torch::nn::Linear(c.dim, 3 * c.dim));
    projection_ = register_module("projection", torch::nn::Linear(c.dim, c.dim));
    norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    up_ = register_module("up", torch::nn::Linear(c.dim, 4 * c.dim));
    down_ = register_module("down", torch::nn::Linear(4 * c.dim, c.dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    namespace F = torch::nn::functional;
    const int64_t batch = x.size(0), time = x.size(1), head_dim = config_.dim / config_.heads;
    const double p = is_training() ? config_.dropout : 0.0;
    auto parts =
        qkv_(norm1_(x)).view({batch, time, 3, config_.heads, head_dim}).permute({2, 0, 3, 1, 4});
    const auto future = torch::ones({time, time}, torch::kBool).triu(1);
    auto scores =
        parts[0].matmul(parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    const auto attention =
        F::dropout(scores.softmax(-1), F::DropoutFuncOptions().p(p).training(is_training()));
    const auto heads =
        attention.matmul(parts[2]).transpose(1, 2).reshape({batch, time, config_.dim});
    const auto h =
        x + F::dropout(projection_(heads), F::DropoutFuncOptions().p(p).training(is_training()));
    return h + F::dropout(down_(torch::gelu(up_(norm2_(h)))),
                          F::DropoutFuncOptions().p(p).training(is_training()));
  }

 private:
  GptConfig config_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, projection_{nullptr}, up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(Block);

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& c) : config_(c) {
    tokens_ = register_module("tokens", torch::nn::Embedding(c.vocabulary, c.dim));
    positions_ = register_module("positions", torch::nn::Embedding(c.time, c.dim));
    blocks_ = register_module("blocks", torch::nn::Sequential());
    for (int64_t i = 0; i < c.layers; ++i) blocks_->push_back(Block(c));
    norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    head_ = register_module(
        "head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocabulary).bias(false)));
  }
  // ids [batch, time] -> logits [batch, time, vocabulary]
  torch::Tensor forward(const torch::Tensor& ids) {
    namespace F = torch::nn::functional;
    auto x = tokens_(ids) + positions_(torch::arange(ids.size(1)));
    x = F::dropout(x, F::DropoutFuncOptions().p(config_.dropout).training(is_training()));
    return head_(norm_(blocks_->forward(x)));
  }

 private:
  GptConfig config_;
  torch::nn::Embedding tokens_{nullptr}, positions_{nullptr};
  torch::nn::Sequential blocks_{nullptr};
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Gpt);

// Windows of time + 1 characters: data the first time, target the last time (one further).
class Windows : public torch::data::datasets::Dataset<Windows> {
 public:
  explicit Windows(torch::Tensor windows) : windows_(std::move(windows)) {}
  torch::data::Example<> get(size_t index) override {
    const auto w = windows_[static_cast<int64_t>(index)];
    const int64_t time = windows_.size(1) - 1;
    return {w.narrow(0, 0, time), w.narrow(0, 1, time)};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(windows_.size(0)); }
  const torch::Tensor& windows() const { return windows_; }

 private:
  torch::Tensor windows_;
};

// The text's characters as ids, cut into windows of time + 1 at a stride of time: the first 90%
// of the text for training, the rest for testing. `vocabulary` gets the number of characters.
std::pair<torch::Tensor, torch::Tensor> gpl_windows(int64_t time, int64_t& vocabulary) {
  const std::string path = "/usr/share/common-licenses/GPL-3";
  std::ifstream file(path, std::ios::binary);
  if (!file) throw shoal::UsageError("--model gpt: cannot read " + path + " (Debian's base-files)");
  std::stringstream buffer;
  buffer << file.rdbuf();
  const std::string text = buffer.str();
  std::vector<int64_t> id_of(256, -1), ids;
  vocabulary = 0;
  for (unsigned char c : text) {
    if (id_of[c] < 0) id_of[c] = vocabulary++;
    ids.push_back(id_of[c]);
  }
  const torch::Tensor all = torch::tensor(ids);
  const int64_t cut = all.size(0) * 9 / 10;
  const auto windows = [time](const torch::Tensor& part) {
    return part.unfold(0, time + 1, time).contiguous();
  };
  return {windows(all.narrow(0, 0, cut)), windows(all.narrow(0, cut, all.size(0) - cut))};
}

// The test set's mean loss and accuracy per predicted element (an image's class, a window's
// character). Each worker scores its share of the rows; one all-reduce adds up.
template <typename Forward>
std::pair<double, double> evaluate(torch::nn::Module& net, const Forward& forward,
                                   const torch::Tensor& inputs, const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  net.eval();
  const int64_t n = inputs.size(0);
  const auto shares = shoal::comm::split_sizes(n, shoal::world_size());
  int64_t begin = 0;
  for (int r = 0; r < shoal::rank(); ++r) begin += shares[r];
  auto sums = torch::zeros({2}, torch::kFloat64);  // loss, hits
  // In chunks: the first convolution's output for 10,000 images would take 250 MB.
  constexpr int64_t kChunk = 500;
  for (int64_t at = begin; at < begin + shares[shoal::rank()]; at += kChunk) {
    const int64_t count = std::min(kChunk, begin + shares[shoal::rank()] - at);
    auto logits = forward(inputs.narrow(0, at, count));
    logits = logits.reshape({-1, logits.size(-1)});
    const auto labels = targets.narrow(0, at, count).reshape({-1});
    sums[0] += torch::nn::functional::cross_entropy(
        logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    sums[1] += logits.argmax(1).eq(labels).sum();
  }
  shoal::world().all_reduce(sums);
  net.train();
  const double elements = static_cast<double>(targets.numel());
  return {sums[0].item<double>() / elements, sums[1].item<double>() / elements};
}

struct Settings {
  std::string policy = "global";
  int64_t batch = 64;
  double lr = 0.05;
  int epochs = 3;
  uint64_t seed = 0;
  int64_t eval_every = 1500;
  std::string precision = "fp32";
};

// Trains `net` on `train` under the policy until scaled_steps() reaches the reference's T, then
// prints the final evaluation. `make` builds the optimizer over the parameters.
template <typename Net, typename Dataset, typename MakeOptimizer>
void train(Net net, Dataset train_set, const torch::Tensor& test_inputs,
           const torch::Tensor& test_targets, const Settings& s, const MakeOptimizer& make) {
  shoal::DataParallelOptions dp_options;
  dp_options.measure_gradient_noise = s.policy == "adascale" || s.policy == "goodput";
  if (s.precision == "bf16" || s.precision == "bf16-all")
    dp_options.mixed_precision.compute = at::kBFloat16;
  if (s.precision == "bf16-reduce" || s.precision == "bf16-all")
    dp_options.mixed_precision.reduce = at::kBFloat16;
  if (s.precision == "fp16-reduce") dp_options.mixed_precision.reduce = at::kHalf;
  shoal::DataParallel model(net, dp_options);
  shoal::GradScaler scaler;  // --precision fp16-reduce
  const auto forward = [&](const torch::Tensor& x) { return net->forward(x); };

  shoal::data::LoaderOptions loader_options;
  loader_options.batch_size = s.batch;
  loader_options.shuffle = true;
  loader_options.seed = s.seed;
  shoal::elastic::StateOptions state_options;
  if (s.policy == "scale") {
    loader_options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::scale_learning_rate(1, 0);
  } else if (s.policy == "adascale") {
    loader_options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::adascale(1);
  } else if (s.policy == "goodput") {
    loader_options.per_worker = true;  // the policy sets its batch_size
    state_options.policy = shoal::elastic::BatchPolicy::goodput(
        {s.batch, 8 * s.batch, std::max<int64_t>(1, s.batch / 4), 2 * s.batch, 1}, 20);
  }
  const int64_t dataset_size = static_cast<int64_t>(*train_set.size());
  auto loader = shoal::data::make_loader(std::move(train_set), loader_options);
  auto optimizer = make(net->parameters());
  shoal::elastic::State state(net.ptr(), *optimizer, loader, state_options);
  // The last multiple of --eval-every evaluated at: committed, so that a newcomer evaluates
  // (a collective) at the same steps as the others.
  state.value("evaluated") = torch::zeros({}, torch::kInt64);

  const double total = static_cast<double>(s.epochs * ((dataset_size + s.batch - 1) / s.batch));
  const auto& sampler = loader.sampler();
  auto samples = [&] { return sampler.epoch() * dataset_size + sampler.cursor(); };
  auto done = [&] { return state.scaled_steps() >= total - 1e-9; };
  auto report = [&](const char* what) {
    const auto [test_loss, accuracy] = evaluate(*net, forward, test_inputs, test_targets);
    if (shoal::is_main()) {
      std::printf("%s samples %lld scaled %.2f commits %lld world %d loss %.4f accuracy %.4f\n",
                  what, static_cast<long long>(samples()), state.scaled_steps(),
                  static_cast<long long>(state.version()), shoal::world_size(), test_loss,
                  accuracy);
      std::fflush(stdout);
    }
  };
  shoal::elastic::run(state, [&] {
    std::printf("train pid=%d rank=%d world=%d step=%lld\n", static_cast<int>(::getpid()),
                shoal::rank(), shoal::world_size(), static_cast<long long>(state.version()));
    std::fflush(stdout);
    for (; !done(); state.next_epoch()) {
      for (auto& b : loader.epoch(state.epoch())) {
        // The reference's cosine decay over its progress; the policy's gain on top (set at once
        // by set_base_learning_rates).
        const double base =
            s.lr * 0.5 * (1 + std::cos(M_PI * std::min(1.0, state.scaled_steps() / total)));
        state.set_base_learning_rates({base});
        const double rate = optimizer->param_groups()[0].options().get_lr();
        const int64_t trained = sampler.global_batch_size();  // before the commit may change it
        optimizer->zero_grad();
        const torch::Tensor logits = model(b.data);
        const torch::Tensor loss = torch::nn::functional::cross_entropy(
            logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}));
        if (s.precision == "fp16-reduce") {
          scaler.scale(loss).backward();
          scaler.step(*optimizer);
          scaler.update();
        } else {
          loss.backward();
          optimizer->step();
        }
        state.commit();
        if (shoal::is_main()) {
          std::printf("step %lld world %d samples %lld scaled %.2f lr %.5f gain %.3f loss %.4f",
                      static_cast<long long>(state.version()), shoal::world_size(),
                      static_cast<long long>(samples()), state.scaled_steps(), rate, state.gain(),
                      loss.item<double>());
          std::printf(" batch %lld\n", static_cast<long long>(trained));
          std::fflush(stdout);
        }
        auto& evaluated = state.value("evaluated");
        if (samples() / s.eval_every > evaluated.item<int64_t>()) {
          evaluated.fill_(samples() / s.eval_every);
          report("eval");
        }
        if (done()) break;
      }
    }
  });
  report("final");
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string model_name = "cnn";
  int64_t limit = 12000;
  int64_t test_size = 0;
  std::string start_when;
  CLI::App app{
      "The demo CNN on Fashion-MNIST, or a character-level GPT, under an elastic batch "
      "policy (bench/convergence.py)"};
  app.add_option("--policy", s.policy, "global, scale, adascale or goodput (default global)")
      ->check(CLI::IsMember({"global", "scale", "adascale", "goodput"}));
  app.add_option("--model", model_name, "cnn (the demo's, on Fashion-MNIST; the default) or gpt")
      ->check(CLI::IsMember({"cnn", "gpt"}));
  app.add_option("--batch", s.batch, "the reference's batch, one worker's (default 64)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", s.lr, "lr0, the reference's rate before its cosine decay (default 0.05)")
      ->check(CLI::PositiveNumber);
  app.add_option("--epochs", s.epochs, "the reference's epochs (default 3)")
      ->check(CLI::PositiveNumber);
  app.add_option("--limit", limit, "training samples, the first N (default 12000)")
      ->check(CLI::PositiveNumber);
  app.add_option(
         "--precision", s.precision,
         "fp32 (the default); bf16 (compute in bfloat16), bf16-reduce (gradients reduced in "
         "bfloat16), bf16-all (both), fp16-reduce (gradients in float16, with loss scaling)")
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-reduce", "bf16-all", "fp16-reduce"}));
  app.add_option("--seed", s.seed, "initial parameters and data order (default 0)");
  app.add_option("--eval-every", s.eval_every, "samples between evaluations (default 1500)")
      ->check(CLI::PositiveNumber);
  app.add_option("--test-size", test_size, "test samples (default: cnn limit/6, gpt all)")
      ->check(CLI::PositiveNumber);
  app.add_option("--start-when", start_when,
                 "join the job once this file exists (default: at once)");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto wait_for_gate = [&] {
      while (!start_when.empty() && !std::filesystem::exists(start_when))
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      shoal::InitOptions init;
      init.intra_op_threads = 1;
      shoal::init(init);
      torch::manual_seed(s.seed);
    };
    if (model_name == "cnn") {
      FashionMnist train_set =
          FashionMnist(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTrain).head(limit);
      const FashionMnist test =
          FashionMnist(shoal::datasets::kFashionMnistRoot, FashionMnist::Split::kTest)
              .head(test_size > 0 ? test_size : std::max<int64_t>(1, limit / 6));
      wait_for_gate();
      fashion_mnist::Net net;
      train(net, std::move(train_set), test.images(), test.labels(), s, [&](auto parameters) {
        return std::make_unique<torch::optim::SGD>(parameters,
                                                   torch::optim::SGDOptions(s.lr).momentum(0.9));
      });
    } else {
      GptConfig config;
      auto [train_windows, test_windows] = gpl_windows(config.time, config.vocabulary);
      if (limit > train_windows.size(0)) {
        throw shoal::UsageError("--limit: the GPT has " + std::to_string(train_windows.size(0)) +
                                " training windows; expected at most that, got " +
                                std::to_string(limit));
      }
      train_windows = train_windows.narrow(0, 0, limit);
      if (test_size > 0)
        test_windows = test_windows.narrow(0, 0, std::min(test_size, test_windows.size(0)));
      const int64_t time = config.time;
      wait_for_gate();
      Gpt net(config);
      train(net, Windows(train_windows), test_windows.narrow(1, 0, time),
            test_windows.narrow(1, 1, time), s, [&](auto parameters) {
              return std::make_unique<torch::optim::AdamW>(
                  parameters, torch::optim::AdamWOptions(s.lr).weight_decay(0.01));
            });
    }
  } catch (const shoal::UsageError& e) {
    std::fprintf(stderr, "convergence: %s\n", e.what());
    return 2;
  }
  return 0;
}
