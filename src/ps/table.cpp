#include "table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "shoal/core/error.h"

#include "../core/hash.h"
#include "optimizer.h"
#include "shard_map.h"

namespace shoal::ps::detail {

void initial_row(const TableSpec& spec, int64_t id, float* out, int64_t dim) {
  using shoal::detail::hash_of;
  const uint64_t key = hash_of(spec.seed, table_key(spec.name, id));
  for (int64_t j = 0; j < dim; ++j) {
    const auto element = static_cast<uint64_t>(j);
    switch (spec.init.kind) {
      case InitSpec::Kind::kZeros:
        out[j] = 0.f;
        break;
      case InitSpec::Kind::kUniform:
        out[j] =
            static_cast<float>(spec.init.a + (spec.init.b - spec.init.a) *
                                                 shoal::detail::uniform_of(hash_of(key, element)));
        break;
      case InitSpec::Kind::kNormal:
        out[j] = static_cast<float>(
            spec.init.a + spec.init.b * shoal::detail::normal_of(hash_of(key, element, 1),
                                                                 hash_of(key, element, 2)));
        break;
    }
  }
}

namespace {

constexpr size_t kFirstIndexSize = 16;
constexpr size_t kFirstBlockRows = 16;
// Linear probing stays short below this fill (a probe reads 24-byte entries in order).
constexpr double kMaxLoad = 0.5;

// Row ids are often small consecutive integers or already hashes; mix them so both spread.
uint64_t mix(int64_t id) {
  auto x = static_cast<uint64_t>(id);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

}  // namespace

size_t RowStore::probe(int64_t id) const {
  const size_t mask = index_.size() - 1;
  size_t at = static_cast<size_t>(mix(id)) & mask;
  while (index_[at].slot.data != nullptr && index_[at].id != id) at = (at + 1) & mask;
  return at;
}

Slot* RowStore::find(int64_t id) {
  if (index_.empty()) return nullptr;
  Entry& entry = index_[probe(id)];
  return entry.slot.data == nullptr ? nullptr : &entry.slot;
}

const Slot* RowStore::find(int64_t id) const {
  if (index_.empty()) return nullptr;
  const Entry& entry = index_[probe(id)];
  return entry.slot.data == nullptr ? nullptr : &entry.slot;
}

void RowStore::grow_index() {
  std::vector<Entry> old(index_.empty() ? kFirstIndexSize : index_.size() * 2, Entry{0, Slot{}});
  old.swap(index_);
  for (const Entry& e : old)
    if (e.slot.data != nullptr) index_[probe(e.id)] = e;
}

float* RowStore::new_floats() {
  const size_t capacity = blocks_.empty() ? 0 : kFirstBlockRows << (blocks_.size() - 1);
  if (used_in_last_block_ == capacity) {
    const size_t rows = kFirstBlockRows << blocks_.size();
    // Uninitialised: insert()'s caller writes every float of the row.
    blocks_.emplace_back(new float[rows * static_cast<size_t>(stride_)]);
    used_in_last_block_ = 0;
  }
  return blocks_.back().get() + used_in_last_block_++ * static_cast<size_t>(stride_);
}

std::pair<Slot*, bool> RowStore::emplace(int64_t id, int64_t stride) {
  if (ids_.empty()) stride_ = stride;
  SHOAL_CHECK(stride == stride_) << "row " << id << " of " << stride
                                 << " floats in a store of rows of " << stride_;
  if (static_cast<double>(ids_.size() + 1) > kMaxLoad * static_cast<double>(index_.size()))
    grow_index();
  Entry& entry = index_[probe(id)];
  if (entry.slot.data != nullptr) return {&entry.slot, false};
  // new float[] never answers nullptr, even for a row of no floats, so the entry is now full.
  entry = Entry{id, Slot{new_floats(), 0}};
  ids_.push_back(id);
  return {&entry.slot, true};
}

void VirtualShard::add_chunk(int32_t table, int64_t chunk, const OptimizerSpec& optimizer,
                             const float* values, int64_t length) {
  Chunk& entry = chunks_[{table, chunk}];
  entry.floats.assign(static_cast<size_t>(length * (1 + state_width(optimizer))), 0.f);
  entry.slot = Slot{entry.floats.data(), 0};
  std::copy(values, values + length, entry.floats.begin());
  init_state(optimizer, entry.slot.state(length), length);
}

Slot* VirtualShard::chunk(int32_t table, int64_t chunk) {
  auto it = chunks_.find({table, chunk});
  return it == chunks_.end() ? nullptr : &it->second.slot;
}

const Slot* VirtualShard::chunk(int32_t table, int64_t chunk) const {
  auto it = chunks_.find({table, chunk});
  return it == chunks_.end() ? nullptr : &it->second.slot;
}

float* VirtualShard::chunk_state(int32_t table, int64_t chunk, int64_t length) {
  Chunk& entry = chunks_.at({table, chunk});
  return entry.placed >= 0 ? entry.floats.data() : entry.slot.data + length;
}

void VirtualShard::place_values(int32_t table, int64_t chunk, float* at, int64_t length) {
  Chunk& entry = chunks_.at({table, chunk});
  if (entry.slot.data == at) return;  // placed there already
  std::memcpy(at, entry.slot.data, static_cast<size_t>(length) * sizeof(float));
  if (entry.placed < 0) {  // the values' floats here are no longer needed
    entry.floats.erase(entry.floats.begin(), entry.floats.begin() + length);
    entry.floats.shrink_to_fit();
  }
  entry.slot.data = at;
  entry.placed = length;
}

RowStore* VirtualShard::rows_of(int32_t table) {
  if (table < 0) return nullptr;
  if (static_cast<size_t>(table) >= rows_.size()) rows_.resize(static_cast<size_t>(table) + 1);
  return &rows_[static_cast<size_t>(table)];
}

const RowStore* VirtualShard::rows_of(int32_t table) const {
  if (table < 0 || static_cast<size_t>(table) >= rows_.size()) return nullptr;
  return &rows_[static_cast<size_t>(table)];
}

const Slot* VirtualShard::find_row(int32_t table, int64_t id) const {
  const RowStore* rows = rows_of(table);
  return rows == nullptr ? nullptr : rows->find(id);
}

Slot& VirtualShard::touch_row(int32_t table, int64_t id, const TableSpec& spec, int64_t dim) {
  RowStore* rows = rows_of(table);
  SHOAL_CHECK(rows != nullptr) << "table index " << table;
  auto [row, fresh] = rows->emplace(id, dim * (1 + state_width(spec.optimizer)));
  if (fresh) {
    initial_row(spec, id, row->values(), dim);
    init_state(spec.optimizer, row->state(dim), dim);
  }
  return *row;
}

void VirtualShard::read_row(int32_t table, int64_t id, const TableSpec& spec, int64_t dim,
                            float* out) const {
  if (const Slot* row = find_row(table, id))
    std::copy(row->values(), row->values() + dim, out);
  else
    initial_row(spec, id, out, dim);
}

size_t VirtualShard::row_count() const {
  size_t count = 0;
  for (const RowStore& rows : rows_) count += rows.size();
  return count;
}

// Note [Shard snapshot format]: native byte order (little-endian on every platform shoal builds
// for). "shoal-ps-shard 1", the shard id (int32), then the chunks and the rows, each list as a
// count (uint64) of entries: table name (uint32 length, bytes), chunk index or row id (int64),
// step count (int64), float count (uint64), floats (values, then the optimizer state).
namespace {

constexpr char kShardMagic[] = "shoal-ps-shard 1";

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// `state`: where the floats after the slot's first `values` are (a placed chunk's), or nullptr:
// right after them.
void put_slot(std::string& out, const std::string& name, int64_t index, const Slot& slot,
              size_t floats, size_t values = 0, const float* state = nullptr) {
  put(out, static_cast<uint32_t>(name.size()));
  out += name;
  put(out, index);
  put(out, slot.step);
  put(out, static_cast<uint64_t>(floats));
  if (state == nullptr) {
    out.append(reinterpret_cast<const char*>(slot.data), floats * sizeof(float));
    return;
  }
  out.append(reinterpret_cast<const char*>(slot.data), values * sizeof(float));
  out.append(reinterpret_cast<const char*>(state), (floats - values) * sizeof(float));
}

class Reader {
 public:
  Reader(int32_t shard, const std::string& bytes) : shard_(shard), bytes_(bytes) {}
  [[noreturn]] void fail(const std::string& what) const {
    throw UsageError("parameter server: snapshot of virtual shard " + std::to_string(shard_) +
                     ": " + what + " (at byte " + std::to_string(at_) + " of " +
                     std::to_string(bytes_.size()) + ")");
  }
  void read(void* out, size_t size) {
    if (bytes_.size() - at_ < size) fail("truncated");
    std::memcpy(out, bytes_.data() + at_, size);
    at_ += size;
  }
  template <typename T>
  T get() {
    T value;
    read(&value, sizeof(T));
    return value;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  int32_t shard_;
  const std::string& bytes_;
  size_t at_ = 0;
};

}  // namespace

std::string VirtualShard::save(const std::vector<TableSpec>& tables) const {
  std::string out(kShardMagic, sizeof(kShardMagic) - 1);
  put(out, id_);
  put(out, static_cast<uint64_t>(chunks_.size()));
  for (const auto& [key, entry] : chunks_) {
    const std::string& name = tables.at(static_cast<size_t>(key.first)).name;
    if (entry.placed < 0) {
      put_slot(out, name, key.second, entry.slot, entry.floats.size());
    } else {
      const auto values = static_cast<size_t>(entry.placed);
      put_slot(out, name, key.second, entry.slot, values + entry.floats.size(), values,
               entry.floats.data());
    }
  }
  put(out, static_cast<uint64_t>(row_count()));
  for (size_t table = 0; table < rows_.size(); ++table) {
    const RowStore& rows = rows_[table];
    for (size_t k = 0; k < rows.size(); ++k)
      put_slot(out, tables.at(table).name, rows.id_at(k), *rows.find(rows.id_at(k)),
               static_cast<size_t>(rows.stride()));
  }
  return out;
}

VirtualShard VirtualShard::load(int32_t id, const std::vector<TableSpec>& tables,
                                const std::string& bytes, int32_t virtual_shards) {
  Reader in(id, bytes);
  std::string magic(sizeof(kShardMagic) - 1, '\0');
  in.read(magic.data(), magic.size());
  if (magic != kShardMagic)
    in.fail("not a shard snapshot (expected it to start with \"" + std::string(kShardMagic) + "\")");
  const auto saved = in.get<int32_t>();
  if (saved != id) in.fail("it holds virtual shard " + std::to_string(saved));
  VirtualShard shard(id);
  for (int list = 0; list < 2; ++list) {
    const bool sparse = list == 1;
    const auto count = in.get<uint64_t>();
    for (uint64_t k = 0; k < count; ++k) {
      const auto length = in.get<uint32_t>();
      if (length > bytes.size()) in.fail("a table name of " + std::to_string(length) + " bytes");
      std::string name(length, '\0');
      in.read(name.data(), length);
      auto it = std::find_if(tables.begin(), tables.end(),
                             [&](const TableSpec& t) { return t.name == name; });
      if (it == tables.end() || it->sparse != sparse)
        in.fail(std::string(sparse ? "sparse" : "dense") + " table '" + name +
                "' is not a registered table of that kind");
      const auto table = static_cast<int32_t>(it - tables.begin());
      const auto index = in.get<int64_t>();
      const auto step = in.get<int64_t>();
      const auto floats = in.get<uint64_t>();
      int64_t length_of_values = 0;
      if (sparse) {
        const int64_t rows = it->shape[0];
        if (index < 0 || (rows > 0 && index >= rows) ||
            row_shard(name, index, virtual_shards) != id)
          in.fail("row " + std::to_string(index) + " of table '" + name + "' is not in this shard");
        length_of_values = it->shape[1];
      } else {
        int64_t numel = 1;
        for (int64_t d : it->shape) numel *= d;
        if (index < 0 || index >= chunk_count(numel) ||
            chunk_shard(name, index, virtual_shards) != id)
          in.fail("chunk " + std::to_string(index) + " of table '" + name +
                  "' is not in this shard");
        length_of_values = chunk_length(numel, index);
      }
      const auto expected =
          static_cast<uint64_t>(length_of_values * (1 + state_width(it->optimizer)));
      if (floats != expected)
        in.fail(std::to_string(floats) + " floats for " + (sparse ? "row " : "chunk ") +
                std::to_string(index) + " of table '" + name + "'; its table and optimizer need " +
                std::to_string(expected));
      Slot* slot = nullptr;
      if (sparse) {
        auto [row, fresh] = shard.rows_of(table)->emplace(index, static_cast<int64_t>(floats));
        if (fresh) slot = row;
      } else {
        auto [entry, fresh] = shard.chunks_.try_emplace(std::make_pair(table, index));
        if (fresh) {
          entry->second.floats.resize(static_cast<size_t>(floats));
          entry->second.slot.data = entry->second.floats.data();
          slot = &entry->second.slot;
        }
      }
      if (slot == nullptr)
        in.fail("entry " + std::to_string(index) + " of table '" + name + "' appears twice");
      slot->step = step;
      in.read(slot->data, static_cast<size_t>(floats) * sizeof(float));
    }
  }
  if (!in.done()) in.fail("unexpected bytes after the last row");
  return shard;
}

}  // namespace shoal::ps::detail
