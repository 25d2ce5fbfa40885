#include "shoal/elastic/state.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>

#include <torch/optim.h>
#include <torch/serialize.h>

#include "../core/hash.h"
#include "checkpoint/file.h"
#include "core/log.h"
#include "dp/replication.h"
#include "durable.h"
#include "notes.h"
#include "policy.h"
#include "runtime/world.h"
#include "shoal/core/error.h"
#include "shoal/global/nn.h"
#include "shoal/runtime/init.h"
#include "slices.h"
#include "snapshot.h"
#include "state_access.h"
#include "world.h"

namespace shoal::elastic {
namespace {

// Thrown by commit() when the workers agreed to form the next round; caught by run(). Not an
// std::exception, so that a training function's catch (const std::exception&) lets it through.
struct Reform {
  std::string why;
};

std::atomic<bool> leave_requested{false};

extern "C" void on_sigterm(int) {
  leave_requested.store(true);
}

using ::shoal::detail::fnv1a;  // the same on every host, unlike what std::hash promises

constexpr const char* kEpochKey = "shoal.elastic.epoch";
constexpr const char* kVersionKey = "shoal.elastic.version";
constexpr const char* kRatesKey = "shoal.elastic.learning_rates";
constexpr const char* kNoiseKey = "shoal.elastic.gradient_noise";
constexpr const char* kScaledStepsKey = "shoal.elastic.scaled_steps";
constexpr const char* kStepTimesKey = "shoal.elastic.step_times";

const char* policy_name(BatchPolicy::Kind kind) {
  switch (kind) {
    case BatchPolicy::Kind::kAdaScale:
      return "adascale()";
    case BatchPolicy::Kind::kGoodput:
      return "goodput()";
    default:
      return "scale_learning_rate()";
  }
}

constexpr const char* kValuePrefix = "value.";
constexpr const char* kBufferPrefix = "shoal.elastic.buffer.";
// How often commit() records the job's progress for newcomers (Note [The job's recorded commits]).
constexpr int64_t kRecordEvery = 100;

}  // namespace

State::State(torch::nn::Module& module, torch::optim::Optimizer& optimizer, data::Sampler& sampler,
             StateOptions options)
    : module_(module), optimizer_(optimizer), sampler_(sampler), options_(options) {
  const bool per_worker = sampler.options().per_worker;
  if (options_.policy.kind == BatchPolicy::Kind::kKeepGlobalBatch && per_worker) {
    throw UsageError(
        "elastic::State: BatchPolicy::keep_global_batch() needs a sampler whose batch_size is the "
        "global batch; this one is per_worker");
  }
  const auto kind = options_.policy.kind;
  if (kind != BatchPolicy::Kind::kKeepGlobalBatch) {
    if (!per_worker) {
      throw UsageError(std::string("elastic::State: BatchPolicy::") + policy_name(kind) +
                       " needs a per_worker sampler (each worker's batch stays); this one's batch_size is the "
                       "global batch");
    }
    if (options_.policy.reference_world_size < 1 || options_.policy.warmup_steps < 0) {
      const bool ada = kind == BatchPolicy::Kind::kAdaScale;
      const std::string name = policy_name(kind);
      throw UsageError("elastic::State: " + name.substr(0, name.size() - 1) +
                       std::to_string(options_.policy.reference_world_size) +
                       (ada ? "" : ", " + std::to_string(options_.policy.warmup_steps)) +
                       "): expected a reference world size >= 1" + (ada ? "" : " and warm-up steps >= 0"));
    }
  }
  // The DataParallel that measures the module's gradient noise, if any.
  for (const auto& p : module.parameters()) {
    if (!p.requires_grad()) continue;
    auto replication = dp::replication_of(p);
    if (!replication) continue;
    if (!noise_) noise_ = replication->noise();
    if (auto slicing = replication->slicing(); slicing && !sliced_) {
      if (options_.copy_parameters) {
        throw UsageError(
            "elastic::State: copy_parameters with a DataParallel at a ZeRO stage; expected it "
            "false (each commit's slices are copied to the next worker instead; docs/memory.md)");
      }
      sliced_ = std::make_unique<SlicedCommits>(std::move(slicing), optimizer_);
    }
  }
  if ((kind == BatchPolicy::Kind::kAdaScale || kind == BatchPolicy::Kind::kGoodput) && !noise_) {
    throw UsageError(
        std::string("elastic::State: BatchPolicy::") + policy_name(kind) +
        " needs the gradient noise measured: expected the module under a DataParallel with "
        "measure_gradient_noise = true");
  }
  if (kind == BatchPolicy::Kind::kGoodput) {
    options_.policy.limits.check("elastic::State: BatchPolicy::goodput()");
    if (options_.policy.choose_every < 1) {
      throw UsageError("elastic::State: BatchPolicy::goodput(): choose_every is " +
                       std::to_string(options_.policy.choose_every) + "; expected commits >= 1");
    }
    if (sampler.leased()) {
      throw UsageError(
          "elastic::State: BatchPolicy::goodput() changes the sampler's batch; this one "
          "leases its batches (an elastic parameter-server job): expected one that cuts them");
    }
  }
  // Elastic rounds share one worker's whole module, which is wrong for pieces of global tensors.
  auto refuse_globals = [](torch::nn::Module& m) {
    auto* holder = dynamic_cast<global::nn::Module*>(&m);
    if (holder == nullptr) return;
    const auto globals = holder->named_global_parameters();
    if (globals.empty()) return;
    throw UsageError(
        "elastic::State: the module holds global parameters (" + globals.front().first +
        ", of shoal::global::nn); elastic jobs do not support them yet: expected a module of plain "
        "torch parameters (with DataParallel)");
  };
  refuse_globals(module);
  for (const auto& child : module.modules(/*include_self=*/false)) refuse_globals(*child);
  for (auto& group : optimizer_.param_groups()) base_rates_.push_back(group.options().get_lr());
  durable_ = std::make_unique<DurableCommits>(options_.checkpoint, options_.checkpoint_every);
}

State::~State() {
  for (auto& [replication, id] : waiters_) {
    if (auto live = replication.lock()) live->remove_waiter(id);
  }
  if (copying_.valid()) copying_.wait();
}

struct State::Vote {
  comm::Work work;
  at::Tensor flags;  // one per member (leaving), then one (a change is pending)
  std::string pending;
};

void State::commit() {
  ++version_;
  const auto& policy = options_.policy;
  if (!epoch_commit_) scaled_steps_ += gain_;  // the step just taken, at the rates of gain_
  if (policy.kind == BatchPolicy::Kind::kGoodput) time_step();
  if (policy.kind == BatchPolicy::Kind::kAdaScale || policy.kind == BatchPolicy::Kind::kGoodput)
    apply_gain();
  if (policy.kind == BatchPolicy::Kind::kScaleLearningRate && warmup_done_ < policy.warmup_steps) {
    ++warmup_done_;
    const int world = shoal::is_initialized() ? shoal::world_size() : 1;
    const double fraction =
        static_cast<double>(warmup_done_) / static_cast<double>(policy.warmup_steps);
    auto& groups = optimizer_.param_groups();
    for (size_t i = 0; i < groups.size() && i < warmup_from_.size(); ++i) {
      const double target = base_rates_[i] * world / policy.reference_world_size;
      groups[i].options().set_lr(warmup_from_[i] + (target - warmup_from_[i]) * fraction);
    }
  }
  snapshot();
  // The job's progress for a queue that runs it, from its first worker, twice a second.
  if (!shoal::is_initialized() || shoal::rank() == 0) {
    Progress progress{
        version_,
        epoch_,
        sampler_.epoch() * sampler_.dataset_size() + sampler_.cursor(),
        shoal::is_initialized() ? shoal::world_size() : 1,
        noise_ ? noise_->value().noise_scale() : 0.0,
        sampler_.options().per_worker ? static_cast<int64_t>(sampler_.options().batch_size) : 0,
        BatchLimits{},
        {}};
    if (policy.kind == BatchPolicy::Kind::kGoodput) {
      progress.batch_limits = policy.limits;
      progress.steps = samples_of(step_times_);
    }
    note_progress(progress, 500, progress_at_ms_, progress_world_);
  }
  if (shoal::is_initialized() && shoal::job().elastic) {
    // A worker the others declared dead trains in a group they left: nothing it does from here
    // is the job's (see Note [Sharing the newest commit]). Checked after the snapshot, so that
    // the recovery finds this worker's parameters at its commit (Note [Commits without copies]).
    ElasticWorld& elastic = ElasticWorld::get();
    if (std::string lost = elastic.lost(); !lost.empty()) {
      throw CommError("commit on " + std::to_string(shoal::world_size()) + " workers: lost " +
                      lost);
    }
    if (sliced_) sliced_->copy_to_next(shoal::world(), version_, lineage_);
    // Once per round and every kRecordEvery commits: one small metadata update each.
    if (!recorded_ || version_ % kRecordEvery == 0) {
      elastic.rendezvous().record_commit(version_);
      recorded_ = true;
    }
    if (durable_->due(version_)) write_to_disk();
    check_world();
  } else if (durable_->due(version_)) {
    write_to_disk();
  }
}

// The first worker keeps the commit on disk; the others hold the same one.
void State::write_to_disk() {
  if (sliced_) {  // every member's slices gathered whole, as shoal::save gathers them
    std::string payload =
        checkpoint::encode_whole_payload(module_, optimizer_, &sampler_, extras());
    if (shoal::rank() == 0) {
      durable_->write(version_, std::move(payload));
    } else {
      durable_->written_by_first(version_);
    }
    return;
  }
  if (shoal::is_initialized() && shoal::rank() != 0) return;
  durable_->write(version_, serialize());
}

std::string State::serialize() const {
  auto extras = this->extras();
  if (!sliced_) return checkpoint::encode_payload(module_, &optimizer_, &sampler_, extras);
  // The slices travel on their own; the buffers as extras.
  for (const auto& item : module_.named_buffers())
    extras[kBufferPrefix + item.key()] = item.value();
  const torch::nn::Module none;
  return checkpoint::encode_payload(none, nullptr, &sampler_, extras);
}

shoal::CheckpointExtras State::extras() const {
  shoal::CheckpointExtras extras;
  for (const auto& [name, value] : values_) {
    if (value.defined()) extras[kValuePrefix + name] = value;
  }
  extras[kEpochKey] = at::tensor({epoch_}, at::kLong);
  extras[kVersionKey] = at::tensor({version_}, at::kLong);
  std::vector<double> rates;
  for (auto& g : optimizer_.param_groups()) rates.push_back(g.options().get_lr());
  extras[kRatesKey] = at::tensor(rates, at::kDouble);
  extras[kScaledStepsKey] = at::tensor({scaled_steps_}, at::kDouble);
  if (!step_times_.empty()) extras[kStepTimesKey] = pack_step_times(step_times_);
  if (noise_) extras[kNoiseKey] = at::tensor(noise_->state(), at::kDouble);
  return extras;
}

void State::deserialize(const std::string& what, std::string_view payload) {
  shoal::CheckpointExtras extras;
  if (!sliced_) {
    checkpoint::decode_payload(what, payload, module_, &optimizer_, &extras, &sampler_);
  } else {
    torch::nn::Module none;
    checkpoint::decode_payload(what, payload, none, nullptr, &extras, &sampler_);
    torch::NoGradGuard no_grad;
    for (auto& item : module_.named_buffers()) {
      auto found = extras.find(kBufferPrefix + item.key());
      if (found != extras.end()) item.value().copy_(found->second);
    }
  }
  take_extras(what, extras);
}

void State::take_extras(const std::string& what, shoal::CheckpointExtras& extras) {
  for (const char* key : {kEpochKey, kVersionKey, kRatesKey}) {
    if (extras.count(key) == 0) {
      throw UsageError(what + " has no " + key + ": expected the commit of an elastic::State");
    }
  }
  epoch_ = extras.at(kEpochKey).item<int64_t>();
  version_ = extras.at(kVersionKey).item<int64_t>();
  auto rates = extras.at(kRatesKey);
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < static_cast<size_t>(rates.numel()); ++i) {
    groups[i].options().set_lr(rates[i].item<double>());
  }
  if (extras.count(kScaledStepsKey)) scaled_steps_ = extras.at(kScaledStepsKey).item<double>();
  step_times_ =
      extras.count(kStepTimesKey) ? unpack_step_times(extras.at(kStepTimesKey)) : StepTimes{};
  if (noise_ && extras.count(kNoiseKey)) {
    const auto numbers = extras.at(kNoiseKey).contiguous();
    noise_->set_state(std::vector<double>(numbers.data_ptr<double>(), numbers.data_ptr<double>() + numbers.numel()));
  }
  values_.clear();
  const std::string prefix = kValuePrefix;
  for (auto& [name, value] : extras) {
    if (name.compare(0, prefix.size(), prefix) == 0) values_[name.substr(prefix.size())] = value;
  }
}

void State::resume_from_disk() {
  if (!durable_->enabled()) return;
  auto payload = durable_->read();
  if (!payload) return;
  deserialize("checkpoint " + durable_->path(), *payload);
  std::fprintf(
      stderr,
      "shoal elastic: no worker holds a commit; resuming from step %lld (epoch %lld) of %s\n",
      static_cast<long long>(version_), static_cast<long long>(epoch_), durable_->path().c_str());
}

int64_t State::lost_history() const {
  if (!shoal::is_initialized() || !shoal::job().elastic) return 0;
  return std::max<int64_t>(0, ElasticWorld::get().rendezvous().recorded_commit());
}

namespace {
[[noreturn]] void refuse_to_start_again(int64_t recorded) {
  if (recorded > 0) {
    std::fprintf(
        stderr,
        "shoal elastic: every worker holding the job's commits is gone (it had committed step "
        "%lld at least); not starting it again from step 0 (durable commits, SHOAL_CHECKPOINT, "
        "would resume it)\n",
        static_cast<long long>(recorded));
  }
  std::fflush(nullptr);
  std::exit(1);
}

}  // namespace

void State::next_epoch() {
  ++epoch_;
  epoch_commit_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{epoch_commit_};
  commit();
}

// The workers vote at each commit on changing the world: this one leaves (SIGTERM), or a worker
// waits to join. The vote is an all-reduce that runs while the next step computes; its result is
// read at the next commit, where every worker sees the same one, so all leave the training
// function at the same commit (one step after the vote).
void State::check_world() {
  ElasticWorld& elastic = ElasticWorld::get();
  comm::Group& group = shoal::world();
  const int n = group.size();
  std::unique_ptr<Vote> counted = std::move(vote_);

  auto vote = std::make_unique<Vote>();
  vote->flags = at::zeros({n + 1}, at::kInt);
  if (leave_requested.load()) vote->flags[group.rank()] = 1;
  vote->pending = elastic.rendezvous().pending_change(elastic.view());
  if (!vote->pending.empty()) vote->flags[n] = 1;
  vote->work = group.all_reduce_async(vote->flags);
  vote_ = std::move(vote);

  if (!counted) return;
  counted->work.wait();
  const auto flags = counted->flags.accessor<int, 1>();
  std::vector<int> leavers;
  for (int r = 0; r < n; ++r) {
    if (flags[r] > 0) leavers.push_back(r);
  }
  const bool change = flags[n] > 0;
  if (leavers.empty() && !change) return;
  vote_->work.wait();  // the others wait for this one too before they leave
  vote_.reset();
  const View& view = elastic.view();
  const bool voted_to_leave =
      std::find(leavers.begin(), leavers.end(), group.rank()) != leavers.end();
  // Note [The last to be stopped]: a queue stops all of a job's workers at once, but the SIGTERMs
  // land a little apart, and one can land just after its worker voted while the others' landed
  // before theirs: every other worker then leaves at this commit, thinking the job goes on
  // without them, and none keeps the commit on disk, since not all voted to leave. This worker,
  // asked to leave by now, goes with them and keeps the commit itself; staying, it would wait
  // alone for a world until its SIGKILL, and the job started again would find no commit.
  const bool last_to_leave = !voted_to_leave && leave_requested.load() &&
                             static_cast<int>(leavers.size()) == n - 1;
  if (voted_to_leave || last_to_leave) {
    // Every worker leaves (a whole job stopped, or preempted by a queue): this commit is the
    // job's last in memory, so the first worker keeps it on disk before it goes, and the job
    // started again resumes from here rather than from the last periodic durable commit.
    if (durable_->enabled() && !durable_->written(version_)) {
      if (last_to_leave && !sliced_) {  // alone, it cannot gather the others' slices
        durable_->write(version_, serialize());
        durable_->wait();
      } else if (static_cast<int>(leavers.size()) == n) {
        write_to_disk();
        if (group.rank() == 0) durable_->wait();
      }
    }
    log::info("shoal elastic: " + view.describe(view.rank) + " leaves the job after step " +
              std::to_string(version_) + " (SIGTERM)");
    note_leave(version_);
    elastic.rendezvous().leave();
    std::fflush(nullptr);
    std::exit(0);
  }
  std::string why;
  for (int r : leavers) why += (why.empty() ? "" : "; ") + view.describe(r) + " leaves";
  if (change)
    why += (why.empty() ? "" : "; ") +
           (counted->pending.empty() ? "a worker waits to join" : counted->pending);
  throw Reform{why};
}

// Note [Sharing the newest commit]
// After a new round forms, its members hold commits of different ages: survivors the last one
// (or the one before, if the failure came between another worker's commit and theirs), a
// newcomer none, and a worker that was declared dead while stopped the one it had then. Every
// member's (version, lineage) is gathered; the lowest rank with the highest version sends its
// commit to all, unless every member already has that very commit. So a worker never takes an
// older commit than its own, version() never goes back, and a member whose commit of another
// round is dropped says so. When no member holds a commit, the first one takes the durable
// commit, if the job keeps one (DurableCommits), before it sends. The
// lineage names the history a version counts in (the round and members that last shared a
// commit), so two halves of a partitioned job that trained apart to the same version are not
// taken for equal.
void State::sync() {
  vote_.reset();  // a vote of the previous world, which is gone
  comm::Group alone = comm::Group::single();
  comm::Group& group = shoal::is_initialized() ? shoal::world() : alone;
  const int n = group.size();
  if (sliced_) {
    sync_slices(group);
    return;
  }
  if (needs_parameters_ && n == 1) {
    throw UsageError(
        "elastic: no worker holds the parameters of commit " + std::to_string(version_) +
        ": they changed after it (the optimizer stepped) and a collective failed before the next "
        "commit(); commit right after the optimizer's step, or set StateOptions::copy_parameters");
  }
  if (n == 1 && version_ == 0) {
    resume_from_disk();
    if (const int64_t recorded = version_ == 0 ? lost_history() : 0; recorded > 0) {
      refuse_to_start_again(recorded);
    }
  }
  if (n > 1) {
    auto mine = at::tensor({version_, static_cast<int64_t>(lineage_), int64_t{needs_parameters_}},
                           at::kLong)
                    .view({1, 3});
    auto all = group.all_gather(mine);
    // The newest commit among the workers that hold their commit's parameters (Note [Commits
    // without copies]); a changed worker newer than all of them has nothing to give.
    int source = -1;
    int64_t newest_changed = -1;
    for (int r = 0; r < n; ++r) {
      const int64_t version = all[r][0].item<int64_t>();
      if (all[r][2].item<int64_t>() != 0) {
        newest_changed = std::max(newest_changed, version);
      } else if (source < 0 || version > all[source][0].item<int64_t>()) {
        source = r;
      }
    }
    if (source < 0 || newest_changed > all[source][0].item<int64_t>()) {
      throw UsageError(
          "elastic: no worker holds the parameters of commit " + std::to_string(newest_changed) +
          ": they changed after it (the optimizer stepped) and a collective failed before the next "
          "commit(); commit right after the optimizer's step, or set "
          "StateOptions::copy_parameters");
    }
    // Nothing committed anywhere yet: start everyone from the durable commit, if any, else from
    // the first worker's values, as DataParallel's constructor does in a static job.
    const int64_t newest = all[source][0].item<int64_t>();
    bool same = newest > 0;
    for (int r = 0; r < n; ++r) same = same && all[r].equal(all[source]);
    if (!same && version_ > 0 && group.rank() != source &&
        all[source][1].item<int64_t>() != static_cast<int64_t>(lineage_) &&
        shoal::is_initialized() && shoal::job().elastic) {
      // A newer commit wins, wherever it was made; say so where one is dropped that was not
      // simply older in the same history (a worker left out while stopped, a partition).
      const View& view = ElasticWorld::get().view();
      std::fprintf(
          stderr,
          "shoal elastic: %s drops its commit of step %lld (made in another round) for step "
          "%lld of %s\n",
          view.describe(group.rank()).c_str(), static_cast<long long>(version_),
          static_cast<long long>(newest), view.describe(source).c_str());
    }
    if (!same) share_from(group, source, newest, true);
  }
  finish_sync(group);
}

void State::share_from(comm::Group& group, int source, int64_t newest, bool resume) {
  std::string payload;
  int64_t lost = 0;
  if (group.rank() == source) {
    if (newest == 0 && resume) resume_from_disk();
    // -1: the job lost its history, and every member stops (the source says why).
    const int64_t recorded = version_ == 0 ? lost_history() : 0;
    if (recorded == 0) payload = serialize();
    lost = recorded;
  }
  auto length =
      at::tensor({lost > 0 ? int64_t{-1} : static_cast<int64_t>(payload.size())}, at::kLong);
  group.broadcast(length, {source});
  if (length.item<int64_t>() < 0) refuse_to_start_again(lost);
  auto bytes = at::empty({length.item<int64_t>()}, at::kByte);
  if (group.rank() == source) std::memcpy(bytes.data_ptr(), payload.data(), payload.size());
  group.broadcast(bytes, {source});
  if (group.rank() != source) {
    const std::string_view view(reinterpret_cast<const char*>(bytes.data_ptr()), bytes.numel());
    deserialize("the elastic state of worker " + std::to_string(source), view);
  }
}

// Note [Slices in an elastic job] (src/elastic/slices.cpp): the newest commit's slices cut for
// this round, from the members' own slices and copies, else from the durable commit.
void State::sync_slices(comm::Group& group) {
  const int n = group.size();
  // SlicedCommits::Column's order.
  std::vector<int64_t> mine{version_, static_cast<int64_t>(lineage_), int64_t{needs_parameters_}};
  for (const int64_t number : sliced_->holding()) mine.push_back(number);
  const auto row = at::tensor(mine, at::kLong).view({1, -1});
  const at::Tensor rows = n > 1 ? group.all_gather(row) : row;
  int source = 0;  // the first member with the newest commit
  const auto column = rows.accessor<int64_t, 2>();
  using Column = SlicedCommits::Column;
  for (int m = 1; m < n; ++m) {
    if (column[m][Column::kVersion] > column[source][Column::kVersion]) source = m;
  }
  const int64_t newest = column[source][Column::kVersion];
  const bool held = SlicedCommits::any_holds_values(rows);
  std::string missing;
  std::optional<SlicedCommits::Plan> plan;
  if (held) plan = SlicedCommits::plan(rows, newest, column[source][Column::kLineage], &missing);
  if (plan) {
    sliced_->recut(group, *plan);
    bool same = true;
    for (int m = 0; m < n; ++m)
      same =
          same &&
          rows[m].narrow(0, 0, Column::kCutSize).equal(rows[source].narrow(0, 0, Column::kCutSize));
    if (!same) share_from(group, source, newest, false);
  } else if (!load_durable(group)) {
    if (held) {
      throw UsageError(
          "elastic: part(s) " + missing + " of the slices of step " + std::to_string(newest) +
          " were lost with their workers (a worker died between its optimizer's step and its "
          "commit's copy, or it and the next one died together); expected a durable commit "
          "(SHOAL_CHECKPOINT) to resume from (docs/memory.md, \"Elastic jobs\")");
    }
    // The job's first round: every slice from the first member's parameters.
    if (const int64_t recorded = n == 1 ? lost_history() : 0; recorded > 0) {
      refuse_to_start_again(recorded);
    }
    sliced_->recut_from(group, source);
    if (n > 1) share_from(group, source, newest, false);
  }
  finish_sync(group);
  sliced_->copy_to_next(group, version_, lineage_);
}

// Every member loads its part of the durable commit, when the first finds one.
bool State::load_durable(comm::Group& group) {
  if (!durable_->enabled()) return false;
  auto exists = at::zeros({1}, at::kLong);
  if (group.rank() == 0) exists[0] = int64_t{durable_->exists()};  // shoal::load reads it
  if (group.size() > 1) group.broadcast(exists, {0});
  if (exists.item<int64_t>() == 0) return false;
  sliced_->recut_for_load();
  shoal::CheckpointExtras extras;
  LoadOptions options;
  options.extras = &extras;
  shoal::load(durable_->path(), module_, optimizer_, sampler_, options);
  sliced_->filled();
  take_extras("checkpoint " + durable_->path(), extras);
  if (group.rank() == 0) {
    std::fprintf(stderr, "shoal elastic: resuming from step %lld (epoch %lld) of %s\n",
                 static_cast<long long>(version_), static_cast<long long>(epoch_),
                 durable_->path().c_str());
  }
  return true;
}

void State::finish_sync(comm::Group& group) {
  const int n = group.size();
  if (shoal::is_initialized() && shoal::job().elastic) {
    const View& view = ElasticWorld::get().view();
    std::string members = std::to_string(view.round);
    for (const auto& p : view.members) members += "," + p.id;
    lineage_ = fnv1a(members);
  }
  if (n != sampler_.world_size() || group.rank() != sampler_.rank()) {
    const auto position = sampler_.state();
    sampler_.reshard(group.rank(), n);
    sampler_.load_state(position);  // so that the loop's set_epoch keeps the cursor
  }
  needs_parameters_ = false;
  recorded_ = false;
  apply_policy();
  snapshot();
  for (auto& reset : resets_) reset();
}

void State::finish() {
  wait_copy();
  // The end of the training is kept too, so that the job started again has nothing left to do.
  if (durable_->enabled() && !durable_->written(version_)) write_to_disk();
  if (!shoal::is_initialized() || shoal::rank() == 0) durable_->wait();
  if (!vote_) return;
  try {
    vote_->work.wait();  // every worker has this vote in flight: end it together
  } catch (const CommError&) {
    // A worker was lost after the last commit: the training is complete all the same.
  }
  vote_.reset();
}

void run(State& state, const std::function<void()>& train) {
  if (!shoal::is_initialized() || !shoal::job().elastic) {
    StateAccess::sync(state);
    train();
    StateAccess::finish(state);
    return;
  }
  struct sigaction action {
  }, previous{};
  action.sa_handler = on_sigterm;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, &previous);
  struct RestoreHandler {
    struct sigaction handler;
    ~RestoreHandler() { sigaction(SIGTERM, &handler, nullptr); }
  } restore_handler{previous};

  ElasticWorld& elastic = ElasticWorld::get();
  std::string why;
  for (;;) {
    try {
      StateAccess::restore(state);
      StateAccess::sync(state);
      if (!why.empty() && shoal::is_main()) {
        log::info("shoal elastic: round " + std::to_string(elastic.view().round) + ": " +
                  std::to_string(shoal::world_size()) + " workers, from step " +
                  std::to_string(state.version()) + " (epoch " + std::to_string(state.epoch()) +
                  ") on; " + why);
      }
      train();
      StateAccess::finish(state);
      return;
    } catch (const Reform& reform) {
      why = reform.why;
      elastic.reform(false);
    } catch (const CommError& e) {
      why = e.what();
      elastic.reform(true);
    }
    // Declared dead while it was silent, this worker keeps its commit: the next round takes
    // the newest commit of its members (Note [Sharing the newest commit]), so the job never
    // goes back to an older one, nor this worker's version().
    elastic.rendezvous().take_rejoined();
  }
}

}  // namespace shoal::elastic
