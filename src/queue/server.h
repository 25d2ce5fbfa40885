// `shoal queue serve`: the scheduler's HTTP face (docs/queue.md, "REST API") and, by default, the
// agent of its own host, so that one command makes a single machine a queue.
#pragma once

#include <string>

#include "access.h"
#include "scheduler.h"

namespace shoal::queue {

struct ServeOptions {
  SchedulerOptions scheduler;
  AccessOptions access;     // its state_dir is the scheduler's
  std::string bind_host = "127.0.0.1";  // loopback unless told (docs/queue.md, "Security")
  int port = 7460;          // the users' API; 0: any free port (written to STATE_DIR/address)
  int agent_port = 7461;    // the agents' heartbeats; 0: any (STATE_DIR/agent-address)
  // HTTPS for both ports: "on", "off", or "auto" (on unless bind_host is a loopback address and
  // no tls_cert is given),
  // with the admin's certificate and key or one made in STATE_DIR/tls (src/queue/tls.h).
  std::string tls = "auto";
  std::string tls_cert;
  std::string tls_key;
  bool local_agent = true;  // start (or adopt) the agent of this host
  int local_slots = 0;      // its --slots
  double tick = 0.2;        // seconds between policy rounds
};

// Serves until SIGTERM or SIGINT; then stops the local agent it started (whose workers stop).
// SIGKILLed, it leaves the agents and their workers running (docs/queue.md, "Failures").
int serve(const ServeOptions& options);

// The dashboard page (dashboard.cpp).
const char* dashboard_html();

}  // namespace shoal::queue
