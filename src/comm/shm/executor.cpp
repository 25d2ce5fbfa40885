#include "comm/shm/executor.h"

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

Executor::Executor(std::unique_ptr<LocalGroup> group)
    : group_(std::move(group)), thread_([this] { loop(); }) {}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queued_.notify_all();
  // An operation still running waits for peers that may never come (its caller gave up on it);
  // cancelling ends its wait within a slice.
  group_->cancel();
  thread_.join();
}

std::shared_ptr<Task> Executor::submit(std::function<void(LocalGroup&)> operation) {
  auto task = std::make_shared<Task>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.emplace_back(std::move(operation), task);
  }
  queued_.notify_one();
  return task;
}

void Executor::loop() {
  for (;;) {
    std::pair<std::function<void(LocalGroup&)>, std::shared_ptr<Task>> next;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      next.first(*group_);
    } catch (...) {
      error = std::current_exception();
    }
    next.second->finish(error);
  }
}

}  // namespace shoal::comm::shm
