#include "shoal/core/error.h"

#include <cstdio>

#include "shoal/core/timeout.h"

namespace shoal {

std::string format_duration(Duration duration) {
  const auto ms = duration.count();
  char buffer[64];
  if (ms < 1000) {
    std::snprintf(buffer, sizeof(buffer), "%lld ms", static_cast<long long>(ms));
  } else if (ms < 120 * 1000) {
    std::snprintf(buffer, sizeof(buffer), "%.2f s", static_cast<double>(ms) / 1000.0);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%lld min %lld s", static_cast<long long>(ms / 60000),
                  static_cast<long long>((ms / 1000) % 60));
  }
  return buffer;
}

}  // namespace shoal
