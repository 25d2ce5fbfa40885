// One virtual shard's storage (docs/ps.md, "Sharding"): the dense chunks and sparse rows that hash
// to it, each with its optimizer state. A server holds the virtual shards the shard map gives it;
// a shard knows nothing of clocks or workers (server_core.h) and is not thread-safe on its own.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "messages.h"

namespace shoal::ps::detail {

// The first value of row `id` of a sparse table: a pure function of (spec.seed, spec.name, id),
// from counter-based hashes of (seed, table, id, element) (core/hash.h; Box-Muller for normal
// values), so it does not depend on which server holds the row, on what was touched
// before, or on LibTorch's generator.
void initial_row(const TableSpec& spec, int64_t id, float* out, int64_t dim);

// A chunk or a row: values, then state_width(optimizer) state vectors of the same length, in
// storage the shard owns. A Slot* from chunk() stays valid while the shard lives; one from
// find_row() or touch_row() until the next touch_row() (a row's floats never move, its Slot may).
struct Slot {
  float* data = nullptr;
  int64_t step = 0;  // how many updates it received (the optimizers' step count)
  float* values() { return data; }
  const float* values() const { return data; }
  float* state(int64_t length) { return data + length; }
};

// Note [Sparse row storage]: the rows of one table in one virtual shard, with no allocation per
// row. Their floats (values, then optimizer state: a fixed stride per table) live in blocks that
// double in size and never move; an open-addressing hash table with linear probing holds each
// row's Slot beside its id, so a lookup reads one entry, then the row. The ids are also kept in
// the order the rows were created, which is the order save() writes them in.
class RowStore {
 public:
  RowStore() = default;
  RowStore(RowStore&&) noexcept = default;
  RowStore& operator=(RowStore&&) noexcept = default;

  Slot* find(int64_t id);
  const Slot* find(int64_t id) const;
  // Row `id` and true if it is new (its `stride` floats uninitialised), or the existing row and
  // false. Every row of a store has the same stride.
  std::pair<Slot*, bool> emplace(int64_t id, int64_t stride);
  size_t size() const { return ids_.size(); }
  int64_t stride() const { return stride_; }
  int64_t id_at(size_t k) const { return ids_[k]; }

 private:
  struct Entry {
    int64_t id;
    Slot slot;  // slot.data == nullptr: empty
  };
  size_t probe(int64_t id) const;  // where id is, or the empty entry where it would go
  void grow_index();
  float* new_floats();

  int64_t stride_ = 0;
  std::vector<Entry> index_;                      // a power of two long, at most kMaxLoad full
  std::vector<int64_t> ids_;                      // by creation
  std::vector<std::unique_ptr<float[]>> blocks_;  // block b holds kFirstBlockRows << b rows
  size_t used_in_last_block_ = 0;                 // rows
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
  // A chunk's optimizer state: after its values' slot, or on its own once placed.
  float* chunk_state(int32_t table, int64_t chunk, int64_t length);
  // Moves the `length` values of a held chunk to `at` (a server's mirror, Note [The values'
  // mirror] in mirror.h), where its slot reads and writes them from then on; `at` must outlive
  // the shard. Its optimizer state stays here.
  void place_values(int32_t table, int64_t chunk, float* at, int64_t length);

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
  struct Chunk {
    std::vector<float> floats;  // the values, then the optimizer state; once placed, the state
    Slot slot;                  // slot.data is floats.data(), or where place_values() put them
    int64_t placed = -1;        // once placed: the values' length
  };
  RowStore* rows_of(int32_t table);
  const RowStore* rows_of(int32_t table) const;

  std::map<std::pair<int32_t, int64_t>, Chunk> chunks_;
  std::vector<RowStore> rows_;  // by table index; a table with no rows here has an empty store
};

}  // namespace shoal::ps::detail
