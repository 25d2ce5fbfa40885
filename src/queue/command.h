// The command line of the queue (docs/queue.md): `shoal queue ...` and `shoal agent ...`.
// Bad flags give one line on stderr and exit code 2.
#pragma once

#include <string>
#include <vector>

namespace shoal::queue {

int queue_command(const std::vector<std::string>& args);
int agent_command(const std::vector<std::string>& args);

}  // namespace shoal::queue
