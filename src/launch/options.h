// What `shoal run` was asked to do, parsed from its command line. See docs/launch.md.
#pragma once

#include <chrono>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "shoal/core/timeout.h"

namespace shoal::launch {

struct LaunchOptions {
  int nproc_per_node = 1;  // -n: workers on this node
  int nnodes = 1;
  int node_rank = 0;

  // The job's store. Node 0 hosts it on master_port (0: any free port, single node only) and
  // every worker connects to master_host; an empty master_host means 127.0.0.1.
  std::string master_host;
  int master_port = 0;
  // The flag the address came from, so errors speak in the user's terms.
  std::string master_described_as = "--master-port";

  // How long a launcher of node k > 0 waits for node 0's store, and how long the launchers wait
  // for every node to join.
  Duration connect_timeout = std::chrono::seconds(60);
  // After SIGTERM, how long workers have before SIGKILL.
  Duration stop_grace = std::chrono::seconds(3);

  std::optional<bool> tag_output;  // unset: tag when the job has more than one worker

  // Elastic jobs (--min/--max, or --join): see docs/elastic.md.
  bool elastic = false;
  int min_workers = 0;  // unset (0) for --join: the job's own apply
  int max_workers = 0;
  bool quorum = false;
  int max_restarts = 0;
  std::string join_host;  // --join HOST:PORT (gossip): a member of the running job
  int join_port = 0;
  std::string etcd;         // --rendezvous etcd://HOST:PORT: "HOST:PORT"; empty for gossip
  std::string join_run_id;  // --join RUN_ID (etcd): the job's run id
  std::string token_file;  // where the token is written (or read, with --join); empty: default
  Duration last_call = std::chrono::seconds(1);
  Duration rendezvous_timeout = std::chrono::seconds(600);
  // --checkpoint PATH / --checkpoint-every N: durable commits, passed to the workers as
  // SHOAL_CHECKPOINT / SHOAL_CHECKPOINT_EVERY (docs/elastic.md). Empty / 0: not set here.
  std::string checkpoint;
  int checkpoint_every = 0;

  // --servers S: parameter servers (`shoal ps-server`) started before the workers and stopped
  // after them (docs/ps.md, "Processes"). Single-node static jobs only, for now.
  int servers = 0;
  // --ps-replicas R: processes per server index, 1 or 2 (a primary and its backup; docs/ps.md,
  // "Replicas and snapshots").
  int ps_replicas = 1;
  // --ps-snapshot-dir DIR / --ps-snapshot-every K: the servers write their shards to DIR every K
  // steps (docs/ps.md, "Replicas and snapshots"). Empty: no snapshots.
  std::string ps_snapshot_dir;
  int ps_snapshot_every = 100;
  // --ps-backup-workers B: a sync step applies the first world_size() - B pushes (docs/ps.md,
  // "Consistency").
  int ps_backup_workers = 0;

  std::string program;  // as given (for messages)
  std::string program_path;  // resolved against PATH; what is executed
  std::vector<std::string> program_args;

  int world_size() const { return nnodes * nproc_per_node; }
  bool tags_output() const { return tag_output.value_or(elastic || world_size() > 1); }
  bool joins() const { return !join_host.empty() || !join_run_id.empty(); }
  bool hosts_store() const { return node_rank == 0; }
  // The address workers (and other nodes' launchers) connect to.
  std::string master_addr() const { return master_host.empty() ? "127.0.0.1" : master_host; }
};

// Parses the arguments after `shoal run`. Returns nullopt when help was asked for (and printed
// to help_out). Raises UsageError with a one-line message for anything wrong, including a
// program that does not exist or cannot be executed.
std::optional<LaunchOptions> parse_run_command(const std::vector<std::string>& args,
                                               std::ostream& help_out);

}  // namespace shoal::launch
