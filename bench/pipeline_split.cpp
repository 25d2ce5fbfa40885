// The cost of the zero-bubble split of the backward (src/pipeline/split_backward.h): the time of
// I (the input's gradient) and of W (the parameters' gradients) beside one backward(), on a stack
// of Linear layers with ReLUs between, one process. I + W should cost about one backward, not
// two: each half computes only its own matrix products. See docs/pipeline.md.
//
//   build/bench/pipeline_split [--layers 4] [--width 1024] [--batch 64] [--rounds 40]
//                              [--threads 1] [--raw FILE]
//
// Each round runs one step of both contenders, the plain backward first on even rounds and the
// split first on odd ones, after --rounds / 4 warm-up rounds. The table gives medians over the
// rounds; --raw FILE appends one line per round (the order and the three times).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <vector>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "pipeline/split_backward.h"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"I and W of the split backward beside one backward"};
  int layers = 4, rounds = 40, threads = 1;
  int64_t width = 1024, batch = 64;
  std::string raw;
  app.add_option("--layers", layers, "Linear layers in the stack")->check(CLI::PositiveNumber);
  app.add_option("--width", width, "features in and out of every layer")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "rows of the micro-batch")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "measured rounds")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::PositiveNumber);
  app.add_option("--raw", raw, "append one line per round to this file");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);

  torch::manual_seed(0);
  torch::nn::Sequential stack;
  for (int l = 0; l < layers; ++l) {
    stack->push_back(torch::nn::Linear(width, width));
    if (l + 1 < layers) stack->push_back(torch::nn::ReLU());
  }
  const auto x = torch::randn({batch, width});
  const auto dy = torch::randn({batch, width});

  auto plain = [&] {
    stack->zero_grad();
    auto input = x.clone().requires_grad_(true);
    auto out = stack->forward(input);
    const auto start = Clock::now();
    out.backward(dy);
    return ms_since(start);
  };
  auto split = [&] {
    stack->zero_grad();
    auto input = x.clone().requires_grad_(true);
    shoal::pipeline::detail::SplitBackward halves(stack->forward(input), input);
    auto start = Clock::now();
    auto dx = halves.input_gradient(dy);
    const double i_ms = ms_since(start);
    start = Clock::now();
    halves.weight_gradient();
    return std::make_pair(i_ms, ms_since(start));
  };

  std::ofstream raw_out;
  if (!raw.empty()) raw_out.open(raw, std::ios::app);
  std::vector<double> backward_ms, i_ms, w_ms, sum_ms;
  const int warmup = std::max(1, rounds / 4);
  for (int r = -warmup; r < rounds; ++r) {
    double b = 0;
    std::pair<double, double> iw;
    if (r % 2 == 0) {
      b = plain();
      iw = split();
    } else {
      iw = split();
      b = plain();
    }
    if (r < 0) continue;
    backward_ms.push_back(b);
    i_ms.push_back(iw.first);
    w_ms.push_back(iw.second);
    sum_ms.push_back(iw.first + iw.second);
    if (raw_out) {
      raw_out << "layers=" << layers << " width=" << width << " batch=" << batch
              << " threads=" << threads
              << " order=" << (r % 2 == 0 ? "backward,split" : "split,backward")
              << " backward_ms=" << b << " i_ms=" << iw.first << " w_ms=" << iw.second << "\n";
    }
  }
  const double b = median(backward_ms), i = median(i_ms), w = median(w_ms), s = median(sum_ms);
  std::printf("%d x Linear(%lld, %lld), batch %lld, %d thread(s), median of %d rounds\n", layers,
              static_cast<long long>(width), static_cast<long long>(width),
              static_cast<long long>(batch), threads, rounds);
  std::printf("%-12s %10s %10s\n", "", "ms", "/backward");
  std::printf("%-12s %10.2f %10.2f\n", "backward", b, 1.0);
  std::printf("%-12s %10.2f %10.2f\n", "I", i, i / b);
  std::printf("%-12s %10.2f %10.2f\n", "W", w, w / b);
  std::printf("%-12s %10.2f %10.2f\n", "I + W", s, s / b);
  return 0;
}
