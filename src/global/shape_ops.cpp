// Ops that move elements around: reshape, view, transpose, permute, cat, slice. See
// docs/global.md.
#include <numeric>
#include <optional>

#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/global/ops.h"
#include "signature.h"

namespace shoal::global {
namespace {

using detail::Signature;

int64_t product(const std::vector<int64_t>& shape, size_t end) {
  return std::accumulate(shape.begin(), shape.begin() + static_cast<std::ptrdiff_t>(end),
                         int64_t{1}, std::multiplies<int64_t>());
}

// Linear maps that keep every split dim whole: any split of `ndim` dims but those in `skip`,
// renamed by `to`, plus broadcast and partial_sum.
std::vector<Signature> carried_table(int64_t ndim, const std::function<int64_t(int64_t)>& to,
                                     int64_t skip = -1) {
  std::vector<Signature> table;
  for (int64_t d = 0; d < ndim; ++d) {
    if (d != skip) table.push_back({{split(d)}, split(to(d))});
  }
  table.push_back({{broadcast()}, broadcast()});
  table.push_back({{partial_sum()}, partial_sum()});
  return table;
}

// Note [Splits through a reshape]
// A piece of split(d) is the rows [o, o + s) of dim d with everything after it: a contiguous run
// of the flattened tensor's blocks. It is a piece of split(e) of the output when dim e starts
// at the same block boundary (the dims before d and before e hold as many elements) and either
// has the same size as d, or is d merged with the dims after it, or is d's first factor when d
// is cut into several. In the last two cases the pieces only line up when the split divides
// evenly (split_sizes cuts 5 rows of 3 into 2+2+1, but 15 elements into 5+5+5); with `workers`
// dividing the size they do however the placement's axes nest.
std::optional<int64_t> carried_dim(const std::vector<int64_t>& in, const std::vector<int64_t>& out,
                                   int64_t d, int64_t workers) {
  const int64_t before = product(in, static_cast<size_t>(d));
  const int64_t through = before * in[d];
  for (size_t e = 0; e < out.size(); ++e) {
    if (product(out, e) != before) continue;
    if (out[e] == in[d]) return static_cast<int64_t>(e);
  }
  for (size_t e = 0; e < out.size(); ++e) {
    if (product(out, e) != before) continue;
    const int64_t out_through = product(out, e + 1);
    if (out_through > through && in[d] % workers == 0) {
      for (size_t k = static_cast<size_t>(d) + 1; k <= in.size(); ++k) {
        if (product(in, k) == out_through)
          return static_cast<int64_t>(e);  // d merged with later dims
      }
    }
    if (out_through < through && out[e] % workers == 0) {
      for (size_t f = e + 1; f <= out.size(); ++f) {
        if (product(out, f) == through)
          return static_cast<int64_t>(e);  // d cut, e its first factor
      }
    }
  }
  return std::nullopt;
}

}  // namespace

GlobalTensor reshape(const GlobalTensor& x, at::IntArrayRef shape) {
  std::vector<int64_t> out = shape.vec();
  int64_t known = 1, inferred = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1 && inferred < 0) {
      inferred = static_cast<int64_t>(i);
    } else if (out[i] < 0) {
      throw UsageError("reshape: shape " + detail::shape_text(shape) +
                       " is invalid; expected sizes from 0 and at most one -1");
    } else {
      known *= out[i];
    }
  }
  if (inferred >= 0 && known > 0 && x.numel() % known == 0) out[inferred] = x.numel() / known;
  if (product(out, out.size()) != x.numel() || (inferred >= 0 && known == 0)) {
    throw UsageError("reshape: shape " + detail::shape_text(shape) +
                     " is invalid for a tensor of shape " + detail::shape_text(x.shape()) + " (" +
                     std::to_string(x.numel()) + " elements)");
  }
  std::vector<Signature> table;
  if (x.numel() > 0) {
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (auto e = carried_dim(x.shape(), out, d, x.placement().size()))
        table.push_back({{split(d)}, split(*e)});
    }
  }
  table.push_back({{broadcast()}, broadcast()});
  table.push_back({{partial_sum()}, partial_sum()});
  return detail::apply("reshape", {x}, table, out, x.dtype(), [&](const detail::Prepared& p) {
    // The local piece's shape: the output's, with the carried splits cut.
    const auto coordinate = p.placement.coordinate(detail::my_rank());
    return p.locals[0].reshape(detail::piece_shape(out, p.placement, p.output, coordinate));
  });
}

GlobalTensor view(const GlobalTensor& x, at::IntArrayRef shape) {
  return reshape(x, shape);
}

GlobalTensor transpose(const GlobalTensor& x, int64_t dim0, int64_t dim1) {
  dim0 = detail::wrap_dim("transpose", dim0, x.dim());
  dim1 = detail::wrap_dim("transpose", dim1, x.dim());
  std::vector<int64_t> shape = x.shape();
  std::swap(shape[dim0], shape[dim1]);
  auto to = [&](int64_t d) { return d == dim0 ? dim1 : d == dim1 ? dim0 : d; };
  return detail::apply(
      "transpose", {x}, carried_table(x.dim(), to), shape, x.dtype(),
      [&](const detail::Prepared& p) { return p.locals[0].transpose(dim0, dim1); });
}

GlobalTensor permute(const GlobalTensor& x, at::IntArrayRef dims) {
  const int64_t n = x.dim();
  std::vector<int64_t> order;
  std::vector<int64_t> inverse(static_cast<size_t>(n), -1);
  for (int64_t d : dims) order.push_back(detail::wrap_dim("permute", d, n));
  for (size_t i = 0; i < order.size(); ++i) {
    if (inverse[order[i]] >= 0) break;
    inverse[order[i]] = static_cast<int64_t>(i);
  }
  if (static_cast<int64_t>(order.size()) != n ||
      std::count(inverse.begin(), inverse.end(), -1) != 0) {
    throw UsageError("permute: dims " + detail::shape_text(dims) +
                     " are not a permutation of the " + std::to_string(n) + " dims of " +
                     x.describe());
  }
  std::vector<int64_t> shape;
  for (int64_t d : order) shape.push_back(x.shape()[d]);
  return detail::apply("permute", {x}, carried_table(n, [&](int64_t d) { return inverse[d]; }),
                       shape, x.dtype(),
                       [&](const detail::Prepared& p) { return p.locals[0].permute(order); });
}

GlobalTensor cat(const std::vector<GlobalTensor>& tensors, int64_t dim) {
  if (tensors.empty()) throw UsageError("cat: expected at least one tensor");
  const GlobalTensor& first = tensors[0];
  dim = detail::wrap_dim("cat", dim, first.dim());
  std::vector<int64_t> shape = first.shape();
  shape[dim] = 0;
  for (const auto& t : tensors) {
    std::vector<int64_t> a = t.shape(), b = first.shape();
    if (a.size() == b.size()) a[dim] = b[dim] = 0;
    if (a != b || t.dtype() != first.dtype()) {
      throw UsageError("cat: expected tensors of one dtype whose shapes differ only in dim " +
                       std::to_string(dim) + ", got " + first.describe() + " and " + t.describe());
    }
    shape[dim] += t.shape()[dim];
  }
  std::vector<Signature> table;
  auto all = [&](const Sbp& s) { return std::vector<Sbp>(tensors.size(), s); };
  for (int64_t d = 0; d < first.dim(); ++d) {
    if (d != dim) table.push_back({all(split(d)), split(d)});
  }
  table.push_back({all(broadcast()), broadcast()});
  table.push_back({all(partial_sum()), partial_sum()});
  return detail::apply("cat", tensors, table, shape, first.dtype(),
                       [&](const detail::Prepared& p) { return at::cat(p.locals, dim); });
}

GlobalTensor slice(const GlobalTensor& x, int64_t dim, int64_t start, int64_t end) {
  dim = detail::wrap_dim("slice", dim, x.dim());
  const int64_t size = x.shape()[dim];
  auto clamp = [&](int64_t i) {
    return std::min(std::max(i < 0 ? i + size : i, int64_t{0}), size);
  };
  start = clamp(start);
  end = std::max(clamp(end), start);
  std::vector<int64_t> shape = x.shape();
  shape[dim] = end - start;
  return detail::apply("slice", {x},
                       carried_table(
                           x.dim(), [](int64_t d) { return d; }, dim),
                       shape, x.dtype(), [&](const detail::Prepared& p) {
                         return p.locals[0].slice(dim, start, end);
                       });
}

}  // namespace shoal::global
