// Global ops against their oracle, the same torch op on the whole values in one process: for
// every op, inputs in every SBP (so that every row of the op's signature table is taken as it is,
// and the other layouts are boxed to one), on 1 to 4 workers and a 2x2 mesh, with sizes that
// divide evenly and sizes that don't, the output's global value and the inputs' gradients equal
// the oracle's (relative 1e-5).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "shoal/global/ops.h"
#include "shoal/shoal.h"

namespace {

namespace g = shoal::global;
using shoal::testing::run_workers;
using Tensors = std::vector<torch::Tensor>;
using Globals = std::vector<g::GlobalTensor>;

struct OpCase {
  std::string name;
  Tensors inputs;  // whole values; floating ones get gradients
  std::function<torch::Tensor(const Tensors&)> oracle;
  std::function<g::GlobalTensor(const Globals&)> op;
  int64_t seed = -1;  // set: torch::manual_seed(seed) before the oracle and before the op
};

torch::Tensor randn(std::vector<int64_t> shape) {
  return torch::randn(shape);
}
// Away from zero, for denominators.
torch::Tensor positive(std::vector<int64_t> shape) {
  return torch::rand(shape) + 0.5;
}

std::vector<g::Sbp> kinds(int64_t ndim) {
  std::vector<g::Sbp> all = {g::broadcast(), g::partial_sum()};
  for (int64_t d = 0; d < ndim; ++d) all.push_back(g::split(d));
  return all;
}

// Every combination of one layout per input: on a line, every Sbp; on a 2x2 mesh, a sample of
// nd-SBPs that nests splits, mixes kinds and repeats one dim.
std::vector<std::vector<g::NdSbp>> combinations(const Tensors& inputs, int axes) {
  std::vector<std::vector<g::NdSbp>> out = {{}};
  for (const auto& input : inputs) {
    std::vector<g::NdSbp> choices;
    const auto one = kinds(input.dim());
    if (axes == 1) {
      for (const auto& s : one) choices.emplace_back(s);
    } else {
      const g::Sbp last = input.dim() > 1 ? g::split(input.dim() - 1) : g::split(0);
      choices = {g::NdSbp{g::split(0), last},
                 g::NdSbp{last, g::split(0)},
                 g::NdSbp{g::broadcast(), g::split(0)},
                 g::NdSbp{g::partial_sum(), g::broadcast()},
                 g::NdSbp{g::split(0), g::partial_sum()},
                 g::NdSbp{g::broadcast(), g::broadcast()},
                 g::NdSbp{g::split(0), g::split(0)}};
    }
    std::vector<std::vector<g::NdSbp>> next;
    for (const auto& prefix : out) {
      for (const auto& c : choices) {
        next.push_back(prefix);
        next.back().push_back(c);
      }
    }
    out = std::move(next);
  }
  return out;
}

torch::Tensor summed(const torch::Tensor& t) {
  torch::Tensor sum = t.clone();
  shoal::world().all_reduce(sum);
  return sum;
}

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.to(torch::kDouble).allclose(b.to(torch::kDouble), 1e-5, 1e-6);
}

// One op with its inputs in `layouts` on `placement`: the output's value and the gradients of a
// random output gradient equal the oracle's. Non-fatal checks only, so that the workers' calls
// stay in step after a failure.
g::NdSbp check(const OpCase& c, const g::Placement& placement,
               const std::vector<g::NdSbp>& layouts) {
  std::string what = c.name + " with";
  for (size_t i = 0; i < layouts.size(); ++i) what += " " + layouts[i].describe();
  what += " on " + placement.describe();

  Tensors wholes;
  Globals globals;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    torch::Tensor whole = c.inputs[i].clone();
    if (whole.is_floating_point()) whole.requires_grad_();
    wholes.push_back(whole);
    globals.push_back(g::GlobalTensor::from_full(whole, placement, layouts[i]));
  }
  if (c.seed >= 0) torch::manual_seed(c.seed);
  const g::GlobalTensor out = c.op(globals);

  Tensors oracle_inputs;
  for (const auto& t : c.inputs)
    oracle_inputs.push_back(t.is_floating_point() ? t.clone().requires_grad_() : t);
  torch::Tensor expected;
  {
    torch::manual_seed(c.seed >= 0 ? c.seed : 0);
    expected = c.oracle(oracle_inputs);
  }
  EXPECT_EQ(out.shape(), expected.sizes().vec()) << what;
  const torch::Tensor value = out.detach().full();
  EXPECT_TRUE(close(value, expected)) << what << "\nglobal:\n"
                                      << value << "\noracle:\n"
                                      << expected;

  torch::manual_seed(99);
  const torch::Tensor w = torch::randn(expected.sizes());
  expected.backward(w);
  out.backward(g::GlobalTensor::from_full(w, placement, g::dual(out.sbp())));
  for (size_t i = 0; i < wholes.size(); ++i) {
    if (!wholes[i].requires_grad()) continue;
    const torch::Tensor want = oracle_inputs[i].grad();
    // Every worker sums, with or without a gradient of its own, so that the sums stay in step.
    const torch::Tensor got =
        summed(wholes[i].grad().defined() ? wholes[i].grad() : torch::zeros_like(want));
    EXPECT_TRUE(close(got, want)) << what << ": gradient of input " << i << "\nglobal:\n"
                                  << got << "\noracle:\n"
                                  << want;
  }
  return out.sbp();
}

// The ops, each on sizes that split evenly over 1 to 4 workers (12) and sizes that don't.
std::vector<OpCase> cases() {
  torch::manual_seed(1);
  using F = torch::nn::functional::CrossEntropyFuncOptions;
  std::vector<OpCase> all;
  auto add = [&](std::string name, Tensors inputs,
                 std::function<torch::Tensor(const Tensors&)> oracle,
                 std::function<g::GlobalTensor(const Globals&)> op, int64_t seed = -1) {
    all.push_back({std::move(name), std::move(inputs), std::move(oracle), std::move(op), seed});
  };
  for (int64_t n : {int64_t{5}, int64_t{12}}) {
    const int64_t k = n == 12 ? 12 : 7, m = n == 12 ? 4 : 3;
    const std::string size = n == 12 ? " (even)" : " (uneven)";
    add(
        "matmul" + size, {randn({n, k}), randn({k, m})},
        [](const Tensors& t) { return t[0].matmul(t[1]); },
        [](const Globals& t) { return g::matmul(t[0], t[1]); });
    add(
        "matmul 3-D x 2-D" + size, {randn({2, n, k}), randn({k, m})},
        [](const Tensors& t) { return t[0].matmul(t[1]); },
        [](const Globals& t) { return g::matmul(t[0], t[1]); });
    add(
        "batched matmul" + size, {randn({3, n, k}), randn({3, k, m})},
        [](const Tensors& t) { return t[0].matmul(t[1]); },
        [](const Globals& t) { return g::matmul(t[0], t[1]); });
    add(
        "linear" + size, {randn({n, k}), randn({m, k}), randn({m})},
        [](const Tensors& t) { return torch::nn::functional::linear(t[0], t[1], t[2]); },
        [](const Globals& t) { return g::linear(t[0], t[1], t[2]); });
    add(
        "add" + size, {randn({n, k}), randn({n, k})}, [](const Tensors& t) { return t[0] + t[1]; },
        [](const Globals& t) { return t[0] + t[1]; });
    add(
        "sub, broadcast row" + size, {randn({n, k}), randn({k})},
        [](const Tensors& t) { return t[0] - t[1]; }, [](const Globals& t) { return t[0] - t[1]; });
    add(
        "mul, outer" + size, {randn({n, 1}), randn({1, k})},
        [](const Tensors& t) { return t[0] * t[1]; }, [](const Globals& t) { return t[0] * t[1]; });
    add(
        "mul" + size, {randn({n, k}), randn({n, k})}, [](const Tensors& t) { return t[0] * t[1]; },
        [](const Globals& t) { return t[0] * t[1]; });
    add(
        "div, broadcast column" + size, {randn({n, k}), positive({n, 1})},
        [](const Tensors& t) { return t[0] / t[1]; }, [](const Globals& t) { return t[0] / t[1]; });
    add(
        "scalars" + size, {randn({n, k})},
        [](const Tensors& t) { return -(((t[0] + 2) * 3 - 1) / 4); },
        [](const Globals& t) { return -(((t[0] + 2) * 3 - 1) / 4); });
    add(
        "relu" + size, {randn({n, k})}, [](const Tensors& t) { return torch::relu(t[0]); },
        [](const Globals& t) { return g::relu(t[0]); });
    add(
        "gelu" + size, {randn({n, k})}, [](const Tensors& t) { return torch::gelu(t[0], "tanh"); },
        [](const Globals& t) { return g::gelu(t[0], "tanh"); });
    add(
        "tanh" + size, {randn({n, k})}, [](const Tensors& t) { return torch::tanh(t[0]); },
        [](const Globals& t) { return g::tanh(t[0]); });
    add(
        "sigmoid" + size, {randn({n, k})}, [](const Tensors& t) { return torch::sigmoid(t[0]); },
        [](const Globals& t) { return g::sigmoid(t[0]); });
    for (int64_t dim : {0, 1}) {
      const std::string d = " dim " + std::to_string(dim) + size;
      add(
          "softmax" + d, {randn({n, k})},
          [dim](const Tensors& t) { return torch::softmax(t[0], dim); },
          [dim](const Globals& t) { return g::softmax(t[0], dim); });
      add(
          "log_softmax" + d, {randn({n, k})},
          [dim](const Tensors& t) { return torch::log_softmax(t[0], dim); },
          [dim](const Globals& t) { return g::log_softmax(t[0], dim); });
      add(
          "sum" + d, {randn({n, k})}, [dim](const Tensors& t) { return t[0].sum(dim); },
          [dim](const Globals& t) { return g::sum(t[0], dim); });
      add(
          "mean keepdim" + d, {randn({n, k})},
          [dim](const Tensors& t) { return t[0].mean(dim, true); },
          [dim](const Globals& t) { return g::mean(t[0], dim, true); });
      add(
          "max" + d, {randn({n, k})}, [dim](const Tensors& t) { return torch::amax(t[0], {dim}); },
          [dim](const Globals& t) { return g::max(t[0], dim); });
      add(
          "slice" + d, {randn({n, k})}, [dim](const Tensors& t) { return t[0].slice(dim, 1, -1); },
          [dim](const Globals& t) { return g::slice(t[0], dim, 1, -1); });
      add(
          "cat" + d, {randn({n, k}), randn({n, k})},
          [dim](const Tensors& t) {
            return torch::cat({t[0], t[1]}, dim);
          },
          [dim](const Globals& t) {
            return g::cat({t[0], t[1]}, dim);
          });
    }
    add(
        "softmax 3-D" + size, {randn({2, n, k})},
        [](const Tensors& t) { return torch::softmax(t[0], -1); },
        [](const Globals& t) { return g::softmax(t[0], -1); });
    add(
        "sum all" + size, {randn({n, k})}, [](const Tensors& t) { return t[0].sum(); },
        [](const Globals& t) { return g::sum(t[0]); });
    add(
        "mean all" + size, {randn({n, k})}, [](const Tensors& t) { return t[0].mean(); },
        [](const Globals& t) { return g::mean(t[0]); });
    add(
        "max all" + size, {randn({n, k})}, [](const Tensors& t) { return t[0].max(); },
        [](const Globals& t) { return g::max(t[0]); });
    add(
        "reshape flat" + size, {randn({n, k})}, [](const Tensors& t) { return t[0].reshape({-1}); },
        [](const Globals& t) { return g::reshape(t[0], {-1}); });
    add(
        "reshape merge" + size, {randn({n, 2, k})},
        [n, k](const Tensors& t) {
          return t[0].reshape({n * 2, k});
        },
        [n, k](const Globals& t) {
          return g::reshape(t[0], {n * 2, k});
        });
    add(
        "view split" + size, {randn({n * 2, k})},
        [n, k](const Tensors& t) {
          return t[0].view({n, 2, k});
        },
        [n, k](const Globals& t) {
          return g::view(t[0], {n, 2, k});
        });
    add(
        "transpose" + size, {randn({n, k})}, [](const Tensors& t) { return t[0].transpose(0, 1); },
        [](const Globals& t) { return g::transpose(t[0], 0, 1); });
    add(
        "permute" + size, {randn({2, n, k})},
        [](const Tensors& t) {
          return t[0].permute({2, 0, 1});
        },
        [](const Globals& t) {
          return g::permute(t[0], {2, 0, 1});
        });
    add(
        "layer_norm" + size, {randn({2, n, k}), randn({k}), randn({k})},
        [k](const Tensors& t) { return torch::layer_norm(t[0], {k}, t[1], t[2]); },
        [k](const Globals& t) { return g::layer_norm(t[0], {k}, t[1], t[2]); });
    add(
        "layer_norm over two dims, no weight" + size, {randn({2, n, k})},
        [n, k](const Tensors& t) {
          return torch::layer_norm(t[0], {n, k});
        },
        [n, k](const Globals& t) {
          return g::layer_norm(t[0], {n, k});
        });
    add(
        "embedding" + size, {torch::randint(n + 2, {3, m}), randn({n + 2, k})},
        [](const Tensors& t) { return torch::embedding(t[1], t[0]); },
        [](const Globals& t) { return g::embedding(t[0], t[1]); });
    add(
        "cross_entropy" + size, {randn({n, k}), torch::randint(k, {n})},
        [](const Tensors& t) { return torch::nn::functional::cross_entropy(t[0], t[1], F()); },
        [](const Globals& t) { return g::cross_entropy(t[0], t[1]); });
    add(
        "dropout" + size, {randn({n, k})},
        [](const Tensors& t) { return torch::dropout(t[0], 0.3, true); },
        [](const Globals& t) { return g::dropout(t[0], 0.3); }, 5);
  }
  return all;
}

shoal::testing::WorkersOptions long_run() {
  shoal::testing::WorkersOptions options;
  options.timeout = std::chrono::seconds(240);
  return options;
}

class Ops : public ::testing::TestWithParam<int> {};

TEST_P(Ops, EqualTheOneProcessOpsInEveryLayout) {
  run_workers(
      GetParam(),
      [] {
        const auto all = g::Placement::all();
        for (const auto& c : cases()) {
          for (const auto& layouts : combinations(c.inputs, 1)) check(c, all, layouts);
        }
      },
      long_run());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Ops, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

TEST(Ops2d, EqualTheOneProcessOpsOnA2x2Mesh) {
  run_workers(
      4,
      [] {
        const auto mesh = g::Placement::mesh({2, 2});
        for (const auto& c : cases()) {
          for (const auto& layouts : combinations(c.inputs, 2)) check(c, mesh, layouts);
        }
      },
      long_run());
}

TEST(Ops, OnAPlacementOfSomeWorkers) {
  // Workers outside the placement take part in nothing but keep their graphs in step.
  run_workers(
      3,
      [] {
        const g::Placement some({2, 0});
        for (const auto& c : cases())
          check(c, some, std::vector<g::NdSbp>(c.inputs.size(), g::split(0)));
      },
      long_run());
}

TEST_P(Ops, RowsThatCommunicateThemselves) {
  // Rows wide enough that sharing row statistics is cheaper than moving the split: softmax and
  // the loss are computed on classes split over the workers, the embedding on split rows.
  run_workers(GetParam(), [] {
    const auto all = g::Placement::all();
    torch::manual_seed(2);
    using F = torch::nn::functional::CrossEntropyFuncOptions;
    const OpCase softmax{"softmax",
                         {randn({3, 97})},
                         [](const Tensors& t) { return torch::softmax(t[0], 1); },
                         [](const Globals& t) { return g::softmax(t[0], 1); }};
    const OpCase log_softmax{"log_softmax",
                             {randn({3, 97})},
                             [](const Tensors& t) { return torch::log_softmax(t[0], 1); },
                             [](const Globals& t) { return g::log_softmax(t[0], 1); }};
    const OpCase loss{
        "cross_entropy",
        {randn({3, 97}), torch::randint(97, {3})},
        [](const Tensors& t) { return torch::nn::functional::cross_entropy(t[0], t[1], F()); },
        [](const Globals& t) { return g::cross_entropy(t[0], t[1]); }};
    const OpCase lookup{"embedding",
                        {torch::randint(11, {2, 5}), randn({11, 3})},
                        [](const Tensors& t) { return torch::embedding(t[1], t[0]); },
                        [](const Globals& t) { return g::embedding(t[0], t[1]); }};
    EXPECT_EQ(check(softmax, all, {g::split(1)}), g::NdSbp(g::split(1)));
    EXPECT_EQ(check(log_softmax, all, {g::split(1)}), g::NdSbp(g::split(1)));
    EXPECT_EQ(check(loss, all, {g::split(1), g::broadcast()}), g::NdSbp(g::broadcast()));
    EXPECT_EQ(check(lookup, all, {g::broadcast(), g::split(0)}), g::NdSbp(g::partial_sum()));
    if (shoal::world_size() == 4) {
      const auto mesh = g::Placement::mesh({2, 2});
      EXPECT_EQ(check(loss, mesh,
                      {g::NdSbp{g::split(0), g::split(1)}, g::NdSbp{g::split(0), g::broadcast()}}),
                (g::NdSbp{g::partial_sum(), g::broadcast()}));
      EXPECT_EQ(check(softmax, mesh, {g::NdSbp{g::split(1), g::split(1)}}),
                (g::NdSbp{g::split(1), g::split(1)}));
    }
  });
}

TEST(Ops, SignaturesThatFitMoveNothing) {
  run_workers(2, [] {
    const auto all = g::Placement::all();
    torch::manual_seed(3);
    const auto x = g::randn({4, 6}, all, g::split(0));
    const auto w = g::randn({6, 8}, all, g::broadcast());
    const auto w1 = g::randn({6, 8}, all, g::split(1));
    const int64_t before = g::sent_bytes();
    EXPECT_EQ(g::matmul(x, w).sbp(), g::NdSbp(g::split(0)));  // data parallel
    EXPECT_EQ(g::matmul(x.to_global(g::broadcast()), w1).sbp(),
              g::NdSbp(g::split(1)));  // model parallel
    const int64_t boxed = g::sent_bytes() - before;
    EXPECT_EQ(boxed, 4 * 6 * 4 / 2) << "only x's all-gather (S0 -> B) moves bytes";
    const auto xs = g::randn({4, 6}, all, g::split(1));
    const auto ws = g::randn({6, 8}, all, g::split(0));
    EXPECT_EQ(g::matmul(xs, ws).sbp(), g::NdSbp(g::partial_sum()));
    EXPECT_EQ(g::sent_bytes() - before, boxed);
    // Megatron's row-parallel output plus a bias: the bias becomes a partial_sum for free.
    EXPECT_EQ((g::matmul(xs, ws) + g::randn({8}, all, g::broadcast())).sbp(),
              g::NdSbp(g::partial_sum()));
    EXPECT_EQ(g::sent_bytes() - before, boxed);
  });
}

TEST(Ops, BadOperandsAreUsageErrors) {
  run_workers(2, [] {
    const auto x = g::randn({4, 5}, g::Placement({0}), g::broadcast());
    const auto w = g::randn({5, 3}, g::Placement::all(), g::split(1));
    try {
      g::matmul(x, w);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(
          e.what(),
          "matmul: the operands are on different placements (operand 0 on [0] as broadcast, "
          "operand 1 on [0, 1] as split(1)); move one with to_global(placement, sbp) first");
    }
    const auto y = g::randn({4, 5}, g::Placement::all(), g::split(0));
    try {
      g::matmul(y, y);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(
          e.what(),
          "matmul: expected a [..., n, k] and b [k, m] or [..., k, m] with a's leading dims, got "
          "[4, 5] and [4, 5]");
    }
    EXPECT_THROW(g::softmax(y, 2), shoal::UsageError);
    EXPECT_THROW(g::reshape(y, {3, -1}), shoal::UsageError);
    EXPECT_THROW(y + g::randn({3}, g::Placement::all(), g::broadcast()), shoal::UsageError);
  });
}

}  // namespace
