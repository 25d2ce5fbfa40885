// Boxing: moving a global tensor's pieces from one (placement, SBP) to another. Each collective
// is an autograd function whose backward is its adjoint (all_gather <-> reduce_scatter,
// all_reduce <-> all_reduce, all_to_all <-> the reverse all_to_all, send <-> recv); the local
// steps (slices, zero padding) are plain torch ops. See docs/global.md, "Boxing".
#include <algorithm>
#include <atomic>
#include <optional>
#include <set>

#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"
#include "shoal/runtime/init.h"

namespace shoal::global::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Ranks = std::vector<int64_t>;

std::atomic<int64_t> sent{0};

int64_t bytes_of(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}
// What each member sends of a whole of `bytes` in a ring all-gather or reduce-scatter.
int64_t ring_share(int64_t bytes, size_t members) {
  return members == 0 ? 0
                      : bytes * static_cast<int64_t>(members - 1) / static_cast<int64_t>(members);
}

std::vector<int> to_ints(const Ranks& ranks) {
  return std::vector<int>(ranks.begin(), ranks.end());
}
Ranks to_ranks(const std::vector<int>& ranks) {
  return Ranks(ranks.begin(), ranks.end());
}

// Concatenation along dim 0 of the members' `x` (their dim-0 sizes: `sizes`).
at::Tensor gather(const at::Tensor& x, const Ranks& ranks, const std::vector<int64_t>& sizes) {
  comm::AllGatherOptions options;
  options.sizes = sizes;
  at::Tensor out = group_of(to_ints(ranks)).all_gather(x.contiguous(), options);
  count_sent(ring_share(bytes_of(out), ranks.size()));
  return out;
}

// This member's part (dim-0 `sizes`) of the sum of the members' `x`.
at::Tensor scatter_sum(const at::Tensor& x, const Ranks& ranks, const std::vector<int64_t>& sizes) {
  comm::ReduceScatterOptions options;
  options.sizes = sizes;
  count_sent(ring_share(bytes_of(x), ranks.size()));
  return group_of(to_ints(ranks)).reduce_scatter(x.contiguous(), options);
}

// gather, whose adjoint is scatter_sum.
class AllGather : public torch::autograd::Function<AllGather> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Ranks ranks,
                            std::vector<int64_t> sizes) {
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["sizes"] = sizes;
    return gather(x, ranks, sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {scatter_sum(grads[0], ctx->saved_data["ranks"].toIntVector(),
                        ctx->saved_data["sizes"].toIntVector()),
            at::Tensor(), at::Tensor()};
  }
};

// scatter_sum, whose adjoint is gather.
class ReduceScatter : public torch::autograd::Function<ReduceScatter> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Ranks ranks,
                            std::vector<int64_t> sizes) {
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["sizes"] = sizes;
    return scatter_sum(x, ranks, sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather(grads[0], ctx->saved_data["ranks"].toIntVector(),
                   ctx->saved_data["sizes"].toIntVector()),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor sum_over(const at::Tensor& x, const Ranks& ranks) {
  at::Tensor sum = x.clone(at::MemoryFormat::Contiguous);
  group_of(to_ints(ranks)).all_reduce(sum);
  count_sent(2 * ring_share(bytes_of(x), ranks.size()));
  return sum;
}

// The sum of the members' `x`, on every member.
class AllReduce : public torch::autograd::Function<AllReduce> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Ranks ranks) {
    ctx->saved_data["ranks"] = ranks;
    return sum_over(x, ranks);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {sum_over(grads[0], ctx->saved_data["ranks"].toIntVector()), at::Tensor()};
  }
};

// The bytes of the parts of a flat `x` (cut by `send`) that go to members other than this one.
int64_t others_share(const at::Tensor& x, const Ranks& ranks, const std::vector<int64_t>& send) {
  int64_t elements = 0;
  for (size_t m = 0; m < ranks.size(); ++m) {
    if (ranks[m] != my_rank()) elements += send[m];
  }
  return elements * static_cast<int64_t>(x.element_size());
}

// A flat `x` cut into `send` element counts, one part to each member; returns the parts
// received (`recv` counts), concatenated in member order.
class AllToAll : public torch::autograd::Function<AllToAll> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Ranks ranks,
                            std::vector<int64_t> send, std::vector<int64_t> recv) {
    ctx->saved_data["ranks"] = ranks;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    comm::AllToAllOptions options;
    options.send_sizes = send;
    options.recv_sizes = recv;
    count_sent(others_share(x, ranks, send));
    return group_of(to_ints(ranks)).all_to_all(x.contiguous(), options);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::AllToAllOptions options;
    options.send_sizes = ctx->saved_data["recv"].toIntVector();
    options.recv_sizes = ctx->saved_data["send"].toIntVector();
    const auto ranks = ctx->saved_data["ranks"].toIntVector();
    count_sent(others_share(grads[0], ranks, options.send_sizes));
    return {group_of(to_ints(ranks)).all_to_all(grads[0].contiguous(), options), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// Point to point between placements: each destination receives (a tensor of `shape`) from its
// source, sources[i] -> destinations[i] (job ranks). A worker that is no destination returns a
// placeholder. Backward sends the gradients back; a source adds what its destinations return.
class Transfer : public torch::autograd::Function<Transfer> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Ranks sources,
                            Ranks destinations, std::vector<int64_t> shape) {
    ctx->saved_data["sources"] = sources;
    ctx->saved_data["destinations"] = destinations;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return route(x, sources, destinations, shape, x.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Ranks sources = ctx->saved_data["sources"].toIntVector();
    const Ranks destinations = ctx->saved_data["destinations"].toIntVector();
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    // The reverse routes; a source sums what comes back to it.
    const int me = my_rank();
    std::vector<comm::Work> sends;
    at::Tensor grad = at::zeros(x_sizes, grads[0].options());
    for (size_t i = 0; i < sources.size(); ++i) {
      if (destinations[i] == me && sources[i] != me) {
        sends.push_back(shoal::world().send_async(grads[0].contiguous(), world_index(sources[i])));
        count_sent(bytes_of(grads[0]));
      }
    }
    for (size_t i = 0; i < sources.size(); ++i) {
      if (sources[i] != me) continue;
      if (destinations[i] == me) {
        grad = grad + grads[0];
      } else {
        at::Tensor part = at::empty(x_sizes, grads[0].options());
        shoal::world().recv(part, world_index(destinations[i]));
        grad = grad + part;
      }
    }
    for (auto& work : sends) work.wait();
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }

 private:
  static int world_index(int64_t rank) {
    const auto& members = shoal::world().members();
    return static_cast<int>(std::find(members.begin(), members.end(), static_cast<int>(rank)) -
                            members.begin());
  }
  static at::Tensor route(const at::Tensor& x, const Ranks& sources, const Ranks& destinations,
                          const std::vector<int64_t>& shape, at::ScalarType dtype) {
    const int me = my_rank();
    std::vector<comm::Work> sends;
    for (size_t i = 0; i < sources.size(); ++i) {
      if (sources[i] == me && destinations[i] != me) {
        sends.push_back(shoal::world().send_async(x.contiguous(), world_index(destinations[i])));
        count_sent(bytes_of(x));
      }
    }
    at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype));
    for (size_t i = 0; i < sources.size(); ++i) {
      if (destinations[i] != me) continue;
      if (sources[i] == me) {
        out = x.clone(at::MemoryFormat::Contiguous);
      } else {
        out = at::empty(shape, at::TensorOptions().dtype(dtype));
        shoal::world().recv(out, world_index(sources[i]));
      }
    }
    for (auto& work : sends) work.wait();
    return out;
  }
};

int64_t offset_of(const std::vector<int64_t>& sizes, int64_t index) {
  int64_t offset = 0;
  for (int64_t i = 0; i < index; ++i) offset += sizes[i];
  return offset;
}

// A member's piece changes from cur[axis] to `target` on one axis, among the workers along it.
// The axes after `axis` must not split a dim that cur[axis] or `target` splits.
at::Tensor change_axis_directly(const at::Tensor& x, at::IntArrayRef shape,
                                const Placement& placement, const NdSbp& cur, int axis,
                                const Sbp& target) {
  const Sbp& from = cur[axis];
  const int n = static_cast<int>(placement.shape()[axis]);
  if (n == 1) return x;  // one worker along the axis: every form is the whole value
  const int me = my_rank();
  const auto coordinate = placement.coordinate(me);
  const int64_t k = coordinate[axis];
  const Ranks ranks = to_ranks(placement.axis_ranks(axis, me));
  auto sizes_of = [&](int64_t dim) {
    return comm::split_sizes(extent_before_axis(shape, placement, cur, coordinate, axis, dim), n);
  };

  if (from.is_split() && target.is_broadcast()) {
    const int64_t d = from.dim();
    return AllGather::apply(x.movedim(d, 0), ranks, sizes_of(d)).movedim(0, d);
  }
  if (from.is_split() && target.is_partial_sum()) {
    const int64_t d = from.dim();
    const auto sizes = sizes_of(d);
    const int64_t before = offset_of(sizes, k);
    const int64_t after =
        extent_before_axis(shape, placement, cur, coordinate, axis, d) - before - sizes[k];
    std::vector<int64_t> pad(static_cast<size_t>(2 * x.dim()), 0);
    const size_t slot =
        static_cast<size_t>(2 * (x.dim() - 1 - d));  // constant_pad_nd counts from the last dim
    pad[slot] = before;
    pad[slot + 1] = after;
    return at::constant_pad_nd(x, pad, 0);
  }
  if (from.is_partial_sum() && target.is_broadcast()) return AllReduce::apply(x, ranks);
  if (from.is_partial_sum() && target.is_split()) {
    const int64_t d = target.dim();
    return ReduceScatter::apply(x.movedim(d, 0), ranks, sizes_of(d)).movedim(0, d);
  }
  if (from.is_broadcast() && target.is_split()) {
    const int64_t d = target.dim();
    const auto sizes = sizes_of(d);
    return x.narrow(d, offset_of(sizes, k), sizes[k]);
  }
  if (from.is_broadcast() && target.is_partial_sum()) return k == 0 ? x : zeros_after(x);
  if (from.is_split() && target.is_split()) {
    // split(i) -> split(j): every member sends member m the rows of its piece that fall in m's
    // part along j, and gets back the parts along i of its own part along j.
    const int64_t i = from.dim();
    const int64_t j = target.dim();
    const auto i_sizes = sizes_of(i);
    const auto j_sizes = sizes_of(j);
    std::vector<at::Tensor> blocks;
    std::vector<int64_t> send, recv;
    // The other dims are cut alike on every worker along this axis (they share the other axes'
    // coordinates), so this worker's sizes of them are everyone's.
    int64_t per_row = 1;
    for (int64_t e = 0; e < x.dim(); ++e) {
      if (e != i && e != j) per_row *= x.size(e);
    }
    for (int m = 0; m < n; ++m) {
      blocks.push_back(x.narrow(j, offset_of(j_sizes, m), j_sizes[m]).reshape({-1}));
      send.push_back(blocks.back().numel());
      recv.push_back(i_sizes[m] * j_sizes[k] * per_row);
    }
    const at::Tensor received = AllToAll::apply(at::cat(blocks), ranks, send, recv);
    std::vector<at::Tensor> parts;
    int64_t offset = 0;
    for (int m = 0; m < n; ++m) {
      std::vector<int64_t> block_shape = x.sizes().vec();
      block_shape[i] = i_sizes[m];
      block_shape[j] = j_sizes[k];
      parts.push_back(received.narrow(0, offset, recv[m]).reshape(block_shape));
      offset += recv[m];
    }
    return at::cat(parts, i);
  }
  return x;  // same kind: split on the same dim, broadcast, partial_sum
}

// cur[axis] -> target, first making broadcast the later axes that split a dim this change
// touches (their pieces would not tile it), which the caller's loop turns into their targets.
at::Tensor change_axis(const at::Tensor& x, at::IntArrayRef shape, const Placement& placement,
                       NdSbp& cur, int axis, const Sbp& target) {
  std::set<int64_t> dims;
  if (cur[axis].is_split()) dims.insert(cur[axis].dim());
  if (target.is_split()) dims.insert(target.dim());
  at::Tensor y = x;
  for (int b = placement.ndim() - 1; b > axis; --b) {
    if (cur[b].is_split() && dims.count(cur[b].dim()) != 0)
      y = change_axis(y, shape, placement, cur, b, broadcast());
  }
  y = change_axis_directly(y, shape, placement, cur, axis, target);
  cur[axis] = target;
  return y;
}

// Within one placement, for a member.
at::Tensor box_within(const at::Tensor& x, at::IntArrayRef shape, const Placement& placement,
                      const NdSbp& from, const NdSbp& to) {
  NdSbp cur = from;
  at::Tensor y = x;
  for (int axis = 0; axis < placement.ndim(); ++axis) {
    if (cur[axis] != to[axis]) y = change_axis(y, shape, placement, cur, axis, to[axis]);
  }
  return y;
}

NdSbp all_broadcast(int axes) {
  return NdSbp(std::vector<Sbp>(static_cast<size_t>(axes), broadcast()));
}

}  // namespace

void count_sent(int64_t bytes) {
  sent += bytes;
}

at::Tensor all_reduce_along(const at::Tensor& x, const Placement& placement, int axis) {
  if (placement.shape()[axis] == 1) return x;
  return AllReduce::apply(x, to_ranks(placement.axis_ranks(axis, my_rank())));
}

at::Tensor all_reduce_max_along(const at::Tensor& x, const Placement& placement, int axis) {
  at::Tensor max = x.detach().clone(at::MemoryFormat::Contiguous);
  if (placement.shape()[axis] == 1) return max;
  const auto ranks = placement.axis_ranks(axis, my_rank());
  comm::AllReduceOptions options;
  options.op = comm::ReduceOp::kMax;
  group_of(ranks).all_reduce(max, options);
  count_sent(2 * ring_share(bytes_of(max), ranks.size()));
  return max;
}

at::Tensor box(const at::Tensor& local, at::IntArrayRef shape, const Placement& from_placement,
               const NdSbp& from, const Placement& to_placement, const NdSbp& to) {
  const int me = my_rank();
  const bool in_from = from_placement.contains(me);
  const bool in_to = to_placement.contains(me);
  std::optional<timeline::Slice> slice;
  if (timeline::enabled() && (in_from || in_to) &&
      !(from_placement == to_placement && from == to)) {
    const bool moves = !(from_placement == to_placement);
    slice.emplace("boxing " + from.describe() + " -> " + to.describe() +
                      (moves ? " to " + to_placement.describe() : ""),
                  "boxing", timeline::Args{{"bytes", bytes_of(local)}});
  }
  if (from_placement == to_placement) {
    if (!in_from || from == to) return local;
    return box_within(local, shape, from_placement, from, to);
  }
  Ranks sources, destinations;
  std::vector<int64_t> received_shape;
  at::Tensor sent = local;
  if (from_placement.shape() == to_placement.shape() && from == to) {
    // The same layout elsewhere (a pipeline stage handing over): piece i goes to worker i.
    for (int i = 0; i < to_placement.size(); ++i) {
      sources.push_back(from_placement.ranks()[i]);
      destinations.push_back(to_placement.ranks()[i]);
    }
    if (in_to) received_shape = piece_shape(shape, to_placement, to, to_placement.coordinate(me));
    at::Tensor out = Transfer::apply(sent, sources, destinations, received_shape);
    return in_to || in_from ? out : placeholder_after({local}, local.scalar_type());
  }
  // Otherwise the whole value: broadcast among the sources, each destination gets it from one
  // of them, and keeps its piece.
  if (in_from)
    sent = box_within(local, shape, from_placement, from, all_broadcast(from_placement.ndim()));
  for (int i = 0; i < to_placement.size(); ++i) {
    // A destination that is a source already holds the whole value.
    const int destination = to_placement.ranks()[i];
    sources.push_back(from_placement.contains(destination)
                          ? destination
                          : from_placement.ranks()[static_cast<size_t>(i % from_placement.size())]);
    destinations.push_back(destination);
  }
  if (!in_from && !in_to) return placeholder_after({local}, local.scalar_type());
  at::Tensor out = Transfer::apply(sent, sources, destinations, shape.vec());
  if (!in_to) return out;
  return box_within(out, shape, to_placement, all_broadcast(to_placement.ndim()), to);
}

}  // namespace shoal::global::detail

namespace shoal::global {
int64_t sent_bytes() {
  return detail::sent.load();
}
}  // namespace shoal::global
