#include "shoal/datasets/synthetic_ctr.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include <ATen/ATen.h>

#include "../core/hash.h"
#include "shoal/core/error.h"

namespace shoal::datasets {
namespace {

using ::shoal::detail::hash_of;
using ::shoal::detail::normal_of;
using ::shoal::detail::uniform_of;

// Streams of the hash, so that no two kinds of draw share a key.
enum Stream : uint64_t { kSample = 1, kField = 2, kDense = 3, kLabel = 4, kWeight = 5, kDenseWeight = 6 };

// Ids below this are the frequent ones (under zipf = 1.1 and 1e5 ids, about 60% of draws).
constexpr int64_t kCachedIds = 4096;

std::string expected(const char* name, const std::string& value, const char* what) {
  return std::string("SyntheticCtr: ") + name + " = " + value + "; expected " + what;
}

// The id whose power-law quantile is u: the continuous inverse of P(X <= x) ~ x^(1 - s) on
// [1, n + 1), floored (Zipf's law with exponent s, up to the discretisation).
int64_t power_law_id(double u, int64_t n, double s) {
  const double top = static_cast<double>(n) + 1.0;
  double x;
  if (std::abs(s - 1.0) < 1e-12) {
    x = std::pow(top, u);
  } else {
    const double a = 1.0 - s;
    x = std::pow(1.0 + u * (std::pow(top, a) - 1.0), 1.0 / a);
  }
  return std::clamp<int64_t>(static_cast<int64_t>(std::floor(x)) - 1, 0, n - 1);
}

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

}  // namespace

SyntheticCtr::SyntheticCtr(SyntheticCtrOptions options) : options_(options) {
  const auto& o = options_;
  if (o.size < 0) throw UsageError(expected("size", std::to_string(o.size), "at least 0"));
  if (o.fields < 1) throw UsageError(expected("fields", std::to_string(o.fields), "at least 1"));
  if (o.vocabulary < 1) {
    throw UsageError(expected("vocabulary", std::to_string(o.vocabulary), "at least 1"));
  }
  if (!(o.zipf > 0)) throw UsageError(expected("zipf", std::to_string(o.zipf), "above 0"));
  if (o.dense < 0) throw UsageError(expected("dense", std::to_string(o.dense), "at least 0"));
  if (o.factors < 0) throw UsageError(expected("factors", std::to_string(o.factors), "at least 0"));
  for (int j = 0; j < o.dense; ++j) {
    dense_weights_.push_back(o.dense_scale * normal_of(hash_of(o.seed, kDenseWeight, j, 0),
                                                       hash_of(o.seed, kDenseWeight, j, 1)));
  }
  cached_ids_ = std::min(o.vocabulary, kCachedIds);
  const int width = 1 + o.factors;
  std::vector<std::vector<double>> cache(o.fields);  // computed by hidden() while cache_ is empty
  for (int f = 0; f < o.fields; ++f) {
    cache[f].resize(cached_ids_ * width);
    for (int64_t id = 0; id < cached_ids_; ++id) hidden(f, id, &cache[f][id * width]);
  }
  cache_ = std::move(cache);
}

void SyntheticCtr::hidden(int field, int64_t id, double* out) const {
  const auto& o = options_;
  if (id < cached_ids_ && !cache_.empty()) {
    const double* cached = &cache_[field][id * (1 + o.factors)];
    std::copy(cached, cached + 1 + o.factors, out);
    return;
  }
  const uint64_t key = hash_of(o.seed, kWeight, field, id);
  const double decay = std::pow(static_cast<double>(id) + 1.0, -o.id_decay);
  for (int k = 0; k <= o.factors; ++k) {
    const double scale = decay * (k == 0 ? o.linear_scale : o.factor_scale);
    out[k] = scale * normal_of(hash_of(key, k, 0), hash_of(key, k, 1));
  }
}

void SyntheticCtr::sample(int64_t index, int64_t* ids, float* dense, float* label,
                          float* probability, std::vector<double> (&scratch)[2]) const {
  const auto& o = options_;
  const uint64_t key = hash_of(o.seed, kSample, index);
  // w: one id's weight and factors; sum: the factors' sum over the fields.
  std::vector<double>& w = scratch[0];
  std::vector<double>& sum = scratch[1];
  w.resize(1 + o.factors);
  sum.assign(o.factors, 0.0);
  double logit = o.bias, squares = 0;
  for (int f = 0; f < o.fields; ++f) {
    ids[f] = power_law_id(uniform_of(hash_of(key, kField, f)), o.vocabulary, o.zipf);
    hidden(f, ids[f], w.data());
    logit += w[0];
    for (int k = 0; k < o.factors; ++k) {
      sum[k] += w[1 + k];
      squares += w[1 + k] * w[1 + k];
    }
  }
  // sum_{f<g} <v_f, v_g> = (|sum_f v_f|^2 - sum_f |v_f|^2) / 2
  logit += 0.5 * (std::inner_product(sum.begin(), sum.end(), sum.begin(), 0.0) - squares);
  for (int j = 0; j < o.dense; ++j) {
    const double x = normal_of(hash_of(key, kDense, j, 0), hash_of(key, kDense, j, 1));
    dense[j] = static_cast<float>(x);
    logit += dense_weights_[j] * x;
  }
  const double p = sigmoid(logit);
  *probability = static_cast<float>(p);
  *label = uniform_of(hash_of(key, kLabel)) < p ? 1.0f : 0.0f;
}

CtrBatch SyntheticCtr::get_batch(c10::ArrayRef<size_t> indices) const {
  const auto& o = options_;
  const auto rows = static_cast<int64_t>(indices.size());
  CtrBatch batch{at::empty({rows, o.fields}, at::kLong), at::empty({rows, o.dense}, at::kFloat),
                 at::empty({rows}, at::kFloat), at::empty({rows}, at::kFloat)};
  std::vector<double> scratch[2];
  for (int64_t r = 0; r < rows; ++r) {
    const auto index = static_cast<int64_t>(indices[r]);
    if (index >= o.size) {
      throw UsageError("SyntheticCtr: sample " + std::to_string(index) +
                       " is out of range; expected 0.." + std::to_string(o.size - 1));
    }
    sample(index, batch.ids.data_ptr<int64_t>() + r * o.fields,
           batch.dense.data_ptr<float>() + r * o.dense, batch.label.data_ptr<float>() + r,
           batch.probability.data_ptr<float>() + r, scratch);
  }
  return batch;
}

CtrBatch SyntheticCtr::range(int64_t first, int64_t count) const {
  if (first < 0 || count < 0 || first + count > options_.size) {
    throw UsageError("SyntheticCtr: samples " + std::to_string(first) + ".." +
                     std::to_string(first + count - 1) + " are out of range; expected 0.." +
                     std::to_string(options_.size - 1));
  }
  std::vector<size_t> indices(count);
  std::iota(indices.begin(), indices.end(), static_cast<size_t>(first));
  return get_batch(indices);
}

double auc(const at::Tensor& scores, const at::Tensor& labels) {
  if (scores.numel() != labels.numel()) {
    throw UsageError("auc: " + std::to_string(scores.numel()) + " scores for " +
                     std::to_string(labels.numel()) + " labels; expected as many of each");
  }
  const at::Tensor s = scores.reshape(-1).to(at::kDouble).contiguous();
  const at::Tensor y = labels.reshape(-1).to(at::kDouble).contiguous();
  const int64_t n = s.numel();
  const double* score = s.data_ptr<double>();
  const double* label = y.data_ptr<double>();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] < score[b]; });
  // Mann-Whitney: the positives' ranks (ties share their mean rank), less their own pairs.
  double positives = 0, rank_sum = 0;
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j < n && score[order[j]] == score[order[i]]) ++j;
    const double mean_rank = 0.5 * static_cast<double>(i + 1 + j);  // ranks i+1..j
    for (int64_t t = i; t < j; ++t) {
      if (label[order[t]] > 0.5) {
        positives += 1;
        rank_sum += mean_rank;
      }
    }
    i = j;
  }
  const double negatives = static_cast<double>(n) - positives;
  if (positives == 0 || negatives == 0) {
    throw UsageError("auc: all " + std::to_string(n) + " labels are " +
                     (positives == 0 ? "0" : "1") + "; expected both classes");
  }
  return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives);
}

double logloss(const at::Tensor& p, const at::Tensor& labels) {
  if (p.numel() != labels.numel()) {
    throw UsageError("logloss: " + std::to_string(p.numel()) + " probabilities for " +
                     std::to_string(labels.numel()) + " labels; expected as many of each");
  }
  const at::Tensor q = p.reshape(-1).to(at::kDouble).clamp(1e-7, 1 - 1e-7);
  const at::Tensor y = labels.reshape(-1).to(at::kDouble);
  return -(y * q.log() + (1 - y) * (1 - q).log()).mean().item<double>();
}

}  // namespace shoal::datasets
