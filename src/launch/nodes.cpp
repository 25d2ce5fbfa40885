#include "nodes.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "core/token.h"
#include "shoal/core/error.h"

namespace shoal::launch {
namespace {

std::string address(const LaunchOptions& options) {
  return options.master_described_as + "=" + options.master_addr() + ":" +
         std::to_string(options.master_port);
}

// Whether something accepts TCP connections at host:port right now. Probing before c10d
// connects keeps the wait for node 0 interruptible: c10d's own connect blocks in one call.
bool is_listening(const LaunchOptions& options) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string host = options.master_addr();
  int rc = ::getaddrinfo(host.c_str(), std::to_string(options.master_port).c_str(), &hints, &found);
  if (rc == EAI_NONAME) {
    throw UsageError(options.master_described_as + ": cannot resolve host '" + host + "' (" +
                     ::gai_strerror(rc) + ")");
  }
  if (rc != 0) return false;  // perhaps a passing DNS failure: try again
  bool listening = false;
  for (addrinfo* entry = found; entry != nullptr && !listening; entry = entry->ai_next) {
    proc::Fd socket(::socket(entry->ai_family, entry->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                       entry->ai_protocol));
    if (!socket.valid()) continue;
    if (::connect(socket.get(), entry->ai_addr, entry->ai_addrlen) == 0) {
      listening = true;
    } else if (errno == EINPROGRESS) {
      pollfd poll_entry{socket.get(), POLLOUT, 0};
      int error = 0;
      socklen_t length = sizeof(error);
      listening = ::poll(&poll_entry, 1, 1000) == 1 &&
                  ::getsockopt(socket.get(), SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
    }
  }
  ::freeaddrinfo(found);
  return listening;
}

// Whether `port` is taken on this host. Checked before c10d binds so that the common mistake gets
// a short message; c10d's own failure (a port taken in between) is still reported, at length.
bool port_in_use(int port) {
  for (int family : {AF_INET6, AF_INET}) {
    proc::Fd socket(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!socket.valid()) continue;  // no IPv6 here: try IPv4
    int yes = 1, no = 0;
    ::setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    int rc;
    if (family == AF_INET6) {
      ::setsockopt(socket.get(), IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof(no));
      sockaddr_in6 address{};
      address.sin6_family = AF_INET6;
      address.sin6_addr = in6addr_any;
      address.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(socket.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address));
    } else {
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_ANY);
      address.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(socket.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address));
    }
    if (rc == 0) return false;
    if (errno == EADDRINUSE) return true;
  }
  return false;
}

}  // namespace

std::unique_ptr<JobStore> open_job_store(const LaunchOptions& options, SignalSet& signals,
                                         const std::string& run_id) {
  if (options.hosts_store()) {
    if (options.master_port != 0 && port_in_use(options.master_port)) {
      throw UsageError(options.master_described_as + ": port " + std::to_string(options.master_port) +
                       " is already in use on this host; pick a free port" +
                       (options.nnodes == 1 ? ", or omit it to use any free port" : ""));
    }
    return JobStore::host(options.master_port, options.connect_timeout, options.master_described_as,
                          run_id);
  }
  Deadline deadline(options.connect_timeout);
  while (!is_listening(options)) {
    if (deadline.expired()) {
      throw UsageError("cannot reach node 0 at " + address(options) + " after " +
                       format_duration(deadline.timeout()) +
                       ": nothing listens there (is `shoal run --node-rank 0` running with the "
                       "same --master?)");
    }
    if (int signal = signals.wait_for_stop(std::min(Duration(200), deadline.remaining()))) {
      throw Interrupted(signal);
    }
  }
  return JobStore::connect(options.master_addr(), options.master_port,
                           std::max(deadline.remaining(), Duration(5000)),
                           options.master_described_as);
}

std::string make_run_id() { return random_hex(16); }

NodeGroup::NodeGroup(JobStore& store, const LaunchOptions& options, SignalSet& signals,
                     Sink& messages)
    : store_(store), options_(options), signals_(signals), messages_(messages) {}

template <typename Ready, typename What>
void NodeGroup::wait_until(Ready ready, What what) {
  Deadline deadline(options_.connect_timeout);
  while (!ready()) {
    if (deadline.expired()) {
      std::string reason = "node " + std::to_string(options_.node_rank) + " timed out after " +
                           format_duration(deadline.timeout()) + " waiting for " + what();
      report_failure(reason);  // so that the nodes that did join stop waiting too
      throw CommError(reason);
    }
    if (int signal = signals_.wait_for_stop(std::min(Duration(100), deadline.remaining()))) {
      throw Interrupted(signal);
    }
  }
}

std::string NodeGroup::missing_nodes() {
  std::string missing;
  int count = 0;
  for (int node = 0; node < options_.nnodes; ++node) {
    if (store_.node_claimed(node)) continue;
    if (++count <= 8) missing += (missing.empty() ? "" : ", ") + std::to_string(node);
  }
  if (count > 8) missing += ", ... (" + std::to_string(count) + " in all)";
  return missing;
}

std::string NodeGroup::join(const std::string& run_id) {
  if (options_.hosts_store()) store_.publish_job(run_id, options_.nproc_per_node);
  if (options_.nnodes == 1) return run_id;

  const std::string node = "node " + std::to_string(options_.node_rank);
  if (!store_.claim_node(options_.node_rank)) {
    // This launcher is not part of the job: it must not report a failure, nor say that node
    // `node_rank` is done, on behalf of the launcher that owns the rank.
    excluded_ = true;
    throw UsageError("--node-rank " + std::to_string(options_.node_rank) +
                     " is taken: another shoal run already joined " + address(options_) + " as " + node);
  }
  std::string job_run_id = run_id;
  if (!options_.hosts_store()) {
    wait_until([&] { return store_.job_published(); },
               [&] { return std::string("node 0 to publish the job at ") + address(options_); });
    job_run_id = store_.run_id();
    const int node0_nproc = store_.nproc_per_node();
    if (node0_nproc != options_.nproc_per_node) {
      std::string reason = node + " was started with -n " + std::to_string(options_.nproc_per_node) +
                           " but node 0 with -n " + std::to_string(node0_nproc) +
                           "; every node must start the same number of workers";
      report_failure(reason);
      throw UsageError(reason);
    }
  }
  store_.count_joined();
  wait_until([&] { return !store_.failure().empty() || store_.joined() >= options_.nnodes; },
             [&] {
               return "all " + std::to_string(options_.nnodes) + " nodes to join at " +
                      address(options_) + "; missing: node " + missing_nodes();
             });
  std::string failure = store_.failure();
  if (!failure.empty()) throw CommError("the job failed before its workers started: " + failure);
  return job_run_id;
}

std::string NodeGroup::check() {
  if (options_.nnodes == 1 || lost_ || excluded_) return "";
  try {
    store_.heartbeat(options_.node_rank);
    return store_.failure();
  } catch (const Error&) {
    lost_ = true;
    throw;
  }
}

void NodeGroup::record_exit(int rank, const std::string& how) {
  if (lost_ || excluded_) return;
  try {
    store_.record_exit(rank, how);
  } catch (const Error&) {
    lost_ = true;
  }
}

void NodeGroup::report_failure(const std::string& reason) {
  if (lost_ || excluded_) return;
  try {
    store_.report_failure(reason);
  } catch (const Error&) {
    lost_ = true;
  }
}

std::string NodeGroup::finish() {
  if (lost_ || excluded_) return "";
  try {
    store_.mark_done(options_.node_rank);
    if (!options_.hosts_store() || options_.nnodes == 1) return store_.failure();

    // Workers of the other nodes may still use the store (and their launchers report through
    // it), so node 0 keeps it up while their launchers live. A node is given up on after
    // kSilenceLimit without a heartbeat.
    struct Waiting {
      int64_t heartbeats = -1;
      Deadline::Clock::time_point changed = Deadline::Clock::now();
    };
    std::map<int, Waiting> waiting;
    for (int node = 1; node < options_.nnodes; ++node) {
      // A node that never joined does not use the store (and will not say it is done).
      if (store_.node_claimed(node)) waiting[node] = Waiting{};
    }
    while (!waiting.empty()) {
      const auto now = Deadline::Clock::now();
      for (auto it = waiting.begin(); it != waiting.end();) {
        const int node = it->first;
        if (store_.is_done(node)) {
          it = waiting.erase(it);
          continue;
        }
        const int64_t beats = store_.heartbeats(node);
        if (beats != it->second.heartbeats) {
          it->second = Waiting{beats, now};
        } else if (now - it->second.changed > kSilenceLimit) {
          messages_.write("shoal run: node " + std::to_string(node) + "'s launcher gave no sign of life for " +
                          format_duration(kSilenceLimit) + "; no longer hosting the store for it\n");
          it = waiting.erase(it);
          continue;
        }
        ++it;
      }
      if (!waiting.empty() && signals_.wait_for_stop(Duration(100)) != 0) break;
    }
    return store_.failure();
  } catch (const Error&) {
    lost_ = true;
    return "";
  }
}

}  // namespace shoal::launch
