// The locked façade over the core's parts (server_core.h): each public method takes the one
// mutex, checks the request whole, and then calls the parts, which take no lock of their own:
// the tables (server_registry.*), the workers and their clocks (server_membership.*), the steps
// and a sync step's sum (server_steps.*, server_sum.*), the ledger (server_leases.*) and the
// snapshots (server_snapshots.*).
#include "server_core.h"

#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "server_text.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"

namespace shoal::ps::detail {

ServerCoreOptions ServerCore::checked(ServerCoreOptions options) {
  if (options.consistency == Consistency::kBoundedStaleness && options.staleness == 0)
    options.consistency = Consistency::kSync;
  if (options.staleness < 0)
    throw UsageError("parameter server: staleness bound " + std::to_string(options.staleness) +
                     "; expected >= 0");
  if (options.replicas_to_aggregate < 0 ||
      (options.replicas_to_aggregate > 0 && options.consistency != Consistency::kSync))
    throw UsageError("parameter server: replicas_to_aggregate " +
                     std::to_string(options.replicas_to_aggregate) +
                     "; expected 0, or > 0 with sync consistency");
  if (options.sealed_pushes && options.replicas_to_aggregate > 0)
    throw UsageError("parameter server: sealed pushes with replicas_to_aggregate " +
                     std::to_string(options.replicas_to_aggregate) +
                     "; expected 0 (backup workers are not supported with elastic workers)");
  if (options.virtual_shards < 1)
    throw UsageError("parameter server: " + std::to_string(options.virtual_shards) +
                     " virtual shards; expected at least 1");
  for (int32_t shard : options.shards) {
    if (shard < 0 || shard >= options.virtual_shards)
      throw UsageError("parameter server: virtual shard " + std::to_string(shard) +
                       "; expected 0 <= shard < " + std::to_string(options.virtual_shards));
  }
  for (int32_t w : options.workers) {
    if (w < 0)
      throw UsageError("parameter server: worker " + std::to_string(w) + "; expected >= 0");
  }
  return options;
}

ServerCore::ServerCore(ServerCoreOptions options)
    : options_(checked(std::move(options))),
      registry_(options_),
      membership_(options_.workers),
      leases_(options_, membership_),
      snapshots_(options_, registry_, membership_),
      steps_(options_, registry_, membership_, leases_, snapshots_) {}

void ServerCore::register_tables(const RegisterRequest& request, const Deadline& deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  registry_.adopt_mode(request, options_);  // Note [The mode comes with the workers]
  ServerRegistry::check_specs(request.tables);
  // See Note [Who creates the tables].
  if (registry_.awaits_initial(request)) {
    const auto until = std::chrono::steady_clock::now() + deadline.remaining();
    if (!changed_.wait_until(lock, until, [&] { return registry_.registered(); }))
      throw CommError("parameter server: registration of worker " + std::to_string(request.worker) +
                      " timed out after " + format_duration(deadline.elapsed()) +
                      " waiting for the registration that carries the dense tables' first values"
                      " (the first worker's)");
  }
  if (registry_.registered()) {
    registry_.check_same(request);
    return;  // the first registration's values stand
  }
  registry_.create(request);
  snapshots_.restore();
  changed_.notify_all();
}

// See Note [Clocks after a reload] (server_snapshots.cpp): once every live worker's clock is
// known, the server's step (sync) is the lowest of them.
void ServerCore::adopt(int32_t w, int64_t clock) {
  const std::optional<int64_t> lowest = snapshots_.adopt(w, clock);
  if (!lowest) return;
  if (options_.consistency == Consistency::kSync) steps_.set_step(*lowest);
  if (options_.on_adopted) options_.on_adopted(snapshots_.restored_step(), *lowest);
  if (options_.consistency == Consistency::kSync) steps_.apply_ready_steps();
  changed_.notify_all();
}

// See Note [Sealed pushes] (server_membership.cpp).
void ServerCore::seal(int32_t w, int64_t clock) {
  if (!membership_.seal(w, clock)) return;
  steps_.apply_sealed(w, clock);
  changed_.notify_all();
}

int64_t ServerCore::slowest_clock() const {
  return membership_.slowest_clock(steps_.step());
}

PushReply ServerCore::push(const PushRequest& request, const Deadline& /*deadline*/) {
  return accept_push(request, nullptr);
}

PushReply ServerCore::push_taking(PushRequest& request, const Deadline& /*deadline*/) {
  return accept_push(request, &request);
}

PushReply ServerCore::accept_push(const PushRequest& request, PushRequest* take) {
  const char* what = "push";
  // With the sum of the step it completes, in sync (docs/ps.md, "A step's timeline").
  timeline::Slice slice("push", "ps", {{"worker", request.worker}, {"clock", request.clock}});
  std::lock_guard<std::mutex> lock(mutex_);
  const int32_t w = request.worker;
  membership_.check_live(what, w);
  adopt(w, request.clock);
  const int64_t next = membership_.clock(w);
  // See Note [Retried pushes] (server_core.h).
  if (request.clock == next - 1) {
    if (const PushReply* last = membership_.last_reply(w)) return *last;
  }
  if (request.clock != next)
    bad(what, "worker " + std::to_string(w) + " pushed step " + std::to_string(request.clock) +
                  "; expected its next step " + std::to_string(next));
  if (request.rows < 0 ||
      (request.rows == 0 && (!request.dense.empty() || !request.sparse.empty())))
    bad(what, "worker " + std::to_string(w) + " pushed a gradient of " +
                  std::to_string(request.rows) + " samples" +
                  (request.rows == 0 ? " with values" : "") +
                  "; expected rows >= 1, or 0 with no values (an idle step)");
  registry_.check_slices(what, request.dense, request.sparse, true);
  leases_.check_push(what, request);

  PushReply reply;
  membership_.set_clock(w, next + 1);
  reply.counted = steps_.take_push(request, take);
  reply.clock = steps_.step();
  membership_.set_last_reply(w, reply);
  changed_.notify_all();
  return reply;
}

PullReply ServerCore::pull(const PullRequest& request, const Deadline& deadline) {
  PullReply reply;
  pull(request, deadline, reply);
  return reply;
}

void ServerCore::pull(const PullRequest& request, const Deadline& deadline, PullReply& reply) {
  answer_pull(request, deadline, reply, nullptr);
}

void ServerCore::pull_into(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                           DenseOut& out) {
  answer_pull(request, deadline, reply, &out);
}

void ServerCore::answer_pull(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                             DenseOut* out) {
  const char* what = "pull";
  // With its wait for the step (sync) or the slowest worker (ssp).
  timeline::Slice slice("pull", "ps", {{"worker", request.worker}, {"clock", request.clock}});
  std::unique_lock<std::mutex> lock(mutex_);
  const int32_t w = request.worker;
  membership_.check_live(what, w);
  adopt(w, request.clock);
  const int64_t clock = membership_.clock(w);
  if (request.clock < 0 || request.clock > clock)
    bad(what, "worker " + std::to_string(w) + " pulled at clock " + std::to_string(request.clock) +
                  "; expected 0 <= clock <= " + std::to_string(clock) + " (its pushed steps)");
  registry_.check_slices(what, request.dense, request.sparse, false);
  if (options_.sealed_pushes) seal(w, request.clock);

  const auto left = [&] { return !membership_.is_live(w) || membership_.is_gone(w); };
  auto ready = [&] {
    if (left()) return true;  // it left: answered below
    switch (options_.consistency) {
      case Consistency::kSync:
        return steps_.step() >= request.clock;
      case Consistency::kBoundedStaleness:
        return slowest_clock() >= request.clock - options_.staleness;
      case Consistency::kAsync:
        return true;
    }
    return true;
  };
  const auto until = std::chrono::steady_clock::now() + deadline.remaining();
  ++pulls_waiting_;
  const bool woke = changed_.wait_until(lock, until, ready);
  --pulls_waiting_;
  if (!woke) {
    const std::string waited_for =
        options_.consistency == Consistency::kSync
            ? steps_.describe_sync_wait(steps_.step())
            : membership_.describe_staleness_wait(request.clock - options_.staleness,
                                                  options_.staleness);
    throw CommError("parameter server: pull of worker " + std::to_string(w) + " at clock " +
                    std::to_string(request.clock) + " timed out after " +
                    format_duration(deadline.elapsed()) + " waiting for " + waited_for);
  }
  if (left())
    throw CommError("parameter server: pull of worker " + std::to_string(w) + " at clock " +
                    std::to_string(request.clock) + " ended after " +
                    format_duration(deadline.elapsed()) +
                    ": the worker left the live set while it waited");

  registry_.fill_reply(request, reply, out);  // Note [Pull replies in place]
  reply.clock = steps_.step();
  reply.staleness = membership_.staleness();
  reply.noise = steps_.noise();  // Note [The gradient noise on servers] (server_sum.cpp)
}

// See Note [Joins and leaves] (server_membership.cpp) for set_live_workers, join, fence and leave.
void ServerCore::set_live_workers(const std::vector<int32_t>& workers, LeaverPush leavers) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int32_t w : workers)
    if (w < 0) bad("set_live_workers", "worker " + std::to_string(w) + "; expected >= 0");
  const std::set<int32_t> next(workers.begin(), workers.end());
  const bool sync = options_.consistency == Consistency::kSync;
  const int64_t start = sync ? steps_.step() : membership_.slowest_staying(next, steps_.step());
  std::vector<int32_t> leaving;
  for (int32_t w : membership_.live())
    if (next.count(w) == 0) leaving.push_back(w);
  if (leavers == LeaverPush::kDiscard)
    for (int32_t w : leaving) steps_.discard_pushes(w);
  for (int32_t w : leaving) steps_.release_batches(w);
  for (int32_t w : next) {
    if (membership_.is_live(w)) continue;
    membership_.start(w, start);
    steps_.forget_unsealed(w);
  }
  membership_.set_live(next);
  if (sync) steps_.apply_ready_steps();
  changed_.notify_all();
}

int64_t ServerCore::sealed_clock(int32_t worker) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return membership_.sealed_clock(worker);
}

void ServerCore::leave(int32_t w, int64_t sealed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!options_.sealed_pushes)
    bad("leave", "worker " + std::to_string(w) +
                     " leaves by its sealed clock, but this server does not seal pushes; expected "
                     "set_live_workers");
  // fenced before it ever joined here
  if (!membership_.is_live(w) && membership_.is_gone(w)) return;
  membership_.check_leaving(w);
  // Pushes before `sealed` reached every server and count here too; later ones are dropped.
  steps_.drop_pushes_from(w, sealed);
  seal(w, sealed);  // applies what it completes (not sync: its counted pushes, at once)
  membership_.remove(w);
  steps_.forget_unsealed(w);
  steps_.release_batches(w);
  if (options_.consistency == Consistency::kSync) steps_.apply_ready_steps();
  changed_.notify_all();
}

int64_t ServerCore::join(int32_t w, int64_t clock) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!options_.sealed_pushes)
    bad("join", "worker " + std::to_string(w) +
                    " joins, but this server does not seal pushes; expected an elastic job");
  const bool sync = options_.consistency == Consistency::kSync;
  const int64_t floor = sync || membership_.live().empty() ? steps_.step() : slowest_clock();
  switch (membership_.join(w, clock, floor)) {
    case ServerMembership::Joined::kStarted:
      steps_.forget_unsealed(w);
      break;
    case ServerMembership::Joined::kRaised:
      if (sync) steps_.apply_ready_steps();
      break;
    case ServerMembership::Joined::kKept:
      break;
  }
  changed_.notify_all();
  return membership_.clock(w);
}

int64_t ServerCore::fence(int32_t w) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!options_.sealed_pushes)
    bad("fence", "worker " + std::to_string(w) +
                     " is fenced off, but this server does not seal pushes; expected an elastic "
                     "job");
  const int64_t sealed = membership_.fence(w);
  changed_.notify_all();  // its pulls still waiting end
  return sealed;
}

MembershipReply ServerCore::membership(const MembershipRequest& request,
                                       const Deadline& /*deadline*/) {
  switch (request.op) {
    case MembershipRequest::Op::kJoin:
      return {join(request.worker, request.clock)};
    case MembershipRequest::Op::kFence:
      return {fence(request.worker)};
    case MembershipRequest::Op::kLeave:
      leave(request.worker, request.clock);
      return {request.clock};
  }
  throw UsageError("parameter server: unknown membership op " +
                   std::to_string(static_cast<int32_t>(request.op)));
}

LeaseReply ServerCore::lease(const LeaseRequest& request, const Deadline& /*deadline*/) {
  std::lock_guard<std::mutex> lock(mutex_);
  return leases_.lease(request);
}

std::optional<std::array<int64_t, 3>> ServerCore::ledger_counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return leases_.counts();
}

int64_t ServerCore::staleness() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return membership_.staleness();
}

int64_t ServerCore::step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return steps_.step();
}

int64_t ServerCore::clock_of(int32_t worker) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return membership_.clock_of(worker);
}

int64_t ServerCore::pulls_waiting() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pulls_waiting_;
}

size_t ServerCore::row_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return registry_.row_count();
}

std::string ServerCore::save_shard(int32_t shard) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshots_.save_shard(shard);
}

void ServerCore::load_shard(int32_t shard, const std::string& bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  snapshots_.load_shard(shard, bytes);
}

}  // namespace shoal::ps::detail
