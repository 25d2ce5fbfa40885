// Activation checkpointing (shoal/dp/recompute.h) against the plain run: the same gradients, bit
// for bit on one thread, dropout included; less memory held between forward and backward; and the
// same results under DataParallel with uneven shares, under ZeRO stage 3, and inside a pipeline.
#include <malloc.h>

#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "shoal/shoal.h"

namespace {

using shoal::testing::run_workers;

constexpr int64_t kWidth = 64, kBlocks = 6;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(double dropout) {
    fc = register_module("fc", torch::nn::Linear(kWidth, kWidth));
    drop = register_module("drop", torch::nn::Dropout(dropout));
  }
  at::Tensor forward(const at::Tensor& x) { return x + drop(torch::gelu(fc(x))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

torch::nn::Sequential blocks(double dropout = 0.25) {
  torch::nn::Sequential net;
  for (int64_t i = 0; i < kBlocks; ++i) net->push_back(Block(dropout));
  net->push_back(torch::nn::Linear(kWidth, 3));
  return net;
}

struct Outcome {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
};

// One forward and backward from the same seeds (the model's and the dropout masks').
Outcome run(const std::function<torch::nn::Sequential(torch::nn::Sequential)>& wrap,
            const at::Tensor& x, const at::Tensor& y) {
  torch::manual_seed(3);
  auto net = blocks();
  auto model = wrap(net);
  torch::manual_seed(11);
  auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
  loss.backward();
  Outcome result{loss.detach(), {}};
  for (const auto& p : net->parameters()) result.grads.push_back(p.grad().clone());
  return result;
}

TEST(Recompute, GradientsEqualThePlainRunBitForBitWithDropout) {
  at::set_num_threads(1);
  torch::manual_seed(0);
  auto x = torch::randn({16, kWidth}, torch::requires_grad());
  auto y = torch::randint(3, {16});
  const Outcome plain = run([](torch::nn::Sequential net) { return net; }, x, y);
  for (int k : {1, 2, 3}) {
    const Outcome recomputed =
        run([k](torch::nn::Sequential net) { return shoal::recompute_every(net, k); }, x, y);
    EXPECT_TRUE(torch::equal(recomputed.loss, plain.loss)) << k;
    ASSERT_EQ(recomputed.grads.size(), plain.grads.size());
    for (size_t i = 0; i < plain.grads.size(); ++i)
      EXPECT_TRUE(torch::equal(recomputed.grads[i], plain.grads[i]))
          << "k " << k << " parameter " << i;
  }
  // Without replaying the random state, the masks would differ: the check can fail.
  torch::manual_seed(3);
  auto net = blocks();
  torch::manual_seed(11);
  auto first = net->forward(x);
  auto second = net->forward(x);
  EXPECT_FALSE(torch::equal(first, second));
}

// The function form: two inputs, two outputs, the parameters listed, the input's gradient too.
TEST(Recompute, FunctionOfSeveralTensorsGivesEveryGradient) {
  at::set_num_threads(1);
  torch::manual_seed(1);
  torch::nn::Linear a(5, 4), b(5, 4);
  auto u = torch::randn({3, 5}, torch::requires_grad());
  auto v = torch::randn({3, 5}, torch::requires_grad());
  auto fn = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{torch::tanh(a(in[0])) * b(in[1]), a(in[1]).sum(1)};
  };
  auto plain = fn({u, v});
  (plain[0].sum() + plain[1].pow(2).sum()).backward();
  std::vector<at::Tensor> want{u.grad().clone(), v.grad().clone(), a->weight.grad().clone(),
                               b->weight.grad().clone()};
  for (auto& t : {u, v, a->weight, a->bias, b->weight, b->bias}) t.mutable_grad().reset();
  auto params = a->parameters();
  for (auto& p : b->parameters()) params.push_back(p);
  auto out = shoal::recompute(fn, {u, v}, params);
  (out[0].sum() + out[1].pow(2).sum()).backward();
  std::vector<at::Tensor> got{u.grad(), v.grad(), a->weight.grad(), b->weight.grad()};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(got[i], want[i])) << i;
  // Evaluation runs the function as it is.
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(shoal::recompute(fn, {u, v}, params)[0], fn({u, v})[0]));
}

// What the allocator holds in use (small blocks and mapped large ones).
int64_t in_use() {
  const auto info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

// Between forward and backward, the plain run keeps every block's activations, the recomputed one
// only each recomputed block's input.
TEST(Recompute, HoldsLessMemoryBetweenForwardAndBackward) {
  at::set_num_threads(1);
  auto measure = [](int k) {
    torch::manual_seed(3);
    auto net = blocks(0.1);
    auto model = k == 0 ? net : shoal::recompute_every(net, k);
    auto x = torch::randn({512, kWidth});
    const int64_t before = in_use();
    auto loss = model->forward(x).logsumexp(1).mean();
    const int64_t held = in_use() - before;
    loss.backward();
    return held;
  };
  measure(0);  // warm the allocator
  const int64_t plain = measure(0), every = measure(1), half = measure(2);
  // Per block, the plain run keeps about 4 [512, 64] float tensors; recomputed, one.
  std::cout << "held between forward and backward: plain " << plain << " B, every block recomputed "
            << every << " B, every second " << half << " B\n";
  EXPECT_LT(every, plain / 2) << every << " against " << plain;
  EXPECT_LT(every, half) << every << " against " << half;
  EXPECT_LT(half, plain) << half << " against " << plain;
}

// Under DataParallel (uneven shares: 7 samples on 3 workers) and at ZeRO stage 3, a recomputed
// model trains as the one-process plain model (dropout off: the workers' masks are their own).
TEST(Recompute, UnderDataParallelAndZeroStage3EqualsOneProcess) {
  run_workers(3, [] {
    const int n = shoal::world_size(), r = shoal::rank();
    torch::manual_seed(5);
    auto x = torch::randn({4, 7, kWidth});
    auto y = torch::randint(3, {4, 7});
    const auto sizes = shoal::comm::split_sizes(7, n);
    int64_t start = 0;
    for (int w = 0; w < r; ++w) start += sizes[w];
    for (int stage : {0, 3}) {
      torch::manual_seed(3);
      auto reference = blocks(0.0);
      torch::optim::SGD ref_opt(reference->parameters(),
                                torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::manual_seed(3);
      auto net = blocks(0.0);
      auto recomputed = shoal::recompute_every(net, 2);
      shoal::DataParallelOptions options;
      options.zero_stage = stage;
      options.unit_bytes = 1;
      shoal::DataParallel model(recomputed, options);
      torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < 4; ++step) {
        ref_opt.zero_grad();
        torch::nn::functional::cross_entropy(reference->forward(x[step]), y[step]).backward();
        ref_opt.step();
        opt.zero_grad();
        torch::nn::functional::cross_entropy(model(x[step].narrow(0, start, sizes[r])),
                                             y[step].narrow(0, start, sizes[r]))
            .backward();
        opt.step();
      }
      model.gather_parameters();
      double diff = 0, scale = 0;
      const auto mine = net->parameters(), want = reference->parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        diff = std::max(diff, (mine[i] - want[i]).abs().max().item<double>());
        scale = std::max(scale, want[i].abs().max().item<double>());
      }
      EXPECT_LT(diff / scale, 1e-5) << "stage " << stage;
    }
  });
}

// A pipeline of recomputed blocks gives the plain pipeline's loss and gradients, under GPipe, 1F1B
// and zero-bubble (whose backward is split into input and weight halves).
TEST(Recompute, InsideAPipelineEqualsThePlainPipeline) {
  run_workers(2, [] {
    namespace pp = shoal::pipeline;
    torch::manual_seed(5);
    auto x = torch::randn({8, kWidth});
    auto y = torch::randint(3, {8});
    auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& target) {
      return torch::nn::functional::cross_entropy(out, target);
    };
    for (auto schedule :
         {pp::ScheduleKind::kGPipe, pp::ScheduleKind::k1F1B, pp::ScheduleKind::kZeroBubbleH1}) {
      std::vector<std::vector<at::Tensor>> grads;
      std::vector<double> losses;
      for (bool recomputed : {false, true}) {
        torch::manual_seed(3);
        auto net = blocks(0.0);
        pp::PipelineOptions options;
        options.micro_batches = 4;
        options.schedule = schedule;
        pp::Pipeline pipe(recomputed ? shoal::recompute_every(net, 1) : net, options);
        losses.push_back(pipe.step(x, y, loss_fn).item<double>());
        grads.emplace_back();
        for (const auto& p : pipe.parameters()) grads.back().push_back(p.grad().clone());
      }
      EXPECT_NEAR(losses[1], losses[0], 1e-6 * std::abs(losses[0]));
      ASSERT_EQ(grads[1].size(), grads[0].size());
      for (size_t i = 0; i < grads[0].size(); ++i)
        EXPECT_TRUE(torch::allclose(grads[1][i], grads[0][i], 1e-5, 1e-7)) << i;
    }
  });
}

TEST(Recompute, BadArgumentsAreRefusedInOneLine) {
  torch::nn::Sequential net(torch::nn::Linear(2, 2));
  try {
    shoal::recompute_every(net, 0);
    ADD_FAILURE() << "k = 0 accepted";
  } catch (const shoal::UsageError& e) {
    EXPECT_STREQ(e.what(), "recompute_every: k must be 1 or more, got 0");
  }
}

}  // namespace
