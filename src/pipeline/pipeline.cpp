#include "shoal/pipeline/pipeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "pipeline_state.h"
#include "shoal/core/error.h"
#include "shoal/global/nn.h"
#include "shoal/runtime/init.h"

namespace shoal::pipeline {

using namespace detail;

std::vector<int> balanced_split(const std::vector<int64_t>& weights, int parts) {
  const int n = static_cast<int>(weights.size());
  if (parts < 1)
    throw UsageError("balanced_split: expected at least 1 part, got " + std::to_string(parts));
  if (n < parts) {
    throw UsageError("pipeline: cannot cut " + std::to_string(n) + " layers into " +
                     std::to_string(parts) + " stages: every stage needs at least one layer");
  }
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + std::max<int64_t>(weights[i], 1);
  // cost[k][j]: the smallest possible largest part when the first j weights form k parts.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> cost(parts + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  cost[0][0] = 0;
  for (int k = 1; k <= parts; ++k) {
    for (int j = k; j <= n; ++j) {
      for (int i = k - 1; i < j; ++i) {
        if (cost[k - 1][i] == kInf) continue;
        const int64_t largest = std::max(cost[k - 1][i], prefix[j] - prefix[i]);
        if (largest < cost[k][j]) {
          cost[k][j] = largest;
          cut[k][j] = i;
        }
      }
    }
  }
  std::vector<int> lengths(parts);
  for (int k = parts, j = n; k >= 1; --k) {
    lengths[k - 1] = j - cut[k][j];
    j = cut[k][j];
  }
  return lengths;
}

namespace {

// How the stages sit on workers: the schedule (generated or the user's) and each stage's rank.
// `placements`: the user's (plain layers) or the layers' (global ones), or empty.
void place_stages(Pipeline::State& state, const std::vector<global::Placement>& placements) {
  const PipelineOptions& o = state.options;
  if (o.micro_batches < 1) {
    throw UsageError("pipeline: expected micro_batches >= 1, got " +
                     std::to_string(o.micro_batches));
  }
  const ScheduleKind kind = o.schedule;
  const bool interleaved = kind == ScheduleKind::kInterleaved1F1B;
  int v = o.stages_per_worker == 0 ? (interleaved ? 2 : 1) : o.stages_per_worker;
  if (v < 1) {
    throw UsageError(
        "pipeline: expected stages_per_worker >= 1 (or 0 for the schedule's "
        "default), got " +
        std::to_string(v));
  }
  if (o.custom_schedule) v = o.custom_schedule->stages / std::max(o.custom_schedule->workers, 1);
  if (!interleaved && !o.custom_schedule && v != 1) {
    throw UsageError("pipeline: the " + schedule_kind_name(o.schedule) +
                     " schedule runs one stage per worker; "
                     "stages_per_worker = " +
                     std::to_string(v) + " needs schedule \"interleaved\"");
  }

  // The stages' placements; each distinct one is a worker of the schedule (a line of d
  // replicas, or a mesh of global layers), numbered in order of first use.
  int stages = 0;
  if (!placements.empty()) {
    stages = static_cast<int>(placements.size());
  } else if (!o.split.empty()) {
    stages = static_cast<int>(o.split.size());
  } else if (o.custom_schedule) {
    stages = o.custom_schedule->stages;
  } else {
    stages = state.world_size * v;
  }
  if (!o.split.empty() && static_cast<int>(o.split.size()) != stages) {
    throw UsageError("pipeline: split has " + std::to_string(o.split.size()) +
                     " stages but placements has " + std::to_string(stages));
  }
  std::vector<std::vector<int>> groups;
  for (int s = 0; s < stages && !placements.empty(); ++s) {
    const global::Placement& placement = placements[s];
    if (placement.ndim() != 1 && !state.global) {
      throw UsageError("pipeline: stage " + std::to_string(s) + "'s placement " +
                       placement.describe() +
                       " is a mesh; a stage's placement is a line of workers (its data axis)");
    }
    for (int rank : placement.ranks()) {
      if (rank >= state.world_size) {
        throw UsageError("pipeline: stage " + std::to_string(s) + "'s placement " +
                         placement.describe() + " names worker " + std::to_string(rank) +
                         ", which is not in this job of " + std::to_string(state.world_size));
      }
    }
    if (std::find(groups.begin(), groups.end(), placement.ranks()) == groups.end()) {
      for (const auto& group : groups) {
        for (int rank : placement.ranks()) {
          if (std::find(group.begin(), group.end(), rank) != group.end()) {
            throw UsageError("pipeline: stage " + std::to_string(s) + "'s placement " +
                             placement.describe() + " shares worker " + std::to_string(rank) +
                             " with another stage's placement " +
                             global::Placement(group).describe() +
                             "; stages on one worker must have the same placement");
          }
        }
      }
      if (!state.global && !groups.empty() && groups.front().size() != placement.ranks().size()) {
        throw UsageError("pipeline: stage " + std::to_string(s) + "'s placement " +
                         placement.describe() + " has " + std::to_string(placement.size()) +
                         " workers, stage 0's " + std::to_string(groups.front().size()) +
                         "; every stage needs as many replicas");
      }
      if (state.global && placement.shape() != placements.front().shape()) {
        throw UsageError("pipeline: stage " + std::to_string(s) + "'s placement " +
                         placement.describe() + " is not shaped as stage 0's " +
                         placements.front().describe() +
                         "; member i of each stage sends to member i of the next, so every "
                         "stage's mesh must have the same shape");
      }
      groups.push_back(placement.ranks());
    }
  }
  const int p = placements.empty() ? (stages + v - 1) / v : static_cast<int>(groups.size());
  if (placements.empty()) {
    if (stages % v != 0) {
      throw UsageError("pipeline: " + std::to_string(stages) + " stages don't fill " +
                       std::to_string(v) + " stages per worker");
    }
    if (p > state.world_size) {
      throw UsageError("pipeline: " + std::to_string(stages) + " stages at " + std::to_string(v) +
                       " per worker need " + std::to_string(p) + " workers; the job has " +
                       std::to_string(state.world_size));
    }
    for (int w = 0; w < p; ++w) groups.push_back({w});
  } else if (stages != p * v) {
    // Two stages on one worker where the schedule runs one per worker (or v per worker).
    for (int s = 0; s < stages; ++s) {
      for (int t = s + 1; t < stages; ++t) {
        if (placements[s] == placements[t] && v == 1) {
          throw UsageError("pipeline: stages " + std::to_string(s) + " and " + std::to_string(t) +
                           " are both placed on " + placements[s].describe() + ", but the " +
                           schedule_kind_name(o.schedule) +
                           " schedule runs one stage per worker (schedule \"interleaved\" runs "
                           "several)");
        }
      }
    }
    throw UsageError("pipeline: " + std::to_string(stages) + " stages on " + std::to_string(p) +
                     " placements, but the " + schedule_kind_name(o.schedule) + " schedule runs " +
                     std::to_string(v) +
                     " stages on each worker");
  }

  if (o.custom_schedule) {
    state.schedule = *o.custom_schedule;
    if (state.schedule.workers != p || state.schedule.stages != stages ||
        state.schedule.micro_batches != o.micro_batches) {
      throw UsageError("pipeline: the custom schedule has " +
                       std::to_string(state.schedule.workers) + " workers, " +
                       std::to_string(state.schedule.stages) + " stages and " +
                       std::to_string(state.schedule.micro_batches) +
                       " micro-batches; the pipeline has " + std::to_string(p) + ", " +
                       std::to_string(stages) + " and " + std::to_string(o.micro_batches));
    }
  } else {
    state.schedule = make_schedule(kind, p, v, o.micro_batches);
  }
  validate(state.schedule);
  // The schedule decides which stages share a worker; the placements must agree.
  for (int s = 0; s < stages && !placements.empty(); ++s) {
    const int w = state.schedule.worker_of(s);
    if (placements[s].ranks() != groups[w]) {
      int first = 0;
      while (state.schedule.worker_of(first) != w) ++first;
      throw UsageError("pipeline: the " + state.schedule.name + " schedule runs stage " +
                       std::to_string(s) + " on the worker of stage " + std::to_string(first) +
                       ", placed on " + placements[first].describe() + ", but stage " +
                       std::to_string(s) + " is placed on " + placements[s].describe());
    }
  }
  state.ranks = groups;
  state.replicas = static_cast<int>(groups.front().size());
  const int my_rank = shoal::rank();
  for (int w = 0; w < p; ++w) {
    for (int j = 0; j < state.replicas; ++j) {
      if (groups[w][j] == my_rank) {
        state.me = w;
        state.replica = j;
      }
    }
  }
  const int64_t tags = int64_t{kChannels} * stages * o.micro_batches;
  if (kTagBase + tags > kTagLimit) {
    throw UsageError("pipeline: " + std::to_string(stages) + " stages x " +
                     std::to_string(o.micro_batches) +
                     " micro-batches need more transfer tags "
                     "than the pipeline has (" +
                     std::to_string(kTagLimit - kTagBase) + ")");
  }
}

// Global layers (global::nn::Module) sit on the placement of their global parameters. Returns
// each layer's placement (a layer without parameters takes its neighbour's), or nothing for a
// model of plain layers. UsageError for a mix, or a layer whose parameters lie on several.
std::vector<global::Placement> placements_of_layers(torch::nn::Sequential& net) {
  const int n = static_cast<int>(net->size());
  std::vector<std::optional<global::Placement>> found(n);
  bool any_global = false;
  int plain_with_parameters = -1;
  for (int l = 0; l < n; ++l) {
    auto module = std::dynamic_pointer_cast<global::nn::Module>(net->ptr(l));
    if (!module) {
      if (!net->ptr(l)->parameters().empty()) plain_with_parameters = l;
      continue;
    }
    any_global = true;
    for (const auto& [name, parameter] : module->named_global_parameters()) {
      if (!found[l]) {
        found[l] = parameter.placement();
      } else if (*found[l] != parameter.placement()) {
        throw UsageError("pipeline: layer " + std::to_string(l) + " has parameters on " +
                         found[l]->describe() + " and on " + parameter.placement().describe() +
                         " ('" + name + "'); a stage's layers sit on one placement");
      }
    }
  }
  if (!any_global) return {};
  if (plain_with_parameters >= 0) {
    throw UsageError("pipeline: layer " + std::to_string(plain_with_parameters) +
                     " is a plain torch module with parameters among global layers; its "
                     "parameters need a placement (build it from shoal::global::nn layers)");
  }
  for (int l = 1; l < n; ++l) {
    if (!found[l]) found[l] = found[l - 1];
  }
  for (int l = n - 2; l >= 0; --l) {
    if (!found[l]) found[l] = found[l + 1];
  }
  if (!found[0]) throw UsageError("pipeline: none of the global layers has a parameter");
  std::vector<global::Placement> placements;
  for (const auto& p : found) placements.push_back(*p);
  return placements;
}

// The stages of global layers: each run of layers on one placement. A split the user gave must
// agree.
std::vector<int> global_split(const PipelineOptions& o,
                              const std::vector<global::Placement>& layer_placements) {
  if (!o.placements.empty()) {
    throw UsageError(
        "pipeline: options.placements is for plain layers; global layers are placed by their "
        "parameters (build each stage's layers on its placement)");
  }
  std::vector<int> split;
  for (size_t l = 0; l < layer_placements.size(); ++l) {
    if (l == 0 || layer_placements[l] != layer_placements[l - 1]) {
      split.push_back(1);
    } else {
      ++split.back();
    }
  }
  if (!o.split.empty() && o.split != split) {
    throw UsageError("pipeline: split " + join(o.split) +
                     " does not match the layers' placements, " + "which make the stages " +
                     join(split));
  }
  return split;
}

// options.batch, checked against the stages' mesh: split(0) or broadcast per axis.
std::vector<global::Sbp> batch_layout(const std::vector<global::Sbp>& batch,
                                      const global::Placement& placement) {
  if (batch.empty()) return std::vector<global::Sbp>(placement.ndim(), global::broadcast());
  const global::NdSbp given(batch);
  if (given.size() != placement.ndim()) {
    throw UsageError("pipeline: options.batch " + given.describe() + " has " +
                     std::to_string(given.size()) + " axes; the stages' placement " +
                     placement.describe() + " has " + std::to_string(placement.ndim()));
  }
  for (const auto& sbp : batch) {
    if (!(sbp.is_broadcast() || (sbp.is_split() && sbp.dim() == 0))) {
      throw UsageError("pipeline: options.batch " + given.describe() +
                       ": expected split(0) (a data axis) or broadcast on each axis");
    }
  }
  return batch;
}

// Global layers: this worker keeps its stages' layers; each parameter's gradient is summed over
// the workers holding the same piece (the data axes' members, and the tensor axes' for a
// broadcast weight), as GradientSync sums it, but once per step.
void keep_global_layers(Pipeline::State& state, torch::nn::Sequential& net) {
  const int stages = state.stages();
  state.layers.resize(stages);
  std::map<std::vector<int>, std::vector<torch::Tensor>> by_holders;
  std::set<const void*> seen;
  int layer_index = 0;
  for (int s = 0; s < stages; ++s) {
    for (int i = 0; i < state.split[s]; ++i, ++layer_index) {
      if (state.schedule.worker_of(s) != state.me) continue;
      state.layers[s].push_back(*(net->begin() + layer_index));
      auto module = std::dynamic_pointer_cast<global::nn::Module>(net->ptr(layer_index));
      if (!module) continue;
      for (const auto& named : module->named_global_parameters()) {
        const global::GlobalTensor& parameter = named.second;
        if (!seen.insert(parameter.to_local().unsafeGetTensorImpl()).second) continue;
        if (!parameter.requires_grad()) continue;
        state.parameters.push_back(parameter.to_local());
        const auto holders = global::nn::piece_holders(parameter);
        if (holders.size() > 1) by_holders[holders].push_back(parameter.to_local());
      }
    }
  }
  // In sorted order (std::map's), so that workers sharing two sets make their groups alike.
  for (auto& [holders, parameters] : by_holders) state.holders.emplace_back(holders, parameters);
  if (state.options.zero_stage == 0) return;
  // ZeRO: the same sets, each piece cut over its holders; the optimizer takes the slices.
  std::vector<global::detail::DataAxisZero::Set> sets;
  for (const auto& [holders, parameters] : state.holders) sets.push_back({holders, parameters});
  state.zero = std::make_unique<global::detail::DataAxisZero>(
      *net, std::move(sets), state.options.zero_stage, state.options.unit_bytes,
      state.options.max_units);
  for (auto& p : state.parameters) p = state.zero->optimizer_tensor(p);
}

}  // namespace

int64_t Pipeline::State::rows_per_micro_batch() const {
  if (!global) return replicas;
  const global::Placement& placement = stage_placements.front();
  int64_t rows = 1;
  for (int a = 0; a < placement.ndim(); ++a) {
    if (batch[a].is_split()) rows *= placement.shape()[a];
  }
  return rows;
}

Pipeline::Pipeline(torch::nn::Sequential net, PipelineOptions options)
    : state_(std::make_unique<State>()) {
  if (!shoal::is_initialized()) throw UsageError("pipeline: call shoal::init() first");
  State& state = *state_;
  state.options = std::move(options);
  state.world_size = shoal::world_size();
  if (state.options.zero_stage < 0 || state.options.zero_stage > 3) {
    throw UsageError("pipeline: zero_stage must be 0, 1, 2 or 3, got " +
                     std::to_string(state.options.zero_stage));
  }
  if (state.options.zero_stage > 0 &&
      (state.options.unit_bytes < 1 || state.options.max_units < 1)) {
    throw UsageError("pipeline: unit_bytes and max_units must be positive, got " +
                     std::to_string(state.options.unit_bytes) + " and " +
                     std::to_string(state.options.max_units));
  }
  const int layer_count = static_cast<int>(net->size());
  const std::vector<global::Placement> layer_placements = placements_of_layers(net);
  state.global = !layer_placements.empty();
  if (state.global) {
    state.options.split = global_split(state.options, layer_placements);
    for (size_t l = 0, s = 0; s < state.options.split.size(); l += state.options.split[s++])
      state.stage_placements.push_back(layer_placements[l]);
    place_stages(state, state.stage_placements);
    state.batch = batch_layout(state.options.batch, state.stage_placements.front());
  } else {
    if (state.options.zero_stage > 0) {
      throw UsageError(
          "pipeline: zero_stage shards global layers' pieces over their data axes, but this "
          "model's layers are plain torch modules; expected zero_stage 0");
    }
    if (!state.options.batch.empty()) {
      throw UsageError(
          "pipeline: options.batch lays out the micro-batches of global layers, but this "
          "model's layers are plain torch modules");
    }
    place_stages(state, state.options.placements);
  }
  const int stages = state.stages();

  if (state.options.split.empty()) {
    std::vector<int64_t> weights;
    for (const auto& layer : *net) weights.push_back(parameter_count(*layer.ptr()));
    state.split = balanced_split(weights, stages);
  } else {
    state.split = state.options.split;
    int total = 0;
    for (int s = 0; s < stages; ++s) {
      if (state.split[s] < 1) {
        throw UsageError("pipeline: split " + join(state.split) + " gives stage " +
                         std::to_string(s) + " no layer; every stage needs at least one");
      }
      total += state.split[s];
    }
    if (total != layer_count) {
      throw UsageError("pipeline: split " + join(state.split) + " has " + std::to_string(total) +
                       " layers; the model has " + std::to_string(layer_count));
    }
  }

  if (state.global) {
    keep_global_layers(state, net);
    return;
  }
  // Keep this worker's layers; find the weights that stages on different workers share.
  state.layers.resize(stages);
  std::vector<int> stage_of_layer;
  for (int s = 0; s < stages; ++s) stage_of_layer.insert(stage_of_layer.end(), state.split[s], s);
  std::unordered_map<const void*, std::set<int>> workers_of;  // parameter -> workers using it
  std::vector<torch::Tensor> in_order;                        // every parameter, first use first
  int layer_index = 0;
  for (const auto& layer : *net) {
    const int s = stage_of_layer[layer_index++];
    if (state.schedule.worker_of(s) == state.me) state.layers[s].push_back(layer);
    for (const auto& p : layer.ptr()->parameters()) {
      auto& used = workers_of[p.unsafeGetTensorImpl()];
      if (used.empty()) in_order.push_back(p);
      used.insert(state.schedule.worker_of(s));
    }
  }
  for (const auto& p : in_order) {
    const auto& used = workers_of[p.unsafeGetTensorImpl()];
    const bool mine = used.count(state.me) > 0;
    if (mine) state.parameters.push_back(p);
    if (used.size() > 1) {
      // Every worker takes part in the tied weights' sum, with zeros for those it doesn't hold.
      state.tied.push_back(
          mine ? p
               : torch::empty(p.sizes(),
                              torch::TensorOptions().dtype(p.scalar_type()).device(torch::kMeta)));
    } else if (mine) {
      state.replicated.push_back(p);
    }
  }
  state.whole = detail::make_whole_model(net, state, stage_of_layer);
}

Pipeline::~Pipeline() = default;

std::vector<torch::Tensor> Pipeline::parameters() const {
  return state_->parameters;
}
const std::vector<int>& Pipeline::split() const {
  return state_->split;
}
int Pipeline::stages() const {
  return state_->stages();
}
global::Placement Pipeline::placement(int stage) const {
  if (stage < 0 || stage >= stages()) {
    throw UsageError("pipeline: stage " + std::to_string(stage) + " is not one of the " +
                     std::to_string(stages()) + " stages");
  }
  if (state_->global) return state_->stage_placements[stage];
  return global::Placement(state_->ranks[state_->schedule.worker_of(stage)]);
}
bool Pipeline::is_global() const {
  return state_->global;
}
const std::vector<StageStepStats>& Pipeline::last_step_stats() const {
  return state_->last_stats;
}

const Schedule& Pipeline::schedule() const {
  return state_->schedule;
}
std::vector<int> Pipeline::local_stages() const {
  std::vector<int> mine;
  for (int s = 0; s < stages(); ++s) {
    if (state_->schedule.worker_of(s) == state_->me) mine.push_back(s);
  }
  return mine;
}

}  // namespace shoal::pipeline
