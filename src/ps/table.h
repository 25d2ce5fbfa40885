// One virtual shard's storage (docs/ps.md, "Sharding"): the dense chunks and sparse rows that hash
// to it, each with its optimizer state. A server holds the virtual shards the shard map gives it;
// a shard knows nothing of clocks or workers (server_core.h) and is not thread-safe on its own.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "messages.h"

namespace shoal::ps::detail {

// The first value of row `id` of a sparse table: a pure function of (spec.seed, spec.name, id),
// from counter-based hashes of (seed, table, id, element) (core/hash.h; Box-Muller for normal
// values), so it does not depend on which server holds the row, on what was touched
// before, or on LibTorch's generator.
void initial_row(const TableSpec& spec, int64_t id, float* out, int64_t dim);

// A chunk or a row: values, then state_width(optimizer) state vectors of the same length.
struct Slot {
  std::vector<float> data;
  int64_t step = 0;  // how many updates it received (the optimizers' step count)
  float* values() { return data.data(); }
  const float* values() const { return data.data(); }
  float* state(int64_t length) { return data.data() + length; }
};

class VirtualShard {
 public:
  explicit VirtualShard(int32_t id) : id_(id) {}
  int32_t id() const { return id_; }

  // Dense chunks, created whole by the table's first registration.
  void add_chunk(int32_t table, int64_t chunk, const OptimizerSpec& optimizer, const float* values,
                 int64_t length);
  Slot* chunk(int32_t table, int64_t chunk);
  const Slot* chunk(int32_t table, int64_t chunk) const;

  // Sparse rows. find_row answers nullptr for a row never updated; touch_row creates it from
  // initial_row on first use. Reading a row (a pull) never creates it: only updates cost memory.
  const Slot* find_row(int32_t table, int64_t id) const;
  Slot& touch_row(int32_t table, int64_t id, const TableSpec& spec, int64_t dim);
  // The row's current values, or its initial values if it was never updated.
  void read_row(int32_t table, int64_t id, const TableSpec& spec, int64_t dim, float* out) const;
  size_t row_count() const;
  size_t chunks_held() const { return chunks_.size(); }

  // The shard as bytes: its chunks and rows with their optimizer state and step counts, by table
  // name (docs/ps.md, "Sharding"). `tables` are the server's, in registration order.
  std::string save(const std::vector<TableSpec>& tables) const;
  // The shard `id` read back from save()'s bytes, for a server whose tables are `tables` (the
  // same names, kinds, shapes and optimizers as the saver's, in any order). Every byte is checked
  // before the result exists: a truncated, foreign or mismatched snapshot is a UsageError.
  static VirtualShard load(int32_t id, const std::vector<TableSpec>& tables,
                           const std::string& bytes, int32_t virtual_shards);

 private:
  int32_t id_;
  std::map<std::pair<int32_t, int64_t>, Slot> chunks_;
  std::map<int32_t, std::unordered_map<int64_t, Slot>> rows_;
};

}  // namespace shoal::ps::detail
