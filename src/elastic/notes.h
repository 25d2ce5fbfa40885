// What an elastic worker tells whoever started it (a queue's agent), through files that its
// environment names: that it left on a SIGTERM rather than finished (SHOAL_LEAVE_NOTE; Note [A
// leave is not the end]), and how far the job has trained (SHOAL_PROGRESS_FILE), from which the
// queue measures each job's throughput at each worker count (docs/queue.md, "Throughput").
#pragma once

#include <cstdint>
#include <vector>

#include "shoal/dp/goodput.h"

namespace shoal::elastic {

// Writes "left after step N" to SHOAL_LEAVE_NOTE's file, if set.
void note_leave(int64_t step);

// The job's committed progress, as the first worker sees it at a commit.
struct Progress {
  int64_t version = 0;  // commits so far
  int64_t epoch = 0;
  int64_t samples = 0;  // samples trained on in committed steps, over all epochs
  int world = 1;
  // The gradient noise scale DataParallel measures (samples; 0: not measured), and each worker's
  // batch when it stays as the world changes (0: the global batch stays): what the queue's
  // goodput policy models the job's efficiency from (src/queue/policy.h).
  double noise_scale = 0;
  int64_t batch_per_worker = 0;
  // Under BatchPolicy::goodput(): the limits of its batch (base_batch 0: another policy) and
  // its agreed step times, from which the queue models its speed-up by the job's own rule.
  BatchLimits batch_limits{};
  std::vector<StepSample> steps;
};

// Replaces SHOAL_PROGRESS_FILE's file, if set, with `progress` as one line of JSON and the wall
// clock in milliseconds, written to a temporary name and renamed. At most every `every_ms`
// (`last_ms` keeps the time of the last write); a world change is written at once.
void note_progress(const Progress& progress, int64_t every_ms, int64_t& last_ms, int& last_world);

}  // namespace shoal::elastic
