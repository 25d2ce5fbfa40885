// Shared memory between a worker and a parameter server on one host (docs/ps.md, "Transport"):
// the float payloads of a connection's pushes and pulls cross through one segment, while gRPC
// carries the calls themselves (their deadlines, token and errors). Private to src/ps.
//
// Note [Shared segments]: the worker creates the segment as a memfd ("shoal-ps") sealed against
// resizing (a server's mapping can never fault past its end, whatever the worker does later) and
// names it in each call's metadata by a handle "v1 <pid> <fd> <boot id> <tag> <bytes>". A server
// opens /proc/<pid>/fd/<fd>, which the kernel allows only to processes that may ptrace the worker
// (the same user), and uses the segment only when the boot id is its own (the same kernel), its
// name, size and seals are as named and the random 128-bit tag stands at its start; otherwise the
// call is refused with SegmentUnusable and the client goes on without the segment. Both sides are
// comm::shm::Mapping, as the collectives' segments and shared buffers are (comm/shm/segment.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "comm/shm/segment.h"

namespace shoal::ps::detail {

// The floats a segment holds for values, after its header.
struct SharedValues {
  float* data = nullptr;
  size_t capacity = 0;  // in floats
};

// A segment's sequence number, in its header: odd while its writer changes the values (a server's
// mirror, Note [The values' mirror] in mirror.h). Read and written as atomics across processes.
class SharedSequence {
 public:
  explicit SharedSequence(uint64_t* word = nullptr) : word_(word) {}
  uint64_t load() const { return __atomic_load_n(word_, __ATOMIC_ACQUIRE); }
  // After reading values: the sequence as it is now, ordered after those reads.
  uint64_t load_after_reads() const {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(word_, __ATOMIC_RELAXED);
  }
  // The writer's: odd before its writes, even after them.
  void begin_writes() {
    __atomic_store_n(word_, __atomic_load_n(word_, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
  }
  void end_writes() {
    __atomic_store_n(word_, __atomic_load_n(word_, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
  }

 private:
  uint64_t* word_;
};

// The side that created a segment: a worker's, for its calls (one at a time), or a server's mirror
// (mirror.h).
class SharedSegment {
 public:
  // A segment with room for `floats` values; nullptr when the system refuses one (no memfd).
  static std::unique_ptr<SharedSegment> create(size_t floats);
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  SharedValues values() const { return values_; }
  const std::string& handle() const { return handle_; }
  SharedSequence sequence() const;

 private:
  SharedSegment() = default;
  comm::shm::Mapping memory_;
  SharedValues values_;
  std::string handle_;
};

// A server's view of a worker's segment.
class SegmentMapping {
 public:
  SharedValues values() const { return values_; }
  SharedSequence sequence() const;

 private:
  friend class SegmentMappings;
  SegmentMapping() = default;
  comm::shm::Mapping memory_;
  SharedValues values_;
};

// A handle that names no usable segment here (another host, another user, a segment not as
// named): the call is refused with FAILED_PRECONDITION, and the client stops offering it.
class SegmentUnusable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Mappings of others' segments, by handle, kept while used lately. Thread-safe.
class SegmentMappings {
 public:
  // Keeps the last `kept` handles' mappings (a server: its connections'; a worker's client: the
  // one server's mirror it pulls from, so that a server gone leaves none of its memory mapped).
  // `read_only`: mapped so (a worker reads a server's mirror and never writes it).
  explicit SegmentMappings(size_t kept = 64, bool read_only = false)
      : kept_count_(kept), read_only_(read_only) {}
  // The segment `handle` names; SegmentUnusable (one line) saying why not.
  std::shared_ptr<const SegmentMapping> open(const std::string& handle);

 private:
  // Connections whose segments stay mapped; the least lately used goes first.
  size_t kept_count_;
  bool read_only_;
  std::mutex mutex_;
  std::list<std::pair<std::string, std::shared_ptr<const SegmentMapping>>> kept_;
};

// This kernel's boot id (/proc/sys/kernel/random/boot_id), "" when unreadable.
const std::string& boot_id();

}  // namespace shoal::ps::detail
