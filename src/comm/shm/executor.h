// Runs a LocalGroup's operations in order on a thread of their own, so that comm::Group's
// asynchronous operations (Work) stay asynchronous on the shared-memory path: DataParallel
// launches a bucket's all-reduce and goes on with the backward while it runs, as over Gloo.
// Torch-free.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

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
  // Cancels what is still running or queued (CommError in each Task) and joins the thread.
  ~Executor();

  const LocalGroup& group() const { return *group_; }

  // Queues `operation` behind those submitted before it. It runs on the executor's thread with
  // the group; whatever it throws ends its Task with that error.
  std::shared_ptr<Task> submit(std::function<void(LocalGroup&)> operation);

  // From any thread: the running operation and every later one fail with CommError (the group is
  // broken; LocalGroup::cancel).
  void cancel() { group_->cancel(); }

 private:
  void loop();
  std::unique_ptr<LocalGroup> group_;
  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<std::pair<std::function<void(LocalGroup&)>, std::shared_ptr<Task>>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace shoal::comm::shm
