#include "notes.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace shoal::elastic {

// Note [A leave is not the end]
// A worker that leaves on SIGTERM exits 0, as one whose training finished does: to whoever
// started it, the two look alike. A queue's agent tells them apart by the file that
// SHOAL_LEAVE_NOTE names, which a leave writes before its exit: an exit 0 without it is the
// program's own end (docs/queue.md, "When a job is done").
void note_leave(int64_t step) {
  const char* path = std::getenv("SHOAL_LEAVE_NOTE");
  if (path == nullptr || *path == '\0') return;
  if (std::FILE* file = std::fopen(path, "w")) {
    std::fprintf(file, "left after step %lld\n", static_cast<long long>(step));
    std::fclose(file);
  }
}

void note_progress(const Progress& progress, int64_t every_ms, int64_t& last_ms, int& last_world) {
  const char* path = std::getenv("SHOAL_PROGRESS_FILE");
  if (path == nullptr || *path == '\0') return;
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  if (now - last_ms < every_ms && progress.world == last_world) return;
  last_ms = now;
  last_world = progress.world;
  const std::string temporary = std::string(path) + ".tmp";
  std::FILE* file = std::fopen(temporary.c_str(), "w");
  if (file == nullptr) return;
  std::fprintf(file,
               "{\"version\": %lld, \"epoch\": %lld, \"samples\": %lld, \"world\": %d, "
               "\"time_ms\": %lld, \"noise_scale\": %.6g, \"batch_per_worker\": %lld",
               static_cast<long long>(progress.version), static_cast<long long>(progress.epoch),
               static_cast<long long>(progress.samples), progress.world,
               static_cast<long long>(now),
               std::isfinite(progress.noise_scale) ? progress.noise_scale : 0.0,
               static_cast<long long>(progress.batch_per_worker));
  if (const BatchLimits& limits = progress.batch_limits; limits.base_batch > 0) {
    std::fprintf(
        file,
        ", \"batch\": {\"base\": %lld, \"max\": %lld, \"min_local\": %lld, \"max_local\": %lld, "
        "\"max_accumulation\": %d}, \"steps\": [",
        static_cast<long long>(limits.base_batch), static_cast<long long>(limits.max_batch),
        static_cast<long long>(limits.min_local), static_cast<long long>(limits.max_local),
        limits.max_accumulation);
    for (size_t i = 0; i < progress.steps.size(); ++i) {
      const StepSample& step = progress.steps[i];
      std::fprintf(file, "%s[%d, %.17g, %.17g, %d]", i ? ", " : "", step.world, step.local_batch,
                   step.seconds, step.accumulation);
    }
    std::fprintf(file, "]");
  }
  std::fprintf(file, "}\n");
  const bool written = std::fclose(file) == 0;
  if (written) std::rename(temporary.c_str(), path);
}

}  // namespace shoal::elastic
