#include "server_snapshots.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "server_core.h"
#include "server_membership.h"
#include "server_registry.h"
#include "server_text.h"

namespace shoal::ps::detail {

ServerSnapshots::ServerSnapshots(const ServerCoreOptions& options, ServerRegistry& registry,
                                 ServerMembership& membership)
    : options_(options), registry_(registry), membership_(membership) {}

std::string ServerSnapshots::save_shard(int32_t shard) const {
  const VirtualShard* held = registry_.find_shard(shard);
  if (held == nullptr)
    bad("save_shard", "virtual shard " + std::to_string(shard) + " is not held by this server");
  return held->save(registry_.specs());
}

void ServerSnapshots::load_shard(int32_t shard, const std::string& bytes) {
  VirtualShard* held = registry_.find_shard(shard);
  if (held == nullptr)
    bad("load_shard", "virtual shard " + std::to_string(shard) + " is not held by this server");
  const int32_t virtual_shards = registry_.virtual_shards();
  VirtualShard loaded = VirtualShard::load(shard, registry_.specs(), bytes, virtual_shards);
  // A dense chunk the snapshot lacks would leave the table with a hole.
  const auto& tables = registry_.tables();
  for (size_t t = 0; t < tables.size(); ++t) {
    if (tables[t].spec.sparse) continue;
    for (int64_t c = 0; c < chunk_count(tables[t].numel); ++c)
      if (chunk_shard(tables[t].spec.name, c, virtual_shards) == shard &&
          loaded.chunk(static_cast<int32_t>(t), c) == nullptr)
        bad("load_shard", "the snapshot of virtual shard " + std::to_string(shard) +
                              " has no chunk " + std::to_string(c) + " of table '" +
                              tables[t].spec.name + "'; expected every chunk of the shard");
  }
  *held = std::move(loaded);
  registry_.shard_loaded();
}

void ServerSnapshots::take_when_due(int64_t step) {
  if (options_.snapshot_every <= 0 || !options_.on_snapshot) return;
  if (step % options_.snapshot_every != 0) return;
  std::map<int32_t, std::string> shards;
  const auto tables = registry_.specs();
  for (const auto& [shard, contents] : registry_.shards())
    shards.emplace(shard, contents.save(tables));
  options_.on_snapshot(step, std::move(shards));
}

void ServerSnapshots::restore() {
  if (!options_.restore) return;
  if (auto restored = options_.restore()) {
    for (const auto& [shard, bytes] : restored->shards) load_shard(shard, bytes);
    restored_step_ = restored->step;
    adopting_ = true;
  }
}

// Note [Clocks after a reload]: a server restarted from a snapshot of step S holds its shards as
// they were at S, while the workers are at some step C >= S: their updates of steps S..C-1 to this
// server's shards are lost. The server adopts the workers' clocks rather than make them go back:
// each worker's first request tells its clock (a push of step c: c; a pull at clock p: p, and its
// push of step p - 1, which the dead server had and this one has not, counts as lost). Once every
// live worker is known, the server's step is the lowest of them (sync), and a step some workers'
// lost pushes belong to completes with the pushes that did arrive (none: nothing is applied).
std::optional<int64_t> ServerSnapshots::adopt(int32_t w, int64_t clock) {
  const auto& live = membership_.live();
  if (!adopting_ || adopted_.count(w) != 0 || live.count(w) == 0 || clock < 0) return std::nullopt;
  adopted_[w] = clock;
  membership_.set_clock(w, clock);
  membership_.seal(w, clock);  // it pushed step `clock`: it sealed those before
  for (int32_t other : live)
    if (adopted_.count(other) == 0) return std::nullopt;
  int64_t lowest = INT64_MAX;
  for (int32_t other : live) lowest = std::min(lowest, adopted_[other]);
  adopting_ = false;
  return lowest;
}

}  // namespace shoal::ps::detail
