#include "sum_handler.h"

#include <string>

namespace shoal::ps::detail {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t size : shape) n *= size;
  return n;
}

}  // namespace

SumHandler::SumHandler(int64_t chunk_elements) : chunk_elements_(chunk_elements) {
  if (chunk_elements <= 0) {
    throw UsageError("chunk_elements = " + std::to_string(chunk_elements) +
                     "; expected at least 1");
  }
}

void SumHandler::register_tables(const RegisterRequest& request, const Deadline&) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!tables_.empty()) {
    if (request.tables.size() != tables_.size()) {
      throw UsageError("worker " + std::to_string(request.worker) + " registers " +
                       std::to_string(request.tables.size()) + " tables; the job has " +
                       std::to_string(tables_.size()));
    }
    for (size_t i = 0; i < tables_.size(); ++i) {
      const TableSpec& have = tables_[i].spec;
      const TableSpec& got = request.tables[i];
      if (got.name != have.name || got.sparse != have.sparse || got.shape != have.shape) {
        throw UsageError("worker " + std::to_string(request.worker) + " registers table " +
                         std::to_string(i) + " as '" + got.name + "' " + shape_text(got.shape) +
                         "; the job has '" + have.name + "' " + shape_text(have.shape));
      }
    }
    return;
  }
  std::vector<Table> tables;
  for (const TableSpec& spec : request.tables) {
    Table table;
    table.spec = spec;
    if (spec.sparse) {
      if (spec.shape.size() != 2 || spec.shape[1] < 1) {
        throw UsageError("sparse table '" + spec.name + "' has shape " + shape_text(spec.shape) +
                         "; expected [rows, dim] with dim >= 1");
      }
      table.dim = spec.shape[1];
    } else {
      table.dense.assign(static_cast<size_t>(numel(spec.shape)), 0.0f);
    }
    tables.push_back(std::move(table));
  }
  tables_ = std::move(tables);
  // Dense tables start from the registering worker's values, where it sends them.
  for (const DenseSlice& slice : request.initial) {
    Table& t = table(slice.table, false);
    size_t at = 0;
    for (int64_t chunk : slice.chunks) {
      const auto [begin, end] = chunk_range(t, chunk);
      if (at + static_cast<size_t>(end - begin) > slice.values.size()) {
        tables_.clear();
        throw UsageError("initial values of table '" + t.spec.name + "': " +
                         std::to_string(slice.values.size()) + " values for its chunks; expected more");
      }
      std::copy(slice.values.begin() + at, slice.values.begin() + at + (end - begin),
                t.dense.begin() + begin);
      at += static_cast<size_t>(end - begin);
    }
  }
}

SumHandler::Table& SumHandler::table(int32_t index, bool sparse) {
  if (index < 0 || static_cast<size_t>(index) >= tables_.size()) {
    throw NotFoundError("table " + std::to_string(index) + " is not registered; the server has " +
                        std::to_string(tables_.size()) + " tables");
  }
  Table& table = tables_[index];
  if (table.spec.sparse != sparse) {
    throw UsageError("table " + std::to_string(index) + " ('" + table.spec.name + "') is " +
                     (table.spec.sparse ? "sparse" : "dense") + "; the request treats it as " +
                     (sparse ? "sparse" : "dense"));
  }
  return table;
}

std::pair<int64_t, int64_t> SumHandler::chunk_range(const Table& table, int64_t chunk) const {
  const int64_t size = static_cast<int64_t>(table.dense.size());
  const int64_t chunks = (size + chunk_elements_ - 1) / chunk_elements_;
  if (chunk < 0 || chunk >= chunks) {
    throw NotFoundError("table '" + table.spec.name + "' has no chunk " + std::to_string(chunk) +
                        "; it has " + std::to_string(chunks));
  }
  return {chunk * chunk_elements_, std::min(size, (chunk + 1) * chunk_elements_)};
}

PullReply SumHandler::pull(const PullRequest& request, const Deadline&) {
  std::lock_guard<std::mutex> lock(mutex_);
  PullReply reply;
  for (const DenseSlice& want : request.dense) {
    const Table& t = table(want.table, false);
    DenseSlice slice{want.table, want.chunks, {}};
    for (int64_t chunk : want.chunks) {
      const auto [begin, end] = chunk_range(t, chunk);
      slice.values.insert(slice.values.end(), t.dense.begin() + begin, t.dense.begin() + end);
    }
    reply.dense.push_back(std::move(slice));
  }
  for (const SparseSlice& want : request.sparse) {
    const Table& t = table(want.table, true);
    SparseSlice slice{want.table, want.ids, {}};
    slice.values.reserve(want.ids.size() * t.dim);
    for (int64_t id : want.ids) {
      const auto row = t.rows.find(id);
      if (row == t.rows.end()) {
        slice.values.insert(slice.values.end(), t.dim, 0.0f);
      } else {
        slice.values.insert(slice.values.end(), row->second.begin(), row->second.end());
      }
    }
    reply.sparse.push_back(std::move(slice));
  }
  reply.clock = pushes_;
  return reply;
}

PushReply SumHandler::push(const PushRequest& request, const Deadline&) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Check everything before changing anything: a refused push leaves the tables as they were.
  for (const DenseSlice& slice : request.dense) {
    const Table& t = table(slice.table, false);
    int64_t expected = 0;
    for (int64_t chunk : slice.chunks) {
      const auto [begin, end] = chunk_range(t, chunk);
      expected += end - begin;
    }
    if (static_cast<int64_t>(slice.count()) != expected) {
      throw UsageError("push to table '" + t.spec.name + "' carries " +
                       std::to_string(slice.count()) + " values for " +
                       std::to_string(slice.chunks.size()) + " chunks; expected " +
                       std::to_string(expected));
    }
  }
  for (const SparseSlice& slice : request.sparse) {
    const Table& t = table(slice.table, true);
    if (static_cast<int64_t>(slice.values.size()) !=
        static_cast<int64_t>(slice.ids.size()) * t.dim) {
      throw UsageError("push to table '" + t.spec.name + "' carries " +
                       std::to_string(slice.values.size()) + " values for " +
                       std::to_string(slice.ids.size()) + " rows of dim " + std::to_string(t.dim) +
                       "; expected " + std::to_string(slice.ids.size() * t.dim));
    }
  }
  for (const DenseSlice& slice : request.dense) {
    Table& t = tables_[slice.table];
    const float* values = slice.data();
    size_t at = 0;
    for (int64_t chunk : slice.chunks) {
      const auto [begin, end] = chunk_range(t, chunk);
      for (int64_t i = begin; i < end; ++i) t.dense[i] += values[at++];
    }
  }
  for (const SparseSlice& slice : request.sparse) {
    Table& t = tables_[slice.table];
    for (size_t r = 0; r < slice.ids.size(); ++r) {
      auto& row = t.rows[slice.ids[r]];
      row.resize(t.dim, 0.0f);
      for (int64_t j = 0; j < t.dim; ++j) row[j] += slice.values[r * t.dim + j];
    }
  }
  PushReply reply;
  reply.clock = ++pushes_;
  return reply;
}

}  // namespace shoal::ps::detail
