// How shoal::init() turns the timeline on and names its track. Internal to shoal; programs
// only record (shoal/core/timeline.h).
#pragma once

#include <optional>
#include <string>

#include "shoal/core/env.h"
#include "shoal/core/timeline.h"

namespace shoal::timeline {

// For shoal::init(). Reads SHOAL_TIMELINE (the file) and SHOAL_TIMELINE_MAX_EVENTS (the cap per
// worker) from `env`; does nothing when SHOAL_TIMELINE is unset or empty. `job` identifies the
// run across its workers: a file whose header names another job is replaced, one naming this job
// is appended to. "" means a run of this process alone; nullopt that set_job() will name it (no
// event is written before). A file that cannot be opened for writing raises UsageError naming it.
// `role` names the process's track ("worker R", or "server R" for a parameter server, whose
// tracks sort after the workers').
void start(const env::Environment& env, int rank, const std::optional<std::string>& job,
           const char* role = "worker");
void set_job(const std::string& job);
// The worker's rank, after an elastic job re-formed its world: names the track.
void set_rank(int rank);

}  // namespace shoal::timeline
