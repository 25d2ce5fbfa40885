#include "job_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <exception>

#include "comm/store.h"
#include "shoal/core/error.h"

namespace shoal::launch {
namespace {

// Keys of the launchers; the workers' keys (comm::worker_exit_key) live under shoal/exit/.
const std::string kPrefix = "shoal/launch/";
const std::string kRunId = kPrefix + "run_id";
const std::string kNproc = kPrefix + "nproc_per_node";
const std::string kJoined = kPrefix + "joined";
const std::string kFailures = kPrefix + "failures";
const std::string kFailure = kPrefix + "failure";

std::string node_key(int node_rank, const std::string& what) {
  return kPrefix + "node/" + std::to_string(node_rank) + "/" + what;
}

std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// c10d logs each failed bind or connect attempt to stderr through glog (several lines, before
// LibTorch's logging is configured) and then raises anyway; open_store turns that into one line.
// So while a store is being opened, and no other thread of the launcher writes to stderr, fd 2
// points to /dev/null.
class QuietStderr {
 public:
  QuietStderr() : saved_(::fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3)) {
    int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (saved_ >= 0 && null_fd >= 0) ::dup2(null_fd, STDERR_FILENO);
    if (null_fd >= 0) ::close(null_fd);
  }
  ~QuietStderr() {
    if (saved_ < 0) return;
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  QuietStderr(const QuietStderr&) = delete;
  QuietStderr& operator=(const QuietStderr&) = delete;

 private:
  int saved_;
};

comm::StorePtr open_quietly(const comm::StoreOptions& options) {
  QuietStderr quiet;
  return comm::open_store(options);
}

}  // namespace

struct JobStore::State {
  comm::StorePtr store;
  int port = 0;
  std::string where;

  // Runs one store operation, turning c10d's errors into a CommError that says which store.
  template <typename F>
  auto guarded(F&& operation) -> decltype(operation()) {
    try {
      return operation();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError("lost the job's store at " + where + ": " + first_line(e.what()));
    }
  }
};

JobStore::JobStore(std::unique_ptr<State> state) : state_(std::move(state)) {}
JobStore::~JobStore() = default;

std::unique_ptr<JobStore> JobStore::host(int port, Duration timeout,
                                         const std::string& described_as,
                                         const std::string& run_id) {
  comm::StoreOptions options;
  // The server listens on every interface; the launcher's own connection to it goes over
  // loopback, so node 0 works whatever name the other nodes know it by.
  options.host = "127.0.0.1";
  options.port = port;
  options.is_server = true;
  options.timeout = timeout;
  options.described_as = described_as;
  // As shoal::init() names a job of shoal run's (JobSpec::job_id).
  options.job_id = "shoal run " + run_id;
  auto state = std::make_unique<State>();
  state->store = open_quietly(options);
  state->port = comm::hosted_port(state->store);
  state->where = described_as + " (port " + std::to_string(state->port) + ")";
  return std::unique_ptr<JobStore>(new JobStore(std::move(state)));
}

std::unique_ptr<JobStore> JobStore::connect(const std::string& host, int port, Duration timeout,
                                            const std::string& described_as) {
  comm::StoreOptions options;
  options.host = host;
  options.port = port;
  options.is_server = false;
  options.timeout = timeout;
  options.described_as = described_as;
  auto state = std::make_unique<State>();
  state->store = open_quietly(options);
  state->port = port;
  state->where = described_as + "=" + host + ":" + std::to_string(port);
  return std::unique_ptr<JobStore>(new JobStore(std::move(state)));
}

int JobStore::port() const { return state_->port; }
const std::string& JobStore::where() const { return state_->where; }

void JobStore::publish_job(const std::string& run_id, int nproc_per_node) {
  state_->guarded([&] {
    state_->store->set(kNproc, bytes(std::to_string(nproc_per_node)));
    // Last: its presence says the job is published.
    state_->store->set(kRunId, bytes(run_id));
  });
}

bool JobStore::job_published() {
  return state_->guarded([&] { return state_->store->check({kRunId}); });
}

std::string JobStore::run_id() {
  return state_->guarded([&] { return comm::try_get(state_->store, kRunId); });
}

int JobStore::nproc_per_node() {
  return state_->guarded([&] { return std::stoi("0" + comm::try_get(state_->store, kNproc)); });
}

bool JobStore::claim_node(int node_rank) {
  return state_->guarded([&] { return state_->store->add(node_key(node_rank, "claims"), 1) == 1; });
}

bool JobStore::node_claimed(int node_rank) {
  return state_->guarded([&] { return state_->store->check({node_key(node_rank, "claims")}); });
}

void JobStore::count_joined() {
  state_->guarded([&] { state_->store->add(kJoined, 1); });
}

int64_t JobStore::joined() {
  return state_->guarded([&] { return state_->store->add(kJoined, 0); });
}

void JobStore::record_exit(int rank, const std::string& how) {
  state_->guarded([&] { state_->store->set(comm::worker_exit_key(rank), bytes(how)); });
}

void JobStore::report_failure(const std::string& reason) {
  state_->guarded([&] {
    // The counter decides who was first, atomically; only the first writes the sentence.
    if (state_->store->add(kFailures, 1) == 1) state_->store->set(kFailure, bytes(reason));
  });
}

void JobStore::put(const std::string& key, const std::string& value) {
  state_->guarded([&] { comm::put(state_->store, key, value); });
}

std::string JobStore::get(const std::string& key) {
  return state_->guarded([&] { return comm::try_get(state_->store, key); });
}

int64_t JobStore::add(const std::string& key, int64_t amount) {
  return state_->guarded([&] { return state_->store->add(key, amount); });
}

std::string JobStore::failure() {
  return state_->guarded([&] { return comm::try_get(state_->store, kFailure); });
}

void JobStore::heartbeat(int node_rank) {
  state_->guarded([&] { state_->store->add(node_key(node_rank, "heartbeats"), 1); });
}

int64_t JobStore::heartbeats(int node_rank) {
  return state_->guarded([&] { return state_->store->add(node_key(node_rank, "heartbeats"), 0); });
}

void JobStore::mark_done(int node_rank) {
  state_->guarded([&] { state_->store->set(node_key(node_rank, "done"), bytes("1")); });
}

bool JobStore::is_done(int node_rank) {
  return state_->guarded([&] { return state_->store->check({node_key(node_rank, "done")}); });
}

}  // namespace shoal::launch
