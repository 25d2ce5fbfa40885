#include "throughput.h"

#include <cmath>

namespace shoal::queue {

bool Throughput::add(int64_t time_ms, int64_t samples, int world) {
  if (!points_.empty()) {
    const Point& last = points_.back();
    if (time_ms <= last.time_ms) return false;
    if (world != last.world) points_.clear();
    else if (samples < last.samples) return false;  // a job resumed from an older commit: wait
  }
  points_.push_back({time_ms, samples, world});
  while (points_.size() > 2 && points_.back().time_ms - points_[1].time_ms >= kMaxWindowMs)
    points_.pop_front();
  const auto rate = current();
  if (!rate) return false;
  auto it = by_world_.find(world);
  const bool notable = it == by_world_.end() || std::abs(*rate - it->second) > 0.1 * it->second;
  by_world_[world] = *rate;
  return notable;
}

std::optional<double> Throughput::current() const {
  if (points_.size() < 2) return std::nullopt;
  const Point& first = points_.front();
  const Point& last = points_.back();
  if (last.time_ms - first.time_ms < kMinWindowMs) return std::nullopt;
  return 1000.0 * static_cast<double>(last.samples - first.samples) /
         static_cast<double>(last.time_ms - first.time_ms);
}

nlohmann::json Throughput::to_json() const {
  nlohmann::json by = nlohmann::json::object();
  for (const auto& [world, rate] : by_world_) by[std::to_string(world)] = rate;
  const auto rate = current();
  return {{"samples_per_s", rate ? nlohmann::json(*rate) : nlohmann::json()},
          {"world", world()},
          {"by_world", by}};
}

void Throughput::restore(const nlohmann::json& doc) {
  if (!doc.is_object()) return;
  const nlohmann::json by = doc.value("by_world", nlohmann::json::object());
  for (const auto& [world, rate] : by.items()) by_world_[std::stoi(world)] = rate.get<double>();
}

}  // namespace shoal::queue
