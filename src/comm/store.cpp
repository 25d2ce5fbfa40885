#include "comm/store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "shoal/core/error.h"
#include "state.h"

namespace shoal::comm {

namespace {

// c10d logs each failed bind and connect attempt (through c10's logging, to stderr) before it
// raises; open_store reports the failure in one line of its own. c10d's log calls are gated by
// FLAGS_caffe2_log_level, so while a store opens it is raised above ERROR. (The launcher, whose
// stderr has no other writer then, also points fd 2 to /dev/null: see job_store.cpp.)
class QuietC10d {
 public:
  QuietC10d() : saved_(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = 3; }
  ~QuietC10d() { FLAGS_caffe2_log_level = saved_; }
  QuietC10d(const QuietC10d&) = delete;
  QuietC10d& operator=(const QuietC10d&) = delete;

 private:
  int saved_;
};

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

std::string describe_job(const std::string& job_id) {
  return job_id.empty() ? "a job with no id" : job_id;
}

// A name that does not resolve is the user's to fix; c10d would report it as a failure to
// listen (server) or to connect (client). Passing resolver failures (EAI_AGAIN) are retried.
void check_resolves(const StoreOptions& options) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(options.host.c_str(), nullptr, &hints, &found);
  if (found != nullptr) freeaddrinfo(found);
  if (rc == EAI_NONAME || rc == EAI_FAIL
#ifdef EAI_NODATA
      || rc == EAI_NODATA
#endif
  ) {
    throw UsageError("cannot resolve the job's master host '" + options.host + "' (" +
                     options.described_as + "): " + gai_strerror(rc) + options.if_unresolved);
  }
}

// The client's side of Note [Job identity] (docs/runtime.md): the store must be this job's.
void check_job(c10d::Store& store, const StoreOptions& options, const std::string& where,
               const Deadline& deadline) {
  try {
    store.wait({kJobIdKey}, std::max(deadline.remaining(), Duration(100)));
  } catch (const std::exception&) {
    throw UsageError("the store at " + options.described_as + "=" + where +
                     " gave no job id within " + format_duration(deadline.elapsed()) +
                     ": it is not a shoal job's store; expected this job's (" +
                     describe_job(*options.job_id) + "), on a port of its own");
  }
  auto bytes = store.get(kJobIdKey);
  const std::string found(bytes.begin(), bytes.end());
  if (found != *options.job_id) {
    throw UsageError("the store at " + options.described_as + "=" + where + " belongs to " +
                     describe_job(found) + ", not to this job (" + describe_job(*options.job_id) +
                     "); give each job a port of its own");
  }
}

}  // namespace

// Note [Broken pipes]
// Gloo's TCP pairs send with writev(2), which takes no MSG_NOSIGNAL. When a peer dies between two
// of its reads, a survivor's next write to it raises SIGPIPE, and SIGPIPE's default action ends
// the survivor at once (Tcp.WorldSizes/KilledPeer saw "worker 2 ... killed by signal 13") where
// Gloo would have turned the EPIPE into the error that names the lost worker. Python ignores
// SIGPIPE at start-up, so PyTorch's users never meet this; a C++ program keeps the default. shoal
// therefore sets SIGPIPE to ignored before it opens a store connection or a group, as Python
// does, but only while it still has its default action: a program's own handler, or its own
// choice to ignore, stays. What a C++ program then sees on writing to a closed pipe is EPIPE, as a
// Python one does.
void ignore_broken_pipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) return;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, nullptr);
}

StorePtr open_store(const StoreOptions& options) {
  ignore_broken_pipes();
  c10d::TCPStoreOptions tcp;
  tcp.port = static_cast<uint16_t>(options.port);
  tcp.isServer = options.is_server;
  tcp.waitWorkers = false;
  tcp.timeout = options.timeout;
  const std::string where = options.host + ":" + std::to_string(options.port);
  Deadline deadline(options.timeout);
  QuietC10d quiet;
  // c10d's client gives up on a refused connection before its timeout is over; keep trying
  // until ours is.
  for (;;) {
    check_resolves(options);
    c10::intrusive_ptr<c10d::TCPStore> store;
    try {
      if (!options.is_server) tcp.timeout = std::max(deadline.remaining(), Duration(100));
      store = c10::make_intrusive<c10d::TCPStore>(options.host, tcp);
      store->setTimeout(options.timeout);
    } catch (const std::exception& e) {
      const std::string what = first_line(e.what());
      if (options.is_server) {
        throw UsageError("cannot host the job's store on " + options.described_as + " (port " +
                         std::to_string(options.port) + "): " + what +
                         "; expected a free port, or 0 to pick one");
      }
      if (deadline.remaining() < Duration(200)) {
        throw UsageError("cannot reach the job's master at " + options.described_as + "=" + where +
                         " after " + format_duration(deadline.elapsed()) + ": " + what);
      }
      continue;
    }
    if (options.job_id) {
      if (options.is_server) {
        store->set(kJobIdKey, std::vector<uint8_t>(options.job_id->begin(), options.job_id->end()));
      } else {
        check_job(*store, options, where, deadline);
      }
    }
    return store;
  }
}

int hosted_port(const StorePtr& store) {
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  SHOAL_CHECK(tcp != nullptr) << "hosted_port needs a TCPStore";
  return tcp->getPort();
}

std::string worker_exit_key(int rank) { return "shoal/exit/" + std::to_string(rank); }

void put(const StorePtr& store, const std::string& key, const std::string& value) {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string try_get(const StorePtr& store, const std::string& key) {
  if (!store->check({key})) return "";
  auto bytes = store->get(key);
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace shoal::comm
