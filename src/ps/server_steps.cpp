#include "server_steps.h"

#include <algorithm>
#include <iterator>
#include <set>
#include <utility>
#include <vector>

#include "server_core.h"
#include "server_leases.h"
#include "server_membership.h"
#include "server_registry.h"
#include "server_snapshots.h"
#include "server_text.h"
#include "shoal/core/timeline.h"

namespace shoal::ps::detail {

ServerSteps::ServerSteps(const ServerCoreOptions& options, ServerRegistry& registry,
                         const ServerMembership& membership, ServerLeases& leases,
                         ServerSnapshots& snapshots)
    : options_(options),
      registry_(registry),
      membership_(membership),
      leases_(leases),
      snapshots_(snapshots),
      sum_(options, registry) {}

// Note [Server 0 decides]: with backup workers (replicas_to_aggregate k) a sync step counts the
// first k pushes that reach the server, and the rest are dropped, their batches going back into
// the epoch. With several servers the first k may differ from server to server, which would
// apply one worker's gradient on some servers only. So one server decides: a worker pushes to
// server 0 first (verdict kDecide), then to the others with server 0's answer (kCounted or
// kDropped), and a server takes a step as complete once it holds k pushes, all of them counted by
// server 0. A primary forwards a push it dropped to its backup as kDropped (without its values),
// so that the backup, whose pushes arrive in another order, drops the same ones.
bool ServerSteps::take_push(const PushRequest& request, PushRequest* take) {
  const char* what = "push";
  const int32_t w = request.worker;
  if (options_.consistency != Consistency::kSync && options_.sealed_pushes) {
    unsealed_[w].emplace(request.clock, hold(request, take));  // applied when sealed
  } else if (options_.consistency != Consistency::kSync) {
    registry_.apply(request.dense, request.sparse);
    ++step_;
    leases_.finish(w, request);
    snapshots_.take_when_due(step_);
  } else if (request.verdict == PushRequest::Verdict::kCounted && request.clock < step_) {
    bad(what, "worker " + std::to_string(w) + "'s push of step " + std::to_string(request.clock) +
                  " was counted by server 0, but this server applied that step without it; "
                  "expected every server of the job to run with the same backup workers");
  } else if (request.verdict == PushRequest::Verdict::kDropped || request.clock < step_ ||
             (request.verdict == PushRequest::Verdict::kDecide &&
              options_.replicas_to_aggregate > 0 &&
              pending_[request.clock].size() >=
                  static_cast<size_t>(options_.replicas_to_aggregate))) {
    // The step was full without it (backup workers; Note [Server 0 decides]).
    // Its samples go back into the epoch, unlike TensorFlow's SyncReplicasOptimizer's.
    leases_.give_back(w, request);
    return false;
  } else {
    buffer_push(request, take);  // Note [Taking a push's storage]
    apply_ready_steps();
  }
  return true;
}

// A step's pushes are summed and applied as Note [Sync sum] (server_sum.cpp) says.
void ServerSteps::apply_ready_steps() {
  while (step_complete(step_)) {
    auto node = pending_.extract(step_);
    if (!node.empty()) {
      timeline::Slice slice(
          timeline::enabled() ? "sum step " + std::to_string(step_) : "", "ps",
          {{"step", step_}, {"pushes", static_cast<int64_t>(node.mapped().size())}});
      sum_.sum_step(step_, node.mapped());
      leases_.finish(node.mapped());
      recycle(node.mapped());
    }
    ++step_;
    snapshots_.take_when_due(step_);
  }
}

bool ServerSteps::step_complete(int64_t clock) const {
  // the step is not known yet (Note [Clocks after a reload])
  if (snapshots_.adopting()) return false;
  auto it = pending_.find(clock);
  const size_t have = it == pending_.end() ? 0 : it->second.size();
  const std::set<int32_t>& live = membership_.live();
  if (options_.replicas_to_aggregate > 0) {
    const size_t need = std::min(static_cast<size_t>(options_.replicas_to_aggregate),
                                 std::max<size_t>(live.size(), 1));
    return have >= need;
  }
  if (live.empty()) return have > 0;  // only leavers' counted pushes remain
  for (int32_t w : live) {
    if (membership_.joined_after(w, clock)) continue;  // Note [Joins and leaves]
    if ((it == pending_.end() || it->second.count(w) == 0) && !snapshots_.lost_push(w, clock))
      return false;
    if (options_.sealed_pushes && membership_.sealed(w) <= clock) return false;
  }
  return true;
}

// See Note [Sealed pushes] (server_membership.cpp): sync applies the steps the seal completes,
// the other modes the worker's pushes of the clocks it sealed.
void ServerSteps::apply_sealed(int32_t w, int64_t clock) {
  if (options_.consistency == Consistency::kSync) {
    apply_ready_steps();
    return;
  }
  auto& mine = unsealed_[w];
  while (!mine.empty() && mine.begin()->first < clock) {
    auto node = mine.extract(mine.begin());
    registry_.apply(node.mapped().dense, node.mapped().sparse);
    ++step_;
    leases_.finish(w, node.mapped());
    recycle(w, node.mapped());
    snapshots_.take_when_due(step_);
  }
}

void ServerSteps::discard_pushes(int32_t w) {
  for (auto& [step, pushes] : pending_) pushes.erase(w);
}

void ServerSteps::drop_pushes_from(int32_t w, int64_t sealed) {
  if (options_.consistency == Consistency::kSync) {
    for (auto& [step, pushes] : pending_)
      if (step >= sealed) pushes.erase(w);
  } else {
    auto& mine = unsealed_[w];
    for (auto it = mine.begin(); it != mine.end();)
      it = it->first >= sealed ? mine.erase(it) : std::next(it);
  }
}

void ServerSteps::release_batches(int32_t w) {
  if (!leases_.open()) return;
  std::set<int64_t> counted;  // batches of pushes still to be applied with their step
  for (const auto& [step, pushes] : pending_) {
    auto it = pushes.find(w);
    if (it != pushes.end() && it->second.batch >= 0 && it->second.epoch == leases_.epoch())
      counted.insert(it->second.batch);
  }
  leases_.release(w, counted);
}

std::string ServerSteps::describe_sync_wait(int64_t step) const {
  auto it = pending_.find(step);
  std::vector<int32_t> have, missing;
  std::set<int32_t> unsealed;
  for (int32_t w : membership_.live()) {
    if (membership_.joined_after(w, step)) continue;
    const bool pushed = it != pending_.end() && it->second.count(w) != 0;
    if (pushed && options_.sealed_pushes && membership_.sealed(w) <= step) unsealed.insert(w);
    if (pushed && unsealed.count(w) == 0)
      have.push_back(w);
    else
      missing.push_back(w);
  }
  std::string text = "step " + std::to_string(step) + " to be applied (pushed by workers " +
                     list_workers(have) + "; waiting for workers ";
  std::string waiting;
  for (int32_t w : missing)
    waiting += (waiting.empty() ? "" : ", ") + std::to_string(w) + " at clock " +
               std::to_string(membership_.clock(w)) +
               (unsealed.count(w) != 0 ? " (not sealed)" : "");
  return text + (waiting.empty() ? "none" : waiting) + ")";
}

// Sync: a push waits in pending_ for its step, in storage kept per worker from its pushes before
// (see Note [A step's sum without allocations]): the values are copied in place, not allocated.
//
// Note [Taking a push's storage]: the transport decodes each push into a request its gRPC thread
// keeps, and needs it no more once the handler returns. Copying its dense values into the held
// push was one more pass over the model's size per worker and step on the server, on the step's
// critical path in sync (a worker waits for the step). push_taking swaps the two instead: the
// held push gets the values, the transport's request gets the held push's storage from an
// earlier step, of the same sizes, which its next decode refills without allocating. A replica's
// primary forwards the request after handling it, so ReplicatedHandler keeps Handler's default
// (a copy); the in-process core of a job of one takes the client's own request, which the client
// refills at its next step. An elastic job's unsealed pushes (async, ssp) are held alike.
//
// Note [Pushes read in place]: a push whose values came through the worker's shared segment
// (Note [Values in shared memory], wire.h) is not copied out of it at all: its dense slices view
// the segment (DenseSlice::view), which the held push keeps mapped (PushRequest::keep), and the
// step's sum reads the gradients there. That is safe because a worker writes its segment with a
// server again only in its next call to that server, and every mode answers that call after the
// push is applied: in sync the worker's next call is the pull of the step after it, answered once
// the step is summed (the pull is the one that seals an elastic job's push); an elastic job's
// unsealed pushes in async and ssp are applied when the pull seals them, before the pull answers;
// the other pushes are applied in their own call. A worker that gave up on a call (its deadline)
// takes a new segment for the next one, and the server's mapping keeps the old one's memory. A
// held push that is discarded (a leaver's, a dropped one) is never read.
void ServerSteps::buffer_push(const PushRequest& request, PushRequest* take) {
  pending_[request.clock].emplace(request.worker, hold(request, take));
}

PushRequest ServerSteps::hold(const PushRequest& request, PushRequest* take) {
  PushRequest held;
  auto spare = spare_.find(request.worker);
  if (spare != spare_.end()) {
    held = std::move(spare->second);
    spare_.erase(spare);
  }
  held.worker = request.worker;
  held.clock = request.clock;
  held.rows = request.rows;
  held.epoch = request.epoch;
  held.batch = request.batch;
  held.gradient_sqr = request.gradient_sqr;
  held.dense.resize(request.dense.size());
  for (size_t i = 0; i < request.dense.size(); ++i) {
    const DenseSlice& from = request.dense[i];
    DenseSlice& to = held.dense[i];
    to.table = from.table;
    to.view = from.view;  // Note [Pushes read in place]
    to.view_count = from.view_count;
    if (take != nullptr) {
      to.chunks.swap(take->dense[i].chunks);
      if (from.view == nullptr) to.values.swap(take->dense[i].values);
    } else {
      to.chunks.assign(from.chunks.begin(), from.chunks.end());
      if (from.view == nullptr) to.values.assign(from.values.begin(), from.values.end());
    }
  }
  held.keep = request.keep;
  held.sparse = request.sparse;  // rows are few; their storage is not worth keeping
  return held;
}

void ServerSteps::recycle(int32_t worker, PushRequest& push) {
  push.sparse.clear();
  push.keep.reset();  // the worker's segment is no longer read here
  for (DenseSlice& slice : push.dense) slice.view = nullptr;
  spare_[worker] = std::move(push);
}

void ServerSteps::recycle(std::map<int32_t, PushRequest>& pushes) {
  for (auto& [worker, push] : pushes) recycle(worker, push);
}

}  // namespace shoal::ps::detail
