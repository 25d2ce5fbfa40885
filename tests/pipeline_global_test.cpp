// Pipelines of global layers (docs/pipeline.md, "Global layers"): stages placed by their layers'
// placements, member-wise transfers between stages of the same mesh shape. The oracle is the
// same model in plain LibTorch on one process, built from the whole initial values: the loss and
// every parameter's whole gradient (relative 1e-5). The GPT in the pipeline and 3d plans is
// tests/global_examples_test.cpp's. Errors: layouts the pipeline refuses, a wrong activation
// shape.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "shoal/global/nn.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/shoal.h"

namespace {

namespace pp = shoal::pipeline;
namespace g = shoal::global;
using shoal::testing::run_workers;
using Clock = std::chrono::steady_clock;

struct TanhImpl : torch::nn::Module {
  g::GlobalTensor forward(const g::GlobalTensor& x) { return g::tanh(x); }
};
TORCH_MODULE(Tanh);

g::GlobalTensor mse(const g::GlobalTensor& out, const g::GlobalTensor& target) {
  const auto d = g::sub(out, target);
  return g::mean(g::mul(d, d));
}

// Stage 0 on `first`: a column-parallel then a row-parallel linear layer (Megatron's MLP, which
// needs boxing inside the stage); stage 1 on `second`: a layer norm, and a linear layer whose
// weights are broadcast. A parameterless Tanh joins its neighbour's stage.
torch::nn::Sequential model(const g::Placement& first, const g::Placement& second) {
  torch::manual_seed(0);
  return torch::nn::Sequential(g::nn::Linear(5, 8, first, g::split(0)), Tanh(),
                               g::nn::Linear(8, 6, first, g::split(1)), g::nn::LayerNorm(6, second),
                               g::nn::Linear(6, 3, second, g::broadcast()));
}

// Each global parameter's whole value and whole gradient (collective: every worker calls it).
std::vector<std::pair<torch::Tensor, torch::Tensor>> wholes(torch::nn::Sequential net) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  for (const auto& layer : *net) {
    auto module = std::dynamic_pointer_cast<g::nn::Module>(layer.ptr());
    if (!module) continue;
    for (const auto& [name, p] : module->named_global_parameters()) {
      // After the step a piece's gradient is the whole gradient's piece, laid out as the
      // parameter (the pipeline summed the shares).
      const torch::Tensor grad = p.is_local() && p.to_local().grad().defined()
                                     ? p.to_local().grad()
                                     : p.to_local().detach();
      out.emplace_back(p.detach().full(),
                       g::GlobalTensor(grad, p.placement(), p.sbp(), p.shape()).full());
    }
  }
  return out;
}

// The same model in plain LibTorch from whole values; returns the loss and the gradients.
std::pair<double, std::vector<torch::Tensor>> one_process(
    const std::vector<std::pair<torch::Tensor, torch::Tensor>>& initial, const torch::Tensor& x,
    const torch::Tensor& y) {
  std::vector<torch::Tensor> w;
  for (const auto& [value, grad] : initial) w.push_back(value.clone().requires_grad_());
  auto h = torch::tanh(torch::linear(x, w[0], w[1]));
  h = torch::linear(h, w[2], w[3]);
  h = torch::layer_norm(h, {6}, w[4], w[5]);
  h = torch::linear(h, w[6], w[7]);
  auto loss = torch::mse_loss(h, y);
  loss.backward();
  std::vector<torch::Tensor> grads;
  for (const auto& t : w) grads.push_back(t.grad());
  return {loss.item<double>(), grads};
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  EXPECT_LE((got - want).abs().max().item<double>(), 1e-5 * scale)
      << what << ": got " << got << " want " << want;
}

struct Case {
  std::string schedule;
  int micro_batches;
};

class GlobalSchedules : public ::testing::TestWithParam<Case> {};

// 4 workers: stage 0 on [0, 1], stage 1 on [2, 3]; the batch split(0) over each line. Two steps
// (the second with the shapes learned at the first), the batch of 11 rows not dividing evenly.
TEST_P(GlobalSchedules, LossAndGradientsEqualOneProcess) {
  const Case c = GetParam();
  run_workers(4, [c] {
    auto net = model(g::Placement({0, 1}), g::Placement({2, 3}));
    const auto initial = wholes(net);
    pp::PipelineOptions options;
    options.micro_batches = c.micro_batches;
    options.schedule = shoal::pipeline::parse_schedule_kind(c.schedule);
    options.batch = {g::split(0)};
    pp::Pipeline pipe(net, options);
    ASSERT_TRUE(pipe.is_global());
    ASSERT_EQ(pipe.split(), (std::vector<int>{3, 2}));
    EXPECT_EQ(pipe.placement(1), g::Placement({2, 3}));
    torch::manual_seed(7);
    const auto x = torch::randn({11, 5}), y = torch::randn({11, 3});
    const auto [want_loss, want_grads] = one_process(initial, x, y);
    for (int step = 0; step < 2; ++step) {
      for (auto& p : pipe.parameters()) p.mutable_grad() = torch::Tensor();
      const double loss = pipe.step(x, y, mse).item<double>();
      EXPECT_NEAR(loss, want_loss, 1e-5 * std::abs(want_loss)) << "step " << step;
      const auto got = wholes(net);
      ASSERT_EQ(got.size(), want_grads.size());
      for (size_t i = 0; i < got.size(); ++i) {
        expect_close(got[i].second, want_grads[i],
                     "parameter " + std::to_string(i) + ", step " + std::to_string(step));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Pipeline, GlobalSchedules,
                         ::testing::Values(Case{"gpipe", 3}, Case{"1f1b", 1}, Case{"1f1b", 5},
                                           Case{"zb", 3}),
                         [](const auto& info) {
                           return info.param.schedule + "_m" +
                                  std::to_string(info.param.micro_batches);
                         });

// evaluate() on stages of global layers: the one-process loss, no gradient.
TEST(GlobalPipeline, EvaluateGivesTheOneProcessLoss) {
  run_workers(4, [] {
    auto net = model(g::Placement({0, 1}), g::Placement({2, 3}));
    const auto initial = wholes(net);
    pp::PipelineOptions options;
    options.micro_batches = 3;
    options.batch = {g::split(0)};
    pp::Pipeline pipe(net, options);
    torch::manual_seed(7);
    const auto x = torch::randn({11, 5}), y = torch::randn({11, 3});
    const double want = one_process(initial, x, y).first;
    EXPECT_NEAR(pipe.evaluate(x, y, mse).item<double>(), want, 1e-5 * std::abs(want));
    for (const auto& p : pipe.parameters()) EXPECT_FALSE(p.grad().defined());
  });
}

// Every layout the pipeline refuses, at construction, with the same message on every worker.
TEST(GlobalPipelineErrors, LayoutsThePipelineRefusesAreUsageErrors) {
  run_workers(3, [] {
    auto refused = [](torch::nn::Sequential net, pp::PipelineOptions options,
                      const std::string& expected) {
      try {
        pp::Pipeline pipe(net, options);
        ADD_FAILURE() << "expected UsageError: " << expected;
      } catch (const shoal::UsageError& e) {
        EXPECT_EQ(std::string(e.what()), expected);
      }
    };
    refused(model(g::Placement({0, 1}), g::Placement({2})), {},
            "pipeline: stage 1's placement [2] is not shaped as stage 0's [0, 1]; member i of "
            "each stage sends to member i of the next, so every stage's mesh must have the same "
            "shape");
    torch::manual_seed(0);
    refused(torch::nn::Sequential(g::nn::Linear(4, 4, g::Placement({0}), g::broadcast()),
                                  torch::nn::Linear(4, 4)),
            {},
            "pipeline: layer 1 is a plain torch module with parameters among global layers; its "
            "parameters need a placement (build it from shoal::global::nn layers)");
    pp::PipelineOptions batch;
    batch.batch = {g::split(0), g::broadcast()};
    refused(model(g::Placement({0}), g::Placement({1})), batch,
            "pipeline: options.batch (split(0), broadcast) has 2 axes; the stages' placement [0] "
            "has 1");
    batch.batch = {g::split(1)};
    refused(model(g::Placement({0}), g::Placement({1})), batch,
            "pipeline: options.batch split(1): expected split(0) (a data axis) or broadcast on "
            "each axis");
    pp::PipelineOptions placed;
    placed.placements = {g::Placement({0}), g::Placement({1})};
    refused(model(g::Placement({0}), g::Placement({1})), placed,
            "pipeline: options.placements is for plain layers; global layers are placed by their "
            "parameters (build each stage's layers on its placement)");
    pp::PipelineOptions split;
    split.split = {2, 3};
    refused(model(g::Placement({0}), g::Placement({1})), split,
            "pipeline: split [2, 3] does not match the layers' placements, which make the stages "
            "[3, 2]");
    // Two stages on one worker where 1F1B runs one per worker.
    refused(torch::nn::Sequential(g::nn::Linear(4, 4, g::Placement({0}), g::broadcast()),
                                  g::nn::Linear(4, 4, g::Placement({1}), g::broadcast()),
                                  g::nn::Linear(4, 4, g::Placement({0}), g::broadcast())),
            {},
            "pipeline: stages 0 and 2 are both placed on [0], but the 1f1b schedule runs one "
            "stage per worker (schedule \"interleaved\" runs several)");
    // A loss of torch tensors for global layers.
    pp::Pipeline pipe(model(g::Placement({0}), g::Placement({1})), {});
    try {
      pipe.step(
          torch::randn({4, 5}), torch::randn({4, 3}),
          [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); });
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "pipeline: the layers are global; step() needs a loss function of "
                   "GlobalTensors (GlobalLossFunction)");
    }
    // Its checkpoint is the global model's own.
    try {
      pipe.module();
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "pipeline.module(): the pipeline's layers are global; save and load the global "
                   "model itself (shoal::save(path, *model), docs/checkpoint.md, \"Global models\")");
    }
  });
}

// Reshapes its input's rows into twice as many when armed: the stage's output shape changes.
std::atomic<bool> armed{false};
struct ShapeSwitchImpl : torch::nn::Module {
  g::GlobalTensor forward(const g::GlobalTensor& x) {
    if (!armed) return x;
    return g::reshape(x, {x.size(0) * 2, x.size(1) / 2});
  }
};
TORCH_MODULE(ShapeSwitch);

TEST(GlobalPipelineErrors, WrongActivationShapeIsAUsageErrorOnBothSides) {
  run_workers(2, [] {
    torch::manual_seed(0);
    auto net =
        torch::nn::Sequential(g::nn::Linear(4, 4, g::Placement({0}), g::broadcast()), ShapeSwitch(),
                              g::nn::Linear(4, 3, g::Placement({1}), g::broadcast()));
    pp::PipelineOptions options;
    options.micro_batches = 2;
    options.timeout = std::chrono::seconds(10);
    pp::Pipeline pipe(net, options);
    torch::manual_seed(1);
    const auto x = torch::randn({6, 4}), y = torch::randn({6, 3});
    pipe.step(x, y, mse);  // learns the shapes
    armed = true;
    const auto start = Clock::now();
    try {
      pipe.step(x, y, mse);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      std::printf("worker %d: %.2f s: %s\n", shoal::rank(), waited, e.what());
      EXPECT_STREQ(e.what(),
                   "pipeline: the activation from stage 0 (worker 0) to stage 1 (worker 1) for "
                   "micro-batch 0 has shape [6, 2] Float (a piece of [6, 2] as broadcast), but "
                   "the first step with a batch of 6 rows sent [3, 4] Float (a piece of [3, 4] "
                   "as broadcast) (a stage's output shape may depend only on its input's)");
      EXPECT_LT(waited, 10.0);  // not the transfer's deadline
    }
  });
}

// Passes its input on; SIGKILLs its worker when armed.
std::atomic<bool> kill_armed{false};
struct KillSwitchImpl : torch::nn::Module {
  g::GlobalTensor forward(const g::GlobalTensor& x) {
    if (kill_armed) raise(SIGKILL);
    return x;
  }
};
TORCH_MODULE(KillSwitch);

// A member of a tensor-parallel stage dies in its forward: its stage's other member waits in
// the row-parallel layer's all-reduce, the next stage's members in their receives; each raises
// CommError naming the lost worker within twice the deadline.
TEST(GlobalPipelineErrors, KilledStageMemberIsACommErrorNamingIt) {
  constexpr auto kTimeout = std::chrono::seconds(5);
  shoal::testing::WorkersOptions workers;
  workers.may_fail = {1};
  run_workers(
      4,
      [kTimeout] {
        torch::manual_seed(0);
        const g::Placement first({0, 1}), second({2, 3});
        auto net = torch::nn::Sequential(g::nn::Linear(4, 8, first, g::split(0)), KillSwitch(),
                                         g::nn::Linear(8, 4, first, g::split(1)),
                                         g::nn::Linear(4, 3, second, g::split(0)));
        pp::PipelineOptions options;
        options.micro_batches = 2;
        options.timeout = kTimeout;
        pp::Pipeline pipe(net, options);
        torch::manual_seed(1);
        const auto x = torch::randn({6, 4}), y = torch::randn({6, 3});
        pipe.step(x, y, mse);
        kill_armed = shoal::rank() == 1;
        const auto start = Clock::now();
        try {
          pipe.step(x, y, mse);
          ADD_FAILURE() << "expected CommError";
        } catch (const shoal::CommError& e) {
          const double waited = std::chrono::duration<double>(Clock::now() - start).count();
          std::printf("worker %d: %.2f s: %s\n", shoal::rank(), waited, e.what());
          EXPECT_LT(waited, 2 * 5.0);
          EXPECT_NE(std::string(e.what()).find("worker 1, which was killed by signal 9 (SIGKILL)"),
                    std::string::npos)
              << e.what();
        }
      },
      workers);
}

}  // namespace
