#include "server_registry.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>

#include "mode.h"
#include "optimizer.h"
#include "server_core.h"
#include "server_text.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail {

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// The first field in which two specs differ, or "" when they are equal.
std::string difference(const TableSpec& a, const TableSpec& b) {
  auto text = [](const auto& x) { return std::to_string(x); };
  if (a.name != b.name) return "name '" + b.name + "' (expected '" + a.name + "')";
  if (a.sparse != b.sparse) return std::string("sparse ") + (b.sparse ? "true" : "false");
  if (a.shape != b.shape)
    return "shape " + shape_text(b.shape) + " (expected " + shape_text(a.shape) + ")";
  if (a.seed != b.seed) return "seed " + text(b.seed) + " (expected " + text(a.seed) + ")";
  const auto &o = a.optimizer, &p = b.optimizer;
  if (o.kind != p.kind)
    return "optimizer kind " + text(static_cast<int>(p.kind)) + " (expected " +
           text(static_cast<int>(o.kind)) + ")";
  const std::pair<const char*, std::pair<double, double>> numbers[] = {
      {"lr", {o.lr, p.lr}},
      {"weight_decay", {o.weight_decay, p.weight_decay}},
      {"momentum", {o.momentum, p.momentum}},
      {"dampening", {o.dampening, p.dampening}},
      {"lr_decay", {o.lr_decay, p.lr_decay}},
      {"initial_accumulator_value", {o.initial_accumulator_value, p.initial_accumulator_value}},
      {"eps", {o.eps, p.eps}},
      {"beta1", {o.beta1, p.beta1}},
      {"beta2", {o.beta2, p.beta2}},
      {"init a", {a.init.a, b.init.a}},
      {"init b", {a.init.b, b.init.b}}};
  for (const auto& [name, values] : numbers)
    if (values.first != values.second)
      return std::string(name) + " " + text(values.second) + " (expected " + text(values.first) +
             ")";
  if (o.nesterov != p.nesterov) return "nesterov differs";
  if (o.amsgrad != p.amsgrad) return "amsgrad differs";
  if (a.init.kind != b.init.kind) return "init kind differs";
  return "";
}

void check_spec(const TableSpec& spec) {
  const char* what = "register";
  if (spec.name.empty()) bad(what, "a table has an empty name; expected a unique name");
  for (int64_t d : spec.shape)
    if (d < 0)
      bad(what, "table '" + spec.name + "' has shape " + shape_text(spec.shape) +
                    "; expected sizes >= 0");
  if (spec.sparse && (spec.shape.size() != 2 || spec.shape[1] < 1))
    bad(what, "sparse table '" + spec.name + "' has shape " + shape_text(spec.shape) +
                  "; expected {rows (0: unbounded), dim >= 1}");
  check_optimizer(spec.optimizer, spec.sparse, spec.name);
  const auto kind = spec.init.kind;
  if (kind != InitSpec::Kind::kZeros && kind != InitSpec::Kind::kUniform &&
      kind != InitSpec::Kind::kNormal)
    bad(what, "table '" + spec.name + "' has init kind " + std::to_string(static_cast<int>(kind)) +
                  "; expected zeros (0), uniform (1) or normal (2)");
  if (kind == InitSpec::Kind::kUniform && !(spec.init.a <= spec.init.b))
    bad(what, "table '" + spec.name + "' has uniform(" + std::to_string(spec.init.a) + ", " +
                  std::to_string(spec.init.b) + "); expected low <= high");
  if (kind == InitSpec::Kind::kNormal && !(spec.init.b >= 0))
    bad(what, "table '" + spec.name + "' has normal standard deviation " +
                  std::to_string(spec.init.b) + "; expected >= 0");
}

// A value that occurs twice in `values`, if any (a sorted copy: no allocation per element).
std::optional<int64_t> repeated(const std::vector<int64_t>& values) {
  std::vector<int64_t> sorted(values);
  std::sort(sorted.begin(), sorted.end());
  auto it = std::adjacent_find(sorted.begin(), sorted.end());
  if (it == sorted.end()) return std::nullopt;
  return *it;
}

}  // namespace

ServerRegistry::ServerRegistry(const ServerCoreOptions& options)
    : virtual_shards_(options.virtual_shards), mirror_wanted_(options.mirror_values) {
  held_.assign(static_cast<size_t>(virtual_shards_), nullptr);
  for (int32_t shard : options.shards)
    held_[static_cast<size_t>(shard)] = &shards_.emplace(shard, VirtualShard(shard)).first->second;
}

// Note [The mode comes with the workers]
// The consistency mode is the program's choice (ps::ServerOptions::mode, which SHOAL_PS_MODE
// overrides on every worker), so the servers, started by `shoal run` before any worker, learn it
// from the workers: each registration names its worker's mode, the first one sets the servers'
// and a later one naming another is refused with a one-line UsageError naming both, before any
// table changes. Nothing reads the mode before the first registration: pulls, pushes, leases and
// joins all come after a worker has registered. A server started with an explicit mode
// (`shoal ps-server --mode`, or SHOAL_PS_MODE when shoal run started it) refuses any other.
void ServerRegistry::adopt_mode(const RegisterRequest& request, ServerCoreOptions& options) {
  if (request.mode.empty()) return;  // a client of the transport's tests: the server's own mode
  const Mode asked =
      parse_mode(request.mode, "worker " + std::to_string(request.worker) + "'s mode");
  if (mode_.empty() && options.mode_from_workers) {
    const Consistency before = options.consistency;
    const int64_t staleness_before = options.staleness;
    options.consistency = asked.kind == Mode::kSync    ? Consistency::kSync
                          : asked.kind == Mode::kAsync ? Consistency::kAsync
                                                       : Consistency::kBoundedStaleness;
    options.staleness = asked.staleness;
    if (options.consistency == Consistency::kBoundedStaleness && options.staleness == 0)
      options.consistency = Consistency::kSync;
    if (options.replicas_to_aggregate > 0 && options.consistency != Consistency::kSync) {
      options.consistency = before;
      options.staleness = staleness_before;
      throw UsageError("parameter server: worker " + std::to_string(request.worker) +
                       " trains in mode " + mode_name(asked) +
                       "; shoal run --ps-backup-workers expects sync (drop one of them)");
    }
    mode_ = mode_name(asked);
    mode_worker_ = request.worker;
    return;
  }
  if (mode_.empty()) {
    Mode own;
    own.kind = options.consistency == Consistency::kSync    ? Mode::kSync
               : options.consistency == Consistency::kAsync ? Mode::kAsync
                                                            : Mode::kBoundedStaleness;
    own.staleness = options.staleness;
    mode_ = mode_name(own);
  }
  if (mode_name(asked) == mode_) return;
  const std::string worker = "parameter server: worker " + std::to_string(request.worker);
  if (mode_worker_ >= 0)
    throw UsageError(worker + " trains in mode " + mode_name(asked) + ", worker " +
                     std::to_string(mode_worker_) + " in " + mode_ +
                     "; expected one mode for the whole job (ps::ServerOptions::mode, or "
                     "SHOAL_PS_MODE)");
  throw UsageError(worker + " trains in mode " + mode_name(asked) + "; expected " + mode_ +
                   ", the servers' --mode (or SHOAL_PS_MODE where shoal run started them)");
}

const ServerRegistry::Table& ServerRegistry::table_at(const char* what, int32_t index) const {
  if (index < 0 || static_cast<size_t>(index) >= tables_.size())
    not_here(what, "unknown table index " + std::to_string(index) + "; expected 0 <= index < " +
                       std::to_string(tables_.size()) + " (the tables registered)");
  return tables_[static_cast<size_t>(index)];
}

void ServerRegistry::check_slices(const char* what, const std::vector<DenseSlice>& dense,
                                  const std::vector<SparseSlice>& sparse, bool with_values) const {
  for (const auto& slice : dense) {
    const Table& table = table_at(what, slice.table);
    const std::string name = "table '" + table.spec.name + "'";
    if (table.spec.sparse) bad(what, name + " is sparse; expected a dense table for chunks");
    const int64_t chunks = chunk_count(table.numel);
    int64_t length = 0;
    for (int64_t chunk : slice.chunks) {
      if (chunk < 0 || chunk >= chunks)
        bad(what, name + ": chunk " + std::to_string(chunk) +
                      " is out of range; expected 0 <= chunk < " + std::to_string(chunks));
      const int32_t shard = chunk_shard(table.spec.name, chunk, virtual_shards_);
      if (!holds(shard))
        not_here(what, name + ": chunk " + std::to_string(chunk) + " is in virtual shard " +
                           std::to_string(shard) + ", which this server does not hold");
      length += chunk_length(table.numel, chunk);
    }
    if (const auto twice = repeated(slice.chunks))
      bad(what, name + ": chunk " + std::to_string(*twice) + " is named twice; expected each once");
    const int64_t expected = with_values ? length : 0;
    if (static_cast<int64_t>(slice.count()) != expected)
      bad(what, name + ": " + std::to_string(slice.count()) + " values for " +
                    std::to_string(slice.chunks.size()) + " chunks; expected " +
                    std::to_string(expected));
  }
  for (const auto& slice : sparse) {
    const Table& table = table_at(what, slice.table);
    const std::string name = "table '" + table.spec.name + "'";
    if (!table.spec.sparse) bad(what, name + " is dense; expected a sparse table for rows");
    const int64_t rows = table.spec.shape[0];
    for (int64_t id : slice.ids) {
      if (id < 0 || (rows > 0 && id >= rows))
        bad(what, name + ": row " + std::to_string(id) + " is out of range; expected 0 <= id" +
                      (rows > 0 ? " < " + std::to_string(rows) : std::string()));
      const int32_t shard = row_shard(table.spec.name, id, virtual_shards_);
      if (!holds(shard))
        not_here(what, name + ": row " + std::to_string(id) + " is in virtual shard " +
                           std::to_string(shard) + ", which this server does not hold");
    }
    if (with_values)  // a pull may name a row twice; a push's gradients must be coalesced
      if (const auto twice = repeated(slice.ids))
        bad(what,
            name + ": row " + std::to_string(*twice) + " is named twice; expected unique ids");
    const int64_t expected = with_values ? static_cast<int64_t>(slice.ids.size()) * table.dim : 0;
    if (static_cast<int64_t>(slice.values.size()) != expected)
      bad(what, name + ": " + std::to_string(slice.values.size()) + " values for " +
                    std::to_string(slice.ids.size()) + " rows of dim " + std::to_string(table.dim) +
                    "; expected " + std::to_string(expected));
  }
}

bool ServerRegistry::holds_dense_chunks(const std::vector<TableSpec>& tables) const {
  for (const auto& spec : tables) {
    if (spec.sparse) continue;
    for (int64_t c = 0; c < chunk_count(numel_of(spec.shape)); ++c)
      if (shards_.count(chunk_shard(spec.name, c, virtual_shards_)) != 0) return true;
  }
  return false;
}

void ServerRegistry::check_specs(const std::vector<TableSpec>& tables) {
  for (const auto& spec : tables) check_spec(spec);
}

void ServerRegistry::check_same(const RegisterRequest& request) const {
  const char* what = "register";
  if (request.tables.size() != tables_.size())
    bad(what, "worker " + std::to_string(request.worker) + " registers " +
                  std::to_string(request.tables.size()) + " tables; expected " +
                  std::to_string(tables_.size()) + " as the first registration");
  for (size_t i = 0; i < tables_.size(); ++i) {
    const std::string diff = difference(tables_[i].spec, request.tables[i]);
    if (!diff.empty())
      bad(what, "worker " + std::to_string(request.worker) + "'s table " + std::to_string(i) +
                    " ('" + tables_[i].spec.name +
                    "') differs from the first registration: " + diff);
  }
}

void ServerRegistry::create(const RegisterRequest& request) {
  const char* what = "register";
  std::set<std::string> names;
  for (const auto& spec : request.tables) {
    if (!names.insert(spec.name).second)
      bad(what, "table name '" + spec.name + "' is used twice; expected unique names");
  }
  // Check the initial values against the new tables before keeping anything.
  std::vector<Table> tables;
  for (const auto& spec : request.tables) {
    Table table{spec, spec.sparse ? 0 : numel_of(spec.shape), spec.sparse ? spec.shape[1] : 0};
    tables.push_back(std::move(table));
  }
  tables_.swap(tables);
  try {
    check_slices(what, request.initial, {}, true);
    std::vector<std::set<int64_t>> given(tables_.size());
    for (const auto& slice : request.initial)
      for (int64_t chunk : slice.chunks)
        if (!given[static_cast<size_t>(slice.table)].insert(chunk).second)
          bad(what, "table '" + tables_[static_cast<size_t>(slice.table)].spec.name +
                        "': initial chunk " + std::to_string(chunk) + " is given twice");
    for (size_t t = 0; t < tables_.size(); ++t) {
      if (tables_[t].spec.sparse) continue;
      for (int64_t c = 0; c < chunk_count(tables_[t].numel); ++c)
        if (shards_.count(chunk_shard(tables_[t].spec.name, c, virtual_shards_)) != 0 &&
            given[t].count(c) == 0)
          bad(what, "table '" + tables_[t].spec.name + "': no initial values for chunk " +
                        std::to_string(c) + ", which this server holds; expected every held chunk");
    }
  } catch (...) {
    tables_.clear();
    throw;
  }
  for (const auto& slice : request.initial) {
    const Table& table = tables_[static_cast<size_t>(slice.table)];
    const float* values = slice.values.data();
    for (int64_t chunk : slice.chunks) {
      const int64_t length = chunk_length(table.numel, chunk);
      holder(chunk_shard(table.spec.name, chunk, virtual_shards_))
          ->add_chunk(slice.table, chunk, table.spec.optimizer, values, length);
      values += length;
    }
  }
  registered_ = true;
  if (mirror_wanted_) mirror_ = ValuesMirror::create(*this);
}

void ServerRegistry::shard_loaded() {
  if (mirror_) mirror_->place_all(*this);
}

void ServerRegistry::apply_chunk(int32_t index, int64_t chunk, const float* grad) {
  const Table& table = tables_[static_cast<size_t>(index)];
  const int64_t length = chunk_length(table.numel, chunk);
  VirtualShard* shard = holder(chunk_shard(table.spec.name, chunk, virtual_shards_));
  Slot* slot = shard->chunk(index, chunk);
  SHOAL_CHECK(slot != nullptr) << "chunk " << chunk << " of table " << table.spec.name;
  // The values may be in the mirror (Note [The values' mirror], mirror.h): written there.
  apply_dense(table.spec.optimizer, slot->values(), shard->chunk_state(index, chunk, length),
              slot->step, grad, length);
}

void ServerRegistry::apply(const std::vector<DenseSlice>& dense,
                           const std::vector<SparseSlice>& sparse) {
  const Change changing = change();
  for (const auto& slice : dense) {
    const Table& table = tables_[static_cast<size_t>(slice.table)];
    const float* grad = slice.data();
    for (int64_t chunk : slice.chunks) {
      apply_chunk(slice.table, chunk, grad);
      grad += chunk_length(table.numel, chunk);
    }
  }
  for (const auto& slice : sparse) {
    const Table& table = tables_[static_cast<size_t>(slice.table)];
    const float* grad = slice.values.data();
    for (int64_t id : slice.ids) {
      Slot& row = holder(row_shard(table.spec.name, id, virtual_shards_))
                      ->touch_row(slice.table, id, table.spec, table.dim);
      apply_row(table.spec.optimizer, row.values(), row.state(table.dim), row.step, grad,
                table.dim);
      grad += table.dim;
    }
  }
}

// Writes into `reply`'s storage: a reply kept from the pull before has every vector sized already
// (Note [A step's sum without allocations]).
//
// Note [Pull replies in place]: a pull over gRPC from a worker on this host is answered through
// the worker's shared segment (Note [Values in shared memory], wire.h). Writing the values into
// the reply and the transport copying them into the segment were two passes over the model's size
// per worker and step; the transport now offers the segment (pull_into, DenseOut) and the values
// go there straight from the tables when they fit, one pass.
void ServerRegistry::fill_reply(const PullRequest& request, PullReply& reply, DenseOut* out) const {
  reply.dense.resize(request.dense.size());
  const auto length_of = [&](const DenseSlice& slice) {
    return chunks_length(tables_[static_cast<size_t>(slice.table)].numel, slice.chunks);
  };
  if (out != nullptr) {
    out->counts.clear();
    out->mirrored.clear();
    out->mirror.clear();
  }
  if (out != nullptr && out->mirror_offered && mirror_ && !request.dense.empty() &&
      from_mirror(request, reply, *out)) {
    fill_rows(request, reply);
    return;
  }
  size_t total = 0;
  for (const DenseSlice& slice : request.dense) total += length_of(slice);
  const bool in_place = out != nullptr && !request.dense.empty() && total <= out->capacity;
  float* shared = in_place ? out->data : nullptr;
  for (size_t s = 0; s < request.dense.size(); ++s) {
    const DenseSlice& slice = request.dense[s];
    const Table& table = tables_[static_cast<size_t>(slice.table)];
    DenseSlice& out_slice = reply.dense[s];
    out_slice.table = slice.table;
    out_slice.chunks.assign(slice.chunks.begin(), slice.chunks.end());
    const size_t length = length_of(slice);
    float* dst = shared;
    if (in_place) {
      out_slice.values.clear();
      out->counts.push_back(length);
      shared += length;
    } else {
      out_slice.values.resize(length);
      dst = out_slice.values.data();
    }
    for (int64_t chunk : slice.chunks) {
      const int64_t n = chunk_length(table.numel, chunk);
      const Slot* slot =
          holder(chunk_shard(table.spec.name, chunk, virtual_shards_))->chunk(slice.table, chunk);
      SHOAL_CHECK(slot != nullptr) << "chunk " << chunk << " of table " << table.spec.name;
      std::memcpy(dst, slot->values(), static_cast<size_t>(n) * sizeof(float));
      dst += n;
    }
  }
  fill_rows(request, reply);
}

// Note [The values' mirror] (mirror.h): a pull whose every dense slice is one run of the mirror
// is answered with where the runs are; otherwise (false) it is answered as before.
bool ServerRegistry::from_mirror(const PullRequest& request, PullReply& reply,
                                 DenseOut& out) const {
  for (const DenseSlice& slice : request.dense) {
    const std::optional<size_t> at = mirror_->run_of(slice);
    if (!at) {
      out.mirrored.clear();
      return false;
    }
    out.mirrored.push_back(*at);
  }
  for (size_t s = 0; s < request.dense.size(); ++s) {
    const DenseSlice& slice = request.dense[s];
    DenseSlice& out_slice = reply.dense[s];
    out_slice.table = slice.table;
    out_slice.chunks.assign(slice.chunks.begin(), slice.chunks.end());
    out_slice.values.clear();
    out.counts.push_back(
        chunks_length(tables_[static_cast<size_t>(slice.table)].numel, slice.chunks));
  }
  out.mirror = mirror_->handle();
  out.sequence = mirror_->sequence();
  return true;
}

void ServerRegistry::fill_rows(const PullRequest& request, PullReply& reply) const {
  reply.sparse.resize(request.sparse.size());
  for (size_t s = 0; s < request.sparse.size(); ++s) {
    const SparseSlice& slice = request.sparse[s];
    const Table& table = tables_[static_cast<size_t>(slice.table)];
    SparseSlice& out_slice = reply.sparse[s];
    out_slice.table = slice.table;
    out_slice.ids.assign(slice.ids.begin(), slice.ids.end());
    out_slice.values.resize(slice.ids.size() * static_cast<size_t>(table.dim));
    float* dst = out_slice.values.data();
    for (int64_t id : slice.ids) {
      holder(row_shard(table.spec.name, id, virtual_shards_))
          ->read_row(slice.table, id, table.spec, table.dim, dst);
      dst += table.dim;
    }
  }
}

std::vector<TableSpec> ServerRegistry::specs() const {
  std::vector<TableSpec> specs;
  for (const auto& table : tables_) specs.push_back(table.spec);
  return specs;
}

VirtualShard* ServerRegistry::find_shard(int32_t shard) {
  auto it = shards_.find(shard);
  return it == shards_.end() ? nullptr : &it->second;
}

const VirtualShard* ServerRegistry::find_shard(int32_t shard) const {
  auto it = shards_.find(shard);
  return it == shards_.end() ? nullptr : &it->second;
}

size_t ServerRegistry::row_count() const {
  size_t count = 0;
  for (const auto& [id, shard] : shards_) count += shard.row_count();
  return count;
}
}  // namespace shoal::ps::detail
