#include "server_core.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "optimizer.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail {

namespace {

std::string prefix(const char* what) {
  return std::string("parameter server: ") + what + ": ";
}

[[noreturn]] void bad(const char* what, const std::string& text) {
  throw UsageError(prefix(what) + text);
}

// A table, chunk or row this server does not hold (NOT_FOUND on the wire, handler.h).
[[noreturn]] void not_here(const char* what, const std::string& text) {
  throw NotFoundError(prefix(what) + text);
}

std::string list_workers(const std::vector<int32_t>& workers) {
  std::string out;
  for (int32_t w : workers) out += (out.empty() ? "" : ", ") + std::to_string(w);
  return out.empty() ? "none" : out;
}

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

ServerCore::ServerCore(ServerCoreOptions options) : options_(std::move(options)) {
  if (options_.consistency == Consistency::kBoundedStaleness && options_.staleness == 0)
    options_.consistency = Consistency::kSync;
  if (options_.staleness < 0)
    throw UsageError("parameter server: staleness bound " + std::to_string(options_.staleness) +
                     "; expected >= 0");
  if (options_.replicas_to_aggregate < 0 ||
      (options_.replicas_to_aggregate > 0 && options_.consistency != Consistency::kSync))
    throw UsageError("parameter server: replicas_to_aggregate " +
                     std::to_string(options_.replicas_to_aggregate) +
                     "; expected 0, or > 0 with sync consistency");
  if (options_.sealed_pushes && options_.replicas_to_aggregate > 0)
    throw UsageError("parameter server: sealed pushes with replicas_to_aggregate " +
                     std::to_string(options_.replicas_to_aggregate) +
                     "; expected 0 (backup workers are not supported with elastic workers)");
  if (options_.virtual_shards < 1)
    throw UsageError("parameter server: " + std::to_string(options_.virtual_shards) +
                     " virtual shards; expected at least 1");
  held_.assign(static_cast<size_t>(options_.virtual_shards), nullptr);
  for (int32_t shard : options_.shards) {
    if (shard < 0 || shard >= options_.virtual_shards)
      throw UsageError("parameter server: virtual shard " + std::to_string(shard) +
                       "; expected 0 <= shard < " + std::to_string(options_.virtual_shards));
    held_[static_cast<size_t>(shard)] = &shards_.emplace(shard, VirtualShard(shard)).first->second;
  }
  for (int32_t w : options_.workers) {
    if (w < 0)
      throw UsageError("parameter server: worker " + std::to_string(w) + "; expected >= 0");
    live_.insert(w);
    sealed_[w] = 0;
    clock_[w] = 0;
  }
}

const ServerCore::Table& ServerCore::table_at(const char* what, int32_t index) const {
  if (index < 0 || static_cast<size_t>(index) >= tables_.size())
    not_here(what, "unknown table index " + std::to_string(index) + "; expected 0 <= index < " +
                       std::to_string(tables_.size()) + " (the tables registered)");
  return tables_[static_cast<size_t>(index)];
}

VirtualShard* ServerCore::holder(int32_t shard) {
  return held_[static_cast<size_t>(shard)];
}

void ServerCore::check_slices(const char* what, const std::vector<DenseSlice>& dense,
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
      const int32_t shard = chunk_shard(table.spec.name, chunk, options_.virtual_shards);
      if (!holds(shard))
        not_here(what, name + ": chunk " + std::to_string(chunk) + " is in virtual shard " +
                           std::to_string(shard) + ", which this server does not hold");
      length += chunk_length(table.numel, chunk);
    }
    if (const auto twice = repeated(slice.chunks))
      bad(what, name + ": chunk " + std::to_string(*twice) + " is named twice; expected each once");
    const int64_t expected = with_values ? length : 0;
    if (static_cast<int64_t>(slice.values.size()) != expected)
      bad(what, name + ": " + std::to_string(slice.values.size()) + " values for " +
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
      const int32_t shard = row_shard(table.spec.name, id, options_.virtual_shards);
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

bool ServerCore::holds_dense_chunks(const std::vector<TableSpec>& tables) const {
  for (const auto& spec : tables) {
    if (spec.sparse) continue;
    for (int64_t c = 0; c < chunk_count(numel_of(spec.shape)); ++c)
      if (shards_.count(chunk_shard(spec.name, c, options_.virtual_shards)) != 0) return true;
  }
  return false;
}

void ServerCore::register_tables(const RegisterRequest& request, const Deadline& deadline) {
  const char* what = "register";
  std::unique_lock<std::mutex> lock(mutex_);
  for (const auto& spec : request.tables) check_spec(spec);
  // See Note [Who creates the tables].
  if (!registered_ && request.initial.empty() && holds_dense_chunks(request.tables)) {
    const auto until = std::chrono::steady_clock::now() + deadline.remaining();
    if (!changed_.wait_until(lock, until, [&] { return registered_; }))
      throw CommError("parameter server: registration of worker " + std::to_string(request.worker) +
                      " timed out after " + format_duration(deadline.elapsed()) +
                      " waiting for the registration that carries the dense tables' first values"
                      " (the first worker's)");
  }
  if (registered_) {
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
    return;  // the first registration's values stand
  }
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
        if (shards_.count(chunk_shard(tables_[t].spec.name, c, options_.virtual_shards)) != 0 &&
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
      holder(chunk_shard(table.spec.name, chunk, options_.virtual_shards))
          ->add_chunk(slice.table, chunk, table.spec.optimizer, values, length);
      values += length;
    }
  }
  registered_ = true;
  if (options_.restore) {
    if (auto restored = options_.restore()) {
      for (const auto& [shard, bytes] : restored->shards) load_shard_locked(shard, bytes);
      restored_step_ = restored->step;
      adopting_ = true;
    }
  }
  changed_.notify_all();
}

// Note [Clocks after a reload]: a server restarted from a snapshot of step S holds its shards as
// they were at S, while the workers are at some step C >= S: their updates of steps S..C-1 to this
// server's shards are lost. The server adopts the workers' clocks rather than make them go back:
// each worker's first request tells its clock (a push of step c: c; a pull at clock p: p, and its
// push of step p - 1, which the dead server had and this one has not, counts as lost). Once every
// live worker is known, the server's step is the lowest of them (sync), and a step some workers'
// lost pushes belong to completes with the pushes that did arrive (none: nothing is applied).
void ServerCore::adopt(int32_t w, int64_t clock) {
  if (!adopting_ || adopted_.count(w) != 0 || live_.count(w) == 0 || clock < 0) return;
  adopted_[w] = clock;
  clock_[w] = clock;
  sealed_[w] = std::max(sealed_[w], clock);  // it pushed step `clock`: it sealed those before
  for (int32_t other : live_)
    if (adopted_.count(other) == 0) return;
  int64_t lowest = INT64_MAX;
  for (int32_t other : live_) lowest = std::min(lowest, adopted_[other]);
  adopting_ = false;
  if (options_.consistency == Consistency::kSync) step_ = lowest;
  if (options_.on_adopted) options_.on_adopted(restored_step_, lowest);
  if (options_.consistency == Consistency::kSync) apply_ready_steps();
  changed_.notify_all();
}

bool ServerCore::lost_push(int32_t w, int64_t clock) const {
  auto it = adopted_.find(w);
  return it != adopted_.end() && clock < it->second;
}

void ServerCore::apply_chunk(int32_t index, int64_t chunk, const float* grad) {
  const Table& table = tables_[static_cast<size_t>(index)];
  const int64_t length = chunk_length(table.numel, chunk);
  Slot* slot =
      holder(chunk_shard(table.spec.name, chunk, options_.virtual_shards))->chunk(index, chunk);
  SHOAL_CHECK(slot != nullptr) << "chunk " << chunk << " of table " << table.spec.name;
  apply_dense(table.spec.optimizer, slot->values(), slot->state(length), slot->step, grad, length);
}

void ServerCore::apply(const std::vector<DenseSlice>& dense,
                       const std::vector<SparseSlice>& sparse) {
  for (const auto& slice : dense) {
    const Table& table = tables_[static_cast<size_t>(slice.table)];
    const float* grad = slice.values.data();
    for (int64_t chunk : slice.chunks) {
      apply_chunk(slice.table, chunk, grad);
      grad += chunk_length(table.numel, chunk);
    }
  }
  for (const auto& slice : sparse) {
    const Table& table = tables_[static_cast<size_t>(slice.table)];
    const float* grad = slice.values.data();
    for (int64_t id : slice.ids) {
      Slot& row = holder(row_shard(table.spec.name, id, options_.virtual_shards))
                      ->touch_row(slice.table, id, table.spec, table.dim);
      apply_row(table.spec.optimizer, row.values(), row.state(table.dim), row.step, grad,
                table.dim);
      grad += table.dim;
    }
  }
}

bool ServerCore::step_complete(int64_t clock) const {
  if (adopting_) return false;  // the step is not known yet (Note [Clocks after a reload])
  auto it = pending_.find(clock);
  const size_t have = it == pending_.end() ? 0 : it->second.size();
  if (options_.replicas_to_aggregate > 0) {
    const size_t need = std::min(static_cast<size_t>(options_.replicas_to_aggregate),
                                 std::max<size_t>(live_.size(), 1));
    return have >= need;
  }
  if (live_.empty()) return have > 0;  // only leavers' counted pushes remain
  for (int32_t w : live_) {
    if (joined_after(w, clock)) continue;  // Note [Joins and leaves]
    if ((it == pending_.end() || it->second.count(w) == 0) && !lost_push(w, clock)) return false;
    if (options_.sealed_pushes && sealed_.at(w) <= clock) return false;
  }
  return true;
}

// Note [Sealed pushes]
// A worker pushes its step to every server, concurrently, and pulls only once every server has
// acknowledged its push. A pull at clock c therefore seals the worker's pushes of steps before c:
// each of them is held by every server. With sealed_pushes (elastic jobs) a push counts only once
// sealed: sync applies step c once every live worker has pushed it and sealed it, async and
// bounded staleness apply a push when its seal arrives. A worker that dies between its pushes to
// two servers has sealed that step nowhere, so no server applied it; one that dies after sealing
// it anywhere had pushed it everywhere. When it leaves, the highest clock it sealed on any server
// (sealed_clock, asked of every server) decides for all servers alike: its pushes before that
// clock count, the rest are dropped and their batches go back into the epoch's ledger. So a
// leaver's gradient counts or is discarded together with its samples, on every server.
void ServerCore::seal(int32_t w, int64_t clock) {
  int64_t& sealed = sealed_[w];
  if (clock <= sealed) return;
  sealed = clock;
  if (options_.consistency == Consistency::kSync) {
    apply_ready_steps();
  } else {
    auto& mine = unsealed_[w];
    while (!mine.empty() && mine.begin()->first < clock) {
      auto node = mine.extract(mine.begin());
      apply(node.mapped().dense, node.mapped().sparse);
      ++step_;
      finish_batch(w, node.mapped());
      recycle(w, node.mapped());
      take_snapshot_when_due();
    }
  }
  changed_.notify_all();
}

void ServerCore::finish_batch(int32_t worker, const PushRequest& push) {
  if (ledger_ && push.batch >= 0) ledger_->done(worker, push.epoch, push.batch);
}

void ServerCore::finish_batches(const std::map<int32_t, PushRequest>& pushes) {
  for (const auto& [worker, push] : pushes) finish_batch(worker, push);
}

// Note [Server 0 decides]: with backup workers (replicas_to_aggregate k) a sync step counts the
// first k pushes that reach the server, and the rest are dropped, their batches going back into
// the epoch. With several servers the first k may differ from server to server, which would
// apply one worker's gradient on some servers only. So one server decides: a worker pushes to
// server 0 first (verdict kDecide), then to the others with server 0's answer (kCounted or
// kDropped), and a server takes a step as complete once it holds k pushes, all of them counted by
// server 0. A primary forwards a push it dropped to its backup as kDropped (without its values),
// so that the backup, whose pushes arrive in another order, drops the same ones.

// Note [Sync sum]: step c applies sum_w rows_w * grad_w / sum_w rows_w over the pushes it took,
// accumulated in double in worker order (std::map), then rounded once: deterministic, and the
// gradient of the mean loss over the workers' concatenated batches. A chunk or row that no push
// names is not stepped, as a parameter without a gradient in torch.
void ServerCore::apply_ready_steps() {
  while (step_complete(step_)) {
    auto node = pending_.extract(step_);
    if (!node.empty()) {
      sum_step(node.mapped());
      finish_batches(node.mapped());
      recycle(node.mapped());
    }
    ++step_;
    take_snapshot_when_due();
  }
}

size_t ServerCore::next_chunk(size_t first) const {
  size_t last = first;
  while (last < sum_terms_.size() && sum_terms_[last].table == sum_terms_[first].table &&
         sum_terms_[last].chunk == sum_terms_[first].chunk) {
    ++last;
  }
  return last;
}

void ServerCore::sum_chunks(size_t first, size_t end, double total, SumScratch& scratch) {
  scratch.acc.resize(static_cast<size_t>(kChunkElements));
  scratch.out.resize(static_cast<size_t>(kChunkElements));
  while (first < end) {
    const SumTerm& head = sum_terms_[first];
    const Table& table = tables_[static_cast<size_t>(head.table)];
    const int64_t length = chunk_length(table.numel, head.chunk);
    double* acc = scratch.acc.data();
    std::fill(acc, acc + length, 0.0);
    const size_t last = next_chunk(first);
    for (size_t term = first; term < last; ++term) {
      const double weight = sum_terms_[term].weight;
      const float* grad = sum_terms_[term].grad;
      for (int64_t i = 0; i < length; ++i) acc[i] += weight * grad[i];
    }
    float* out = scratch.out.data();
    for (int64_t i = 0; i < length; ++i) out[i] = static_cast<float>(acc[i] / total);
    apply_chunk(head.table, head.chunk, out);
    first = last;
  }
}

// Note [A step's sum without allocations]: a dense model's push is tens of MB; a buffer of that
// size allocated per step is mmap'ed by glibc and given back at free, so every step faulted its
// pages in anew (half the cycles of a one-process run). The dense sum is therefore taken chunk by
// chunk (a chunk is at most kChunkElements values) in two scratch buffers kept by the core, and
// each chunk's optimizer step applied at once from them; the buffered pushes' storage is kept per
// worker and refilled by the next push (buffer_push). The arithmetic is Note [Sync sum]'s, term
// for term: results are bit-identical to a sum over whole tables.
void ServerCore::sum_step(const std::map<int32_t, PushRequest>& pushes) {
  double total = 0;
  for (const auto& [worker, push] : pushes) total += static_cast<double>(push.rows);

  // Dense: every (table, chunk, push) named, sorted so that a chunk's terms are adjacent and in
  // worker order (pushes is ordered by worker).
  sum_terms_.clear();
  size_t order = 0;
  for (const auto& [worker, push] : pushes) {
    for (const auto& slice : push.dense) {
      const Table& table = tables_[static_cast<size_t>(slice.table)];
      const float* grad = slice.values.data();
      for (int64_t chunk : slice.chunks) {
        sum_terms_.push_back({slice.table, chunk, order, static_cast<double>(push.rows), grad});
        grad += chunk_length(table.numel, chunk);
      }
    }
    ++order;
  }
  std::sort(sum_terms_.begin(), sum_terms_.end(), [](const SumTerm& a, const SumTerm& b) {
    return std::tie(a.table, a.chunk, a.order) < std::tie(b.table, b.chunk, b.order);
  });
  // Note [A step's sum on two threads]: in sync the workers wait for this sum, so a second
  // thread takes the chunks from the middle of the model on; each chunk's arithmetic is the same
  // on either thread, so the result is bit-identical to one thread's.
  const auto length_at = [&](size_t term) {
    const SumTerm& t = sum_terms_[term];
    return static_cast<size_t>(chunk_length(tables_[static_cast<size_t>(t.table)].numel, t.chunk));
  };
  size_t values = 0;
  for (size_t first = 0; first < sum_terms_.size(); first = next_chunk(first)) {
    values += length_at(first);
  }
  size_t split = sum_terms_.size();
  if (options_.sum_threads > 1 && values >= kSumSplitAtLeast) {
    size_t below = 0;
    for (split = 0; split < sum_terms_.size() && 2 * below < values; split = next_chunk(split)) {
      below += length_at(split);
    }
  }
  std::thread second;
  std::exception_ptr failed;
  if (split < sum_terms_.size()) {
    try {
      second = std::thread([this, split, total, &failed] {
        try {
          sum_chunks(split, sum_terms_.size(), total, sum_scratch_[1]);
        } catch (...) {
          failed = std::current_exception();
        }
      });
    } catch (const std::system_error&) {
      split = sum_terms_.size();  // no thread to be had: this one sums it all
    }
  }
  try {
    sum_chunks(0, split, total, sum_scratch_[0]);
  } catch (...) {
    if (second.joinable()) second.join();
    throw;
  }
  if (second.joinable()) second.join();
  if (failed) std::rethrow_exception(failed);

  // Sparse: rows are few per step; each row's sum in the order rows first appear.
  struct RowSums {
    std::unordered_map<int64_t, size_t> at;
    std::vector<int64_t> ids;
    std::vector<double> acc;
  };
  std::map<int32_t, RowSums> rows;
  for (const auto& [worker, push] : pushes) {
    const auto weight = static_cast<double>(push.rows);
    for (const auto& slice : push.sparse) {
      const Table& table = tables_[static_cast<size_t>(slice.table)];
      const float* grad = slice.values.data();
      const auto dim = static_cast<size_t>(table.dim);
      RowSums& sums = rows[slice.table];
      sums.at.reserve(sums.at.size() + slice.ids.size());
      for (int64_t id : slice.ids) {
        auto [it, fresh] = sums.at.emplace(id, sums.ids.size());
        if (fresh) {
          sums.ids.push_back(id);
          sums.acc.resize(sums.acc.size() + dim, 0.0);
        }
        double* acc = sums.acc.data() + it->second * dim;
        for (size_t i = 0; i < dim; ++i) acc[i] += weight * grad[i];
        grad += dim;
      }
    }
  }
  if (rows.empty()) return;
  std::vector<SparseSlice> sparse;
  for (auto& [table, sums] : rows) {
    SparseSlice slice{table, std::move(sums.ids), std::vector<float>(sums.acc.size())};
    for (size_t i = 0; i < sums.acc.size(); ++i)
      slice.values[i] = static_cast<float>(sums.acc[i] / total);
    sparse.push_back(std::move(slice));
  }
  apply({}, sparse);
}

// Sync: a push waits in pending_ for its step, in storage kept per worker from its pushes before
// (see Note [A step's sum without allocations]): the values are copied in place, not allocated.
//
// Note [Taking a push's storage]: the transport decodes each push into a request its gRPC thread
// keeps, and needs it no more once the handler returns. Copying its dense values into the held
// push was one more pass over the model's size per worker and step on the server, on the step's
// critical path in sync (a worker waits for the step). push_taking swaps the two instead: the
// held push gets the values, the transport's request gets the held push's storage from an
// earlier step, of the same sizes, which its next decode refills without allocating. A replica's
// primary forwards the request after handling it, so ReplicatedHandler keeps Handler's default
// (a copy); the in-process core of a job of one takes the client's own request, which the client
// refills at its next step. An elastic job's unsealed pushes (async, ssp) are held alike.
void ServerCore::buffer_push(const PushRequest& request, PushRequest* take) {
  pending_[request.clock].emplace(request.worker, hold(request, take));
}

PushRequest ServerCore::hold(const PushRequest& request, PushRequest* take) {
  PushRequest held;
  auto spare = spare_.find(request.worker);
  if (spare != spare_.end()) {
    held = std::move(spare->second);
    spare_.erase(spare);
  }
  held.worker = request.worker;
  held.clock = request.clock;
  held.rows = request.rows;
  held.epoch = request.epoch;
  held.batch = request.batch;
  held.dense.resize(request.dense.size());
  for (size_t i = 0; i < request.dense.size(); ++i) {
    held.dense[i].table = request.dense[i].table;
    if (take != nullptr) {
      held.dense[i].chunks.swap(take->dense[i].chunks);
      held.dense[i].values.swap(take->dense[i].values);
    } else {
      held.dense[i].chunks.assign(request.dense[i].chunks.begin(), request.dense[i].chunks.end());
      held.dense[i].values.assign(request.dense[i].values.begin(), request.dense[i].values.end());
    }
  }
  held.sparse = request.sparse;  // rows are few; their storage is not worth keeping
  return held;
}

void ServerCore::recycle(int32_t worker, PushRequest& push) {
  push.sparse.clear();
  spare_[worker] = std::move(push);
}

void ServerCore::recycle(std::map<int32_t, PushRequest>& pushes) {
  for (auto& [worker, push] : pushes) recycle(worker, push);
}

PushReply ServerCore::push(const PushRequest& request, const Deadline& /*deadline*/) {
  return accept_push(request, nullptr);
}

PushReply ServerCore::push_taking(PushRequest& request, const Deadline& /*deadline*/) {
  return accept_push(request, &request);
}

PushReply ServerCore::accept_push(const PushRequest& request, PushRequest* take) {
  const char* what = "push";
  std::lock_guard<std::mutex> lock(mutex_);
  const int32_t w = request.worker;
  check_live(what, w);
  adopt(w, request.clock);
  const int64_t next = clock_[w];
  // See Note [Retried pushes] (server_core.h).
  if (request.clock == next - 1) {
    auto last = last_reply_.find(w);
    if (last != last_reply_.end()) return last->second;
  }
  if (request.clock != next)
    bad(what, "worker " + std::to_string(w) + " pushed step " + std::to_string(request.clock) +
                  "; expected its next step " + std::to_string(next));
  if (request.rows < 0 ||
      (request.rows == 0 && (!request.dense.empty() || !request.sparse.empty())))
    bad(what, "worker " + std::to_string(w) + " pushed a gradient of " +
                  std::to_string(request.rows) + " samples" +
                  (request.rows == 0 ? " with values" : "") +
                  "; expected rows >= 1, or 0 with no values (an idle step)");
  check_slices(what, request.dense, request.sparse, true);
  if (ledger_ && request.batch >= 0 && !ledger_->is_out(w, request.epoch, request.batch))
    bad(what, "worker " + std::to_string(w) + " pushed the gradient of batch " +
                  std::to_string(request.batch) + " of epoch " + std::to_string(request.epoch) +
                  "; expected a batch leased to it and not yet trained");

  PushReply reply;
  clock_[w] = next + 1;
  if (options_.consistency != Consistency::kSync && options_.sealed_pushes) {
    unsealed_[w].emplace(request.clock, hold(request, take));  // applied when sealed
  } else if (options_.consistency != Consistency::kSync) {
    apply(request.dense, request.sparse);
    ++step_;
    finish_batch(w, request);
    take_snapshot_when_due();
  } else if (request.verdict == PushRequest::Verdict::kCounted && request.clock < step_) {
    bad(what, "worker " + std::to_string(w) + "'s push of step " + std::to_string(request.clock) +
                  " was counted by server 0, but this server applied that step without it; "
                  "expected every server of the job to run with the same backup workers");
  } else if (request.verdict == PushRequest::Verdict::kDropped || request.clock < step_ ||
             (request.verdict == PushRequest::Verdict::kDecide &&
              options_.replicas_to_aggregate > 0 &&
              pending_[request.clock].size() >=
                  static_cast<size_t>(options_.replicas_to_aggregate))) {
    // The step was full without it (backup workers; Note [Server 0 decides]).
    reply.counted = false;
    // Its samples go back into the epoch, unlike TensorFlow's SyncReplicasOptimizer's.
    if (ledger_ && request.batch >= 0) ledger_->give_back(w, request.epoch, request.batch);
  } else {
    buffer_push(request, take);  // Note [Taking a push's storage]
    apply_ready_steps();
  }
  reply.clock = step_;
  last_reply_[w] = reply;
  changed_.notify_all();
  return reply;
}

void ServerCore::check_live(const char* what, int32_t w) const {
  if (gone_.count(w) != 0)
    bad(what, "worker " + std::to_string(w) +
                  " has left the job (its launcher saw it exit); expected a live worker");
  if (live_.count(w) == 0)
    bad(what, "worker " + std::to_string(w) + " is not live; expected one of " +
                  list_workers({live_.begin(), live_.end()}));
}

int64_t ServerCore::slowest_clock() const {
  int64_t slowest = INT64_MAX;
  for (int32_t w : live_) slowest = std::min(slowest, clock_.at(w));
  return live_.empty() ? step_ : slowest;
}

std::string ServerCore::describe_sync_wait(int64_t step) const {
  auto it = pending_.find(step);
  std::vector<int32_t> have, missing;
  std::set<int32_t> unsealed;
  for (int32_t w : live_) {
    if (joined_after(w, step)) continue;
    const bool pushed = it != pending_.end() && it->second.count(w) != 0;
    if (pushed && options_.sealed_pushes && sealed_.at(w) <= step) unsealed.insert(w);
    if (pushed && unsealed.count(w) == 0)
      have.push_back(w);
    else
      missing.push_back(w);
  }
  std::string text = "step " + std::to_string(step) + " to be applied (pushed by workers " +
                     list_workers(have) + "; waiting for workers ";
  std::string waiting;
  for (int32_t w : missing)
    waiting += (waiting.empty() ? "" : ", ") + std::to_string(w) + " at clock " +
               std::to_string(clock_.at(w)) + (unsealed.count(w) != 0 ? " (not sealed)" : "");
  return text + (waiting.empty() ? "none" : waiting) + ")";
}

std::string ServerCore::describe_staleness_wait(int64_t needed) const {
  std::string waiting;
  for (int32_t w : live_)
    if (clock_.at(w) < needed)
      waiting += (waiting.empty() ? "" : ", ") + std::to_string(w) + " at clock " +
                 std::to_string(clock_.at(w));
  return "every live worker to reach clock " + std::to_string(needed) + " (staleness bound " +
         std::to_string(options_.staleness) + "; waiting for workers " + waiting + ")";
}

PullReply ServerCore::pull(const PullRequest& request, const Deadline& deadline) {
  PullReply reply;
  pull(request, deadline, reply);
  return reply;
}

// Writes into `reply`'s storage: a reply kept from the pull before has every vector sized already
// (Note [A step's sum without allocations]).
//
// Note [Pull replies in place]: a pull over gRPC from a worker on this host is answered through
// the worker's shared segment (Note [Values in shared memory], wire.h). Writing the values into
// the reply and the transport copying them into the segment were two passes over the model's size
// per worker and step; the transport now offers the segment (pull_into, DenseOut) and the values
// go there straight from the tables when they fit, one pass.
void ServerCore::fill_reply(const PullRequest& request, PullReply& reply, DenseOut* out) {
  reply.dense.resize(request.dense.size());
  const auto length_of = [&](const DenseSlice& slice) {
    return chunks_length(tables_[static_cast<size_t>(slice.table)].numel, slice.chunks);
  };
  size_t total = 0;
  for (const DenseSlice& slice : request.dense) total += length_of(slice);
  const bool in_place = out != nullptr && !request.dense.empty() && total <= out->capacity;
  if (out != nullptr) out->counts.clear();
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
      const Slot* slot = holder(chunk_shard(table.spec.name, chunk, options_.virtual_shards))
                             ->chunk(slice.table, chunk);
      SHOAL_CHECK(slot != nullptr) << "chunk " << chunk << " of table " << table.spec.name;
      std::memcpy(dst, slot->values(), static_cast<size_t>(n) * sizeof(float));
      dst += n;
    }
  }
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
      holder(row_shard(table.spec.name, id, options_.virtual_shards))
          ->read_row(slice.table, id, table.spec, table.dim, dst);
      dst += table.dim;
    }
  }
}

void ServerCore::pull(const PullRequest& request, const Deadline& deadline, PullReply& reply) {
  answer_pull(request, deadline, reply, nullptr);
}

void ServerCore::pull_into(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                           DenseOut& out) {
  answer_pull(request, deadline, reply, &out);
}

void ServerCore::answer_pull(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                             DenseOut* out) {
  const char* what = "pull";
  std::unique_lock<std::mutex> lock(mutex_);
  const int32_t w = request.worker;
  check_live(what, w);
  adopt(w, request.clock);
  if (request.clock < 0 || request.clock > clock_[w])
    bad(what, "worker " + std::to_string(w) + " pulled at clock " + std::to_string(request.clock) +
                  "; expected 0 <= clock <= " + std::to_string(clock_[w]) + " (its pushed steps)");
  check_slices(what, request.dense, request.sparse, false);
  if (options_.sealed_pushes) seal(w, request.clock);

  auto ready = [&] {
    if (live_.count(w) == 0 || gone_.count(w) != 0) return true;  // it left: answered below
    switch (options_.consistency) {
      case Consistency::kSync:
        return step_ >= request.clock;
      case Consistency::kBoundedStaleness:
        return slowest_clock() >= request.clock - options_.staleness;
      case Consistency::kAsync:
        return true;
    }
    return true;
  };
  const auto until = std::chrono::steady_clock::now() + deadline.remaining();
  ++pulls_waiting_;
  const bool woke = changed_.wait_until(lock, until, ready);
  --pulls_waiting_;
  if (!woke) {
    const std::string waited_for =
        options_.consistency == Consistency::kSync
            ? describe_sync_wait(step_)
            : describe_staleness_wait(request.clock - options_.staleness);
    throw CommError("parameter server: pull of worker " + std::to_string(w) + " at clock " +
                    std::to_string(request.clock) + " timed out after " +
                    format_duration(deadline.elapsed()) + " waiting for " + waited_for);
  }
  if (live_.count(w) == 0 || gone_.count(w) != 0)
    throw CommError("parameter server: pull of worker " + std::to_string(w) + " at clock " +
                    std::to_string(request.clock) + " ended after " +
                    format_duration(deadline.elapsed()) +
                    ": the worker left the live set while it waited");

  fill_reply(request, reply, out);
  reply.clock = step_;
  int64_t fastest = 0;
  for (int32_t v : live_) fastest = std::max(fastest, clock_.at(v));
  reply.staleness = live_.empty() ? 0 : fastest - slowest_clock();
}

void ServerCore::set_live_workers(const std::vector<int32_t>& workers, LeaverPush leavers) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int32_t w : workers)
    if (w < 0) bad("set_live_workers", "worker " + std::to_string(w) + "; expected >= 0");
  const std::set<int32_t> next(workers.begin(), workers.end());
  std::set<int32_t> staying;
  for (int32_t w : live_)
    if (next.count(w) != 0) staying.insert(w);
  int64_t start = step_;
  if (options_.consistency != Consistency::kSync && !staying.empty()) {
    start = INT64_MAX;
    for (int32_t w : staying) start = std::min(start, clock_[w]);
  }
  if (leavers == LeaverPush::kDiscard)
    for (auto& [step, pushes] : pending_)
      for (int32_t w : live_)
        if (next.count(w) == 0) pushes.erase(w);
  for (int32_t w : live_)
    if (next.count(w) == 0) release_batches(w);
  for (int32_t w : next) {
    if (live_.count(w) != 0) continue;
    clock_[w] = start;
    sealed_[w] = start;
    joined_at_[w] = start;
    unsealed_.erase(w);
    last_reply_.erase(w);  // a joiner's clock starts anew: no step of it was pushed yet
  }
  live_ = next;
  if (options_.consistency == Consistency::kSync) apply_ready_steps();
  changed_.notify_all();
}

void ServerCore::release_batches(int32_t w) {
  if (!ledger_) return;
  std::set<int64_t> counted;  // batches of pushes still to be applied with their step
  for (const auto& [step, pushes] : pending_) {
    auto it = pushes.find(w);
    if (it != pushes.end() && it->second.batch >= 0 && it->second.epoch == ledger_->epoch())
      counted.insert(it->second.batch);
  }
  ledger_->release(w, counted);
}

int64_t ServerCore::sealed_clock(int32_t worker) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sealed_.find(worker);
  return it == sealed_.end() ? 0 : it->second;
}

void ServerCore::leave(int32_t w, int64_t sealed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!options_.sealed_pushes)
    bad("leave", "worker " + std::to_string(w) +
                     " leaves by its sealed clock, but this server does not seal pushes; expected "
                     "set_live_workers");
  if (live_.count(w) == 0 && gone_.count(w) != 0) return;  // fenced before it ever joined here
  if (live_.count(w) == 0)
    bad("leave", "worker " + std::to_string(w) + " is not live; expected one of " +
                     list_workers({live_.begin(), live_.end()}));
  // Pushes before `sealed` reached every server and count here too; later ones are dropped.
  if (options_.consistency == Consistency::kSync) {
    for (auto& [step, pushes] : pending_)
      if (step >= sealed) pushes.erase(w);
  } else {
    auto& mine = unsealed_[w];
    for (auto it = mine.begin(); it != mine.end();)
      it = it->first >= sealed ? mine.erase(it) : std::next(it);
  }
  seal(w, sealed);  // applies what it completes (not sync: its counted pushes, at once)
  live_.erase(w);
  unsealed_.erase(w);
  release_batches(w);
  if (options_.consistency == Consistency::kSync) apply_ready_steps();
  changed_.notify_all();
}

// Note [Joins and leaves]
// An elastic job's worker joins each server by itself, once it is ready to train (a launcher
// that made it live at its start would stall sync steps for the seconds a program takes to load):
// join(w, 0) on every server answers the clock each makes it live from (its own step in sync, so
// that it blocks no step already open without it; its slowest worker's clock otherwise, so that
// it neither holds the others back nor lags), and the worker joins again on every server with the
// highest of them, C. A server that answered less raises the worker's clock to C and no longer
// waits for its pushes of steps before C, and no server can pass step C without its push of C
// once it is live there: after the second round every server has it live from C, and it pulls at
// C. A worker id is never live twice: a restarted worker joins under a new one.
//
// A worker is lost when its launcher sees its process exit. Requests of the dead process may
// still be in a server's threads, and a seal that arrived after its sealed clock was read would
// count a push on one server only; so the launcher first fences the worker off on every server
// (fence(): from then on the server takes no request of it, and answers its sealed clock, read
// under the same lock), and only then makes it leave everywhere with the highest sealed clock
// (leave(), Note [Sealed pushes]).
int64_t ServerCore::join(int32_t w, int64_t clock) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!options_.sealed_pushes)
    bad("join", "worker " + std::to_string(w) +
                    " joins, but this server does not seal pushes; expected an elastic job");
  if (gone_.count(w) != 0)
    bad("join", "worker " + std::to_string(w) +
                    " has left the job; expected a new worker id for a worker that joins again");
  if (live_.count(w) == 0) {
    const int64_t floor = options_.consistency == Consistency::kSync || live_.empty()
                              ? step_
                              : slowest_clock();
    const int64_t start = std::max(clock, floor);
    live_.insert(w);
    clock_[w] = start;
    sealed_[w] = start;
    joined_at_[w] = start;
    unsealed_.erase(w);
    last_reply_.erase(w);
  } else if (clock > clock_[w] && clock_[w] == joined_at_[w]) {
    // Live here from an earlier clock than another server made it, and nothing pushed since.
    clock_[w] = clock;
    sealed_[w] = clock;
    joined_at_[w] = clock;
    if (options_.consistency == Consistency::kSync) apply_ready_steps();
  }
  changed_.notify_all();
  return clock_[w];
}

int64_t ServerCore::fence(int32_t w) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!options_.sealed_pushes)
    bad("fence", "worker " + std::to_string(w) +
                     " is fenced off, but this server does not seal pushes; expected an elastic "
                     "job");
  gone_.insert(w);
  changed_.notify_all();  // its pulls still waiting end
  auto it = sealed_.find(w);
  return it == sealed_.end() ? 0 : it->second;
}

MembershipReply ServerCore::membership(const MembershipRequest& request,
                                       const Deadline& /*deadline*/) {
  switch (request.op) {
    case MembershipRequest::Op::kJoin:
      return {join(request.worker, request.clock)};
    case MembershipRequest::Op::kFence:
      return {fence(request.worker)};
    case MembershipRequest::Op::kLeave:
      leave(request.worker, request.clock);
      return {request.clock};
  }
  throw UsageError("parameter server: unknown membership op " +
                   std::to_string(static_cast<int32_t>(request.op)));
}

LeaseReply ServerCore::lease(const LeaseRequest& request, const Deadline& /*deadline*/) {
  const int32_t worker = request.worker;
  const Ledger::Options data{request.dataset_size, request.batch_size, request.drop_last};
  std::lock_guard<std::mutex> lock(mutex_);
  if (options_.snapshot_every > 0)
    bad("lease", "worker " + std::to_string(worker) +
                     " asked for a batch, but this server writes snapshots, which do not hold the "
                     "ledger yet (a restarted server would start the epoch again); expected a job "
                     "without --ps-snapshot-dir to lease batches");
  check_live("lease", worker);
  if (!ledger_) ledger_.emplace(data);
  const Ledger::Options& kept = ledger_->options();
  if (data.dataset_size != kept.dataset_size || data.batch_size != kept.batch_size ||
      data.drop_last != kept.drop_last) {
    bad("lease", "worker " + std::to_string(worker) + " names a data set of " +
                     std::to_string(data.dataset_size) + " samples in batches of " +
                     std::to_string(data.batch_size) + (data.drop_last ? " (drop_last)" : "") +
                     "; expected the ledger's " + std::to_string(kept.dataset_size) +
                     " in batches of " + std::to_string(kept.batch_size) +
                     (kept.drop_last ? " (drop_last)" : ""));
  }
  const Ledger::Lease lease = ledger_->lease(worker, request.epoch);
  return {static_cast<LeaseReply::Kind>(lease.kind), lease.epoch, lease.batch, lease.begin,
          lease.end};
}

std::optional<std::array<int64_t, 3>> ServerCore::ledger_counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ledger_) return std::nullopt;
  return std::array<int64_t, 3>{ledger_->epoch(), ledger_->done_count(), ledger_->out_count()};
}

int64_t ServerCore::staleness() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (live_.empty()) return 0;
  int64_t fastest = 0;
  for (int32_t w : live_) fastest = std::max(fastest, clock_.at(w));
  return fastest - slowest_clock();
}

int64_t ServerCore::step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return step_;
}

int64_t ServerCore::clock_of(int32_t worker) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = clock_.find(worker);
  return it == clock_.end() ? 0 : it->second;
}

int64_t ServerCore::pulls_waiting() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pulls_waiting_;
}

size_t ServerCore::row_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = 0;
  for (const auto& [id, shard] : shards_) count += shard.row_count();
  return count;
}

void ServerCore::take_snapshot_when_due() {
  if (options_.snapshot_every <= 0 || !options_.on_snapshot) return;
  if (step_ % options_.snapshot_every != 0) return;
  std::map<int32_t, std::string> shards;
  const auto tables = specs();
  for (const auto& [shard, contents] : shards_) shards.emplace(shard, contents.save(tables));
  options_.on_snapshot(step_, std::move(shards));
}

std::vector<TableSpec> ServerCore::specs() const {
  std::vector<TableSpec> specs;
  for (const auto& table : tables_) specs.push_back(table.spec);
  return specs;
}

std::string ServerCore::save_shard(int32_t shard) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = shards_.find(shard);
  if (it == shards_.end())
    bad("save_shard", "virtual shard " + std::to_string(shard) + " is not held by this server");
  return it->second.save(specs());
}

void ServerCore::load_shard(int32_t shard, const std::string& bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  load_shard_locked(shard, bytes);
}

void ServerCore::load_shard_locked(int32_t shard, const std::string& bytes) {
  auto it = shards_.find(shard);
  if (it == shards_.end())
    bad("load_shard", "virtual shard " + std::to_string(shard) + " is not held by this server");
  VirtualShard loaded = VirtualShard::load(shard, specs(), bytes, options_.virtual_shards);
  // A dense chunk the snapshot lacks would leave the table with a hole.
  for (size_t t = 0; t < tables_.size(); ++t) {
    if (tables_[t].spec.sparse) continue;
    for (int64_t c = 0; c < chunk_count(tables_[t].numel); ++c)
      if (chunk_shard(tables_[t].spec.name, c, options_.virtual_shards) == shard &&
          loaded.chunk(static_cast<int32_t>(t), c) == nullptr)
        bad("load_shard", "the snapshot of virtual shard " + std::to_string(shard) +
                              " has no chunk " + std::to_string(c) + " of table '" +
                              tables_[t].spec.name + "'; expected every chunk of the shard");
  }
  it->second = std::move(loaded);
}

}  // namespace shoal::ps::detail
