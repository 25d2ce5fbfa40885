// save and load's collective halves: who writes, who reads, how every worker learns the outcome
// (checkpoint.cpp), also for models that no one worker holds whole (whole.cpp). Private to
// src/checkpoint.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "shoal/comm/group.h"
#include "shoal/core/timeout.h"

namespace shoal::checkpoint {

// The group of a save or load (options.group or the world), after checking the path.
comm::Group checkpoint_group(const std::optional<comm::Group>& group, const std::string& path,
                             const char* operation);

// The group's first worker writes `path` atomically with the payload make_payload() returns (it
// alone calls it); every worker returns once it is written, or raises its UsageError.
void save_payload(const std::string& path, comm::Group& group,
                  const std::function<std::string()>& make_payload, Duration timeout);

// The verified payload of `path`, read by the first worker and sent to all; UsageError on every
// worker when it can't be read or is truncated or corrupt.
std::string read_payload(const std::string& path, comm::Group& group, Duration timeout);

// Every worker learns whether all can go on before any changes anything: when some worker's
// `error` is not empty, the first such worker's message is raised as a UsageError on every worker.
void agree(comm::Group& group, std::string error, Duration timeout);

}  // namespace shoal::checkpoint
