// Where a global tensor lives (Placement) and how it is distributed there (Sbp: split, broadcast,
// partial_sum), as OneFlow's global tensors have it. See docs/global.md.
//
//   namespace g = shoal::global;
//   g::Placement::all()              // every worker, as a line
//   g::Placement({0, 1})             // workers 0 and 1
//   g::Placement::mesh({2, 2})       // every worker (4), as a 2x2 mesh, row-major
//   g::split(0), g::broadcast(), g::partial_sum()
//   g::NdSbp{g::split(0), g::broadcast()}   // one Sbp per mesh axis
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace shoal::global {

class Placement {
 public:
  // Every worker of the job (shoal::world_size() of them), as a line.
  static Placement all();
  // Every worker of the job as a mesh of `shape` (its product must be the world size), row-major:
  // mesh({2, 2}) puts workers 0, 1 on the first row and 2, 3 on the second.
  static Placement mesh(std::vector<int64_t> shape);
  // `ranks` as a mesh of `shape`, row-major.
  static Placement mesh(std::vector<int64_t> shape, std::vector<int> ranks);

  // `ranks`, in this order, as a line. UsageError for an empty list or a repeated rank.
  Placement(std::vector<int> ranks);  // NOLINT: implicit, so that {0, 1} is a placement
  Placement(std::initializer_list<int> ranks) : Placement(std::vector<int>(ranks)) {}

  const std::vector<int>& ranks() const { return ranks_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int size() const { return static_cast<int>(ranks_.size()); }
  bool contains(int rank) const { return index_of(rank) >= 0; }
  // The position of `rank` in ranks(), -1 when it is not a member.
  int index_of(int rank) const;
  // The mesh coordinate of member `rank`.
  std::vector<int64_t> coordinate(int rank) const;
  // The members that share every coordinate of member `rank` except the one on `axis`, in order
  // of that coordinate: the workers a collective along `axis` runs among.
  std::vector<int> axis_ranks(int axis, int rank) const;

  // "[0, 1, 2, 3]", or "[0, 1, 2, 3] as 2x2" for a mesh.
  std::string describe() const;

  bool operator==(const Placement& other) const {
    return ranks_ == other.ranks_ && shape_ == other.shape_;
  }
  bool operator!=(const Placement& other) const { return !(*this == other); }

 private:
  Placement(std::vector<int64_t> shape, std::vector<int> ranks, const char* caller);

  std::vector<int> ranks_;
  std::vector<int64_t> shape_;
};

// How a tensor is distributed over one mesh axis.
class Sbp {
 public:
  enum class Kind { kSplit, kBroadcast, kPartialSum };

  Kind kind() const { return kind_; }
  bool is_split() const { return kind_ == Kind::kSplit; }
  bool is_broadcast() const { return kind_ == Kind::kBroadcast; }
  bool is_partial_sum() const { return kind_ == Kind::kPartialSum; }
  // The split dimension (for split only).
  int64_t dim() const { return dim_; }

  // "split(0)", "broadcast", "partial_sum"
  std::string describe() const;

  bool operator==(const Sbp& other) const { return kind_ == other.kind_ && dim_ == other.dim_; }
  bool operator!=(const Sbp& other) const { return !(*this == other); }

 private:
  friend Sbp split(int64_t dim);
  friend Sbp broadcast();
  friend Sbp partial_sum();
  Sbp(Kind kind, int64_t dim) : kind_(kind), dim_(dim) {}

  Kind kind_ = Kind::kBroadcast;
  int64_t dim_ = 0;
};

// Each worker holds a slice along `dim` (sizes as comm::split_sizes cuts them: the first ones one
// row more when it does not divide).
Sbp split(int64_t dim);
// Each worker holds the whole value.
Sbp broadcast();
// The value is the sum of the workers' tensors.
Sbp partial_sum();

// The SBP of a gradient: split(d) stays split(d), broadcast and partial_sum swap.
Sbp dual(const Sbp& sbp);

// One Sbp per axis of a placement's mesh.
class NdSbp {
 public:
  NdSbp(Sbp sbp) : axes_{sbp} {}  // NOLINT: implicit, so that split(0) is an NdSbp
  NdSbp(std::initializer_list<Sbp> axes) : axes_(axes) {}
  explicit NdSbp(std::vector<Sbp> axes) : axes_(std::move(axes)) {}

  int size() const { return static_cast<int>(axes_.size()); }
  const Sbp& operator[](int axis) const { return axes_.at(static_cast<size_t>(axis)); }
  Sbp& operator[](int axis) { return axes_.at(static_cast<size_t>(axis)); }
  const std::vector<Sbp>& axes() const { return axes_; }

  // "split(0)", or "(split(0), broadcast)" for several axes.
  std::string describe() const;

  bool operator==(const NdSbp& other) const { return axes_ == other.axes_; }
  bool operator!=(const NdSbp& other) const { return !(*this == other); }

 private:
  std::vector<Sbp> axes_;
};

NdSbp dual(const NdSbp& sbp);

}  // namespace shoal::global
