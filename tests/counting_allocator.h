// A CPU allocator that counts the bytes every tensor holds and their peak: memory measured from
// the allocator, for tests/zero_test.cpp and bench/memory.cpp. Install it before the tensors to be
// counted are made:
//
//   static shoal::testing::CountingAllocator counting(c10::GetDefaultCPUAllocator());
//   c10::SetCPUAllocator(&counting, /*priority=*/100);
//
// Its DataPtr's context is the data itself (as raw_allocate, which parts of LibTorch use,
// requires), and a table keeps what the base allocator gave. One may be installed per process.
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace shoal::testing {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) { self_ = this; }
  c10::DataPtr allocate(size_t bytes) const override {
    c10::DataPtr inner = base_->allocate(bytes);
    void* data = inner.get();
    const c10::Device device = inner.device();
    std::lock_guard<std::mutex> lock(mutex_);
    held_[data] = {std::move(inner), bytes};
    in_use_ += static_cast<int64_t>(bytes);
    peak_ = std::max(peak_, in_use_);
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  int64_t in_use() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_use_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  void reset_peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = in_use_;
  }

 private:
  struct Held {
    c10::DataPtr inner;
    size_t bytes = 0;
  };
  static void release(void* data) {
    if (data == nullptr) return;
    Held gone;  // freed by the base allocator once the lock is released
    std::lock_guard<std::mutex> lock(self_->mutex_);
    auto found = self_->held_.find(data);
    if (found == self_->held_.end()) return;
    gone = std::move(found->second);
    self_->held_.erase(found);
    self_->in_use_ -= static_cast<int64_t>(gone.bytes);
  }
  static inline const CountingAllocator* self_ = nullptr;
  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Held> held_;
  mutable int64_t in_use_ = 0, peak_ = 0;
};

}  // namespace shoal::testing
