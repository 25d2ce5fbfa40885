// Mixed precision (DataParallelOptions::mixed_precision, shoal::GradScaler; docs/memory.md,
// "Mixed precision") against oracles computed in the test: what a bfloat16 forward computes and
// keeps, the one-process bfloat16 run, and the exact float32 sums of 16-bit parts that a reduce
// in bfloat16 or float16 gives, at every ZeRO stage.
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compare.h"
#include "error_of.h"
#include "harness.h"
#include "shoal/shoal.h"

namespace {

using shoal::testing::run_workers;

constexpr int64_t kIn = 6, kHidden = 7, kOut = 3, kPerWorker = 4;

// Records the dtype its hidden layer computed in.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
    scale = register_parameter("scale", torch::ones({}));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc1(x);
    hidden_dtype = h.scalar_type();
    return fc2(torch::tanh(h)) * scale;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale;
  at::ScalarType hidden_dtype = at::kFloat;
};
TORCH_MODULE(Net);

std::vector<torch::Tensor> trainable(const Net& net) {
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  return params;
}

using shoal::testing::relative_difference;

torch::Tensor batch_of(const torch::Tensor& all, int worker) {
  return all.narrow(0, worker * kPerWorker, kPerWorker);
}

// Every worker's local gradient of its shard's mean loss (times `loss_scale`), computed here on
// one process from a copy of the model: element i of result[w] is worker w's.
std::vector<std::vector<torch::Tensor>> local_gradients(Net& copy, const torch::Tensor& x,
                                                        const torch::Tensor& y, int n,
                                                        double loss_scale) {
  std::vector<std::vector<torch::Tensor>> grads;
  for (int w = 0; w < n; ++w) {
    for (auto& p : copy->parameters()) p.mutable_grad().reset();
    (torch::nn::functional::cross_entropy(copy->forward(batch_of(x, w)), batch_of(y, w)) *
     loss_scale)
        .backward();
    std::vector<torch::Tensor> g;
    for (auto& p : trainable(copy)) g.push_back(p.grad().reshape(-1).clone());
    grads.push_back(std::move(g));
  }
  return grads;
}

// A batch over the world's workers, the model (the same on every worker), and every worker's
// local gradient of its shard's mean loss times `loss_scale`.
struct Problem {
  explicit Problem(double loss_scale) {
    const int n = shoal::world_size();
    torch::manual_seed(3);
    x = torch::randn({n * kPerWorker, kIn});
    y = torch::randint(kOut, {n * kPerWorker});
    torch::manual_seed(5);
    Net copy;
    torch::manual_seed(5);
    net = Net();
    locals = local_gradients(copy, x, y, n, loss_scale);
  }
  torch::Tensor x, y;
  Net net{nullptr};
  std::vector<std::vector<torch::Tensor>> locals;
};

// The average that a member who owns an element computes of it: its own value in float32, the
// others' rounded to `wire` on their way, summed in member order, divided by n.
torch::Tensor owner_average(const std::vector<torch::Tensor>& values, int owner,
                            at::ScalarType wire) {
  const int n = static_cast<int>(values.size());
  torch::Tensor sum = values[owner].clone();
  for (int j = 0; j < n; ++j) {
    if (j != owner) sum.add_(values[j].to(wire).to(values[j].scalar_type()));
  }
  return sum.div_(n);
}

// Where member r's part of a range of `length` elements starts (comm::split_sizes).
std::vector<int64_t> starts_of(int64_t length, int n) {
  const auto sizes = shoal::comm::split_sizes(length, n);
  std::vector<int64_t> starts{0};
  for (auto s : sizes) starts.push_back(starts.back() + s);
  return starts;
}

// ----- Computing in bfloat16 -----

void bfloat16_forward(int stage) {
  const int n = shoal::world_size(), r = shoal::rank();
  torch::manual_seed(7);
  const auto x = torch::randn({3, n * kPerWorker, kIn});
  const auto y = torch::randint(kOut, {3, n * kPerWorker});
  torch::manual_seed(11);
  Net reference;
  torch::manual_seed(11);
  Net net;
  shoal::DataParallelOptions options;
  options.zero_stage = stage;
  options.mixed_precision.compute = at::kBFloat16;
  shoal::DataParallel model(net, options);
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(0.01));
  torch::optim::Adam ref_opt(trainable(reference), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    // The one-process run over the whole batch under the same autocast.
    ref_opt.zero_grad();
    {
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
      torch::Tensor total = torch::zeros({});
      for (int w = 0; w < n; ++w) {
        total = total +
                torch::nn::functional::cross_entropy(
                    reference->forward(batch_of(x[step], w)).to(at::kFloat), batch_of(y[step], w));
      }
      at::autocast::set_cpu_enabled(false);
      at::autocast::clear_cache();
      (total / n).backward();
    }
    ref_opt.step();

    opt.zero_grad();
    auto out = model(batch_of(x[step], r));
    EXPECT_EQ(net->hidden_dtype, at::kBFloat16) << "stage " << stage;
    EXPECT_EQ(out.scalar_type(), at::kFloat) << "stage " << stage;
    EXPECT_FALSE(at::autocast::is_cpu_enabled()) << "autocast left on after the forward";
    torch::nn::functional::cross_entropy(out, batch_of(y[step], r)).backward();
    for (const auto& p : model.parameters()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    }
    opt.step();
  }
  for (const auto& p : model.parameters()) {
    const auto& state = static_cast<torch::optim::AdamParamState&>(
        *opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    EXPECT_EQ(state.exp_avg().scalar_type(), at::kFloat);
    EXPECT_EQ(state.exp_avg_sq().scalar_type(), at::kFloat);
  }
  model.gather_parameters();
  // Each worker's bfloat16 products round differently from the one process's over the whole
  // batch (a weight's gradient is a product summed over the batch): bfloat16's 8 bits.
  EXPECT_LT(relative_difference(trainable(net), trainable(reference)), 1e-2) << "stage " << stage;
  // The forward outside DataParallel is float32 again.
  net->forward(batch_of(x[0], r));
  EXPECT_EQ(net->hidden_dtype, at::kFloat);
}

TEST(Precision, ComputesInBFloat16AndKeepsFloat32State) {
  run_workers(2, [] {
    for (int stage : {0, 3}) bfloat16_forward(stage);
  });
}

// Recomputing a block in backward under the bfloat16 policy replays autocast; the weights it casts
// must not outlive that backward (autocast's cache), or the next step computes with the weights
// of before the optimizer's step.
TEST(Precision, RecomputedBlocksCastEachStepsWeights) {
  const auto train = [](bool recomputed) {
    torch::manual_seed(21);
    torch::nn::Sequential blocks(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
                                 torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
                                 torch::nn::Linear(kHidden, kOut));
    auto net = recomputed ? shoal::recompute_every(blocks, 1) : blocks;
    shoal::DataParallelOptions options;
    options.mixed_precision.compute = at::kBFloat16;
    shoal::DataParallel model(net.ptr(), options);
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.5));
    torch::manual_seed(22);
    const auto x = torch::randn({4, 16, kIn});
    const auto y = torch::randint(kOut, {4, 16});
    for (int step = 0; step < 4; ++step) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model(x[step]), y[step]).backward();
      opt.step();
    }
    return net->parameters();
  };
  EXPECT_LT(relative_difference(train(true), train(false)), 1e-6);
}

// ----- Reducing in 16 bits -----

// One backward with gradients reduced in `wire`; every worker's .grad (stage 0) or slice's .grad
// (ZeRO) against the exact sum the owner of each element computes.
void reduce_in(at::ScalarType wire, int stage) {
  const int n = shoal::world_size(), r = shoal::rank();
  Problem problem(1.0);
  auto& [x, y, net, locals] = problem;

  shoal::DataParallelOptions options;
  options.zero_stage = stage;
  options.mixed_precision.reduce = wire;
  // One bucket at stage 0, whose parts are cut over the members in reverse registration order
  // in the first backward; several under ZeRO, each cut by member.
  options.bucket_bytes = stage == 0 ? (1 << 30) : 64;
  options.first_bucket_bytes = stage == 0 ? (1 << 30) : 32;
  shoal::DataParallel model(net, options);
  torch::nn::functional::cross_entropy(model(batch_of(x, r)), batch_of(y, r)).backward();

  const auto params = trainable(net);
  const size_t count = params.size();
  const std::string what = std::string(c10::toString(wire)) + " stage " + std::to_string(stage);
  std::vector<torch::Tensor> exact(count), rounded(count);  // float32 oracle and 16-bit oracle
  if (stage == 0) {
    // The bucket: the parameters in reverse order, member j owning split_sizes' part j.
    std::vector<torch::Tensor> bucket(n);
    for (int w = 0; w < n; ++w) {
      std::vector<torch::Tensor> flat;
      for (size_t k = count; k-- > 0;) flat.push_back(locals[w][k]);
      bucket[w] = torch::cat(flat);
    }
    const auto starts = starts_of(bucket[0].numel(), n);
    std::vector<torch::Tensor> pieces;
    for (int owner = 0; owner < n; ++owner) {
      std::vector<torch::Tensor> parts;
      for (int w = 0; w < n; ++w)
        parts.push_back(bucket[w].slice(0, starts[owner], starts[owner + 1]));
      // The owner's average goes back to everyone rounded to the wire's dtype.
      pieces.push_back(owner_average(parts, owner, wire).to(wire).to(at::kFloat));
    }
    const auto average = torch::cat(pieces);
    int64_t at = 0;
    for (size_t k = count; k-- > 0;) {
      rounded[k] = average.narrow(0, at, params[k].numel()).view_as(params[k]);
      at += params[k].numel();
    }
    for (size_t k = 0; k < count; ++k) {
      torch::Tensor sum = torch::zeros_like(locals[0][k]);
      for (int w = 0; w < n; ++w) sum += locals[w][k];
      exact[k] = (sum / n).view_as(params[k]);
    }
    std::vector<torch::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    EXPECT_LT(relative_difference(grads, rounded), 1e-6) << what;
    EXPECT_GT(relative_difference(grads, exact), 1e-4) << what << ": no rounding seen";
    return;
  }
  // ZeRO: this worker's slice of each parameter, averaged by it, not rounded after.
  const auto slices = model.parameters();
  ASSERT_EQ(slices.size(), count);
  std::vector<torch::Tensor> grads;
  for (size_t k = 0; k < count; ++k) {
    const auto starts = starts_of(params[k].numel(), n);
    std::vector<torch::Tensor> parts;
    for (int w = 0; w < n; ++w) parts.push_back(locals[w][k].slice(0, starts[r], starts[r + 1]));
    rounded[k] = owner_average(parts, r, wire);
    torch::Tensor sum = torch::zeros_like(parts[0]);
    for (int w = 0; w < n; ++w) sum += parts[w];
    exact[k] = sum / n;
    if (slices[k].numel() == 0) {
      rounded[k] = exact[k] = torch::zeros({1});
      grads.push_back(torch::zeros({1}));
      continue;
    }
    ASSERT_TRUE(slices[k].grad().defined()) << what;
    grads.push_back(slices[k].grad());
  }
  EXPECT_LT(relative_difference(grads, rounded), 1e-6) << what;
  EXPECT_GT(relative_difference(grads, exact), 1e-5) << what << ": no rounding seen";
}

TEST(Precision, ReducesIn16BitsSummedInFloat32AtEveryStage) {
  run_workers(3, [] {
    for (auto wire : {at::kBFloat16, at::kHalf}) {
      for (int stage : {0, 1, 2, 3}) reduce_in(wire, stage);
    }
  });
}

// ----- Loss scaling -----

// Gradients of 1e-8 and below, reduced in float16: they round to zero without a scale and come
// through with one.
double small_gradients(int stage, bool scaled) {
  const int n = shoal::world_size(), r = shoal::rank();
  constexpr double kTiny = 1e-8;
  Problem problem(kTiny);
  auto& [x, y, net, locals] = problem;
  shoal::DataParallelOptions options;
  options.zero_stage = stage;
  options.mixed_precision.reduce = at::kHalf;
  shoal::DataParallel model(net, options);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(1.0));
  shoal::GradScaler scaler;
  auto loss = torch::nn::functional::cross_entropy(model(batch_of(x, r)), batch_of(y, r)) * kTiny;
  (scaled ? scaler.scale(loss) : loss).backward();
  if (scaled) scaler.unscale(opt);
  // The float32 average of this worker's slices (stage 0: of the whole parameters).
  const auto params = trainable(net);
  const auto slices = model.parameters();
  std::vector<torch::Tensor> grads, exact;
  for (size_t k = 0; k < params.size(); ++k) {
    torch::Tensor sum = torch::zeros_like(locals[0][k]);
    for (int w = 0; w < n; ++w) sum += locals[w][k];
    torch::Tensor average = sum / n;
    if (stage > 0) {
      const auto starts = starts_of(params[k].numel(), n);
      average = average.slice(0, starts[r], starts[r + 1]);
      if (average.numel() == 0) continue;
    }
    exact.push_back(average.reshape(-1));
    grads.push_back(slices[k].grad().reshape(-1));
  }
  EXPECT_TRUE(scaler.step(opt) || !scaled);
  return relative_difference(grads, exact);
}

TEST(Precision, Float16GradientsNeedAndGetLossScaling) {
  run_workers(2, [] {
    for (int stage : {0, 2}) {
      const double unscaled = small_gradients(stage, false);
      const double scaled = small_gradients(stage, true);
      EXPECT_GT(unscaled, 0.3) << "stage " << stage << ": float16 kept gradients of 1e-8";
      EXPECT_LT(scaled, 2e-3) << "stage " << stage;
    }
  });
}

// A scalar parameter lies in the first worker's slice alone (split_sizes(1, 3) = 1, 0, 0): its
// scaled gradient overflows float16 there only, and every worker must skip the step with it.
struct ScalarNetImpl : torch::nn::Module {
  ScalarNetImpl() {
    fc = register_module("fc", torch::nn::Linear(kIn, kOut));
    bias = register_parameter("bias", torch::zeros({}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x) + bias; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor bias;
};
TORCH_MODULE(ScalarNet);

TEST(Precision, AnOverflowAnywhereSkipsTheStepEverywhere) {
  run_workers(3, [] {
    const int r = shoal::rank();
    torch::manual_seed(9);
    ScalarNet net;
    shoal::DataParallelOptions options;
    options.zero_stage = 2;
    options.mixed_precision.reduce = at::kHalf;
    shoal::DataParallel model(net, options);
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.01));
    shoal::GradScalerOptions scaling;
    scaling.init_scale = 1e4;
    shoal::GradScaler scaler(scaling);
    torch::manual_seed(1);
    const auto x = torch::randn({3 * kPerWorker, kIn}) * 1e-3;
    // d loss / d bias = 20: scaled by 1e4 and 5e3 it overflows float16 (65504), by 2500 not.
    const std::vector<bool> expected{false, false, true};
    const std::vector<double> scales{1e4, 5e3, 2.5e3};
    for (size_t step = 0; step < expected.size(); ++step) {
      EXPECT_EQ(scaler.get_scale(), scales[step]);
      model.gather_parameters();
      std::vector<torch::Tensor> before;
      for (const auto& p : net->parameters()) before.push_back(p.clone());
      opt.zero_grad();
      auto out = model(batch_of(x, r));
      scaler.scale(out.sum() * 1e-3 + net->bias * 20).backward();
      EXPECT_EQ(scaler.step(opt), expected[step]) << "step " << step << " on worker " << r;
      scaler.update();
      model.gather_parameters();
      const auto after = net->parameters();
      bool same = true;
      for (size_t i = 0; i < after.size(); ++i) same = same && torch::equal(after[i], before[i]);
      EXPECT_EQ(same, !expected[step]) << "step " << step << " on worker " << r;
    }
    EXPECT_EQ(scaler.get_scale(), 2.5e3);
  });
}

// ----- Bad input -----

TEST(Precision, BadPoliciesAreRefusedInOneLine) {
  const auto refused = [](auto change) {
    shoal::DataParallelOptions options;
    change(options);
    return shoal::testing::error_of<shoal::UsageError>(
        [&] { shoal::DataParallel model(Net(), options); });
  };
  EXPECT_EQ(
      refused([](auto& o) { o.mixed_precision.compute = at::kHalf; }),
      "DataParallel: mixed_precision.compute is Half, and LibTorch's CPU autocast computes in "
      "BFloat16 only; expected at::kBFloat16 or at::kFloat");
  EXPECT_EQ(
      refused([](auto& o) { o.mixed_precision.compute = at::kDouble; }),
      "DataParallel: mixed_precision.compute is Double; expected at::kBFloat16 or at::kFloat");
  EXPECT_EQ(refused([](auto& o) { o.mixed_precision.reduce = at::kInt; }),
            "DataParallel: mixed_precision.reduce is Int; expected at::kFloat, at::kBFloat16 or "
            "at::kHalf");
  EXPECT_EQ(refused([](auto& o) {
              o.mixed_precision.reduce = at::kBFloat16;
              o.comm_hook = shoal::dp::fp16_compress_hook();
            }),
            "DataParallel: mixed_precision.reduce is BFloat16 and a comm_hook is given, which "
            "decides the dtype itself; expected one of the two");

  const auto scaler_refused = [](auto change) {
    shoal::GradScalerOptions options;
    change(options);
    return shoal::testing::error_of<shoal::UsageError>([&] { shoal::GradScaler scaler(options); });
  };
  EXPECT_EQ(scaler_refused([](auto& o) { o.init_scale = 0; }),
            "GradScaler: init_scale is 0.000000; expected a positive finite number");
  EXPECT_EQ(scaler_refused([](auto& o) { o.growth_interval = 0; }),
            "GradScaler: growth_interval is 0; expected 1 or more");
  shoal::GradScaler scaler;
  EXPECT_EQ(shoal::testing::error_of<shoal::UsageError>([&] { scaler.update(); }),
            "GradScaler: update() before step(); expected scale, backward, step, update");
  EXPECT_EQ(
      shoal::testing::error_of<shoal::UsageError>([&] { scaler.load_state(torch::ones({3})); }),
      "GradScaler: load_state given 3 values; expected the 2 of state()");
}

}  // namespace
