// Op signatures: the SBP combinations whose local computation is correct, and how an op picks
// one for its inputs and boxes them to it. Private to src/global; see docs/global.md,
// "Signatures".
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "shoal/global/tensor.h"

namespace shoal::global::detail {

// One row of an op's signature table, for one mesh axis: the inputs' SBP and the output's.
// Each mesh axis picks a row of its own (OneFlow's nd-SBP: the axes are independent).
struct Signature {
  std::vector<Sbp> inputs;
  Sbp output;
  // Bytes the op's own computation all-reduces on this axis with this row (a softmax over a
  // split dim all-reduces row statistics): priced as a ring all-reduce sends them, 2(n-1)/n
  // of that per worker, and added to the boxing cost when rows are compared.
  int64_t own_bytes = 0;
};

// What an op computes with on this worker, once its inputs are boxed.
struct Prepared {
  Placement placement{std::vector<int>{0}};
  std::vector<NdSbp> inputs;  // the inputs' SBP after boxing
  NdSbp output{std::vector<Sbp>{}};
  std::vector<at::Tensor> locals;  // the boxed local inputs (placeholders outside the placement)
  bool member = false;             // whether this worker holds pieces
};

// Checks that `inputs` share one placement (UsageError naming `op` and every operand's
// placement and SBP), picks for each mesh axis the row of `table` that boxes least (ties: the
// earlier row), and boxes the inputs to it. UsageError when the table is empty.
Prepared prepare(const std::string& op, const std::vector<GlobalTensor>& inputs,
                 const std::vector<Signature>& table);

// The op's output: `local` on members (computed from prepared.locals), a placeholder that depends
// on the inputs elsewhere.
GlobalTensor finish(const Prepared& prepared, const std::function<at::Tensor()>& local,
                    std::vector<int64_t> shape, at::ScalarType dtype);

// The usual case: prepare, compute `local` from the boxed local inputs, finish.
GlobalTensor apply(const std::string& op, const std::vector<GlobalTensor>& inputs,
                   const std::vector<Signature>& table, std::vector<int64_t> shape,
                   at::ScalarType dtype, const std::function<at::Tensor(const Prepared&)>& local);

// The axes on which input `input` picked split(dim).
std::vector<int> axes_splitting(const Prepared& prepared, size_t input, int64_t dim);

// Dimension `dim` of a tensor of `ndim` dims, negative counting from the end; UsageError naming
// `op` when out of range.
int64_t wrap_dim(const std::string& op, int64_t dim, int64_t ndim);

}  // namespace shoal::global::detail
