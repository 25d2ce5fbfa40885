#include "shoal/data/sampler.h"

#include <torch/serialize/archive.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "../core/hash.h"
#include "batch_source.h"
#include "shoal/comm/group.h"
#include "shoal/core/error.h"
#include "shoal/data/torch_sampler.h"
#include "runtime/world.h"
#include "shoal/runtime/init.h"

namespace shoal::data {
namespace {

using ::shoal::detail::SplitMix64;  // fixed by its definition, unlike std::*_distribution's or torch's

std::string out_of_range(const char* name, int64_t value, const std::string& expected) {
  return std::string("Sampler: ") + name + " = " + std::to_string(value) + " is out of range: expected " + expected;
}

void check_world(int rank, int world_size) {
  if (world_size < 1) throw UsageError(out_of_range("world_size", world_size, "at least 1"));
  if (rank < 0 || rank >= world_size) {
    throw UsageError(out_of_range("rank", rank, "0 <= rank < world_size = " + std::to_string(world_size)));
  }
}

// A program may leave shoal::init() to its loader or to DataParallel, whichever comes first.
void join_job() { runtime::join_implicitly("a shoal sampler"); }

// Two functions because the order in which a call's arguments are evaluated is unspecified.
int job_rank() {
  join_job();
  return rank();
}

int job_world_size() {
  join_job();
  return world_size();
}

}  // namespace

std::vector<size_t> epoch_permutation(int64_t size, uint64_t seed, int64_t epoch) {
  std::vector<size_t> permutation(static_cast<size_t>(std::max<int64_t>(size, 0)));
  std::iota(permutation.begin(), permutation.end(), size_t{0});
  // mix64 is a bijection, so distinct epochs of one seed start distinct streams.
  SplitMix64 random(::shoal::detail::mix64(::shoal::detail::mix64(seed) ^ static_cast<uint64_t>(epoch)));
  for (size_t i = permutation.size(); i > 1; --i) {
    std::swap(permutation[i - 1], permutation[random.below(i)]);
  }
  return permutation;
}

Sampler::Sampler(int64_t dataset_size, const SamplerOptions& options, int rank, int world_size)
    : options_(options), dataset_size_(dataset_size), rank_(rank), world_size_(world_size),
      source_(std::make_unique<detail::CursorSource>()) {
  if (dataset_size < 0) throw UsageError(out_of_range("dataset_size", dataset_size, "at least 0"));
  if (options.batch_size < 1) throw UsageError(out_of_range("batch_size", options.batch_size, "at least 1"));
  check_world(rank, world_size);
  set_epoch(0);
}

Sampler::Sampler(int64_t dataset_size, const SamplerOptions& options)
    : Sampler(dataset_size, options, job_rank(), job_world_size()) {}

Sampler::Sampler(const Sampler& other)
    : checkpoint::Stateful(other), options_(other.options_), dataset_size_(other.dataset_size_),
      rank_(other.rank_), world_size_(other.world_size_), epoch_(other.epoch_), cursor_(other.cursor_),
      restored_(other.restored_), permutation_(other.permutation_),
      source_(other.source_ ? other.source_->clone() : nullptr) {}

Sampler& Sampler::operator=(const Sampler& other) {
  *this = Sampler(other);
  return *this;
}

Sampler::Sampler(Sampler&& other) noexcept = default;
Sampler& Sampler::operator=(Sampler&& other) noexcept = default;
Sampler::~Sampler() = default;

void Sampler::set_epoch(int64_t epoch) {
  if (epoch < 0) throw UsageError(out_of_range("epoch", epoch, "at least 0"));
  const bool resuming = restored_ && epoch == epoch_;
  restored_ = false;
  if (resuming) return;
  if (epoch != epoch_ || permutation_.size() != static_cast<size_t>(dataset_size_)) {
    if (options_.shuffle) {
      permutation_ = epoch_permutation(dataset_size_, options_.seed, epoch);
    } else {
      permutation_.resize(static_cast<size_t>(dataset_size_));
      std::iota(permutation_.begin(), permutation_.end(), size_t{0});
    }
  }
  epoch_ = epoch;
  cursor_ = 0;
  source_->start_epoch();
}

void Sampler::lease_from(std::shared_ptr<BatchLeases> leases) {
  if (options_.last_batch == LastBatch::kPad) {
    throw UsageError(
        "Sampler: leased batches (an elastic parameter-server job) with LastBatch::kPad; expected "
        "kKeep or kDrop");
  }
  if (!leases) {
    source_ = std::make_unique<detail::CursorSource>();
    return;
  }
  const int64_t lease_size = options_.per_worker ? options_.batch_size
                                                 : (options_.batch_size + world_size_ - 1) / world_size_;
  source_ = std::make_unique<detail::LeasedSource>(std::move(leases), lease_size,
                                                   options_.last_batch == LastBatch::kDrop);
}

void Sampler::set_batch_size(int64_t batch_size) {
  if (batch_size < 1) {
    throw UsageError("Sampler::set_batch_size: " +
                     out_of_range("batch_size", batch_size, "at least 1"));
  }
  if (leased()) {
    throw UsageError(
        "Sampler::set_batch_size on a sampler that leases its batches (an elastic "
        "parameter-server job); expected one that cuts them from its cursor");
  }
  options_.batch_size = batch_size;
}

bool Sampler::leased() const { return source_->leased(); }

void Sampler::reshard(int rank, int world_size) {
  check_world(rank, world_size);
  rank_ = rank;
  world_size_ = world_size;
}

int64_t Sampler::global_batch_size() const {
  return options_.per_worker ? options_.batch_size * world_size_ : options_.batch_size;
}

int64_t Sampler::batches_from(int64_t position) const {
  const int64_t remaining = dataset_size_ - position;
  const int64_t global = global_batch_size();
  if (options_.last_batch == LastBatch::kDrop) return remaining / global;
  return (remaining + global - 1) / global;
}

int64_t Sampler::batches_per_epoch() const { return batches_from(0); }
int64_t Sampler::batches_remaining() const { return batches_from(cursor_); }
bool Sampler::epoch_done() const { return source_->epoch_done(*this); }
int64_t Sampler::global_batch_at_cursor() const { return source_->global_batch_at_cursor(*this); }
std::vector<size_t> Sampler::batch() const { return source_->batch(*this); }
void Sampler::advance() { cursor_ = source_->advance(*this); }

SamplerState Sampler::state() const {
  SamplerState state;
  state.seed = options_.seed;
  state.shuffle = options_.shuffle;
  state.dataset_size = dataset_size_;
  state.epoch = epoch_;
  state.cursor = cursor_;
  return state;
}

void Sampler::check_state(const SamplerState& state) const {
  if (state.dataset_size != dataset_size_) {
    throw UsageError("Sampler: the state was saved for a dataset of " + std::to_string(state.dataset_size) +
                     " samples; this one has " + std::to_string(dataset_size_));
  }
  if (state.seed != options_.seed) {
    throw UsageError("Sampler: the state was saved with seed " + std::to_string(state.seed) +
                     "; this sampler's seed is " + std::to_string(options_.seed));
  }
  if (state.shuffle != options_.shuffle) {
    const auto name = [](bool shuffle) { return shuffle ? "true" : "false"; };
    throw UsageError(std::string("Sampler: the state was saved with shuffle = ") + name(state.shuffle) +
                     "; this sampler has shuffle = " + name(options_.shuffle));
  }
  if (state.epoch < 0) throw UsageError(out_of_range("the state's epoch", state.epoch, "at least 0"));
  if (state.cursor < 0 || state.cursor > dataset_size_) {
    throw UsageError(out_of_range("the state's cursor", state.cursor,
                                  "0 <= cursor <= dataset_size = " + std::to_string(dataset_size_)));
  }
}

void Sampler::load_state(const SamplerState& state) {
  check_state(state);
  set_epoch(state.epoch);
  cursor_ = state.cursor;
  restored_ = true;
}

namespace {

at::Tensor int64_scalar(int64_t value) { return at::scalar_tensor(value, at::kLong); }

// The integer `state` holds under `key`; UsageError when it holds none, or not as a 0-dim
// integer tensor.
int64_t integer_at(const checkpoint::StateDict& state, const std::string& key) {
  const auto found = state.find(key);
  if (found == state.end()) {
    throw UsageError("Sampler: the state has no \"" + key +
                     "\"; expected the names seed, shuffle, dataset_size, epoch and cursor");
  }
  const at::Tensor& value = found->second;
  const std::string named = "Sampler: the state's \"" + key + "\" is ";
  const char* expected = "; expected a 0-dim integer tensor";
  if (!value.defined()) throw UsageError(named + "an undefined tensor" + expected);
  if (value.dim() != 0 || !at::isIntegralType(value.scalar_type(), /*includeBool=*/false)) {
    throw UsageError(named + "a " + c10::toString(value.scalar_type()) + " tensor of shape " +
                     c10::str(value.sizes()) + expected);
  }
  return value.item<int64_t>();
}

// The SamplerState a state_dict() holds, checked for its form only (check_state judges it).
SamplerState from_state_dict(const checkpoint::StateDict& dict) {
  SamplerState state;
  state.seed = static_cast<uint64_t>(integer_at(dict, "seed"));
  const int64_t shuffle = integer_at(dict, "shuffle");
  if (shuffle != 0 && shuffle != 1) throw UsageError(out_of_range("the state's shuffle", shuffle, "0 or 1"));
  state.shuffle = shuffle == 1;
  state.dataset_size = integer_at(dict, "dataset_size");
  state.epoch = integer_at(dict, "epoch");
  state.cursor = integer_at(dict, "cursor");
  return state;
}

}  // namespace

checkpoint::StateDict Sampler::state_dict() const {
  const SamplerState position = state();
  return {
      {"seed", int64_scalar(static_cast<int64_t>(position.seed))},  // the bits: a uint64 over 2^63 is negative
      {"shuffle", int64_scalar(position.shuffle ? 1 : 0)},
      {"dataset_size", int64_scalar(position.dataset_size)},
      {"epoch", int64_scalar(position.epoch)},
      {"cursor", int64_scalar(position.cursor)},
  };
}

void Sampler::check_state_dict(const checkpoint::StateDict& state) const { check_state(from_state_dict(state)); }

void Sampler::load_state_dict(const checkpoint::StateDict& state) { load_state(from_state_dict(state)); }

// ----- The two sources of batches (batch_source.h) -----

namespace detail {

std::unique_ptr<BatchSource> CursorSource::clone() const { return std::make_unique<CursorSource>(*this); }

bool CursorSource::epoch_done(const Sampler& sampler) const { return sampler.batches_remaining() == 0; }

int64_t CursorSource::global_batch_at_cursor(const Sampler& sampler) const {
  if (epoch_done(sampler)) return 0;
  if (sampler.options().last_batch == LastBatch::kKeep) {
    return std::min(sampler.global_batch_size(), sampler.dataset_size() - sampler.cursor());
  }
  return sampler.global_batch_size();  // kDrop: only full batches remain; kPad: filled up
}

std::vector<size_t> CursorSource::batch(const Sampler& sampler) const {
  const int rank = sampler.rank();
  const comm::Sizes shares = comm::split_sizes(global_batch_at_cursor(sampler), sampler.world_size());
  const int64_t offset = std::accumulate(shares.begin(), shares.begin() + rank, int64_t{0});
  const std::vector<size_t>& permutation = sampler.permutation();
  std::vector<size_t> indices(static_cast<size_t>(shares[rank]));
  for (size_t i = 0; i < indices.size(); ++i) {
    // Wraps around only for kPad's last batch.
    const int64_t position = (sampler.cursor() + offset + static_cast<int64_t>(i)) % sampler.dataset_size();
    indices[i] = permutation[static_cast<size_t>(position)];
  }
  return indices;
}

int64_t CursorSource::advance(const Sampler& sampler) {
  if (epoch_done(sampler)) return sampler.cursor();
  return std::min(sampler.dataset_size(), sampler.cursor() + sampler.global_batch_size());
}

LeasedSource::LeasedSource(std::shared_ptr<BatchLeases> leases, int64_t lease_size, bool drop_last)
    : leases_(std::move(leases)), lease_size_(lease_size), drop_last_(drop_last) {}

std::unique_ptr<BatchSource> LeasedSource::clone() const { return std::make_unique<LeasedSource>(*this); }

const BatchLeases::Lease& LeasedSource::current(const Sampler& sampler) const {
  if (!lease_) lease_ = leases_->next(sampler.epoch(), sampler.dataset_size(), lease_size_, drop_last_);
  return *lease_;
}

bool LeasedSource::epoch_done(const Sampler& sampler) const {
  return current(sampler).kind == BatchLeases::Lease::Kind::kEpochDone;
}

int64_t LeasedSource::global_batch_at_cursor(const Sampler& sampler) const {
  if (epoch_done(sampler)) return 0;
  return current(sampler).end - current(sampler).begin;  // this worker's, leased
}

std::vector<size_t> LeasedSource::batch(const Sampler& sampler) const {
  const BatchLeases::Lease& lease = current(sampler);
  if (lease.kind != BatchLeases::Lease::Kind::kBatch) return {};
  const std::vector<size_t>& permutation = sampler.permutation();
  return {permutation.begin() + lease.begin, permutation.begin() + lease.end};
}

int64_t LeasedSource::advance(const Sampler& sampler) {
  lease_.reset();  // the next question leases the next batch
  return sampler.cursor();
}

}  // namespace detail

DistributedSampler::DistributedSampler(int64_t size, bool shuffle, bool drop_last, uint64_t seed)
    : size_(size), shuffle_(shuffle), drop_last_(drop_last), seed_(seed), rank_(job_rank()),
      world_size_(job_world_size()) {
  if (size < 0) throw UsageError(out_of_range("dataset_size", size, "at least 0"));
}

void DistributedSampler::set_epoch(int64_t epoch) {
  if (epoch < 0) throw UsageError(out_of_range("epoch", epoch, "at least 0"));
  next_epoch_ = epoch;
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  // The loader's begin() right after load() goes on from the saved place.
  if (std::exchange(restored_, false) && !new_size) return;
  if (new_size) size_ = static_cast<int64_t>(*new_size);
  epoch_ = next_epoch_.value_or(epoch_ + 1);
  next_epoch_.reset();
  cursor_ = 0;
  if (shuffle_) {
    permutation_ = epoch_permutation(size_, seed_, epoch_);
  } else {
    permutation_.resize(static_cast<size_t>(size_));
    std::iota(permutation_.begin(), permutation_.end(), size_t{0});
  }
}

// Note [A last batch smaller than the worker count]
// torch's loader refuses an empty request, so when a global batch of g samples is cut over more
// workers than it has (n > g), every worker must still get at least one. The batch is then
// repeated k = ceil(n / g) times and the g * k rows cut over the workers: each sample appears k
// times, so every worker's mean loss weighed by its rows (Note [Weighing gradients by batch
// share], shoal/dp/data_parallel.h) sums to the mean over the g samples, as one process gets it.
c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (epoch_ < 0) reset();  // torch's loader resets first; a direct caller may not
  const int64_t global = std::min(static_cast<int64_t>(batch_size), size_ - cursor_);
  if (global <= 0 || (drop_last_ && global < static_cast<int64_t>(batch_size))) return c10::nullopt;
  const int64_t copies = (world_size_ + global - 1) / global;  // 1 unless world_size_ > global
  const comm::Sizes shares = comm::split_sizes(global * copies, world_size_);
  const int64_t offset = std::accumulate(shares.begin(), shares.begin() + rank_, int64_t{0});
  std::vector<size_t> indices;
  for (int64_t i = 0; i < shares[rank_]; ++i) {
    indices.push_back(permutation_[static_cast<size_t>(cursor_ + (offset + i) % global)]);
  }
  cursor_ += global;
  return indices;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", torch::tensor(epoch_, torch::kInt64), /*is_buffer=*/true);
  archive.write("cursor", torch::tensor(cursor_, torch::kInt64), /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor epoch, cursor;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("cursor", cursor, /*is_buffer=*/true);
  const int64_t saved_cursor = cursor.item<int64_t>();
  if (saved_cursor < 0 || saved_cursor > size_) {
    throw UsageError(out_of_range("the saved cursor", saved_cursor, "0 <= cursor <= dataset_size = " + std::to_string(size_)));
  }
  next_epoch_ = epoch.item<int64_t>();
  reset();
  cursor_ = saved_cursor;
  restored_ = true;
}

}  // namespace shoal::data
