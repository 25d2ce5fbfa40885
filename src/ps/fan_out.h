// Work spread over a few threads that a caller keeps from call to call: a worker's calls to its
// servers (client.cpp), a server's sum of a large step on two threads (server_sum.cpp). The
// threads are LibTorch's c10::ThreadPool, started once, rather than a thread per call.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <c10/core/thread_pool.h>

namespace shoal::ps::detail {

// A pool of `threads` threads; null when `threads` is 0 or none can be started, and then
// fan_out runs every task on the calling thread.
inline std::unique_ptr<c10::ThreadPool> make_pool(int threads) {
  if (threads <= 0) return nullptr;
  try {
    return std::make_unique<c10::ThreadPool>(threads);
  } catch (const std::system_error&) {
    return nullptr;
  }
}

// Runs task(i) for every i in [0, count): task(0) on the calling thread, the others on `pool`
// (on the calling thread after task(0) when `pool` is null). Returns once every task has ended,
// rethrowing the exception of the lowest i that threw. Every task bounds its own wait (each is a
// call with a deadline, or a sum), so the wait for them is bounded too.
inline void fan_out(c10::ThreadPool* pool, int count, const std::function<void(int)>& task) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(count));
  auto run = [&](int i) {
    try {
      task(i);
    } catch (...) {
      errors[static_cast<size_t>(i)] = std::current_exception();
    }
  };
  std::mutex mutex;
  std::condition_variable ended;
  int pending = 0;
  if (pool != nullptr) {
    for (int i = 1; i < count; ++i) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        ++pending;
      }
      pool->run([&, i] {
        run(i);
        // Notified under the lock: the waiter may return, and these go, as soon as it sees 0.
        std::lock_guard<std::mutex> lock(mutex);
        --pending;
        ended.notify_one();
      });
    }
  }
  run(0);
  if (pool == nullptr) {
    for (int i = 1; i < count; ++i) run(i);
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    ended.wait(lock, [&] { return pending == 0; });
  }
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

}  // namespace shoal::ps::detail
