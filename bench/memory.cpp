// Memory and throughput of DataParallel's ZeRO stages (docs/memory.md), side by side in one job:
// a small GPT (token embedding, pre-norm blocks of causal self-attention and a 4x MLP, a head)
// trained with Adam at each of --stages, optionally with every block recomputed.
//
//   shoal run -n 4 memory [--stages 0,1,2,3] [--recompute 0,1] [--width 256] [--layers 4]
//                         [--batch 8] [--seq 64] [--vocab 512] [--steps 12] [--block 3]
//                         [--bucket-mb 25] [--unit-mb 1]
//
// Memory: each contender alone (built, one untimed step, then --block steps), the peak of the bytes
// every tensor holds, from a CPU allocator that counts them (as tests/zero_test.cpp's), the main
// worker's (tests/counting_allocator.h), beside the formula's bytes per parameter (float32 Adam:
// 16, 8 + 8/N, 4 + 12/N, 16/N). On shared memory stage 0's buckets lie in a segment the allocator
// does not see: measure memory with SHOAL_COMM=tcp.
// Throughput: all contenders alive together, taking turns in blocks of --block steps, the order
// rotating from cycle to cycle, each block between two barriers; --steps steps each. One line per
// contender:
//
//   memory stage=2 recompute=0 workers=4 params=3.4e6 peak_mb=... formula_mb=... samples_per_s=...
//       ratio=...   (samples/s over the first contender's)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "../tests/counting_allocator.h"
#include "shoal/shoal.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t width, layers, seq, vocab;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) : width(width) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    qkv = register_module("qkv", torch::nn::Linear(width, 3 * width));
    proj = register_module("proj", torch::nn::Linear(width, width));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    up = register_module("up", torch::nn::Linear(width, 4 * width));
    down = register_module("down", torch::nn::Linear(4 * width, width));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t heads = 4, t = x.size(1);
    auto parts = qkv(norm1(x)).chunk(3, -1);
    auto split = [&](const torch::Tensor& z) {
      return z.view({x.size(0), t, heads, -1}).transpose(1, 2);
    };
    auto scores = torch::matmul(split(parts[0]), split(parts[1]).transpose(-2, -1)) /
                  std::sqrt(static_cast<double>(width / heads));
    auto mask = torch::ones({t, t}, torch::kBool).triu(1);
    auto attended =
        torch::matmul(torch::softmax(scores.masked_fill(mask, -1e9), -1), split(parts[2]));
    auto h = x + proj(attended.transpose(1, 2).reshape({x.size(0), t, width}));
    return h + down(torch::gelu(up(norm2(h))));
  }
  int64_t width;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(const Shape& shape, int recompute_every) : recompute_every(recompute_every) {
    embed = register_module("embed", torch::nn::Embedding(shape.vocab, shape.width));
    position = register_parameter("position", torch::randn({shape.seq, shape.width}) * 0.02);
    for (int64_t i = 0; i < shape.layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Block(shape.width)));
    norm =
        register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape.width})));
    head = register_module("head", torch::nn::Linear(shape.width, shape.vocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = embed(tokens) + position;
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto& block = blocks[i];
      if (recompute_every > 0 && i % static_cast<size_t>(recompute_every) == 0) {
        x = shoal::recompute(
            *block, [block](const torch::Tensor& h) mutable { return block->forward(h); }, x);
      } else {
        x = block->forward(x);
      }
    }
    return head(norm(x));
  }
  int recompute_every;
  torch::nn::Embedding embed{nullptr};
  torch::Tensor position;
  std::vector<Block> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Gpt);

struct Contender {
  int stage = 0;
  int recompute = 0;
  Gpt net{nullptr};
  std::unique_ptr<shoal::DataParallel<GptImpl>> model;
  std::unique_ptr<torch::optim::Adam> opt;
  double seconds = 0;
};

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

void build(Contender& c, const Shape& shape, int64_t bucket_bytes, int64_t unit_bytes) {
  torch::manual_seed(1);
  c.net = Gpt(shape, c.recompute);
  shoal::DataParallelOptions options;
  options.zero_stage = c.stage;
  options.bucket_bytes = bucket_bytes;
  options.first_bucket_bytes = std::min<int64_t>(options.first_bucket_bytes, bucket_bytes);
  options.unit_bytes = unit_bytes;
  c.model = std::make_unique<shoal::DataParallel<GptImpl>>(c.net, options);
  c.opt =
      std::make_unique<torch::optim::Adam>(c.model->parameters(), torch::optim::AdamOptions(1e-4));
}

void step(Contender& c, const torch::Tensor& tokens, const torch::Tensor& targets) {
  c.opt->zero_grad();
  auto logits = (*c.model)(tokens);
  torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), targets.view({-1}))
      .backward();
  c.opt->step();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeRO stages: memory and throughput side by side"};
  std::string stages_text = "0,1,2,3", recompute_text = "0";
  Shape shape{256, 4, 64, 512};
  int64_t batch = 8;
  int steps = 12, block = 3;
  app.add_option("--stages", stages_text);
  app.add_option("--recompute", recompute_text, "0: none; k: every k-th block recomputed");
  app.add_option("--width", shape.width);
  app.add_option("--layers", shape.layers);
  app.add_option("--seq", shape.seq);
  app.add_option("--vocab", shape.vocab);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--block", block);
  double bucket_mb = 25, unit_mb = 1;
  app.add_option("--bucket-mb", bucket_mb, "DataParallelOptions::bucket_bytes, in MiB");
  app.add_option("--unit-mb", unit_mb, "DataParallelOptions::unit_bytes, in MiB (stage 3)");
  CLI11_PARSE(app, argc, argv);

  const auto bucket_bytes = static_cast<int64_t>(bucket_mb * 1024 * 1024);
  const auto unit_bytes = static_cast<int64_t>(unit_mb * 1024 * 1024);
  static shoal::testing::CountingAllocator counting(c10::GetDefaultCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  at::set_num_threads(1);
  shoal::init();
  const int n = shoal::world_size();
  torch::manual_seed(100 + shoal::rank());
  auto tokens = torch::randint(shape.vocab, {batch, shape.seq});
  auto targets = torch::randint(shape.vocab, {batch, shape.seq});

  std::vector<Contender> contenders;
  for (int stage : parse_list(stages_text)) {
    for (int recompute : parse_list(recompute_text)) {
      Contender c;
      c.stage = stage;
      c.recompute = recompute;
      contenders.push_back(std::move(c));
    }
  }
  // Memory: each alone.
  std::vector<double> peak_mb;
  int64_t params = 0;
  for (auto& c : contenders) {
    build(c, shape, bucket_bytes, unit_bytes);
    params = 0;
    for (const auto& p : c.net->parameters()) params += p.numel();
    step(c, tokens, targets);
    counting.reset_peak();
    for (int s = 0; s < block; ++s) step(c, tokens, targets);
    peak_mb.push_back(static_cast<double>(counting.peak()) / 1e6);
    c.model.reset();
    c.opt.reset();
    c.net = Gpt(nullptr);
  }
  // Throughput: all alive, taking turns.
  for (auto& c : contenders) {
    build(c, shape, bucket_bytes, unit_bytes);
    step(c, tokens, targets);
  }
  const int cycles = (steps + block - 1) / block;
  for (int cycle = 0; cycle < cycles; ++cycle) {
    for (size_t i = 0; i < contenders.size(); ++i) {
      auto& c = contenders[(i + static_cast<size_t>(cycle)) % contenders.size()];
      shoal::world().barrier();
      const auto start = Clock::now();
      for (int s = 0; s < block; ++s) step(c, tokens, targets);
      shoal::world().barrier();
      c.seconds += std::chrono::duration<double>(Clock::now() - start).count();
    }
  }
  if (shoal::is_main()) {
    const double formula[] = {16, 8 + 8.0 / n, 4 + 12.0 / n, 16.0 / n};
    const double first = n * batch * cycles * block / contenders[0].seconds;
    for (size_t i = 0; i < contenders.size(); ++i) {
      const auto& c = contenders[i];
      const double rate = n * batch * cycles * block / c.seconds;
      std::printf(
          "memory stage=%d recompute=%d workers=%d params=%.3g peak_mb=%.2f formula_mb=%.2f "
          "samples_per_s=%.1f "
          "ratio=%.3f\n",
          c.stage, c.recompute, n, static_cast<double>(params), peak_mb[i],
          formula[c.stage] * static_cast<double>(params) / 1e6, rate, rate / first);
    }
  }
  return 0;
}
