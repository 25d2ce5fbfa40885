#include "mirror.h"

#include "server_registry.h"
#include "shard_map.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail {

namespace {

// Chunk `chunk` of table `t`'s shard, when this server holds the chunk.
VirtualShard* holder_of(ServerRegistry& registry, int32_t t, int64_t chunk) {
  const ServerRegistry::Table& table = registry.table(t);
  VirtualShard* shard =
      registry.find_shard(chunk_shard(table.spec.name, chunk, registry.virtual_shards()));
  return shard != nullptr && shard->chunk(t, chunk) != nullptr ? shard : nullptr;
}

}  // namespace

std::unique_ptr<ValuesMirror> ValuesMirror::create(ServerRegistry& registry) {
  std::unique_ptr<ValuesMirror> mirror(new ValuesMirror());
  const auto& tables = registry.tables();
  mirror->offsets_.resize(tables.size());
  mirror->numels_.resize(tables.size());
  int64_t at = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    if (tables[t].spec.sparse) continue;
    mirror->numels_[t] = tables[t].numel;
    const int64_t chunks = chunk_count(tables[t].numel);
    std::vector<int64_t>& offsets = mirror->offsets_[t];
    offsets.assign(static_cast<size_t>(chunks), -1);
    for (int64_t c = 0; c < chunks; ++c) {
      if (holder_of(registry, static_cast<int32_t>(t), c) == nullptr) continue;
      offsets[static_cast<size_t>(c)] = at;
      at += chunk_length(tables[t].numel, c);
    }
  }
  if (at == 0) return nullptr;  // no dense values here: nothing to pull from it
  mirror->segment_ = SharedSegment::create(static_cast<size_t>(at));
  if (!mirror->segment_) return nullptr;
  mirror->place_all(registry);
  return mirror;
}

void ValuesMirror::begin_change() {
  if (depth_++ == 0) segment_->sequence().begin_writes();
}

void ValuesMirror::end_change() {
  SHOAL_CHECK(depth_ > 0) << "a mirror's change ended that did not begin";
  if (--depth_ == 0) segment_->sequence().end_writes();
}

void ValuesMirror::place_all(ServerRegistry& registry) {
  begin_change();
  for (size_t t = 0; t < offsets_.size(); ++t) {
    for (size_t c = 0; c < offsets_[t].size(); ++c) {
      if (offsets_[t][c] < 0) continue;
      const auto table = static_cast<int32_t>(t);
      const auto chunk = static_cast<int64_t>(c);
      VirtualShard* shard = holder_of(registry, table, chunk);
      SHOAL_CHECK(shard != nullptr) << "chunk " << chunk << " of table " << table;
      shard->place_values(table, chunk, segment_->values().data + offsets_[t][c],
                          chunk_length(numels_[t], chunk));
    }
  }
  end_change();
}

std::optional<size_t> ValuesMirror::run_of(const DenseSlice& slice) const {
  if (slice.table < 0 || static_cast<size_t>(slice.table) >= offsets_.size() ||
      slice.chunks.empty())
    return std::nullopt;
  const std::vector<int64_t>& offsets = offsets_[static_cast<size_t>(slice.table)];
  const int64_t numel = numels_[static_cast<size_t>(slice.table)];
  int64_t next = -1;  // where the run's next chunk must be; -1: before the first
  for (int64_t chunk : slice.chunks) {
    if (chunk < 0 || static_cast<size_t>(chunk) >= offsets.size()) return std::nullopt;
    const int64_t at = offsets[static_cast<size_t>(chunk)];
    if (at < 0 || (next >= 0 && at != next)) return std::nullopt;
    next = at + chunk_length(numel, chunk);
  }
  return static_cast<size_t>(offsets[static_cast<size_t>(slice.chunks.front())]);
}

}  // namespace shoal::ps::detail
