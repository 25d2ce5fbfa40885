#include "server_sum.h"

#include <algorithm>
#include <exception>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "server_core.h"
#include "server_registry.h"
#include "squares.h"

namespace shoal::ps::detail {

ServerSum::ServerSum(const ServerCoreOptions& options, ServerRegistry& registry)
    : options_(options), registry_(registry) {}

// Note [Sync sum]: step c applies sum_w rows_w * grad_w / sum_w rows_w over the pushes it took,
// accumulated in double in worker order (std::map), then rounded once: deterministic, and the
// gradient of the mean loss over the workers' concatenated batches. A chunk or row that no push
// names is not stepped, as a parameter without a gradient in torch.

// Note [A step's sum without allocations]: a dense model's push is tens of MB; a buffer of that
// size allocated per step is mmap'ed by glibc and given back at free, so every step faulted its
// pages in anew (half the cycles of a one-process run). The dense sum is therefore taken chunk by
// chunk (a chunk is at most kChunkElements values) in two scratch buffers kept by the core, and
// each chunk's optimizer step applied at once from them; the buffered pushes' storage is kept per
// worker and refilled by the next push (buffer_push). The arithmetic is Note [Sync sum]'s, term
// for term: results are bit-identical to a sum over whole tables.
// Note [The gradient noise on servers]
// A sync step holds what DataParallel measures the gradient noise from (Note [Measuring the
// gradient noise], shoal/dp/gradient_noise.h): each worker's mean gradient g_i over its b_i rows,
// and their mean weighted by rows over B = sum b_i, the gradient the step applies. With S the mean
// of |g_i|^2 and L = |applied|^2, E S = |G|^2 + tr(Sigma) / b and E L = |G|^2 + tr(Sigma) / B,
// where b is the harmonic mean of the b_i (equal batches: b_i itself), so the estimator holds with
// small = b and big = B. No server holds a whole gradient: each worker sends, with each push,
// |g_i|^2 over that push's values (PushRequest::gradient_sqr), and each server sums |applied|^2
// over the values it applies, chunk by chunk as it rounds them (sparse rows too). Both are sums
// over disjoint parts of the model, so the worker adds the servers' parts (NoisePart, in every pull
// reply) and has S and L whole. A step counts when at least two of its pushes carry rows and all of
// those measured; a job of one measures nothing (DataParallel pairs a worker's steps instead, which
// on a server would cost a copy of the model).
void ServerSum::sum_step(int64_t step, const std::map<int32_t, PushRequest>& pushes) {
  const ServerRegistry::Change changing = registry_.change();  // Note [The values' mirror]
  double total = 0;
  for (const auto& [worker, push] : pushes) total += static_cast<double>(push.rows);
  int64_t measured = 0;
  double local_sqr = 0, inverse_rows = 0;
  for (const auto& [worker, push] : pushes) {
    if (push.rows == 0) continue;
    measured = push.gradient_sqr < 0 || measured < 0 ? -1 : measured + 1;
    local_sqr += push.gradient_sqr;
    inverse_rows += 1.0 / static_cast<double>(push.rows);
  }
  const bool measure = measured >= 2;
  noise_ = {};
  sum_scratch_[0].sqr = sum_scratch_[1].sqr = 0;

  // Dense: every (table, chunk, push) named, sorted so that a chunk's terms are adjacent and in
  // worker order (pushes is ordered by worker).
  sum_terms_.clear();
  size_t order = 0;
  for (const auto& [worker, push] : pushes) {
    for (const auto& slice : push.dense) {
      const ServerRegistry::Table& table = registry_.table(slice.table);
      const float* grad = slice.data();
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
    return static_cast<size_t>(chunk_length(registry_.table(t.table).numel, t.chunk));
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
  if (split < sum_terms_.size() && !second_) second_ = make_pool(1);
  if (!second_) split = sum_terms_.size();  // no thread to be had: this one sums it all
  const size_t parts = split < sum_terms_.size() ? 2 : 1;
  fan_out(second_.get(), static_cast<int>(parts), [&](int part) {
    if (part == 0) {
      sum_chunks(0, split, total, measure, sum_scratch_[0]);
    } else {
      sum_chunks(split, sum_terms_.size(), total, measure, sum_scratch_[1]);
    }
  });
  double average_sqr = sum_scratch_[0].sqr + sum_scratch_[1].sqr;

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
      const ServerRegistry::Table& table = registry_.table(slice.table);
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
  std::vector<SparseSlice> sparse;
  for (auto& [table, sums] : rows) {
    SparseSlice slice{table, std::move(sums.ids), std::vector<float>(sums.acc.size())};
    for (size_t i = 0; i < sums.acc.size(); ++i)
      slice.values[i] = static_cast<float>(sums.acc[i] / total);
    if (measure)
      average_sqr += sum_of_squares(slice.values.data(), static_cast<int64_t>(slice.values.size()));
    sparse.push_back(std::move(slice));
  }
  if (measure) {
    const auto count = static_cast<double>(measured);
    noise_ = {step, local_sqr / count, average_sqr, count / inverse_rows, total};
  }
  if (!sparse.empty()) registry_.apply({}, sparse);
}

size_t ServerSum::next_chunk(size_t first) const {
  size_t last = first;
  while (last < sum_terms_.size() && sum_terms_[last].table == sum_terms_[first].table &&
         sum_terms_[last].chunk == sum_terms_[first].chunk) {
    ++last;
  }
  return last;
}

// Note [A chunk's sum in blocks]: the workers' gradients are read once each, straight from where
// their pushes are (Note [Pushes read in place], server_steps.cpp), into a sum of a few thousand
// doubles that stays in the first-level cache, block after block of the chunk; the sum is scaled
// by 1 / total, a product (a division per value took a quarter of the sum's time). The order of
// the terms is Note [Sync sum]'s, so a step's result does not depend on the threads either.
void ServerSum::sum_chunks(size_t first, size_t end, double total, bool measure,
                           SumScratch& scratch) {
  constexpr int64_t kBlock = 2048;
  scratch.acc.resize(static_cast<size_t>(kBlock));
  scratch.out.resize(static_cast<size_t>(kChunkElements));
  const double scale = 1.0 / total;
  double* acc = scratch.acc.data();
  while (first < end) {
    const SumTerm& head = sum_terms_[first];
    const ServerRegistry::Table& table = registry_.table(head.table);
    const int64_t length = chunk_length(table.numel, head.chunk);
    const size_t last = next_chunk(first);
    float* out = scratch.out.data();
    for (int64_t at = 0; at < length; at += kBlock) {
      const int64_t n = std::min(kBlock, length - at);
      const double weight = head.weight;
      const float* grad = head.grad + at;
      for (int64_t i = 0; i < n; ++i) acc[i] = weight * grad[i];
      for (size_t term = first + 1; term < last; ++term) {
        const double w = sum_terms_[term].weight;
        const float* g = sum_terms_[term].grad + at;
        for (int64_t i = 0; i < n; ++i) acc[i] += w * g[i];
      }
      float* block = out + at;
      for (int64_t i = 0; i < n; ++i) block[i] = static_cast<float>(acc[i] * scale);
    }
    if (measure) scratch.sqr += sum_of_squares(out, length);
    registry_.apply_chunk(head.table, head.chunk, out);
    first = last;
  }
}

}  // namespace shoal::ps::detail
