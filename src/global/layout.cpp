// Placement, Sbp and the shapes of pieces. See docs/global.md.
#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <numeric>
#include <set>

#include "layout.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"
#include "runtime/world.h"

namespace shoal::global {
namespace {

std::string join(const std::vector<int64_t>& values, const char* separator) {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i)
    text += (i ? separator : "") + std::to_string(values[i]);
  return text;
}

}  // namespace

// ----- Placement -----

Placement::Placement(std::vector<int64_t> shape, std::vector<int> ranks, const char* caller)
    : ranks_(std::move(ranks)), shape_(std::move(shape)) {
  if (ranks_.empty())
    throw UsageError(std::string(caller) + ": expected at least one worker, got none");
  std::set<int> seen;
  for (int r : ranks_) {
    if (r < 0 || !seen.insert(r).second) {
      std::vector<int64_t> all(ranks_.begin(), ranks_.end());
      throw UsageError(std::string(caller) + "([" + join(all, ", ") +
                       "]): expected distinct worker ranks from 0");
    }
  }
  int64_t product = 1;
  for (int64_t n : shape_) {
    if (n < 1)
      throw UsageError(std::string(caller) + ": mesh dimensions must be at least 1, got " +
                       join(shape_, "x"));
    product *= n;
  }
  if (product != static_cast<int64_t>(ranks_.size())) {
    throw UsageError(std::string(caller) + ": a " + join(shape_, "x") + " mesh holds " +
                     std::to_string(product) + " workers, but " + std::to_string(ranks_.size()) +
                     " were given");
  }
}

namespace {
std::vector<int64_t> line_of(const std::vector<int>& ranks) {
  return {static_cast<int64_t>(ranks.size())};
}
}  // namespace

Placement::Placement(std::vector<int> ranks) : Placement(line_of(ranks), ranks, "Placement") {}

Placement Placement::all() {
  std::vector<int> ranks(static_cast<size_t>(detail::job_size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  return Placement(std::move(ranks));
}

Placement Placement::mesh(std::vector<int64_t> shape) {
  std::vector<int> ranks(static_cast<size_t>(detail::job_size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  return Placement(std::move(shape), std::move(ranks), "Placement::mesh");
}

Placement Placement::mesh(std::vector<int64_t> shape, std::vector<int> ranks) {
  return Placement(std::move(shape), std::move(ranks), "Placement::mesh");
}

int Placement::index_of(int rank) const {
  auto it = std::find(ranks_.begin(), ranks_.end(), rank);
  return it == ranks_.end() ? -1 : static_cast<int>(it - ranks_.begin());
}

std::vector<int64_t> Placement::coordinate(int rank) const {
  int64_t index = index_of(rank);
  SHOAL_CHECK(index >= 0) << "coordinate of worker " << rank << ", which is not in " << describe();
  std::vector<int64_t> coordinate(shape_.size());
  for (int axis = ndim() - 1; axis >= 0; --axis) {
    coordinate[axis] = index % shape_[axis];
    index /= shape_[axis];
  }
  return coordinate;
}

std::vector<int> Placement::axis_ranks(int axis, int rank) const {
  std::vector<int64_t> coordinate = this->coordinate(rank);
  std::vector<int> ranks;
  for (int64_t i = 0; i < shape_[axis]; ++i) {
    coordinate[axis] = i;
    int64_t index = 0;
    for (int a = 0; a < ndim(); ++a) index = index * shape_[a] + coordinate[a];
    ranks.push_back(ranks_[index]);
  }
  return ranks;
}

std::string Placement::describe() const {
  std::string text = "[" + join(std::vector<int64_t>(ranks_.begin(), ranks_.end()), ", ") + "]";
  if (shape_.size() > 1) text += " as " + join(shape_, "x");
  return text;
}

// ----- Sbp -----

Sbp split(int64_t dim) {
  if (dim < 0) throw UsageError("split(" + std::to_string(dim) + "): expected a dimension from 0");
  return Sbp(Sbp::Kind::kSplit, dim);
}
Sbp broadcast() {
  return Sbp(Sbp::Kind::kBroadcast, 0);
}
Sbp partial_sum() {
  return Sbp(Sbp::Kind::kPartialSum, 0);
}

Sbp dual(const Sbp& sbp) {
  if (sbp.is_broadcast()) return partial_sum();
  if (sbp.is_partial_sum()) return broadcast();
  return sbp;
}

NdSbp dual(const NdSbp& sbp) {
  std::vector<Sbp> axes;
  for (const auto& s : sbp.axes()) axes.push_back(dual(s));
  return NdSbp(std::move(axes));
}

std::string Sbp::describe() const {
  switch (kind_) {
    case Kind::kSplit:
      return "split(" + std::to_string(dim_) + ")";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kPartialSum:
      return "partial_sum";
  }
  return "?";
}

std::string NdSbp::describe() const {
  if (axes_.size() == 1) return axes_[0].describe();
  std::string text = "(";
  for (size_t i = 0; i < axes_.size(); ++i) text += (i ? ", " : "") + axes_[i].describe();
  return text + ")";
}

namespace detail {

std::string shape_text(at::IntArrayRef shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::string dtype_text(at::ScalarType dtype) {
  std::string text = c10::toString(dtype);
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

// Through shoal::rank() and world_size(), so that before init() (or after shutdown()) every
// entry point of global tensors raises the same UsageError as they do, instead of running as a
// job of one that the program never asked for.
int my_rank() {
  return shoal::rank();
}
int job_size() {
  return shoal::world_size();
}

void check_layout(const std::string& op, const Placement& placement, const NdSbp& sbp,
                  int64_t ndim) {
  for (int r : placement.ranks()) {
    if (r >= job_size()) {
      throw UsageError(op + ": placement " + placement.describe() + " names worker " +
                       std::to_string(r) + ", but the job has " + std::to_string(job_size()) +
                       " workers (0 to " + std::to_string(job_size() - 1) + ")");
    }
  }
  if (ndim < 0) return;  // the placement only
  if (sbp.size() != placement.ndim()) {
    throw UsageError(op + ": sbp " + sbp.describe() + " has " + std::to_string(sbp.size()) +
                     " axes, but placement " + placement.describe() + " has " +
                     std::to_string(placement.ndim()) + "; expected one Sbp per mesh axis");
  }
  for (const auto& s : sbp.axes()) {
    if (s.is_split() && s.dim() >= ndim) {
      throw UsageError(op + ": " + s.describe() + " is out of range for a tensor of " +
                       std::to_string(ndim) + " dimensions (placement " + placement.describe() +
                       ", sbp " + sbp.describe() + ")");
    }
  }
}

int64_t extent_before_axis(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                           const std::vector<int64_t>& coordinate, int axis, int64_t dim) {
  int64_t extent = shape[dim];
  for (int a = 0; a < axis; ++a) {
    if (sbp[a].is_split() && sbp[a].dim() == dim) {
      extent = comm::split_sizes(extent, static_cast<int>(placement.shape()[a]))[coordinate[a]];
    }
  }
  return extent;
}

std::vector<int64_t> piece_shape(at::IntArrayRef shape, const Placement& placement,
                                 const NdSbp& sbp, const std::vector<int64_t>& coordinate) {
  std::vector<int64_t> piece(shape.begin(), shape.end());
  for (int a = 0; a < placement.ndim(); ++a) {
    if (!sbp[a].is_split()) continue;
    const int64_t d = sbp[a].dim();
    piece[d] = comm::split_sizes(piece[d], static_cast<int>(placement.shape()[a]))[coordinate[a]];
  }
  return piece;
}

int64_t piece_offset(at::IntArrayRef shape, const Placement& placement, const NdSbp& sbp,
                     const std::vector<int64_t>& coordinate, int64_t dim) {
  int64_t extent = shape[dim];
  int64_t offset = 0;
  for (int a = 0; a < placement.ndim(); ++a) {
    if (!sbp[a].is_split() || sbp[a].dim() != dim) continue;
    const auto sizes = comm::split_sizes(extent, static_cast<int>(placement.shape()[a]));
    for (int64_t i = 0; i < coordinate[a]; ++i) offset += sizes[i];
    extent = sizes[coordinate[a]];
  }
  return offset;
}

at::Tensor take_piece(const at::Tensor& full, const Placement& placement, const NdSbp& sbp,
                      const std::vector<int64_t>& coordinate) {
  at::Tensor piece = full;
  for (int a = 0; a < placement.ndim(); ++a) {
    if (sbp[a].is_split()) {
      const int64_t d = sbp[a].dim();
      const auto sizes = comm::split_sizes(piece.size(d), static_cast<int>(placement.shape()[a]));
      int64_t offset = 0;
      for (int64_t i = 0; i < coordinate[a]; ++i) offset += sizes[i];
      piece = piece.narrow(d, offset, sizes[coordinate[a]]);
    } else if (sbp[a].is_partial_sum() && coordinate[a] != 0) {
      piece = zeros_after(piece);
    }
  }
  return piece;
}

comm::Group& group_of(const std::vector<int>& ranks) {
  static std::mutex mutex;
  static std::map<std::vector<int>, comm::Group> groups;
  static int listener = -1;
  std::lock_guard<std::mutex> lock(mutex);
  if (listener < 0) {
    // A new world (an elastic job's next round) makes new groups.
    listener = runtime::add_world_listener([] {
      std::lock_guard<std::mutex> lock(mutex);
      groups.clear();
    });
  }
  comm::Group& world = shoal::world();
  if (ranks == world.members()) return world;
  auto it = groups.find(ranks);
  if (it == groups.end()) {
    std::vector<int> positions;
    for (int r : ranks)
      positions.push_back(static_cast<int>(
          std::find(world.members().begin(), world.members().end(), r) - world.members().begin()));
    it = groups.emplace(ranks, world.subgroup(positions)).first;
  }
  return it->second;
}

at::Tensor zeros_after(const at::Tensor& x) {
  return x.masked_fill(at::ones({}, at::TensorOptions().dtype(at::kBool)), 0);
}

at::Tensor placeholder(at::ScalarType dtype, bool requires_grad) {
  return at::empty({0}, at::TensorOptions().dtype(dtype)).requires_grad_(requires_grad);
}

namespace {

// A zero-size output that depends on its inputs: the node a worker outside an op's placement
// has in its graph where the members have the op's.
class After : public torch::autograd::Function<After> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                            at::ScalarType dtype) {
    ctx->saved_data["count"] = static_cast<int64_t>(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      ctx->saved_data["sizes" + std::to_string(i)] = inputs[i].sizes().vec();
      ctx->saved_data["dtype" + std::to_string(i)] = static_cast<int64_t>(inputs[i].scalar_type());
    }
    return at::empty({0}, at::TensorOptions().dtype(dtype));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list /*grad_outputs*/) {
    torch::autograd::variable_list grads;
    const int64_t count = ctx->saved_data["count"].toInt();
    for (int64_t i = 0; i < count; ++i) {
      const auto sizes = ctx->saved_data["sizes" + std::to_string(i)].toIntVector();
      const auto dtype =
          static_cast<at::ScalarType>(ctx->saved_data["dtype" + std::to_string(i)].toInt());
      grads.push_back(at::zeros(sizes, at::TensorOptions().dtype(dtype)));
    }
    grads.push_back(at::Tensor());  // for dtype
    return grads;
  }
};

}  // namespace

at::Tensor placeholder_after(const std::vector<at::Tensor>& inputs, at::ScalarType dtype) {
  return After::apply(at::TensorList(inputs), dtype);
}

}  // namespace detail
}  // namespace shoal::global
