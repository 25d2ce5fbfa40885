// Runs a LocalGroup's operations on threads of their own, so that comm::Group's asynchronous
// operations (Work) stay asynchronous on the shared-memory path: DataParallel launches a bucket's
// all-reduce and goes on with the backward while it runs, and a pipeline posts its receives ahead,
// as over Gloo. Torch-free.
//
// Note [Lanes]: operations run in lanes, each a queue with a thread, in the order submitted to it:
// one lane for the collectives (every member calls them in the same order, and each uses the whole
// segment) and one per destination for sends (each touches only its channel: Note [Channels] in
// local_group.h); receives have a thread per source (Note [Matching by tag]). So a send waiting
// for a slow receiver holds up no collective and no other peer's messages, as Gloo's separate
// pairs do. Threads start with their first operation.
//
// Note [Matching by tag]: Gloo matches a receive to a message by source and tag, not by order, and
// callers rely on it: a pipeline posts the receives of every micro-batch's shape header before
// any activation's, and then waits for an activation first. So receives from one source are not a
// queue: a receiver thread per source reads each message's header as it comes, hands the message
// to the earliest posted receive with its tag (straight into its buffer), or, when none is
// posted, copies it out of the ring and keeps it for the receive that will want it, which takes it
// at once when posted. A message whose tag matches but whose size does not fails its receive with
// UsageError and is dropped whole, so the stream stays in step. The channel is read only while a
// receive is posted, so, as over Gloo, a message larger than the ring waits in its send until a
// receive from its destination is posted (any receive: the others' messages are kept).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/shm/local_group.h"

namespace shoal::comm::shm {

// One operation handed to the executor, and how it ended.
class Task {
 public:
  // Blocks until the operation has ended or `limit` has passed; true when it has ended.
  bool wait_for(Duration limit);
  bool done() const;
  // How it failed (null: it succeeded). Valid once done().
  std::exception_ptr error() const;

 private:
  friend class Executor;
  void finish(std::exception_ptr error);
  int lane_ = -1;  // the lane it was queued on; -1 for a receive
  mutable std::mutex mutex_;
  std::condition_variable ended_;
  bool done_ = false;
  std::exception_ptr error_;
};

class Executor {
 public:
  explicit Executor(std::unique_ptr<LocalGroup> group);
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  // Cancels what is still running or queued (CommError in each Task) and joins the lanes.
  ~Executor();

  const LocalGroup& group() const { return *group_; }

  // A collective: queued behind those submitted before it. It runs on the collectives' lane with
  // the group; whatever it throws ends its Task with that error. `operation` owns what it uses
  // (the caller may drop the Task at once). Without `wake`, the caller promises to call run_here
  // for it next (Note [Running on the waiter]): the lane leaves it to the caller unless asked.
  std::shared_ptr<Task> submit(std::function<void(LocalGroup&)> operation, bool wake = true);
  // A message to `dst`, after those submitted before to the same destination. `keep` holds `data`
  // alive until the message is written.
  std::shared_ptr<Task> send(int dst, uint32_t tag, const void* data, size_t bytes,
                             const Deadline& deadline, std::shared_ptr<void> keep = nullptr);
  // The next message from `src` with `tag` (Note [Matching by tag]), into `data`, which must hold
  // exactly `bytes`; `keep` holds it alive until then.
  std::shared_ptr<Task> recv(int src, uint32_t tag, void* data, size_t bytes,
                             const Deadline& deadline, std::shared_ptr<void> keep = nullptr);

  // Note [Running on the waiter]: when `task` is still queued at the front of a lane that runs
  // nothing, runs it on the calling thread and returns true once it has ended; otherwise hands it
  // (and what is queued before it) to the lane, which runs it, and returns false at once.
  bool run_here(const std::shared_ptr<Task>& task);
  // Gives the lane an operation queued without `wake` whose caller will not run it after all.
  void hand_over(const std::shared_ptr<Task>& task);

  // From any thread: what runs and every later operation fail with CommError (the group is
  // broken; LocalGroup::cancel).
  void cancel() { group_->cancel(); }

 private:
  struct Lane;
  struct Receiver;
  struct Queued {
    std::function<void()> operation;
    std::shared_ptr<Task> task;
    bool woken = true;  // false: its caller runs it (Note [Running on the waiter])
  };
  static std::exception_ptr run(Queued& next);
  Lane* lane_of(const Task& task);
  static void wake_up_to(Lane& lane, const std::shared_ptr<Task>& task);
  std::shared_ptr<Task> enqueue(int lane, std::function<void()> operation, bool wake = true);
  Receiver& receiver(int src);

  std::unique_ptr<LocalGroup> group_;
  std::mutex mutex_;  // guards lanes_ and receivers_
  std::map<int, std::unique_ptr<Lane>> lanes_;
  std::map<int, std::unique_ptr<Receiver>> receivers_;
};

}  // namespace shoal::comm::shm
