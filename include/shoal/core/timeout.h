// Durations and deadlines. Every wait in shoal has one (docs/comm.md, "Deadlines and lost peers").
#pragma once

#include <chrono>
#include <string>

namespace shoal {

using Duration = std::chrono::milliseconds;

// In an options struct: "use the group's (or the job's) default".
inline constexpr Duration kUnsetTimeout{-1};

// "1.50 s", "250 ms", "3 min 20 s": how error messages print a duration.
std::string format_duration(Duration duration);

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Deadline(Duration timeout) : start_(Clock::now()), timeout_(timeout) {}

  Duration timeout() const { return timeout_; }
  Duration elapsed() const {
    return std::chrono::duration_cast<Duration>(Clock::now() - start_);
  }
  Duration remaining() const {
    auto left = timeout_ - elapsed();
    return left.count() > 0 ? left : Duration(0);
  }
  bool expired() const { return elapsed() >= timeout_; }

 private:
  Clock::time_point start_;
  Duration timeout_;
};

}  // namespace shoal
