// Picking an op's signature and boxing its inputs to it. See docs/global.md, "Signatures".
#include "signature.h"

#include "layout.h"
#include "shoal/core/error.h"

namespace shoal::global::detail {
namespace {

// Bytes each worker sends to box a tensor of `bytes` (as held on this axis) from `from` to `to`
// among `n` workers (split -> partial_sum: see below), plus one for any change at all, so that of
// two free routes the one that keeps the inputs as they are wins, and a free split or partial_sum
// is not taken over broadcast for nothing.
double boxing_cost(const Sbp& from, const Sbp& to, double bytes, int64_t n) {
  if (from == to) return 0;
  if (n == 1) return 1;
  const double share = static_cast<double>(n - 1) / static_cast<double>(n);
  double sent = 0;
  if (to.is_broadcast()) {
    sent = from.is_split() ? bytes * share : 2 * bytes * share;  // all-gather; all-reduce
  } else if (to.is_split()) {
    if (from.is_partial_sum()) sent = bytes * share;                     // reduce-scatter
    if (from.is_split()) sent = bytes * share / static_cast<double>(n);  // all-to-all
  } else if (from.is_split()) {
    // Zero padding sends nothing now, but holds the whole size and leaves a reduction for
    // later that costs more than the all-gather it spares: priced as that all-gather, so that
    // a split the op can't keep is gathered rather than padded, unless padding saves elsewhere.
    sent = bytes * share;
  }
  return sent + 1;
}

// The tensor's bytes as the workers along `axis` hold it: the whole, less the splits of the other
// axes.
double bytes_on_axis(const GlobalTensor& t, int axis) {
  double bytes = static_cast<double>(t.numel()) * static_cast<double>(c10::elementSize(t.dtype()));
  const auto& mesh = t.placement().shape();
  for (int a = 0; a < t.placement().ndim(); ++a) {
    if (a != axis && t.sbp()[a].is_split()) bytes /= static_cast<double>(mesh[a]);
  }
  return bytes;
}

std::string operands(const std::vector<GlobalTensor>& inputs) {
  std::string text;
  for (size_t i = 0; i < inputs.size(); ++i) {
    text += (i ? ", " : "") + std::string("operand ") + std::to_string(i) + " on " +
            inputs[i].placement().describe() + " as " + inputs[i].sbp().describe();
  }
  return text;
}

}  // namespace

Prepared prepare(const std::string& op, const std::vector<GlobalTensor>& inputs,
                 const std::vector<Signature>& table) {
  SHOAL_CHECK(!inputs.empty()) << op << " without inputs";
  for (const auto& t : inputs) {
    if (!t.defined()) throw UsageError(op + ": an operand is an empty GlobalTensor");
    if (t.placement() != inputs[0].placement()) {
      throw UsageError(op + ": the operands are on different placements (" + operands(inputs) +
                       "); move one with to_global(placement, sbp) first");
    }
  }
  if (table.empty()) {
    throw UsageError(op + ": no signature fits these operands (" + operands(inputs) + ")");
  }
  Prepared prepared;
  prepared.placement = inputs[0].placement();
  const int axes = prepared.placement.ndim();
  std::vector<std::vector<Sbp>> targets(inputs.size());
  std::vector<Sbp> output;
  for (int axis = 0; axis < axes; ++axis) {
    const int64_t n = prepared.placement.shape()[axis];
    size_t best = 0;
    double best_cost = -1;
    for (size_t row = 0; row < table.size(); ++row) {
      SHOAL_CHECK(table[row].inputs.size() == inputs.size())
          << op << ": signature row " << row << " has " << table[row].inputs.size()
          << " inputs, the op " << inputs.size();
      double cost = 2 * static_cast<double>(table[row].own_bytes) * static_cast<double>(n - 1) /
                    static_cast<double>(n);
      for (size_t i = 0; i < inputs.size(); ++i) {
        cost += boxing_cost(inputs[i].sbp()[axis], table[row].inputs[i],
                            bytes_on_axis(inputs[i], axis), n);
      }
      if (best_cost < 0 || cost < best_cost) {
        best = row;
        best_cost = cost;
      }
    }
    for (size_t i = 0; i < inputs.size(); ++i) targets[i].push_back(table[best].inputs[i]);
    output.push_back(table[best].output);
  }
  prepared.output = NdSbp(output);
  prepared.member = prepared.placement.contains(my_rank());
  for (size_t i = 0; i < inputs.size(); ++i) {
    NdSbp target(targets[i]);
    prepared.locals.push_back(inputs[i].sbp() == target ? inputs[i].to_local()
                                                        : inputs[i].to_global(target).to_local());
    prepared.inputs.push_back(std::move(target));
  }
  return prepared;
}

GlobalTensor finish(const Prepared& prepared, const std::function<at::Tensor()>& local,
                    std::vector<int64_t> shape, at::ScalarType dtype) {
  at::Tensor out = prepared.member ? local() : placeholder_after(prepared.locals, dtype);
  return GlobalTensor(std::move(out), prepared.placement, prepared.output, std::move(shape));
}

GlobalTensor apply(const std::string& op, const std::vector<GlobalTensor>& inputs,
                   const std::vector<Signature>& table, std::vector<int64_t> shape,
                   at::ScalarType dtype, const std::function<at::Tensor(const Prepared&)>& local) {
  const Prepared prepared = prepare(op, inputs, table);
  return finish(
      prepared, [&] { return local(prepared); }, std::move(shape), dtype);
}

std::vector<int> axes_splitting(const Prepared& prepared, size_t input, int64_t dim) {
  std::vector<int> axes;
  const NdSbp& sbp = prepared.inputs.at(input);
  for (int a = 0; a < sbp.size(); ++a) {
    if (sbp[a].is_split() && sbp[a].dim() == dim) axes.push_back(a);
  }
  return axes;
}

int64_t wrap_dim(const std::string& op, int64_t dim, int64_t ndim) {
  if (dim < -ndim || dim >= ndim || ndim == 0) {
    throw UsageError(op + ": dim " + std::to_string(dim) + " is out of range for a tensor of " +
                     std::to_string(ndim) + " dimensions");
  }
  return dim < 0 ? dim + ndim : dim;
}

}  // namespace shoal::global::detail
