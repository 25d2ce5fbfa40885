// `shoal queue serve|submit|ls|show|cancel|top` and `shoal agent`: their flags, and the
// client's side of the REST API. See docs/queue.md.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>

#include "core/token.h"
#include "proc/process.h"
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

// HOST and PORT of [https://]HOST:PORT.
std::pair<std::string, int> parse_address(const std::string& address, const std::string& flag) {
  std::string text = address;
  for (const char* scheme : {"https://", "http://"}) {
    if (text.rfind(scheme, 0) == 0) text = text.substr(std::strlen(scheme));
  }
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
    throw UsageError(flag + " expects HOST:PORT or https://HOST:PORT, not '" + address + "'");
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
  std::string ca_file;

  void add_flags(CLI::App& app) {
    app.add_option("--queue", queue,
                   "the scheduler's [https://]HOST:PORT (default: $SHOAL_QUEUE, else the local "
                   "one's)");
    app.add_option("--token-file", token_file,
                   "the queue's token (default: $SHOAL_QUEUE_TOKEN, else the local one's)");
    app.add_option("--ca-cert", ca_file,
                   "with https: the scheduler's certificate (default: $SHOAL_QUEUE_CA, else the "
                   "local one's STATE_DIR/tls/cert.pem)");
  }

  std::string ca() const {
    if (!ca_file.empty()) return ca_file;
    if (const char* from_env = std::getenv("SHOAL_QUEUE_CA"); from_env != nullptr && *from_env)
      return from_env;
    const std::string local = default_state_dir() + "/tls/cert.pem";
    return ::access(local.c_str(), R_OK) == 0 ? local : "";
  }

  // HOST:PORT of the scheduler's API.
  std::string address() const {
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
    parse_address(address, "--queue");
    return address;
  }

  std::string base_url() const {
    const std::string at = address();
    return at.rfind("https://", 0) == 0 ? at : "http://" + at;
  }

  HttpClient client() const {
    const std::string dir = default_state_dir();
    std::string token;
    if (!token_file.empty()) {
      token = read_token_file(token_file, "--token-file");
    } else if (const char* from_env = std::getenv("SHOAL_QUEUE_TOKEN");
               from_env != nullptr && *from_env != '\0') {
      token = from_env;
    } else if (::access((dir + "/token").c_str(), R_OK) == 0) {
      token = read_token_file(dir + "/token", "the queue's token file");
    } else {
      throw UsageError("the queue's token is needed: pass --token-file or set SHOAL_QUEUE_TOKEN");
    }
    return HttpClient(address(), token, ca());
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
  if (auto value = parse_integer(text, -1000000, 1000000)) return static_cast<int>(*value);
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
  path = proc::resolve_program(path);
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
  if (auto id = parse_job_id(text)) return *id;
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

// `shoal queue user add NAME [--run-as U] [--allow-root]`, `user rm NAME`, `user ls`: the
// admin's (docs/queue.md, "Security").
int user(const std::vector<std::string>& args) {
  CLI::App app("Manage the queue's users (the admin's token): add prints a new user's token once",
               "shoal queue user");
  Connection connection;
  connection.add_flags(app);
  std::string action;
  std::string name;
  std::string run_as;
  bool allow_root = false;
  app.add_option("action", action, "add, rm or ls")->required();
  app.add_option("name", name, "the user's name (add, rm)");
  app.add_option("--run-as", run_as, "add: the Unix user the user's jobs run as (default: NAME)");
  app.add_flag("--allow-root", allow_root, "add: the user's jobs may run as root");
  if (!parse(app, args)) return 0;
  HttpClient client = connection.client();
  if (action == "ls") {
    const json users = client.get("/users");
    for (const auto& u : users.at("users")) {
      std::cout << u.at("name").get<std::string>() << " runs as "
                << u.at("run_as").get<std::string>()
                << (u.at("allow_root").get<bool>() ? " (root allowed)" : "") << "\n";
    }
    return 0;
  }
  if (name.empty()) throw UsageError(action + " expects a user's name");
  if (action == "add") {
    const json answer =
        client.post("/users", {{"name", name}, {"run_as", run_as}, {"allow_root", allow_root}});
    std::cout << answer.at("token").get<std::string>() << std::endl;
    return 0;
  }
  if (action == "rm") {
    client.del("/users/" + name);
    std::cout << "removed user " << name << std::endl;
    return 0;
  }
  throw UsageError("expected add, rm or ls, not '" + action + "'");
}

// `shoal queue dashboard`: the dashboard's address with a one-time login code (Note [Tokens out
// of URLs], src/queue/access.h).
int dashboard(const std::vector<std::string>& args) {
  CLI::App app("Print the dashboard's address, with a login code good for 60 s and one use",
               "shoal queue dashboard");
  Connection connection;
  connection.add_flags(app);
  if (!parse(app, args)) return 0;
  const json answer = connection.client().post("/login/code", json::object());
  std::cout << connection.base_url() << answer.at("path").get<std::string>() << std::endl;
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
  app.add_option("--port", options.port, "the users' API and dashboard (0: any free port)");
  app.add_option("--agent-port", options.agent_port,
                 "the agents' heartbeats (default 7461; 0: any free port)");
  app.add_option("--token-file", options.access.token_file,
                 "the admin's token (default STATE_DIR/token, made if missing)");
  app.add_option("--run-as", options.access.run_as,
                 "the Unix user the admin's jobs run as (default: the scheduler's)");
  app.add_flag("--allow-root-jobs", options.access.allow_root_jobs,
               "the admin's jobs may run as root (and the local agent may start them)");
  app.add_option("--tls", options.tls,
                 "HTTPS on both ports: auto (the default: on unless --host is loopback and no "
                 "--tls-cert is given), on, off");
  app.add_option("--tls-cert", options.tls_cert,
                 "the certificate to serve (PEM; default: one made in STATE_DIR/tls)");
  app.add_option("--tls-key", options.tls_key, "its private key (PEM)");
  app.add_option("--allow-programs", options.access.allowed_programs,
                 "directories whose programs jobs may run (default: any program)")
      ->delimiter(',');
  app.add_option("--cooldown", options.scheduler.policy.cooldown,
                 "seconds between two resizes of one job");
  app.add_option("--grow-idle", options.scheduler.policy.grow_idle,
                 "seconds capacity stays idle before running jobs grow into it");
  app.add_option("--resize-cost", options.scheduler.policy.resize_cost,
                 "seconds of training a resize costs a job, which the goodput policy weighs "
                 "against what the resize gains (default 0: shoal resizes in place; docs/queue.md, "
                 "\"Goodput\")");
  std::string policy = "priority";
  app.add_option("--policy", policy,
                 "priority (default: idle capacity to the highest priority) or goodput (workers "
                 "where they speed training most, from each job's measured throughput and "
                 "gradient noise; docs/queue.md, \"Goodput\")");
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
  for (const auto& [flag, port] : {std::pair<std::string, int>{"--port", options.port},
                                   {"--agent-port", options.agent_port}}) {
    if (port < 0 || port > 65535) {
      throw UsageError(flag + " expects a port from 0 (any free one) to 65535, not " +
                       std::to_string(port));
    }
  }
  if (options.tls_cert.empty() != options.tls_key.empty())
    throw UsageError("--tls-cert and --tls-key go together; pass both, or neither");
  if (options.port != 0 && options.port == options.agent_port) {
    throw UsageError("--port and --agent-port are both " + std::to_string(options.port) +
                     "; expected two ports (users and agents do not share one)");
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
  if (policy == "goodput") {
    options.scheduler.policy.kind = PolicyOptions::Kind::kGoodput;
  } else if (policy != "priority") {
    throw UsageError("--policy expects priority or goodput, not '" + policy + "'");
  }
  if (options.scheduler.oversubscribe <= 0) throw UsageError("--oversubscribe must be above 0");
  if (options.scheduler.policy.cooldown < 0 || options.scheduler.policy.grow_idle < 0 ||
      options.scheduler.policy.resize_cost < 0) {
    throw UsageError("--cooldown, --grow-idle and --resize-cost must not be negative");
  }
  return serve(options);
}

}  // namespace

int queue_command(const std::vector<std::string>& args) {
  const std::string usage =
      "usage: shoal queue serve|submit|ls|show|cancel|top|user|dashboard [FLAGS]; see "
      "docs/queue.md";
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
    if (command == "user") return user(rest);
    if (command == "dashboard") return dashboard(rest);
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
    app.add_option("--queue", queue, "the scheduler's agent address HOST:AGENT_PORT")->required();
    app.add_option("--token-file", token_file,
                   "the agents' token: a copy of the scheduler's STATE_DIR/agent-token (or set "
                   "SHOAL_QUEUE_TOKEN)");
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
    app.add_option("--ca-cert", options.ca_file,
                   "with an https:// --queue: the scheduler's certificate (a copy of its "
                   "STATE_DIR/tls/cert.pem)");
    app.add_flag("--allow-root-workers", options.allow_root_workers,
                 "start workers whose job runs as root (default: refuse them)");
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
    options.queue_address = queue;
    if (!token_file.empty()) {
      options.token = read_token_file(token_file, "--token-file");
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
