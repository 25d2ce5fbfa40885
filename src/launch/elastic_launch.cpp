// `shoal run` for elastic jobs: see docs/elastic.md, "shoal run for elastic jobs".
//
// The launcher takes part in the job's membership as an agent (never in a round): its address is
// the job's address for --join, its metadata carries the job's --min/--max/--quorum to joining
// launchers, and its workers find the job through it. A worker that fails is restarted (up to
// --max-restarts, with a back-off that doubles) while the others go on; the job ends when every
// worker has ended.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "core/token.h"
#include "elastic_agent.h"
#include "launcher.h"
#include "nodes.h"
#include "proc/process.h"
#include "shoal/comm/address.h"
#include "shoal/core/error.h"
#include "signals.h"
#include "watchdog.h"
#include "worker.h"

namespace shoal::launch {

namespace {

using Clock = std::chrono::steady_clock;

// An elastic worker given SIGTERM leaves at its next commit; give it that long.
constexpr Duration kElasticStopGrace{10000};

// A joining launcher takes the job's settings from any agent already in it.
bool adopt_job_settings(const elastic::GossipAgent& membership, proc::ElasticPlace& place) {
  for (const auto& meta : membership.others_meta()) {
    const auto settings = proc::parse_agent_metadata(meta);
    if (!settings) continue;
    place.min_workers = settings->min_workers;
    place.max_workers = settings->max_workers;
    place.quorum = settings->quorum;
    place.last_call = settings->last_call;
    place.run_id = settings->run_id;
    return true;
  }
  return false;
}

std::string default_token_path(const std::string& run_id) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/shoal-" + run_id + ".token";
}

}  // namespace

int Launcher::run_elastic() {
  agent_ = std::make_unique<ElasticAgent>();
  proc::ElasticPlace& place = agent_->place;
  place.local_world_size = options_.nproc_per_node;
  place.last_call = options_.last_call;
  place.rendezvous_timeout = options_.rendezvous_timeout;

  std::string token;
  if (options_.joins()) {
    if (!options_.token_file.empty()) {
      token = read_token_file(options_.token_file, "--token-file");
      agent_->token_file = options_.token_file;
    } else if (const char* from_env = std::getenv("SHOAL_JOB_TOKEN");
               from_env != nullptr && *from_env != '\0') {
      token = from_env;
    } else {
      throw UsageError(
          "--join needs the job's token: pass --token-file PATH (the file the first shoal run "
          "wrote) or set SHOAL_JOB_TOKEN");
    }
  } else {
    place.min_workers = options_.min_workers;
    place.max_workers = options_.max_workers;
    place.quorum = options_.quorum;
    place.run_id = make_run_id();
    token = make_token();
    agent_->token_file =
        options_.token_file.empty() ? default_token_path(place.run_id) : options_.token_file;
    write_token_file(agent_->token_file, token);
    agent_->owns_token_file = true;
  }
  if (options_.etcd.empty()) {
    join_gossip(token);
  } else {
    join_etcd(token);
  }
  place.token_file = agent_->token_file;
  options_.stop_grace = std::max(options_.stop_grace, kElasticStopGrace);

  start_elastic_workers();
  supervise();
  kill_leftovers();
  agent_->finished = any_success_;
  agent_.reset();
  // The job's last lines say how each worker ended: one that crashed and was not restarted
  // does not change the exit code of a job whose training finished.
  for (const auto& worker : workers_) {
    if (!worker->exit) continue;
    const int restarts = worker->restarts;
    say("worker " + std::to_string(worker->local_rank) + " " + worker->exit->describe() +
        (restarts > 0
             ? " (after " + std::to_string(restarts) + " restart" + (restarts > 1 ? "s" : "") + ")"
             : ""));
  }
  if (exit_code_ >= 128 && stopping_) return exit_code_;  // stopped by a signal
  return any_success_ ? 0 : exit_code_;
}

void Launcher::join_gossip(const std::string& token) {
  proc::ElasticPlace& place = agent_->place;
  elastic::GossipAgentOptions membership;
  if (options_.joins()) {
    membership.seeds = {options_.join_host + ":" + std::to_string(options_.join_port)};
    membership.advertise_host = comm::local_address_towards(options_.join_host, options_.join_port);
  } else {
    // --master HOST:PORT names this agent's address, for launchers on other hosts to --join.
    membership.port = options_.master_port;
    membership.advertise_host = options_.master_host.empty() ? "127.0.0.1" : options_.master_host;
  }
  membership.token = token;
  membership.meta = proc::agent_metadata(place);
  membership.join_timeout = options_.connect_timeout;
  try {
    agent_->membership = std::make_unique<elastic::GossipAgent>(membership);
  } catch (const CommError& e) {
    throw UsageError(std::string("--join ") + options_.join_host + ":" +
                     std::to_string(options_.join_port) + ": " + e.what());
  }
  if (options_.joins()) {
    if (!adopt_job_settings(*agent_->membership, place)) {
      throw UsageError("--join " + options_.join_host + ":" + std::to_string(options_.join_port) +
                       ": no launcher of the job is in its membership to tell its --min/--max");
    }
    agent_->membership->set_meta(proc::agent_metadata(place));
  } else {
    say("elastic job of " + std::to_string(place.min_workers) + " to " +
        std::to_string(place.max_workers) + " workers; to add workers: shoal run --join " +
        agent_->membership->address() + " --token-file " + agent_->token_file + " PROGRAM");
  }
  place.seeds = agent_->membership->address();
}

// With etcd the launcher keeps no membership of its own: the job's record in etcd carries its
// settings and its token's digest, and its workers register themselves.
void Launcher::join_etcd(const std::string& token) {
  proc::ElasticPlace& place = agent_->place;
  if (options_.joins()) place.run_id = options_.join_run_id;
  place.etcd = options_.etcd;
  elastic::JobSettings settings;
  settings.min_workers = place.min_workers;
  settings.max_workers = place.max_workers;
  settings.quorum = place.quorum;
  settings.last_call = place.last_call;
  try {
    agent_->etcd = std::make_unique<elastic::EtcdJob>(options_.etcd, place.run_id, token, settings,
                                                      !options_.joins(), options_.connect_timeout);
  } catch (const CommError& e) {
    throw UsageError(std::string("--rendezvous etcd://") + options_.etcd + ": " + e.what());
  }
  const elastic::JobSettings& record = agent_->etcd->settings();
  place.min_workers = record.min_workers;
  place.max_workers = record.max_workers;
  place.quorum = record.quorum;
  place.last_call = record.last_call;
  if (!options_.joins()) {
    say("elastic job " + place.run_id + " of " + std::to_string(place.min_workers) + " to " +
        std::to_string(place.max_workers) + " workers in etcd at " + options_.etcd +
        "; to add workers: shoal run --rendezvous etcd://" + options_.etcd + " --join " +
        place.run_id + " --token-file " + agent_->token_file + " PROGRAM");
  }
}

void Launcher::start_elastic_workers() {
  env::Environment base = env::current();
  if (!options_.checkpoint.empty()) base["SHOAL_CHECKPOINT"] = options_.checkpoint;
  if (options_.checkpoint_every > 0) base["SHOAL_CHECKPOINT_EVERY"] = std::to_string(options_.checkpoint_every);
  for (int i = 0; i < options_.nproc_per_node; ++i) {
    const std::string prefix =
        options_.tags_output()
            ? "[" + std::string(options_.joins() ? "+" : "") + std::to_string(i) + "] "
            : "";
    auto worker = std::make_unique<Worker>(i, i, prefix, out_, err_);
    worker->envp = proc::to_envp(proc::elastic_worker_environment(base, agent_->place));
    try {
      spawn(*worker);
    } catch (const Error& e) {
      if (workers_.empty()) throw;
      say(std::string(e.what()) + "; stopping the other workers");
      exit_code_ = 2;
      begin_stop(SIGTERM);
      return;
    }
    workers_.push_back(std::move(worker));
  }
}

void Launcher::on_elastic_failure(Worker& worker, const proc::ExitStatus& status) {
  if (exit_code_ == 0) exit_code_ = status.shell_code();
  if (worker.restarts >= options_.max_restarts) {
    say("worker " + std::to_string(worker.local_rank) + " " + status.describe() +
        (options_.max_restarts > 0 ? " (restarted " + std::to_string(worker.restarts) + " times)"
                                   : "") +
        "; the job goes on without it");
    if (ps_elastic()) check_min_workers(worker, status);
    return;
  }
  const Duration backoff = proc::restart_backoff(worker.restarts);
  say("worker " + std::to_string(worker.local_rank) + " " + status.describe() +
      "; restarting it in " + format_duration(backoff));
  worker.restart_at = Clock::now() + backoff;
}

void Launcher::restart_due(TimePoint now) {
  for (auto& worker : workers_) {
    if (!worker->restart_at) continue;
    if (stopping_) {
      worker->restart_at.reset();
      continue;
    }
    if (now < *worker->restart_at) continue;
    worker->restart_at.reset();
    if (ps_elastic() && !reserve_workers(1)) {
      say("not restarting worker " + std::to_string(worker->local_rank) +
          ": the job runs its --max workers (others joined)");
      continue;
    }
    ++worker->restarts;
    close_output(*worker);
    if (ps_elastic()) set_ps_worker(*worker);
    try {
      spawn(*worker);
    } catch (const Error& e) {
      say("restarting worker " + std::to_string(worker->local_rank) + " failed: " + e.what());
      if (ps_elastic()) release_workers(1);
    }
  }
}

std::optional<Launcher::TimePoint> Launcher::next_restart() const {
  std::optional<TimePoint> next;
  for (const auto& worker : workers_) {
    if (worker->restart_at && (!next || *worker->restart_at < *next)) next = worker->restart_at;
  }
  return next;
}

}  // namespace shoal::launch
