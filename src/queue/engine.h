// How an agent runs its workers. The agent (agent.cpp) decides what runs, from the scheduler's
// orders; an engine only starts, signals and watches. local/engine.h forks the workers on this
// host; slurm/engine.h submits each as a Slurm job to one node (docs/queue.md, "Slurm").
//
// The contract: every worker that start() accepted is reported by poll() exactly once as ended,
// whatever happens to it; its pid, when start() did not know it, is reported once its program
// runs, which with Slurm may be after a wait in Slurm's queue. Calls come from the agent's one
// loop, never at once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "access.h"

namespace shoal::queue {

// One worker to run.
struct WorkerLaunch {
  int64_t worker = 0;
  int64_t job = 0;
  int priority = 0;               // the job's priority in the queue (higher first)
  std::vector<std::string> argv;  // argv[0]: the program, an absolute path
  std::vector<std::string> env;   // "NAME=value": the program's whole environment
  std::string cwd;
  std::string log;  // the program's stdout and stderr, appended
  // The Unix user to run it as when it is not the agent's (the agent is then root): the engine
  // starts the program as that user (docs/queue.md, "Security"). Unset: as the agent's user.
  std::optional<UnixUser> user;
};

// What became of a started worker since the last poll.
struct WorkerChange {
  int64_t worker = 0;
  int64_t pid = 0;  // the program's process id once it runs; 0 while it waits to start
  bool ended = false;
  std::string exit;  // when ended: "exited with code 0", "was killed by signal 9 (SIGKILL)", ...
  bool success = false;
};

// What the agent reports for its host when --slots is not given.
struct Capacity {
  int cores = 1;
  int slots = 0;  // 0: the scheduler's default, cores x its --oversubscribe
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual Capacity capacity() const = 0;

  // Starts the worker, or raises an Error with one line saying why it cannot; the agent reports
  // that line as the worker's failure. Returns the program's pid, or 0 when it is yet to run.
  virtual int64_t start(const WorkerLaunch& launch) = 0;

  // Sends `signal` to the worker's program: SIGTERM asks an elastic worker to leave at its next
  // commit, SIGKILL ends it. A worker that has ended is left alone.
  virtual void signal(int64_t worker, int signal) = 0;

  // The workers whose program started or ended since the last call. An ended worker is then
  // forgotten by the engine.
  virtual std::vector<WorkerChange> poll() = 0;
};

}  // namespace shoal::queue
