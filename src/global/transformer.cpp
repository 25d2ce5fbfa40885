// A GPT-2 block of global layers. See include/shoal/global/nn.h and docs/global.md.
#include <cmath>
#include <limits>

#include "shoal/core/error.h"
#include "shoal/dp/recompute.h"
#include "shoal/global/nn.h"

namespace shoal::global::nn {

TransformerBlockImpl::TransformerBlockImpl(const TransformerBlockOptions& options_,
                                           const Layout& layout_)
    : options(options_), layout(layout_) {
  if (options.hidden == 0) options.hidden = 4 * options.dim;
  int64_t tensor_workers = 1;
  for (int a : layout.tensor_axes)
    tensor_workers *= layout.placement.shape().at(static_cast<size_t>(a));
  if (options.heads < 1 || options.dim % options.heads != 0 ||
      options.heads % tensor_workers != 0) {
    throw UsageError("TransformerBlock: expected dim (" + std::to_string(options.dim) +
                     ") to be a multiple of heads (" + std::to_string(options.heads) +
                     ") and heads a multiple of the " + std::to_string(tensor_workers) +
                     " tensor-parallel workers");
  }
  const Placement& p = layout.placement;
  const int64_t d = options.dim;
  norm1 = register_module("norm1", LayerNorm(d, p));
  query = register_module("query", Linear(d, d, p, layout.column()));
  // No key bias: it adds q.b to every score of a query's row, which softmax cancels, so its
  // gradient is zero, and Adam would turn the rounding noise of that zero into full-size steps.
  key = register_module("key", Linear(d, d, p, layout.column(), false));
  value = register_module("value", Linear(d, d, p, layout.column()));
  projection = register_module("projection", Linear(d, d, p, layout.row()));
  norm2 = register_module("norm2", LayerNorm(d, p));
  up = register_module("up", Linear(d, options.hidden, p, layout.column()));
  down = register_module("down", Linear(options.hidden, d, p, layout.row()));
}

GlobalTensor TransformerBlockImpl::forward(const GlobalTensor& x) {
  if (x.dim() != 3 || x.shape()[2] != options.dim) {
    throw UsageError("TransformerBlock: expected x [batch, time, " + std::to_string(options.dim) +
                     "], got " + x.describe());
  }
  if (!options.recompute) return compute(x);
  // Note [Recomputing a global block]: shoal::recompute works on torch tensors, so the block
  // runs on this worker's piece of x, wrapped again as the global tensor it is, and gives its
  // output's piece; the output's layout, which the ops decide, is read from the first run. Every
  // worker of the placement recomputes the same block at the same point of backward, so the
  // collectives of the recomputation (and of its backward) meet as the forward's did.
  std::vector<at::Tensor> weights;
  for (const auto& p : parameters()) {
    if (p.requires_grad()) weights.push_back(p);
  }
  auto output = std::make_shared<GlobalTensor>();
  const RecomputedFunction fn = [this, output, placement = x.placement(), sbp = x.sbp(),
                                 shape = x.shape()](const std::vector<at::Tensor>& inputs) {
    *output = compute(GlobalTensor(inputs[0], placement, sbp, shape));
    return std::vector<at::Tensor>{output->to_local()};
  };
  const at::Tensor y = shoal::recompute(fn, {x.to_local()}, weights).front();
  return GlobalTensor(y, output->placement(), output->sbp(), output->shape());
}

GlobalTensor TransformerBlockImpl::compute(const GlobalTensor& x) {
  const int64_t batch = x.shape()[0], time = x.shape()[1];
  const int64_t heads = options.heads, head_dim = options.dim / heads;
  const double p = is_training() ? options.dropout : 0.0;
  // [batch, time, dim] -> [batch, heads, time, head_dim]: a split of dim (the heads' columns of
  // a column-parallel layer) becomes a split of heads.
  auto split_heads = [&](const GlobalTensor& t) {
    return transpose(reshape(t, {batch, time, heads, head_dim}), 1, 2);
  };
  // Note [Megatron's all-reduces]: the residual stream is boxed to broadcast on the tensor
  // axes before each layer norm (a partial_sum there: the all-reduce; its backward is the other).
  // Left to the ops' rule, the layer norm would take the cheaper reduce-scatter to split(0), and
  // the next layers would then gather their weights instead of splitting heads.
  auto whole_on_tensor_axes = [&](const GlobalTensor& t) {
    NdSbp sbp = t.sbp();
    for (int a : layout.tensor_axes) sbp[a] = broadcast();
    return sbp == t.sbp() ? t : t.to_global(sbp);
  };
  const GlobalTensor h = norm1(whole_on_tensor_axes(x));
  const GlobalTensor q = split_heads(query(h)), k = split_heads(key(h)), v = split_heads(value(h));
  const at::Tensor future =
      torch::full({time, time}, -std::numeric_limits<float>::infinity()).triu(1);
  const GlobalTensor mask =
      GlobalTensor::from_full(future.to(x.dtype()), layout.placement, layout.replicated());
  GlobalTensor scores =
      matmul(q, transpose(k, -2, -1)) * (1.0 / std::sqrt(static_cast<double>(head_dim))) + mask;
  const GlobalTensor attention = dropout(softmax(scores, -1), p, is_training());
  const GlobalTensor merged =
      reshape(transpose(matmul(attention, v), 1, 2), {batch, time, options.dim});
  const GlobalTensor y = x + dropout(projection(merged), p, is_training());
  return y + dropout(down(gelu(up(norm2(whole_on_tensor_axes(y))))), p, is_training());
}

}  // namespace shoal::global::nn
