// `shoal agent`: one per host. It reports to the scheduler every half second and runs the
// workers the reply lists (Note [Desired state] in scheduler.h): it starts them with the
// environment of an elastic job, tells those asked to leave (SIGTERM: they leave at their next
// commit), stops those no longer listed, and reports each one's end. For every job with workers
// here it is a member of the job's gossip membership, through which its workers find the job, as
// `shoal run`'s launcher is. How a worker is started, signalled and watched is its engine's
// (engine.h): forked here (local/), or a Slurm job on one node (slurm/). See docs/queue.md,
// "Agents", and docs/queue.md, "Slurm".
#pragma once

#include <string>
#include <vector>

namespace shoal::queue {

struct AgentOptions {
  std::string queue_host;
  int queue_port = 0;
  std::string queue_address;  // [https://]HOST:PORT of the scheduler's agents' port
  std::string ca_file;        // with https: the scheduler's certificate
  std::string token;
  std::string host;  // the name the scheduler knows this host by; default: the host name
                     // (with Slurm: the node's name)
  int slots = 0;     // workers this host may run; 0: the engine's (local: cores x the
                     // queue's oversubscription; Slurm: the node's CPUs)
  std::string dir;   // workers' logs and the jobs' token files
  std::string engine = "local";  // "local" or "slurm"
  std::string slurm_node;        // with Slurm: the node this agent speaks for
  std::string partition;         // with Slurm: the partition to submit to ("": Slurm's default)
  bool allow_root_workers = false;  // start workers of jobs that run as root
};

// Runs until SIGTERM or SIGINT, then stops its workers (SIGTERM, then SIGKILL after 10 s) and
// returns 0. Local workers die with it if it is SIGKILLed (PR_SET_PDEATHSIG); Slurm jobs do not
// (docs/queue.md, "Slurm", "Assumptions").
int run_agent(const AgentOptions& options);

}  // namespace shoal::queue
