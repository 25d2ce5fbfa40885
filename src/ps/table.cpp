#include "table.h"

#include <algorithm>
#include <cmath>

#include "optimizer.h"
#include "shard_map.h"

namespace shoal::ps::detail {

namespace {

// Uniform in [0, 1) from the top 53 bits.
double unit(uint64_t bits) {
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

}  // namespace

void initial_row(const TableSpec& spec, int64_t id, float* out, int64_t dim) {
  const uint64_t key = table_key(spec.name, id) ^ splitmix64(spec.seed ^ 0x5eedULL);
  auto draw = [key](int64_t counter) {
    return unit(splitmix64(key ^ splitmix64(static_cast<uint64_t>(counter))));
  };
  for (int64_t j = 0; j < dim; ++j) {
    switch (spec.init.kind) {
      case InitSpec::Kind::kZeros:
        out[j] = 0.f;
        break;
      case InitSpec::Kind::kUniform:
        out[j] = static_cast<float>(spec.init.a + (spec.init.b - spec.init.a) * draw(j));
        break;
      case InitSpec::Kind::kNormal: {
        const double u1 = 1.0 - draw(2 * j);  // (0, 1]: the logarithm stays finite
        const double u2 = draw(2 * j + 1);
        const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
        out[j] = static_cast<float>(spec.init.a + spec.init.b * z);
        break;
      }
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

}  // namespace shoal::ps::detail
