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
// Built with during_backward off, it attaches nothing to autograd and sums the same buckets when
// called (sum_gradients()): the pipeline's sums of a step's gradients.
// See docs/dp.md. Internal to shoal: DataParallel (src/dp/replicator.h), GradientSync and the
// pipeline (src/pipeline/step.cpp) hold it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dp/replication.h"
#include "dp/shards.h"
#include "shoal/comm/group.h"
#include "shoal/core/timeout.h"
#include "shoal/dp/buckets.h"
#include "shoal/dp/comm_hooks.h"

namespace shoal::dp {

struct ReducerOptions : BucketOptions {
  // Work during backward, as above. Off: no hook on any parameter, and nothing happens until
  // sum_gradients(), which sums the buckets then (the pipeline's way: its backward runs once
  // per micro-batch, and a step's gradients are summed once, after the last). Of the options
  // below only gradient_as_bucket_view then counts.
  bool during_backward = true;
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
  // DataParallel's ZeRO stages (src/dp/shards.h): each bucket is cut by member (Note [Buckets cut
  // by member]) and reduce-scattered, and each member's part of the average becomes its slices'
  // .grad (added to a .grad a slice has, as autograd accumulates). At stage 1 the parameters keep
  // their full .grad, zeroed once copied into its bucket (outside no_sync), and each slice's .grad
  // is its part of it, given the average; at stages 2 and 3 the full .grad is released once
  // copied, and the slices' .grad are parts of the reduce-scatters' results.
  // Needs during_backward and no hook; gradient_as_bucket_view does not apply.
  std::shared_ptr<Shards> shards;
  // With shards: reduce-scatter the average (DataParallel's), or the sum (false: GradientSync's,
  // whose global loss is already the whole batch's mean).
  bool average = true;
  // With shards: the buckets' parts travel in this dtype (16 bits) and are summed in theirs
  // (src/dp/compressed_scatter.h); at::kFloat: in their own.
  at::ScalarType wire = at::kFloat;
};

class Reducer {
 public:
  // `parameters`: the ones that require gradients, in registration order. Every member gives
  // the same list of shapes and dtypes. Without during_backward, a parameter this worker does not
  // hold may be given as a meta tensor of its shape and dtype (device at::kMeta): it adds zeros
  // to the sums and is given no gradient.
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

  // Without during_backward: sums over the group, now, what each parameter's .grad gained since
  // `since` (one tensor per parameter, in the constructor's order: its .grad when the gains
  // began, undefined where it had none; empty: none had one), and leaves `since` plus that sum in
  // .grad, so that what was summed before is not summed again. A sum, not an average, in the
  // parameters' dtype, bucket by bucket as during backward: each bucket starts once filled, while
  // the next fills. A parameter without .grad adds zeros and gets the sum. Each all-reduce ends
  // within `timeout` (kUnsetTimeout: the group's), else CommError. A collective: every member
  // calls it at the same point.
  void sum_gradients(const std::vector<at::Tensor>& since, Duration timeout = kUnsetTimeout);

  // The buckets, as lists of parameter indices (for tests and docs).
  std::vector<std::vector<size_t>> bucket_assignment() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace shoal::dp
