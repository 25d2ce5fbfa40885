#include "dp/gatherer.h"

// RecordFunction's layout depends on NDEBUG (a debug-only field), and LibTorch is built with it.
#ifndef NDEBUG
#error "src/dp/gatherer.cpp reads RecordFunction's inputs: build shoal with NDEBUG, as LibTorch is"
#endif

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>

#include "shoal/core/error.h"

namespace shoal::dp {
namespace {

// Note [Gathering a parameter when an operation reads it]. Each thread that ran a stage-3
// wrapper's forward observes its operations once, for every Gatherer that asked it to; a
// Gatherer gone is dropped at the next operation.
thread_local std::vector<std::weak_ptr<Gatherer>> observers;
thread_local bool observer_registered = false;
thread_local bool inside_observer = false;

// An operation's tensor inputs: each one's storage and the tensor itself.
using Reads = std::vector<std::pair<const void*, const void*>>;

void add_read(const at::Tensor& t, Reads& reads) {
  if (t.defined() && t.has_storage())
    reads.emplace_back(t.storage().unsafeGetStorageImpl(), t.unsafeGetTensorImpl());
}

void add_storage(const c10::IValue& value, Reads& reads) {
  if (value.isTensor()) {
    add_read(value.toTensor(), reads);
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorVector()) add_read(t, reads);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) add_storage(item, reads);
  }
}

std::unique_ptr<at::ObserverContext> observe(const at::RecordFunction& operation) {
  if (inside_observer || observers.empty()) return nullptr;
  inside_observer = true;
  struct Leave {
    ~Leave() { inside_observer = false; }
  } leave;
  Reads reads;
  for (const c10::IValue& input : operation.inputs()) add_storage(input, reads);
  if (reads.empty()) return nullptr;
  bool expired = false;
  std::vector<const void*> storages;
  for (const auto& weak : observers) {
    auto gatherer = weak.lock();
    if (!gatherer) {
      expired = true;
      continue;
    }
    storages.clear();
    for (const auto& [storage, tensor] : reads) {
      if (gatherer->watches(storage, tensor)) storages.push_back(storage);
    }
    if (!storages.empty()) gatherer->on_operation(storages);
  }
  if (expired) {
    observers.erase(std::remove_if(observers.begin(), observers.end(),
                                   [](const auto& w) { return w.expired(); }),
                    observers.end());
  }
  return nullptr;
}

c10::StorageImpl* storage_of(const at::Tensor& p) {
  return p.storage().unsafeGetStorageImpl();
}

size_t bytes_of(const at::Tensor& p) {
  return static_cast<size_t>(p.numel()) * p.element_size();
}

// The parameter's memory, given back or taken again, on its own StorageImpl: the parameter's
// TensorImpl, its version counter and every view of it (autograd's saved tensors) stay as they are.
void release_memory(const at::Tensor& p) {
  c10::StorageImpl* storage = storage_of(p);
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
  storage->set_nbytes(0);
}

void take_memory(const at::Tensor& p) {
  c10::StorageImpl* storage = storage_of(p);
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes_of(p)));
  storage->set_nbytes(bytes_of(p));
}

// The parameter's memory as a flat tensor of its own (writing through it bumps no version).
at::Tensor flat_memory(const at::Tensor& p) {
  auto flat = at::empty({0}, p.options().requires_grad(false));
  flat.set_(p.storage(), 0, {p.numel()}, {1});
  return flat;
}

}  // namespace

std::vector<std::vector<size_t>> module_units(const torch::nn::Module& module, const Shards& shards,
                                              int64_t unit_bytes) {
  std::vector<std::vector<size_t>> units;
  std::set<size_t> placed;
  int64_t bytes = unit_bytes;  // full: the first module opens a unit
  for (const auto& child : module.modules()) {
    bool opened = false;
    for (const auto& p : child->parameters(/*recurse=*/false)) {
      const auto k = shards.index_of(p);
      if (!k || !placed.insert(*k).second) continue;
      if (!opened && bytes >= unit_bytes) {
        units.emplace_back();
        bytes = 0;
      }
      opened = true;
      units.back().push_back(*k);
      bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
  }
  return units;
}

Gatherer::Gatherer(std::shared_ptr<Shards> shards, comm::Group group,
                   std::vector<std::vector<size_t>> units, int max_units, bool keep_memory)
    : shards_(std::move(shards)),
      group_(std::move(group)),
      max_units_(std::max(1, max_units)),
      keep_memory_(keep_memory) {
  const auto& params = shards_->params();
  for (const auto& p : keep_memory_ ? std::vector<at::Tensor>() : params) {
    // Its memory may be freed already: by the Gatherer of an elastic job's previous world.
    const size_t held = p.storage().nbytes();
    if (p.storage_offset() != 0 || (held != 0 && held != bytes_of(p))) {
      throw UsageError(
          "zero_stage 3 frees each parameter's memory between uses, so each must own "
          "its memory; a parameter of " +
          std::to_string(p.numel()) + " elements is a view of a larger tensor");
    }
  }
  for (auto& members : units) {
    Unit unit;
    unit.layout = shards_->layout(members);
    for (size_t k : members) unit_of_[storage_of(params[k])] = units_.size();
    unit.params = std::move(members);
    units_.push_back(std::move(unit));
  }
  SHOAL_CHECK(unit_of_.size() == params.size())
      << "units cover " << unit_of_.size() << " of " << params.size()
      << " parameters, or two share memory";
  if (keep_memory_) {
    for (const auto& slice : shards_->slices()) slices_.insert(slice.unsafeGetTensorImpl());
    for (auto& unit : units_) unit.status = Status::kWhole;
    return;
  }
  at::NoGradGuard no_grad;
  for (const auto& p : params) release_memory(p);
}

Gatherer::~Gatherer() {
  for (auto& unit : units_) {
    if (unit.status != Status::kInFlight) continue;
    try {
      unit.work.wait();
    } catch (const std::exception&) {
      // the group broke; nothing reads this unit
    }
  }
}

void Gatherer::observe_this_thread() {
  if (!observer_registered) {
    at::addThreadLocalCallback(at::RecordFunctionCallback(observe).needsInputs(true));
    observer_registered = true;
  }
  bool known = false;
  for (const auto& weak : observers) known = known || weak.lock().get() == this;
  if (!known) observers.push_back(weak_from_this());
}

void Gatherer::begin_forward() {
  observe_this_thread();
  if (!needed_.empty()) plan_ = std::exchange(needed_, {});
  next_ = 0;
}

size_t Gatherer::occupied() const {
  size_t count = 0;
  for (const auto& unit : units_) {
    // With keep_memory whole units hold nothing more than the model: only gathers in flight count.
    count += unit.status == Status::kInFlight || (!keep_memory_ && unit.status == Status::kWhole)
                 ? 1
                 : 0;
  }
  return count;
}

bool Gatherer::make_room() {
  if (keep_memory_) {
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].status != Status::kInFlight) continue;
      finish(u);
      return true;
    }
    return false;
  }
  size_t victim = units_.size();
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = units_[u];
    if (unit.status != Status::kWhole || unit.last_use == clock_)
      continue;  // in flight, or read now
    if (victim == units_.size() || unit.last_use < units_[victim].last_use) victim = u;
  }
  if (victim == units_.size()) return false;
  free(victim);
  return true;
}

void Gatherer::launch(size_t u) {
  Unit& unit = units_[u];
  unit.status = Status::kInFlight;
  if (!broken_)
    unit.work =
        shards_->start_gather(group_, unit.params, unit.layout);  // else finish() gives zeros
}

void Gatherer::finish(size_t u) {
  Unit& unit = units_[u];
  if (unit.status != Status::kInFlight) return;
  const auto& params = shards_->params();
  if (!keep_memory_) {
    for (size_t k : unit.params) take_memory(params[k]);
  }
  unit.status = Status::kWhole;
  // With keep_memory the parameter is written in place (a stage-1 or 2 parameter may be a view);
  // its own part is its slice already.
  const auto flat = [&](size_t k) {
    return keep_memory_ ? params[k].view(-1) : flat_memory(params[k]);
  };
  if (broken_) {
    if (!keep_memory_) {
      for (size_t k : unit.params) flat(k).zero_();
    }
    return;
  }
  unit.work.wait();
  shards_->unpack(unit.params, unit.layout, unit.work.result(), flat, /*skip_own=*/keep_memory_);
  unit.work =
      comm::Work();  // the gathered buffer (a unit's worth) goes now, not at the next gather
}

void Gatherer::free(size_t u) {
  Unit& unit = units_[u];
  if (!keep_memory_) {
    for (size_t k : unit.params) release_memory(shards_->params()[k]);
  }
  unit.status = Status::kFreed;
}

void Gatherer::need(size_t u) {
  needed_.push_back(u);
  // Where this step stands in the previous one's plan.
  auto at = std::find(plan_.begin() + static_cast<std::ptrdiff_t>(std::min(next_, plan_.size())),
                      plan_.end(), u);
  if (at != plan_.end()) next_ = static_cast<size_t>(at - plan_.begin()) + 1;
  if (units_[u].status == Status::kFreed) {
    if (occupied() >= static_cast<size_t>(max_units_)) make_room();
    launch(u);
  }
  finish(u);
  prefetch();
}

void Gatherer::prefetch() {
  // The next units of the plan, up to max_units - 1 ahead of the one just needed.
  size_t ahead = 0;
  for (size_t i = next_; i < plan_.size() && ahead + 1 < static_cast<size_t>(max_units_); ++i) {
    const size_t v = plan_[i];
    if (units_[v].last_use == clock_) continue;  // read by this operation: whole already
    ++ahead;
    if (units_[v].status != Status::kFreed) continue;
    if (occupied() >= static_cast<size_t>(max_units_) && !make_room()) break;
    launch(v);
  }
}

void Gatherer::on_operation(const std::vector<const void*>& storages) {
  at::DisableRecordFunctionGuard quiet;  // the gathers' own operations are not observed
  at::NoGradGuard no_grad;
  ++clock_;
  std::vector<size_t> missing;
  for (const void* storage : storages) {
    const auto found = unit_of_.find(storage);
    if (found == unit_of_.end()) continue;
    Unit& unit = units_[found->second];
    unit.last_use = clock_;
    if (unit.status != Status::kWhole &&
        std::find(missing.begin(), missing.end(), found->second) == missing.end()) {
      missing.push_back(found->second);
    }
  }
  for (size_t u : missing) {
    try {
      need(u);
    } catch (...) {
      if (!error_) error_ = std::current_exception();
      broken_ = true;
      if (units_[u].status == Status::kFreed) units_[u].status = Status::kInFlight;
      finish(u);  // zeros, so that the operation can run
    }
  }
}

void Gatherer::release_all() {
  at::DisableRecordFunctionGuard quiet;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    if (unit.status == Status::kInFlight && !broken_) {
      try {
        unit.work.wait();  // a prefetch past the plan's end: its result is not needed
      } catch (...) {
        if (!error_) error_ = std::current_exception();
        broken_ = true;
      }
    }
    if (unit.status != Status::kFreed) free(u);
  }
}

void Gatherer::gather_all() {
  at::DisableRecordFunctionGuard quiet;
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].status != Status::kFreed) continue;
    // With keep_memory at most max_units gathers travel at once; stage 3 makes every unit whole.
    if (keep_memory_ && occupied() >= static_cast<size_t>(max_units_)) make_room();
    launch(u);
  }
  for (size_t u = 0; u < units_.size(); ++u) finish(u);
}

void Gatherer::rethrow() {
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

}  // namespace shoal::dp
