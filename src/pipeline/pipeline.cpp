#include "shoal/pipeline/pipeline.h"

#include <algorithm>
#include <limits>
#include <set>
#include <unordered_map>

#include "pipeline_state.h"
#include "shoal/core/error.h"
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
void place_stages(Pipeline::State& state) {
  const PipelineOptions& o = state.options;
  if (o.micro_batches < 1) {
    throw UsageError("pipeline: expected micro_batches >= 1, got " +
                     std::to_string(o.micro_batches));
  }
  const ScheduleKind kind = parse_schedule_kind(o.schedule);
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
    throw UsageError("pipeline: the " + o.schedule +
                     " schedule runs one stage per worker; "
                     "stages_per_worker = " +
                     std::to_string(v) + " needs schedule \"interleaved\"");
  }

  // The stages' placements; each distinct one is a worker of the schedule (a line of d
  // replicas), numbered in order of first use.
  const auto& placements = o.placements;
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
    if (placement.ndim() != 1) {
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
      if (!groups.empty() && groups.front().size() != placement.ranks().size()) {
        throw UsageError("pipeline: stage " + std::to_string(s) + "'s placement " +
                         placement.describe() + " has " + std::to_string(placement.size()) +
                         " workers, stage 0's " + std::to_string(groups.front().size()) +
                         "; every stage needs as many replicas");
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
                           o.schedule +
                           " schedule runs one stage per worker (schedule \"interleaved\" runs "
                           "several)");
        }
      }
    }
    throw UsageError("pipeline: " + std::to_string(stages) + " stages on " + std::to_string(p) +
                     " placements, but the " + o.schedule + " schedule runs " + std::to_string(v) +
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

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential net, PipelineOptions options)
    : state_(std::make_unique<State>()) {
  if (!shoal::is_initialized()) throw UsageError("pipeline: call shoal::init() first");
  State& state = *state_;
  state.options = std::move(options);
  state.world_size = shoal::world_size();
  const int layer_count = static_cast<int>(net->size());
  place_stages(state);
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
      state.tied.push_back(mine ? p : torch::Tensor());
      state.tied_numel.push_back(p.numel());
    } else if (mine) {
      state.replicated.push_back(p);
      state.replicated_numel.push_back(p.numel());
    }
  }
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
  return global::Placement(state_->ranks[state_->schedule.worker_of(stage)]);
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
