#include "shoal/dp/data_parallel.h"

#include <map>
#include <set>
#include <sstream>

#include <ATen/core/grad_mode.h>

#include <torch/csrc/autograd/variable.h>

#include "dp/autocast.h"
#include "dp/replicator.h"
#include "runtime/world.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal::dp {
namespace {

struct Entry {
  std::string kind;  // "parameter" or "buffer"
  std::string name;
  std::string shape;
  std::string dtype;
};

std::vector<Entry> describe(const torch::nn::Module& module) {
  std::vector<Entry> entries;
  auto add = [&](const char* kind, const std::string& name, const at::Tensor& t) {
    std::ostringstream shape;
    shape << t.sizes();
    entries.push_back({kind, name, shape.str(), std::string(c10::toString(t.scalar_type()))});
  };
  for (const auto& item : module.named_parameters()) add("parameter", item.key(), item.value());
  for (const auto& item : module.named_buffers()) add("buffer", item.key(), item.value());
  return entries;
}

std::string encode(const std::vector<Entry>& entries) {
  std::string text;
  for (const auto& e : entries) text += e.kind + '\t' + e.name + '\t' + e.shape + '\t' + e.dtype + '\n';
  return text;
}

std::vector<Entry> decode(const std::string& text) {
  std::vector<Entry> entries;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    Entry e;
    std::istringstream fields(line);
    std::getline(fields, e.kind, '\t');
    std::getline(fields, e.name, '\t');
    std::getline(fields, e.shape, '\t');
    std::getline(fields, e.dtype, '\t');
    entries.push_back(e);
  }
  return entries;
}

// Every worker's description of its model, through two all-gathers (lengths, then bytes).
std::vector<std::string> gather_descriptions(comm::Group& group, const std::string& mine) {
  auto length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  auto lengths = group.all_gather(length);
  comm::AllGatherOptions options;
  for (int i = 0; i < group.size(); ++i) options.sizes.push_back(lengths[i].item<int64_t>());
  auto bytes = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  auto all = group.all_gather(bytes, options);
  std::vector<std::string> descriptions;
  int64_t offset = 0;
  for (int i = 0; i < group.size(); ++i) {
    descriptions.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + offset, options.sizes[i]);
    offset += options.sizes[i];
  }
  return descriptions;
}

// The first difference between worker 0's model and another's, or "" when all agree. Every
// worker computes the same answer from the same descriptions, so all raise together.
std::string first_difference(const std::vector<std::string>& descriptions, const std::vector<int>& members) {
  const auto reference = decode(descriptions[0]);
  for (size_t w = 1; w < descriptions.size(); ++w) {
    if (descriptions[w] == descriptions[0]) continue;
    const auto other = decode(descriptions[w]);
    const std::string a = "worker " + std::to_string(members[0]);
    const std::string b = "worker " + std::to_string(members[w]);
    for (size_t i = 0; i < std::max(reference.size(), other.size()); ++i) {
      if (i >= reference.size()) return b + " has " + other[i].kind + " '" + other[i].name + "' that " + a + " lacks";
      if (i >= other.size()) return a + " has " + reference[i].kind + " '" + reference[i].name + "' that " + b + " lacks";
      const auto& x = reference[i];
      const auto& y = other[i];
      if (x.kind != y.kind || x.name != y.name) {
        return x.kind + " " + std::to_string(i) + " is '" + x.name + "' on " + a + " but " + y.kind + " '" + y.name +
               "' on " + b;
      }
      if (x.shape != y.shape || x.dtype != y.dtype) {
        return x.kind + " '" + x.name + "' has shape " + x.shape + " (" + x.dtype + ") on " + a + " but " + y.shape +
               " (" + y.dtype + ") on " + b;
      }
    }
  }
  return "";
}

std::string dtype_name(at::ScalarType dtype) {
  return c10::toString(dtype);
}

void check_precision(const DataParallelOptions& options) {
  const MixedPrecision& policy = options.mixed_precision;
  if (policy.compute == at::kHalf) {
    throw UsageError(
        "DataParallel: mixed_precision.compute is Half, and LibTorch's CPU autocast computes in "
        "BFloat16 only; expected at::kBFloat16 or at::kFloat");
  }
  if (policy.compute != at::kFloat && policy.compute != at::kBFloat16) {
    throw UsageError("DataParallel: mixed_precision.compute is " + dtype_name(policy.compute) +
                     "; expected at::kBFloat16 or at::kFloat");
  }
  if (policy.reduce != at::kFloat && policy.reduce != at::kBFloat16 && policy.reduce != at::kHalf) {
    throw UsageError("DataParallel: mixed_precision.reduce is " + dtype_name(policy.reduce) +
                     "; expected at::kFloat, at::kBFloat16 or at::kHalf");
  }
  if (policy.reduce != at::kFloat && options.comm_hook) {
    throw UsageError("DataParallel: mixed_precision.reduce is " + dtype_name(policy.reduce) +
                     " and a comm_hook is given, which decides the dtype itself; expected one "
                     "of the two");
  }
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> unique;
  std::set<const void*> seen;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) unique.push_back(p);
  }
  return unique;
}

// One broadcast per dtype rather than one per tensor.
void broadcast_from_first(comm::Group& group, const std::vector<at::Tensor>& tensors) {
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  torch::NoGradGuard no_grad;
  for (auto& [dtype, group_tensors] : by_dtype) {
    std::vector<at::Tensor> flat;
    for (auto& t : group_tensors) flat.push_back(t.reshape(-1));
    auto buffer = at::cat(flat);
    group.broadcast(buffer, {0});
    int64_t offset = 0;
    for (auto& t : group_tensors) {
      t.copy_(buffer.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

}  // namespace

Replicator::Replicator(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options)
    : module_(std::move(module)), options_(std::move(options)) {
  if (!module_) throw UsageError("DataParallel: the module is null");
  replication_ = std::make_shared<Replication>(
      options_.measure_gradient_noise ? std::make_shared<NoiseMeter>(options_.gradient_noise_smoothing) : nullptr);
  if (options_.zero_stage < 0 || options_.zero_stage > 3) {
    throw UsageError("DataParallel: zero_stage must be 0, 1, 2 or 3, got " +
                     std::to_string(options_.zero_stage));
  }
  if (options_.zero_stage == 3 && (options_.unit_bytes < 1 || options_.max_units < 1)) {
    throw UsageError("DataParallel: unit_bytes and max_units must be positive, got " +
                     std::to_string(options_.unit_bytes) + " and " +
                     std::to_string(options_.max_units));
  }
  if (options_.zero_stage > 0 && options_.comm_hook) {
    throw UsageError("DataParallel: a comm_hook averages whole buckets, and zero_stage " +
                     std::to_string(options_.zero_stage) +
                     " reduce-scatters them; expected zero_stage 0 with a hook");
  }
  check_precision(options_);
  if (options_.batch_dim < 0) {
    throw UsageError("DataParallel: batch_dim must be 0 or more, got " + std::to_string(options_.batch_dim));
  }
  if (options_.group) {
    bind(*options_.group, true);
    return;
  }
  runtime::join_implicitly("DataParallel");  // a program may leave joining the job to it
  // An elastic job's members synchronize through elastic::State, which every member of a
  // round reaches together; a newcomer's constructor must not start a collective of its own.
  const bool elastic = shoal::job().elastic;
  // Note [Slices in an elastic job] (src/elastic/slices.cpp): elastic::State gives the slices
  // their values, and re-cuts them when the world changes.
  if (elastic && options_.zero_stage > 0) {
    slicing_ = std::make_shared<Slices>(*this);
    replication_->set_slicing(slicing_);
  }
  bind(shoal::world(), !elastic);
  world_listener_ = runtime::add_world_listener([this] { bind(shoal::world(), false); });
}

Replicator::~Replicator() {
  if (world_listener_ != 0) runtime::remove_world_listener(world_listener_);
}

void Replicator::bind(comm::Group group, bool synchronize) {
  // A broken group's operation may still complete late and write into its buckets; new ones
  // (a new Reducer), and gradients that no longer share the old buckets' storage, keep that
  // away from the gradients in use.
  if (reducer_) {
    reducer_.reset();
    for (auto& p : module_->parameters()) p.mutable_grad().reset();
  }
  group_ = std::move(group);
  // Each parameter once: LibTorch lists a tied weight under each of its names.
  std::vector<at::Tensor> trainable;
  for (auto& p : unique_parameters(*module_)) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  if (slicing_) {
    // The slices hold what they held, in the cut they held it, until elastic::State re-cuts them
    // for this world and calls Slices::filled().
    ready_ = false;
    gatherer_.reset();
    if (!shards_) {
      shards_ =
          std::make_shared<Shards>(trainable, group_.rank(), group_.size(), options_.zero_stage);
      mark_pieces();
    }
    return;
  }
  // A job of one: nothing to check, copy or average; the Reducer only measures the noise there,
  // and under ZeRO gives the slices their gradients.
  if (group_.size() == 1 && !options_.measure_gradient_noise && options_.zero_stage == 0) return;

  if (synchronize && group_.size() > 1) {
    const auto problem = first_difference(gather_descriptions(group_, encode(describe(*module_))), group_.members());
    if (!problem.empty()) {
      throw UsageError("DataParallel: the model differs across workers: " + problem +
                       "; expected the same parameters and buffers, in the same order, everywhere");
    }
    std::vector<at::Tensor> state = module_->parameters();
    for (auto& b : module_->buffers()) state.push_back(b);
    broadcast_from_first(group_, state);
  }
  // After the broadcast: at stage 3 the slices are copies.
  if (options_.zero_stage > 0 && !shards_) {
    shards_ =
        std::make_shared<Shards>(trainable, group_.rank(), group_.size(), options_.zero_stage);
    if (options_.zero_stage == 3) make_gatherer();
    mark_pieces();
  }
  make_reducer(std::move(trainable));
}

void Replicator::make_gatherer() {
  gatherer_ = std::make_shared<Gatherer>(
      shards_, group_, module_units(*module_, *shards_, options_.unit_bytes), options_.max_units);
  gatherer_->observe_this_thread();
}

void Replicator::make_reducer(std::vector<at::Tensor> trainable) {
  ReducerOptions reducer;
  static_cast<BucketOptions&>(reducer) = options_;
  reducer.find_unused_parameters = options_.find_unused_parameters;
  reducer.gradient_as_bucket_view = options_.gradient_as_bucket_view;
  reducer.hook = options_.comm_hook;
  // Mixed precision: 16-bit parts summed in float32 (shoal/dp/comm_hooks.h), over a whole bucket
  // or, under ZeRO, as its reduce-scatter.
  const at::ScalarType wire = options_.mixed_precision.reduce;
  if (wire != at::kFloat) {
    if (shards_) {
      reducer.wire = wire;
    } else {
      reducer.hook = wire == at::kHalf ? fp16_compress_hook() : bf16_compress_hook();
    }
  }
  reducer.weigh_by_batch_share = options_.weigh_by_batch_share;
  reducer.replication = replication_;
  reducer.shards = shards_;
  reducer_ = std::make_unique<Reducer>(std::move(trainable), group_, std::move(reducer));
  reducer_->set_sync(sync_);
  const bool buffers = options_.broadcast_buffers && !module_->buffers().empty();
  if (buffers || shards_) {
    reducer_->set_after_backward([this, buffers] {
      if (buffers) broadcast_buffers();
      if (shards_) slices_changed();  // the optimizer's step is about to change them
      if (gatherer_) gatherer_->rethrow();
    });
  }
}

// The slices were re-cut for group_ and hold the job's values (Slices::filled()).
void Replicator::slices_filled() {
  holds_values_ = true;
  ready_ = true;
  if (options_.zero_stage == 3) make_gatherer();
  make_reducer(shards_->params());
  slices_changed();
}

void Replicator::check_ready() const {
  if (slicing_ && !ready_) {
    throw UsageError("DataParallel: zero_stage " + std::to_string(options_.zero_stage) +
                     " in an elastic job takes its slices' values from elastic::State; expected "
                     "the model in an elastic::State, trained inside elastic::run");
  }
}

void Replicator::slices_changed() {
  if (gatherer_) {
    gatherer_->release_all();
  } else {
    gather_pending_ = true;
  }
}

torch::OrderedDict<std::string, at::Tensor> Replicator::named_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> named;
  std::set<const void*> seen;
  for (const auto& item : module_->named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const auto k = shards_ ? shards_->index_of(item.value()) : std::nullopt;
    named.insert(item.key(), k ? shards_->slice(*k) : item.value());
  }
  return named;
}

double Replicator::clip_grad_norm(double max_norm, double norm_type) {
  if (shards_) return shards_->clip_grad_norm(group_, max_norm, norm_type);
  // Replicated: every worker holds the whole average, so each computes the norm alone.
  std::vector<at::Tensor> gradients;
  for (const auto& p : unique_parameters(*module_)) {
    if (p.grad().defined()) gradients.push_back(p.grad());
  }
  return dp::clip_grad_norm(gradients, nullptr, max_norm, norm_type);
}

void Replicator::gather_parameters() {
  check_ready();
  if (gatherer_) {
    gatherer_->gather_all();
    gatherer_->rethrow();
    return;
  }
  if (!gather_pending_) return;
  gather_pending_ = false;
  shards_->gather(group_, options_.bucket_bytes);
}

void Replicator::broadcast_buffers() {
  if (group_.size() > 1) broadcast_from_first(group_, module_->buffers());
}

// See Note [Weighing gradients by batch share] (shoal/dp/data_parallel.h). Whether to count is
// decided by what every worker's program does alike (grad mode, the input's presence and rank),
// so that every member starts the count's all-reduce.
void Replicator::before_forward(const at::Tensor* input) {
  // Under ZeRO, every forward (an evaluation's too) needs the step's parameters: gathered now at
  // stages 1 and 2, as operations read them at stage 3.
  check_ready();
  if (gatherer_) {
    gatherer_->begin_forward();
  } else {
    gather_parameters();
  }
  const bool counts = options_.weigh_by_batch_share || options_.measure_gradient_noise;
  if (!reducer_ || !counts || input == nullptr || !at::GradMode::is_enabled()) return;
  if (!input->defined() || input->dim() <= options_.batch_dim) {
    throw UsageError("DataParallel: the forward's first tensor has " +
                     std::to_string(input->defined() ? input->dim() : 0) +
                     " dimensions; expected its samples along dimension " + std::to_string(options_.batch_dim) +
                     " (DataParallelOptions::batch_dim), or weigh_by_batch_share = false");
  }
  reducer_->count_batch(input->size(options_.batch_dim));
}

// Note [Saving a sharded model]
// A checkpoint holds what the same model on one process holds (docs/memory.md, "Checkpoints"):
// each trainable parameter's piece is this worker's slice, gathered whole on save (over the
// group, which must be the world, as shoal::save's whole values are) and cut again on load; the
// optimizer's state is keyed by the slice and laid out as it is. Frozen parameters are whole on
// every worker. After a load the slices hold the file's values: at stages 1 and 2 the parameters
// are gathered before the next forward; at stage 3 every unit is released, to be gathered anew.
void Replicator::mark_pieces() {
  const std::weak_ptr<int> alive = alive_;
  for (const auto& p : unique_parameters(*module_)) {
    const auto index = shards_->index_of(p);
    const bool sliced = index.has_value();
    const size_t k = index.value_or(0);
    // Weakly: the marker lives on the parameter itself.
    c10::weak_intrusive_ptr<at::TensorImpl, c10::UndefinedTensorImpl> weak(p.getIntrusivePtr());
    auto describe = [this, alive, weak, sliced, k]() {
      auto strong = weak.lock();
      if (alive.expired() || !strong) return checkpoint::Piece{};
      return piece_of(at::Tensor(std::move(strong)), sliced, k);
    };
    // A tensor's first register_hook() clears the hooks it had (LibTorch's create_cpp_hook):
    // one made and removed first keeps the marker from the Reducer's and the program's.
    if (p.requires_grad()) {
      at::Tensor handle = p;
      handle.remove_hook(handle.register_hook([](const at::Tensor&) { return at::Tensor(); }));
    }
    torch::autograd::impl::add_hook(p, std::make_shared<checkpoint::PieceOf>(describe));
    // Note [Slices in an elastic job]: elastic::State finds the Replication on the parameters
    // (replication_of) before any Reducer exists, and across worlds.
    if (slicing_ && sliced)
      torch::autograd::impl::add_hook(p, std::make_shared<ReplicatedBy>(replication_));
  }
}

checkpoint::Piece Replicator::piece_of(const at::Tensor& parameter, bool sliced, size_t k) {
  checkpoint::Piece piece;
  const int n = group_.size(), rank = group_.rank();
  piece.local = parameter;
  piece.shape = parameter.sizes().vec();
  piece.holders = n;
  piece.first_holder = rank == 0;
  if (n != shoal::world_size()) {
    piece.refusal = "is held in slices over " + std::to_string(n) + " of the " +
                    std::to_string(shoal::world_size()) +
                    " workers; expected a DataParallel over the world";
    return piece;
  }
  if (!sliced) {  // frozen: the same whole value on every worker
    piece.gather = [rank](const at::Tensor& like) {
      return rank == 0 ? like.detach().clone() : at::Tensor();
    };
    piece.cut = [](const at::Tensor& whole) { return whole; };
    return piece;
  }
  piece.slice = shards_->slice(k);
  piece.gather = [shards = shards_, group = group_, k,
                  shape = piece.shape](const at::Tensor& like) mutable {
    comm::AllGatherOptions options;
    for (int r = 0; r < shards->size(); ++r) options.sizes.push_back(shards->length(k, r));
    at::Tensor whole = group.all_gather(like.detach().reshape(-1), options);
    return group.rank() == 0 ? whole.view(shape) : at::Tensor();
  };
  piece.cut = [shards = shards_, k](const at::Tensor& whole) {
    const int rank = shards->rank();
    return whole.reshape(-1).narrow(0, shards->start(k, rank), shards->length(k, rank)).clone();
  };
  const std::weak_ptr<int> alive = alive_;
  piece.loaded = [this, alive] {
    if (!alive.expired()) slices_changed();
  };
  return piece;
}

void Replicator::after_forward() {
  if (gatherer_) gatherer_->rethrow();
}

// Note [Copying a commit in the background] (src/dp/replication.h).
int Replication::add_waiter(std::function<void()> wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiters_.emplace(++last_id_, std::move(wait));
  return last_id_;
}

void Replication::remove_waiter(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiters_.erase(id);
}

void Replication::before_parameters_change() {
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, wait] : waiters_) waiters.push_back(wait);
  }
  for (auto& wait : waiters) wait();
}

ForwardScope::ForwardScope(Replicator& replicator, const at::Tensor* input)
    : replicator_(replicator) {
  replicator_.before_forward(input);
  const at::ScalarType compute = replicator_.compute_dtype();
  if (compute == at::kFloat) return;
  const AutocastState before = enter_autocast({true, compute});
  was_enabled_ = before.enabled;
  was_dtype_ = before.dtype;
  autocast_ = true;
}

ForwardScope::~ForwardScope() {
  leave_autocast();
}

void ForwardScope::leave_autocast() {
  if (!autocast_) return;
  autocast_ = false;
  dp::leave_autocast({was_enabled_, was_dtype_});
}

void ForwardScope::finish() {
  leave_autocast();
  replicator_.after_forward();
}

at::Tensor ForwardScope::finish(at::Tensor output) {
  const bool computed_low = autocast_;
  finish();
  if (computed_low && output.defined() && output.is_floating_point() && output.element_size() < 4) {
    return output.to(at::kFloat);
  }
  return output;
}

std::shared_ptr<Replicator> make_replicator(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options) {
  return std::make_shared<Replicator>(std::move(module), std::move(options));
}
void set_sync(Replicator& replicator, bool sync) { replicator.set_sync(sync); }
bool sync(const Replicator& replicator) { return replicator.sync(); }
void before_forward(Replicator& replicator, const at::Tensor* input) { replicator.before_forward(input); }
void after_forward(Replicator& replicator) {
  replicator.after_forward();
}
std::vector<std::vector<size_t>> bucket_assignment(const Replicator& replicator) {
  return replicator.reducer() ? replicator.reducer()->bucket_assignment() : std::vector<std::vector<size_t>>{};
}
torch::OrderedDict<std::string, at::Tensor> named_parameters(const Replicator& replicator) {
  return replicator.named_parameters();
}
double clip_grad_norm(Replicator& replicator, double max_norm, double norm_type) {
  return replicator.clip_grad_norm(max_norm, norm_type);
}
void gather_parameters(Replicator& replicator) {
  replicator.gather_parameters();
}
std::optional<GradientNoise> gradient_noise(const Replicator& replicator) {
  const auto& meter = replicator.replication().noise();
  if (!meter) return std::nullopt;
  return meter->value();
}

}  // namespace shoal::dp
