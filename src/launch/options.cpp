#include "options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <utility>

#include <CLI/CLI.hpp>

#include "../ps/mode.h"
#include "proc/process.h"
#include "shoal/core/error.h"
#include "shoal/runtime/job.h"

namespace shoal::launch {
namespace {

// The flags as typed, before validation: CLI11 only splits the command line, so that every
// message about a value is ours and fits on one line.
struct RawFlags {
  std::string nproc = "1";
  std::string nnodes = "1";
  std::string node_rank = "0";
  std::string master;
  std::string master_port;
  std::string connect_timeout = "60";
  std::string min_workers;
  std::string max_workers;
  std::string max_restarts = "0";
  std::string join;
  std::string rendezvous = "gossip";
  std::string token_file;
  std::string last_call = "1";
  std::string rendezvous_timeout = "600";
  std::string checkpoint;
  std::string checkpoint_every;
  std::string servers = "0";
  std::string ps_replicas = "1";
  std::string ps_snapshot_dir;
  std::string ps_snapshot_every = "100";
  std::string ps_backup_workers = "0";
};

// The program and its arguments are split off before CLI11 parses, so CLI11 does not know them;
// the usage line says they are there.
class RunFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: shoal run [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

int parse_int(const std::string& flag, const std::string& text, long min, long max,
              const std::string& expected) {
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0' || value < min || value > max) {
    throw UsageError(flag + ": expected " + expected + ", got '" + text + "'");
  }
  return static_cast<int>(value);
}

Duration parse_seconds(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  double seconds = std::strtod(text.c_str(), &end);
  if (text.empty() || errno != 0 || *end != '\0' || !std::isfinite(seconds) || seconds <= 0 ||
      seconds > 7 * 24 * 3600) {
    throw UsageError(flag + ": expected a positive number of seconds, got '" + text + "'");
  }
  return Duration(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

Duration parse_seconds_or_zero(const std::string& flag, const std::string& text) {
  return text == "0" ? Duration(0) : parse_seconds(flag, text);
}

// Where the launcher's own flags end and the program begins: at `--`, or at the first argument
// that is neither a flag nor a flag's value. Everything from there on belongs to the program,
// even arguments that look like our flags (`shoal run -n 2 ./train -n 5`).
size_t program_start(const CLI::App& app, const std::vector<std::string>& args, bool& has_separator) {
  has_separator = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      has_separator = true;
      return i;
    }
    if (arg.size() < 2 || arg[0] != '-') return i;
    std::string name = arg;
    bool value_attached = false;
    if (arg.compare(0, 2, "--") == 0) {
      auto eq = arg.find('=');
      if (eq != std::string::npos) {
        name = arg.substr(0, eq);
        value_attached = true;
      }
    } else if (arg.size() > 2) {  // -n4
      name = arg.substr(0, 2);
      value_attached = true;
    }
    const CLI::Option* option = app.get_option_no_throw(name);
    if (option == nullptr || option->get_positional()) {
      throw UsageError("unknown flag '" + name + "' (see shoal run --help)");
    }
    if (option->get_expected_min() > 0 && !value_attached) {
      if (i + 1 >= args.size()) throw UsageError(name + " needs a value (see shoal run --help)");
      ++i;
    }
  }
  return args.size();
}

void add_flags(CLI::App& app, RawFlags& raw) {
  app.add_option("-n,--nproc-per-node", raw.nproc, "Workers to start on this node (default 1)")
      ->type_name("N");
  app.add_option("--nnodes", raw.nnodes,
                 "Nodes in the job; run one `shoal run` per node (default 1)")
      ->type_name("K");
  app.add_option("--node-rank", raw.node_rank, "This node's index, 0 to K-1 (default 0)")
      ->type_name("I");
  app.add_option("--master", raw.master,
                 "Address of the job's store, hosted by node 0's launcher; needed when K > 1")
      ->type_name("HOST:PORT");
  app.add_option("--master-port", raw.master_port,
                 "Port of the store on a single node (default: any free port)")
      ->type_name("PORT");
  app.add_option("--connect-timeout", raw.connect_timeout,
                 "How long to wait for node 0 and for all nodes to join (default 60)")
      ->type_name("SECONDS");
  app.add_option("--min", raw.min_workers,
                 "Elastic job: the fewest workers it trains with (waits for them to start)")
      ->type_name("A");
  app.add_option("--max", raw.max_workers, "Elastic job: the most workers it trains with")->type_name("B");
  app.add_option("--max-restarts", raw.max_restarts,
                 "Elastic job: restarts of each worker that fails, with a growing back-off (default 0)")
      ->type_name("R");
  app.add_option("--join", raw.join,
                 "Adds this node's workers to a running elastic job: the address of any of its members "
                 "(gossip), or its run id (etcd)")
      ->type_name("HOST:PORT|RUN_ID");
  app.add_option("--rendezvous", raw.rendezvous,
                 "Elastic job: how workers find each other: gossip among the job's processes (default), "
                 "or an etcd server")
      ->type_name("gossip|etcd://HOST:PORT");
  app.add_option("--token-file", raw.token_file,
                 "Elastic job: where the job's token is written (mode 600), or read with --join")
      ->type_name("PATH");
  app.add_flag("--quorum", "Elastic job: a round goes on only with a majority of the previous one");
  app.add_option("--last-call", raw.last_call,
                 "Elastic job: how long a round waits for more workers once --min are there (default 1)")
      ->type_name("SECONDS");
  app.add_option("--rendezvous-timeout", raw.rendezvous_timeout,
                 "Elastic job: how long a worker waits for a round to close (default 600)")
      ->type_name("SECONDS");
  app.add_option("--checkpoint", raw.checkpoint,
                 "Elastic job: keep its commit on disk too, at PATH, so that a job whose every "
                 "worker died resumes from it (SHOAL_CHECKPOINT)")
      ->type_name("PATH");
  app.add_option("--checkpoint-every", raw.checkpoint_every,
                 "Elastic job: write --checkpoint every N commits (default 100, and at the end)")
      ->type_name("N");
  app.add_flag("--tag-output", "Prefix each output line with \"[RANK] \" (the default when the "
               "job has more than one worker)");
  app.add_flag("--no-tag-output", "Forward output lines as they are");
  app.add_option("--servers", raw.servers,
                 "Parameter servers to start before the workers (default 0; docs/ps.md)")
      ->type_name("S");
  app.add_option("--ps-replicas", raw.ps_replicas,
                 "Processes per parameter server: 1 (default) or 2, a primary and a backup that "
                 "takes over when it dies (docs/ps.md)")
      ->type_name("R");
  app.add_option("--ps-snapshot-dir", raw.ps_snapshot_dir,
                 "Parameter servers write their shards to DIR every --ps-snapshot-every steps "
                 "(docs/ps.md)")
      ->type_name("DIR");
  app.add_option("--ps-snapshot-every", raw.ps_snapshot_every,
                 "Steps between the parameter servers' snapshots (default 100)")
      ->type_name("K");
  app.add_option("--ps-backup-workers", raw.ps_backup_workers,
                 "Sync parameter servers apply each step with the first N - B workers' gradients; "
                 "a late one's samples go back into the epoch (default 0; docs/ps.md)")
      ->type_name("B");
}

// See docs/ps.md, "Processes".
void validate_servers(const RawFlags& raw, const CLI::App& app, LaunchOptions& options) {
  options.servers =
      parse_int("--servers", raw.servers, 0, 1024, "a number of servers from 0 to 1024");
  options.ps_replicas = parse_int("--ps-replicas", raw.ps_replicas, 1, 2,
                                  "1 or 2 processes per parameter server");
  options.ps_snapshot_every = parse_int("--ps-snapshot-every", raw.ps_snapshot_every, 1,
                                        1 << 30, "a number of steps from 1");
  options.ps_snapshot_dir = raw.ps_snapshot_dir;
  options.ps_backup_workers = parse_int("--ps-backup-workers", raw.ps_backup_workers, 0, 1 << 20,
                                        "a number of workers from 0");
  if (options.servers == 0) {
    if (options.ps_replicas != 1) throw UsageError("--ps-replicas needs --servers S; add it");
    if (options.ps_backup_workers != 0)
      throw UsageError("--ps-backup-workers needs --servers S; add it");
    if (!raw.ps_snapshot_dir.empty()) {
      throw UsageError("--ps-snapshot-dir needs --servers S; add it");
    }
    return;
  }
  ps::mode_from_environment();  // a bad SHOAL_PS_MODE is refused before any server starts
  if (options.ps_backup_workers > 0) {
    // docs/ps.md, "Consistency": TensorFlow's SyncReplicasOptimizer's replicas_to_aggregate.
    if (options.elastic) {
      throw UsageError("--ps-backup-workers is not supported with elastic workers (--min/--max) "
                       "yet; drop one of them");
    }
    if (options.ps_backup_workers >= options.world_size()) {
      throw UsageError("--ps-backup-workers " + std::to_string(options.ps_backup_workers) +
                       " leaves no worker to aggregate; expected fewer than the job's " +
                       std::to_string(options.world_size()) + " workers");
    }
    if (ps::mode_from_environment().kind != ps::Mode::kSync) {
      throw UsageError("--ps-backup-workers is for sync parameter servers; SHOAL_PS_MODE is " +
                       std::string(std::getenv("SHOAL_PS_MODE")) + " (unset it, or set it to sync)");
    }
  }
  if (options.elastic) {
    // docs/ps.md, "Elastic workers": the servers are the job's membership; one launcher.
    if (!options.join_run_id.empty()) {
      throw UsageError("--join RUN_ID is for elastic all-reduce jobs on etcd; a job with --servers "
                       "is joined at the address its first shoal run printed (--join HOST:PORT)");
    }
    for (const char* flag : {"--rendezvous", "--quorum", "--last-call", "--rendezvous-timeout", "--checkpoint",
                             "--checkpoint-every", "--token-file"}) {
      if (app.count(flag) > 0) {
        throw UsageError(std::string(flag) +
                         " is for elastic all-reduce jobs; a job with --servers keeps its state "
                         "on the servers (drop it)");
      }
    }
    if (options.ps_replicas > 1 || !options.ps_snapshot_dir.empty()) {
      throw UsageError(std::string(options.ps_replicas > 1 ? "--ps-replicas" : "--ps-snapshot-dir") +
                       " is not supported with elastic workers (--min/--max) yet; drop one of them");
    }
  }
}

// See docs/elastic.md, "shoal run for elastic jobs".
void validate_elastic(const RawFlags& raw, const CLI::App& app, LaunchOptions& options) {
  const bool has_min = app.count("--min") > 0;
  const bool has_max = app.count("--max") > 0;
  const bool joins = app.count("--join") > 0;
  for (const char* flag :
       {"--max-restarts", "--token-file", "--quorum", "--last-call", "--rendezvous-timeout", "--rendezvous",
        "--checkpoint", "--checkpoint-every"}) {
    if (app.count(flag) > 0 && !has_min && !has_max && !joins) {
      throw UsageError(std::string(flag) + " is for elastic jobs; add --min A --max B (or --join HOST:PORT)");
    }
  }
  if (!has_min && !has_max && !joins) return;
  if (options.nnodes > 1 || app.count("--node-rank") > 0) {
    throw UsageError("--nnodes/--node-rank are for static jobs; an elastic job grows with --join HOST:PORT");
  }
  if (joins) {
    if (has_min || has_max || app.count("--quorum") > 0) {
      throw UsageError("--join takes the job's --min, --max and --quorum from the job itself; drop them");
    }
  }
  if (raw.rendezvous != "gossip") {
    const std::string scheme = "etcd://";
    if (raw.rendezvous.compare(0, scheme.size(), scheme) != 0) {
      throw UsageError("--rendezvous " + raw.rendezvous + " is not a rendezvous backend; expected gossip or "
                       "etcd://HOST:PORT");
    }
    options.etcd = raw.rendezvous.substr(scheme.size());
    parse_host_port(options.etcd, "--rendezvous etcd://");
  }
  if (joins && !options.etcd.empty()) {
    if (raw.join.empty() || raw.join.find_first_of(":/ ") != std::string::npos) {
      throw UsageError("--join '" + raw.join + "': with --rendezvous etcd:// it takes the job's run id, which its "
                       "first shoal run printed");
    }
    options.join_run_id = raw.join;
  } else if (joins) {
    std::tie(options.join_host, options.join_port) = parse_host_port(raw.join, "--join");
  } else {
    if (has_min != has_max) {
      throw UsageError(std::string(has_min ? "--min" : "--max") + " needs " + (has_min ? "--max" : "--min") +
                       ": an elastic job is started with both");
    }
    options.min_workers = parse_int("--min", raw.min_workers, 1, 1 << 20, "a number of workers from 1");
    options.max_workers = parse_int("--max", raw.max_workers, 1, 1 << 20, "a number of workers from 1");
    if (options.min_workers > options.max_workers) {
      throw UsageError("--min " + std::to_string(options.min_workers) + " is more than --max " +
                       std::to_string(options.max_workers) + ": expected min <= max");
    }
    if (app.count("--nproc-per-node") == 0) {
      options.nproc_per_node = options.min_workers;
    } else if (options.nproc_per_node > options.max_workers) {
      throw UsageError("-n " + std::to_string(options.nproc_per_node) + " is more than --max " +
                       std::to_string(options.max_workers) + ": the job could not take them all");
    }
    options.quorum = app.count("--quorum") > 0;
  }
  options.elastic = true;
  options.max_restarts = parse_int("--max-restarts", raw.max_restarts, 0, 1 << 20, "a number of restarts from 0");
  options.token_file = raw.token_file;
  options.last_call = parse_seconds_or_zero("--last-call", raw.last_call);
  options.rendezvous_timeout = parse_seconds("--rendezvous-timeout", raw.rendezvous_timeout);
  if (app.count("--checkpoint-every") > 0 && raw.checkpoint.empty()) {
    throw UsageError("--checkpoint-every needs --checkpoint PATH: where the commits are kept");
  }
  options.checkpoint = raw.checkpoint;
  if (app.count("--checkpoint-every") > 0) {
    options.checkpoint_every = parse_int("--checkpoint-every", raw.checkpoint_every, 1, 1 << 30, "a number of commits from 1");
  }
}

LaunchOptions validate(const RawFlags& raw, const CLI::App& app) {
  LaunchOptions options;
  options.nproc_per_node = parse_int("-n/--nproc-per-node", raw.nproc, 1, 1024,
                                     "a number of workers from 1 to 1024");
  options.nnodes = parse_int("--nnodes", raw.nnodes, 1, 65536, "a positive number of nodes");
  options.node_rank = parse_int("--node-rank", raw.node_rank, 0, 65535, "an integer from 0");
  if (options.node_rank >= options.nnodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) + " is out of range for --nnodes " +
                     std::to_string(options.nnodes) + ": expected 0 to " +
                     std::to_string(options.nnodes - 1));
  }
  const bool has_master = app.count("--master") > 0;
  const bool has_port = app.count("--master-port") > 0;
  if (has_master && has_port) {
    throw UsageError("--master HOST:PORT already gives the port; drop --master-port");
  }
  if (has_master) {
    std::tie(options.master_host, options.master_port) = parse_host_port(raw.master, "--master");
    if (options.master_host.empty()) throw UsageError("--master='" + raw.master + "' has no host");
    options.master_described_as = "--master";
  } else if (options.nnodes > 1) {
    throw UsageError("--nnodes " + std::to_string(options.nnodes) +
                     " needs --master HOST:PORT, the address where node 0 hosts the job's store");
  }
  if (has_port) {
    options.master_port = parse_int("--master-port", raw.master_port, 0, 65535,
                                    "a port from 1 to 65535, or 0 for any free port");
  }
  options.connect_timeout = parse_seconds("--connect-timeout", raw.connect_timeout);
  const bool tag = app.count("--tag-output") > 0;
  const bool no_tag = app.count("--no-tag-output") > 0;
  if (tag && no_tag) throw UsageError("--tag-output and --no-tag-output contradict each other");
  if (tag || no_tag) options.tag_output = tag;
  validate_elastic(raw, app, options);
  validate_servers(raw, app, options);
  return options;
}

}  // namespace

std::optional<LaunchOptions> parse_run_command(const std::vector<std::string>& args,
                                               std::ostream& help_out) {
  CLI::App app("Starts N workers running PROGRAM [ARGS...] on this node, hosts (node 0) or joins "
               "the job's store, forwards their output and signals, and stops them all when one "
               "fails. PROGRAM is found on PATH as a shell would.",
               "shoal run");
  app.footer("Workers get SHOAL_RANK, SHOAL_WORLD_SIZE, ... and torchrun's RANK, WORLD_SIZE, "
             "MASTER_ADDR, ...; see docs/launch.md.");
  auto formatter = std::make_shared<RunFormatter>();
  formatter->column_width(30);
  app.formatter(formatter);
  RawFlags raw;
  add_flags(app, raw);

  bool has_separator = false;
  const size_t start = program_start(app, args, has_separator);
  std::vector<std::string> flags(args.begin(), args.begin() + static_cast<long>(start));
  std::vector<std::string> program(args.begin() + static_cast<long>(start + (has_separator ? 1 : 0)),
                                   args.end());
  try {
    // CLI11 consumes its argument vector from the back.
    std::vector<std::string> reversed(flags.rbegin(), flags.rend());
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    help_out << app.help();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    std::string message = e.what();
    for (char& c : message) {
      if (c == '\n') c = ' ';
    }
    throw UsageError(message);
  }

  LaunchOptions options = validate(raw, app);
  if (program.empty()) {
    throw UsageError("no program given; usage: shoal run [OPTIONS] PROGRAM [ARGS...]");
  }
  options.program = program.front();
  options.program_path = proc::resolve_program(options.program);
  options.program_args.assign(program.begin() + 1, program.end());
  return options;
}

}  // namespace shoal::launch
