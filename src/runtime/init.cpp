#include "shoal/runtime/init.h"

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>

#include <ATen/Parallel.h>

#include "shoal/core/error.h"
#include "shoal/runtime/world.h"

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

runtime::ElasticJoin& elastic_join() {
  static runtime::ElasticJoin join;
  return join;
}

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

Callbacks& parameter_waiters() {
  static Callbacks waiters;
  return waiters;
}

std::atomic<int> announcers{0};
std::atomic<uint64_t> backwards{0};

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

}  // namespace

void init(const InitOptions& options) {
  if (the_runtime != nullptr) throw UsageError("shoal::init() was already called in this process");
  const auto env = env::current();
  auto state = std::make_unique<Runtime>();
  state->job = discover_job(env, options.master);
  const JobSpec& job = state->job;
  set_threads(options, job, env);
  const Duration timeout = default_timeout(options, env);

  if (job.elastic) {
    SHOAL_CHECK(elastic_join() != nullptr) << "the elastic part did not register how to join";
    auto world = elastic_join()(job, env, options.connect_timeout, timeout);
    state->job = std::move(world.job);
    state->world = std::move(world.group);
  } else if (job.master_addr.empty()) {
    state->world = comm::Group::single();
  } else {
    comm::StoreOptions store;
    store.host = job.master_addr;
    store.port = job.master_port;
    store.is_server = !job.store_hosted_by_launcher && job.rank == 0;
    store.timeout = options.connect_timeout;
    store.described_as = job.master_described_as;
    state->store = comm::open_store(store);

    comm::GroupOptions group;
    group.timeout = options.connect_timeout;  // for connecting; collectives get `timeout`
    if (auto ifname = env::get(env, "SHOAL_SOCKET_IFNAME")) group.interface = *ifname;
    else if (auto gloo_ifname = env::get(env, "GLOO_SOCKET_IFNAME")) group.interface = *gloo_ifname;
    group.bind_address = comm::local_address_towards(job.master_addr, job.master_port);
    state->world = comm::Group::create(state->store, job.rank, job.world_size, group);
    state->world.set_timeout(timeout);
  }
  the_runtime = state.release();
}

bool is_initialized() { return the_runtime != nullptr; }
int world_size() { return current().job.world_size; }
bool is_main() { return current().job.rank == 0; }
int rank() { return current().job.rank; }
int local_rank() { return current().job.local_rank; }
const JobSpec& job() { return current().job; }
comm::Group& world() { return current().world; }

namespace runtime {

void register_elastic_join(ElasticJoin join) { elastic_join() = std::move(join); }

void replace_world(World world) {
  Runtime& state = current();
  state.job = std::move(world.job);
  state.world = std::move(world.group);
  world_listeners().call_all();
}

int add_world_listener(std::function<void()> listener) { return world_listeners().add(std::move(listener)); }
void remove_world_listener(int id) { world_listeners().remove(id); }

void before_parameters_change() { parameter_waiters().call_all(); }
int add_parameter_waiter(std::function<void()> wait) { return parameter_waiters().add(std::move(wait)); }
void remove_parameter_waiter(int id) { parameter_waiters().remove(id); }
void count_parameter_change_announcer(int delta) { announcers += delta; }
bool parameter_changes_announced() { return announcers.load() > 0; }
void count_synchronized_backward() { ++backwards; }
uint64_t synchronized_backwards() { return backwards.load(); }

}  // namespace runtime

void shutdown() {
  Runtime* state = the_runtime;
  the_runtime = nullptr;
  delete state;
}

}  // namespace shoal
