// A parameter server's steps (part of ServerCore, server_core.h, which calls it with its lock
// held; it takes no lock itself): the step (steps applied in sync, pushes applied in the others),
// the pushes waiting to be applied (sync: for their step, Note [Server 0 decides] with backup
// workers; elastic jobs: for their seal, Note [Sealed pushes]) in storage kept from step to step
// (Note [Taking a push's storage]), and the steps applied as they complete (server_sum.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "messages.h"
#include "server_sum.h"

namespace shoal::ps::detail {

struct ServerCoreOptions;
class ServerLeases;
class ServerMembership;
class ServerRegistry;
class ServerSnapshots;

class ServerSteps {
 public:
  ServerSteps(const ServerCoreOptions& options, ServerRegistry& registry,
              const ServerMembership& membership, ServerLeases& leases, ServerSnapshots& snapshots);
  ServerSteps(const ServerSteps&) = delete;
  ServerSteps& operator=(const ServerSteps&) = delete;

  int64_t step() const { return step_; }
  // Sync: the last applied step's part of the gradient-noise measurement (server_sum.h).
  const NoisePart& noise() const { return sum_.noise(); }
  // Sync, after a reload: the step adopted from the workers' clocks (Note [Clocks after a reload]).
  void set_step(int64_t step) { step_ = step; }

  // A checked push of its worker's next step, whose clock has counted it: applied at once, held
  // until sealed, or buffered until its step is complete. False when the step was full without it
  // (backup workers): dropped, its batch back in the ledger. `take`: the request itself when its
  // storage may be taken (Note [Taking a push's storage]).
  bool take_push(const PushRequest& request, PushRequest* take);
  // Sync: applies the open step while it is complete.
  void apply_ready_steps();
  // Sealed pushes: worker w's clock is now sealed up to `clock`; applies what that completes.
  void apply_sealed(int32_t w, int64_t clock);

  // A leaver's pushes not yet applied: all of them (discarded with its samples), those of steps
  // from `sealed` on (Note [Sealed pushes]), and its unsealed ones (it left, or a joiner starts
  // anew).
  void discard_pushes(int32_t w);
  void drop_pushes_from(int32_t w, int64_t sealed);
  void forget_unsealed(int32_t w) { unsealed_.erase(w); }
  // A leaver's ledger batches come back, but for those of its pushes still counted.
  void release_batches(int32_t w);

  // "step N to be applied (...)": what a sync pull waits for.
  std::string describe_sync_wait(int64_t step) const;

 private:
  bool step_complete(int64_t clock) const;
  // Sync: holds a push in pending_ until its step, in storage reused from the worker's last one.
  // `take`: the request itself, whose dense slices' storage is swapped with the held push's
  // rather than copied (push_taking); null: copied.
  void buffer_push(const PushRequest& request, PushRequest* take);
  // The push as held (buffer_push's, and an elastic job's unsealed pushes).
  PushRequest hold(const PushRequest& request, PushRequest* take);
  // Keeps an applied step's pushes' storage for the workers' next pushes.
  void recycle(int32_t worker, PushRequest& push);
  void recycle(std::map<int32_t, PushRequest>& pushes);

  const ServerCoreOptions& options_;
  ServerRegistry& registry_;
  const ServerMembership& membership_;
  ServerLeases& leases_;
  ServerSnapshots& snapshots_;
  ServerSum sum_;
  int64_t step_ = 0;
  std::map<int64_t, std::map<int32_t, PushRequest>> pending_;  // sync: step -> worker -> push
  // sealed_pushes, not sync: pushes received and not yet sealed, per worker by clock.
  std::map<int32_t, std::map<int64_t, PushRequest>> unsealed_;
  // Note [A step's sum without allocations]: storage kept from step to step.
  std::map<int32_t, PushRequest> spare_;  // per worker: an applied push's, for its next push
};

}  // namespace shoal::ps::detail
