#include "shoal/runtime/init.h"

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include <ATen/Parallel.h>

#include "shoal/core/error.h"
#include "comm/store.h"
#include "core/timeline_start.h"
#include "shoal/core/timeline.h"
#include "runtime/job_discovery.h"
#include "runtime/world.h"

namespace shoal {
namespace {

struct Runtime {
  JobSpec job;
  comm::StorePtr store;
  comm::Group world;
};

// Deliberately never destroyed: at exit, peers may still hold connections to this process's
// group, and c10d's destructor would wait for their operations.
Runtime* the_runtime = nullptr;

// Callbacks by id, called in the order they were added.
class Callbacks {
 public:
  int add(std::function<void()> callback) {
    callbacks_.emplace(++last_id_, std::move(callback));
    return last_id_;
  }
  void remove(int id) { callbacks_.erase(id); }
  void call_all() {
    for (auto& [id, callback] : callbacks_) callback();
  }

 private:
  std::map<int, std::function<void()>> callbacks_;
  int last_id_ = 0;
};

Callbacks& world_listeners() {
  static Callbacks listeners;
  return listeners;
}


Runtime& current() {
  if (the_runtime == nullptr) throw UsageError("shoal::init() has not been called");
  return *the_runtime;
}

int cores_on_host() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
}

void set_threads(const InitOptions& options, const JobSpec& job, const env::Environment& env) {
  if (options.intra_op_threads > 0) {
    at::set_num_threads(options.intra_op_threads);
    return;
  }
  if (auto n = env::get_int(env, "SHOAL_NUM_THREADS", 1)) {
    at::set_num_threads(static_cast<int>(*n));
    return;
  }
  if (env.count("OMP_NUM_THREADS")) return;  // the user's choice, already applied by OpenMP
  at::set_num_threads(std::max(1, cores_on_host() / std::max(1, job.local_world_size)));
}

Duration default_timeout(const InitOptions& options, const env::Environment& env) {
  if (options.timeout != kUnsetTimeout) {
    if (options.timeout.count() <= 0) throw UsageError("InitOptions::timeout must be positive");
    return options.timeout;
  }
  if (auto seconds = env::get_int(env, "SHOAL_TIMEOUT", 1)) return std::chrono::seconds(*seconds);
  return comm::kDefaultGroupTimeout;
}

// What to set when the master's host name does not resolve, in the launcher's terms.
std::string if_unresolved(const JobSpec& job) {
  if (job.launcher == "shoal") {
    return "; give shoal run --master a name or address that every node resolves";
  }
  if (job.launcher == "torchrun")
    return "; set MASTER_ADDR to a name or address every worker resolves";
  return "; set MASTER_ADDR (or SHOAL_MASTER=HOST:PORT) to a name or address of " +
         std::string(job.launcher == "slurm" ? "the job's first node" : "rank 0's host") +
         " that every worker resolves";
}

comm::StoreOptions store_options(const JobSpec& job, Duration timeout) {
  comm::StoreOptions store;
  store.host = job.master_addr;
  store.port = job.master_port;
  store.is_server = job.hosts_store;
  store.timeout = timeout;
  store.described_as = job.master_described_as;
  if (job.store_names_job) store.job_id = job.job_id;
  store.if_unresolved = if_unresolved(job);
  return store;
}

// See Note [mpirun's host] in docs/runtime.md. The candidates that can lead from this host
// to another one: not this host's own addresses, not those it has no route to.
std::vector<std::string> routable_candidates(const JobSpec& job) {
  std::vector<std::string> routable;
  for (const auto& address : job.master_candidates) {
    const std::string via = comm::local_address_towards(address, job.master_port);
    if (via != address && via != "127.0.0.1") routable.push_back(address);
  }
  return routable;
}

std::string joined(const std::vector<std::string>& items) {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : ", ") + item;
  return text;
}

// Opens the job's store. A worker away from a store host with several addresses tries them in
// turn, a second at a time, until one answers as this job's store; job.master_addr becomes it.
comm::StorePtr open_job_store(JobSpec& job, Duration timeout) {
  if (job.master_candidates.size() < 2 || job.on_master_host || job.hosts_store) {
    return comm::open_store(store_options(job, timeout));
  }
  const std::vector<std::string> candidates = routable_candidates(job);
  if (candidates.empty()) {
    throw UsageError("this host has no route to any address of " + job.master_described_as + " (" +
                     joined(job.master_candidates) +
                     "); set SHOAL_MASTER=HOST:PORT to an address of mpirun's host that every "
                     "worker reaches");
  }
  Deadline deadline(timeout);
  std::string last_error;
  for (size_t i = 0;; i = (i + 1) % candidates.size()) {
    JobSpec attempt = job;
    attempt.master_addr = candidates[i];
    const Duration slice = candidates.size() == 1
                               ? deadline.remaining()
                               : std::min<Duration>(std::chrono::seconds(1), deadline.remaining());
    try {
      auto store = comm::open_store(store_options(attempt, std::max(slice, Duration(100))));
      store->setTimeout(timeout);
      job.master_addr = candidates[i];
      return store;
    } catch (const UsageError& e) {
      last_error = e.what();
    }
    if (deadline.expired()) {
      throw UsageError("cannot reach the job's master at " + job.master_described_as + " (" +
                       joined(candidates) + ", port " + std::to_string(job.master_port) +
                       ") within " + format_duration(deadline.elapsed()) + "; last: " + last_error);
    }
  }
}

// Note [A wrong environment fails every worker at once]
// Workers check what they read alike (world size, the store's address, Slurm's whole task
// layout) identically, so such a mistake fails all of them. What only one worker can see (its
// SLURM_LOCALID against its node's task count, say) fails that one; it then posts its error in
// the store under shoal/init/<attempt>/failure, and every worker checks in there before building
// the world group: it counts itself under .../arrived and polls until all have arrived or a
// failure is posted, which it raises as its own UsageError. The poll has the connect timeout as
// its deadline. Whoever hosts the store (a failing worker that would host it hosts it anyway)
// keeps it up until every worker has read the failure (each counts itself under .../heard),
// since the others may connect only later.
std::string init_key(const env::Environment& env, const std::string& what) {
  // torchrun restarts workers against the same agent store: each attempt has its own keys.
  return "shoal/init/" + env::get(env, "TORCHELASTIC_RESTART_COUNT").value_or("0") + "/" + what;
}

std::string this_worker() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return "a worker on host " + std::string(host) + " (pid " + std::to_string(getpid()) + ")";
}

// Every worker counts itself under .../heard once it has posted or read a failure.
void wait_until_all_heard(const comm::StorePtr& store, const JobSpec& job,
                          const env::Environment& env, const Deadline& deadline) {
  while (store->add(init_key(env, "heard"), 0) < job.world_size && !deadline.expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void check_in(const comm::StorePtr& store, const JobSpec& job, const env::Environment& env,
              Duration timeout) {
  const std::string arrived = init_key(env, "arrived"), failure = init_key(env, "failure");
  store->add(arrived, 1);
  Deadline deadline(timeout);
  auto pause = std::chrono::milliseconds(2);
  for (;;) {
    const std::string posted = comm::try_get(store, failure);
    if (!posted.empty()) {
      store->add(init_key(env, "heard"), 1);
      // The others may not have connected yet: the host keeps the store up until they heard.
      if (job.hosts_store) wait_until_all_heard(store, job, env, deadline);
      throw UsageError("the job cannot start: " + posted);
    }
    const int64_t count = store->add(arrived, 0);
    if (count >= job.world_size) return;
    if (deadline.expired()) {
      throw CommError("only " + std::to_string(count) + " of " + std::to_string(job.world_size) +
                      " workers reached the job's store at " + job.master_described_as + "=" +
                      job.master_addr + ":" + std::to_string(job.master_port) + " within " +
                      format_duration(deadline.timeout()));
    }
    std::this_thread::sleep_for(std::min<Duration>(pause, deadline.remaining()));
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

// See Note [A wrong environment fails every worker at once]. Best effort: the worker raises its
// own error in any case.
void tell_the_job(const env::Environment& env, const InitOptions& options,
                  const std::string& error) {
  try {
    JobSpec job = discover_job_store(env, options.master);
    if (job.master_addr.empty() || job.world_size <= 1) return;
    auto store = open_job_store(job, options.connect_timeout);
    const std::string message = this_worker() + " found: " + error;
    if (store->add(init_key(env, "failures"), 1) == 1)
      comm::put(store, init_key(env, "failure"), message);
    store->add(init_key(env, "heard"), 1);
    if (job.hosts_store) wait_until_all_heard(store, job, env, Deadline(options.connect_timeout));
  } catch (const std::exception&) {
  }
}

// What the timeline calls the job, to tell its file from an earlier run's: the launcher's id;
// "" (a run of its own) for a job of one; nullopt when the workers must agree on a name, which
// rank 0 then makes up and shares through the store.
std::optional<std::string> timeline_job(const JobSpec& job) {
  if (!job.job_id.empty()) return job.job_id;
  if (job.world_size <= 1 && !job.elastic) return std::string();
  return std::nullopt;
}

std::string unnamed_job_token() {
  std::random_device random;
  return "unnamed job " + std::to_string(random()) + "-" + std::to_string(random());
}

}  // namespace

namespace runtime {

Joining prepare(const InitOptions& options) {
  if (the_runtime != nullptr) throw UsageError("shoal::init() was already called in this process");
  Joining joining;
  joining.env = env::current();
  try {
    joining.job = discover_job(joining.env, options.master);
    timeline::start(joining.env, joining.job.rank, timeline_job(joining.job));
  } catch (const UsageError& e) {
    tell_the_job(joining.env, options, e.what());
    throw;
  }
  set_threads(options, joining.job, joining.env);
  joining.connect_timeout = options.connect_timeout;
  joining.timeout = default_timeout(options, joining.env);
  return joining;
}

void start(Round round) {
  auto state = std::make_unique<Runtime>();
  state->job = std::move(round.job);
  state->world = std::move(round.group);
  the_runtime = state.release();
}

void start(Joining joining, const InitOptions& options) {
  if (joining.job.elastic) {
    throw UsageError("an elastic job (shoal run --min/--max) is joined by shoal::init(), which forms its rounds");
  }
  const env::Environment& env = joining.env;
  const Duration timeout = joining.timeout;
  auto state = std::make_unique<Runtime>();
  state->job = std::move(joining.job);
  const JobSpec& job = state->job;
  if (job.master_addr.empty() || env::get_bool(env, "SHOAL_SEPARATE_WORKERS").value_or(false)) {
    // A job of one, or one whose workers share no group (an elastic parameter-server job, whose
    // workers train through the servers and come and go, docs/ps.md): each a world of its own.
    state->world = comm::Group::single();
  } else {
    state->store = open_job_store(state->job, options.connect_timeout);
    // See Note [mpirun's host]: a worker that reached mpirun's host from elsewhere says at
    // which address before it checks in, so the workers there know it once all have.
    const bool settles_address = state->job.master_candidates.size() > 1;
    if (settles_address && !state->job.on_master_host) {
      comm::put(state->store, init_key(env, "master_reached_at"), state->job.master_addr);
    }
    try {
      check_in(state->store, job, env, options.connect_timeout);
      if (settles_address && state->job.on_master_host) {
        const std::string reached = comm::try_get(state->store, init_key(env, "master_reached_at"));
        if (!reached.empty()) state->job.master_addr = reached;
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string what = e.what();
      throw CommError("lost the job's store at " + job.master_described_as + "=" + job.master_addr +
                      ":" + std::to_string(job.master_port) + " while the workers checked in: " +
                      what.substr(0, what.find('\n')));
    }

    comm::GroupOptions group;
    group.timeout = options.connect_timeout;  // for connecting; collectives get `timeout`
    if (auto ifname = env::get(env, "SHOAL_SOCKET_IFNAME")) group.interface = *ifname;
    else if (auto gloo_ifname = env::get(env, "GLOO_SOCKET_IFNAME")) group.interface = *gloo_ifname;
    group.bind_address = comm::local_address_towards(job.master_addr, job.master_port);
    if (timeline::enabled() && !timeline_job(job) && job.rank == 0) {
      comm::put(state->store, init_key(env, "timeline"), unnamed_job_token());
    }
    state->world = comm::Group::create(state->store, job.rank, job.world_size, group);
    state->world.set_timeout(timeout);
    // Group::create ends with a barrier: the name is in the store by now.
    if (timeline::enabled() && !timeline_job(job))
      timeline::set_job(comm::try_get(state->store, init_key(env, "timeline")));
  }
  the_runtime = state.release();
}

void join_implicitly(const std::string& who) {
  if (the_runtime != nullptr) return;
  if (env::get_bool(env::current(), "SHOAL_ELASTIC").value_or(false)) {
    throw UsageError(who + " in an elastic job (shoal run --min/--max) before shoal::init(): call shoal::init() "
                     "first; it joins the job's first round");
  }
  const InitOptions options;
  start(prepare(options), options);
}

}  // namespace runtime

bool is_initialized() { return the_runtime != nullptr; }
int world_size() { return current().job.world_size; }
bool is_main() { return current().job.rank == 0; }
int rank() { return current().job.rank; }
int local_rank() { return current().job.local_rank; }
const JobSpec& job() { return current().job; }
comm::Group& world() { return current().world; }

namespace runtime {

void replace_world(Round round) {
  Runtime& state = current();
  state.job = std::move(round.job);
  state.world = std::move(round.group);
  timeline::set_rank(state.job.rank);
  world_listeners().call_all();
}

int add_world_listener(std::function<void()> listener) { return world_listeners().add(std::move(listener)); }
void remove_world_listener(int id) { world_listeners().remove(id); }


}  // namespace runtime

void shutdown() {
  Runtime* state = the_runtime;
  the_runtime = nullptr;
  delete state;
}

}  // namespace shoal
