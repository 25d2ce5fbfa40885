// The memory that the co-located members of a group share (docs/comm.md, "Shared memory among
// co-located workers"). Torch-free.
//
// Note [Segment by /proc]: member 0 creates the segment as a memfd (anonymous memory: it has no
// name in any file system, and the kernel frees it when the last process holding an fd or a
// mapping of it ends, so nothing outlives the job even when every member is SIGKILLed) and seals
// its size, so that no mapping can ever fault past its end. It names the segment in a handle,
// "shm1 <pid> <fd> <locality key> <tag> <bytes>", that the wiring hands to the other members
// through the group's store (tests: through a pipe). A member opens /proc/<pid>/fd/<fd>, which the
// kernel allows only to a process that may ptrace the creator (the same user; measured to work
// here for src/ps/shm.h, Note [Shared segments]), and uses the segment only when its locality key
// is the handle's, its size and seals are as named, and the random 128-bit tag (getrandom, one per
// group) stands in its header. A pid and fd of another job (or a reused pid) therefore carry
// another tag and are refused: two jobs never share a segment.
// Why not SCM_RIGHTS over a Unix socket: it needs a socket per member, an accepting side and an
// address of its own to rendezvous on; /proc needs nothing but the one string, which the store
// carries anyway. What the /proc way costs: the creator must live until the others have opened
// the segment (when it does not, they fail naming it, which they would have to do anyway).
// Why not pidfd_getfd(2): it needs PTRACE_MODE_ATTACH, which Yama (ptrace_scope 1) refuses to
// non-descendants, while /proc's fd links need only PTRACE_MODE_READ.
// Why not shm_open: a name in /dev/shm outlives a job whose processes are all SIGKILLed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace shoal::comm::shm {

// What the memfd's name starts with; /proc/<pid>/fd links show "/memfd:shoal-shm-<tag> (deleted)",
// with the first 16 hex digits of the group's tag.
inline constexpr char kMemfdPrefix[] = "shoal-shm-";

// Sizes of the parts of a segment. Every member of a group must use the same values: the
// creator writes them into the header and the others take them from there.
struct SegmentSizes {
  // Bytes of one member's slot in one of the two buffers of collective data; a collective moves
  // data through the slots in pieces of this size (double-buffered), so a larger slot means
  // fewer synchronisations per byte and more memory (2 * size * slot_bytes in all).
  size_t slot_bytes = size_t{1} << 20;
  // Bytes of the ring of each ordered pair of members, for send/recv (a power of two; 0: the
  // group's default_channel_bytes). A message up to this size (less 16 bytes of header) is sent
  // without waiting for the receiver; a larger one goes in turns with it, each side woken once
  // per ringful.
  size_t channel_bytes = 0;
};

// Note [Ring size]: a ring of 4 MiB takes a message of up to 4 MiB less its 16-byte header in
// one go, e.g. a pipeline's activation of 512 x 512 floats (1 MiB); with 256 KiB, even one of
// 128 x 512 floats went in turns (bench/RESULTS.md, "pipeline, 2026-11-28, 19:50-20:20 UTC").
// The kernel gives a ring its pages only as they are used, so pairs that never talk cost address
// space alone; but there are k x k rings, so past 8 members the ring halves until they take at
// most 256 MiB together, down to 256 KiB (1 GiB at 64 members).
inline size_t default_channel_bytes(int members) {
  constexpr size_t kLargest = size_t{4} << 20, kSmallest = size_t{256} << 10;
  constexpr size_t kAllRings = size_t{256} << 20;
  const size_t pairs = static_cast<size_t>(members) * static_cast<size_t>(members);
  size_t bytes = kLargest;
  while (bytes > kSmallest && pairs * bytes > kAllRings) bytes /= 2;
  return bytes;
}

// Note [Shared buffers]: memory that one member allocates and every other member of its group maps
// too (LocalGroup::allocate), so that a collective on a buffer in it reads and writes each member's
// buffer where it lies, with no copy through the slots (Note [All-reduce in shared buffers] in
// local_group.cpp). Made like the segment: a sealed memfd, opened by the others through
// /proc/<pid>/fd/<fd> while its creator still holds the fd, and freed by the kernel once the last
// mapping of it is gone. A Mapping is one process's mapping of such a memfd; movable, unmaps on
// destruction.
class Mapping {
 public:
  // A new memfd named `name` of `bytes` bytes (more than 0), sealed against resizing, mapped.
  // CommError (one line) when the system refuses.
  static Mapping create(const std::string& name, size_t bytes);
  // Member `pid`'s memfd `fd`, which must be named `name` and hold `bytes`, mapped (and its fd
  // here closed again); CommError naming what was wrong otherwise. `read_only`: mapped so (a
  // write into it is a fault).
  static Mapping open(int pid, int fd, const std::string& name, size_t bytes,
                      bool read_only = false);

  Mapping() = default;
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  unsigned char* data() const { return static_cast<unsigned char*>(base_); }
  size_t bytes() const { return bytes_; }
  int fd() const { return fd_; }
  // Once the others have opened it: the mapping alone keeps the memory.
  void close_fd();

 private:
  friend class Segment;
  void map(int fd, size_t bytes, bool read_only = false);
  void release();
  int fd_ = -1;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// A futex word and the count of processes sleeping on it, alone in 128 bytes (two cache lines:
// adjacent-line prefetchers pull lines in pairs), so that one member's writes never slow down
// another's reads of its own word.
struct alignas(128) Counter {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> waiters;
};

// A member's place in the segment.
struct alignas(128) MemberBlock {
  Counter seq;                     // arrivals of this member in collectives (Note [Phases])
  std::atomic<uint32_t> attached;  // 1 once the member has opened the segment and written below
  int32_t pid;
  uint64_t start_time;  // /proc/<pid>/stat field 22, against pid reuse
};

// Send/recv from one member to another: a byte ring (Note [Channels] in channel.h).
struct ChannelBlock {
  Counter head;  // bytes written by the sender, modulo 2^32
  Counter tail;  // bytes consumed by the receiver, modulo 2^32
};

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t size;  // members
  unsigned char tag[16];
  uint64_t slot_bytes;
  uint64_t channel_bytes;
  uint64_t total_bytes;
  // The first member that raised an error in a collective, plus one (0: none), what kind of
  // error it was (FailureKind, sync.h), the member it lost (for kLost) and its message: the others
  // quote it instead of waiting for their own deadline. Written before `failed` is released.
  std::atomic<int32_t> failed;
  int32_t failure_kind;
  int32_t failure_member;
  char failure[500];
  // Note [Taking chunks] (local_group.cpp): the call that last took a chunk of an all-reduce in
  // shared buffers (high 32 bits: its phase) and the next chunk to take (low 32 bits). Alone in
  // its cache lines: every member's reduction writes it.
  alignas(128) std::atomic<uint64_t> next_chunk;
};

// One mapping of a group's segment, created or opened. Movable, not copyable; unmaps and closes
// on destruction.
class Segment {
 public:
  // Creates the segment of a group of `size` members. Raises CommError when the system refuses
  // (no memfd, no memory).
  static Segment create(int size, const SegmentSizes& sizes = {});
  // Opens the segment a handle names, for a group of `size` members. Raises CommError (one line)
  // naming what was wrong: another host, a gone creator, a wrong tag, size or seals.
  static Segment open(const std::string& handle, int size);

  Segment(Segment&& other) noexcept = default;
  Segment& operator=(Segment&& other) noexcept = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // The memfd name of the group's shared buffer number `id` (Note [Shared buffers]).
  std::string buffer_name(int64_t id) const;
  // What the other members pass to open(); only the creator's is valid for that.
  const std::string& handle() const { return handle_; }
  int size() const { return static_cast<int>(header()->size); }
  size_t slot_bytes() const { return header()->slot_bytes; }
  size_t channel_bytes() const { return header()->channel_bytes; }
  size_t bytes() const { return memory_.bytes(); }

  SegmentHeader* header() const {
    return static_cast<SegmentHeader*>(static_cast<void*>(memory_.data()));
  }
  MemberBlock* member(int m) const;
  // Row m of the table where collectives publish small per-member values (all_to_all's sizes):
  // two halves of 2 * size + 2 int64 each, used alternately by successive calls, so that a member
  // that runs ahead into the next call never overwrites what a slower one has yet to read.
  int64_t* published(int m) const;
  ChannelBlock* channel(int from, int to) const;
  unsigned char* ring(int from, int to) const;
  // Member m's slot in buffer b (0 or 1); the slots of one buffer are contiguous, in member order.
  unsigned char* slot(int buffer, int m) const;

 private:
  Segment() = default;
  Mapping memory_;
  std::string handle_;
};

}  // namespace shoal::comm::shm
