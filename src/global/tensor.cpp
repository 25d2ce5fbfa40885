// GlobalTensor: pieces, creation, boxing to other layouts, autograd seeding. See docs/global.md.
#include "shoal/global/tensor.h"

#include <numeric>

#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal::global {
namespace {

using detail::shape_text;

// The whole value made by `make` on every worker (so that random streams stay alike), cut.
GlobalTensor create(const char* op, at::IntArrayRef shape, const Placement& placement,
                    const NdSbp& sbp, const std::function<at::Tensor()>& make) {
  detail::check_layout(op, placement, sbp, static_cast<int64_t>(shape.size()));
  return GlobalTensor::from_full(make(), placement, sbp);
}

}  // namespace

GlobalTensor::GlobalTensor(at::Tensor local, Placement placement, NdSbp sbp,
                           std::vector<int64_t> shape)
    : local_(std::move(local)),
      placement_(std::move(placement)),
      sbp_(std::move(sbp)),
      shape_(std::move(shape)) {
  SHOAL_CHECK(local_.defined())
      << "a GlobalTensor needs a local tensor (a placeholder outside its placement)";
}

GlobalTensor GlobalTensor::from_full(const at::Tensor& full, const Placement& placement,
                                     const NdSbp& sbp) {
  detail::check_layout("from_full", placement, sbp, full.dim());
  const int me = detail::my_rank();
  at::Tensor local = placement.contains(me)
                         ? detail::take_piece(full, placement, sbp, placement.coordinate(me))
                         : detail::placeholder_after({full}, full.scalar_type());
  if (!local.requires_grad())
    local = local.contiguous().clone();  // not a view that keeps `full` alive
  return GlobalTensor(local, placement, sbp, full.sizes().vec());
}

GlobalTensor GlobalTensor::from_local(const at::Tensor& local, const Placement& placement,
                                      const NdSbp& sbp, at::IntArrayRef shape) {
  detail::check_layout("from_local", placement, sbp, static_cast<int64_t>(shape.size()));
  const int me = detail::my_rank();
  if (!placement.contains(me)) {
    return GlobalTensor(detail::placeholder_after({local}, local.scalar_type()), placement, sbp,
                        shape.vec());
  }
  const auto expected = detail::piece_shape(shape, placement, sbp, placement.coordinate(me));
  if (local.sizes().vec() != expected) {
    throw UsageError("from_local: worker " + std::to_string(me) + "'s piece has shape " +
                     shape_text(local.sizes()) + ", but a global shape of " + shape_text(shape) +
                     " as " + sbp.describe() + " on " + placement.describe() + " gives it " +
                     shape_text(expected));
  }
  return GlobalTensor(local, placement, sbp, shape.vec());
}

GlobalTensor GlobalTensor::from_local(const at::Tensor& local, const Placement& placement,
                                      const NdSbp& sbp) {
  // Every worker tells its piece's dtype and shape; the global shape follows from the members'.
  constexpr int64_t kMaxDims = 16;
  detail::check_layout("from_local", placement, sbp, -1);  // the workers, before any exchange
  const int me = detail::my_rank();
  const bool member = placement.contains(me);
  constexpr int64_t kNoTensor = -2;
  at::Tensor mine = at::full({kMaxDims + 2}, -1, at::kLong);
  if (member && !local.defined()) {
    mine[1] = kNoTensor;
  } else if (member) {
    mine[0] = static_cast<int64_t>(local.scalar_type());
    mine[1] = std::min<int64_t>(local.dim(), kMaxDims + 1);
    for (int64_t d = 0; d < std::min<int64_t>(local.dim(), kMaxDims); ++d)
      mine[d + 2] = local.size(d);
  }
  const at::Tensor all = shoal::world().all_gather(mine.unsqueeze(0));
  auto row = [&](int rank) { return all[rank]; };
  // Every worker raises the same errors from the same exchanged facts, so none is left waiting.
  for (int r : placement.ranks()) {
    if (row(r)[1].item<int64_t>() == kNoTensor) {
      throw UsageError("from_local: worker " + std::to_string(r) + ", a member of " +
                       placement.describe() + ", passed no tensor");
    }
    if (row(r)[1].item<int64_t>() > kMaxDims) {
      throw UsageError("from_local: worker " + std::to_string(r) + "'s piece has more than " +
                       std::to_string(kMaxDims) +
                       " dimensions, which global tensors do not support");
    }
  }
  const at::Tensor first = row(placement.ranks()[0]);
  const int64_t ndim = first[1].item<int64_t>();
  const auto dtype = static_cast<at::ScalarType>(first[0].item<int64_t>());
  detail::check_layout("from_local", placement, sbp, ndim);
  // Along a dim some axes split, the members at coordinate 0 on every other axis tile it.
  std::vector<int64_t> shape(static_cast<size_t>(ndim), 0);
  for (int64_t d = 0; d < ndim; ++d) {
    std::vector<int> splitting;
    for (int a = 0; a < placement.ndim(); ++a) {
      if (sbp[a].is_split() && sbp[a].dim() == d) splitting.push_back(a);
    }
    for (int r : placement.ranks()) {
      const auto c = placement.coordinate(r);
      bool tiles = true;
      for (int a = 0; a < placement.ndim(); ++a) {
        if (std::find(splitting.begin(), splitting.end(), a) == splitting.end() && c[a] != 0)
          tiles = false;
      }
      if (!tiles) continue;
      shape[d] = splitting.empty() ? row(r)[d + 2].item<int64_t>()
                                   : shape[d] + row(r)[d + 2].item<int64_t>();
      if (splitting.empty()) break;
    }
  }
  for (int r : placement.ranks()) {
    const auto expected = detail::piece_shape(shape, placement, sbp, placement.coordinate(r));
    std::vector<int64_t> got;
    const at::Tensor info = row(r);
    for (int64_t d = 0; d < info[1].item<int64_t>(); ++d)
      got.push_back(info[d + 2].item<int64_t>());
    if (got != expected || static_cast<at::ScalarType>(info[0].item<int64_t>()) != dtype) {
      throw UsageError("from_local: the pieces do not fit together as " + sbp.describe() + " on " +
                       placement.describe() + ": worker " + std::to_string(r) + " holds " +
                       shape_text(got) + " of " +
                       detail::dtype_text(static_cast<at::ScalarType>(info[0].item<int64_t>())) +
                       ", expected " + shape_text(expected) + " of " + detail::dtype_text(dtype) +
                       " (split sizes as comm::split_sizes cuts them)");
    }
  }
  at::Tensor piece = member            ? local
                     : local.defined() ? detail::placeholder_after({local}, dtype)
                                       : detail::placeholder(dtype, false);
  return GlobalTensor(piece, placement, sbp, shape);
}

int64_t GlobalTensor::size(int64_t dim) const {
  const int64_t n = this->dim();
  if (dim < -n || dim >= n) {
    throw UsageError("size(" + std::to_string(dim) + "): out of range for " + describe());
  }
  return shape_[static_cast<size_t>(dim < 0 ? dim + n : dim)];
}

int64_t GlobalTensor::numel() const {
  return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<int64_t>());
}

bool GlobalTensor::is_local() const {
  return placement_.contains(detail::my_rank());
}

at::Tensor GlobalTensor::full() const {
  return to_global(Placement::all(), NdSbp(broadcast())).to_local();
}

GlobalTensor GlobalTensor::to_global(const Placement& placement, const NdSbp& sbp) const {
  if (!defined()) throw UsageError("to_global: this is an empty GlobalTensor");
  detail::check_layout("to_global", placement, sbp, dim());
  return GlobalTensor(detail::box(local_, shape_, placement_, sbp_, placement, sbp), placement, sbp,
                      shape_);
}

GlobalTensor& GlobalTensor::requires_grad_(bool requires_grad) {
  local_.requires_grad_(requires_grad);
  return *this;
}

GlobalTensor GlobalTensor::grad() const {
  const at::Tensor& g = local_.grad();
  if (!g.defined()) return GlobalTensor();
  return GlobalTensor(g, placement_, dual(sbp_), shape_);
}

void GlobalTensor::backward() const {
  if (!defined()) throw UsageError("backward: this is an empty GlobalTensor");
  if (numel() != 1) {
    throw UsageError("backward() without a gradient needs a single value; this is " + describe() +
                     "; pass backward(gradient)");
  }
  torch::autograd::backward({local_}, {backward_seed()});
}

at::Tensor GlobalTensor::backward_seed() const {
  if (!is_local()) return at::zeros_like(local_);
  const auto coordinate = placement_.coordinate(detail::my_rank());
  bool first = true;
  for (int a = 0; a < placement_.ndim(); ++a)
    first = first && (!sbp_[a].is_broadcast() || coordinate[a] == 0);
  return first ? at::ones_like(local_) : at::zeros_like(local_);
}

void GlobalTensor::backward(const GlobalTensor& gradient) const {
  if (gradient.placement() != placement_ || gradient.sbp() != dual(sbp_) ||
      gradient.shape() != shape_) {
    throw UsageError("backward(gradient): expected a gradient of shape " + shape_text(shape_) +
                     " on " + placement_.describe() + " as " + dual(sbp_).describe() +
                     " (the dual of " + sbp_.describe() + "), got " + gradient.describe());
  }
  torch::autograd::backward({local_}, {gradient.to_local()});
}

GlobalTensor GlobalTensor::detach() const {
  return GlobalTensor(local_.detach(), placement_, sbp_, shape_);
}

std::string GlobalTensor::describe() const {
  if (!defined()) return "an empty GlobalTensor";
  // Not placement_.describe(), whose "[0, 1, 2, 3] as 2x2" would read "as 2x2 as split(0)" here.
  std::string where = placement_.describe();
  if (placement_.ndim() > 1) {
    const std::vector<int64_t> ranks(placement_.ranks().begin(), placement_.ranks().end());
    std::string mesh;
    for (int64_t n : placement_.shape()) mesh += (mesh.empty() ? "" : "x") + std::to_string(n);
    where = "the " + mesh + " mesh " + shape_text(ranks);
  }
  return "GlobalTensor of shape " + shape_text(shape_) + ", " + detail::dtype_text(dtype()) +
         ", on " + where + " as " + sbp_.describe();
}

GlobalTensor randn(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                   const at::TensorOptions& options) {
  return create("randn", shape, placement, sbp, [&] { return torch::randn(shape, options); });
}

GlobalTensor rand(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                  const at::TensorOptions& options) {
  return create("rand", shape, placement, sbp, [&] { return torch::rand(shape, options); });
}

GlobalTensor zeros(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                   const at::TensorOptions& options) {
  return create("zeros", shape, placement, sbp, [&] { return torch::zeros(shape, options); });
}

GlobalTensor ones(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                  const at::TensorOptions& options) {
  return create("ones", shape, placement, sbp, [&] { return torch::ones(shape, options); });
}

GlobalTensor full(at::IntArrayRef shape, const at::Scalar& value, const Placement& placement,
                  const NdSbp& sbp, const at::TensorOptions& options) {
  return create("full", shape, placement, sbp, [&] { return torch::full(shape, value, options); });
}

GlobalTensor arange(int64_t end, const Placement& placement, const NdSbp& sbp,
                    const at::TensorOptions& options) {
  return create("arange", {end}, placement, sbp, [&] { return torch::arange(end, options); });
}

}  // namespace shoal::global
