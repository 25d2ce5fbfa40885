// The sum of the squares of float values, in double: a worker's |g|^2 over what it pushes to one
// server, and a server's |mean gradient|^2 over what it applies (Note [The gradient noise on
// servers], server_sum.cpp).
#pragma once

#include <cstdint>

namespace shoal::ps::detail {

inline double sum_of_squares(const float* values, int64_t count) {
  // Four sums, so that the additions need not wait for one another.
  double a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    a += static_cast<double>(values[i]) * values[i];
    b += static_cast<double>(values[i + 1]) * values[i + 1];
    c += static_cast<double>(values[i + 2]) * values[i + 2];
    d += static_cast<double>(values[i + 3]) * values[i + 3];
  }
  for (; i < count; ++i) a += static_cast<double>(values[i]) * values[i];
  return (a + b) + (c + d);
}

}  // namespace shoal::ps::detail
