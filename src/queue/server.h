// `shoal queue serve`: the scheduler's HTTP face (docs/queue.md, "REST API") and, by default, the
// agent of its own host, so that one command makes a single machine a queue.
#pragma once

#include <string>

#include "scheduler.h"

namespace shoal::queue {

struct ServeOptions {
  SchedulerOptions scheduler;
  std::string bind_host = "127.0.0.1";  // loopback unless told (docs/queue.md, "Security")
  int port = 7460;          // 0: any free port (written to STATE_DIR/address either way)
  std::string token_file;   // default STATE_DIR/token, made on first start (mode 600)
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
