// What DataParallel does for any module's type: checks and broadcasts the model, holds the
// Reducer over the current world (a new one when an elastic job's world changes) and the
// module's Replication, which outlives those reducers. Internal to shoal; DataParallel<M>
// reaches it through the calls in shoal/dp/data_parallel.h.
#pragma once

#include <memory>

#include "dp/gatherer.h"
#include "dp/reducer.h"
#include "dp/replication.h"
#include "shoal/checkpoint/savable.h"
#include "shoal/dp/data_parallel.h"

namespace shoal::dp {

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
  void before_forward(const at::Tensor* input);
  void after_forward();
  // What the forward computes in (DataParallelOptions::mixed_precision.compute).
  at::ScalarType compute_dtype() const { return options_.mixed_precision.compute; }
  // Null in a job of one, where there is nothing to average (unless it measures the noise).
  const Reducer* reducer() const { return reducer_.get(); }
  const Replication& replication() const { return *replication_; }
  // Copies the first worker's buffers to every worker.
  void broadcast_buffers();
  // DataParallel::named_parameters(), clip_grad_norm() and gather_parameters().
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;
  double clip_grad_norm(double max_norm, double norm_type);
  void gather_parameters();

 private:
  // Averages over `group` from now on, with new buckets. With `synchronize`, first checks that
  // every worker has the same model and copies the first worker's values to all (a collective);
  // in an elastic job elastic::State does that when the world changes.
  void bind(comm::Group group, bool synchronize);

  std::shared_ptr<torch::nn::Module> module_;
  DataParallelOptions options_;
  comm::Group group_;
  std::shared_ptr<Replication> replication_;
  std::unique_ptr<Reducer> reducer_;
  // At zero_stage 1 to 3: the slices, and (1 and 2) whether a synchronized backward (and so, maybe,
  // an optimizer step) came since the parameters were last gathered.
  std::shared_ptr<Shards> shards_;
  bool gather_pending_ = false;
  std::shared_ptr<Gatherer> gatherer_;  // stage 3
  // Under ZeRO, tells shoal::save and shoal::load each parameter's piece (checkpoint::PieceOf on
  // every parameter), as long as this Replicator lives.
  void mark_pieces();
  // The slices have changed (an optimizer's step comes, or a load wrote them): the parameters are
  // gathered anew before they are next read.
  void slices_changed();
  checkpoint::Piece piece_of(const at::Tensor& parameter, bool sliced, size_t k);
  // In an elastic job at a ZeRO stage (Note [Slices in an elastic job], src/elastic/slices.cpp):
  // what elastic::State re-cuts, whether the slices hold the job's values, and whether they are
  // cut for group_ with its Reducer built.
  class Slices : public Slicing {
   public:
    explicit Slices(Replicator& owner) : owner_(owner) {}
    const std::vector<at::Tensor>& parameters() const override { return owner_.shards_->params(); }
    const std::vector<at::Tensor>& slices() const override { return owner_.shards_->slices(); }
    int cut_rank() const override { return owner_.holds_values_ ? owner_.shards_->rank() : 0; }
    int cut_size() const override { return owner_.holds_values_ ? owner_.shards_->size() : 0; }
    void recut() override {
      owner_.holds_values_ = false;
      owner_.shards_->recut(owner_.group_.rank(), owner_.group_.size());
    }
    void filled() override { owner_.slices_filled(); }

   private:
    Replicator& owner_;
  };
  std::shared_ptr<Slices> slicing_;
  bool holds_values_ = false;
  bool ready_ = true;
  void slices_filled();
  void check_ready() const;
  void make_gatherer();
  void make_reducer(std::vector<at::Tensor> trainable);
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
  bool sync_ = true;
  int world_listener_ = 0;  // set while following shoal::world()
};

}  // namespace shoal::dp
