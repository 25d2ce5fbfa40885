// An elastic::State's commit in memory: taking it (snapshot), and going back to it (restore).

#include "snapshot.h"

#include "slices.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <sstream>

#include <torch/serialize.h>

#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal::elastic {
namespace {

at::Tensor copy_into(const at::Tensor& from, at::Tensor to) {
  if (!from.defined()) return {};
  if (to.defined() && to.sizes() == from.sizes() && to.scalar_type() == from.scalar_type()) {
    if (to.is_contiguous() && from.is_contiguous() && from.device().is_cpu()) {
      // glibc's memcpy streams large blocks past the cache, which at::copy_ does not.
      std::memcpy(to.data_ptr(), from.data_ptr(), from.nbytes());
    } else {
      to.copy_(from);
    }
    return to;
  }
  return from.detach().clone();
}

// Copies an optimizer's per-parameter state into `to`, reusing its tensors. False for an
// optimizer whose state type is not one of LibTorch's (its state is then serialized instead).
template <typename T, typename Fields>
bool copy_as(const torch::optim::OptimizerParamState& from,
             std::unique_ptr<torch::optim::OptimizerParamState>& to, Fields fields) {
  const auto* source = dynamic_cast<const T*>(&from);
  if (source == nullptr) return false;
  auto* target = dynamic_cast<T*>(to.get());
  if (target == nullptr) {
    to = std::make_unique<T>();
    target = static_cast<T*>(to.get());
  }
  fields(*source, *target);
  return true;
}

bool copy_param_state(const torch::optim::OptimizerParamState& from,
                      std::unique_ptr<torch::optim::OptimizerParamState>& to) {
  using namespace torch::optim;
  // Adam's and AdamW's states have the same fields.
  const auto adam = [](const auto& s, auto& d) {
    d.step(s.step());
    d.exp_avg(copy_into(s.exp_avg(), d.exp_avg()));
    d.exp_avg_sq(copy_into(s.exp_avg_sq(), d.exp_avg_sq()));
    d.max_exp_avg_sq(copy_into(s.max_exp_avg_sq(), d.max_exp_avg_sq()));
  };
  return copy_as<SGDParamState>(
             from, to,
             [](const auto& s, auto& d) {
               d.momentum_buffer(copy_into(s.momentum_buffer(), d.momentum_buffer()));
             }) ||
         copy_as<AdamParamState>(from, to, adam) || copy_as<AdamWParamState>(from, to, adam) ||
         copy_as<AdagradParamState>(from, to,
                                    [](const auto& s, auto& d) {
                                      d.step(s.step());
                                      d.sum(copy_into(s.sum(), d.sum()));
                                    }) ||
         copy_as<RMSpropParamState>(from, to, [](const auto& s, auto& d) {
           d.step(s.step());
           d.square_avg(copy_into(s.square_avg(), d.square_avg()));
           d.momentum_buffer(copy_into(s.momentum_buffer(), d.momentum_buffer()));
           d.grad_avg(copy_into(s.grad_avg(), d.grad_avg()));
         });
}

std::vector<at::Tensor> module_tensors(torch::nn::Module& module) {
  std::vector<at::Tensor> tensors = module.parameters();
  for (auto& b : module.buffers()) tensors.push_back(b);
  return tensors;
}

}  // namespace

// Note [Commits without copies]
// In an elastic job where a DataParallel replicates each of the module's trainable parameters,
// every worker holds the same parameters and optimizer state, and only the optimizer's step
// changes them, after a backward whose all-reduce completed. So commit() records only where it is
// (the parameters' version counters, which torch raises at in-place changes, and the count of
// those DataParallels' backwards whose collectives all returned, after
// which the program's step may change the parameters through .data(), which those counters do
// not see), not a copy, which would cost a memory pass over the model and its optimizer state
// per step (bench/RESULTS.md, "elastic"). At a failure, a worker where neither moved still holds
// its commit; one where one moved (it may have stepped, then failed before its next commit) takes
// the parameters, with the rest of the state, from a worker that holds its commit or a newer
// one: sync() picks as source the newest commit among the unchanged workers. A worker that
// stepped after a completed all-reduce is never newer than that source without having
// committed (its step was the job's next step, and only its commit makes it one), so nothing
// is lost. In the usual loop (forward, backward, step, commit) a failure shows in the backward
// (before its last collective returns) or in commit() (after the snapshot), so every survivor is
// unchanged. Only a collective between the end of backward and commit() can fail with every
// survivor changed; sync() then raises UsageError (a retry could not help), and
// StateOptions::copy_parameters is the way to run such
// a program (or the collective moves before the backward). Whether a DataParallel replicates a
// parameter, and how many backwards it completed, is asked of that parameter
// (dp::replication_of): another model's DataParallel, or a GradientSync beside it, counts its own
// backwards, which change nothing here.

void State::snapshot() {
  torch::NoGradGuard no_grad;
  wait_copy();
  if (!committed_) committed_ = std::make_unique<Snapshot>();
  Snapshot& s = *committed_;
  // What the next forward may change (buffers) or is cheap is copied now; the parameters and the
  // optimizer's state, which only the optimizer's step changes, maybe in the background.
  const auto params = module_.parameters();
  const auto buffers = module_.buffers();
  s.tensors.resize(params.size() + buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    s.tensors[params.size() + i] = copy_into(buffers[i], s.tensors[params.size() + i]);
  }
  s.rates.clear();
  for (auto& group : optimizer_.param_groups()) s.rates.push_back(group.options().get_lr());
  s.sampler = sampler_.state();
  s.epoch = epoch_;
  s.version = version_;
  for (auto it = s.values.begin(); it != s.values.end();) {
    it = values_.count(it->first) ? std::next(it) : s.values.erase(it);
  }
  for (auto& [name, value] : values_) s.values[name] = copy_into(value, s.values[name]);
  s.warmup_from = warmup_from_;
  s.warmup_done = warmup_done_;
  if (noise_) s.noise = noise_->state();
  s.scaled_steps = scaled_steps_;
  s.gain = gain_;

  const auto replicated = replications();
  if (!replicated.empty() && !options_.copy_parameters) {
    // LibTorch's optimizers step through .data(), which torch's version counters do not see:
    // what is counted is the backwards after which a step may have come.
    s.replications.assign(replicated.begin(), replicated.end());
    s.backwards = 0;
    for (const auto& r : replicated) s.backwards += r->synchronized_backwards();
    s.parameter_versions.clear();
    // Under ZeRO the parameters' memory is written by every gather; only the optimizer's step
    // changes the slices (through .data()), which the backwards count.
    for (const auto& p : params)
      s.parameter_versions.push_back(sliced_ ? int64_t{-1} : static_cast<int64_t>(p._version()));
    for (size_t i = 0; i < params.size(); ++i) s.tensors[i] = at::Tensor();
    s.optimizer_state.clear();
    return;
  }
  s.parameter_versions.clear();
  s.replications.clear();
  auto copy = [this, &s, params] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) s.tensors[i] = copy_into(params[i], s.tensors[i]);
    auto& live = optimizer_.state();
    if (!s.optimizer_serialized) {
      for (auto& [key, param_state] : live) {
        if (!copy_param_state(*param_state, s.optimizer_state[key])) {
          s.optimizer_serialized = true;
          s.optimizer_state.clear();
          break;
        }
      }
      for (auto it = s.optimizer_state.begin(); it != s.optimizer_state.end();) {
        it = live.count(it->first) ? std::next(it) : s.optimizer_state.erase(it);
      }
    }
    if (s.optimizer_serialized) {
      torch::serialize::OutputArchive archive;
      optimizer_.save(archive);
      std::ostringstream bytes;
      archive.save_to(bytes);
      s.optimizer_bytes = bytes.str();
    }
  };
  // See Note [Copying a commit in the background] (src/dp/replication.h).
  if (replicated.empty()) {
    copy();
    return;
  }
  waiters_.erase(std::remove_if(waiters_.begin(), waiters_.end(), [](const auto& w) { return w.first.expired(); }),
                 waiters_.end());
  for (const auto& r : replicated) {
    const bool known = std::any_of(waiters_.begin(), waiters_.end(),
                                   [&](const auto& w) { return w.first.lock() == r; });
    if (!known) waiters_.emplace_back(r, r->add_waiter([this] { wait_copy(); }));
  }
  copying_ = std::async(std::launch::async, copy);
}

std::vector<std::shared_ptr<dp::Replication>> State::replications() const {
  if (!shoal::is_initialized() || !shoal::job().elastic) return {};
  std::vector<std::shared_ptr<dp::Replication>> found;
  for (const auto& p : module_.parameters()) {
    if (!p.requires_grad()) continue;  // no optimizer step changes it
    auto replication = dp::replication_of(p);
    if (!replication) return {};
    if (std::find(found.begin(), found.end(), replication) == found.end()) found.push_back(std::move(replication));
  }
  return found;
}

bool State::parameters_changed() const {
  if (!committed_ || committed_->parameter_versions.empty()) return false;
  const auto params = module_.parameters();
  if (params.size() != committed_->parameter_versions.size()) return true;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t version = committed_->parameter_versions[i];
    if (version >= 0 && static_cast<int64_t>(params[i]._version()) != version) return true;
  }
  uint64_t backwards = 0;
  for (const auto& weak : committed_->replications) {
    const auto replication = weak.lock();
    if (!replication) return true;  // its DataParallel is gone: nothing says what happened since
    backwards += replication->synchronized_backwards();
  }
  return backwards != committed_->backwards;
}

void State::wait_copy() {
  if (copying_.valid()) copying_.get();
}

void State::restore() {
  wait_copy();
  if (!committed_) return;
  torch::NoGradGuard no_grad;
  const Snapshot& s = *committed_;
  auto tensors = module_tensors(module_);
  SHOAL_CHECK_EQ(tensors.size(), s.tensors.size());
  // Without a copy (Note [Commits without copies]) the parameters and the optimizer's state are
  // the commit's unless they changed; then sync() brings them from another worker.
  const bool copied = s.parameter_versions.empty();
  if (!copied && parameters_changed()) needs_parameters_ = true;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (s.tensors[i].defined()) tensors[i].copy_(s.tensors[i]);
  }

  if (!copied) {
    // as they are
  } else if (s.optimizer_serialized) {
    torch::serialize::InputArchive archive;
    std::istringstream bytes(s.optimizer_bytes);
    archive.load_from(bytes);
    optimizer_.load(archive);
  } else {
    auto& live = optimizer_.state();
    for (auto it = live.begin(); it != live.end();) {
      it = s.optimizer_state.count(it->first) ? std::next(it) : live.erase(it);
    }
    for (auto& [key, param_state] : s.optimizer_state) copy_param_state(*param_state, live[key]);
  }
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < s.rates.size(); ++i)
    groups[i].options().set_lr(s.rates[i]);
  sampler_.load_state(s.sampler);
  epoch_ = s.epoch;
  version_ = s.version;
  values_.clear();
  for (auto& [name, value] : s.values)
    values_[name] = value.defined() ? value.clone() : at::Tensor();
  warmup_from_ = s.warmup_from;
  warmup_done_ = s.warmup_done;
  if (noise_ && !s.noise.empty()) noise_->set_state(s.noise);
  scaled_steps_ = s.scaled_steps;
  gain_ = s.gain;
}

}  // namespace shoal::elastic
