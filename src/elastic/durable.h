// Durable commits: an elastic job's commit kept on disk as well, in the checkpoint format of
// shoal::save (docs/checkpoint.md), so that a job whose every worker died, or that is started
// again, resumes from it instead of from step 0. Private to src/elastic; see docs/elastic.md,
// "Durable commits".
#pragma once

#include <cstdint>
#include <future>
#include <optional>
#include <string>

namespace shoal::elastic {

class DurableCommits {
 public:
  // `path` empty: SHOAL_CHECKPOINT, if set; `every` 0: SHOAL_CHECKPOINT_EVERY, if set, else 100.
  // UsageError naming the variable or option for a value that is not a commit count >= 1.
  DurableCommits(std::string path, int64_t every);
  ~DurableCommits();
  DurableCommits(const DurableCommits&) = delete;
  DurableCommits& operator=(const DurableCommits&) = delete;

  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  // Whether commit `version` is one to keep on disk (every `every` commits, and the last one).
  bool due(int64_t version) const {
    return enabled() && version % every_ == 0 && version != written_;
  }
  bool written(int64_t version) const { return version == written_; }

  // Writes `payload` (a checkpoint payload, checkpoint/contents.h) as commit `version`, atomically
  // and in the background; first waits for the previous write. A write that failed raises its
  // UsageError here or in wait().
  void write(int64_t version, std::string payload);
  // Commit `version` is kept, by the first worker (a sharded model's, which every worker gathers:
  // each then decides alike whether a commit is still to keep).
  void written_by_first(int64_t version) { written_ = version; }
  void wait();

  // The payload of the checkpoint at path(), checked; nullopt when there is no file. UsageError
  // for a file that is unreadable, truncated or corrupt.
  std::optional<std::string> read() const;
  // Whether there is a file at path() (one that cannot be read is read()'s error).
  bool exists() const;

 private:
  std::string path_;
  int64_t every_ = 100;
  int64_t written_ = -1;
  std::future<void> writing_;
};

}  // namespace shoal::elastic
