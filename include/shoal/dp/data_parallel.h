// DataParallel: wraps a module so that backward averages its gradients across the job's workers.
// It joins the job (shoal::init()) if the program has not.
//
//   auto net = std::make_shared<Net>();        // or a TORCH_MODULE holder
//   shoal::DataParallel model(net);             // broadcasts, checks, hooks in
//   ... net->forward(x) / model->forward(x), loss.backward(), optimizer.step() as before
//
// The module is used exactly as before; DataParallel only adds autograd hooks and keeps the
// workers' copies equal. See docs/dp.md.
#pragma once

#include <memory>
#include <optional>
#include <utility>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "shoal/comm/group.h"
#include "shoal/dp/comm_hooks.h"
#include "shoal/dp/reducer.h"

namespace shoal {

struct DataParallelOptions {
  // Gradients are averaged in buckets of about this many bytes (PyTorch: bucket_cap_mb=25).
  int64_t bucket_bytes = 25 * 1024 * 1024;
  // See dp::ReducerOptions::find_unused_parameters.
  bool find_unused_parameters = false;
  // See dp::ReducerOptions::gradient_as_bucket_view.
  bool gradient_as_bucket_view = true;
  // Broadcast buffers (e.g. batch-norm running statistics) from the first worker after each
  // synchronized backward, so every worker's next forward sees the same buffers.
  bool broadcast_buffers = true;
  // Weigh each worker's gradient by its share of the global batch, as a shoal loader or sampler
  // reports it, so that uneven shares still give the one-process gradient of a mean loss (Note
  // [Weighing gradients by batch share] in runtime/batch_share.h). Off: equal weights, as
  // PyTorch's DDP (e.g. for a loss summed rather than averaged over the batch).
  bool weigh_by_batch_share = true;
  // How a bucket is averaged; empty: an all-reduce in the gradients' dtype.
  dp::CommHook comm_hook;
  // The workers to replicate over; empty: shoal::world(), followed as an elastic job's world
  // changes (see docs/elastic.md).
  std::optional<comm::Group> group;
};

namespace dp {

// The part of DataParallel that does not depend on the module's type.
class Replicator {
 public:
  Replicator(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options);
  ~Replicator();
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;
  void set_sync(bool sync) {
    if (reducer_) reducer_->set_sync(sync);
    sync_ = sync;
  }
  bool sync() const { return sync_; }
  // Null in a job of one, where there is nothing to average.
  const Reducer* reducer() const { return reducer_.get(); }
  // Copies the first worker's buffers to every worker.
  void broadcast_buffers();

 private:
  // Averages over `group` from now on, with new buckets. With `synchronize`, first checks that
  // every worker has the same model and copies the first worker's values to all (a collective);
  // in an elastic job elastic::State does that when the world changes.
  void bind(comm::Group group, bool synchronize);

  std::shared_ptr<torch::nn::Module> module_;
  DataParallelOptions options_;
  comm::Group group_;
  std::unique_ptr<Reducer> reducer_;
  bool sync_ = true;
  int world_listener_ = 0;  // set while following shoal::world()
};

}  // namespace dp

template <typename ModuleType>
class DataParallel {
 public:
  explicit DataParallel(std::shared_ptr<ModuleType> module, DataParallelOptions options = {})
      : module_(std::move(module)), replicator_(std::make_unique<dp::Replicator>(module_, std::move(options))) {}

  explicit DataParallel(torch::nn::ModuleHolder<ModuleType> holder, DataParallelOptions options = {})
      : DataParallel(holder.ptr(), std::move(options)) {}

  ModuleType* operator->() { return module_.get(); }
  const ModuleType* operator->() const { return module_.get(); }
  ModuleType& operator*() { return *module_; }
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  // The engine that averages gradients (its buckets); null in a job of one.
  const dp::Reducer* reducer() const { return replicator_->reducer(); }

  // Calls the module's forward.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    return module_->forward(std::forward<Args>(args)...);
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return module_->forward(std::forward<Args>(args)...);
  }

  // Within the returned guard's scope, backward accumulates gradients locally only; the first
  // backward after it averages everything accumulated (gradient accumulation, PyTorch's no_sync).
  class NoSync {
   public:
    explicit NoSync(dp::Replicator& replicator) : replicator_(&replicator), before_(replicator.sync()) {
      replicator.set_sync(false);
    }
    ~NoSync() {
      if (replicator_) replicator_->set_sync(before_);
    }
    NoSync(NoSync&& other) noexcept : replicator_(std::exchange(other.replicator_, nullptr)), before_(other.before_) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    dp::Replicator* replicator_;
    bool before_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*replicator_); }

  const dp::Replicator& replicator() const { return *replicator_; }

 private:
  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<dp::Replicator> replicator_;
};

template <typename ModuleType>
DataParallel(std::shared_ptr<ModuleType>, DataParallelOptions = {}) -> DataParallel<ModuleType>;
template <typename ModuleType>
DataParallel(torch::nn::ModuleHolder<ModuleType>, DataParallelOptions = {}) -> DataParallel<ModuleType>;

}  // namespace shoal
