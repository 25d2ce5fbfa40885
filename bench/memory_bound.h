// The memory-bandwidth bound of an all-reduce on one host, measured in the same run as what it
// bounds (bench/shm_allreduce, bench/allreduce): one core copying the buffer once (memcpy of S
// bytes) and summing it once into another (a[i] += b[i] over S bytes). An all-reduce among
// co-located workers must at least read every member's input and write the result, which is
// that much memory traffic on the core doing it. Median of 5 repetitions.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace shoal::bench {

inline double memory_bound_seconds(size_t bytes) {
  using Clock = std::chrono::steady_clock;
  const size_t n = bytes / sizeof(float);
  std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n, 0.0f);
  const size_t iterations = std::clamp<size_t>((size_t{64} << 20) / std::max<size_t>(bytes, 1), 3, 2000);
  std::vector<double> times;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = Clock::now();
    for (size_t it = 0; it < iterations; ++it) {
      std::memcpy(c.data(), a.data(), bytes);
      float* __restrict x = a.data();
      const float* __restrict y = b.data();
      for (size_t i = 0; i < n; ++i) x[i] += y[i];
    }
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count() /
                    static_cast<double>(iterations));
  }
  // Keeps the copy observable.
  if (n > 0 && c[n / 2] < 0) times.push_back(0);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace shoal::bench
