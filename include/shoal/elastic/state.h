// Elastic training: what a failure rolls back to and what a newcomer receives, in one object
// (Horovod's elastic state, in C++), and the loop that recovers.
//
//   shoal::init();                                   // under shoal run --min 1 --max 4
//   ...model, optimizer, DataParallel, loader as usual...
//   shoal::elastic::State state(net, optimizer, loader);
//   shoal::elastic::run(state, [&] {
//     for (; state.epoch() < epochs; state.next_epoch())
//       for (auto& batch : loader.epoch(state.epoch())) { step(batch); state.commit(); }
//   });
//
// When a worker dies, the others' collective raises CommError; run() catches it, forms the
// next round with the workers still alive (and any waiting to join), gives every member the
// newest commit, re-cuts what is left of the epoch over the new world and calls the function
// again: the loop continues from the last commit. See docs/elastic.md.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "shoal/data/sampler.h"
#include "shoal/dp/goodput.h"

namespace shoal::comm {
class Group;
}  // namespace shoal::comm

namespace shoal::dp {
class Replication;  // src/dp/replication.h
class NoiseMeter;   // src/dp/noise_meter.h
}  // namespace shoal::dp

namespace shoal::elastic {

// What changes when the number of workers changes.
struct BatchPolicy {
  enum class Kind {
    // The global batch stays (the sampler's batch_size is the global one and is cut over the
    // workers: each takes more or fewer samples); the learning rate stays.
    kKeepGlobalBatch,
    // Each worker's batch stays (the sampler is per_worker), so the global batch follows the
    // world, and the learning rate is scaled linearly with it: lr = lr0 * world / reference.
    kScaleLearningRate,
    // Each worker's batch stays, and the learning rate is scaled by AdaScale's gain (Johnson et
    // al., ICML'20) for the global batch against the reference world's, from the gradient noise
    // DataParallel measures (shoal/dp/gradient_noise.h): lr = lr0 * gain, after every commit.
    // The gain lies between 1 and world / reference: linear scaling while the gradient's noise
    // dominates, none once the batch is far above the noise scale. State::scaled_steps() counts
    // the progress in steps at the reference world, for a schedule and for when to stop.
    kAdaScale,
    // The batch follows the world by goodput (Pollux, OSDI'21; shoal/dp/goodput.h): at every
    // change of the world and every `choose_every` commits, the batch of the highest goodput
    // within `limits`, from the steps this job measured and its gradient noise, and the
    // learning rate scaled by AdaScale's gain for that batch against limits.base_batch. The
    // sampler is per_worker; its batch_size becomes each worker's samples per step, which the
    // loop takes in accumulation() backward passes (State::accumulation()).
    kGoodput,
  };
  Kind kind = Kind::kKeepGlobalBatch;
  // kScaleLearningRate and kAdaScale: the world size the optimizer's learning rates were set for.
  int reference_world_size = 1;
  // kScaleLearningRate: after a change, the rate moves linearly to its new value over this many
  // commits (0: at once).
  int64_t warmup_steps = 0;
  // kGoodput: what the batch may be, and how many commits pass between two choices.
  BatchLimits limits{};
  int64_t choose_every = 50;

  static BatchPolicy keep_global_batch() { return {}; }
  static BatchPolicy scale_learning_rate(int reference_world_size = 1, int64_t warmup_steps = 0) {
    return {Kind::kScaleLearningRate, reference_world_size, warmup_steps};
  }
  static BatchPolicy adascale(int reference_world_size = 1) { return {Kind::kAdaScale, reference_world_size, 0}; }
  static BatchPolicy goodput(BatchLimits limits, int64_t choose_every = 50) {
    return {Kind::kGoodput, 1, 0, limits, choose_every};
  }
};

struct StateOptions {
  BatchPolicy policy;
  // Whether commit() copies the parameters and the optimizer's state. In an elastic job with
  // DataParallel it need not (the default): every worker holds the same parameters, which only
  // the optimizer's step changes, so a worker whose parameters changed since its last commit
  // takes them from one whose did not, or whose commit is newer (Note [Commits without
  // copies]). Set it when the program communicates between the end of its backward and commit()
  // (a collective that fails there finds every worker's parameters possibly changed, and run()
  // raises), or when it changes parameters outside the optimizer. Outside elastic DataParallel jobs
  // commit() always copies.
  bool copy_parameters = false;
  // Durable commits (docs/elastic.md): every `checkpoint_every` commits, and at the end, the
  // first worker also writes the commit to `checkpoint` (the format of shoal::save), atomically
  // and in the background; a job in which no worker holds a commit (all died, or it is started
  // again) resumes from that file. Empty and 0: SHOAL_CHECKPOINT and SHOAL_CHECKPOINT_EVERY
  // (default 100), which `shoal run` passes on to its workers; no file is written when neither
  // names one.
  std::string checkpoint{};
  int64_t checkpoint_every = 0;
};

class DurableCommits;
class SlicedCommits;  // src/elastic/slices.h
struct StateAccess;  // run()'s and the tests' way to restore, sync and finish (src/elastic/state_access.h)

class State {
 public:
  // The module's parameters and buffers, the optimizer's state and learning rates, and the
  // sampler's place. UsageError when the policy does not fit the sampler (kKeepGlobalBatch needs
  // a global batch_size, kScaleLearningRate a per_worker one), and for a module holding global
  // parameters (shoal::global::nn), whose pieces differ between workers: a new round would give
  // every worker the first one's pieces.
  State(torch::nn::Module& module, torch::optim::Optimizer& optimizer, data::Sampler& sampler,
        StateOptions options = {});
  template <typename ModuleType, typename Loader>
  State(const std::shared_ptr<ModuleType>& module, torch::optim::Optimizer& optimizer,
        Loader& loader, StateOptions options = {})
      : State(*module, optimizer, loader.sampler(), options) {}
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Records the state in memory, as the point a failure rolls back to. Cheap (buffers, values
  // and the sampler's place; the parameters and the optimizer's state only by their version
  // counters, or copied in the background with copy_parameters); in an elastic job it also
  // agrees with the other
  // workers whether the world should change now (a worker waiting to join, or this one or
  // another leaving after SIGTERM) and, if so, leaves the training function to form it. A
  // worker that got SIGTERM exits here with code 0, after the others know it leaves.
  // Every worker calls it at the same points (a collective).
  void commit();

  // The epoch the training loop is in; next_epoch() moves to the next one and commits.
  int64_t epoch() const { return epoch_; }
  void next_epoch();

  // Commits so far in the job's history (the committed step count), the same on every worker.
  // It only grows: a round takes the newest commit any member holds (or the durable one).
  int64_t version() const { return version_; }

  // The program's own values (a step counter, a schedule's state, an RNG seed), committed and
  // restored with the rest and received by newcomers. Any dtype and shape.
  at::Tensor& value(const std::string& name) { return values_[name]; }

  // Called on every worker after the world changed and the state was restored and shared, before
  // the training function runs again (e.g. to rebuild what depends on the world size).
  void on_reset(std::function<void()> callback) { resets_.push_back(std::move(callback)); }

  // Changes the rates of each of the optimizer's parameter groups, as the policy's base
  // ("lr0") values; for a program's own schedule under kScaleLearningRate and kAdaScale. The
  // optimizer's rates become base * gain() at once (during a warmup, its next commits move them
  // towards the new target instead).
  void set_base_learning_rates(std::vector<double> rates);

  // The training's progress in steps at the policy's reference world: under kAdaScale the sum of
  // each committed step's gain (AdaScale's scale-invariant iterations), else the steps times
  // world / reference (kScaleLearningRate) or the steps (kKeepGlobalBatch). Committed and restored
  // with the rest. A schedule of the reference run follows it, and a run ends at the same value.
  double scaled_steps() const { return scaled_steps_; }
  // The factor the policy scales the learning rates by for the next step (1 under
  // kKeepGlobalBatch).
  double gain() const { return gain_; }
  // kGoodput: the backward passes the next step takes its batch in (gradient accumulation: the
  // first accumulation() - 1 under DataParallel::no_sync()); 1 under the other policies. And the
  // last choice, with what it expected of it.
  int accumulation() const { return choice_.accumulation; }
  const BatchChoice& batch_choice() const { return choice_; }

  struct Snapshot;

 private:
  friend struct StateAccess;
  // For run(): back to the last commit, and sharing the newest commit after a new round.
  void restore();
  void sync();
  // After the training function returned: ends what commit() left in flight.
  void finish();

  void snapshot();
  void wait_copy();
  // The DataParallels that replicate the module's trainable parameters, one each; empty when a
  // parameter has none, and commit() must copy (see StateOptions).
  std::vector<std::shared_ptr<dp::Replication>> replications() const;
  // Some parameter changed since the last commit, which kept no copy of them.
  bool parameters_changed() const;
  void apply_policy();
  // The learning rates for the next step: lr0 * gain_ (kAdaScale, kGoodput).
  void apply_gain();
  // kGoodput: times the step that just ended, and every choose_every commits agrees on the
  // steps' times and picks the batch again (a collective); choose() picks it from what is
  // agreed (Note [Choosing the batch in an elastic job], src/elastic/state.cpp).
  void time_step();
  void choose();
  void check_world();
  // The state as a checkpoint payload (checkpoint/contents.h), and back. Under ZeRO, without
  // the slices and their optimizer state, which travel on their own (Note [Slices in an elastic
  // job], src/elastic/slices.cpp). take_extras restores what the extras hold.
  std::string serialize() const;
  void deserialize(const std::string& what, std::string_view payload);
  std::map<std::string, at::Tensor> extras() const;
  void take_extras(const std::string& what, std::map<std::string, at::Tensor>& extras);
  // sync()'s parts: sharing `source`'s commit with the others (and with newest 0, the durable
  // one it resumes from, unless `resume` is false); under ZeRO, the slices cut for the new world
  // and the durable commit loaded by every member (false: there is none); what every round
  // does after.
  void share_from(comm::Group& group, int source, int64_t newest, bool resume);
  void sync_slices(comm::Group& group);
  bool load_durable(comm::Group& group);
  void finish_sync(comm::Group& group);
  // No member of the round holds a commit: take the durable one, if any (the first worker).
  void resume_from_disk();
  // No member of the round holds a commit and none is on disk, but the job has committed
  // before: the newest version recorded, else 0 (Note [The job's recorded commits]).
  int64_t lost_history() const;
  void write_to_disk();

  torch::nn::Module& module_;
  torch::optim::Optimizer& optimizer_;
  data::Sampler& sampler_;
  StateOptions options_;
  std::map<std::string, at::Tensor> values_;
  std::vector<std::function<void()>> resets_;
  std::vector<double> base_rates_;
  int64_t epoch_ = 0;
  int64_t version_ = 0;
  uint64_t lineage_ = 0;  // which history version_ counts in; see Note [Sharing the newest commit]
  // Warm-up towards new learning rates (kScaleLearningRate).
  std::vector<double> warmup_from_;
  int64_t warmup_done_ = 0;
  // The gradient noise of the DataParallel of the module's parameters, when it measures it: its
  // state is committed with the rest, so that every worker's gain stays the same.
  std::shared_ptr<dp::NoiseMeter> noise_;
  double scaled_steps_ = 0.0;
  double gain_ = 1.0;
  // kGoodput: the mean seconds of a step at each (world, batch per backward, backward passes),
  // the same on every worker (agreed, committed and restored with the rest); this worker's own
  // steps since the last agreement, at the current choice; when the last commit ended.
  using StepTimes = std::map<std::tuple<int, int64_t, int>, std::pair<double, int64_t>>;
  StepTimes step_times_;
  double pending_seconds_ = 0.0;
  int64_t pending_steps_ = 0;
  int64_t commits_since_choice_ = 0;
  double last_commit_s_ = -1.0;
  BatchChoice choice_{};
  bool epoch_commit_ = false;  // next_epoch()'s commit, which ends no step
  std::unique_ptr<Snapshot> committed_;
  // restore() found the parameters changed since the commit, which kept no copy: sync() must
  // bring them from another worker.
  bool needs_parameters_ = false;
  // See Note [Copying a commit in the background] (src/dp/replication.h): a waiter on each
  // replication, which joins copying_.
  std::future<void> copying_;
  std::vector<std::pair<std::weak_ptr<dp::Replication>, int>> waiters_;
  // The previous commit's vote on changing the world, in flight (see check_world).
  struct Vote;
  std::unique_ptr<Vote> vote_;
  std::unique_ptr<DurableCommits> durable_;
  // A DataParallel at a ZeRO stage replicates the module: its slices' copies and re-cuts.
  std::unique_ptr<SlicedCommits> sliced_;
  bool recorded_ = false;  // a commit of this round was recorded for newcomers
  int64_t progress_at_ms_ = 0;  // the last progress written for a queue (src/elastic/notes.h)
  int progress_world_ = 0;
};

// Runs `train` and, in an elastic job, recovers from the loss of a worker (CommError) and from
// changes agreed at commit(): forms the next round, restores and shares the newest commit, and
// calls `train` again. Returns when `train` returns. Outside an elastic job it only calls
// `train` once (after sharing the first worker's state), and errors propagate.
// `train` must let shoal's exceptions through (no catch (...) around commit()).
void run(State& state, const std::function<void()>& train);

}  // namespace shoal::elastic
