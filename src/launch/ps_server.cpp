#include "ps_server.h"

#include <iostream>

#include <CLI/CLI.hpp>

#include "ps/serve.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"

namespace shoal::launch {

int ps_server_command(const std::vector<std::string>& args) {
  ps::detail::ServerProcessOptions options;
  options.index = -1;
  std::string handler = "core";
  std::string role = "primary";
  options.mode = env::get(env::current(), "SHOAL_PS_MODE").value_or("");
  CLI::App app("Serves one parameter server of a job (started by shoal run --servers).",
               "shoal ps-server");
  app.add_option("--index", options.index, "The server's index in the job, 0 to S-1")->required();
  app.add_option("--port", options.port, "The port to serve on (default 0: any free port)");
  app.add_option("--host", options.host, "The interface to listen on (default 0.0.0.0)");
  app.add_option("--handler", handler,
                 "core (the parameter server) or sum (the transport's test handler)")
      ->check(CLI::IsMember({"core", "sum"}));
  app.add_option("--role", role, "primary (the default) or backup (docs/ps.md, replicas)")
      ->check(CLI::IsMember({"primary", "backup"}));
  app.add_option("--replicas", options.replicas,
                 "Processes serving this index: 1 (the default) or 2 (a primary forwards every "
                 "update to its backup)")
      ->check(CLI::Range(1, 2));
  app.add_option("--snapshot-dir", options.snapshot_dir,
                 "Write the server's shards to DIR every --snapshot-every steps (docs/ps.md)");
  app.add_option("--snapshot-every", options.snapshot_every,
                 "Steps between snapshots (default 100)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_flag("--restore", options.restore,
               "Restarted: load the newest snapshot of this server's shards from --snapshot-dir");
  app.add_option("--mode", options.mode,
                 "sync, async or ssp:S (bounded staleness S); default SHOAL_PS_MODE, else the "
                 "workers' (ps::ServerOptions::mode)");
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    app.parse(reversed);
    if (!options.mode.empty()) {
      ps::parse_mode(options.mode, app.count("--mode") > 0 ? "--mode" : "SHOAL_PS_MODE");
    }
    if (options.index < 0) {
      throw UsageError("--index " + std::to_string(options.index) + "; expected 0 or more");
    }
    if (options.port < 0 || options.port > 65535) {
      throw UsageError("--port " + std::to_string(options.port) + "; expected 0 to 65535");
    }
    options.sum_handler = handler == "sum";
    options.backup = role == "backup";
    ps::detail::run_server_process(options);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "shoal ps-server: " << e.what() << std::endl;
    return 2;
  } catch (const UsageError& e) {
    std::cerr << "shoal ps-server: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shoal ps-server: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace shoal::launch
