// `shoal queue serve|submit|ls|show|cancel|top` and `shoal agent`: their flags, and the
// client's side of the REST API. See docs/queue.md.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>

#include "../elastic/token.h"
#include "../launch/process.h"
#include "agent.h"
#include "command.h"
#include "http.h"
#include "server.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

namespace {

std::string default_state_dir() {
  if (const char* dir = std::getenv("SHOAL_QUEUE_DIR"); dir != nullptr && *dir != '\0') return dir;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr && *home != '\0' ? home : "/tmp") + "/.shoal-queue";
}

std::pair<std::string, int> parse_address(const std::string& text, const std::string& flag) {
  const auto colon = text.rfind(':');
  int port = 0;
  if (colon != std::string::npos && colon > 0) {
    try {
      size_t used = 0;
      port = std::stoi(text.substr(colon + 1), &used);
      if (used != text.size() - colon - 1) port = 0;
    } catch (const std::exception&) {
      port = 0;
    }
  }
  if (port <= 0 || port > 65535) {
    throw UsageError(flag + " expects HOST:PORT, not '" + text + "'");
  }
  return {text.substr(0, colon), port};
}

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Where the queue is and its token: the flags, else SHOAL_QUEUE / SHOAL_QUEUE_TOKEN, else what
// `shoal queue serve` wrote into its state directory on this machine.
struct Connection {
  std::string queue;
  std::string token_file;

  void add_flags(CLI::App& app) {
    app.add_option("--queue", queue,
                   "the scheduler's HOST:PORT (default: $SHOAL_QUEUE, else the local one's)");
    app.add_option("--token-file", token_file,
                   "the queue's token (default: $SHOAL_QUEUE_TOKEN, else the local one's)");
  }

  HttpClient client() const {
    const std::string dir = default_state_dir();
    std::string address = queue;
    if (address.empty()) {
      const char* from_env = std::getenv("SHOAL_QUEUE");
      address = from_env != nullptr && *from_env != '\0' ? from_env : first_line(dir + "/address");
    }
    if (address.empty()) {
      throw UsageError(
          "no queue to talk to: pass --queue HOST:PORT, set SHOAL_QUEUE, or start "
          "`shoal queue serve` on this machine (it writes " +
          dir + "/address)");
    }
    auto [host, port] = parse_address(address, "--queue");
    std::string token;
    if (!token_file.empty()) {
      token = elastic::read_token_file(token_file, "--token-file");
    } else if (const char* from_env = std::getenv("SHOAL_QUEUE_TOKEN");
               from_env != nullptr && *from_env != '\0') {
      token = from_env;
    } else if (::access((dir + "/token").c_str(), R_OK) == 0) {
      token = elastic::read_token_file(dir + "/token", "the queue's token file");
    } else {
      throw UsageError("the queue's token is needed: pass --token-file or set SHOAL_QUEUE_TOKEN");
    }
    return HttpClient(host, port, token);
  }
};

// Parses `args` into `app`. With --help it prints the command's usage and its flags instead,
// and returns false: the command then exits 0.
bool parse(CLI::App& app, const std::vector<std::string>& args) {
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    app.parse(reversed);
    return true;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return false;
  }
}

int parse_priority(const std::string& text) {
  if (text == "low") return -100;
  if (text == "normal") return 0;
  if (text == "high") return 100;
  try {
    size_t used = 0;
    const long value = std::stol(text, &used);
    if (used == text.size() && value >= -1000000 && value <= 1000000)
      return static_cast<int>(value);
  } catch (const std::exception&) {
  }
  throw UsageError(
      "--priority expects an integer from -1000000 to 1000000 (higher first) or "
      "low, normal, high; not '" +
      text + "'");
}

std::string format_time(int64_t ms) {
  if (ms <= 0) return "-";
  const std::time_t seconds = static_cast<std::time_t>(ms / 1000);
  std::tm local{};
  ::localtime_r(&seconds, &local);
  std::ostringstream out;
  out << std::put_time(&local, "%H:%M:%S");
  return out.str();
}

void print_jobs(const json& jobs, std::ostream& out) {
  out << std::left << std::setw(6) << "JOB" << std::setw(14) << "NAME" << std::setw(11) << "STATE"
      << std::setw(9) << "PRIORITY" << std::setw(9) << "WORKERS" << std::setw(9) << "MIN-MAX"
      << "REASON\n";
  for (const auto& job : jobs.at("jobs")) {
    std::string name = job.value("name", "");
    if (name.empty()) {
      const std::string program = job.at("argv").at(0);
      name = program.substr(program.rfind('/') + 1);
    }
    out << std::left << std::setw(6) << job.at("id").get<int64_t>() << std::setw(14)
        << name.substr(0, 13) << std::setw(11) << job.at("state").get<std::string>() << std::setw(9)
        << job.at("priority").get<int>() << std::setw(9) << job.at("workers").get<int>()
        << std::setw(9)
        << (std::to_string(job.at("min").get<int>()) + "-" +
            std::to_string(job.at("max").get<int>()))
        << job.value("reason", "") << "\n";
  }
}

int submit(const std::vector<std::string>& args) {
  CLI::App app("Submit a job to the queue: shoal queue submit [FLAGS] PROGRAM [ARGS...]",
               "shoal queue submit");
  Connection connection;
  connection.add_flags(app);
  std::string priority = "0";
  int min_workers = 1;
  int max_workers = 0;
  bool preemptible = false;
  int max_restarts = 3;
  std::string name;
  std::vector<std::string> program;
  app.add_option("--priority", priority, "an integer (higher first) or low, normal, high");
  app.add_option("--min", min_workers, "workers the job needs to run (started all at once)");
  app.add_option("--max", max_workers, "workers it can use (default --min)");
  app.add_flag("--preemptible", preemptible, "may be stopped whole for a higher-priority job");
  app.add_option("--max-restarts", max_restarts, "failures of its workers before it fails");
  app.add_option("--name", name, "a name to show");
  // CLI11 takes flags up to the program; the program's own flags stay its own.
  app.prefix_command();
  if (!parse(app, args)) return 0;
  program = app.remaining();
  if (program.empty())
    throw UsageError("expected the program to run: shoal queue submit [FLAGS] PROGRAM [ARGS...]");
  if (max_workers == 0) max_workers = min_workers;
  if (min_workers < 1)
    throw UsageError("--min must be at least 1, not " + std::to_string(min_workers));
  if (min_workers > max_workers) {
    throw UsageError("--min " + std::to_string(min_workers) + " is above --max " +
                     std::to_string(max_workers) + "; expected --min <= --max");
  }
  const int priority_value = parse_priority(priority);
  std::string path = program.at(0);
  if (path.find('/') != std::string::npos && path[0] != '/') {
    char cwd[4096];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) path = std::string(cwd) + "/" + path;
  }
  path = launch::resolve_program(path);
  std::vector<std::string> argv = program;
  argv[0] = path;
  char cwd[4096] = "/";
  if (::getcwd(cwd, sizeof(cwd)) == nullptr) std::strcpy(cwd, "/");
  json body{{"argv", argv},
            {"cwd", cwd},
            {"env", env::current()},
            {"priority", priority_value},
            {"min", min_workers},
            {"max", max_workers},
            {"preemptible", preemptible},
            {"max_restarts", max_restarts},
            {"name", name}};
  const json answer = connection.client().post("/jobs", body);
  std::cout << "submitted job " << answer.at("id").get<int64_t>() << std::endl;
  return 0;
}

int ls(const std::vector<std::string>& args) {
  CLI::App app("List the queue's jobs", "shoal queue ls");
  Connection connection;
  connection.add_flags(app);
  if (!parse(app, args)) return 0;
  print_jobs(connection.client().get("/jobs"), std::cout);
  return 0;
}

int64_t parse_job(const std::string& text) {
  try {
    size_t used = 0;
    const long long id = std::stoll(text, &used);
    if (used == text.size() && id > 0) return id;
  } catch (const std::exception&) {
  }
  throw UsageError("expected a job id (a positive integer), not '" + text + "'");
}

int show(const std::vector<std::string>& args) {
  CLI::App app("Show one job: its workers, hosts, restarts and the scheduler's reasons",
               "shoal queue show");
  Connection connection;
  connection.add_flags(app);
  std::string id;
  app.add_option("job", id, "the job's id")->required();
  if (!parse(app, args)) return 0;
  const json job = connection.client().get("/jobs/" + std::to_string(parse_job(id)));
  std::cout << "job " << job.at("id").get<int64_t>() << ": " << job.at("state").get<std::string>()
            << " (" << job.value("reason", "") << ")\n";
  std::cout << "  program    ";
  for (const auto& arg : job.at("argv")) std::cout << arg.get<std::string>() << " ";
  std::cout << "\n  priority   " << job.at("priority").get<int>()
            << (job.value("preemptible", false) ? ", preemptible" : "") << "\n  workers    "
            << job.at("workers").get<int>() << " (--min " << job.at("min").get<int>() << ", --max "
            << job.at("max").get<int>() << ")"
            << "\n  failures   " << job.at("failures").get<int>() << " (--max-restarts "
            << job.at("max_restarts").get<int>() << ")"
            << "\n  resizes    " << job.at("resizes").get<int>() << ", preemptions "
            << job.at("preemptions").get<int>() << ", preemption cycles "
            << job.at("cycles").get<int>() << "\n  submitted  "
            << format_time(job.at("submitted_ms")) << ", started "
            << format_time(job.at("started_ms")) << ", ended " << format_time(job.at("ended_ms"))
            << "\n\n";
  std::cout << std::left << std::setw(8) << "WORKER" << std::setw(14) << "HOST" << std::setw(9)
            << "PID" << std::setw(10) << "STATE"
            << "\n";
  for (const auto& w : job.at("worker_list")) {
    std::string state = w.at("state");
    if (state != "exited" && w.value("leave", false)) state = "leaving";
    if (state != "exited" && w.value("stop", false)) state = "stopping";
    std::cout << std::left << std::setw(8) << w.at("id").get<int64_t>() << std::setw(14)
              << w.at("host").get<std::string>() << std::setw(9) << w.at("pid").get<int64_t>()
              << std::setw(10) << state << w.value("exit", "") << "\n";
  }
  std::cout << "\nEVENTS\n";
  for (const auto& e : job.at("events")) {
    std::cout << format_time(e.at("time_ms")) << "  " << e.at("message").get<std::string>() << "\n";
  }
  return 0;
}

int cancel(const std::vector<std::string>& args) {
  CLI::App app("Cancel a job: its workers are stopped", "shoal queue cancel");
  Connection connection;
  connection.add_flags(app);
  std::string id;
  app.add_option("job", id, "the job's id")->required();
  if (!parse(app, args)) return 0;
  const int64_t job = parse_job(id);
  connection.client().del("/jobs/" + std::to_string(job));
  std::cout << "cancelled job " << job << std::endl;
  return 0;
}

int top(const std::vector<std::string>& args) {
  CLI::App app("A live view of the queue: jobs, hosts, the latest decisions", "shoal queue top");
  Connection connection;
  connection.add_flags(app);
  double interval = 1;
  int iterations = 0;
  app.add_option("--interval", interval, "seconds between refreshes");
  app.add_option("-n,--iterations", iterations, "refreshes before exiting (default: until Ctrl-C)");
  if (!parse(app, args)) return 0;
  HttpClient client = connection.client();
  const bool terminal = ::isatty(1) != 0;
  for (int i = 0; iterations == 0 || i < iterations; ++i) {
    if (i > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(interval * 1000)));
    const json jobs = client.get("/jobs");
    const json nodes = client.get("/nodes");
    const json metrics = client.get("/metrics");
    const json recent = client.get("/events?since=0&limit=100000");
    std::ostringstream out;
    if (terminal) out << "\x1b[H\x1b[2J";
    out << "shoal queue   "
        << format_time(std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count())
        << "   workers " << metrics.at("workers").get<int>() << "/"
        << metrics.at("capacity").get<int>() << "   resizes " << metrics.at("resizes").get<int>()
        << "   preemptions " << metrics.at("preemptions").get<int>() << "\n\n";
    print_jobs(jobs, out);
    out << "\nHOST          SLOTS  WORKERS\n";
    for (const auto& node : nodes.at("nodes")) {
      std::string running;
      for (const auto& w : node.at("workers")) {
        running += "j" + std::to_string(w.at("job").get<int64_t>()) + "/w" +
                   std::to_string(w.at("id").get<int64_t>()) + " ";
      }
      out << std::left << std::setw(14) << node.at("name").get<std::string>() << std::setw(7)
          << node.at("capacity").get<int>() << (node.at("alive").get<bool>() ? running : "(lost)")
          << "\n";
    }
    out << "\nLATEST DECISIONS\n";
    const auto& events = recent.at("events");
    const size_t first = events.size() > 8 ? events.size() - 8 : 0;
    for (size_t e = first; e < events.size(); ++e) {
      out << format_time(events[e].at("time_ms")) << "  "
          << events[e].at("message").get<std::string>() << "\n";
    }
    std::cout << out.str() << std::flush;
  }
  return 0;
}

int serve_command(const std::vector<std::string>& args) {
  CLI::App app("Run the queue's scheduler (and this host's agent)", "shoal queue serve");
  ServeOptions options;
  options.scheduler.state_dir = default_state_dir();
  app.add_option("--state-dir", options.scheduler.state_dir,
                 "the database, token and address (default $SHOAL_QUEUE_DIR or ~/.shoal-queue)");
  app.add_option("--host", options.bind_host,
                 "the address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)");
  app.add_option("--port", options.port, "the port (0: any free one)");
  app.add_option("--token-file", options.token_file,
                 "the queue's token (default STATE_DIR/token, made if missing)");
  app.add_option("--cooldown", options.scheduler.policy.cooldown,
                 "seconds between two resizes of one job");
  app.add_option("--grow-idle", options.scheduler.policy.grow_idle,
                 "seconds capacity stays idle before running jobs grow into it");
  std::string resize_by = "leave";
  app.add_option("--resize-by", resize_by,
                 "leave (default: a shrink is a graceful leave, a grow a join) or restart (the "
                 "whole job stops at a commit and starts again at its new size, as Kubeflow's "
                 "elastic PyTorchJob and Ray Train resize)");
  app.add_option("--oversubscribe", options.scheduler.oversubscribe,
                 "workers per core a host may run");
  app.add_option("--host-timeout", options.scheduler.host_timeout,
                 "seconds of silence before a host is lost");
  app.add_option("--below-min-grace", options.scheduler.below_min_grace,
                 "seconds a job may run below --min before it waits again");
  bool no_agent = false;
  app.add_flag("--no-local-agent", no_agent,
               "do not run this host's agent (hosts come from `shoal agent`)");
  app.add_option("--slots", options.local_slots, "the local agent's --slots");
  if (!parse(app, args)) return 0;
  options.local_agent = !no_agent;
  if (options.port < 0 || options.port > 65535) {
    throw UsageError("--port expects a port from 0 (any free one) to 65535, not " +
                     std::to_string(options.port));
  }
  if (options.local_slots < 0) {
    throw UsageError("--slots expects a count of workers, 0 or more (0: cores x --oversubscribe), "
                     "not " + std::to_string(options.local_slots));
  }
  if (options.scheduler.host_timeout <= 0 || options.scheduler.below_min_grace < 0) {
    throw UsageError("--host-timeout must be above 0 and --below-min-grace not negative");
  }
  if (resize_by == "restart") {
    options.scheduler.resize_by = ResizeBy::kRestart;
  } else if (resize_by != "leave") {
    throw UsageError("--resize-by expects leave or restart, not '" + resize_by + "'");
  }
  if (options.scheduler.oversubscribe <= 0) throw UsageError("--oversubscribe must be above 0");
  if (options.scheduler.policy.cooldown < 0 || options.scheduler.policy.grow_idle < 0) {
    throw UsageError("--cooldown and --grow-idle must not be negative");
  }
  return serve(options);
}

}  // namespace

int queue_command(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: shoal queue serve|submit|ls|show|cancel|top [FLAGS]; see docs/queue.md";
  if (args.empty()) {
    std::cerr << "shoal queue: expected a command; " << usage << std::endl;
    return 2;
  }
  const std::string command = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  try {
    if (command == "serve") return serve_command(rest);
    if (command == "submit") return submit(rest);
    if (command == "ls") return ls(rest);
    if (command == "show") return show(rest);
    if (command == "cancel") return cancel(rest);
    if (command == "top") return top(rest);
    if (command == "-h" || command == "--help" || command == "help") {
      std::cout << usage << std::endl;
      return 0;
    }
    std::cerr << "shoal queue: unknown command '" << command << "'; " << usage << std::endl;
    return 2;
  } catch (const CLI::CallForHelp&) {
    std::cout << usage << std::endl;
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "shoal queue " << command << ": " << e.what() << std::endl;
    return 2;
  } catch (const UsageError& e) {
    std::cerr << "shoal queue " << command << ": " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shoal queue " << command << ": " << e.what() << std::endl;
    return 1;
  }
}

int agent_command(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: shoal agent --queue HOST:PORT [--token-file F] [--host NAME] [--slots N] [--dir DIR] "
      "[--engine local|slurm] [--slurm-node NODE] [--partition P]";
  try {
    CLI::App app("Run this host's agent for the queue", "shoal agent");
    AgentOptions options;
    std::string queue;
    std::string token_file;
    app.add_option("--queue", queue, "the scheduler's HOST:PORT")->required();
    app.add_option("--token-file", token_file, "the queue's token (or set SHOAL_QUEUE_TOKEN)");
    app.add_option(
        "--host", options.host,
        "this host's name in the queue (default: its host name; with Slurm, the node's)");
    app.add_option("--slots", options.slots,
                   "workers this host may run (default: cores x the queue's --oversubscribe; with "
                   "Slurm, the node's CPUs)");
    app.add_option("--dir", options.dir,
                   "the workers' logs (default /tmp/shoal-agent-HOST); with Slurm, on a filesystem "
                   "the node shares");
    app.add_option("--engine", options.engine,
                   "how workers run: local (forked here) or slurm (a Slurm job each)");
    app.add_option("--slurm-node", options.slurm_node,
                   "with --engine slurm: the Slurm node this agent speaks for");
    app.add_option("--partition", options.partition,
                   "with --engine slurm: the partition to submit to (default: Slurm's)");
    if (!parse(app, args)) return 0;
    if (options.engine != "local" && options.engine != "slurm") {
      throw UsageError("--engine expects local or slurm, not '" + options.engine + "'");
    }
    if (options.engine == "slurm" && options.slurm_node.empty()) {
      throw UsageError(
          "--engine slurm needs --slurm-node NODE: the Slurm node this agent speaks for");
    }
    if (options.engine != "slurm" && (!options.slurm_node.empty() || !options.partition.empty())) {
      throw UsageError(std::string(options.slurm_node.empty() ? "--partition" : "--slurm-node") +
                       " is for --engine slurm; this agent's engine is " + options.engine);
    }
    std::tie(options.queue_host, options.queue_port) = parse_address(queue, "--queue");
    if (!token_file.empty()) {
      options.token = elastic::read_token_file(token_file, "--token-file");
    } else if (const char* from_env = std::getenv("SHOAL_QUEUE_TOKEN");
               from_env != nullptr && *from_env != '\0') {
      options.token = from_env;
    } else {
      throw UsageError("the queue's token is needed: pass --token-file or set SHOAL_QUEUE_TOKEN");
    }
    if (options.slots < 0) throw UsageError("--slots must not be negative");
    if (options.dir.empty()) {
      char name[256] = {};
      ::gethostname(name, sizeof(name) - 1);
      std::string host = options.host;
      if (host.empty()) host = options.engine == "slurm" ? options.slurm_node : std::string(name);
      options.dir = "/tmp/shoal-agent-" + host;
    }
    return run_agent(options);
  } catch (const CLI::CallForHelp&) {
    std::cout << usage << std::endl;
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "shoal agent: " << e.what() << std::endl;
    return 2;
  } catch (const UsageError& e) {
    std::cerr << "shoal agent: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shoal agent: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace shoal::queue
