#include "options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <utility>

#include <CLI/CLI.hpp>

#include "ps/serve.h"
#include "proc/process.h"
#include "runtime/job_discovery.h"
#include "shoal/core/error.h"

namespace shoal::launch {
namespace {

// Note [Flags through CLI11's validators]
// CLI11 converts each flag to its type after running the flag's validators over its text, and a
// validator's message reaches the user as "NAME: MESSAGE", NAME being the flag's long name. So
// shoal's validators return only "expected ..., got '...'", and a bad value reads
// "--servers: expected a number of servers from 0 to 1024, got '-1'", one line, as every usage
// error of shoal's. A validator sees one flag; what needs two (--min <= --max, --node-rank below
// --nnodes) or depends on another (--join's text on --rendezvous) is checked in validate(), after
// every flag's value has passed its own.

// An integer from min to max, written in decimal. A transform: CLI11 2.1 reads integers with
// strtoll's base 0, where "010" is 8 and "0x10" is 16, so the text accepted here is rewritten as
// the decimal CLI11 then converts.
CLI::Validator whole_number(long min, long max, const std::string& expected) {
  return CLI::Validator(
      [min, max, expected](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long value = std::strtol(text.c_str(), &end, 10);
        if (text.empty() || errno != 0 || *end != '\0' || value < min || value > max) {
          return "expected " + expected + ", got '" + text + "'";
        }
        text = std::to_string(value);
        return {};
      },
      "");  // no description: --help shows the flags' own type names
}

// A number of seconds above 0 and at most a week (or exactly "0" where zero_allowed: no wait).
CLI::Validator duration_in_seconds(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& text) -> std::string {
        if (zero_allowed && text == "0") return {};
        errno = 0;
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        if (text.empty() || errno != 0 || *end != '\0' || !std::isfinite(value) || value <= 0 ||
            value > 7 * 24 * 3600) {
          return "expected a positive number of seconds, got '" + text + "'";
        }
        return {};
      },
      "");
}

Duration from_seconds(double seconds) {
  return Duration(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

// The flags whose text is read after parsing: runtime's parse_host_port reads the addresses (its
// messages quote the text, "--master='host' has no port; ..."), and --join means a member's
// address or a run id depending on --rendezvous.
struct AddressFlags {
  std::string master;
  std::string join;
  std::string rendezvous = "gossip";
};

// The program and its arguments are split off before CLI11 parses, so CLI11 does not know them;
// the usage line says they are there.
class RunFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: shoal run [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

// The arguments after `shoal run`, split where the program begins.
struct CommandLine {
  std::vector<std::string> flags;    // the launcher's own
  std::vector<std::string> program;  // PROGRAM [ARGS...]
  // -h or --help among the flags. Help is printed before CLI11 parses: CLI11 runs the validators
  // before it looks for help, and `shoal run -n 0 --help` prints help.
  bool asks_help = false;
};

// The launcher's own flags end at `--`, or at the first argument that is neither a flag nor a
// flag's value. Everything from there on belongs to the program, even arguments that look like
// our flags (`shoal run -n 2 ./train -n 5`).
CommandLine split_command_line(const CLI::App& app, const std::vector<std::string>& args) {
  CommandLine line;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      line.flags.assign(args.begin(), args.begin() + static_cast<long>(i));
      line.program.assign(args.begin() + static_cast<long>(i + 1), args.end());
      return line;
    }
    if (arg.size() < 2 || arg[0] != '-') break;
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
    if (option == app.get_help_ptr() && !value_attached) line.asks_help = true;
    if (option->get_expected_min() > 0 && !value_attached) {
      if (i + 1 >= args.size()) throw UsageError(name + " needs a value (see shoal run --help)");
      ++i;
    }
  }
  line.flags.assign(args.begin(), args.begin() + static_cast<long>(i));
  line.program.assign(args.begin() + static_cast<long>(i), args.end());
  return line;
}

// The flags, parsed into options (and addresses) by CLI11 through their validators; see
// Note [Flags through CLI11's validators]. A flag that is not given keeps options' default.
void add_flags(CLI::App& app, LaunchOptions& options, AddressFlags& addresses) {
  app.add_option("-n,--nproc-per-node", options.nproc_per_node,
                 "Workers to start on this node (default 1)")
      ->transform(whole_number(1, 1024, "a number of workers from 1 to 1024"))
      ->type_name("N");
  app.add_option("--nnodes", options.nnodes,
                 "Nodes in the job; run one `shoal run` per node (default 1)")
      ->transform(whole_number(1, 65536, "a positive number of nodes"))
      ->type_name("K");
  app.add_option("--node-rank", options.node_rank, "This node's index, 0 to K-1 (default 0)")
      ->transform(whole_number(0, 65535, "an integer from 0"))
      ->type_name("I");
  app.add_option("--master", addresses.master,
                 "Address of the job's store, hosted by node 0's launcher; needed when K > 1")
      ->type_name("HOST:PORT");
  app.add_option("--master-port", options.master_port,
                 "Port of the store on a single node (default: any free port)")
      ->transform(whole_number(0, 65535, "a port from 1 to 65535, or 0 for any free port"))
      ->type_name("PORT");
  app.add_option_function<double>(
         "--connect-timeout", [&options](double s) { options.connect_timeout = from_seconds(s); },
         "How long to wait for node 0 and for all nodes to join (default 60)")
      ->check(duration_in_seconds(false))
      ->type_name("SECONDS");
  app.add_option("--min", options.min_workers,
                 "Elastic job: the fewest workers it trains with (waits for them to start)")
      ->transform(whole_number(1, 1 << 20, "a number of workers from 1"))
      ->type_name("A");
  app.add_option("--max", options.max_workers, "Elastic job: the most workers it trains with")
      ->transform(whole_number(1, 1 << 20, "a number of workers from 1"))
      ->type_name("B");
  app.add_option(
         "--max-restarts", options.max_restarts,
         "Elastic job: restarts of each worker that fails, with a growing back-off (default 0)")
      ->transform(whole_number(0, 1 << 20, "a number of restarts from 0"))
      ->type_name("R");
  app.add_option(
         "--join", addresses.join,
         "Adds this node's workers to a running elastic job: the address of any of its members "
         "(gossip), or its run id (etcd)")
      ->type_name("HOST:PORT|RUN_ID");
  app.add_option(
         "--rendezvous", addresses.rendezvous,
         "Elastic job: how workers find each other: gossip among the job's processes (default), "
         "or an etcd server")
      ->type_name("gossip|etcd://HOST:PORT");
  app.add_option("--token-file", options.token_file,
                 "Elastic job: where the job's token is written (mode 600), or read with --join")
      ->type_name("PATH");
  app.add_flag("--quorum", "Elastic job: a round goes on only with a majority of the previous one");
  app.add_option_function<double>(
         "--last-call", [&options](double s) { options.last_call = from_seconds(s); },
         "Elastic job: how long a round waits for more workers once --min are there (default 1)")
      ->check(duration_in_seconds(true))
      ->type_name("SECONDS");
  app.add_option_function<double>(
         "--rendezvous-timeout",
         [&options](double s) { options.rendezvous_timeout = from_seconds(s); },
         "Elastic job: how long a worker waits for a round to close (default 600)")
      ->check(duration_in_seconds(false))
      ->type_name("SECONDS");
  app.add_option("--checkpoint", options.checkpoint,
                 "Elastic job: keep its commit on disk too, at PATH, so that a job whose every "
                 "worker died resumes from it (SHOAL_CHECKPOINT)")
      ->type_name("PATH");
  app.add_option("--checkpoint-every", options.checkpoint_every,
                 "Elastic job: write --checkpoint every N commits (default 100, and at the end)")
      ->transform(whole_number(1, 1 << 30, "a number of commits from 1"))
      ->type_name("N");
  app.add_flag("--tag-output", "Prefix each output line with \"[RANK] \" (the default when the "
               "job has more than one worker)");
  app.add_flag("--no-tag-output", "Forward output lines as they are");
  app.add_option("--servers", options.servers,
                 "Parameter servers to start before the workers (default 0; docs/ps.md)")
      ->transform(whole_number(0, 1024, "a number of servers from 0 to 1024"))
      ->type_name("S");
  app.add_option("--ps-replicas", options.ps_replicas,
                 "Processes per parameter server: 1 (default) or 2, a primary and a backup that "
                 "takes over when it dies (docs/ps.md)")
      ->transform(whole_number(1, 2, "1 or 2 processes per parameter server"))
      ->type_name("R");
  app.add_option("--ps-snapshot-dir", options.ps_snapshot_dir,
                 "Parameter servers write their shards to DIR every --ps-snapshot-every steps "
                 "(docs/ps.md)")
      ->type_name("DIR");
  app.add_option("--ps-snapshot-every", options.ps_snapshot_every,
                 "Steps between the parameter servers' snapshots (default 100)")
      ->transform(whole_number(1, 1 << 30, "a number of steps from 1"))
      ->type_name("K");
  app.add_option("--ps-backup-workers", options.ps_backup_workers,
                 "Sync parameter servers apply each step with the first N - B workers' gradients; "
                 "a late one's samples go back into the epoch (default 0; docs/ps.md)")
      ->transform(whole_number(0, 1 << 20, "a number of workers from 0"))
      ->type_name("B");
}

// See docs/ps.md, "Processes".
void validate_servers(const CLI::App& app, LaunchOptions& options) {
  if (options.servers == 0) {
    if (options.ps_replicas != 1) throw UsageError("--ps-replicas needs --servers S; add it");
    if (options.ps_backup_workers != 0)
      throw UsageError("--ps-backup-workers needs --servers S; add it");
    if (!options.ps_snapshot_dir.empty()) {
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
void validate_elastic(const AddressFlags& addresses, const CLI::App& app, LaunchOptions& options) {
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
  const std::string& rendezvous = addresses.rendezvous;
  if (rendezvous != "gossip") {
    const std::string scheme = "etcd://";
    if (rendezvous.compare(0, scheme.size(), scheme) != 0) {
      throw UsageError("--rendezvous " + rendezvous +
                       " is not a rendezvous backend; expected gossip or "
                       "etcd://HOST:PORT");
    }
    options.etcd = rendezvous.substr(scheme.size());
    parse_host_port(options.etcd, "--rendezvous etcd://");
  }
  if (joins && !options.etcd.empty()) {
    if (addresses.join.empty() || addresses.join.find_first_of(":/ ") != std::string::npos) {
      throw UsageError("--join '" + addresses.join +
                       "': with --rendezvous etcd:// it takes the job's run id, which its "
                       "first shoal run printed");
    }
    options.join_run_id = addresses.join;
  } else if (joins) {
    std::tie(options.join_host, options.join_port) = parse_host_port(addresses.join, "--join");
  } else {
    if (has_min != has_max) {
      throw UsageError(std::string(has_min ? "--min" : "--max") + " needs " + (has_min ? "--max" : "--min") +
                       ": an elastic job is started with both");
    }
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
  if (app.count("--checkpoint-every") > 0 && options.checkpoint.empty()) {
    throw UsageError("--checkpoint-every needs --checkpoint PATH: where the commits are kept");
  }
}

// What no flag's validator can check alone (Note [Flags through CLI11's validators]).
void validate(const AddressFlags& addresses, const CLI::App& app, LaunchOptions& options) {
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
    std::tie(options.master_host, options.master_port) =
        parse_host_port(addresses.master, "--master");
    if (options.master_host.empty())
      throw UsageError("--master='" + addresses.master + "' has no host");
    options.master_described_as = "--master";
  } else if (options.nnodes > 1) {
    throw UsageError("--nnodes " + std::to_string(options.nnodes) +
                     " needs --master HOST:PORT, the address where node 0 hosts the job's store");
  }
  const bool tag = app.count("--tag-output") > 0;
  const bool no_tag = app.count("--no-tag-output") > 0;
  if (tag && no_tag) throw UsageError("--tag-output and --no-tag-output contradict each other");
  if (tag || no_tag) options.tag_output = tag;
  validate_elastic(addresses, app, options);
  validate_servers(app, options);
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
  LaunchOptions options;
  AddressFlags addresses;
  add_flags(app, options, addresses);

  const CommandLine line = split_command_line(app, args);
  if (line.asks_help) {
    help_out << app.help();
    return std::nullopt;
  }
  try {
    // CLI11 consumes its argument vector from the back.
    std::vector<std::string> reversed(line.flags.rbegin(), line.flags.rend());
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {  // help spelled otherwise (--help=1)
    help_out << app.help();
    return std::nullopt;
  } catch (const CLI::ValidationError& e) {
    // A validator's message, after the flag's long name (Note [Flags through CLI11's validators]);
    // shoal's messages name both of -n's names, as docs/launch.md shows.
    const std::string message = e.what();
    throw UsageError(message.rfind("--nproc-per-node:", 0) == 0 ? "-n/" + message : message);
  } catch (const CLI::ParseError& e) {
    std::string message = e.what();
    for (char& c : message) {
      if (c == '\n') c = ' ';
    }
    throw UsageError(message);
  }

  validate(addresses, app, options);
  if (line.program.empty()) {
    throw UsageError("no program given; usage: shoal run [OPTIONS] PROGRAM [ARGS...]");
  }
  options.program = line.program.front();
  options.program_path = proc::resolve_program(options.program);
  options.program_args.assign(line.program.begin() + 1, line.program.end());
  return options;
}

}  // namespace shoal::launch
