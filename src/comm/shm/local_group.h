// The co-located members of a group and their collectives through one shared segment (docs/comm.md,
// "Shared memory among co-located workers"). Torch-free, on raw buffers: the wiring
// into comm::Group passes tensors' data pointers.
//
// Contract (as comm::Group's): every member calls the same collectives in the same order with the
// same counts, dtype and op; send/recv pairs match in order between two members. Calls on one
// LocalGroup are not thread-safe. After a CommError the group is broken: every later call raises
// CommError at once, and the group must be replaced.
//
// Making one: member 0 calls Segment::create(size) and hands segment.handle() (a string) to the
// others, which call Segment::open(handle, size); each then constructs its LocalGroup, which
// returns once all members have joined. Member 0 must stay alive until the others have opened
// the segment (Note [Segment by /proc] in segment.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "comm/shm/reduce.h"
#include "comm/shm/segment.h"
#include "comm/shm/sync.h"
#include "shoal/core/timeout.h"

namespace shoal::comm::shm {

class LocalGroup {
 public:
  // Joins `segment` as member `rank`, waiting for every member to join (until `timeout`).
  // `timeout` is also every operation's default deadline.
  LocalGroup(Segment segment, int rank, Duration timeout);
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // In place: every member ends with the reduction of all members' `count` elements.
  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op,
                  Duration timeout = kUnsetTimeout);
  // In place: every member ends with root's `count` elements.
  void broadcast(void* data, size_t count, DType dtype, int root, Duration timeout = kUnsetTimeout);
  // out = member 0's counts[0] elements, then member 1's counts[1], ...; `in` holds
  // counts[rank()] elements and may be out's own part (in place) but no other overlap of out.
  void all_gather(const void* in, void* out, const std::vector<size_t>& counts, DType dtype,
                  Duration timeout = kUnsetTimeout);
  // `in` holds sum(counts) elements, cut in member order; out gets the reduction of every member's
  // part rank() (counts[rank()] elements). out may be in's own part, no other overlap of in.
  void reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, DType dtype,
                      ReduceOp op, Duration timeout = kUnsetTimeout);
  // in: send_counts[m] elements for each member m, in member order; out: recv_counts[m] from each
  // member m, in member order. in and out must not overlap. Counts are checked against the
  // senders' (UsageError on every member when they disagree).
  void all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                  const std::vector<size_t>& recv_counts, DType dtype,
                  Duration timeout = kUnsetTimeout);
  void barrier(Duration timeout = kUnsetTimeout);
  // Note [Shared buffers] (segment.h): `bytes` of memory that every member maps, allocated by all
  // members together (each calls it in the same order with the same bytes; UsageError on every
  // member otherwise). Returns this member's buffer, which lives while the pointer or a copy of it
  // does. An all_reduce of a part of it that every member passes at the same offset reads and
  // writes the members' buffers in place (Note [All-reduce in shared buffers]). Null on every
  // member alike when some member could not make or map its buffer: the caller then uses memory
  // of its own, and the collectives copy as usual.
  std::shared_ptr<unsigned char> allocate(size_t bytes, Duration timeout = kUnsetTimeout);
  // Whether [data, data + bytes) lies in one of this member's live shared buffers.
  bool in_shared_buffer(const void* data, size_t bytes) const {
    return find_shared(data, bytes) != nullptr;
  }
  // Note [Channels]: messages from one member to another go, in order, through a ring of their
  // own; a send returns once its bytes are in the ring, so one that fits (channel_bytes less a
  // 16-byte header) never waits for the receiver; a larger one waits for the receiver to drain it.
  // recv checks that the next message has the expected tag and size (UsageError otherwise):
  // messages are matched in order, not by tag.
  void send(const void* data, size_t bytes, int dst, uint32_t tag,
            Duration timeout = kUnsetTimeout);
  void recv(void* data, size_t bytes, int src, uint32_t tag, Duration timeout = kUnsetTimeout);

  // UsageError unless `peer` is another member ("send"/"recv" name the operation).
  void check_peer(const char* operation, int peer) const;

  // The channels' parts, for callers that match messages by tag themselves (Executor). Unlike the
  // calls above they neither check the group's state nor break it on failure. Calls on different
  // channels may run on different threads at once; calls on one channel must not.
  struct MessageHeader {
    uint32_t tag;
    uint32_t reserved;
    uint64_t bytes;
  };
  // Writes one whole message into the channel to `dst`, waiting for room as the receiver drains.
  void write_message(int dst, uint32_t tag, const void* data, size_t bytes, Duration timeout);
  // The header of the next message from `src`; then read_payload must take its `bytes`.
  MessageHeader read_header(int src, Duration timeout);
  // The payload of the message whose header was read last from `src`, into `data` (null: dropped).
  void read_payload(int src, void* data, size_t bytes, Duration timeout);

  // From any thread: a wait in progress (and every later one) raises CommError within a wait
  // slice (10 ms); for callers that gave up on an operation at a deadline of their own.
  void cancel() { cancelled_.store(true, std::memory_order_release); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

 private:
  // Note [Phases]: in a collective every member advances its own counter once per phase, the same
  // number of times in every member, so counter value c means "done with phase c"
  // (local_group.cpp).
  void arrive();
  void wait_member(int m, uint32_t target, const WaitScope& scope);
  void wait_all(uint32_t target, const WaitScope& scope);
  // The buffer (0/1) the next piece uses, once every member is done with its previous piece.
  int next_buffer(const WaitScope& scope);
  // Marks buffer b free once every member has arrived again.
  void free_after(int b);
  // Piece by piece: every member publishes its parts of blocks other than its own, then member r
  // reduces block r (Note [All-reduce]).
  // With `check`, the first piece's synchronisation also compares the calls published in half
  // `check->half` and stops, with what differs in `check->mismatch`, when they disagree.
  struct Check {
    size_t half;
    std::string mismatch;
  };
  void reduce_blocks(const char* operation, const void* in, const std::vector<size_t>& counts,
                     DType dtype, ReduceOp op, void* out, bool gather, Duration timeout,
                     Check* check = nullptr);
  // A member's buffer allocated together with the others', and where the others' lie here.
  struct SharedBuffer {
    int64_t id = 0;
    std::weak_ptr<unsigned char> mine;
    size_t bytes = 0;
    std::vector<unsigned char*> bases;  // every member's, in member order
    std::vector<Mapping> others;
  };
  // The shared buffer that holds [data, data + bytes) in this member, or null.
  const SharedBuffer* find_shared(const void* data, size_t bytes) const;
  // The buffer in place: the members take chunks of it, and reduce each into every member's.
  void reduce_in_place(const SharedBuffer& buffer, size_t offset, size_t count, DType dtype,
                       ReduceOp op, const WaitScope& scope);
  // Note [Checking a call]: writes `values` into this member's row of the next half of the
  // table, and returns that half; after the next synchronisation every member may read them.
  size_t publish(std::initializer_list<int64_t> values);
  // This member's row in the next half of the table (2 * size + 2 values), and that half.
  int64_t* next_row(size_t& half);
  const int64_t* published(int m, size_t half) const;
  // What differs between member 0's all_reduce and another's (empty: nothing), from the table.
  std::string compare_calls(size_t half) const;
  WaitScope scope(const char* operation, Duration timeout, int watch = -1) const;
  // Moves n bytes between the ring of (from, to) and `bytes` (null: padding, or dropped).
  void write_ring(int to, const unsigned char* bytes, size_t n, const WaitScope& scope);
  void read_ring(int from, unsigned char* bytes, size_t n, const WaitScope& scope);
  // Runs body; on CommError marks the group broken and tells the other members.
  template <typename Body>
  void run(const char* operation, Body&& body);

  Segment segment_;
  int rank_;
  int size_;
  Duration timeout_;
  Liveness liveness_;
  int spins_ = 0;                 // Note [Spinning]
  uint32_t seq_ = 0;              // this member's counter (Note [Phases])
  uint32_t free_at_[2] = {0, 0};  // the phase after which all members are done with each buffer
  int buffer_ = 0;
  size_t table_half_ = 0;  // which half of the published table the next call uses
  std::vector<SharedBuffer> shared_;
  int64_t next_shared_id_ = 0;
  std::string broken_;     // the first error, once broken
  std::atomic<bool> cancelled_{false};
};

}  // namespace shoal::comm::shm
