// The shared state behind Group and Work handles. Private to src/comm.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/shm/executor.h"
#include "comm/store.h"
#include "shoal/comm/group.h"
#include "shoal/comm/work.h"
#include "shoal/core/timeline.h"

namespace shoal::comm {

class DataPath;
class ShmPath;

// The all-reduce of a group across hosts with several members on some host (Note [Hierarchical
// all-reduce] in path.cpp).
struct Hierarchy {
  // Member local_rank of every host, over Gloo (rank: the host's number); null when this member
  // takes no slice. Declared before `local`, whose lanes use it: they end first.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> across;
  // This host's members, in group order, through their segment; null on a host of one member.
  std::unique_ptr<shm::Executor> local;
  int local_rank = 0;
  int local_size = 1;
  int hosts = 1;
  int members = 1;  // of the whole group: an average's divisor
  int slices = 1;  // members per host that cross: the fewest any host has
  int64_t flat_below = 0;  // smaller all-reduces (bytes) take the flat ring over all members
};

// A failure of the network step of a hierarchical operation, in Gloo's words.
class NetworkFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Group::State {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend;  // null in a group of one
  // The shared-memory path, when every member is on this host (docs/comm.md, "Shared memory among
  // co-located workers"); null: every operation goes through Gloo.
  std::unique_ptr<shm::Executor> shm;
  // Across hosts, with members sharing some host: the hierarchical all-reduce; null otherwise.
  std::unique_ptr<Hierarchy> hierarchy;
  // The paths over the three above (Note [Data paths] in data_path.h), each null when what it
  // uses is; declared after them, so that they end first.
  std::unique_ptr<DataPath> gloo_path;
  std::unique_ptr<ShmPath> shm_path;
  std::unique_ptr<DataPath> hierarchical_path;
  StorePtr store;           // the job's store, unprefixed; null in a group of one
  std::string prefix;       // this group's key prefix in the store
  GroupOptions options;
  int rank = 0;
  std::vector<int> members;  // job ranks, in group order
  // The ranks of the group this one descends from by subgroup() (empty: members): where a lost
  // member that left cleanly sends lost_members() looking for the failure it left after.
  std::vector<int> job;

  std::atomic<bool> broken{false};
  std::mutex mutex;
  std::string broken_reason;                   // guarded by mutex
  std::map<std::string, int> subgroup_counts;  // guarded by mutex

  int size() const { return static_cast<int>(members.size()); }
  std::string describe() const;        // "workers [0, 1, 2] (this worker: 1)"
  void mark_broken(const std::string& reason);
  // How the members that have ended did so, from their launchers' records; "" when none has.
  std::string lost_members() const;

  ~State();
};

// "0, 1, 2": ranks or sizes, as messages list them.
template <typename Int>
std::string join(const std::vector<Int>& values) {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text;
}

// How often a blocked wait (an operation's, or a connect's) asks who is gone. A member killed
// outright is usually reported by its path at once, but only to the workers that talk to it
// directly; the rest learn of it this way instead of at the group's timeout.
inline constexpr Duration kLivenessPeriod{250};

// Which path SHOAL_COMM asks for (Note [Choosing the shared-memory path] in path.cpp);
// UsageError for another value.
enum class Path { kAuto, kTcp, kShm };
Path requested_path();
// This process's locality key, or "- <why not>" (equal to no other).
std::string this_locality();
// After the connect barrier of a group whose members wrote their locality keys: opens the shared
// memory or the hierarchy its members agree on (state.shm, state.hierarchy), or leaves it on
// Gloo; CommError when SHOAL_COMM=shm cannot be honoured.
void open_paths(Group::State& state, const Deadline& deadline,
                const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& backend_options);
// Note [Hierarchical all-reduce], on the collectives' lane of hierarchy.local: `buffer` in place.
void hierarchical_all_reduce(const Hierarchy& hierarchy, shm::LocalGroup& local,
                             const at::Tensor& buffer, shm::DType dtype, shm::ReduceOp op,
                             c10d::ReduceOp backend_op, Duration timeout);
// SIGPIPE to ignored unless the program chose an action of its own (Note [Broken pipes] in
// store.cpp); before this process opens a connection of the job's.
void ignore_broken_pipes();
// Each member writes `<counter>/<rank>` and adds one to `<counter>`; returns once the counter holds
// every member (Note [Creating a group ends with a barrier] in group.cpp).
void wait_for_members(Group::State& state, const std::string& counter, const Deadline& deadline);

struct Work::State {
  std::string op;
  std::shared_ptr<Group::State> group;
  c10::intrusive_ptr<c10d::Work> backend_work;  // null when nothing was sent (one worker, no data)
  std::shared_ptr<shm::Task> shm_task;          // instead of backend_work on the shared-memory path
  bool point_to_point = false;
  Deadline deadline{Duration(0)};
  std::function<void(Work::State&)> finish;  // after success: copy back, reduce, fill result
  at::Tensor result;
  bool done = false;
  timeline::AsyncSlice slice;  // from launch to the completion a wait() sees
};

}  // namespace shoal::comm
