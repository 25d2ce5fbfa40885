// A parameter server's tables (part of ServerCore, server_core.h, which calls it with its lock
// held; it takes no lock itself): the mode the job trains in, the registration that creates the
// tables (Note [Who creates the tables] in server_core.h), the virtual shards that hold their
// chunks and rows, and what requests do to them: checks, optimizer steps and reads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "handler.h"
#include "messages.h"
#include "mirror.h"
#include "table.h"

namespace shoal::ps::detail {

struct ServerCoreOptions;

class ServerRegistry {
 public:
  struct Table {
    TableSpec spec;
    int64_t numel = 0;  // dense
    int64_t dim = 0;    // sparse
  };

  // Holds options.shards (which ServerCore has checked); no tables until the first registration.
  explicit ServerRegistry(const ServerCoreOptions& options);
  ServerRegistry(const ServerRegistry&) = delete;
  ServerRegistry& operator=(const ServerRegistry&) = delete;

  // Takes the registering worker's mode into `options`' consistency and staleness, or checks it
  // against the servers' (see mode_).
  void adopt_mode(const RegisterRequest& request, ServerCoreOptions& options);

  // Registration (Note [Who creates the tables] in server_core.h). UsageError for a bad spec.
  static void check_specs(const std::vector<TableSpec>& tables);
  bool registered() const { return registered_; }
  // Whether `request`, which carries no initial values, must wait for the one that does.
  bool awaits_initial(const RegisterRequest& request) const {
    return !registered_ && request.initial.empty() && holds_dense_chunks(request.tables);
  }
  // A registration after the first: UsageError naming the first difference from it.
  void check_same(const RegisterRequest& request) const;
  // The first registration: creates the tables from its initial values, after checking them all.
  void create(const RegisterRequest& request);

  const Table& table_at(const char* what, int32_t index) const;  // NotFoundError if unknown
  const Table& table(int32_t index) const { return tables_[static_cast<size_t>(index)]; }
  const std::vector<Table>& tables() const { return tables_; }
  std::vector<TableSpec> specs() const;
  int32_t virtual_shards() const { return virtual_shards_; }

  // A request's slices: UsageError or NotFoundError unless every table, chunk and row is one this
  // server holds and the values (with_values: a push's; else none, a pull's) fit.
  void check_slices(const char* what, const std::vector<DenseSlice>& dense,
                    const std::vector<SparseSlice>& sparse, bool with_values) const;
  // The optimizer steps of checked slices' gradients.
  void apply(const std::vector<DenseSlice>& dense, const std::vector<SparseSlice>& sparse);
  // One dense chunk's optimizer step with the gradient `grad` (the chunk's length of values),
  // within a Change.
  void apply_chunk(int32_t table, int64_t chunk, const float* grad);
  // Values change while one lives (apply() makes its own): the mirror's sequence is odd (Note
  // [The values' mirror], mirror.h). Made under the core's lock; they nest.
  class Change {
   public:
    explicit Change(ValuesMirror* mirror) : mirror_(mirror) {
      if (mirror_) mirror_->begin_change();
    }
    ~Change() {
      if (mirror_) mirror_->end_change();
    }
    Change(const Change&) = delete;
    Change& operator=(const Change&) = delete;

   private:
    ValuesMirror* mirror_;
  };
  Change change() { return Change(mirror_.get()); }
  // A shard's values were replaced (loaded from a snapshot): the mirror is written anew.
  void shard_loaded();
  // A checked pull's values. `out`: where the dense values go when they fit (Note [Pull replies
  // in place]), or null.
  void fill_reply(const PullRequest& request, PullReply& reply, DenseOut* out) const;

  // The held shards, by id (a snapshot's, save_shard's and load_shard's).
  const std::map<int32_t, VirtualShard>& shards() const { return shards_; }
  VirtualShard* find_shard(int32_t shard);  // nullptr if not held
  const VirtualShard* find_shard(int32_t shard) const;
  // Sparse rows held in memory, over all shards.
  size_t row_count() const;

 private:
  bool holds_dense_chunks(const std::vector<TableSpec>& tables) const;
  // fill_reply's parts: the dense values' places in the mirror, and the sparse rows.
  bool from_mirror(const PullRequest& request, PullReply& reply, DenseOut& out) const;
  void fill_rows(const PullRequest& request, PullReply& reply) const;
  bool holds(int32_t shard) const {
    return shard >= 0 && static_cast<size_t>(shard) < held_.size() &&
           held_[static_cast<size_t>(shard)] != nullptr;
  }
  VirtualShard* holder(int32_t shard) { return held_[static_cast<size_t>(shard)]; }
  const VirtualShard* holder(int32_t shard) const { return held_[static_cast<size_t>(shard)]; }

  int32_t virtual_shards_;
  bool mirror_wanted_;                    // ServerCoreOptions::mirror_values
  std::unique_ptr<ValuesMirror> mirror_;  // once the tables exist, where wanted and possible
  std::map<int32_t, VirtualShard> shards_;
  // By virtual shard: its entry in shards_ (map nodes do not move), or nullptr if not held here.
  std::vector<VirtualShard*> held_;
  std::vector<Table> tables_;
  bool registered_ = false;
  // Whose mode the servers train in (Note [The mode comes with the workers]): empty until the
  // first registration when options.mode_from_workers, else the options' mode.
  std::string mode_;
  int32_t mode_worker_ = -1;  // the worker whose registration set it
};

}  // namespace shoal::ps::detail
