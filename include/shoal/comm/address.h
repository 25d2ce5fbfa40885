// Which local address peers on other hosts reach this process on. No LibTorch here: the queue's
// agent (src/queue) uses it too.
#pragma once

#include <string>

namespace shoal::comm {

// The local IPv4 address on the route to host:port: what peers on other hosts reach this process
// on (shoal::init() binds the world group there). A connected UDP socket sends nothing but makes
// the kernel pick the route. "127.0.0.1" when host does not resolve or has no route.
std::string local_address_towards(const std::string& host, int port);

}  // namespace shoal::comm
