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

void VirtualShard::add_chunk(int32_t table, int64_t chunk, const OptimizerSpec& optimizer,
                             const float* values, int64_t length) {
  Slot slot;
  slot.data.resize(static_cast<size_t>(length * (1 + state_width(optimizer))));
  std::copy(values, values + length, slot.data.begin());
  init_state(optimizer, slot.state(length), length);
  chunks_[{table, chunk}] = std::move(slot);
}

Slot* VirtualShard::chunk(int32_t table, int64_t chunk) {
  auto it = chunks_.find({table, chunk});
  return it == chunks_.end() ? nullptr : &it->second;
}

const Slot* VirtualShard::chunk(int32_t table, int64_t chunk) const {
  auto it = chunks_.find({table, chunk});
  return it == chunks_.end() ? nullptr : &it->second;
}

const Slot* VirtualShard::find_row(int32_t table, int64_t id) const {
  auto t = rows_.find(table);
  if (t == rows_.end()) return nullptr;
  auto it = t->second.find(id);
  return it == t->second.end() ? nullptr : &it->second;
}

Slot& VirtualShard::touch_row(int32_t table, int64_t id, const TableSpec& spec, int64_t dim) {
  auto& rows = rows_[table];
  auto it = rows.find(id);
  if (it != rows.end()) return it->second;
  Slot slot;
  slot.data.resize(static_cast<size_t>(dim * (1 + state_width(spec.optimizer))));
  initial_row(spec, id, slot.values(), dim);
  init_state(spec.optimizer, slot.state(dim), dim);
  return rows.emplace(id, std::move(slot)).first->second;
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
  for (const auto& [table, rows] : rows_) count += rows.size();
  return count;
}

// Note [Shard snapshot format]: native byte order (little-endian on every platform shoal builds
// for). "shoal-ps-shard 1", the shard id (int32), then the chunks and the rows, each list as a
// count (uint64) of entries: table name (uint32 length, bytes), chunk index or row id (int64),
// step count (int64), float count (uint64), floats (values, then the optimizer state).
namespace {

constexpr char kMagic[] = "shoal-ps-shard 1";

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

void put_slot(std::string& out, const std::string& name, int64_t index, const Slot& slot) {
  put(out, static_cast<uint32_t>(name.size()));
  out += name;
  put(out, index);
  put(out, slot.step);
  put(out, static_cast<uint64_t>(slot.data.size()));
  out.append(reinterpret_cast<const char*>(slot.data.data()), slot.data.size() * sizeof(float));
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
  std::string out(kMagic, sizeof(kMagic) - 1);
  put(out, id_);
  put(out, static_cast<uint64_t>(chunks_.size()));
  for (const auto& [key, slot] : chunks_)
    put_slot(out, tables.at(static_cast<size_t>(key.first)).name, key.second, slot);
  put(out, static_cast<uint64_t>(row_count()));
  for (const auto& [table, rows] : rows_)
    for (const auto& [id, slot] : rows)
      put_slot(out, tables.at(static_cast<size_t>(table)).name, id, slot);
  return out;
}

VirtualShard VirtualShard::load(int32_t id, const std::vector<TableSpec>& tables,
                                const std::string& bytes, int32_t virtual_shards) {
  Reader in(id, bytes);
  std::string magic(sizeof(kMagic) - 1, '\0');
  in.read(magic.data(), magic.size());
  if (magic != kMagic)
    in.fail("not a shard snapshot (expected it to start with \"" + std::string(kMagic) + "\")");
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
      Slot slot;
      slot.step = in.get<int64_t>();
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
      slot.data.resize(static_cast<size_t>(floats));
      in.read(slot.data.data(), slot.data.size() * sizeof(float));
      const bool fresh =
          sparse ? shard.rows_[table].emplace(index, std::move(slot)).second
                 : shard.chunks_.emplace(std::make_pair(table, index), std::move(slot)).second;
      if (!fresh)
        in.fail("entry " + std::to_string(index) + " of table '" + name + "' appears twice");
    }
  }
  if (!in.done()) in.fail("unexpected bytes after the last row");
  return shard;
}

}  // namespace shoal::ps::detail
