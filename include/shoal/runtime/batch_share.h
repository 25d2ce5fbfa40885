// What part of the current global batch this worker trains on: the loaders say, DataParallel
// weighs this worker's gradient by it.
//
// Note [Weighing gradients by batch share]
// A global batch of B samples is cut among the n workers as b_0, ..., b_{n-1}
// (comm::split_sizes), and worker i's loss is the mean over its b_i samples, with gradient g_i.
// One process on the whole batch gets the gradient of the mean over all B, which is
// sum_i (b_i / B) g_i. Averaging with equal weights, sum_i g_i / n, equals it only when every
// b_i = B / n; with 64 samples over 3 workers (22, 21, 21), or a last batch smaller than the
// worker count, it does not. So the loaders (data::Loader, data::RandomSampler and
// data::SequentialSampler) record the share of the batch they hand out, and DataParallel scales
// each incoming gradient by n * b_i / B before averaging: exactly the one-process gradient, with
// no change to the user's loss. When every share is equal the weight is 1 and nothing is done,
// so the common path costs nothing. A share of 0 weighs the gradient by 0 (not by
// multiplication, which would keep a NaN from an empty batch's mean).
// The weight is exact for losses reduced by a mean over the batch (every torch loss's default).
#pragma once

#include <cstdint>
#include <optional>

namespace shoal::runtime {

struct BatchShare {
  int64_t local = 0;   // samples of the current global batch on this worker
  int64_t global = 0;  // samples in the whole global batch
  int workers = 1;     // the number of workers it was cut among
};

// Called by a loader when it hands out a batch; `nullopt` when its epoch ends (a loader used
// after the training loop, or none at all, then leaves gradients unweighted).
void set_batch_share(std::optional<BatchShare> share);

// The share of the batch most recently handed out, if a loader is in an epoch.
std::optional<BatchShare> batch_share();

// The factor DataParallel applies to this worker's gradient before averaging it over a group of
// `group_size` workers: n * local / global when a share is known for a group of that size,
// otherwise 1 (also when the loader's world is not the group's, e.g. a sub-group).
double gradient_weight(int group_size);

}  // namespace shoal::runtime
