// `shoal-run`: the half of the `shoal` command that needs LibTorch, `shoal run` (docs/launch.md)
// and the parameter servers it starts (`shoal ps-server`, docs/ps.md). `shoal` execs it for
// those commands (main.cpp), so users never name it.
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "launcher.h"
#include "options.h"
#include "proc/process.h"
#include "ps_server.h"
#include "shoal/core/error.h"

namespace {

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
  shoal::proc::keep_standard_streams_open();
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0] == "run") return run_command({args.begin() + 1, args.end()});
  // The parameter servers that `shoal run --servers` starts (docs/ps.md).
  if (!args.empty() && args[0] == "ps-server") {
    return shoal::launch::ps_server_command({args.begin() + 1, args.end()});
  }
  std::cerr << "shoal-run: expected run or ps-server; run it as `shoal run` (see shoal --help)"
            << std::endl;
  return 2;
}
