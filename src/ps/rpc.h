// The parameter server's transport (docs/ps.md, "Transport"): a gRPC service that carries the
// structs of messages.h between a worker's RpcClient and a server's RpcServer, which hands them
// to a Handler. gRPC stays behind these classes: this header includes none of it.
//
// Contract: every call carries the job's token (metadata "shoal-job-token") and a deadline. The
// server validates a request before the handler sees it; a malformed one is refused with
// INVALID_ARGUMENT and the server goes on serving. On the worker's side a refusal (bad request,
// unknown table, wrong token) is a UsageError carrying the server's one-line message; a server
// that cannot be reached, died or did not answer in time is a CommError naming the server (index
// and address), the call and how long it waited.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "handler.h"
#include "messages.h"
#include "shoal/core/timeout.h"

namespace shoal::ps::detail {

// The gRPC metadata key that carries the job's token.
inline constexpr const char* kTokenMetadata = "shoal-job-token";
// The gRPC metadata key that names the worker's shared segment (Note [Shared segments], shm.h).
inline constexpr const char* kSegmentMetadata = "shoal-ps-shm";
// The gRPC metadata key by which a pull offers to read the server's mirror (Note [The values'
// mirror], mirror.h); its value is "1".
inline constexpr const char* kMirrorMetadata = "shoal-ps-mirror";

struct RpcServerOptions {
  std::string host = "0.0.0.0";  // the interface to listen on
  int port = 0;                  // 0: any free port (see RpcServer::port)
  int index = 0;                 // the server's index in the job, answered by Ping
  std::string token;             // the job's token; calls without it are refused
};

class RpcServer {
 public:
  // Listens and serves on gRPC's threads until shutdown(). UsageError (one line) when the
  // address cannot be bound or the token is empty.
  RpcServer(Handler& handler, const RpcServerOptions& options);
  ~RpcServer();  // shutdown(0)
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  int port() const;
  // Stops accepting calls, lets calls under way finish for up to `grace`, then cancels the rest.
  void shutdown(Duration grace);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// One channel to one server index. Thread-safe: calls from several threads share the channel.
//
// Failover (docs/ps.md, "Replicas and snapshots"): given the addresses of an index's primary and
// its backup, a call the primary cannot take (its connection refused or reset: the process is
// gone) is sent again to the backup within the same deadline, and every later call goes there.
// A server that answers, even with an error, is never failed over from. The caller sees one
// server that did not die; retried pushes are answered as before by the core (Note [Retried
// pushes] in server_core.h).
class RpcClient {
 public:
  // Connects lazily (the first call). `index` and `address` ("host:port") name the server in
  // errors.
  RpcClient(int index, const std::string& address, const std::string& token);
  // `addresses`: the primary's first, then its backup's (one or more, tried in order).
  RpcClient(int index, std::vector<std::string> addresses, const std::string& token);
  ~RpcClient();
  RpcClient(const RpcClient&) = delete;
  RpcClient& operator=(const RpcClient&) = delete;

  int index() const;
  // The address calls go to now (the backup's after a failover).
  std::string address() const;
  // How many times this client moved to the next address or reconnected to a restarted server.
  int failovers() const;
  // Pushes and pulls that named this client's shared segment and were answered (docs/ps.md,
  // "Transport": a server on this host), and whether the client still offers one.
  int shared_calls() const;
  bool sharing() const;
  // Pulls answered from the server's mirror (Note [The values' mirror], mirror.h), and those of
  // them pulled again because a change of the values overlapped the copy.
  int mirrored_calls() const;
  int mirror_retries() const;

  // Reconnection (docs/ps.md, "Replicas and snapshots"): when the server is gone and no backup is
  // left, the client asks `resolve` for the index's address (the job's store, where a restarted
  // server publishes its new one) until a server there answers, within the call's deadline; it
  // registers there again with this client's last registration, and retries the call.
  void set_resolver(std::function<std::string()> resolve);

  // Each call ends within `timeout` (plus the time to convert its reply).
  void register_tables(const RegisterRequest& request, Duration timeout);
  PullReply pull(const PullRequest& request, Duration timeout);
  // The same into `reply`, whose vectors keep their storage (a worker's pull of each step).
  // `sink`: takes dense values that came through the shared segment where they are (DenseSink,
  // messages.h); values that came in the message stay in `reply`.
  void pull(const PullRequest& request, Duration timeout, PullReply& reply,
            const DenseSink* sink = nullptr);
  PushReply push(const PushRequest& request, Duration timeout);
  // A worker's push of its step: the dense values are written by `source` where they are sent
  // from (DenseSource, messages.h; the request's slices carry none, and are filled when the values
  // go inline). Through the shared segment they are sent in place (Note [Pushes read in place] in
  // server_steps.cpp): the caller's next call to this server must come after the push is applied,
  // as a worker's next pull does.
  PushReply push(PushRequest& request, Duration timeout, const DenseSource& source);
  // Liveness: returns the index the server was started with.
  int ping(Duration timeout);
  // A batch of the epoch's ledger (server 0).
  LeaseReply lease(const LeaseRequest& request, Duration timeout);
  MembershipReply membership(const MembershipRequest& request, Duration timeout);

 private:
  // A push through the shared segment, or nullopt where there is none or the values are few.
  std::optional<PushReply> push_shared(const PushRequest& request, Duration timeout,
                                       const DenseSource* source, bool in_place);
  PushReply push_inline(const PushRequest& request, Duration timeout);

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shoal::ps::detail
