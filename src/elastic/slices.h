// An elastic job's DataParallel at a ZeRO stage: at each commit, a copy of this worker's slices
// and their optimizer state on the next worker; when the world changes, the slices cut again for
// it from what the members hold. Private to src/elastic; see Note [Slices in an elastic job] in
// slices.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "dp/replication.h"
#include "shoal/comm/group.h"

namespace shoal::elastic {

class SlicedCommits {
 public:
  // UsageError when the optimizer's state cannot be moved (not SGD, Adam, AdamW, Adagrad or
  // RMSprop) or when the optimizer does not hold the slices.
  SlicedCommits(std::shared_ptr<dp::Slicing> slicing, torch::optim::Optimizer& optimizer);

  // The row each member gives sync(): its commit's version and lineage and whether its slices
  // changed since (Note [Commits without copies]); then, from holding(), its slices' cut (size 0:
  // none of the job's values) and the cut, part, version and lineage of the copy it keeps of the
  // previous worker's.
  enum Column : int {
    kVersion,
    kLineage,
    kChanged,
    kCutSize,
    kCutRank,
    kCopySize,
    kCopyRank,
    kCopyVersion,
    kCopyLineage,
  };
  std::vector<int64_t> holding() const;  // the columns from kCutSize on

  // At a commit of `version` in the history `lineage` (and after a round's re-cut): this worker's
  // slices and their optimizer state go to the next member of `group`, the previous member's
  // come here, replacing the copy kept so far. A collective; nothing in a world of one.
  void copy_to_next(comm::Group& group, int64_t version, uint64_t lineage);

  // Who holds each part of the cut of commit (`version`, `lineage`): a member whose own slices
  // are that commit's (its row is the commit's and unchanged), else one that keeps a copy of
  // them. `rows`: every member's [version, lineage, changed, holding()...]. Nothing, with the
  // parts no member holds named in `missing`, when some part is lost.
  struct Plan {
    int size = 0;
    std::vector<int> holder;  // [part] -> member
    std::vector<bool> copy;   // [part]: the holder's copy, not its own slices
  };
  static std::optional<Plan> plan(const at::Tensor& rows, int64_t version, int64_t lineage,
                                  std::string* missing);
  static bool any_holds_values(const at::Tensor& rows);

  // The slices cut for `group` (the world) from the plan's parts, with their optimizer state; a
  // collective of every member.
  void recut(comm::Group& group, const Plan& plan);
  // The slices cut for `group` from `source`'s whole parameters, without optimizer state (no
  // member holds the job's values yet: the job's first round). A collective.
  void recut_from(comm::Group& group, int source);
  // The slices cut for the world, their values to be loaded (a durable commit), then filled().
  void recut_for_load() { slicing_->recut(); }
  void filled() { slicing_->filled(); }

 private:
  // Parameter k's part as columns, each contiguous and of the slice's length: the slice's
  // values, then each defined field of its optimizer state, in state_fields() order; and its
  // header row (has state, step or -1, the mask of the defined fields).
  std::vector<at::Tensor> own_columns(size_t k) const;
  void header_row(size_t k, int64_t* row) const;

  std::shared_ptr<dp::Slicing> slicing_;
  torch::optim::Optimizer& optimizer_;
  std::vector<std::string> fields_;
  // The copy of the previous member's slices: its cut and part, the commit, the header ([K, 3]:
  // has state, step or -1, mask of defined fields) and each parameter's columns ([columns,
  // length]), over `bytes`.
  struct Copy {
    int64_t size = 0, rank = 0, version = -1;
    uint64_t lineage = 0;
    at::Tensor header, bytes;
    std::vector<at::Tensor> columns;
  } copy_;
};

}  // namespace shoal::elastic
