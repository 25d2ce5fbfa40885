#include "comm/shm/executor.h"

#include <cstring>

#include "shoal/core/error.h"

namespace shoal::comm::shm {

bool Task::wait_for(Duration limit) {
  std::unique_lock<std::mutex> lock(mutex_);
  return ended_.wait_for(lock, limit, [&] { return done_; });
}

bool Task::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

std::exception_ptr Task::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void Task::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  ended_.notify_all();
}

// Runs one queued operation; returns how it failed (null: it succeeded).
std::exception_ptr Executor::run(Queued& next) {
  std::exception_ptr error;
  try {
    next.operation();
  } catch (...) {
    error = std::current_exception();
  }
  next.operation = nullptr;  // let go of what the operation kept alive before saying it is done
  return error;
}

// A queue and the thread that runs it (Note [Lanes]). `busy` while an operation of the lane runs,
// on its thread or on a waiter's (Note [Running on the waiter]): the lane's operations run one at
// a time, in the order queued, wherever they run. The thread takes the front operation once it is
// woken, i.e. not left to its caller; when stopping, whatever is queued.
struct Executor::Lane {
  std::mutex mutex;
  std::condition_variable queued;
  std::deque<Queued> queue;
  bool busy = false;
  bool stopping = false;
  std::thread thread;

  void loop() {
    for (;;) {
      Queued next;
      {
        std::unique_lock<std::mutex> lock(mutex);
        queued.wait(lock, [&] {
          if (queue.empty()) return stopping;
          return !busy && (queue.front().woken || stopping);
        });
        if (queue.empty()) return;  // stopping, nothing left
        next = std::move(queue.front());
        queue.pop_front();
        busy = true;
      }
      const auto error = run(next);
      {
        // Idle before the Task ends, so that its waiter finds the lane free for its next one.
        std::lock_guard<std::mutex> lock(mutex);
        busy = false;
      }
      next.task->finish(error);
    }
  }
};

// The receiving side of one source's channel (Note [Matching by tag]).
struct Executor::Receiver {
  struct Posted {
    uint32_t tag;
    void* data;
    size_t bytes;
    Deadline deadline;
    std::shared_ptr<void> keep;
    std::shared_ptr<Task> task;
  };
  struct Kept {
    uint32_t tag;
    std::vector<unsigned char> payload;
  };

  LocalGroup* group;
  int src;
  std::mutex mutex;  // guards posted, kept and stopping
  std::condition_variable changed;
  std::deque<Posted> posted;
  std::deque<Kept> kept;
  bool stopping = false;
  std::thread thread;

  UsageError wrong_size(const Posted& p, uint64_t got) const {
    return UsageError("shared-memory recv: member " + std::to_string(group->rank()) +
                      " expected " + std::to_string(p.bytes) + " bytes with tag " +
                      std::to_string(p.tag) + " from member " + std::to_string(src) +
                      ", which sent " + std::to_string(got));
  }

  // Completes receive `p` with a message read earlier.
  void deliver(Posted& p, const Kept& message) const {
    if (message.payload.size() != p.bytes) {
      p.task->finish(std::make_exception_ptr(wrong_size(p, message.payload.size())));
      return;
    }
    std::memcpy(p.data, message.payload.data(), p.bytes);
    p.keep.reset();
    p.task->finish(nullptr);
  }

  // On the caller's thread: a kept message completes the receive at once; else it is posted.
  void post(Posted p) {
    std::unique_lock<std::mutex> lock(mutex);
    for (auto it = kept.begin(); it != kept.end(); ++it) {
      if (it->tag != p.tag) continue;
      Kept message = std::move(*it);
      kept.erase(it);
      lock.unlock();
      deliver(p, message);
      return;
    }
    posted.push_back(std::move(p));
    changed.notify_one();
  }

  void loop() {
    for (;;) {
      Deadline deadline(Duration(0));
      {
        std::unique_lock<std::mutex> lock(mutex);
        changed.wait(lock, [&] { return stopping || !posted.empty(); });
        if (posted.empty()) return;  // stopping, nothing waits
        // The header is awaited for as long as the most patient receive waits.
        deadline = posted.front().deadline;
        for (const auto& p : posted) {
          if (p.deadline.remaining() > deadline.remaining()) deadline = p.deadline;
        }
      }
      try {
        const auto header = group->read_header(src, deadline.remaining());
        std::unique_lock<std::mutex> lock(mutex);
        auto match = posted.begin();
        while (match != posted.end() && match->tag != header.tag) ++match;
        if (match == posted.end()) {
          Kept other{header.tag, std::vector<unsigned char>(header.bytes)};
          lock.unlock();
          group->read_payload(src, other.payload.data(), header.bytes, deadline.remaining());
          lock.lock();
          // A receive for it may have been posted while the payload was read, after it looked
          // among the kept ones: it takes the message now, or the message is kept.
          match = posted.begin();
          while (match != posted.end() && match->tag != header.tag) ++match;
          if (match == posted.end()) {
            kept.push_back(std::move(other));
            continue;
          }
          Posted p = std::move(*match);
          posted.erase(match);
          lock.unlock();
          deliver(p, other);
          continue;
        }
        Posted p = std::move(*match);
        posted.erase(match);
        lock.unlock();
        if (header.bytes != p.bytes) {
          group->read_payload(src, nullptr, header.bytes, p.deadline.remaining());
          p.task->finish(std::make_exception_ptr(wrong_size(p, header.bytes)));
        } else {
          group->read_payload(src, p.data, p.bytes, p.deadline.remaining());
          p.keep.reset();
          p.task->finish(nullptr);
        }
      } catch (...) {
        // The channel can't be read on (a lost member, a deadline, a cancel): every receive
        // posted from this source fails alike, and so will those posted later.
        const auto error = std::current_exception();
        std::deque<Posted> failed;
        {
          std::lock_guard<std::mutex> lock(mutex);
          failed.swap(posted);
        }
        for (auto& p : failed) p.task->finish(error);
        std::unique_lock<std::mutex> lock(mutex);
        failing(lock, error);
        return;
      }
    }
  }

  // After a failure: fails every receive posted from now on, until stopping.
  void failing(std::unique_lock<std::mutex>& lock, const std::exception_ptr& error) {
    for (;;) {
      changed.wait(lock, [&] { return stopping || !posted.empty(); });
      std::deque<Posted> failed;
      failed.swap(posted);
      lock.unlock();
      for (auto& p : failed) p.task->finish(error);
      lock.lock();
      if (stopping && posted.empty()) return;
    }
  }
};

Executor::Executor(std::unique_ptr<LocalGroup> group) : group_(std::move(group)) {}

Executor::~Executor() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, lane] : lanes_) {
    std::lock_guard<std::mutex> queue_lock(lane->mutex);
    lane->stopping = true;
    lane->queued.notify_all();
  }
  for (auto& [id, receiver] : receivers_) {
    std::lock_guard<std::mutex> posted_lock(receiver->mutex);
    receiver->stopping = true;
    receiver->changed.notify_all();
  }
  // An operation still running may wait for peers that will never come (its caller gave up on
  // it); cancelling ends its wait within a slice, and what is still queued fails at once.
  group_->cancel();
  for (auto& [id, lane] : lanes_) lane->thread.join();
  for (auto& [id, receiver] : receivers_) receiver->thread.join();
}

std::shared_ptr<Task> Executor::enqueue(int id, std::function<void()> operation, bool wake) {
  auto task = std::make_shared<Task>();
  Lane* lane;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = lanes_[id];
    if (!slot) {
      slot = std::make_unique<Lane>();
      slot->thread = std::thread([lane = slot.get()] { lane->loop(); });
    }
    lane = slot.get();
  }
  task->lane_ = id;
  {
    std::lock_guard<std::mutex> lock(lane->mutex);
    lane->queue.push_back({std::move(operation), task, wake});
  }
  if (wake) lane->queued.notify_one();
  return task;
}

// Note [Running on the waiter]
// A lane's thread sleeps between operations, so an operation costs two hand-offs between threads
// beside its own work: the lane's thread is woken to run it, and the caller is woken when it ends.
// For a small all-reduce those are most of its time (0.1 ms on two cores, where the collective
// itself takes microseconds), and on a machine with no idle core the woken thread must also wait
// for one. A caller that waits for an operation nothing runs yet has nothing else to do: it runs
// the operation itself, as MPI progresses a request inside MPI_Wait. Only the operation at the
// front of an idle lane is taken, so a lane's operations still run one at a time in their order;
// when the lane's thread took it first, or runs an earlier one, the caller waits as before.
// Whether the woken lane's thread or the waiter comes first is the scheduler's choice, so a caller
// that will wait at once (a blocking collective) queues its operation without waking the lane,
// and the lane leaves it to the caller: it runs on the caller unless an earlier operation still
// holds the lane. Nothing queued that way is stranded: a waiter that cannot take its operation
// hands it, and whatever is queued before it, to the lane, and one that has run its own wakes the
// lane for what came after.
Executor::Lane* Executor::lane_of(const Task& task) {
  if (task.lane_ < 0) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = lanes_.find(task.lane_);
  return found == lanes_.end() ? nullptr : found->second.get();
}

// Marks `task`, and what is queued before it, as the lane's to run; the lane holds `mutex`.
void Executor::wake_up_to(Lane& lane, const std::shared_ptr<Task>& task) {
  for (auto& queued : lane.queue) {
    queued.woken = true;
    if (queued.task == task) break;
  }
  lane.queued.notify_one();
}

bool Executor::run_here(const std::shared_ptr<Task>& task) {
  Lane* lane = lane_of(*task);
  if (lane == nullptr) return false;
  Queued next;
  {
    std::lock_guard<std::mutex> lock(lane->mutex);
    if (lane->busy || lane->queue.empty() || lane->queue.front().task != task) {
      wake_up_to(*lane, task);  // the lane runs it after what runs or is queued before it
      return false;
    }
    next = std::move(lane->queue.front());
    lane->queue.pop_front();
    lane->busy = true;
  }
  const auto error = run(next);
  {
    std::lock_guard<std::mutex> lock(lane->mutex);
    lane->busy = false;
  }
  lane->queued.notify_one();  // the lane's thread may wait for it to be idle again
  next.task->finish(error);
  return true;
}

void Executor::hand_over(const std::shared_ptr<Task>& task) {
  Lane* lane = lane_of(*task);
  if (lane == nullptr) return;
  std::lock_guard<std::mutex> lock(lane->mutex);
  wake_up_to(*lane, task);
}

Executor::Receiver& Executor::receiver(int src) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& slot = receivers_[src];
  if (!slot) {
    slot = std::make_unique<Receiver>();
    slot->group = group_.get();
    slot->src = src;
    slot->thread = std::thread([receiver = slot.get()] { receiver->loop(); });
  }
  return *slot;
}

// Lane ids: 0 the collectives, 1 + m sends to member m.
std::shared_ptr<Task> Executor::submit(std::function<void(LocalGroup&)> operation, bool wake) {
  return enqueue(0, [this, operation = std::move(operation)] { operation(*group_); }, wake);
}

std::shared_ptr<Task> Executor::send(int dst, uint32_t tag, const void* data, size_t bytes,
                                     const Deadline& deadline, std::shared_ptr<void> keep) {
  return enqueue(1 + dst, [=, keep = std::move(keep)] {
    group_->write_message(dst, tag, data, bytes, deadline.remaining());
  });
}

std::shared_ptr<Task> Executor::recv(int src, uint32_t tag, void* data, size_t bytes,
                                     const Deadline& deadline, std::shared_ptr<void> keep) {
  group_->check_peer("recv", src);
  auto task = std::make_shared<Task>();
  receiver(src).post({tag, data, bytes, deadline, std::move(keep), task});
  return task;
}

}  // namespace shoal::comm::shm
