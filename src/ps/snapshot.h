// A parameter server's snapshot files (docs/ps.md, "Replicas and snapshots"): the virtual shards
// one server held at one step, in one file written atomically (a temporary name, fsync, a
// checksum, rename), and the reader that finds, for any set of shards, the newest complete
// snapshot of them among the files of any earlier server count.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace shoal::ps::detail {

// Writes `shards` (shard -> ServerCore::save_shard bytes), taken at `step` by server `index` of
// `servers`, as DIR/snapshot-<step>-server-<index>-of-<servers>.bin, and then removes that
// server's older files but the newest `keep`. UsageError naming the path when it cannot.
void write_snapshot(const std::string& dir, int index, int servers, int64_t step,
                    const std::map<int32_t, std::string>& shards, int keep = 2);

struct Snapshot {
  int64_t step = 0;
  std::map<int32_t, std::string> shards;  // every shard asked for
  std::vector<std::string> files;         // where they came from
};

// The newest step at which the snapshot files in `dir` (of one server count) hold every shard of
// `shards`, with those shards' bytes. Files whose checksum or layout is wrong, and temporary
// files, are skipped. nullopt when no step has them all (or `dir` has no snapshot).
std::optional<Snapshot> read_newest_snapshot(const std::string& dir,
                                             const std::vector<int32_t>& shards);

// Writes a server's snapshots on a thread of its own, so that the core, which hands them over
// under its lock (ServerCoreOptions::on_snapshot), never waits for a disk. When the disk is
// slower than the steps, a snapshot still waiting is replaced by the newer one; the last one
// handed over is written before the destructor returns. A write that fails is reported on stderr
// and the server goes on.
class SnapshotWriter {
 public:
  // Creates `dir` if needed (UsageError naming it when it cannot). `restore`: the server was
  // restarted and loads the newest snapshot once registered (docs/ps.md, "Replicas and
  // snapshots").
  SnapshotWriter(std::string dir, int64_t every, int index, int servers, bool restore);
  ~SnapshotWriter();
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  int64_t every() const { return every_; }
  const std::string& dir() const { return dir_; }
  bool restore() const { return restore_; }
  void hand(int64_t step, std::map<int32_t, std::string> shards);

 private:
  struct Pending {
    int64_t step;
    std::map<int32_t, std::string> shards;
  };
  void run();

  const std::string dir_;
  const int64_t every_;
  const int index_;
  const int servers_;
  const bool restore_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::optional<Pending> pending_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace shoal::ps::detail
