// Element-wise ops: arithmetic with broadcasting, activations, dropout. See docs/global.md.
#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/global/ops.h"
#include "signature.h"

namespace shoal::global {
namespace {

using detail::Signature;

// One input: any split, broadcast, and partial_sum when the op is linear (f(a + b) = f(a) + f(b)).
std::vector<Signature> pointwise_table(int64_t ndim, bool linear) {
  std::vector<Signature> table;
  for (int64_t d = 0; d < ndim; ++d) table.push_back({{split(d)}, split(d)});
  table.push_back({{broadcast()}, broadcast()});
  if (linear) table.push_back({{partial_sum()}, partial_sum()});
  return table;
}

GlobalTensor pointwise(const char* op, const GlobalTensor& x, bool linear,
                       const std::function<at::Tensor(const at::Tensor&)>& fn) {
  return detail::apply(op, {x}, pointwise_table(x.dim(), linear), x.shape(), x.dtype(),
                       [&](const detail::Prepared& p) { return fn(p.locals[0]); });
}

enum class Linearity { kSum, kProduct, kQuotient };

// Two inputs with torch's broadcasting. An output dim is split where each input that has it at
// full size is split along it and the others (which lack it or have it at size 1) are whole.
// kSum: partial_sum + partial_sum; kProduct: partial_sum times broadcast either way round;
// kQuotient: partial_sum over broadcast.
GlobalTensor binary(const char* op, const GlobalTensor& a, const GlobalTensor& b,
                    Linearity linearity, at::Tensor (*fn)(const at::Tensor&, const at::Tensor&)) {
  std::vector<int64_t> shape;
  try {
    shape = at::infer_size(a.shape(), b.shape());
  } catch (const c10::Error&) {
    throw UsageError(std::string(op) + ": shapes " + detail::shape_text(a.shape()) + " and " +
                     detail::shape_text(b.shape()) + " do not broadcast");
  }
  const auto r = static_cast<int64_t>(shape.size());
  auto layout_of = [&](const GlobalTensor& t, int64_t d) {
    const int64_t own = d - (r - t.dim());
    return own >= 0 && t.shape()[own] == shape[d] ? split(own) : broadcast();
  };
  std::vector<Signature> table;
  for (int64_t d = 0; d < r; ++d) {
    const Sbp sa = layout_of(a, d), sb = layout_of(b, d);
    if (sa.is_split() || sb.is_split()) table.push_back({{sa, sb}, split(d)});
  }
  table.push_back({{broadcast(), broadcast()}, broadcast()});
  if (linearity == Linearity::kSum)
    table.push_back({{partial_sum(), partial_sum()}, partial_sum()});
  if (linearity == Linearity::kProduct || linearity == Linearity::kQuotient) {
    table.push_back({{partial_sum(), broadcast()}, partial_sum()});
  }
  if (linearity == Linearity::kProduct)
    table.push_back({{broadcast(), partial_sum()}, partial_sum()});
  at::ScalarType dtype = at::promote_types(a.dtype(), b.dtype());
  if (linearity == Linearity::kQuotient && !at::isFloatingType(dtype))
    dtype = at::typeMetaToScalarType(at::get_default_dtype());  // true division
  return detail::apply(op, {a, b}, table, shape, dtype,
                       [&](const detail::Prepared& p) { return fn(p.locals[0], p.locals[1]); });
}

at::Tensor add_local(const at::Tensor& a, const at::Tensor& b) {
  return at::add(a, b);
}
at::Tensor sub_local(const at::Tensor& a, const at::Tensor& b) {
  return at::sub(a, b);
}
at::Tensor mul_local(const at::Tensor& a, const at::Tensor& b) {
  return at::mul(a, b);
}
at::Tensor div_local(const at::Tensor& a, const at::Tensor& b) {
  return at::div(a, b);
}

}  // namespace

GlobalTensor add(const GlobalTensor& a, const GlobalTensor& b) {
  return binary("add", a, b, Linearity::kSum, add_local);
}
GlobalTensor sub(const GlobalTensor& a, const GlobalTensor& b) {
  return binary("sub", a, b, Linearity::kSum, sub_local);
}
GlobalTensor mul(const GlobalTensor& a, const GlobalTensor& b) {
  return binary("mul", a, b, Linearity::kProduct, mul_local);
}
GlobalTensor div(const GlobalTensor& a, const GlobalTensor& b) {
  return binary("div", a, b, Linearity::kQuotient, div_local);
}

// Adding a constant to a partial_sum would add it once per worker: not linear.
GlobalTensor add(const GlobalTensor& a, const at::Scalar& b) {
  return pointwise("add", a, false, [&](const at::Tensor& t) { return at::add(t, b); });
}
GlobalTensor mul(const GlobalTensor& a, const at::Scalar& b) {
  return pointwise("mul", a, true, [&](const at::Tensor& t) { return at::mul(t, b); });
}

GlobalTensor operator+(const GlobalTensor& a, const GlobalTensor& b) {
  return add(a, b);
}
GlobalTensor operator-(const GlobalTensor& a, const GlobalTensor& b) {
  return sub(a, b);
}
GlobalTensor operator*(const GlobalTensor& a, const GlobalTensor& b) {
  return mul(a, b);
}
GlobalTensor operator/(const GlobalTensor& a, const GlobalTensor& b) {
  return div(a, b);
}
GlobalTensor operator+(const GlobalTensor& a, const at::Scalar& b) {
  return add(a, b);
}
GlobalTensor operator-(const GlobalTensor& a, const at::Scalar& b) {
  return pointwise("sub", a, false, [&](const at::Tensor& t) { return at::sub(t, b); });
}
GlobalTensor operator*(const GlobalTensor& a, const at::Scalar& b) {
  return mul(a, b);
}
GlobalTensor operator/(const GlobalTensor& a, const at::Scalar& b) {
  return pointwise("div", a, true, [&](const at::Tensor& t) { return at::div(t, b); });
}
GlobalTensor operator-(const GlobalTensor& a) {
  return pointwise("neg", a, true, [](const at::Tensor& t) { return at::neg(t); });
}

GlobalTensor relu(const GlobalTensor& x) {
  return pointwise("relu", x, false, [](const at::Tensor& t) { return at::relu(t); });
}
GlobalTensor gelu(const GlobalTensor& x, const std::string& approximate) {
  if (approximate != "none" && approximate != "tanh") {
    throw UsageError("gelu: approximate must be \"none\" or \"tanh\", got \"" + approximate + "\"");
  }
  return pointwise("gelu", x, false, [&](const at::Tensor& t) { return at::gelu(t, approximate); });
}
GlobalTensor tanh(const GlobalTensor& x) {
  return pointwise("tanh", x, false, [](const at::Tensor& t) { return at::tanh(t); });
}
GlobalTensor sigmoid(const GlobalTensor& x) {
  return pointwise("sigmoid", x, false, [](const at::Tensor& t) { return at::sigmoid(t); });
}

GlobalTensor dropout(const GlobalTensor& x, double p, bool training) {
  if (p < 0 || p > 1) throw UsageError("dropout: p must be in [0, 1], got " + std::to_string(p));
  if (!training || p == 0) return x;
  if (p == 1) return x * 0;  // torch draws nothing then either
  // As at::dropout draws its mask: bernoulli(1 - p) over the whole shape, scaled by 1/(1 - p).
  // Every worker of the job draws it, so that random streams stay alike everywhere.
  at::Tensor mask = at::empty(x.shape(), at::TensorOptions().dtype(x.dtype()));
  mask.bernoulli_(1 - p);
  mask.div_(1 - p);
  return detail::apply("dropout", {x}, pointwise_table(x.dim(), true), x.shape(), x.dtype(),
                       [&](const detail::Prepared& prepared) {
                         // A partial_sum's pieces all take the whole mask.
                         NdSbp cut = prepared.output;
                         for (int a = 0; a < cut.size(); ++a) {
                           if (cut[a].is_partial_sum()) cut[a] = broadcast();
                         }
                         const auto coordinate = prepared.placement.coordinate(detail::my_rank());
                         return prepared.locals[0] *
                                detail::take_piece(mask, prepared.placement, cut, coordinate);
                       });
}

}  // namespace shoal::global
