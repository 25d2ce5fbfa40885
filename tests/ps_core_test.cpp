// The parameter server's core without the network (docs/ps.md): the shard map, tables, the
// optimizers against LibTorch's torch::optim and PyTorch's sparse optimizers, and the clocks of
// sync / backup workers / bounded staleness / async with threads as workers, against one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "ps/optimizer.h"
#include "ps/server_core.h"
#include "ps/shard_map.h"
#include "ps/table.h"
#include "shoal/core/error.h"

namespace {

using namespace shoal::ps::detail;
using shoal::CommError;
using shoal::UsageError;
using Ms = std::chrono::milliseconds;

// |a - b| <= rel * max(|a|, |b|, rms(b)) element by element, the worst offender in the message.
// The RMS term: an element near zero is the difference of larger terms, whose float rounding
// (LibTorch fuses multiply-adds in its vectorized loops and not in their tails) is relative to
// those terms, not to the small result.
::testing::AssertionResult near_relative(const std::vector<float>& a, const std::vector<float>& b,
                                         double rel) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes " << a.size() << " and " << b.size();
  double sum_sq = 0;
  for (float y : b) sum_sq += double(y) * y;
  const double rms = b.empty() ? 0 : std::sqrt(sum_sq / static_cast<double>(b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = b[i];
    if (!(std::abs(x - y) <= rel * std::max({std::abs(x), std::abs(y), rms})))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << x << " vs " << y << " (relative tolerance " << rel
             << ", rms " << rms << ")";
  }
  return ::testing::AssertionSuccess();
}

std::vector<float> to_vector(const torch::Tensor& t) {
  auto c = t.detach().contiguous().to(torch::kFloat).reshape({-1});
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

// The error of `body`, which must throw E; its message.
template <typename E>
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception of the expected type";
  return "";
}

// ---------------------------------------------------------------------------------------------
// Sharding

TEST(PsShardMap, HashesAreFixedByTheirDefinitions) {
  // Published values: FNV-1a 64 of "a", and splitmix64's first output from state 0.
  EXPECT_EQ(fnv1a("a", 1), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(splitmix64(0), 0xe220a8397b1dcdafULL);
}

TEST(PsShardMap, EveryServerHoldsItsShareWithinOne) {
  for (int32_t servers : {1, 2, 3, 5, 7, 8, 32}) {
    ShardMap map(servers);
    const int32_t low = kVirtualShards / servers;
    const int32_t high = low + (kVirtualShards % servers != 0 ? 1 : 0);
    int64_t total = 0;
    for (int32_t s = 0; s < servers; ++s) {
      const auto held = static_cast<int32_t>(map.shards_of(s).size());
      EXPECT_GE(held, low) << servers << " servers, server " << s;
      EXPECT_LE(held, high) << servers << " servers, server " << s;
      total += held;
    }
    EXPECT_EQ(total, kVirtualShards);
  }
}

TEST(PsShardMap, IsAPureFunctionOfShardsAndServers) {
  for (int32_t servers : {2, 3, 4}) {
    ShardMap a(servers), b(servers);
    for (int32_t v = 0; v < kVirtualShards; ++v) ASSERT_EQ(a.owner(v), b.owner(v));
  }
  EXPECT_EQ(chunk_shard("fc.weight", 3), chunk_shard(std::string("fc.") + "weight", 3));
}

TEST(PsShardMap, LosingTheLastServerMovesOnlyItsShards) {
  for (int32_t servers : {2, 3, 4, 8}) {
    ShardMap big(servers), small(servers - 1);
    int32_t moved = 0;
    for (int32_t v = 0; v < kVirtualShards; ++v) {
      if (big.owner(v) == servers - 1)
        ++moved;
      else
        EXPECT_EQ(big.owner(v), small.owner(v))
            << "shard " << v << " moved from a server that stayed";
    }
    EXPECT_EQ(moved, static_cast<int32_t>(big.shards_of(servers - 1).size()));
  }
  EXPECT_THROW(ShardMap(0), UsageError);
}

TEST(PsShardMap, ChunksAndZipfRowsSpreadEvenly) {
  ShardMap map(3);
  // Rows: 1e6 draws from a Zipf-like (log-uniform) law over 1e8 ids; the distinct ids each
  // server holds are within 5% of a third.
  std::mt19937_64 random(7);
  std::uniform_real_distribution<double> unit(0, 1);
  std::set<int64_t> ids;
  for (int i = 0; i < 1000000; ++i)
    ids.insert(static_cast<int64_t>(std::exp(unit(random) * std::log(1e8))) - 1);
  std::vector<double> rows(3, 0);
  for (int64_t id : ids) rows[static_cast<size_t>(map.owner(row_shard("embedding", id)))] += 1;
  for (int s = 0; s < 3; ++s)
    EXPECT_NEAR(rows[static_cast<size_t>(s)] / static_cast<double>(ids.size()), 1.0 / 3, 0.05 / 3)
        << "server " << s << " of " << ids.size() << " distinct rows";
  // Chunks: a 1e9-element table (15259 chunks); within 5% of a third too.
  const int64_t chunks = chunk_count(1000000000);
  EXPECT_EQ(chunks, 15259);
  std::vector<double> held(3, 0);
  for (int64_t c = 0; c < chunks; ++c)
    held[static_cast<size_t>(map.owner(chunk_shard("big", c)))] += 1;
  for (int s = 0; s < 3; ++s)
    EXPECT_NEAR(held[static_cast<size_t>(s)] / static_cast<double>(chunks), 1.0 / 3, 0.05 / 3);
  EXPECT_EQ(chunk_length(1000000000, chunks - 1), 1000000000 - (chunks - 1) * kChunkElements);
  EXPECT_EQ(chunk_length(1000000000, 0), kChunkElements);
}

// ---------------------------------------------------------------------------------------------
// Tables

TableSpec sparse_spec(const std::string& name, int64_t rows, int64_t dim, InitSpec init,
                      OptimizerSpec optimizer = {}) {
  TableSpec spec;
  spec.name = name;
  spec.sparse = true;
  spec.shape = {rows, dim};
  spec.init = init;
  spec.optimizer = optimizer;
  spec.seed = 42;
  return spec;
}

TEST(PsTable, RowsStartFromAPureFunctionOfSeedTableAndId) {
  const auto spec = sparse_spec("emb", 0, 5, {InitSpec::Kind::kNormal, 0.5, 2.0});
  VirtualShard a(3), b(900);
  // Different shards, different orders, other rows touched in between.
  for (int64_t id : {10, 20, 30, 40}) a.touch_row(0, id, spec, 5);
  for (int64_t id : {99, 40, 7, 30, 20, 10}) b.touch_row(0, id, spec, 5);
  for (int64_t id : {10, 20, 30, 40}) {
    std::vector<float> expected(5);
    initial_row(spec, id, expected.data(), 5);
    const Slot* x = a.find_row(0, id);
    const Slot* y = b.find_row(0, id);
    ASSERT_TRUE(x != nullptr && y != nullptr);
    for (int j = 0; j < 5; ++j) {
      EXPECT_EQ(x->values()[j], expected[static_cast<size_t>(j)]);
      EXPECT_EQ(y->values()[j], expected[static_cast<size_t>(j)]);
    }
  }
  // The seed and the table's name matter.
  std::vector<float> one(5), other(5);
  initial_row(spec, 10, one.data(), 5);
  auto reseeded = spec;
  reseeded.seed = 43;
  initial_row(reseeded, 10, other.data(), 5);
  EXPECT_NE(one, other);
  auto renamed = spec;
  renamed.name = "emb2";
  initial_row(renamed, 10, other.data(), 5);
  EXPECT_NE(one, other);
}

TEST(PsTable, InitialValuesFollowTheirLaw) {
  const int64_t n = 20000, dim = 8;
  std::vector<float> row(dim);
  double sum = 0, sum_sq = 0, low = 1e9, high = -1e9;
  const auto normal = sparse_spec("n", 0, dim, {InitSpec::Kind::kNormal, 1.0, 0.5});
  const auto uniform = sparse_spec("u", 0, dim, {InitSpec::Kind::kUniform, -0.25, 0.75});
  for (int64_t id = 0; id < n; ++id) {
    initial_row(normal, id, row.data(), dim);
    for (float v : row) sum += v, sum_sq += double(v) * v;
    initial_row(uniform, id, row.data(), dim);
    for (float v : row) low = std::min(low, double(v)), high = std::max(high, double(v));
  }
  const double count = n * dim, mean = sum / count;
  EXPECT_NEAR(mean, 1.0, 0.01);  // 5 standard errors: 0.5 / sqrt(160000) = 0.00125
  EXPECT_NEAR(std::sqrt(sum_sq / count - mean * mean), 0.5, 0.01);
  EXPECT_GE(low, -0.25);
  EXPECT_LT(high, 0.75);
  EXPECT_LT(low, -0.24);
  EXPECT_GT(high, 0.74);
  const auto zeros = sparse_spec("z", 0, dim, {});
  initial_row(zeros, 5, row.data(), dim);
  EXPECT_EQ(row, std::vector<float>(dim, 0.f));
}

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
  const std::string path = SHOAL_PS_FIXTURES "/sparse_optimizers.json";
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
