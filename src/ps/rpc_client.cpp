// The parameter server's gRPC client (docs/ps.md, "Transport"): one server's calls with their
// deadlines, failover to a restarted server or its backup, and values through shared memory.
#include "rpc.h"

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/impl/rpc_service_method.h>
#include <grpcpp/support/method_handler.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <type_traits>

#include "ps.grpc.pb.h"
#include "rpc_common.h"
#include "shm.h"
#include "wire.h"
namespace shoal::ps::detail {

using namespace rpc;  // NOLINT: the transport's shared names (rpc_common.h)

namespace {

// Note [Which UNAVAILABLE fails over]: gRPC answers UNAVAILABLE when the connection to a server
// is refused or breaks (a SIGKILLed server: at once), and the service answers it too when its
// handler raised CommError before the call's deadline (a pull whose worker left the live set).
// Only the first means the server is gone. The service's own statuses always begin with the
// method's name and ": " (Service::serve, rpc_server.cpp), gRPC's never do: that tells them apart
// without a second round trip.
bool server_gone(const grpc::Status& status, const char* name) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         status.error_message().rfind(std::string(name) + ": ", 0) != 0;
}

// The service's methods on one channel.
struct Methods {
  explicit Methods(const std::shared_ptr<grpc::Channel>& channel)
      : register_tables(kRegisterMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        pull(kPullMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        push(kPushMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        ping(kPingMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        lease(kLeaseMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        membership(kMembershipMethod, grpc::internal::RpcMethod::NORMAL_RPC, channel) {}
  grpc::internal::RpcMethod register_tables, pull, push, ping, lease, membership;
};

// One address's channel; replaced whole on failover, so a call in flight keeps its own.
struct Endpoint {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  // Ping and Register when looking for a restarted server (State::reconnect).
  std::unique_ptr<pb::ParameterServer::Stub> stub;
  // The service's methods, registered with the channel once, as a generated stub does; calls
  // send and receive raw bytes (Note [Values without copies], wire.h).
  std::unique_ptr<Methods> methods;
};

std::shared_ptr<Endpoint> open_endpoint(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Servers are the job's own processes: an http_proxy in the environment must not be used.
  args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);
  // A server that was unreachable is tried again soon (gRPC's default backoff grows to 2 min).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto endpoint = std::make_shared<Endpoint>();
  endpoint->address = address;
  endpoint->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  endpoint->stub = pb::ParameterServer::NewStub(endpoint->channel);
  endpoint->methods = std::make_unique<Methods>(endpoint->channel);
  return endpoint;
}

}  // namespace

struct RpcClient::State {
  int index = 0;
  std::string token;
  std::vector<std::string> addresses;  // the primary's first, then its backups'

  mutable std::mutex mutex;
  size_t at = 0;  // addresses[at] is where calls go
  std::shared_ptr<Endpoint> endpoint;
  int failovers = 0;
  std::function<std::string()> resolve;
  std::optional<pb::RegisterRequest> registration;  // the last one, for a restarted server
  std::timed_mutex reconnecting;  // one call at a time looks for a restarted server

  // Note [Values in shared memory] (wire.h): one segment for this client's dense pushes and
  // pulls, used by one call at a time; a call that finds it taken sends its values inline.
  std::mutex segment_mutex;
  std::unique_ptr<SharedSegment> segment;
  std::atomic<bool> no_segment{false};  // the system or a server refused one: inline from now on
  std::atomic<int> shared_calls{0};
  // Note [The values' mirror] (mirror.h): the servers' mirrors this client has mapped; whether it
  // stopped offering to read them (one could not be mapped here); pulls answered from one, and
  // those pulled again because a change overlapped the copy.
  SegmentMappings mirrors{1, /*read_only=*/true};
  std::atomic<bool> no_mirror{false};
  std::atomic<int> mirrored_calls{0};
  std::atomic<int> mirror_retries{0};

  // The segment, with room for `values`, under segment_mutex; nullptr when there is none.
  SharedSegment* segment_for(size_t values) {
    if (no_segment) return nullptr;
    if (!segment || segment->values().capacity < values) {
      segment.reset();
      segment = SharedSegment::create(values);
      if (!segment) no_segment = true;
    }
    return segment.get();
  }

  std::shared_ptr<Endpoint> current() const {
    std::lock_guard<std::mutex> lock(mutex);
    return endpoint;
  }

  // Moves to the next address after `failed` was found gone. False when there is none. Calls
  // that fail on the same endpoint at once move the client once.
  bool fail_over(const std::shared_ptr<Endpoint>& failed) {
    std::lock_guard<std::mutex> lock(mutex);
    if (endpoint != failed) return true;
    if (at + 1 >= addresses.size()) return false;
    endpoint = open_endpoint(addresses[++at]);
    ++failovers;
    return true;
  }

  // Looks for a restarted server under the resolver's address until `deadline`, registers there
  // again and makes it the endpoint. False when there is no resolver or no server answered.
  bool reconnect(const std::shared_ptr<Endpoint>& failed, SystemClock::time_point deadline) {
    std::function<std::string()> resolver;
    std::optional<pb::RegisterRequest> registered;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (endpoint != failed) return true;
      resolver = resolve;
      registered = registration;
    }
    if (!resolver) return false;
    // A call that waits here for another's search still keeps its own deadline.
    std::unique_lock<std::timed_mutex> one(reconnecting, deadline);
    if (!one.owns_lock()) return false;
    if (current() != failed) return true;  // another call found it meanwhile
    while (SystemClock::now() < deadline) {
      const std::string address = resolver();
      if (!address.empty()) {
        auto fresh = open_endpoint(address);
        grpc::ClientContext context;
        context.set_deadline(std::min(deadline, SystemClock::now() + std::chrono::seconds(1)));
        context.AddMetadata(kTokenMetadata, token);
        pb::PingReply pong;
        if (fresh->stub->Ping(&context, pb::PingRequest(), &pong).ok()) {
          if (registered) {
            grpc::ClientContext again;
            again.set_deadline(deadline);
            again.AddMetadata(kTokenMetadata, token);
            pb::RegisterReply reply;
            const grpc::Status status = fresh->stub->Register(&again, *registered, &reply);
            if (!status.ok()) return false;
          }
          std::lock_guard<std::mutex> lock(mutex);
          endpoint = fresh;
          ++failovers;
          return true;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  std::string server(const Endpoint& endpoint) const {
    return "parameter server " + std::to_string(index) + " (" + endpoint.address + ")";
  }

  // `segment`: the handle of the shared segment the call's values are in; a server that cannot
  // use it answers FAILED_PRECONDITION, thrown here as SegmentUnusable for the caller to resend
  // the values inline.
  // `mirror`: the call offers to read the server's mirror (a pull).
  void call(const char* name, grpc::internal::RpcMethod Methods::*method, Duration timeout,
            const grpc::ByteBuffer& request, grpc::ByteBuffer& reply,
            const std::string* segment = nullptr, bool mirror = false) {
    const auto start = SteadyClock::now();
    const auto deadline = SystemClock::now() + std::max(timeout, Duration(0));
    for (;;) {
      const std::shared_ptr<Endpoint> endpoint = current();
      grpc::ClientContext context;
      context.set_deadline(deadline);
      context.AddMetadata(kTokenMetadata, token);
      if (segment != nullptr) context.AddMetadata(kSegmentMetadata, *segment);
      if (mirror) context.AddMetadata(kMirrorMetadata, "1");
      const grpc::Status status =
          grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
              endpoint->channel.get(), endpoint->methods.get()->*method, &context, request, &reply);
      if (status.ok()) return;
      // See Note [Which UNAVAILABLE fails over]; the retry keeps the call's deadline.
      if (server_gone(status, name) && SystemClock::now() < deadline &&
          (fail_over(endpoint) || reconnect(endpoint, deadline))) {
        reply.Clear();
        continue;
      }
      if (segment != nullptr && status.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        throw SegmentUnusable(status.error_message());
      const auto waited = std::chrono::duration_cast<Duration>(SteadyClock::now() - start);
      const std::string said = one_line(status.error_message());
      const std::string server = this->server(*endpoint);
      switch (status.error_code()) {
        case grpc::StatusCode::INVALID_ARGUMENT:
        case grpc::StatusCode::NOT_FOUND:
        case grpc::StatusCode::UNAUTHENTICATED:
          throw UsageError(server + " refused " + name + ": " + said);
        case grpc::StatusCode::DEADLINE_EXCEEDED:
          throw CommError(server + " did not answer " + name + " within its deadline of " +
                          format_duration(timeout) + " (waited " + format_duration(waited) + ")" +
                          (said == "Deadline Exceeded" ? "" : ": " + said));
        case grpc::StatusCode::UNAVAILABLE:
          throw CommError(server + " is unreachable: " + name + " failed after " +
                          format_duration(waited) + " (" + said + ")");
        default:
          throw CommError(server + " failed " + name + " after " + format_duration(waited) + ": " +
                          code_name(status.error_code()) + ": " + said);
      }
    }
  }

  // A reply that does not convert is the server's fault, not the caller's.
  template <typename Reply>
  Reply convert(const char* name, const char* type, const grpc::ByteBuffer& bytes) {
    Reply reply;
    convert(name, type, bytes, reply);
    return reply;
  }
  // The same into `reply`, whose storage is reused; `shm`: the segment the call brought.
  template <typename Reply>
  void convert(const char* name, const char* type, const grpc::ByteBuffer& bytes, Reply& reply,
               const SharedValues* shm = nullptr, const DenseSink* sink = nullptr,
               wire_format::MirrorReader* mirror = nullptr) {
    bool read = false;
    try {
      if constexpr (std::is_same_v<Reply, PullReply>) {
        read = wire_format::decode(bytes, reply, shm, sink, mirror);
      } else {
        read = wire_format::decode(bytes, reply);
      }
    } catch (const UsageError& e) {
      throw CommError(server(*current()) + " answered " + name +
                      " with a malformed reply: " + e.what());
    }
    if (!read) {
      throw CommError(server(*current()) + " answered " + name + " with a malformed reply: not a " +
                      type + " message (" + std::to_string(bytes.Length()) + " bytes)");
    }
  }
};

RpcClient::RpcClient(int index, const std::string& address, const std::string& token)
    : RpcClient(index, std::vector<std::string>{address}, token) {}

RpcClient::RpcClient(int index, std::vector<std::string> addresses, const std::string& token)
    : state_(std::make_unique<State>()) {
  keep_grpc_initialized();
  if (addresses.empty()) {
    throw UsageError("a client of parameter server " + std::to_string(index) +
                     " was given no address; expected at least one");
  }
  state_->index = index;
  state_->addresses = std::move(addresses);
  state_->token = token;
  state_->endpoint = open_endpoint(state_->addresses.front());
}

RpcClient::~RpcClient() = default;

int RpcClient::index() const {
  return state_->index;
}
std::string RpcClient::address() const {
  return state_->current()->address;
}
int RpcClient::failovers() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->failovers;
}

void RpcClient::set_resolver(std::function<std::string()> resolve) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->resolve = std::move(resolve);
}

void RpcClient::register_tables(const RegisterRequest& request, Duration timeout) {
  pb::RegisterRequest message;
  wire_format::to_wire(request, message);
  grpc::ByteBuffer bytes, reply;
  bool own = false;
  grpc::SerializationTraits<pb::RegisterRequest>::Serialize(message, &bytes, &own);
  state_->call("Register", &Methods::register_tables, timeout, bytes, reply);
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->registration = std::move(message);
}

PullReply RpcClient::pull(const PullRequest& request, Duration timeout) {
  PullReply reply;
  pull(request, timeout, reply);
  return reply;
}

// Values of at least this many floats go through the shared segment when there is one.
constexpr size_t kSharedAtLeast = 16 << 10;

void RpcClient::pull(const PullRequest& request, Duration timeout, PullReply& reply,
                     const DenseSink* sink) {
  State& state = *state_;
  const auto start = SteadyClock::now();
  const auto left = [&] {
    return timeout - std::chrono::duration_cast<Duration>(SteadyClock::now() - start);
  };
  const bool dense = !request.dense.empty();
  // Note [The values' mirror] (mirror.h): offered while this client can map servers' mirrors; a
  // copy that a change overlapped is pulled again without the offer.
  bool offer_mirror = dense && !state.no_mirror;
  for (;;) {
    std::unique_lock<std::mutex> lock(state.segment_mutex, std::defer_lock);
    const SharedSegment* segment = nullptr;
    if (dense && !state.no_segment && lock.try_lock() && state.segment && !state.no_segment)
      segment = state.segment.get();
    const SharedValues shared = segment ? segment->values() : SharedValues{};
    std::shared_ptr<const SegmentMapping> mapped;
    bool mirror_refused = false;
    wire_format::MirrorReader mirror;
    mirror.open = [&](const std::string& handle) {
      try {
        mapped = state.mirrors.open(handle);
      } catch (const SegmentUnusable&) {
        mirror_refused = true;
        throw;
      }
      return mapped->values();
    };
    try {
      grpc::ByteBuffer bytes;
      state.call("Pull", &Methods::pull, left(), wire_format::encode(request), bytes,
                 segment ? &segment->handle() : nullptr, offer_mirror);
      state.convert("Pull", "PullReply", bytes, reply, segment ? &shared : nullptr, sink,
                    offer_mirror ? &mirror : nullptr);
      if (segment) ++state.shared_calls;
      if (mirror.used) {
        ++state.mirrored_calls;
        const uint64_t now = mapped->sequence().load_after_reads();
        if (now != mirror.sequence || now % 2 != 0) {
          ++state.mirror_retries;
          offer_mirror = false;
          continue;
        }
      }
      return;
    } catch (const SegmentUnusable&) {
      // The server cannot map this client's segment, or this client the server's mirror: without
      // it from now on.
      (mirror_refused ? state.no_mirror : state.no_segment) = true;
      offer_mirror = offer_mirror && !mirror_refused;
    } catch (...) {
      // A server may still answer a call the client gave up on, into this segment: the next call
      // gets a new one.
      if (segment) state.segment.reset();
      throw;
    }
  }
}

PushReply RpcClient::push(const PushRequest& request, Duration timeout) {
  const auto start = SteadyClock::now();
  if (auto reply = push_shared(request, timeout, nullptr, false)) return *reply;
  return push_inline(request,
                     timeout - std::chrono::duration_cast<Duration>(SteadyClock::now() - start));
}

PushReply RpcClient::push(PushRequest& request, Duration timeout, const DenseSource& source) {
  const auto start = SteadyClock::now();
  if (auto reply = push_shared(request, timeout, &source, true)) return *reply;
  source.fill_slices(request.dense);  // in the message, from the request's slices
  return push_inline(request,
                     timeout - std::chrono::duration_cast<Duration>(SteadyClock::now() - start));
}

std::optional<PushReply> RpcClient::push_shared(const PushRequest& request, Duration timeout,
                                                const DenseSource* source, bool in_place) {
  State& state = *state_;
  const size_t values =
      source ? std::accumulate(source->counts.begin(), source->counts.end(), size_t{0})
             : wire_format::dense_values(request.dense);
  if (values < kSharedAtLeast || state.no_segment) return std::nullopt;
  std::unique_lock<std::mutex> lock(state.segment_mutex, std::try_to_lock);
  SharedSegment* segment = lock.owns_lock() ? state.segment_for(values) : nullptr;
  if (segment == nullptr) return std::nullopt;
  try {
    grpc::ByteBuffer reply;
    state.call("Push", &Methods::push, timeout,
               wire_format::encode(request, segment->values(), source, in_place), reply,
               &segment->handle());
    ++state.shared_calls;
    return state.convert<PushReply>("Push", "PushReply", reply);
  } catch (const SegmentUnusable&) {
    state.no_segment = true;  // this server cannot map it: values inline from now on
    return std::nullopt;
  } catch (...) {
    // A server may still answer a call the client gave up on, into this segment: the next call
    // gets a new one.
    state.segment.reset();
    throw;
  }
}

PushReply RpcClient::push_inline(const PushRequest& request, Duration timeout) {
  grpc::ByteBuffer reply;
  state_->call("Push", &Methods::push, timeout, wire_format::encode(request), reply);
  return state_->convert<PushReply>("Push", "PushReply", reply);
}

int RpcClient::shared_calls() const {
  return state_->shared_calls;
}
int RpcClient::mirrored_calls() const {
  return state_->mirrored_calls;
}
int RpcClient::mirror_retries() const {
  return state_->mirror_retries;
}
bool RpcClient::sharing() const {
  return !state_->no_segment;
}

LeaseReply RpcClient::lease(const LeaseRequest& request, Duration timeout) {
  pb::LeaseRequest message;
  wire_format::to_wire(request, message);
  grpc::ByteBuffer bytes, reply;
  bool own = false;
  grpc::SerializationTraits<pb::LeaseRequest>::Serialize(message, &bytes, &own);
  state_->call("Lease", &Methods::lease, timeout, bytes, reply);
  pb::LeaseReply answer;
  if (!grpc::SerializationTraits<pb::LeaseReply>::Deserialize(&reply, &answer).ok()) {
    throw CommError(state_->server(*state_->current()) +
                    " answered Lease with a malformed reply (" + std::to_string(reply.Length()) +
                    " bytes)");
  }
  try {
    return wire_format::from_wire(answer);
  } catch (const UsageError& e) {
    throw CommError(state_->server(*state_->current()) + " answered Lease with " + e.what());
  }
}

MembershipReply RpcClient::membership(const MembershipRequest& request, Duration timeout) {
  pb::MembershipRequest message;
  wire_format::to_wire(request, message);
  grpc::ByteBuffer bytes, reply;
  bool own = false;
  grpc::SerializationTraits<pb::MembershipRequest>::Serialize(message, &bytes, &own);
  state_->call("Membership", &Methods::membership, timeout, bytes, reply);
  pb::MembershipReply answer;
  if (!grpc::SerializationTraits<pb::MembershipReply>::Deserialize(&reply, &answer).ok() ||
      answer.clock() < 0) {
    throw CommError(state_->server(*state_->current()) +
                    " answered Membership with a malformed reply (" +
                    std::to_string(reply.Length()) + " bytes)");
  }
  return {answer.clock()};
}

int RpcClient::ping(Duration timeout) {
  grpc::ByteBuffer bytes, reply;
  bool own = false;
  grpc::SerializationTraits<pb::PingRequest>::Serialize(pb::PingRequest(), &bytes, &own);
  state_->call("Ping", &Methods::ping, timeout, bytes, reply);
  pb::PingReply message;
  if (!grpc::SerializationTraits<pb::PingReply>::Deserialize(&reply, &message).ok()) {
    throw CommError(state_->server(*state_->current()) + " answered Ping with a malformed reply (" +
                    std::to_string(reply.Length()) + " bytes)");
  }
  return message.server();
}

}  // namespace shoal::ps::detail
