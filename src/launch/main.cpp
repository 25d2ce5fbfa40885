// The `shoal` command: `run` (docs/launch.md), `queue` and `agent` (docs/queue.md).
#include <fcntl.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "launcher.h"
#include "options.h"
#include "ps_server.h"
#include "../queue/command.h"
#include "shoal/core/error.h"

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

// Errors are one line: scripts and people grep the first line of stderr.
std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

int run_command(const std::vector<std::string>& args) {
  try {
    auto options = shoal::launch::parse_run_command(args, std::cout);
    if (!options) return 0;  // --help
    shoal::launch::Launcher launcher(std::move(*options));
    return launcher.run();
  } catch (const shoal::UsageError& e) {
    std::cerr << "shoal run: " << one_line(e.what()) << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shoal run: " << one_line(e.what()) << std::endl;
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // With stdin, stdout or stderr closed, the next pipe would take its number and worker output
  // would go astray.
  int fd;
  while ((fd = ::open("/dev/null", O_RDWR)) >= 0 && fd <= 2) {
  }
  if (fd > 2) ::close(fd);
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << "shoal: expected a command (run, queue, agent); see shoal --help" << std::endl;
    return 2;
  }
  if (args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (args[0] == "run") return run_command({args.begin() + 1, args.end()});
  if (args[0] == "queue") return shoal::queue::queue_command({args.begin() + 1, args.end()});
  if (args[0] == "agent") return shoal::queue::agent_command({args.begin() + 1, args.end()});
  // Internal: the parameter servers that `shoal run --servers` starts (docs/ps.md).
  if (args[0] == "ps-server") {
    return shoal::launch::ps_server_command({args.begin() + 1, args.end()});
  }
  std::cerr << "shoal: unknown command '" << args[0] << "'; expected run, queue or agent (see shoal --help)"
            << std::endl;
  return 2;
}
