// A job's measured throughput (docs/queue.md, "Throughput"): samples per second of committed
// training, from the progress its first worker writes (src/elastic/notes.h) and its agent
// reports, per worker count. The rate at a worker count is that of the last window of at least
// kMinWindowMs in which the count did not change (a resize starts a new window, so the time of
// a re-forming round is not counted against the new count).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

namespace shoal::queue {

class Throughput {
 public:
  static constexpr int64_t kMinWindowMs = 2000;
  static constexpr int64_t kMaxWindowMs = 10000;

  // A progress point; one older than the last, or of fewer samples, is ignored. Whether the
  // rate at its worker count was measured for the first time or moved by more than a tenth (what
  // is worth keeping on disk).
  bool add(int64_t time_ms, int64_t samples, int world);

  // Samples per second at the current worker count, once a window is measured.
  std::optional<double> current() const;
  int world() const { return points_.empty() ? 0 : points_.back().world; }
  // The last rate measured at each worker count.
  const std::map<int, double>& by_world() const { return by_world_; }

  // {"samples_per_s", "world", "by_world": {"2": ..}}, or null before any measurement.
  nlohmann::json to_json() const;
  // Restores by_world (a restarted scheduler measures the current window again).
  void restore(const nlohmann::json& doc);

 private:
  struct Point {
    int64_t time_ms;
    int64_t samples;
    int world;
  };
  std::deque<Point> points_;  // the current window: one worker count, the last kMaxWindowMs
  std::map<int, double> by_world_;
};

}  // namespace shoal::queue
