// The `shoal` command: `run` (docs/launch.md), `queue` and `agent` (docs/queue.md). This program
// links no LibTorch, so that the queue's commands and the agent start at once; `run` and the
// parameter servers are `shoal-run`'s, beside this program, which it execs (CMakeLists.txt).
#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "queue/command.h"
#include "proc/process.h"

namespace {

constexpr const char* kUsage =
    "Usage: shoal COMMAND [ARGS...]\n"
    "\n"
    "Commands:\n"
    "  run    Start the workers of a job on this node: shoal run -n N PROGRAM [ARGS...]\n"
    "  queue  The job queue: shoal queue serve|submit|ls|show|cancel|top\n"
    "  agent  A host's agent for the queue: shoal agent --queue HOST:PORT\n"
    "\n"
    "See `shoal run --help` and docs/queue.md.\n";

// `shoal-run` with `argv`, in place of this process (same pid: whoever started `shoal run`
// signals and waits for the launcher itself).
int exec_run(char** argv) {
  char self[PATH_MAX];
  const ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) {
    std::cerr << "shoal: cannot find this program (/proc/self/exe): " << std::strerror(errno)
              << std::endl;
    return 1;
  }
  std::string path(self, static_cast<size_t>(length));
  path = path.substr(0, path.rfind('/') + 1) + "shoal-run";
  ::execv(path.c_str(), argv);
  std::cerr << "shoal: cannot run " << path << " (installed beside shoal for `shoal "
            << argv[1] << "`): " << std::strerror(errno) << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  shoal::proc::keep_standard_streams_open();
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << "shoal: expected a command (run, queue, agent); see shoal --help" << std::endl;
    return 2;
  }
  if (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    std::cout << kUsage;
    return 0;
  }
  // ps-server is internal: the parameter servers that `shoal run --servers` starts (docs/ps.md).
  if (args[0] == "run" || args[0] == "ps-server") return exec_run(argv);
  if (args[0] == "queue") return shoal::queue::queue_command({args.begin() + 1, args.end()});
  if (args[0] == "agent") return shoal::queue::agent_command({args.begin() + 1, args.end()});
  std::cerr << "shoal: unknown command '" << args[0] << "'; expected run, queue or agent (see shoal --help)"
            << std::endl;
  return 2;
}
