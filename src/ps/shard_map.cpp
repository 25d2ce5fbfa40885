#include "shard_map.h"

#include <algorithm>

#include "../core/hash.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail {

uint64_t table_key(const std::string& table, int64_t index) {
  return shoal::detail::hash_of(shoal::detail::fnv1a(table), static_cast<uint64_t>(index));
}

int64_t chunk_count(int64_t numel) {
  return (numel + kChunkElements - 1) / kChunkElements;
}
int64_t chunk_begin(int64_t chunk) {
  return chunk * kChunkElements;
}
int64_t chunk_length(int64_t numel, int64_t chunk) {
  return std::min(kChunkElements, numel - chunk_begin(chunk));
}

size_t chunks_length(int64_t numel, const std::vector<int64_t>& chunks) {
  size_t length = 0;
  for (int64_t chunk : chunks) length += static_cast<size_t>(chunk_length(numel, chunk));
  return length;
}

int32_t chunk_shard(const std::string& table, int64_t chunk, int32_t shards) {
  return static_cast<int32_t>(table_key(table, chunk) % static_cast<uint64_t>(shards));
}

int32_t row_shard(const std::string& table, int64_t id, int32_t shards) {
  // Rows and chunks of one table hash apart: a row id is not a chunk index.
  return static_cast<int32_t>(shoal::detail::hash_of(table_key(table, id), 0x726f77ULL) %
                              static_cast<uint64_t>(shards));
}

ShardMap::ShardMap(int32_t servers, int32_t shards) : servers_(servers) {
  if (servers < 1 || shards < servers)
    throw UsageError("parameter servers: cannot map " + std::to_string(shards) +
                     " virtual shards onto " + std::to_string(servers) +
                     " servers; expected 1 <= servers <= shards");
  owner_.assign(static_cast<size_t>(shards), 0);
  std::vector<std::vector<int32_t>> held(static_cast<size_t>(servers));
  for (int32_t v = 0; v < shards; ++v) held[0].push_back(v);
  for (int32_t s = 1; s < servers; ++s) {
    const int32_t take = shards / (s + 1);
    for (int32_t t = 0; t < take; ++t) {
      size_t from = 0;
      for (size_t i = 1; i < static_cast<size_t>(s); ++i)
        if (held[i].size() > held[from].size()) from = i;
      auto& list = held[from];
      auto score = [s](int32_t v) {
        return shoal::detail::hash_of(static_cast<uint64_t>(s), static_cast<uint64_t>(v));
      };
      auto best = std::max_element(list.begin(), list.end(),
                                   [&](int32_t a, int32_t b) { return score(a) < score(b); });
      held[static_cast<size_t>(s)].push_back(*best);
      list.erase(best);
    }
  }
  for (int32_t s = 0; s < servers; ++s)
    for (int32_t v : held[static_cast<size_t>(s)]) owner_[static_cast<size_t>(v)] = s;
}

std::vector<int32_t> ShardMap::shards_of(int32_t server) const {
  std::vector<int32_t> out;
  for (size_t v = 0; v < owner_.size(); ++v)
    if (owner_[v] == server) out.push_back(static_cast<int32_t>(v));
  return out;
}

}  // namespace shoal::ps::detail
