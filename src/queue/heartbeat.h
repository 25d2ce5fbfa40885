// What an agent reports in each heartbeat (POST /agent/heartbeat; Note [Desired state] in
// scheduler.h): its host, what runs there and what ended there. The agent (agent.cpp) builds one
// and posts json(report); the server (server.cpp) reads the body back with
// json.get<HeartbeatReport>() before the scheduler sees it. This pair is the one place the
// report's field names are written.
//
// Note [A heartbeat is read whole]
// The scheduler once read the report's JSON field by field as it applied it, so a field missing or
// of the wrong type halfway through raised after the first half was applied: the host's cores
// taken, some workers' ends recorded, the rest not. Now the whole report is read into a
// HeartbeatReport first, and a malformed one is refused (400) with one line that names the field
// and what was expected, before anything changes. Every field the agent sends is required but two:
// `stopping` (agents of before sent it only in their last heartbeat) and a worker's `progress`
// (only a job's first worker writes one). Fields the report does not know are ignored.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shoal/dp/goodput.h"

namespace shoal::queue {

struct HeartbeatReport {
  // A job's progress as its first worker writes it (SHOAL_PROGRESS_FILE, src/elastic/notes.h).
  struct Progress {
    int64_t time_ms = 0;  // the wall clock when it was written
    int64_t samples = 0;  // trained on in committed steps
    int world = 1;
    double noise_scale = 0;        // the gradient noise scale, in samples (0: not measured)
    int64_t batch_per_worker = 0;  // each worker's batch when it stays (0: the global one does)
    // Under BatchPolicy::goodput(): its batch's limits (base_batch 0: another policy) and its
    // step times (src/elastic/notes.h).
    BatchLimits batch_limits{};
    std::vector<StepSample> steps;
  };
  // A worker the agent runs, or one that ended and whose end the scheduler has not yet recorded
  // (the agent reports it until the orders' `forget` lists it).
  struct Worker {
    int64_t id = 0;
    int64_t job = 0;
    int64_t pid = 0;  // -1: it could not start
    bool running = false;
    int64_t started_ms = 0;
    std::string exit;  // how it ended, in words (when not running)
    bool success = false;
    std::optional<Progress> progress;
  };

  std::string host;  // the name the scheduler knows the host by; never empty
  int cores = 1;
  int slots = 0;        // workers the host may run; 0: its cores x the queue's --oversubscribe
  int64_t pid = 0;      // the agent's
  int nudge_port = 0;   // the UDP port the agent takes nudges on (Note [Nudges], server.cpp)
  bool stopping = false;  // its last heartbeat (Note [An agent that stops], agent.cpp)
  std::vector<Worker> workers;
  std::map<int64_t, std::string> members;  // job id -> the agent's membership address for it
};

// The report as the agent posts it.
void to_json(nlohmann::json& out, const HeartbeatReport::Progress& p);
void to_json(nlohmann::json& out, const HeartbeatReport& report);
// UsageError naming the field (its path: "progress.world") and what was expected.
void from_json(const nlohmann::json& in, HeartbeatReport::Progress& p);
// The whole report, or UsageError with one line naming the first field that is missing or of the
// wrong type and what was expected (Note [A heartbeat is read whole]):
//   heartbeat: field 'workers[0].running' is a string; expected true or false
void from_json(const nlohmann::json& in, HeartbeatReport& report);

}  // namespace shoal::queue
