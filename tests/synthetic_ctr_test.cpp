// shoal::datasets::SyntheticCtr: samples that are a pure function of (seed, index), ids that follow
// the power law, labels drawn with the hidden model's probability, and auc()/logloss() against
// their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "error_of.h"
#include "shoal/core/error.h"
#include "shoal/datasets/synthetic_ctr.h"

namespace {

using shoal::datasets::CtrBatch;
using shoal::datasets::SyntheticCtr;
using shoal::datasets::SyntheticCtrOptions;

SyntheticCtrOptions small(uint64_t seed = 7) {
  SyntheticCtrOptions o;
  o.seed = seed;
  o.size = 200'000;
  return o;
}

void expect_rows_equal(const CtrBatch& a, int64_t row_a, const CtrBatch& b, int64_t row_b) {
  EXPECT_TRUE(torch::equal(a.ids[row_a], b.ids[row_b]));
  EXPECT_TRUE(torch::equal(a.dense[row_a], b.dense[row_b]));
  EXPECT_EQ(a.label[row_a].item<float>(), b.label[row_b].item<float>());
  EXPECT_EQ(a.probability[row_a].item<float>(), b.probability[row_b].item<float>());
}

using shoal::testing::error_of;

TEST(SyntheticCtr, ASampleIsAPureFunctionOfSeedAndIndex) {
  const SyntheticCtr one(small()), other(small());
  // Asked in any order, alone or with others, from any instance: the same sample.
  const CtrBatch run = one.range(1000, 50);
  const std::vector<size_t> scattered = {1049, 1000, 1020, 199'999};
  const CtrBatch picked = other.get_batch(scattered);
  expect_rows_equal(run, 49, picked, 0);
  expect_rows_equal(run, 0, picked, 1);
  expect_rows_equal(run, 20, picked, 2);
  // Ids beyond the cached frequent ones (computed on the fly) are equally fixed.
  EXPECT_TRUE(torch::equal(one.range(0, 2000).ids, other.range(0, 2000).ids));
  EXPECT_TRUE(torch::equal(one.range(0, 2000).probability, other.range(0, 2000).probability));
  EXPECT_GT(one.range(0, 2000).ids.max().item<int64_t>(), 4096);  // some ids are not cached
  // Another seed, another set.
  const SyntheticCtr reseeded(small(8));
  EXPECT_FALSE(torch::equal(reseeded.range(1000, 50).ids, run.ids));
  EXPECT_FALSE(torch::equal(reseeded.range(1000, 50).probability, run.probability));
}

TEST(SyntheticCtr, IdsFollowThePowerLaw) {
  SyntheticCtrOptions o = small();
  const SyntheticCtr set(o);
  const int64_t n = 100'000;
  const CtrBatch batch = set.range(0, n);
  EXPECT_EQ(batch.ids.sizes(), (std::vector<int64_t>{n, o.fields}));
  EXPECT_GE(batch.ids.min().item<int64_t>(), 0);
  EXPECT_LT(batch.ids.max().item<int64_t>(), o.vocabulary);
  // P(id < k) = ((k + 1)^a - 1) / ((n + 1)^a - 1), a = 1 - zipf, for each field.
  const double a = 1 - o.zipf;
  const double top = std::pow(static_cast<double>(o.vocabulary) + 1, a) - 1;
  for (int64_t k : {1, 10, 1000}) {
    const double p = (std::pow(static_cast<double>(k) + 1, a) - 1) / top;
    const double sigma = std::sqrt(p * (1 - p) / static_cast<double>(n));
    for (int f = 0; f < o.fields; f += 5) {
      const double seen = (batch.ids.select(1, f) < k).to(torch::kDouble).mean().item<double>();
      EXPECT_NEAR(seen, p, 5 * sigma) << "field " << f << ", ids below " << k;
    }
  }
  // Fields draw independently: field 0's and field 1's frequent id are not the same draws.
  const auto both = ((batch.ids.select(1, 0) == 0) & (batch.ids.select(1, 1) == 0));
  const double p0 = (std::pow(2.0, a) - 1) / top;
  EXPECT_NEAR(both.to(torch::kDouble).mean().item<double>(), p0 * p0,
              5 * std::sqrt(p0 * p0 / static_cast<double>(n)));
}

TEST(SyntheticCtr, LabelsAreDrawnWithTheHiddenProbability) {
  const SyntheticCtr set(small());
  const int64_t n = 100'000;
  const CtrBatch batch = set.range(0, n);
  // Clamped as logloss() clamps: a float probability can round to 0 or 1.
  const auto p = batch.probability.to(torch::kDouble).clamp(1e-7, 1 - 1e-7);
  const auto y = batch.label.to(torch::kDouble);
  EXPECT_TRUE(((y == 0) | (y == 1)).all().item<bool>());
  // Calibrated in every decile of p: the label rate is the mean probability.
  const auto sorted = std::get<1>(p.sort());
  for (int d = 0; d < 10; ++d) {
    const auto part = sorted.narrow(0, d * n / 10, n / 10);
    const auto pp = p.index_select(0, part), yy = y.index_select(0, part);
    const double sigma = std::sqrt((pp * (1 - pp)).sum().item<double>()) / (n / 10);
    EXPECT_NEAR(yy.mean().item<double>(), pp.mean().item<double>(), 5 * sigma) << "decile " << d;
  }
  // The Bayes predictor's logloss is, in expectation, the mean binary entropy of p.
  const auto entropy = -(p * p.log() + (1 - p) * (1 - p).log());
  const auto loss = -(y * p.log() + (1 - y) * (1 - p).log());
  const double sigma = (loss - entropy).std().item<double>() / std::sqrt(static_cast<double>(n));
  EXPECT_NEAR(shoal::datasets::logloss(batch.probability, batch.label), entropy.mean().item<double>(),
              5 * sigma);
  // The set carries signal: the Bayes AUC is well above chance, the logloss below the base rate's.
  const double rate = y.mean().item<double>();
  const double base = -(rate * std::log(rate) + (1 - rate) * std::log(1 - rate));
  EXPECT_LT(shoal::datasets::logloss(batch.probability, batch.label), base - 0.05);
  EXPECT_GT(shoal::datasets::auc(batch.probability, batch.label), 0.7);
  // Dense features are standard normal.
  EXPECT_NEAR(batch.dense.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(batch.dense.var().item<double>(), 1.0, 0.02);
}

TEST(SyntheticCtr, AucIsThePairwiseOrderingProbability) {
  std::mt19937 random(3);
  std::uniform_int_distribution<int> score_of(0, 20);  // many ties
  std::bernoulli_distribution label_of(0.3);
  const int n = 400;
  std::vector<float> scores(n), labels(n);
  for (int i = 0; i < n; ++i) {
    scores[i] = static_cast<float>(score_of(random));
    labels[i] = label_of(random) ? 1.0f : 0.0f;
  }
  double wins = 0, pairs = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (labels[i] != 1 || labels[j] != 0) continue;
      pairs += 1;
      wins += scores[i] > scores[j] ? 1.0 : scores[i] == scores[j] ? 0.5 : 0.0;
    }
  }
  EXPECT_NEAR(shoal::datasets::auc(torch::tensor(scores), torch::tensor(labels)), wins / pairs, 1e-12);
  // A constant score orders nothing.
  EXPECT_DOUBLE_EQ(shoal::datasets::auc(torch::zeros({n}), torch::tensor(labels)), 0.5);
}

TEST(SyntheticCtr, BadInputIsAUsageErrorNamingIt) {
  auto with = [](auto change) {
    SyntheticCtrOptions o = small();
    change(o);
    return error_of([&] { SyntheticCtr set(o); });
  };
  EXPECT_EQ(with([](auto& o) { o.vocabulary = 0; }),
            "SyntheticCtr: vocabulary = 0; expected at least 1");
  EXPECT_EQ(with([](auto& o) { o.fields = 0; }), "SyntheticCtr: fields = 0; expected at least 1");
  EXPECT_EQ(with([](auto& o) { o.zipf = 0; }), "SyntheticCtr: zipf = 0.000000; expected above 0");
  EXPECT_EQ(with([](auto& o) { o.size = -1; }), "SyntheticCtr: size = -1; expected at least 0");
  const SyntheticCtr set(small());
  EXPECT_EQ(error_of([&] { set.get_batch(std::vector<size_t>{5, 200'000}); }),
            "SyntheticCtr: sample 200000 is out of range; expected 0..199999");
  EXPECT_EQ(error_of([&] { set.range(199'990, 20); }),
            "SyntheticCtr: samples 199990..200009 are out of range; expected 0..199999");
  EXPECT_EQ(error_of([] { shoal::datasets::auc(torch::ones({4}), torch::zeros({4})); }),
            "auc: all 4 labels are 0; expected both classes");
  EXPECT_EQ(error_of([] { shoal::datasets::auc(torch::ones({4}), torch::zeros({3})); }),
            "auc: 4 scores for 3 labels; expected as many of each");
}

}  // namespace
