// A parameter server's dense values in shared memory, for the workers on its host to copy from
// (Note [The values' mirror]). Private to src/ps; ServerRegistry keeps it, the transport names it.
//
// Note [The values' mirror]
// A pull answered through the worker's segment (Note [Pull replies in place] in
// server_registry.cpp) still cost the server a pass over the model's size per worker, one after
// the worker's own copy. A server process therefore keeps its dense values in a segment of its own
// (shm.h, created as a worker's is), every table's held chunks one after the other in the order a
// worker's pull names them: the chunks' values live there (VirtualShard::place_values; their
// optimizer state stays in the shard), so the optimizer's step writes them there, once. A pull that
// offers to read it (metadata "shoal-ps-mirror") is answered with where its values are in the
// mirror and the mirror's sequence number; the worker copies them from there into its parameters,
// then reads the sequence again. The server makes the sequence odd before a change and even after
// it, under the core's lock, so a worker that reads the same even number before and after its copy
// has values no change touched (the sequence is read before the copy, in the reply, and after it);
// another number (an async push applied meanwhile, a step completed by backup workers) and it pulls
// again without the offer. A worker maps it read-only; one on another host, or one the server's
// memory is refused to, cannot map it and stops offering. A sync worker's pull is answered once its
// step is applied, and the next change needs the worker's own next push, so in sync its copy always
// stands.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "messages.h"
#include "shm.h"

namespace shoal::ps::detail {

class ServerRegistry;

class ValuesMirror {
 public:
  // The dense chunks `registry` holds, laid out and written; nullptr when the system refuses a
  // segment (then pulls copy as before).
  static std::unique_ptr<ValuesMirror> create(ServerRegistry& registry);

  // A change of values: the sequence is odd from the first begin to the matching end.
  void begin_change();
  void end_change();
  // Every chunk's values moved into the mirror (VirtualShard::place_values), within a change:
  // at its creation, and for the chunks of a shard loaded from a snapshot.
  void place_all(ServerRegistry& registry);

  // Where the values of `slice`'s chunks are, when they are one run of the mirror.
  std::optional<size_t> run_of(const DenseSlice& slice) const;
  const std::string& handle() const { return segment_->handle(); }
  uint64_t sequence() const { return segment_->sequence().load(); }

 private:
  ValuesMirror() = default;
  std::unique_ptr<SharedSegment> segment_;
  std::vector<std::vector<int64_t>> offsets_;  // by table, by chunk: its offset, or -1
  std::vector<int64_t> numels_;                // by table (dense)
  int depth_ = 0;                              // nested begin_change()s
};

}  // namespace shoal::ps::detail
