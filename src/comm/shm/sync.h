// Waiting on the members of a shared segment (docs/comm.md, "Shared memory among co-located
// workers"). Torch-free.
//
// Note [Waiting with a deadline]: a wait for a counter in the segment spins briefly (a member that
// is running on another core usually arrives within microseconds), then sleeps on the counter
// with FUTEX_WAIT (shared, not FUTEX_PRIVATE: the word is in a MAP_SHARED segment and the waker is
// another process) in slices of at most 10 ms. Between slices it looks at (1) whether another
// member has already failed in this group (SegmentHeader::failed), (2) whether a member's process
// has ended (pidfd_open(2) + poll: a pidfd turns readable when its process exits, with no race
// against pid reuse; where there is no pidfd, kill(pid, 0) and the start time in /proc/<pid>/stat)
// and (3) the deadline. So a SIGKILLed member is named within ~10 ms plus scheduling, a stopped one
// at the deadline. Shared memory gives no connection reset, which is what tells Gloo at once.
// A waker raises the counter, then wakes only when the count of sleepers is not zero: both sides
// use sequentially consistent operations in opposite order (the sleeper counts itself, then reads
// the counter; the waker writes the counter, then reads the count), so one of them always sees
// the other, and FUTEX_WAIT itself refuses to sleep when the counter has already moved.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/shm/segment.h"
#include "shoal/core/error.h"
#include "shoal/core/timeout.h"

namespace shoal::comm::shm {

// /proc/<pid>/stat's start time (clock ticks since boot), 0 when the process is gone.
uint64_t process_start_time(pid_t pid);

// The processes of a group's members, watched for their end.
class Liveness {
 public:
  Liveness() = default;
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;
  ~Liveness();

  // Watches `member`, process `pid` started at `start_time` (a process by that pid that started
  // at another time is a new process, and the member counts as ended).
  void watch(int member, pid_t pid, uint64_t start_time);
  // The first watched member (in member order; only `member` when it is >= 0) whose process has
  // ended, or -1.
  int ended(int member = -1) const;
  pid_t pid(int member) const;

 private:
  struct Peer {
    int member;
    pid_t pid;
    uint64_t start_time;
    int pidfd;    // -1 when pidfd_open is unavailable
    bool reused;  // the pid named another process already when watching began
  };
  std::vector<Peer> peers_;
};

// What ended a wait, so that the wiring words it as it does Gloo's failures.
enum class FailureKind : int32_t { kOther = 0, kTimedOut = 1, kLost = 2 };

// A wait failed: its deadline passed (kTimedOut), a member's process ended (kLost, `member` names
// it), or, with `first` >= 0, member `first` failed that way first and said so in the segment.
class WaitFailed : public CommError {
 public:
  WaitFailed(const std::string& what, FailureKind kind, int member, int first = -1)
      : CommError(what), kind(kind), member(member), first(first) {}
  FailureKind kind;
  int member;  // the lost member (kLost), else -1
  int first;   // the member that failed first, or -1: this one
};

// What a wait is part of, for its errors.
struct WaitScope {
  const Segment* segment;
  const Liveness* liveness;
  int self;               // this member
  const char* operation;  // "all_reduce", ...
  Deadline deadline;
  int watch = -1;    // the only member whose end fails the wait; -1: any member's
  int spins = 2000;  // checks before sleeping (Note [Waiting with a deadline])
  // Set by another thread when nobody waits for the operation any more (its caller gave up at
  // an earlier deadline of its own): the wait then raises CommError at its next slice.
  const std::atomic<bool>* cancelled = nullptr;
};

// True when `value` has reached `target`, counting modulo 2^32 (members are never 2^31 apart).
inline bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// Blocks until counter `c` reaches `target` (Note [Waiting with a deadline]); `member` is whose
// counter it is, for the error. Raises CommError (one line) when a member ends, another member
// failed first, or the deadline passes.
void wait_for(Counter& c, uint32_t target, int member, const WaitScope& scope);

// Sets counter `c` to `value` and wakes its sleepers.
void advance(Counter& c, uint32_t value);

}  // namespace shoal::comm::shm
