// What a parameter server does with a request, as the transport (src/ps/rpc.h) sees it: the
// server's core implements it; the transport validates each request, calls it, and maps what it
// throws to a status the worker's client turns back into the same exception type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "messages.h"
#include "shoal/core/error.h"
#include "shoal/core/timeout.h"

namespace shoal::ps::detail {

// A request names a table (or a row range, a chunk) the server does not hold. It is a
// UsageError to the worker; on the wire it is NOT_FOUND rather than INVALID_ARGUMENT.
class NotFoundError : public UsageError {
 public:
  using UsageError::UsageError;
};

// Where a handler may write a pull reply's dense values itself rather than into the reply (a
// worker's shared segment, Note [Pull replies in place] in server_registry.cpp): `capacity` floats
// at `data`. A handler that writes there puts slice i's values right after slice i - 1's, leaves
// the reply's dense `values` empty and sets `counts`, one per dense slice; `counts` empty: it did
// not.
//
// `mirror_offered`: the worker can read the server's mirror (Note [The values' mirror] in
// mirror.h). A handler that answers from it sets `counts` as above, `mirrored` (slice i's values
// are at mirrored[i] in the mirror), the mirror's `handle` and its `sequence` then, and writes
// nothing.
struct DenseOut {
  float* data = nullptr;
  size_t capacity = 0;
  std::vector<size_t> counts;
  bool mirror_offered = false;
  std::vector<size_t> mirrored = {};
  std::string mirror = {};
  uint64_t sequence = 0;
};

// Contract: called concurrently from the transport's threads, one call per request; a call may
// block (sync pulls wait for a step) but must return or throw by `deadline`. Throws
// NotFoundError / UsageError for a request that cannot be obeyed (the server keeps serving) and
// CommError for a wait that timed out or a peer (a replica) that was lost.
class Handler {
 public:
  virtual ~Handler() = default;
  virtual void register_tables(const RegisterRequest& request, const Deadline& deadline) = 0;
  virtual PullReply pull(const PullRequest& request, const Deadline& deadline) = 0;
  // The same, written into `reply`, which the transport keeps from call to call so that its
  // storage is reused; a handler that cannot write in place has a new reply moved into it.
  virtual void pull(const PullRequest& request, const Deadline& deadline, PullReply& reply) {
    reply = pull(request, deadline);
  }
  // The same, with `out` offered for the dense values (DenseOut); a handler may ignore it.
  virtual void pull_into(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                         DenseOut& out) {
    pull(request, deadline, reply);
  }
  virtual PushReply push(const PushRequest& request, const Deadline& deadline) = 0;
  // The same, from a request its caller no longer needs once this returns (the transport's
  // decoded request): a handler may take the storage of its values and leave storage of the same
  // kind in its place, for the caller to refill. A handler that needs the request afterwards (a
  // replica forwards it) keeps this default, which leaves it as it was.
  virtual PushReply push_taking(PushRequest& request, const Deadline& deadline) {
    return push(request, deadline);
  }
  // The epoch's ledger (docs/ps.md, "Leased batches"), kept by server 0. A handler that keeps
  // none refuses.
  virtual LeaseReply lease(const LeaseRequest& request, const Deadline& /*deadline*/) {
    throw UsageError("parameter server: worker " + std::to_string(request.worker) +
                     " asked for a batch; this server keeps no ledger of batches (expected "
                     "server 0 of a job without --ps-replicas)");
  }
  // Joins and leaves of an elastic job's workers (MembershipRequest in messages.h). A handler
  // that does not seal pushes refuses.
  virtual MembershipReply membership(const MembershipRequest& request,
                                     const Deadline& /*deadline*/) {
    throw UsageError("parameter server: worker " + std::to_string(request.worker) +
                     " joins or leaves, but this server serves a job of fixed workers (expected "
                     "an elastic job: shoal run --servers S --min A --max B, without "
                     "--ps-replicas)");
  }
};

}  // namespace shoal::ps::detail
