// Groups of workers and their collectives, over c10d's ProcessGroupGloo.
//
// Contract (as c10d's): every member calls the same operations on a group in the same order,
// with tensors of the same dtype and compatible shapes. A group is for a fixed set of workers;
// when a peer is lost (CommError), the group is broken for good and must be replaced.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoal/comm/store.h"
#include "shoal/comm/work.h"
#include "shoal/core/timeout.h"

namespace shoal::comm {

class DataPath;

enum class ReduceOp { kSum, kAvg, kMax, kMin };

// The default timeout of a group's operations.
inline constexpr Duration kDefaultGroupTimeout = std::chrono::minutes(10);

struct GroupOptions {
  Duration timeout = kDefaultGroupTimeout;
  // Local address (or interface name, with `interface`) that peers reach this worker on.
  std::string bind_address = "127.0.0.1";
  std::string interface;
  // Threads c10d gives the group to run operations.
  int threads = 2;
  // Where in the store the members exchange their addresses. A store that sees the same
  // members connect again (an elastic job's next round) needs a new prefix each time.
  std::string store_prefix = "shoal/group/world";
  // Asked every 250 ms while a collective waits: a non-empty answer names members known to be
  // gone, and the collective fails with CommError quoting it instead of waiting for its
  // deadline. Elastic jobs answer from their membership, which notices a silent peer long
  // before any collective's timeout. When set, it replaces the launchers' exit records in the
  // store as the way a failed collective names lost members.
  std::function<std::string()> lost_check;
};

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  Duration timeout = kUnsetTimeout;
};

struct BroadcastOptions {
  int root = 0;
  Duration timeout = kUnsetTimeout;
};

// Sizes along dim 0, one per member. Empty: every member's part has the same size
// (all_gather), or dim 0 is cut by split_sizes (reduce_scatter, all_to_all).
using Sizes = std::vector<int64_t>;

struct AllGatherOptions {
  Sizes sizes;  // each member's dim-0 size, when they differ
  Duration timeout = kUnsetTimeout;
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  Sizes sizes;  // how dim 0 of the input is cut among members; default split_sizes
  Duration timeout = kUnsetTimeout;
};

struct AllToAllOptions {
  Sizes send_sizes;  // dim-0 rows this worker sends to each member; default split_sizes
  Sizes recv_sizes;  // dim-0 rows this worker receives from each member; default: equal parts
  Duration timeout = kUnsetTimeout;
};

struct PointToPointOptions {
  int tag = 0;
  Duration timeout = kUnsetTimeout;
};

struct BarrierOptions {
  Duration timeout = kUnsetTimeout;
};

// Bytes this worker has sent in every group's operations since the process started, counted as
// ring algorithms send them (all-reduce of T bytes among n: 2T(n-1)/n; all-gather,
// reduce-scatter, broadcast: T(n-1)/n of the whole; send: T; receive: 0; docs/comm.md). It covers
// whatever uses groups: DataParallel, GradientSync, boxing, pipelines. For comparing plans.
int64_t sent_bytes();

// How `length` rows are cut into `parts`: the first (length % parts) parts get one row more.
// The same rule everywhere in shoal (collectives, data sharding, split SBP).
Sizes split_sizes(int64_t length, int parts);
// Where each of those parts starts, and the end: parts + 1 entries, the first 0, the last length.
Sizes split_starts(int64_t length, int parts);

// Promises, for its scope, that the calling thread waits for the first operation it launches
// before it launches another. On the shared-memory path that operation then runs on the thread
// that waits for it, instead of waking the group's own thread and being woken by it (two hand-offs
// between threads, the larger part of a small all-reduce's time; Note [Running on the waiter] in
// src/comm/shm/executor.cpp). Blocking collectives make this promise themselves; DataParallel
// makes it for the bucket it launches last. A promise not kept costs no deadlock, only time: the
// operation, and those launched after it, run once one of them is waited for.
class RunOnWaiter {
 public:
  RunOnWaiter();
  ~RunOnWaiter();
  RunOnWaiter(const RunOnWaiter&) = delete;
  RunOnWaiter& operator=(const RunOnWaiter&) = delete;
};

class Group {
 public:
  // The group of all `size` workers, meeting through `store`. Every worker calls this with its
  // own rank; it returns once all have connected, or raises CommError after options.timeout.
  static Group create(StorePtr store, int rank, int size, const GroupOptions& options = {});

  // A group of one, with no store: every collective is a local no-op or copy.
  static Group single();

  Group() = default;

  int rank() const;   // this worker's index in the group
  int size() const;
  // The members' ranks in the job's numbering, in group order.
  const std::vector<int>& members() const;
  Duration timeout() const;
  void set_timeout(Duration timeout);

  // Collectives. The plain form waits; the _async form returns a Work to wait on. In-place
  // operations (all_reduce, broadcast, recv) write into their tensor argument.
  void all_reduce(at::Tensor& tensor, const AllReduceOptions& options = {});
  Work all_reduce_async(at::Tensor& tensor, const AllReduceOptions& options = {});

  void broadcast(at::Tensor& tensor, const BroadcastOptions& options = {});
  Work broadcast_async(at::Tensor& tensor, const BroadcastOptions& options = {});

  // Concatenation along dim 0 of every member's tensor, in group order.
  at::Tensor all_gather(const at::Tensor& tensor, const AllGatherOptions& options = {});
  Work all_gather_async(const at::Tensor& tensor, const AllGatherOptions& options = {});

  // This member's part (along dim 0) of the reduction of every member's input.
  at::Tensor reduce_scatter(const at::Tensor& input, const ReduceScatterOptions& options = {});
  Work reduce_scatter_async(const at::Tensor& input, const ReduceScatterOptions& options = {});

  // Sends rows send_sizes[j] of `input` (in order) to member j; returns what every member sent
  // here, concatenated in group order.
  at::Tensor all_to_all(const at::Tensor& input, const AllToAllOptions& options = {});
  Work all_to_all_async(const at::Tensor& input, const AllToAllOptions& options = {});

  void send(const at::Tensor& tensor, int dst, const PointToPointOptions& options = {});
  Work send_async(const at::Tensor& tensor, int dst, const PointToPointOptions& options = {});
  void recv(at::Tensor& tensor, int src, const PointToPointOptions& options = {});
  Work recv_async(at::Tensor& tensor, int src, const PointToPointOptions& options = {});

  void barrier(const BarrierOptions& options = {});
  Work barrier_async(const BarrierOptions& options = {});

  // A one-dimensional tensor of `numel` elements of `dtype`, uninitialised, in memory that this
  // group's members share when the group takes the shared-memory path (docs/comm.md, "Shared
  // buffers"): an all_reduce of a tensor that lies in it, at the same place on every member,
  // reads and writes every member's memory directly instead of copying through the group's
  // segment (PyTorch's symmetric memory, NCCL's registered buffers). Elsewhere (Gloo,
  // hierarchical, a group of one, a dtype shared memory does not reduce), or when the memory
  // cannot be had, an ordinary tensor: collectives take it as any other. A collective: every
  // member calls it in the same order with the same numel and dtype.
  at::Tensor empty_shared(int64_t numel, at::ScalarType dtype);

  // A group of some of this group's members (`ranks` in this group's numbering, any order,
  // no repeats). Called by those members only, in the same order among themselves; the
  // others don't take part. Raises UsageError when this worker is not among `ranks`.
  Group subgroup(std::vector<int> ranks) const;

  // True after a CommError: the group must be replaced.
  bool is_broken() const;

  // How this group's data travels (docs/comm.md, "Which path a group takes"): "none" (a group of
  // one), "gloo" (TCP between all members), "shared memory" (all members on one host) or
  // "hierarchical" (several hosts, members sharing some: all_reduce through shared memory inside
  // each host and Gloo between hosts; the other operations over Gloo). Equal on every member.
  std::string path() const;

  struct State;

 private:
  explicit Group(std::shared_ptr<State> state) : state_(std::move(state)) {}
  // `bytes` (this worker's tensor) and `peer` (-1: none) are what the timeline records.
  Work launch(const char* op, const std::function<void(Work::State&)>& start, Duration timeout,
              int64_t bytes, int peer = -1);
  // The path an operation on `tensor` takes (Note [Data paths], src/comm/data_path.h); null: a
  // point-to-point or a barrier, which take the shared segment whatever their dtype.
  DataPath& path_for(const at::Tensor* tensor) const;
  std::shared_ptr<State> state_;
};

}  // namespace shoal::comm
