// A parameter server's snapshot files (docs/ps.md, "Replicas and snapshots"): the virtual shards
// one server held at one step, in one file written atomically (a temporary name, fsync, a
// checksum, rename), and the reader that finds, for any set of shards, the newest complete
// snapshot of them among the files of any earlier server count.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
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

}  // namespace shoal::ps::detail
