// DataParallel's ZeRO stages (DataParallelOptions::zero_stage, docs/memory.md) against their
// oracle: the same training on one process over the whole global batch. The model has shapes
// that no worker count divides, a scalar, a weight tied under two names, a frozen parameter and
// batch-norm buffers; each worker starts from a different random model (DataParallel broadcasts
// the first worker's) and trains on its shard with the optimizer built on model.parameters().
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compare.h"
#include "counting_allocator.h"
#include "harness.h"
#include "shoal/shoal.h"

namespace {

using shoal::testing::run_workers;

constexpr int64_t kIn = 6, kHidden = 7, kOut = 3, kPerWorker = 4, kSteps = 6;

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool with_norm = true) {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));  // 42 + 7 elements
    if (with_norm) norm = register_module("norm", torch::nn::BatchNorm1d(kHidden));
    tied = register_parameter("tied_in", torch::randn({kHidden, kHidden}) / 3);
    register_parameter("tied_out", tied);  // the same tensor under a second name
    scale = register_parameter("scale", torch::ones({}));
    frozen = register_parameter("frozen", torch::randn({kHidden}), /*requires_grad=*/false);
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc1(x);
    h = torch::tanh(norm ? norm(h) : h);
    h = torch::tanh(torch::matmul(h, tied));
    h = torch::matmul(h, tied.t()) * scale + frozen;
    return fc2(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::Tensor tied, scale, frozen;
};
TORCH_MODULE(Net);

// The whole world again, over Gloo's TCP path (not shared memory).
shoal::comm::Group tcp_group() {
  std::vector<int> everyone(shoal::world_size());
  std::iota(everyone.begin(), everyone.end(), 0);
  setenv("SHOAL_COMM", "tcp", 1);
  auto tcp = shoal::world().subgroup(everyone);
  unsetenv("SHOAL_COMM");
  return tcp;
}

enum class Optim { kSgd, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::Tensor> params,
                                                        Optim kind) {
  if (kind == Optim::kSgd) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  // An eps above the rounding of a near-zero gradient (tests/dp_test.cpp, make_optimizer).
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01).eps(1e-4));
}

// Each tensor once (the one-process reference's optimizer, as DataParallel::parameters()).
std::vector<torch::Tensor> unique(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    bool seen = false;
    for (const auto& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

using shoal::testing::relative_difference;

struct Case {
  int stage;
  Optim optim;
  double clip;              // 0: no clipping
  bool accumulate = false;  // two micro-batches a step, the first under no_sync()
  int64_t unit_bytes = 1;   // stage 3: a unit per module, gathered and freed many times a step
};

std::string describe(const Case& c) {
  return "stage " + std::to_string(c.stage) + (c.optim == Optim::kSgd ? " sgd" : " adam") +
         " clip " + std::to_string(c.clip) + (c.accumulate ? " no_sync" : "");
}

// Trains the reference on one process and the sharded model on this worker's shards, and checks
// that their parameters and buffers agree after every step.
void train_and_compare(const Case& c, std::optional<shoal::comm::Group> group = std::nullopt) {
  const int n = shoal::world_size(), r = shoal::rank();
  const int micro = c.accumulate ? 2 : 1;
  torch::manual_seed(1234);
  auto x = torch::randn({kSteps, micro, n * kPerWorker, kIn});
  auto y = torch::randint(kOut, {kSteps, micro, n * kPerWorker});

  torch::manual_seed(100);
  Net reference;
  torch::manual_seed(100 + r);
  Net net;
  shoal::DataParallelOptions options;
  options.zero_stage = c.stage;
  options.bucket_bytes = 100;  // several buckets, of parameters cut unevenly
  options.first_bucket_bytes = 40;
  options.group = group;
  options.unit_bytes = c.unit_bytes;
  shoal::DataParallel model(net, options);

  auto ref_opt = make_optimizer(unique(reference->parameters()), c.optim);
  auto opt = make_optimizer(model.parameters(), c.optim);
  ASSERT_EQ(model.parameters().size(), unique(net->parameters()).size());
  const auto shard = [&](const torch::Tensor& t, int step, int m, int w) {
    return t[step][m].narrow(0, w * kPerWorker, kPerWorker);
  };
  for (int step = 0; step < kSteps; ++step) {
    ref_opt->zero_grad();
    std::vector<torch::Tensor> first_buffers;
    for (int m = 0; m < micro; ++m) {
      // The mean over shards of each shard's mean loss; the first worker's buffers win
      // (DataParallel broadcasts them after each synchronized backward).
      torch::Tensor total = torch::zeros({});
      for (int w = 0; w < n; ++w) {
        total = total + torch::nn::functional::cross_entropy(
                            reference->forward(shard(x, step, m, w)), shard(y, step, m, w));
        if (w == 0 && m == micro - 1) {
          for (auto& b : reference->buffers()) first_buffers.push_back(b.clone());
        }
      }
      (total / (n * micro)).backward();
    }
    if (c.clip > 0) torch::nn::utils::clip_grad_norm_(unique(reference->parameters()), c.clip);
    ref_opt->step();
    {
      torch::NoGradGuard no_grad;
      auto buffers = reference->buffers();
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(first_buffers[i]);
    }

    opt->zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto loss =
          torch::nn::functional::cross_entropy(model(shard(x, step, m, r)), shard(y, step, m, r)) /
          micro;
      if (m + 1 < micro) {
        auto guard = model.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    if (c.stage >= 2) {
      // Stages 2 and 3 keep only the slices' gradients.
      for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << describe(c);
    }
    if (c.stage == 3) {
      // Stage 3 holds no parameter's memory between steps.
      for (const auto& p : net->parameters()) {
        if (p.requires_grad()) {
          EXPECT_EQ(p.storage().nbytes(), 0u) << describe(c);
        }
      }
    }
    if (c.clip > 0) model.clip_grad_norm(c.clip);
    opt->step();
    // At stage 3 the next step's forward and backward then gather unit by unit, as they need.
    if (c.stage == 3 && step + 1 < kSteps) continue;
    model.gather_parameters();
    EXPECT_LT(relative_difference(net->parameters(), reference->parameters()), 1e-5)
        << describe(c) << " step " << step;
  }
  // Running statistics (num_batches_tracked is an integer). Under accumulation every worker's
  // first micro-batch updates its own before the first worker's are broadcast, which the
  // reference does not follow; training-mode batch norm does not read them.
  if (c.accumulate) return;
  std::vector<torch::Tensor> nb, rb;
  for (auto& b : net->buffers())
    if (b.is_floating_point()) nb.push_back(b);
  for (auto& b : reference->buffers())
    if (b.is_floating_point()) rb.push_back(b);
  EXPECT_LT(relative_difference(nb, rb), 1e-5) << describe(c);
}

void every_case(std::optional<shoal::comm::Group> group = std::nullopt) {
  for (int stage : {0, 1, 2, 3}) {
    for (Optim optim : {Optim::kSgd, Optim::kAdam}) {
      for (double clip : {0.0, 0.5}) train_and_compare({stage, optim, clip}, group);
    }
  }
  train_and_compare({2, Optim::kAdam, 0.5, true}, group);
  train_and_compare({3, Optim::kAdam, 0.5, true}, group);
  train_and_compare({3, Optim::kSgd, 0.0, false, 1 << 20}, group);  // one unit: the whole model
  train_and_compare({1, Optim::kSgd, 0.0, true}, group);
}

// Stage 3 with a unit per module: gathered and freed many times a step.
shoal::DataParallelOptions stage3_by_module() {
  shoal::DataParallelOptions options;
  options.zero_stage = 3;
  options.unit_bytes = 1;
  return options;
}

// ----- Checkpoints (Note [Saving a sharded model], src/dp/data_parallel.cpp) -----
// Without batch norm, so that the one-process reference trains on the whole global batch,
// whatever the worker count.
constexpr int64_t kSaved = 3, kMore = 3;

std::pair<torch::Tensor, torch::Tensor> checkpoint_data() {
  torch::manual_seed(4321);
  return {torch::randn({kSaved + kMore, 12, kIn}), torch::randint(kOut, {kSaved + kMore, 12})};
}

// Steps [from, to) of the global batches, this worker's share of each (12 samples divide by 1 to
// 4 workers).
void train(const std::function<torch::Tensor(torch::Tensor)>& forward, torch::optim::Optimizer& opt,
           int64_t from, int64_t to, int n, int r) {
  auto [x, y] = checkpoint_data();
  const int64_t per = 12 / n;
  for (int64_t step = from; step < to; ++step) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(forward(x[step].narrow(0, r * per, per)),
                                         y[step].narrow(0, r * per, per))
        .backward();
    opt.step();
  }
}

// The one-process run: kSaved steps, or all of them.
std::pair<Net, std::unique_ptr<torch::optim::Adam>> reference(int64_t steps) {
  torch::manual_seed(100);
  Net net(false);
  auto opt = std::make_unique<torch::optim::Adam>(unique(net->parameters()),
                                                  torch::optim::AdamOptions(0.01).eps(1e-4));
  train([&](torch::Tensor x) { return net->forward(x); }, *opt, 0, steps, 1, 0);
  return {net, std::move(opt)};
}

// Adam's moments of each trainable parameter, in module order, flattened.
std::vector<torch::Tensor> moments(torch::optim::Optimizer& opt,
                                   const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    if (!p.requires_grad()) continue;  // frozen: no state
    auto& state = static_cast<torch::optim::AdamParamState&>(
        *opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    out.push_back(state.exp_avg().reshape(-1));
    out.push_back(state.exp_avg_sq().reshape(-1));
  }
  return out;
}

// Saved at stage 3 on 4 workers, loaded at stage 1 on 2, at stage 3 on 3 and into a plain model
// in one process: the file holds the one-process run's parameters and Adam state, each load
// restores them (every worker's slices of the moments are the reference's), and training on from
// the load ends at the one-process run's parameters.
TEST(Zero, CheckpointsCrossStagesAndWorkerCounts) {
  const std::string path = ::testing::TempDir() + "zero_checkpoint.pt";
  if (!shoal::testing::is_worker()) std::remove(path.c_str());
  run_workers(4, [path] {
    torch::manual_seed(100);
    Net net(false);
    shoal::DataParallel model(net, stage3_by_module());
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01).eps(1e-4));
    train([&](torch::Tensor x) { return model(x); }, opt, 0, kSaved, 4, shoal::rank());
    shoal::save(path, *net, opt);
  });
  auto check_load = [path](int stage) {
    const int n = shoal::world_size(), r = shoal::rank();
    torch::manual_seed(7);  // a different start: everything must come from the file
    Net net(false);
    shoal::DataParallelOptions options;
    options.zero_stage = stage;
    shoal::DataParallel model(net, options);
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01).eps(1e-4));
    shoal::load(path, *net, opt);
    auto [saved, saved_opt] = reference(kSaved);
    model.gather_parameters();
    EXPECT_LT(relative_difference(unique(net->parameters()), unique(saved->parameters())), 1e-5)
        << stage;
    // This worker's slice of each moment is the reference's.
    const auto whole = moments(*saved_opt, unique(saved->parameters()));
    const auto mine = moments(opt, model.parameters());
    ASSERT_EQ(mine.size(), whole.size());
    const auto params = unique(saved->parameters());
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto sizes = shoal::comm::split_sizes(whole[i].numel(), n);
      const int64_t start = std::accumulate(sizes.begin(), sizes.begin() + r, int64_t{0});
      EXPECT_TRUE(torch::allclose(mine[i], whole[i].narrow(0, start, sizes[r]), 1e-5, 1e-7))
          << stage << " " << i;
    }
    train([&](torch::Tensor x) { return model(x); }, opt, kSaved, kSaved + kMore, n, r);
    model.gather_parameters();
    auto [trained, trained_opt] = reference(kSaved + kMore);
    EXPECT_LT(relative_difference(unique(net->parameters()), unique(trained->parameters())), 1e-5)
        << stage;
  };
  run_workers(2, [&] { check_load(1); });
  run_workers(3, [&] { check_load(3); });
  // In one process with no launcher: a plain model and optimizer.
  shoal::testing::WorkersOptions alone;
  alone.launcher = shoal::testing::Launcher::kNone;
  run_workers(
      1,
      [path] {
        Net net(false);
        torch::optim::Adam opt(unique(net->parameters()),
                               torch::optim::AdamOptions(0.01).eps(1e-4));
        shoal::LoadOptions single;
        single.group = shoal::comm::Group::single();
        shoal::load(path, *net, opt, single);
        auto [saved, saved_opt] = reference(kSaved);
        EXPECT_LT(relative_difference(unique(net->parameters()), unique(saved->parameters())),
                  1e-5);
        const auto a = moments(opt, unique(net->parameters()));
        const auto b = moments(*saved_opt, unique(saved->parameters()));
        EXPECT_LT(relative_difference(a, b), 1e-5);
        train([&](torch::Tensor x) { return net->forward(x); }, opt, kSaved, kSaved + kMore, 1, 0);
        auto [trained, trained_opt] = reference(kSaved + kMore);
        EXPECT_LT(relative_difference(unique(net->parameters()), unique(trained->parameters())),
                  1e-5);
      },
      alone);
}

// ----- Peak memory per worker, from the allocator, against the formula (docs/memory.md) -----

struct WideImpl : torch::nn::Module {
  WideImpl() {
    for (int i = 0; i < 16; ++i)
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(256, 256)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = torch::tanh(layer(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Wide);

// Four workers train a model of 1.05 M float32 parameters (Psi) with Adam at each stage; the
// peak of the bytes alive during a step (after the first, whose peak includes the broadcast) is
// at least the formula's bytes per parameter times Psi, and at most that plus what moves, which
// is bounded by the bucket and unit sizes, not by the model's.
TEST(Zero, PeakMemoryPerWorkerFollowsTheFormula) {
  run_workers(4, [] {
    static shoal::testing::CountingAllocator counting(c10::GetDefaultCPUAllocator());
    c10::SetCPUAllocator(&counting, /*priority=*/100);
    const double n = shoal::world_size();
    const double formula[] = {16, 8 + 8 / n, 4 + 12 / n, 16 / n};
    const int64_t moving_cap = 256 * 1024;  // bucket_bytes and unit_bytes
    // Over TCP: on shared memory stage 0's buckets lie in a segment the allocator does not see.
    auto tcp = tcp_group();
    for (int stage : {0, 1, 2, 3}) {
      torch::manual_seed(1);
      Wide net;
      int64_t psi = 0;
      for (const auto& p : net->parameters()) psi += p.numel();
      shoal::DataParallelOptions options;
      options.zero_stage = stage;
      options.bucket_bytes = moving_cap;
      options.first_bucket_bytes = moving_cap;
      options.unit_bytes = moving_cap;
      options.group = tcp;
      shoal::DataParallel model(net, options);
      torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(1e-3));
      auto x = torch::randn({4, 256});
      int64_t peak = 0;
      for (int step = 0; step < 3; ++step) {
        if (step == 1) counting.reset_peak();
        opt.zero_grad();
        model(x).pow(2).mean().backward();
        opt.step();
        peak = counting.peak();
      }
      const double expected = formula[stage] * static_cast<double>(psi);
      // What moves, whatever the model's size: at most two reduce-scatters in flight (each its
      // bucket, what it received and its result), the bucket being filled, the full gradient of
      // the layer backward is at, two gathered buckets, Adam's temporaries: twelve buckets' worth,
      // less than what separates one stage's formula from the next here. Stage 3 adds its units:
      // max_units whole, and their gathers' buffers.
      const double moving = (stage == 3 ? 16.0 : 12.0) * moving_cap;
      std::cout << "stage " << stage << ": peak " << peak / 1e6 << " MB, formula " << expected / 1e6
                << " MB\n";
      EXPECT_GE(static_cast<double>(peak), expected) << "stage " << stage;
      EXPECT_LE(static_cast<double>(peak), expected + moving) << "stage " << stage;
    }
  });
}

class Zero : public ::testing::TestWithParam<int> {};

TEST_P(Zero, EveryStageEqualsOneProcess) {
  run_workers(GetParam(), [] { every_case(); });
}

// Over Gloo's TCP path, where gradients are scaled by 1/n on their way into the bucket.
TEST(Zero, EveryStageEqualsOneProcessOverTcp) {
  run_workers(3, [] {
    auto tcp = tcp_group();
    every_case(tcp);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Zero, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// Each worker's slices are its split_sizes part of every trainable parameter, the same names as
// the module's (a tied weight once), and together they cover every element once.
TEST(Zero, SlicesCoverEveryElementOnce) {
  run_workers(3, [] {
    Net net;
    shoal::DataParallelOptions options;
    options.zero_stage = 1;
    shoal::DataParallel model(net, options);
    const auto named = model.named_parameters();
    EXPECT_EQ(named.keys(),
              (std::vector<std::string>{"tied_in", "scale", "frozen", "fc1.weight", "fc1.bias",
                                        "norm.weight", "norm.bias", "fc2.weight", "fc2.bias"}));
    for (const auto& item : named) {
      const auto& whole = net->named_parameters()[item.key()];
      if (!whole.requires_grad()) {
        EXPECT_TRUE(item.value().is_same(whole)) << item.key();
        continue;
      }
      const auto sizes = shoal::comm::split_sizes(whole.numel(), 3);
      EXPECT_EQ(item.value().numel(), sizes[shoal::rank()]) << item.key();
      auto counts = torch::full({3}, item.value().numel(), torch::kLong);
      shoal::world().all_reduce(counts);
      EXPECT_EQ(counts[0].item<int64_t>(), whole.numel()) << item.key();
    }
  });
}

// The gradient noise measured under ZeRO, where each worker holds a part of the average, is
// the one measured with the average whole on every worker.
TEST(Zero, GradientNoiseEqualsTheReplicatedMeasure) {
  run_workers(3, [] {
    const int n = shoal::world_size(), r = shoal::rank();
    torch::manual_seed(1234);
    auto x = torch::randn({kSteps, n * kPerWorker, kIn});
    auto y = torch::randint(kOut, {kSteps, n * kPerWorker});
    std::vector<shoal::GradientNoise> measured;
    for (int stage : {0, 2}) {
      torch::manual_seed(100);
      Net net;
      shoal::DataParallelOptions options;
      options.zero_stage = stage;
      options.measure_gradient_noise = true;
      options.bucket_bytes = 100;
      shoal::DataParallel model(net, options);
      auto opt = make_optimizer(model.parameters(), Optim::kSgd);
      for (int step = 0; step < kSteps; ++step) {
        opt->zero_grad();
        auto xs = x[step].narrow(0, r * kPerWorker, kPerWorker);
        torch::nn::functional::cross_entropy(model(xs),
                                             y[step].narrow(0, r * kPerWorker, kPerWorker))
            .backward();
        opt->step();
      }
      ASSERT_TRUE(model.gradient_noise().has_value());
      measured.push_back(*model.gradient_noise());
    }
    EXPECT_GT(measured[0].gradient_sqr, 0.0);
    EXPECT_NEAR(measured[1].gradient_sqr, measured[0].gradient_sqr,
                1e-6 * measured[0].gradient_sqr);
    EXPECT_NEAR(measured[1].variance, measured[0].variance, 1e-6 * std::abs(measured[0].variance));
  });
}

// At stage 3 the module's own forward, called directly on the thread that wrapped it (an
// evaluation that skips the wrapper), gathers what it reads too, and so does any operation that
// reads a parameter; the parameters hold no memory again after the next backward.
// Two synchronized backwards before a step, with no zero_grad() between (the gradients
// accumulate, as on one process and under PyTorch's DDP): each stage gives the one-process sum of
// the two averages, and so does the next step after zero_grad().
TEST(Zero, SynchronizedBackwardsAccumulateAsOneProcess) {
  run_workers(3, [] {
    const int n = shoal::world_size(), r = shoal::rank();
    torch::manual_seed(77);
    const auto x = torch::randn({2, 2, n * kPerWorker, kIn});
    const auto y = torch::randint(kOut, {2, 2, n * kPerWorker});
    for (int stage : {0, 1, 2, 3}) {
      torch::manual_seed(78);
      Net reference(/*with_norm=*/false);
      torch::manual_seed(78);
      Net net(/*with_norm=*/false);
      shoal::DataParallelOptions options;
      options.zero_stage = stage;
      options.bucket_bytes = 100;
      options.first_bucket_bytes = 40;
      shoal::DataParallel model(net, options);
      torch::optim::SGD ref_opt(unique(reference->parameters()), torch::optim::SGDOptions(0.1));
      torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < 2; ++step) {
        ref_opt.zero_grad();
        opt.zero_grad();
        for (int pass = 0; pass < 2; ++pass) {
          torch::nn::functional::cross_entropy(reference->forward(x[step][pass]), y[step][pass])
              .backward();
          const auto mine = x[step][pass].narrow(0, r * kPerWorker, kPerWorker);
          const auto labels = y[step][pass].narrow(0, r * kPerWorker, kPerWorker);
          torch::nn::functional::cross_entropy(model(mine), labels).backward();
        }
        ref_opt.step();
        opt.step();
        model.gather_parameters();
        EXPECT_LT(relative_difference(net->parameters(), reference->parameters()), 1e-5)
            << "stage " << stage << ", step " << step;
      }
    }
  });
}

TEST(Zero, Stage3GathersForTheModuleCalledDirectly) {
  run_workers(2, [] {
    torch::manual_seed(100);
    Net reference(false);
    torch::manual_seed(100);
    Net net(false);
    shoal::DataParallel model(net, stage3_by_module());
    for (const auto& p : net->parameters()) {
      if (p.requires_grad()) {
        EXPECT_EQ(p.storage().nbytes(), 0u);
      }
    }
    torch::manual_seed(9);
    auto x = torch::randn({5, kIn});
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(net->forward(x), reference->forward(x)));
    EXPECT_TRUE(torch::equal(net->fc2->bias.clone(), reference->fc2->bias));
  });
}

TEST(Zero, BadOptionsAreRefusedInOneLine) {
  run_workers(2, [] {
    Net net;
    shoal::DataParallelOptions options;
    options.zero_stage = 4;
    try {
      shoal::DataParallel model(net, options);
      ADD_FAILURE() << "zero_stage 4 accepted";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(), "DataParallel: zero_stage must be 0, 1, 2 or 3, got 4");
    }
    options.zero_stage = 2;
    options.comm_hook = shoal::dp::bf16_compress_hook();
    try {
      shoal::DataParallel model(net, options);
      ADD_FAILURE() << "a hook accepted with zero_stage 2";
    } catch (const shoal::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("expected zero_stage 0 with a hook"), std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
