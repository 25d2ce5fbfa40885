// The engine of DataParallel: averages gradients across workers during backward.
//
// Parameters are grouped into buckets in reverse registration order (roughly the order backward
// produces their gradients), and after the first backward in the order the first worker's
// gradients actually arrived. A hook after each parameter's gradient accumulation copies the
// gradient into its bucket (or finds it there already, when .grad is the bucket's slice); when a
// bucket is full its average is started at once, while backward goes on with earlier layers. Buckets are started strictly in bucket order, so every worker
// issues the same collectives in the same order whatever order its gradients arrive in. At the
// end of backward (an autograd engine callback) buckets not yet started (their parameters got no
// gradient here) are started with zeros in place of the missing gradients, every bucket is
// waited for, and the averages are written to the parameters' .grad.
// See docs/dp.md. Internal to shoal: DataParallel (src/dp/replicator.h) and GradientSync hold it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dp/replication.h"
#include "shoal/comm/group.h"
#include "shoal/dp/buckets.h"
#include "shoal/dp/comm_hooks.h"

namespace shoal::dp {

struct ReducerOptions : BucketOptions {
  // Agree after each backward on which parameters got a gradient on any worker, and leave the
  // .grad of those that got none anywhere untouched (as a single process would). One more small
  // all-reduce per step. Without it such parameters get a zero gradient.
  bool find_unused_parameters = false;
  // Each parameter's .grad is its slice of its bucket once the first synchronized backward has
  // run (PyTorch's gradient_as_bucket_view): backward accumulates into the bucket and the
  // average is left in place, two copies of every gradient fewer per step.
  bool gradient_as_bucket_view = true;
  // How a bucket is averaged. Empty: gradients are scaled by 1/n on their way into the bucket
  // and the bucket is summed (what allreduce_hook() gives, with one pass fewer).
  CommHook hook;
  // Weigh each incoming gradient by this worker's share of the batch count_batch() last
  // counted, so that the average is the gradient of the whole batch's mean loss even when the
  // shares are uneven (DataParallel; Note [Weighing gradients by batch share],
  // shoal/dp/data_parallel.h). GradientSync leaves it off: a global loss is already the whole
  // batch's mean.
  bool weigh_by_batch_share = false;
  // DataParallel's: told before each optimizer step may change the parameters, and of each
  // synchronized backward (src/dp/replication.h). Null for GradientSync.
  std::shared_ptr<Replication> replication;
};

class Reducer {
 public:
  // `parameters`: the ones that require gradients, in registration order.
  Reducer(std::vector<at::Tensor> parameters, comm::Group group, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // With weigh_by_batch_share: this worker's forward is on `rows` samples. Starts counting the
  // group's samples (a small all-reduce, which every member starts at the same forward); the
  // backwards until the next count weigh this worker's gradient by n * rows / (the group's).
  void count_batch(int64_t rows);

  // While false, backward accumulates gradients locally only (no_sync).
  void set_sync(bool sync);
  bool sync() const;

  // Called at the end of each synchronized backward, after the gradients are averaged
  // (DataParallel broadcasts buffers here).
  void set_after_backward(std::function<void()> callback);

  // The buckets, as lists of parameter indices (for tests and docs).
  std::vector<std::vector<size_t>> bucket_assignment() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace shoal::dp
