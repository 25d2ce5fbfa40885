// Where a parameter lives (docs/ps.md, "Sharding"): tables are cut into chunks (dense) or rows
// (sparse), each hashed onto one of kVirtualShards virtual shards, and the virtual shards are
// spread over the servers by a balanced table that is a pure function of (shards, servers).
// Every function here is deterministic across processes, builds and machines: a worker's client
// and every server compute the same owner for a chunk or a row without talking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shoal::ps::detail {

// 1024 virtual shards: many more than servers (up to a few dozen), so that each server's share
// is within one shard of even (under 3% apart at 32 servers) and a re-mapping moves shards of a
// few hundred KiB to a few MiB, while a per-shard snapshot file or lock stays cheap to keep.
inline constexpr int32_t kVirtualShards = 1024;

// A dense table's chunk: 64 Ki floats (256 KiB), well under gRPC's 4 MiB default message limit,
// large enough that per-chunk overhead (a hash-map entry, a header) is negligible.
inline constexpr int64_t kChunkElements = 64 * 1024;

// A key for (table name, index): hash_of(FNV-1a of the name, index) from core/hash.h, whose
// values are fixed by their definitions (never std::hash, which differs across builds).
uint64_t table_key(const std::string& table, int64_t index);

// Number of chunks of a dense table of `numel` elements (the last one may be short) and the
// element range [begin, begin + length) of chunk `chunk`.
int64_t chunk_count(int64_t numel);
int64_t chunk_begin(int64_t chunk);
int64_t chunk_length(int64_t numel, int64_t chunk);
// The number of values of `chunks` together (a dense slice's).
size_t chunks_length(int64_t numel, const std::vector<int64_t>& chunks);

// The virtual shard of dense chunk `chunk` / sparse row `id` of table `table`.
int32_t chunk_shard(const std::string& table, int64_t chunk, int32_t shards = kVirtualShards);
int32_t row_shard(const std::string& table, int64_t id, int32_t shards = kVirtualShards);

// The map of `shards` virtual shards onto `servers` servers. Each server holds shards/servers
// rounded down or up. Built server by server: server s (s >= 1) takes floor(shards / (s + 1))
// shards, one at a time from whichever earlier server holds the most (the lowest index on a tie),
// choosing that server's shard with the highest score hash_of(s, shard). Hence the map for S
// servers is the map for S + 1 with server S's shards handed back: adding or removing the last
// server moves only the shards it takes or gives, the fewest any balanced map can move.
class ShardMap {
 public:
  ShardMap(int32_t servers, int32_t shards = kVirtualShards);

  int32_t servers() const { return servers_; }
  int32_t shards() const { return static_cast<int32_t>(owner_.size()); }
  int32_t owner(int32_t shard) const { return owner_.at(static_cast<size_t>(shard)); }
  // The shards server `server` holds, ascending.
  std::vector<int32_t> shards_of(int32_t server) const;

 private:
  int32_t servers_;
  std::vector<int32_t> owner_;
};

}  // namespace shoal::ps::detail
