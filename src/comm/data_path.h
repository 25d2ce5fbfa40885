// The paths a group's data takes (Note [Data paths]). Private to src/comm.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "state.h"

namespace shoal::comm {

// Note [Data paths]
// A Group (group.cpp) checks an operation's arguments, lays out its buffers, counts the bytes it
// sends (Note [Bytes sent]) and makes its Work; a DataPath starts it on those buffers, as c10d's
// backends do for a ProcessGroup and Gloo's transports for a pair: it sets work.backend_work or
// work.shm_task, and work.finish where the result needs a last step. Three paths exist
// (docs/comm.md):
//   - GlooPath (path_gloo.cpp): Gloo over TCP, for every operation of a group of several members;
//   - ShmPath (path_shm.cpp): the host's shared segment, when every member is on this host and the
//     dtype is one the segment reduces (point-to-point and barriers take it for any dtype);
//   - HierarchicalPath (path.cpp): an all-reduce across hosts whose members share some host,
//     reduced on each host's segment and across hosts over Gloo (Note [Hierarchical all-reduce]).
// Group picks one per operation (Group::path_for). A group of one takes none: it sends nothing.
class DataPath {
 public:
  virtual ~DataPath() = default;
  // Reduces `buffer` over the members, in place. Returns whether the path divided an average
  // itself (else Group divides the sum).
  virtual bool all_reduce(Work::State& work, const at::Tensor& buffer, ReduceOp op) = 0;
  virtual void broadcast(Work::State& work, const at::Tensor& buffer, int root) = 0;
  // `input` holds sizes[rank] rows; work.result becomes every member's rows, in member order.
  virtual void all_gather(Work::State& work, const at::Tensor& input, const Sizes& sizes,
                          int rank) = 0;
  // Sends send[j] rows of `input` to member j, receiving recv[j] rows from it into `output`.
  virtual void all_to_all(Work::State& work, const at::Tensor& input, const at::Tensor& output,
                          const Sizes& send, const Sizes& recv) = 0;
  // work.result becomes this member's sizes[rank] rows of the reduction of every member's input.
  virtual void reduce_scatter(Work::State& work, const at::Tensor& input, const Sizes& sizes,
                              int rank, ReduceOp op) = 0;
  virtual void send(Work::State& work, const at::Tensor& buffer, int dst, int tag) = 0;
  virtual void recv(Work::State& work, const at::Tensor& buffer, int src, int tag) = 0;
  virtual void barrier(Work::State& work) = 0;
};

// The shared-memory path, which also hands the group's segment memory out (Group::empty_shared).
class ShmPath final : public DataPath {
 public:
  // `state` owns this path and its executor (state.shm).
  explicit ShmPath(const Group::State& state) : state_(state) {}
  bool all_reduce(Work::State& work, const at::Tensor& buffer, ReduceOp op) override;
  void broadcast(Work::State& work, const at::Tensor& buffer, int root) override;
  void all_gather(Work::State& work, const at::Tensor& input, const Sizes& sizes,
                  int rank) override;
  void all_to_all(Work::State& work, const at::Tensor& input, const at::Tensor& output,
                  const Sizes& send, const Sizes& recv) override;
  void reduce_scatter(Work::State& work, const at::Tensor& input, const Sizes& sizes, int rank,
                      ReduceOp op) override;
  void send(Work::State& work, const at::Tensor& buffer, int dst, int tag) override;
  void recv(Work::State& work, const at::Tensor& buffer, int src, int tag) override;
  void barrier(Work::State& work) override;
  // Runs `operation` on the segment's lane with the time left of `work`'s deadline.
  void submit(Work::State& work, std::function<void(shm::LocalGroup&, Duration)> operation);

 private:
  const Group::State& state_;
};

// Gloo over `backend` (a group of several members).
std::unique_ptr<DataPath> gloo_path(c10::intrusive_ptr<c10d::ProcessGroupGloo> backend);
// The hierarchical all-reduce over `hierarchy`; every other operation goes to `flat`.
std::unique_ptr<DataPath> hierarchical_path(const Hierarchy& hierarchy, DataPath& flat);

// Takes (and clears) this thread's RunOnWaiter promise: whether the caller of the operation being
// launched waits for it at once, so that the segment's lane may stay asleep (Note [Running on the
// waiter] in shm/executor.cpp).
bool take_waited_at_once();

// Conversions and shapes that Group and the paths share.
c10d::ReduceOp to_backend(ReduceOp op);
// The element type of the shared-memory path for a tensor's dtype; nullopt: Gloo takes it.
std::optional<shm::DType> shm_dtype(at::ScalarType type);
shm::ReduceOp to_shm(ReduceOp op);
std::vector<int64_t> shape_with_rows(const at::Tensor& like, int64_t rows);
// Elements of each count of rows of a tensor shaped like `like` (dim 0 is the rows).
std::vector<size_t> element_counts(const at::Tensor& like, const Sizes& rows);
// The reduction over dim 0 of `stacked` (one row block per member).
at::Tensor reduce_rows(const at::Tensor& stacked, ReduceOp op);

}  // namespace shoal::comm
