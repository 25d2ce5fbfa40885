// The parameter server's optimizers (docs/ps.md, "Optimizers"): dense chunks against LibTorch's
// torch::optim, sparse rows against PyTorch's SparseAdam and sparse Adagrad (fixtures from
// tests/fixtures/ps), and what sparse tables refuse.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "error_of.h"
#include "ps/optimizer.h"
#include "ps/table.h"
#include "ps_support.h"
#include "shoal/core/error.h"
#include "test_paths.h"

namespace {

using namespace shoal::ps::detail;
using shoal::UsageError;
using shoal::testing::error_of;
using shoal::testing::near_relative;
using shoal::testing::tests_source_dir;
using shoal::testing::to_vector;

// ---------------------------------------------------------------------------------------------
// Optimizers against LibTorch (dense) and PyTorch (sparse fixtures)

struct DenseCase {
  std::string name;
  OptimizerSpec spec;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> make;
};

std::vector<DenseCase> dense_cases() {
  using K = OptimizerSpec::Kind;
  std::vector<DenseCase> cases;
  auto sgd = [](double lr, double momentum, double dampening, bool nesterov, double wd) {
    OptimizerSpec s;
    s.kind = K::kSgd, s.lr = lr, s.momentum = momentum, s.dampening = dampening;
    s.nesterov = nesterov, s.weight_decay = wd;
    return DenseCase{"sgd", s, [=](std::vector<torch::Tensor> p) {
                       return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(lr)
                                                                         .momentum(momentum)
                                                                         .dampening(dampening)
                                                                         .nesterov(nesterov)
                                                                         .weight_decay(wd));
                     }};
  };
  cases.push_back(sgd(0.1, 0, 0, false, 0));
  cases.push_back(sgd(0.05, 0.9, 0.1, false, 0.01));
  cases.push_back(sgd(0.05, 0.9, 0, true, 1e-3));
  auto adagrad = [](double lr, double lr_decay, double wd, double init, double eps) {
    OptimizerSpec s;
    s.kind = K::kAdagrad, s.lr = lr, s.lr_decay = lr_decay, s.weight_decay = wd;
    s.initial_accumulator_value = init, s.eps = eps;
    return DenseCase{"adagrad", s, [=](std::vector<torch::Tensor> p) {
                       return std::make_unique<torch::optim::Adagrad>(
                           p, torch::optim::AdagradOptions(lr)
                                  .lr_decay(lr_decay)
                                  .weight_decay(wd)
                                  .initial_accumulator_value(init)
                                  .eps(eps));
                     }};
  };
  cases.push_back(adagrad(0.01, 0, 0, 0, 1e-10));
  cases.push_back(adagrad(0.1, 0.05, 0.01, 0.2, 1e-6));
  auto adam = [](double lr, double b1, double b2, double eps, double wd, bool amsgrad) {
    OptimizerSpec s;
    s.kind = K::kAdam, s.lr = lr, s.beta1 = b1, s.beta2 = b2, s.eps = eps, s.weight_decay = wd;
    s.amsgrad = amsgrad;
    return DenseCase{
        "adam", s, [=](std::vector<torch::Tensor> p) {
          return std::make_unique<torch::optim::Adam>(
              p, torch::optim::AdamOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd).amsgrad(
                     amsgrad));
        }};
  };
  cases.push_back(adam(1e-3, 0.9, 0.999, 1e-8, 0, false));
  cases.push_back(adam(0.02, 0.8, 0.99, 1e-6, 0.01, false));
  cases.push_back(adam(0.02, 0.5, 0.9, 1e-6, 0, true));
  return cases;
}

TEST(PsOptimizer, DenseChunksFollowTorchOptim) {
  torch::manual_seed(3);
  const int64_t n = 1000, first = 600;  // two "chunks" of 600 and 400 elements
  for (const auto& c : dense_cases()) {
    auto initial = torch::randn({n});
    auto param = initial.clone().requires_grad_(true);
    auto optimizer = c.make({param});
    std::vector<float> values = to_vector(initial);
    const int width = state_width(c.spec);
    std::vector<float> state_a(static_cast<size_t>(width * first)),
        state_b(static_cast<size_t>(width * (n - first)));
    init_state(c.spec, state_a.data(), first);
    init_state(c.spec, state_b.data(), n - first);
    int64_t step_a = 0, step_b = 0;
    for (int step = 0; step < 10; ++step) {
      auto grad = torch::randn({n});
      param.mutable_grad() = grad.clone();
      optimizer->step();
      const auto g = to_vector(grad);
      apply_dense(c.spec, values.data(), state_a.data(), step_a, g.data(), first);
      apply_dense(c.spec, values.data() + first, state_b.data(), step_b, g.data() + first,
                  n - first);
    }
    EXPECT_EQ(step_a, 10);
    EXPECT_TRUE(near_relative(values, to_vector(param), 1e-6))
        << c.name << " lr " << c.spec.lr << " weight_decay " << c.spec.weight_decay;
  }
}

nlohmann::json load_fixtures() {
  const std::string path = tests_source_dir() + "/fixtures/ps/sparse_optimizers.json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return nlohmann::json::parse(in);
}

TEST(PsOptimizer, SparseRowsFollowPyTorchsSparseAdamAndAdagrad) {
  const auto fixtures = load_fixtures();
  const int64_t rows = fixtures["rows"], dim = fixtures["dim"];
  ASSERT_EQ(fixtures["cases"].size(), 4u);
  for (const auto& [name, c] : fixtures["cases"].items()) {
    const auto& o = c["optimizer"];
    OptimizerSpec spec;
    spec.kind = o["kind"] == "adam" ? OptimizerSpec::Kind::kAdam : OptimizerSpec::Kind::kAdagrad;
    spec.lr = o["lr"];
    spec.eps = o["eps"];
    if (spec.kind == OptimizerSpec::Kind::kAdam) {
      spec.beta1 = o["beta1"];
      spec.beta2 = o["beta2"];
    } else {
      spec.lr_decay = o["lr_decay"];
      spec.initial_accumulator_value = o["initial_accumulator_value"];
    }
    EXPECT_NO_THROW(check_optimizer(spec, true, name));
    std::vector<std::vector<float>> values, state;
    std::vector<int64_t> steps(static_cast<size_t>(rows), 0);
    for (const auto& row : c["initial"]) {
      values.push_back(row.get<std::vector<float>>());
      state.emplace_back(static_cast<size_t>(state_width(spec) * dim));
      init_state(spec, state.back().data(), dim);
    }
    for (const auto& step : c["steps"]) {
      // Coalesce: a row looked up twice gets the sum of its gradients, as Embedding's backward.
      std::map<int64_t, std::vector<float>> grads;
      const auto ids = step["ids"].get<std::vector<int64_t>>();
      for (size_t k = 0; k < ids.size(); ++k) {
        auto& g = grads[ids[k]];
        g.resize(static_cast<size_t>(dim), 0.f);
        const auto occurrence = step["grads"][k].get<std::vector<float>>();
        for (int64_t j = 0; j < dim; ++j)
          g[static_cast<size_t>(j)] += occurrence[static_cast<size_t>(j)];
      }
      for (const auto& [id, g] : grads) {
        const auto r = static_cast<size_t>(id);
        apply_row(spec, values[r].data(), state[r].data(), steps[r], g.data(), dim);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const auto expected = c["final"][static_cast<size_t>(r)].get<std::vector<float>>();
      if (steps[static_cast<size_t>(r)] == 0)
        EXPECT_EQ(values[static_cast<size_t>(r)], expected) << name << ": untouched row " << r;
      else
        EXPECT_TRUE(near_relative(values[static_cast<size_t>(r)], expected, 1e-6))
            << name << ": row " << r << " after " << steps[static_cast<size_t>(r)] << " updates";
    }
    EXPECT_EQ(steps[7], 0) << "the fixture leaves row 7 untouched";
  }
}

TEST(PsOptimizer, SparseTablesRefuseWhatPyTorchRefuses) {
  OptimizerSpec adam;
  adam.kind = OptimizerSpec::Kind::kAdam;
  adam.amsgrad = true;
  EXPECT_NO_THROW(check_optimizer(adam, false, "fc"));
  EXPECT_NE(error_of<UsageError>([&] {
              check_optimizer(adam, true, "emb");
            }).find("table 'emb': a sparse table's Adam is PyTorch's SparseAdam"),
            std::string::npos);
  OptimizerSpec adagrad;
  adagrad.kind = OptimizerSpec::Kind::kAdagrad;
  adagrad.weight_decay = 0.1;
  EXPECT_NE(error_of<UsageError>([&] {
              check_optimizer(adagrad, true, "emb");
            }).find("weight_decay 0.100000 is not compatible with sparse gradients"),
            std::string::npos);
  OptimizerSpec sgd;
  sgd.lr = -1;
  EXPECT_NE(error_of<UsageError>([&] { check_optimizer(sgd, false, "fc"); }).find("lr is -1"),
            std::string::npos);
}

}  // namespace
