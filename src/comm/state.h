// The shared state behind Group and Work handles. Private to src/comm.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/shm/executor.h"
#include "shoal/comm/group.h"
#include "shoal/comm/work.h"
#include "shoal/core/timeline.h"

namespace shoal::comm {

struct Group::State {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend;  // null in a group of one
  // The shared-memory path, when every member is on this host (docs/comm.md, "Shared memory among
  // co-located workers"); null: every operation goes through Gloo.
  std::unique_ptr<shm::Executor> shm;
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
