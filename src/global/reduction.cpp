// Ops that reduce over a dim: sum, mean, max, softmax, log_softmax, cross_entropy. See
// docs/global.md.
#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/global/ops.h"
#include "signature.h"

namespace shoal::global {
namespace {

using detail::Signature;

// The output dim of input dim `d` once `dim` is reduced.
int64_t after_reduction(int64_t d, int64_t dim, bool keepdim) {
  return keepdim || d < dim ? d : d - 1;
}

std::vector<int64_t> reduced_shape(const std::vector<int64_t>& shape, int64_t dim, bool keepdim) {
  std::vector<int64_t> out = shape;
  if (keepdim) {
    out[dim] = 1;
  } else {
    out.erase(out.begin() + dim);
  }
  return out;
}

// Sum over `dim` (or over everything when dim < 0): a split along the reduced dim gives a
// partial_sum, other splits stay, and the sum is linear.
std::vector<Signature> sum_table(int64_t ndim, int64_t dim, bool keepdim) {
  std::vector<Signature> table;
  for (int64_t d = 0; d < ndim; ++d) {
    const bool reduced = dim < 0 || d == dim;
    table.push_back(
        {{split(d)}, reduced ? partial_sum() : split(after_reduction(d, dim, keepdim))});
  }
  table.push_back({{broadcast()}, broadcast()});
  table.push_back({{partial_sum()}, partial_sum()});
  return table;
}

// The pieces of a row-wise statistic, kept whole: splits of other dims, broadcast.
std::vector<Signature> rowwise_table(int64_t ndim, int64_t dim, bool keepdim) {
  std::vector<Signature> table;
  for (int64_t d = 0; d < ndim; ++d) {
    if (d != dim) table.push_back({{split(d)}, split(after_reduction(d, dim, keepdim))});
  }
  table.push_back({{broadcast()}, broadcast()});
  return table;
}

// log_softmax over `dim` of the local piece; where axes split `dim`, the workers along them
// share the maximum and the sum of exponentials of each row. The maximum only shifts the
// exponentials and cancels out, so it is taken without gradient.
at::Tensor local_log_softmax(const at::Tensor& x, int64_t dim, const detail::Prepared& prepared) {
  const auto axes = detail::axes_splitting(prepared, 0, dim);
  if (axes.empty()) return at::log_softmax(x, dim);
  at::Tensor shift = std::get<0>(x.detach().max(dim, true));
  for (int a : axes) shift = detail::all_reduce_max_along(shift, prepared.placement, a);
  at::Tensor shifted = x - shift;
  at::Tensor total = shifted.exp().sum(dim, true);
  for (int a : axes) total = detail::all_reduce_along(total, prepared.placement, a);
  return shifted - total.log();
}

// Row statistics all-reduced when `dim` of x is split on an axis: `count` values per row.
int64_t row_statistics_bytes(const GlobalTensor& x, int64_t dim, int64_t count) {
  return count * (x.numel() / std::max<int64_t>(x.shape()[dim], 1)) *
         static_cast<int64_t>(c10::elementSize(x.dtype()));
}

GlobalTensor softmax_like(const char* op, const GlobalTensor& x, int64_t dim, bool log) {
  dim = detail::wrap_dim(op, dim, x.dim());
  std::vector<Signature> table;
  for (int64_t d = 0; d < x.dim(); ++d) {
    table.push_back(
        {{split(d)}, split(d), d == dim ? row_statistics_bytes(x, dim, 2) : 0});  // max, sum
  }
  table.push_back({{broadcast()}, broadcast()});
  return detail::apply(op, {x}, table, x.shape(), x.dtype(), [&](const detail::Prepared& p) {
    if (detail::axes_splitting(p, 0, dim).empty())
      return log ? at::log_softmax(p.locals[0], dim) : at::softmax(p.locals[0], dim);
    const at::Tensor out = local_log_softmax(p.locals[0], dim, p);
    return log ? out : out.exp();
  });
}

}  // namespace

GlobalTensor softmax(const GlobalTensor& x, int64_t dim) {
  return softmax_like("softmax", x, dim, false);
}
GlobalTensor log_softmax(const GlobalTensor& x, int64_t dim) {
  return softmax_like("log_softmax", x, dim, true);
}

GlobalTensor sum(const GlobalTensor& x) {
  return detail::apply("sum", {x}, sum_table(x.dim(), -1, false), {}, x.dtype(),
                       [](const detail::Prepared& p) { return p.locals[0].sum(); });
}

GlobalTensor sum(const GlobalTensor& x, int64_t dim, bool keepdim) {
  dim = detail::wrap_dim("sum", dim, x.dim());
  return detail::apply("sum", {x}, sum_table(x.dim(), dim, keepdim),
                       reduced_shape(x.shape(), dim, keepdim), x.dtype(),
                       [&](const detail::Prepared& p) { return p.locals[0].sum(dim, keepdim); });
}

// A mean is the local sum over the global count: right for a piece of a split (which sums to a
// partial_sum), for a whole value and for a partial_sum alike.
GlobalTensor mean(const GlobalTensor& x) {
  const double count = static_cast<double>(x.numel());
  return detail::apply("mean", {x}, sum_table(x.dim(), -1, false), {}, x.dtype(),
                       [&](const detail::Prepared& p) { return p.locals[0].sum() / count; });
}

GlobalTensor mean(const GlobalTensor& x, int64_t dim, bool keepdim) {
  dim = detail::wrap_dim("mean", dim, x.dim());
  const double count = static_cast<double>(x.shape()[dim]);
  return detail::apply(
      "mean", {x}, sum_table(x.dim(), dim, keepdim), reduced_shape(x.shape(), dim, keepdim),
      x.dtype(), [&](const detail::Prepared& p) { return p.locals[0].sum(dim, keepdim) / count; });
}

GlobalTensor max(const GlobalTensor& x) {
  return detail::apply("max", {x}, {{{broadcast()}, broadcast()}}, {}, x.dtype(),
                       [](const detail::Prepared& p) { return p.locals[0].max(); });
}

GlobalTensor max(const GlobalTensor& x, int64_t dim, bool keepdim) {
  dim = detail::wrap_dim("max", dim, x.dim());
  return detail::apply(
      "max", {x}, rowwise_table(x.dim(), dim, keepdim), reduced_shape(x.shape(), dim, keepdim),
      x.dtype(), [&](const detail::Prepared& p) { return at::amax(p.locals[0], {dim}, keepdim); });
}

GlobalTensor cross_entropy(const GlobalTensor& logits, const GlobalTensor& target) {
  if (logits.dim() != 2 || target.dim() != 1 || target.shape()[0] != logits.shape()[0]) {
    throw UsageError("cross_entropy: expected logits [batch, classes] and target [batch], got " +
                     detail::shape_text(logits.shape()) + " and " +
                     detail::shape_text(target.shape()));
  }
  if (at::isFloatingType(target.dtype()) || target.dtype() == at::kBool) {
    throw UsageError(std::string("cross_entropy: expected integer class indices as target, got ") +
                     detail::dtype_text(target.dtype()));
  }
  const double batch = static_cast<double>(logits.shape()[0]);
  const std::vector<Signature> table = {
      {{split(0), split(0)}, partial_sum()},  // rows: each worker sums its rows' losses
      {{split(1), broadcast()},
       broadcast(),
       row_statistics_bytes(logits, 1, 3)},  // classes: max, sum, pick
      {{broadcast(), broadcast()}, broadcast()},
  };
  return detail::apply(
      "cross_entropy", {logits, target}, table, {}, logits.dtype(), [&](const detail::Prepared& p) {
        const at::Tensor& x = p.locals[0];
        const at::Tensor scores = local_log_softmax(x, 1, p);
        // The target's score, from the worker holding its class (the others contribute zero).
        const auto class_axes = detail::axes_splitting(p, 0, 1);
        const int64_t offset = detail::piece_offset(logits.shape(), p.placement, p.inputs[0],
                                                    p.placement.coordinate(detail::my_rank()), 1);
        const at::Tensor local = p.locals[1].to(at::kLong) - offset;
        const at::Tensor held = (local >= 0).logical_and(local < x.size(1));
        at::Tensor picked =
            scores.gather(1, at::where(held, local, at::zeros_like(local)).unsqueeze(1)).squeeze(1);
        picked = at::where(held, picked, at::zeros_like(picked));
        for (int a : class_axes) picked = detail::all_reduce_along(picked, p.placement, a);
        return -picked.sum() / batch;
      });
}

GlobalTensor layer_norm(const GlobalTensor& x, at::IntArrayRef normalized_shape,
                        const GlobalTensor& weight, const GlobalTensor& bias, double eps) {
  const auto k = static_cast<int64_t>(normalized_shape.size());
  const bool fits =
      k >= 1 && k <= x.dim() &&
      std::equal(normalized_shape.begin(), normalized_shape.end(), x.shape().end() - k) &&
      (!weight.defined() || weight.shape() == normalized_shape.vec()) &&
      (!bias.defined() || bias.shape() == normalized_shape.vec());
  if (!fits) {
    throw UsageError("layer_norm: expected normalized_shape " +
                     detail::shape_text(normalized_shape) + " to be the last dims of " +
                     x.describe() + " and the shape of weight and bias");
  }
  // Rows are normalized each on its own: a split of the leading dims stays, weight and bias whole.
  std::vector<GlobalTensor> inputs = {x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  auto row = [&](const Sbp& sbp) {
    std::vector<Sbp> sbps(inputs.size(), broadcast());
    sbps[0] = sbp;
    return sbps;
  };
  std::vector<Signature> table;
  for (int64_t d = 0; d < x.dim() - k; ++d) table.push_back({row(split(d)), split(d)});
  table.push_back({row(broadcast()), broadcast()});
  return detail::apply("layer_norm", inputs, table, x.shape(), x.dtype(),
                       [&](const detail::Prepared& p) {
                         const at::Tensor w = weight.defined() ? p.locals[1] : at::Tensor();
                         const at::Tensor b = bias.defined() ? p.locals.back() : at::Tensor();
                         return at::layer_norm(p.locals[0], normalized_shape, w, b, eps);
                       });
}

}  // namespace shoal::global
