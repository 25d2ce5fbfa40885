// A click-through-rate data set with a known answer, for the parameter-server example and its
// tests (docs/data.md, "Synthetic CTR"): each sample has `fields` categorical ids drawn from a
// power law (Zipf-like: a few ids are frequent, most rare, as in Criteo's logs) and `dense`
// standard-normal features, and its label is drawn with the probability a hidden factorization
// machine gives it. Sample i is a pure function of (seed, i), and so is every hidden weight: the
// set needs no storage, any worker computes any sample, and the Bayes-optimal predictor (the
// hidden model's probability itself) is known, so a trained model's logloss and AUC can be set
// beside the best any model can reach.
//
// One of shoal's demo datasets (shoal/datasets/, library shoal::datasets), not part of the
// library's API: see fashion_mnist.h.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace shoal::datasets {

struct SyntheticCtrOptions {
  uint64_t seed = 0;
  int64_t size = 1'000'000;      // samples: 0..size-1
  int fields = 26;               // categorical fields (Criteo's count)
  int64_t vocabulary = 100'000;  // ids per field, 0..vocabulary-1 (0 the most frequent)
  double zipf = 1.1;             // the power law's exponent (> 0): P(id) ~ (id + 1)^-zipf
  int dense = 13;                // dense features (Criteo's count)
  int factors = 8;               // the hidden factorization machine's k
  // The hidden model: logit = bias + sum_f w(f, id_f) + sum_j u_j x_j
  //                           + sum_{f<g} <v(f, id_f), v(g, id_g)>,
  // with w, u and v's entries normal with these standard deviations.
  // An id's w and v are further scaled by (id + 1)^-id_decay: rare ids carry less of the signal,
  // as in real logs, so that what the frequent ids say can be learned from a feasible number of
  // samples (at id_decay = 0 every id matters alike, and most are seen too rarely to be learned).
  double bias = -1.5;
  double linear_scale = 1.0;
  double dense_scale = 0.2;
  double factor_scale = 0.6;
  double id_decay = 1.0;
};

// A batch of samples, rows in the order of the indices asked for.
struct CtrBatch {
  at::Tensor ids;          // int64 [rows, fields], each field's ids in 0..vocabulary-1
  at::Tensor dense;        // float32 [rows, dense]
  at::Tensor label;        // float32 [rows], 0 or 1
  at::Tensor probability;  // float32 [rows], the hidden model's P(label = 1): the Bayes predictor
};

class SyntheticCtr {
 public:
  // Raises UsageError for options out of range, naming the option and what was expected.
  explicit SyntheticCtr(SyntheticCtrOptions options = {});

  int64_t size() const { return options_.size; }
  const SyntheticCtrOptions& options() const { return options_; }

  // Samples by index (each in 0..size-1, else UsageError).
  CtrBatch get_batch(c10::ArrayRef<size_t> indices) const;
  // Samples first..first+count-1.
  CtrBatch range(int64_t first, int64_t count) const;

 private:
  // The hidden weight w(field, id) and factors v(field, id) of one id, into out[0..factors].
  void hidden(int field, int64_t id, double* out) const;
  // One sample into the batch's rows; `scratch` is reused from sample to sample.
  void sample(int64_t index, int64_t* ids, float* dense, float* label, float* probability,
              std::vector<double> (&scratch)[2]) const;

  SyntheticCtrOptions options_;
  std::vector<double> dense_weights_;
  // The hidden weights of each field's most frequent ids, computed at construction:
  // [field][id * (1 + factors) + 0..factors] for id < cached_ids_.
  int64_t cached_ids_ = 0;
  std::vector<std::vector<double>> cache_;
};

// The area under the ROC curve of `scores` for binary `labels` (any shapes with the same number
// of elements): the probability that a random positive scores above a random negative, ties
// counting one half. Raises UsageError when the labels are all of one class.
double auc(const at::Tensor& scores, const at::Tensor& labels);

// The mean binary cross-entropy of probabilities `p` (clamped to [1e-7, 1 - 1e-7]) for `labels`.
double logloss(const at::Tensor& p, const at::Tensor& labels);

}  // namespace shoal::datasets
