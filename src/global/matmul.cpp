// Products: matmul, linear, embedding (a lookup is a product with one-hot rows). See
// docs/global.md.
#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/global/ops.h"
#include "signature.h"

namespace shoal::global {

using detail::Signature;

GlobalTensor matmul(const GlobalTensor& a, const GlobalTensor& b) {
  const int64_t r = a.dim();
  const bool batched = b.dim() > 2;
  const bool fits = r >= 2 && b.dim() >= 2 && a.shape()[r - 1] == b.shape()[b.dim() - 2] &&
                    (!batched || (b.dim() == r && std::equal(a.shape().begin(), a.shape().end() - 2,
                                                             b.shape().begin())));
  if (!fits) {
    throw UsageError(
        "matmul: expected a [..., n, k] and b [k, m] or [..., k, m] with a's leading dims, got " +
        detail::shape_text(a.shape()) + " and " + detail::shape_text(b.shape()));
  }
  std::vector<Signature> table;
  // Rows of a (and batch dims, which b shares when batched) split the output alike.
  for (int64_t i = 0; i < r - 1; ++i) {
    const bool shared = batched && i < r - 2;
    table.push_back({{split(i), shared ? split(i) : broadcast()}, split(i)});
  }
  const int64_t b_rows = b.dim() - 2, b_columns = b.dim() - 1;
  table.push_back({{broadcast(), split(b_columns)}, split(r - 1)});
  table.push_back(
      {{split(r - 1), split(b_rows)}, partial_sum()});  // the inner dim: partial products
  table.push_back({{partial_sum(), broadcast()}, partial_sum()});
  table.push_back({{broadcast(), partial_sum()}, partial_sum()});
  table.push_back({{broadcast(), broadcast()}, broadcast()});
  std::vector<int64_t> shape(a.shape().begin(), a.shape().end() - 1);
  shape.push_back(b.shape()[b_columns]);
  return detail::apply(
      "matmul", {a, b}, table, shape, at::promote_types(a.dtype(), b.dtype()),
      [](const detail::Prepared& p) { return at::matmul(p.locals[0], p.locals[1]); });
}

GlobalTensor linear(const GlobalTensor& x, const GlobalTensor& weight, const GlobalTensor& bias) {
  if (weight.dim() != 2) {
    throw UsageError("linear: expected weight [out, in], got " +
                     detail::shape_text(weight.shape()));
  }
  GlobalTensor y = matmul(x, transpose(weight, 0, 1));
  return bias.defined() ? y + bias : y;
}

GlobalTensor embedding(const GlobalTensor& indices, const GlobalTensor& weight) {
  if (weight.dim() != 2 || at::isFloatingType(indices.dtype()) || indices.dtype() == at::kBool) {
    throw UsageError("embedding: expected integer indices and weight [vocabulary, dim], got " +
                     indices.describe() + " and " + weight.describe());
  }
  const int64_t r = indices.dim();
  std::vector<Signature> table;
  for (int64_t i = 0; i < r; ++i) table.push_back({{split(i), broadcast()}, split(i)});
  table.push_back({{broadcast(), split(1)}, split(r)});
  table.push_back({{broadcast(), split(0)}, partial_sum()});  // vocabulary-parallel
  table.push_back({{broadcast(), broadcast()}, broadcast()});
  std::vector<int64_t> shape = indices.shape();
  shape.push_back(weight.shape()[1]);
  return detail::apply(
      "embedding", {indices, weight}, table, shape, weight.dtype(), [&](const detail::Prepared& p) {
        const at::Tensor& rows = p.locals[1];
        if (detail::axes_splitting(p, 1, 0).empty()) return at::embedding(rows, p.locals[0]);
        // This worker's rows of the vocabulary: ids outside them look up nothing (zeros).
        const int64_t offset = detail::piece_offset(weight.shape(), p.placement, p.inputs[1],
                                                    p.placement.coordinate(detail::my_rank()), 0);
        const at::Tensor local = p.locals[0].to(at::kLong) - offset;
        const at::Tensor held = (local >= 0).logical_and(local < rows.size(0));
        const at::Tensor found = at::embedding(rows, at::where(held, local, at::zeros_like(local)));
        return at::where(held.unsqueeze(-1), found, at::zeros_like(found));
      });
}

}  // namespace shoal::global
