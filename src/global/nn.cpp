// Layers with global parameters and their gradient synchronization. See docs/global.md,
// "Layers and gradient synchronization".
#include "shoal/global/nn.h"

#include <cmath>
#include <map>
#include <set>

#include "dp/gatherer.h"
#include "dp/reducer.h"
#include "dp/shards.h"
#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"
#include "zero.h"

namespace shoal::global::nn {

std::vector<std::pair<std::string, GlobalTensor>> Module::named_global_parameters() {
  std::vector<std::pair<std::string, GlobalTensor>> all;
  for (const auto& item : named_modules()) {
    auto* module = dynamic_cast<Module*>(item.value().get());
    if (module == nullptr) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& [name, value] : module->globals_) all.emplace_back(prefix + name, value);
  }
  return all;
}

namespace {

// The piece of a global parameter as its layout holds it: gathered and cut along its placement
// and SBP; a partial_sum one is refused.
checkpoint::Piece layout_piece(const GlobalTensor& value) {
  checkpoint::Piece piece;
  piece.local = value.to_local();
  piece.held_here = value.is_local();
  piece.shape = value.shape();
  piece.holders = static_cast<int>(value.placement().size());
  piece.first_holder = value.placement().ranks().front() == shoal::rank();
  const GlobalTensor layout = value;
  piece.gather = [layout](const at::Tensor& like_local) {
    torch::NoGradGuard no_grad;
    const at::Tensor local = layout.is_local() ? like_local.detach() : layout.to_local().detach();
    at::Tensor whole = GlobalTensor(local, layout.placement(), layout.sbp(), layout.shape()).full();
    return shoal::rank() == 0 ? whole : at::Tensor();
  };
  piece.cut = [layout](const at::Tensor& whole) {
    if (!layout.is_local()) return at::Tensor();
    torch::NoGradGuard no_grad;
    return GlobalTensor::from_full(whole.detach(), layout.placement(), layout.sbp())
        .to_local()
        .contiguous()
        .clone();
  };
  const auto& sbp = value.sbp();
  for (int axis = 0; axis < static_cast<int>(sbp.axes().size()); ++axis) {
    if (sbp[axis].is_partial_sum()) {
      piece.refusal = "is " + value.describe() + ", partial_sum on mesh axis " +
                      std::to_string(axis) +
                      "; expected split or broadcast on every axis (a saved value is whole)";
      break;
    }
  }
  return piece;
}

}  // namespace

std::vector<std::pair<std::string, checkpoint::Piece>> Module::pieces() const {
  std::vector<std::pair<std::string, checkpoint::Piece>> pieces;
  for (const auto& [name, value] : globals_) {
    checkpoint::Piece piece = layout_piece(value);
    // Under a GradientSync's ZeRO the optimizer holds a slice of the piece (Note [Saving a
    // sharded global model]).
    const auto sliced = sliced_.find(value.to_local().unsafeGetTensorImpl());
    if (sliced != sliced_.end()) piece = sliced->second(std::move(piece));
    pieces.emplace_back(name, std::move(piece));
  }
  return pieces;
}

GlobalTensor Module::register_global_parameter(const std::string& name, const GlobalTensor& value) {
  // A leaf of its own: the piece of the whole value, or the placeholder outside the placement.
  GlobalTensor parameter(value.to_local().detach(), value.placement(), value.sbp(), value.shape());
  parameter.requires_grad_();
  register_parameter(name, parameter.to_local());
  globals_.emplace_back(name, parameter);
  return parameter;
}

namespace {

NdSbp per_axis(const Layout& layout, const Sbp& tensor) {
  std::vector<Sbp> axes(static_cast<size_t>(layout.placement.ndim()), broadcast());
  for (int a : layout.tensor_axes) {
    if (a < 0 || a >= layout.placement.ndim()) {
      throw UsageError("Layout: tensor axis " + std::to_string(a) +
                       " is not an axis of placement " + layout.placement.describe());
    }
    axes[static_cast<size_t>(a)] = tensor;
  }
  return NdSbp(axes);
}

// The whole value, drawn as torch::nn::Linear draws it, on every worker.
torch::Tensor uniform(std::vector<int64_t> shape, double bound) {
  return torch::empty(shape).uniform_(-bound, bound);
}

}  // namespace

NdSbp Layout::replicated() const {
  return per_axis(*this, broadcast());
}
NdSbp Layout::column() const {
  return per_axis(*this, split(0));
}
NdSbp Layout::row() const {
  return per_axis(*this, split(1));
}

LinearImpl::LinearImpl(int64_t in, int64_t out, const Placement& placement, const NdSbp& weight_sbp,
                       bool with_bias) {
  // torch::nn::Linear: kaiming_uniform_(a = sqrt(5)) is uniform in +-1/sqrt(in), and so is the
  // bias.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  weight = register_global_parameter(
      "weight", GlobalTensor::from_full(uniform({out, in}, bound), placement, weight_sbp));
  if (with_bias) {
    std::vector<Sbp> axes;
    for (const auto& s : weight_sbp.axes())
      axes.push_back(s.is_split() && s.dim() == 0 ? split(0) : broadcast());
    bias = register_global_parameter(
        "bias", GlobalTensor::from_full(uniform({out}, bound), placement, NdSbp(axes)));
  }
}

GlobalTensor LinearImpl::forward(const GlobalTensor& x) {
  return linear(x, weight, bias);
}

EmbeddingImpl::EmbeddingImpl(int64_t count, int64_t dim, const Placement& placement,
                             const NdSbp& weight_sbp) {
  weight = register_global_parameter(
      "weight", GlobalTensor::from_full(torch::randn({count, dim}), placement, weight_sbp));
}

GlobalTensor EmbeddingImpl::forward(const GlobalTensor& indices) {
  return embedding(indices, weight);
}

LayerNormImpl::LayerNormImpl(int64_t dim, const Placement& placement, double eps) : eps(eps) {
  const NdSbp whole(std::vector<Sbp>(static_cast<size_t>(placement.ndim()), broadcast()));
  weight = register_global_parameter("weight",
                                     GlobalTensor::from_full(torch::ones({dim}), placement, whole));
  bias = register_global_parameter("bias",
                                   GlobalTensor::from_full(torch::zeros({dim}), placement, whole));
}

GlobalTensor LayerNormImpl::forward(const GlobalTensor& x) {
  return layer_norm(x, {x.shape().back()}, weight, bias, eps);
}

std::vector<int> piece_holders(const GlobalTensor& parameter) {
  const Placement& placement = parameter.placement();
  const auto mine = placement.coordinate(detail::my_rank());
  std::vector<int> ranks;
  for (int r : placement.ranks()) {
    const auto theirs = placement.coordinate(r);
    bool same = true;
    for (int a = 0; a < placement.ndim(); ++a)
      same = same && (parameter.sbp()[a].is_broadcast() || theirs[a] == mine[a]);
    if (same) ranks.push_back(r);
  }
  return ranks;
}

GradientSync::~GradientSync() = default;
GradientSync::GradientSync(GradientSync&&) noexcept = default;
GradientSync& GradientSync::operator=(GradientSync&&) noexcept = default;

GradientSync::GradientSync(const std::shared_ptr<Module>& module, GradientSyncOptions options) {
  SHOAL_CHECK(module != nullptr) << "GradientSync of a null module";
  if (options.zero_stage < 0 || options.zero_stage > 3) {
    throw UsageError("GradientSync: zero_stage must be 0, 1, 2 or 3, got " +
                     std::to_string(options.zero_stage));
  }
  if (options.zero_stage > 0 && (options.unit_bytes < 1 || options.max_units < 1)) {
    throw UsageError("GradientSync: unit_bytes and max_units must be positive, got " +
                     std::to_string(options.unit_bytes) + " and " +
                     std::to_string(options.max_units));
  }
  std::set<const c10::TensorImpl*> global;
  // Parameters by the workers their gradients are summed over, in registration order.
  std::map<std::vector<int>, std::vector<at::Tensor>> by_group;
  std::vector<std::vector<int>> order;
  for (const auto& [name, parameter] : module->named_global_parameters()) {
    global.insert(parameter.to_local().unsafeGetTensorImpl());
    if (!parameter.is_local() || !parameter.requires_grad()) continue;
    // The workers holding the same piece hold shares of its gradient.
    const std::vector<int> ranks = piece_holders(parameter);
    if (ranks.size() < 2) continue;
    if (by_group.count(ranks) == 0) order.push_back(ranks);
    by_group[ranks].push_back(parameter.to_local());
  }
  for (const auto& item : module->named_parameters()) {
    if (global.count(item.value().unsafeGetTensorImpl()) == 0) {
      throw UsageError(
          "GradientSync: parameter '" + item.key() +
          "' is a plain tensor; register it with "
          "register_global_parameter so that its layout says how its gradient is shared");
    }
  }
  dp::ReducerOptions reducer;
  static_cast<BucketOptions&>(reducer) = options;
  if (options.zero_stage == 0) {
    reducer.hook = [](comm::Group& group, at::Tensor& bucket) {
      return group.all_reduce_async(bucket);
    };  // a sum
  } else {
    reducer.average = false;  // a global loss is the whole batch's mean already
  }
  std::vector<global::detail::DataAxisZero::Set> sets;
  for (const auto& ranks : order) {
    groups_.push_back(ranks);
    if (options.zero_stage == 0) {
      reducers_.push_back(
          std::make_unique<dp::Reducer>(by_group[ranks], detail::group_of(ranks), reducer));
    } else {
      sets.push_back({ranks, by_group[ranks]});
    }
  }
  if (!sets.empty()) {
    // ZeRO over the workers holding the same pieces: the data axes of these parameters.
    zero_ = std::make_unique<global::detail::DataAxisZero>(
        *module, std::move(sets), options.zero_stage, options.unit_bytes, options.max_units);
    zero_->start();
    for (size_t set = 0; set < zero_->sets(); ++set) {
      dp::ReducerOptions sharded = reducer;
      sharded.shards = zero_->shards(set);
      auto sum =
          std::make_unique<dp::Reducer>(by_group[zero_->ranks(set)], zero_->group(set), sharded);
      // The optimizer's step comes next and changes the slices.
      global::detail::DataAxisZero* zero = zero_.get();
      sum->set_after_backward([zero, set] { zero->slices_changed(set); });
      reducers_.push_back(std::move(sum));
    }
  }
  // Each tensor once, a shared piece replaced by this worker's slice of it.
  std::set<const c10::TensorImpl*> listed;
  for (const auto& p : module->parameters()) {
    if (listed.insert(p.unsafeGetTensorImpl()).second)
      parameters_.push_back(zero_ ? zero_->optimizer_tensor(p) : p);
  }
}

void GradientSync::gather_parameters() {
  if (zero_) zero_->gather_all();
}

std::vector<std::vector<int>> GradientSync::groups() const {
  return groups_;
}

}  // namespace shoal::global::nn

namespace shoal::global::detail {

// ----- ZeRO on the data axes (src/global/zero.h) -----

struct DataAxisZero::State {
  struct PerSet {
    std::vector<int> ranks;
    std::shared_ptr<dp::Shards> shards;
    std::vector<std::vector<size_t>> units;
    std::shared_ptr<dp::Gatherer> gatherer;  // once started
  };
  std::vector<PerSet> sets;
  int stage = 0;
  int max_units = 2;
  bool started = false;
};

namespace {

// Note [Saving a sharded global model]
// A checkpoint holds whole values, whatever the plan (docs/checkpoint.md). Under ZeRO a worker's
// optimizer holds a slice of its piece of each shared parameter, so the piece the checkpoint sees
// is the layout's piece seen through the slice: gathering a value laid out as the slice (the
// parameter's or a moment's) first all-gathers the slices of the workers holding that piece,
// then gathers the pieces along the layout; cutting a whole value cuts the layout's piece, then
// this worker's slice of it. After a load the pieces are gathered anew when next read. So a
// checkpoint saved under ZeRO loads into any plan at any stage, and the other way round.
checkpoint::Piece through_slice(checkpoint::Piece piece,
                                const std::weak_ptr<DataAxisZero::State>& weak, size_t set,
                                size_t k) {
  auto state = weak.lock();
  if (!state) return piece;
  const auto shards = state->sets[set].shards;
  const std::vector<int> ranks = state->sets[set].ranks;
  const std::vector<int64_t> piece_shape = piece.local.sizes().vec();
  piece.slice = shards->slice(k);
  auto whole_of_piece = std::move(piece.gather);
  piece.gather = [shards, ranks, k, piece_shape, whole_of_piece](const at::Tensor& like) {
    torch::NoGradGuard no_grad;
    comm::AllGatherOptions options;
    for (int r = 0; r < shards->size(); ++r) options.sizes.push_back(shards->length(k, r));
    const at::Tensor piece_value = group_of(ranks).all_gather(like.detach().reshape(-1), options);
    return whole_of_piece(piece_value.view(piece_shape));
  };
  auto piece_of_whole = std::move(piece.cut);
  piece.cut = [shards, k, piece_of_whole](const at::Tensor& whole) {
    const at::Tensor mine = piece_of_whole(whole);
    if (!mine.defined()) return mine;
    const int rank = shards->rank();
    return mine.reshape(-1).narrow(0, shards->start(k, rank), shards->length(k, rank)).clone();
  };
  piece.loaded = [weak, set] {
    auto state = weak.lock();
    if (state && state->sets[set].gatherer) state->sets[set].gatherer->release_all();
  };
  return piece;
}

}  // namespace

DataAxisZero::DataAxisZero(torch::nn::Module& root, std::vector<Set> sets, int stage,
                           int64_t unit_bytes, int max_units)
    : state_(std::make_shared<State>()) {
  state_->stage = stage;
  state_->max_units = max_units;
  const int me = my_rank();
  for (auto& set : sets) {
    State::PerSet per;
    const int rank =
        static_cast<int>(std::find(set.ranks.begin(), set.ranks.end(), me) - set.ranks.begin());
    per.shards =
        std::make_shared<dp::Shards>(set.pieces, rank, static_cast<int>(set.ranks.size()), stage);
    per.units = dp::module_units(root, *per.shards, unit_bytes);
    per.ranks = std::move(set.ranks);
    state_->sets.push_back(std::move(per));
  }
  // The global layers' pieces, seen through the slices by checkpoints.
  const std::weak_ptr<State> weak = state_;
  for (const auto& item : root.named_modules()) {
    auto* module = dynamic_cast<nn::Module*>(item.value().get());
    if (module == nullptr) continue;
    for (const auto& named : module->globals_) {
      const at::Tensor& local = named.second.to_local();
      for (size_t set = 0; set < state_->sets.size(); ++set) {
        const auto k = state_->sets[set].shards->index_of(local);
        if (!k) continue;
        module->sliced_[local.unsafeGetTensorImpl()] = [weak, set,
                                                        k = *k](checkpoint::Piece piece) {
          return through_slice(std::move(piece), weak, set, k);
        };
      }
    }
  }
}

DataAxisZero::~DataAxisZero() = default;

size_t DataAxisZero::sets() const {
  return state_->sets.size();
}
const std::vector<int>& DataAxisZero::ranks(size_t set) const {
  return state_->sets[set].ranks;
}
comm::Group& DataAxisZero::group(size_t set) const {
  return group_of(state_->sets[set].ranks);
}
const std::shared_ptr<dp::Shards>& DataAxisZero::shards(size_t set) const {
  return state_->sets[set].shards;
}

at::Tensor DataAxisZero::optimizer_tensor(const at::Tensor& parameter) const {
  for (const auto& set : state_->sets) {
    if (const auto k = set.shards->index_of(parameter)) return set.shards->slice(*k);
  }
  return parameter;
}

void DataAxisZero::start() {
  if (state_->started) return;
  state_->started = true;
  const bool stage3 = state_->stage == 3;
  for (auto& set : state_->sets) {
    set.gatherer = std::make_shared<dp::Gatherer>(set.shards, group_of(set.ranks), set.units,
                                                  state_->max_units, /*keep_memory=*/!stage3);
    set.gatherer->observe_this_thread();
    // The slices may hold values the pieces do not (a load before the start): gathered when read.
    if (!stage3) set.gatherer->release_all();
  }
}

bool DataAxisZero::started() const {
  return state_->started;
}

void DataAxisZero::slices_changed(size_t set) {
  auto& gatherer = state_->sets[set].gatherer;
  if (!gatherer) return;
  gatherer->release_all();
  gatherer->rethrow();
}

void DataAxisZero::gather_all() {
  for (auto& set : state_->sets) {
    if (!set.gatherer) continue;
    set.gatherer->gather_all();
    set.gatherer->rethrow();
  }
}

}  // namespace shoal::global::detail
