// CPU weights by priority for an oversubscribed host (docs/queue.md, "Oversubscription"): the
// agent puts each job's workers in a cgroup of their own whose CPU weight follows the job's
// priority, so that when a host runs more workers than cores, lower-priority workers get less of
// them. Where no cgroup can be made (not root, a read-only hierarchy) it falls back to the
// workers' nice value, which the kernel's scheduler weighs the same way.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>

namespace shoal::queue {

// The share of a priority, relative to 1024 for priority 0: doubled every 100 above it, halved
// every 100 below (high = 2048, normal = 1024, low = 512), within cgroup v1's 2..262144.
int64_t cpu_shares_for(int priority);
// The nice value used where no cgroup can be made: -1 per 100 of priority above 0 (not below
// 0 unless root may), +1 per 100 below, within -20..19. Kernel weights step by ~1.25x a nice
// level, so this is a milder ratio than the shares'.
int nice_for(int priority);

class CpuWeights {
 public:
  // `root`: the cgroup directory to make the jobs' groups under; "" finds one: cgroup v2's
  // unified hierarchy (cpu.weight) or v1's cpu controller (cpu.shares), under a directory named
  // after this agent's pid. Nothing is made until the first worker is placed; then the groups of
  // agents that were killed (no process has their pid) go, as their destructors never ran.
  explicit CpuWeights(std::string root = "");
  ~CpuWeights();  // removes the groups it made (empty once their workers are gone)
  CpuWeights(const CpuWeights&) = delete;
  CpuWeights& operator=(const CpuWeights&) = delete;

  // Puts `pid` (a worker just started) in the group of `job` with the weight of `priority`.
  // Returns how, in words ("cgroup /sys/fs/cgroup/cpu/.../job-3 cpu.shares 512", "nice 1"), or
  // why not; never throws: a weight is a preference, not a condition of running.
  std::string place(pid_t pid, int64_t job, int priority);
  // A job with no worker left here: its group goes.
  void forget(int64_t job);

  // The group a job's workers are in ("" when none was made).
  std::string group_of(int64_t job) const;

 private:
  std::string root_;
  std::string weight_file_;  // "cpu.weight" (v2) or "cpu.shares" (v1); "" when nice is used
  bool probed_ = false;
  std::map<int64_t, std::string> groups_;

  void probe();
};

}  // namespace shoal::queue
