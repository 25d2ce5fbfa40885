// Global layers and GradientSync: after backward every worker's .grad is the gradient of its
// piece, as one process computes it, in data-, tensor- and 2-D-parallel layouts; the workers
// summed over are those holding the same piece; plain parameters are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "shoal/global/nn.h"
#include "shoal/shoal.h"

namespace {

namespace g = shoal::global;
using shoal::testing::run_workers;

// Two linears (column- then row-parallel where the layout says) and a layer norm.
class MlpImpl : public g::nn::Module {
 public:
  explicit MlpImpl(const g::nn::Layout& layout) {
    up = register_module("up", g::nn::Linear(6, 8, layout.placement, layout.column()));
    down = register_module("down", g::nn::Linear(8, 6, layout.placement, layout.row()));
    norm = register_module("norm", g::nn::LayerNorm(6, layout.placement));
  }
  g::GlobalTensor forward(const g::GlobalTensor& x) { return norm(down(g::relu(up(x)))); }
  g::nn::Linear up{nullptr}, down{nullptr};
  g::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Mlp);

// The gradients of every parameter, whole, after one step on a batch of 5 rows in `batch`.
std::vector<torch::Tensor> gradients(const g::nn::Layout& layout, const g::NdSbp& batch) {
  torch::manual_seed(11);
  Mlp model(layout);
  g::nn::GradientSync sync(model);
  const auto x = g::randn({5, 6}, layout.placement, batch);
  const auto target = g::randn({5, 6}, layout.placement, batch);
  const auto diff = model->forward(x) - target;
  g::mean(diff * diff).backward();
  std::vector<torch::Tensor> grads;
  for (const auto& named : model->named_global_parameters()) {
    // Each worker's .grad is its piece's whole gradient: broadcast where the parameter is.
    const auto& local = named.second.to_local();
    const auto grad =
        g::GlobalTensor(local.grad().defined() ? local.grad() : torch::zeros_like(local),
                        named.second.placement(), named.second.sbp(), named.second.shape());
    grads.push_back(grad.full());
  }
  return grads;
}

TEST(GradientSync, GradientsEqualOneProcessInEveryLayout) {
  run_workers(4, [] {
    const auto one = gradients({g::Placement({0}), {}}, g::broadcast());
    const auto all = g::Placement::all();
    const auto mesh = g::Placement::mesh({2, 2});
    const std::vector<std::pair<std::string, std::vector<torch::Tensor>>> plans = {
        {"data", gradients({all, {}}, g::split(0))},
        {"tensor", gradients({all, {0}}, g::broadcast())},
        {"2-D", gradients({mesh, {1}}, g::NdSbp{g::split(0), g::broadcast()})},
        {"2-D, batch split on both axes",
         gradients({mesh, {}}, g::NdSbp{g::split(0), g::split(0)})},
    };
    for (const auto& [name, grads] : plans) {
      ASSERT_EQ(grads.size(), one.size());
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_TRUE(grads[i].allclose(one[i], 1e-5, 1e-6)) << name << ", parameter " << i << "\n"
                                                           << grads[i] << "\n"
                                                           << one[i];
      }
    }
  });
}

TEST(GradientSync, SumsOverTheWorkersHoldingThePiece) {
  run_workers(4, [] {
    const auto mesh = g::Placement::mesh({2, 2});
    Mlp model(g::nn::Layout{mesh, {1}});
    g::nn::GradientSync sync(model);
    // Weights split on axis 1 are summed along axis 0; the layer norm's over all four.
    const int r = shoal::rank();
    const std::vector<int> column = {r % 2, r % 2 + 2};
    EXPECT_EQ(sync.groups(), (std::vector<std::vector<int>>{column, {0, 1, 2, 3}}))
        << "worker " << r;
  });
}

class PlainImpl : public g::nn::Module {
 public:
  PlainImpl() { register_parameter("scale", torch::ones({3})); }
};
TORCH_MODULE(Plain);

TEST(GradientSync, RefusesPlainParameters) {
  run_workers(2, [] {
    try {
      g::nn::GradientSync sync(Plain{});
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "GradientSync: parameter 'scale' is a plain tensor; register it with "
                   "register_global_parameter so that its layout says how its gradient is shared");
    }
  });
}

}  // namespace
