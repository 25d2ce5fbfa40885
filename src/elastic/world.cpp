#include "world.h"

#include "join.h"

#include <unistd.h>

#include <cstdlib>
#include <sstream>
#include <thread>

#include "etcd/job.h"
#include "etcd/rendezvous.h"
#include "gossip/rendezvous.h"
#include "core/token.h"
#include "shoal/core/error.h"
#include "runtime/job_discovery.h"

namespace shoal::elastic {
namespace {

ElasticWorld* the_world = nullptr;

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

runtime::Round make_round(const View& view, comm::Group group) {
  runtime::Round round;
  round.job.launcher = "shoal";
  round.job.elastic = true;
  round.job.rank = view.rank;
  round.job.world_size = view.size();
  const std::string& host = view.members[view.rank].host;
  round.job.local_rank = 0;
  round.job.local_world_size = 0;
  for (int r = 0; r < view.size(); ++r) {
    if (view.members[r].host != host) continue;
    if (r < view.rank) ++round.job.local_rank;
    ++round.job.local_world_size;
  }
  const auto& store = view.members[0].store;
  auto [addr, port] = parse_host_port(store, "the round's store");
  round.job.master_addr = addr;
  round.job.master_port = port;
  round.job.master_described_as = "the store of round " + std::to_string(view.round) + "'s first worker";
  round.group = std::move(group);
  return round;
}

std::unique_ptr<Rendezvous> start_gossip(const Settings& settings, const std::string& address, const Peer& self,
                                         Duration connect_timeout) {
  gossip::Options membership;
  membership.seeds = settings.seeds;
  membership.token = settings.token;
  membership.advertise_host = address;
  membership.join_timeout = connect_timeout;
  return std::make_unique<gossip::GossipRendezvous>(membership, self, settings.rendezvous);
}

// The job's record in etcd is made by its first shoal run (or its first worker, when started
// without one); a worker whose token is not the job's is refused before it writes anything.
std::unique_ptr<Rendezvous> start_etcd(const Settings& settings, const Peer& self, Duration connect_timeout) {
  etcd::EtcdOptions options;
  options.endpoint = settings.etcd;
  options.prefix = etcd::job_prefix(settings.run_id);
  options.connect_timeout = connect_timeout;
  etcd::JobRecord record;
  record.min_workers = settings.rendezvous.min_workers;
  record.max_workers = settings.rendezvous.max_workers;
  record.quorum = settings.rendezvous.quorum;
  record.last_call = settings.rendezvous.last_call;
  const etcd::Client client(etcd::Endpoint::parse(options.endpoint), options.request_timeout);
  Deadline deadline(connect_timeout);
  for (;;) {
    try {
      etcd::open_job(client, options.prefix, settings.token, record, /*create=*/true);
      break;
    } catch (const CommError& e) {
      if (deadline.expired()) throw;
      std::this_thread::sleep_for(std::min(Duration(200), deadline.remaining()));
    }
  }
  return std::make_unique<etcd::EtcdRendezvous>(options, self, settings.rendezvous);
}

}  // namespace

Settings read_settings(const env::Environment& env) {
  Settings settings;
  auto min = env::get_int(env, "SHOAL_MIN_WORKERS", 1, 1 << 20);
  auto max = env::get_int(env, "SHOAL_MAX_WORKERS", 1, 1 << 20);
  if (!min || !max) {
    throw UsageError("SHOAL_ELASTIC is set but SHOAL_MIN_WORKERS or SHOAL_MAX_WORKERS is not; expected "
                     "both, as shoal run --min/--max sets them");
  }
  if (*min > *max) {
    throw UsageError("SHOAL_MIN_WORKERS=" + std::to_string(*min) + " is more than SHOAL_MAX_WORKERS=" +
                     std::to_string(*max) + "; expected min <= max");
  }
  settings.rendezvous.min_workers = static_cast<int>(*min);
  settings.rendezvous.max_workers = static_cast<int>(*max);
  settings.rendezvous.quorum = env::get_bool(env, "SHOAL_QUORUM").value_or(false);
  if (auto ms = env::get_int(env, "SHOAL_LAST_CALL_MS", 0, 3600 * 1000)) {
    settings.rendezvous.last_call = Duration(*ms);
  }
  if (auto s = env::get_int(env, "SHOAL_RENDEZVOUS_TIMEOUT", 1, 7 * 24 * 3600)) {
    settings.rendezvous_timeout = std::chrono::seconds(*s);
  }
  if (auto backend = env::get(env, "SHOAL_RENDEZVOUS"); backend && *backend != "gossip") {
    const std::string scheme = "etcd://";
    if (backend->compare(0, scheme.size(), scheme) != 0) {
      throw UsageError("SHOAL_RENDEZVOUS=" + *backend + " is not a rendezvous backend; expected gossip or "
                       "etcd://HOST:PORT");
    }
    settings.etcd = etcd::Endpoint::parse(backend->substr(scheme.size())).text();
    settings.run_id = env::get(env, "SHOAL_RUN_ID").value_or("");
    if (settings.run_id.empty()) {
      throw UsageError("SHOAL_RENDEZVOUS=" + *backend + " needs SHOAL_RUN_ID, the job's name in etcd (shoal run "
                       "sets it)");
    }
  }
  settings.seeds = split_list(env::get(env, "SHOAL_GOSSIP_SEEDS").value_or(""));
  if (auto token = env::get(env, "SHOAL_JOB_TOKEN"); token && !token->empty()) {
    settings.token = *token;
  } else if (auto path = env::get(env, "SHOAL_JOB_TOKEN_FILE"); path && !path->empty()) {
    settings.token = read_token_file(*path, "SHOAL_JOB_TOKEN_FILE");
  } else {
    throw UsageError("an elastic job needs its token: set SHOAL_JOB_TOKEN or SHOAL_JOB_TOKEN_FILE (shoal run "
                     "does, and --join takes --token-file)");
  }
  return settings;
}

ElasticWorld& ElasticWorld::get() {
  if (the_world == nullptr) {
    throw UsageError("shoal::elastic needs an elastic job: start the program with shoal run --min/--max, "
                     "after shoal::init()");
  }
  return *the_world;
}

runtime::Round ElasticWorld::join(const JobSpec& discovered, const env::Environment& env, Duration connect_timeout,
                                  Duration timeout) {
  SHOAL_CHECK(the_world == nullptr) << "joined an elastic job twice";
  auto world = std::unique_ptr<ElasticWorld>(new ElasticWorld());
  world->settings_ = read_settings(env);
  world->connect_timeout_ = connect_timeout;
  world->timeout_ = timeout;

  std::string towards = "127.0.0.1";
  int towards_port = 1;
  if (!world->settings_.etcd.empty()) {
    std::tie(towards, towards_port) = parse_host_port(world->settings_.etcd, "SHOAL_RENDEZVOUS");
  } else if (!world->settings_.seeds.empty()) {
    std::tie(towards, towards_port) = parse_host_port(world->settings_.seeds[0], "SHOAL_GOSSIP_SEEDS");
  }
  world->address_ = comm::local_address_towards(towards, towards_port);

  // Every worker hosts a store; a round's group meets in its first member's.
  comm::StoreOptions server;
  server.is_server = true;
  server.port = 0;
  server.timeout = connect_timeout;
  server.described_as = "this worker's store";
  world->server_ = comm::open_store(server);

  Peer self;
  self.host = host_name();
  self.pid = static_cast<int>(getpid());
  self.store = world->address_ + ":" + std::to_string(comm::hosted_port(world->server_));

  world->rendezvous_ = world->settings_.etcd.empty() ? start_gossip(world->settings_, world->address_, self, connect_timeout)
                                                     : start_etcd(world->settings_, self, connect_timeout);

  the_world = world.release();  // lives as long as the process, as the runtime does
  // A worker that returns from main() has left the job: say so (the others need not detect
  // it), and stop the membership's thread before static destructors run under it.
  std::atexit([] { the_world->rendezvous().leave(); });
  the_world->next_round(nullptr);
  the_world->rendezvous_->take_rejoined();  // nothing committed yet that could be stale
  return the_world->round_;
}

void ElasticWorld::reform(bool failed) {
  if (failed) rendezvous_->check(view_);
  next_round(&view_);
  runtime::replace_world(round_);
}

void ElasticWorld::next_round(const View* previous) {
  Deadline deadline(settings_.rendezvous_timeout);
  View last;
  if (previous != nullptr) last = *previous;
  bool have_last = previous != nullptr;
  for (;;) {
    View view = rendezvous_->next(have_last ? &last : nullptr, deadline.remaining());
    try {
      round_ = form(view);
      view_ = view;
      return;
    } catch (const CommError& e) {
      // A member died while the group connected: the next round leaves it out.
      if (deadline.expired()) throw;
      rendezvous_->check(view);
      last = view;
      have_last = true;
    }
  }
}

runtime::Round ElasticWorld::form(const View& view) {
  auto [host, port] = parse_host_port(view.members[0].store, "the round's store");
  comm::StoreOptions client;
  client.host = host;
  client.port = port;
  client.timeout = connect_timeout_;
  client.described_as = "the store of " + view.describe(0);
  comm::StorePtr store;
  try {
    store = comm::open_store(client);
  } catch (const UsageError& e) {
    throw CommError(std::string("elastic round ") + std::to_string(view.round) + ": " + e.what());
  }
  comm::GroupOptions options;
  options.timeout = connect_timeout_;
  options.bind_address = address_;
  options.store_prefix = "shoal/elastic/round/" + std::to_string(view.round);
  options.lost_check = [this, view] { return rendezvous_->lost(view); };
  auto group = comm::Group::create(store, view.rank, view.size(), options);
  group.set_timeout(timeout_);
  return make_round(view, std::move(group));
}

runtime::Round join(const runtime::Joining& joining) {
  return ElasticWorld::join(joining.job, joining.env, joining.connect_timeout, joining.timeout);
}

}  // namespace shoal::elastic
