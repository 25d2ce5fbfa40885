// Is anybody there? A TCP connect to each of a round's store addresses, all at once.
#pragma once

#include <string>
#include <vector>

#include "shoal/core/timeout.h"

namespace shoal::elastic::etcd {

// For each "IP:PORT" in `addresses`: true when its host refused the connection, i.e. nothing
// listens there any more: the process that hosted it is gone. False when it accepted, when no
// answer came within `timeout` (a stopped process, a slow network: for the lease to decide) and
// when the address is malformed.
std::vector<bool> refusing(const std::vector<std::string>& addresses, Duration timeout);

}  // namespace shoal::elastic::etcd
