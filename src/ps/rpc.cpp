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
#include "shm.h"
#include "wire.h"

namespace shoal::ps::detail {
namespace {

namespace pb = ::shoal::ps::wire;
using SystemClock = std::chrono::system_clock;
using SteadyClock = std::chrono::steady_clock;

// Well above any one request of a sane job (a dense push is cut into chunks per server) and
// below what a hostile peer could make the server allocate in one message.
constexpr int kMaxMessageBytes = 1 << 30;
constexpr const char* kService = "/shoal.ps.wire.ParameterServer/";
constexpr const char* kRegisterMethod = "/shoal.ps.wire.ParameterServer/Register";
constexpr const char* kPullMethod = "/shoal.ps.wire.ParameterServer/Pull";
constexpr const char* kPushMethod = "/shoal.ps.wire.ParameterServer/Push";
constexpr const char* kPingMethod = "/shoal.ps.wire.ParameterServer/Ping";
constexpr const char* kLeaseMethod = "/shoal.ps.wire.ParameterServer/Lease";
constexpr const char* kMembershipMethod = "/shoal.ps.wire.ParameterServer/Membership";

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  std::replace(text.begin(), text.end(), '\r', ' ');
  return text;
}

const char* code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "an unknown status";
  }
}

// Compares without stopping at the first difference, so the time taken says nothing about how
// much of a guessed token was right.
bool same_token(grpc::string_ref got, const std::string& expected) {
  if (got.size() != expected.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < expected.size(); ++i) diff |= got.data()[i] ^ expected[i];
  return diff == 0;
}

// Note [Raw requests]: the service's methods receive a request's raw bytes and parse them here,
// not in gRPC's generated code, which answers a message that does not parse with INTERNAL and no
// text. Here it is INVALID_ARGUMENT naming the call, and the token is checked before any parsing.
class Service : public grpc::Service {
 public:
  Service(Handler& handler, const ServerOptions& options)
      : handler_(handler), token_(options.token), index_(options.index) {
    add("Register", &Service::register_tables);
    add("Pull", &Service::pull);
    add("Push", &Service::push);
    add("Ping", &Service::ping);
    add("Lease", &Service::lease);
    add("Membership", &Service::membership);
  }

 private:
  using Method = grpc::Status (Service::*)(grpc::ServerContext*, const grpc::ByteBuffer*,
                                           grpc::ByteBuffer*);

  void add(const std::string& name, Method method) {
    names_.push_back(std::make_unique<std::string>(kService + name));
    AddMethod(new grpc::internal::RpcServiceMethod(
        names_.back()->c_str(), grpc::internal::RpcMethod::NORMAL_RPC,
        new grpc::internal::RpcMethodHandler<Service, grpc::ByteBuffer, grpc::ByteBuffer>(
            [method](Service* service, grpc::ServerContext* context, const grpc::ByteBuffer* in,
                     grpc::ByteBuffer* out) { return (service->*method)(context, in, out); },
            this)));
  }

  grpc::Status register_tables(grpc::ServerContext* context, const grpc::ByteBuffer* in,
                               grpc::ByteBuffer* out) {
    return serve("Register", context, [&] {
      const auto request = parse_message<pb::RegisterRequest>("Register", *in);
      handler_.register_tables(wire_format::from_wire(request), deadline_of(*context));
      return serialize(pb::RegisterReply(), out);
    });
  }
  grpc::Status pull(grpc::ServerContext* context, const grpc::ByteBuffer* in,
                    grpc::ByteBuffer* out) {
    return serve("Pull", context, [&] {
      const auto request = parse<PullRequest>("Pull", "PullRequest", *in);
      const auto segment = segment_of(*context);
      std::shared_ptr<PullReply> reply = replies_->take();
      if (segment) {
        // The handler may write the values into the worker's segment itself (Note [Pull replies
        // in place], server_core.cpp); a reply is then its slices' counts.
        DenseOut shared{segment->values().data, segment->values().capacity, {}};
        handler_.pull_into(request, deadline_of(*context), *reply, shared);
        if (!shared.counts.empty()) {
          *out = wire_format::encode(*reply, shared.counts);
          return grpc::Status::OK;
        }
      } else {
        handler_.pull(request, deadline_of(*context), *reply);
      }
      // Into the worker's segment when the values fit (Note [Values in shared memory], wire.h).
      if (segment && wire_format::dense_values(reply->dense) <= segment->values().capacity) {
        *out = wire_format::encode(*reply, segment->values());
      } else {
        *out = wire_format::encode(std::shared_ptr<const PullReply>(std::move(reply)));
      }
      return grpc::Status::OK;
    });
  }
  grpc::Status push(grpc::ServerContext* context, const grpc::ByteBuffer* in,
                    grpc::ByteBuffer* out) {
    return serve("Push", context, [&] {
      // Read into storage this gRPC thread kept from its last push: a dense push is the model's
      // size (Note [Values without copies], wire.h). The handler may take the values' storage and
      // leave other storage here (Note [Taking a push's storage], server_core.cpp).
      thread_local PushRequest request;
      const auto segment = segment_of(*context);
      const SharedValues shared = segment ? segment->values() : SharedValues{};
      if (!wire_format::decode(*in, request, segment ? &shared : nullptr))
        throw malformed("Push", "PushRequest", *in);
      *out = wire_format::encode(handler_.push_taking(request, deadline_of(*context)));
      return grpc::Status::OK;
    });
  }
  grpc::Status lease(grpc::ServerContext* context, const grpc::ByteBuffer* in,
                     grpc::ByteBuffer* out) {
    return serve("Lease", context, [&] {
      const auto request = parse_message<pb::LeaseRequest>("Lease", *in);
      pb::LeaseReply reply;
      wire_format::to_wire(
          handler_.lease(wire_format::from_wire(request), deadline_of(*context)), reply);
      return serialize(reply, out);
    });
  }
  grpc::Status membership(grpc::ServerContext* context, const grpc::ByteBuffer* in,
                          grpc::ByteBuffer* out) {
    return serve("Membership", context, [&] {
      const auto request = parse_message<pb::MembershipRequest>("Membership", *in);
      pb::MembershipReply reply;
      reply.set_clock(
          handler_.membership(wire_format::from_wire(request), deadline_of(*context)).clock);
      return serialize(reply, out);
    });
  }
  grpc::Status ping(grpc::ServerContext* context, const grpc::ByteBuffer* in,
                    grpc::ByteBuffer* out) {
    return serve("Ping", context, [&] {
      parse_message<pb::PingRequest>("Ping", *in);
      pb::PingReply reply;
      reply.set_server(index_);
      return serialize(reply, out);
    });
  }

  // A request that does not parse: INVALID_ARGUMENT with this text, before the handler sees it.
  struct Malformed {
    std::string message;
  };
  static Malformed malformed(const char* name, const char* type, const grpc::ByteBuffer& in) {
    return {"malformed " + std::string(name) + " request (" + std::to_string(in.Length()) +
            " bytes): not a " + type + " message (truncated or corrupt)"};
  }
  // Pulls and pushes: read straight into the structs (Note [Values without copies], wire.h).
  template <typename Request>
  static Request parse(const char* name, const char* type, const grpc::ByteBuffer& in) {
    Request request;
    if (!wire_format::decode(in, request)) throw malformed(name, type, in);
    return request;
  }
  // Registrations and pings: through the generated classes.
  template <typename Message>
  static Message parse_message(const char* name, const grpc::ByteBuffer& in) {
    Message message;
    grpc::ByteBuffer bytes(in);
    grpc::ProtoBufferReader reader(&bytes);
    if (!message.ParseFromZeroCopyStream(&reader)) {
      throw malformed(name, Message::descriptor()->name().c_str(), in);
    }
    return message;
  }
  template <typename Message>
  static grpc::Status serialize(const Message& message, grpc::ByteBuffer* out) {
    bool own = false;
    return grpc::SerializationTraits<Message>::Serialize(message, out, &own);
  }

  static Deadline deadline_of(const grpc::ServerContext& context) {
    const auto left = context.deadline() - SystemClock::now();
    const auto day = std::chrono::hours(24);
    return Deadline(std::chrono::duration_cast<Duration>(
        std::clamp<SystemClock::duration>(left, SystemClock::duration::zero(), day)));
  }

  template <typename Body>
  grpc::Status serve(const char* name, grpc::ServerContext* context, Body&& body) {
    const auto& metadata = context->client_metadata();
    const auto token = metadata.find(kTokenMetadata);
    if (token == metadata.end()) {
      return {grpc::StatusCode::UNAUTHENTICATED,
              std::string(name) + " carries no job token; expected the job's token in metadata " +
                  kTokenMetadata + " (SHOAL_JOB_TOKEN)"};
    }
    if (!same_token(token->second, token_)) {
      return {grpc::StatusCode::UNAUTHENTICATED,
              std::string(name) + " carries a token that is not this job's"};
    }
    try {
      return body();
    } catch (const Malformed& e) {
      return {grpc::StatusCode::INVALID_ARGUMENT, e.message};
    } catch (const SegmentUnusable& e) {
      return {grpc::StatusCode::FAILED_PRECONDITION, one_line(name + std::string(": ") + e.what())};
    } catch (const NotFoundError& e) {
      return {grpc::StatusCode::NOT_FOUND, one_line(name + std::string(": ") + e.what())};
    } catch (const UsageError& e) {
      return {grpc::StatusCode::INVALID_ARGUMENT, one_line(name + std::string(": ") + e.what())};
    } catch (const CommError& e) {
      const bool late = SystemClock::now() >= context->deadline();
      return {late ? grpc::StatusCode::DEADLINE_EXCEEDED : grpc::StatusCode::UNAVAILABLE,
              one_line(name + std::string(": ") + e.what())};
    } catch (const std::exception& e) {
      return {grpc::StatusCode::INTERNAL, one_line(name + std::string(" failed: ") + e.what())};
    }
  }

  // Note [Pull replies kept]: a dense pull's reply is the model's share of this server (tens of
  // MB), lent to gRPC until sent (Note [Values without copies], wire.h). When gRPC lets go of it,
  // it comes back here instead of being freed, and the next pull's handler writes into its
  // storage: no buffer of that size is allocated (and its pages faulted in) per pull.
  class ReplyPool : public std::enable_shared_from_this<ReplyPool> {
   public:
    std::shared_ptr<PullReply> take() {
      std::unique_ptr<PullReply> reply;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!free_.empty()) {
          reply = std::move(free_.back());
          free_.pop_back();
        }
      }
      if (!reply) reply = std::make_unique<PullReply>();
      // The deleter holds the pool: gRPC may free a reply's slices after the service is gone.
      return std::shared_ptr<PullReply>(reply.release(), [pool = shared_from_this()](PullReply* r) {
        pool->give_back(std::unique_ptr<PullReply>(r));
      });
    }

   private:
    // More than the pulls a server answers at once is memory held for nothing.
    static constexpr size_t kKept = 8;
    void give_back(std::unique_ptr<PullReply> reply) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (free_.size() < kKept) free_.push_back(std::move(reply));
    }
    std::mutex mutex_;
    std::vector<std::unique_ptr<PullReply>> free_;
  };

  // The worker's shared segment a call names (Note [Shared segments], shm.h), or nullptr.
  std::shared_ptr<const SegmentMapping> segment_of(const grpc::ServerContext& context) {
    const auto& metadata = context.client_metadata();
    const auto handle = metadata.find(kSegmentMetadata);
    if (handle == metadata.end()) return nullptr;
    return segments_.open(std::string(handle->second.data(), handle->second.size()));
  }

  SegmentMappings segments_;
  Handler& handler_;
  const std::shared_ptr<ReplyPool> replies_ = std::make_shared<ReplyPool>();
  const std::string token_;
  const int index_;
  std::vector<std::unique_ptr<std::string>> names_;  // gRPC keeps the method names' pointers
};

// Note [gRPC stays initialized]
// gRPC counts its users (grpc_init / grpc_shutdown); when the last server or channel goes, the
// one destroying it tears gRPC down and joins gRPC's executor threads, one of which may sit in a
// poll for up to ~10 s. A server that stopped at the end of its job then outlived the launcher's
// stop grace (3 s) about every other time and was SIGKILLed. Holding one count for the process's
// life makes that teardown never happen: the process's exit takes gRPC's threads with it.
void keep_grpc_initialized() {
  static const bool initialized = (grpc_init(), true);
  (void)initialized;
}

}  // namespace

struct RpcServer::State {
  std::unique_ptr<Service> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

RpcServer::RpcServer(Handler& handler, const ServerOptions& options)
    : state_(std::make_unique<State>()) {
  keep_grpc_initialized();
  if (options.token.empty()) {
    throw UsageError("a parameter server needs the job's token (SHOAL_JOB_TOKEN); it is empty");
  }
  state_->service = std::make_unique<Service>(handler, options);
  const std::string address = options.host + ":" + std::to_string(options.port);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &state_->port);
  builder.RegisterService(state_->service.get());
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // gRPC sets SO_REUSEPORT by default: a second server would share a taken port silently.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  state_->server = builder.BuildAndStart();
  if (!state_->server || state_->port == 0) {
    throw UsageError("parameter server " + std::to_string(options.index) + " cannot listen on " +
                     address + "; expected a free port on a local interface");
  }
}

RpcServer::~RpcServer() {
  shutdown(Duration(0));
}

int RpcServer::port() const {
  return state_->port;
}

void RpcServer::shutdown(Duration grace) {
  if (!state_->server) return;
  state_->server->Shutdown(SystemClock::now() + grace);
  state_->server->Wait();
  state_->server.reset();
}

namespace {

// Note [Which UNAVAILABLE fails over]: gRPC answers UNAVAILABLE when the connection to a server
// is refused or breaks (a SIGKILLed server: at once), and the service answers it too when its
// handler raised CommError before the call's deadline (a pull whose worker left the live set).
// Only the first means the server is gone. The service's own statuses always begin with the
// method's name and ": " (Service::serve above), gRPC's never do: that tells them apart without a
// second round trip.
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
  void call(const char* name, grpc::internal::RpcMethod Methods::*method, Duration timeout,
            const grpc::ByteBuffer& request, grpc::ByteBuffer& reply,
            const std::string* segment = nullptr) {
    const auto start = SteadyClock::now();
    const auto deadline = SystemClock::now() + std::max(timeout, Duration(0));
    for (;;) {
      const std::shared_ptr<Endpoint> endpoint = current();
      grpc::ClientContext context;
      context.set_deadline(deadline);
      context.AddMetadata(kTokenMetadata, token);
      if (segment != nullptr) context.AddMetadata(kSegmentMetadata, *segment);
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
               const SharedValues* shm = nullptr, const DenseSink* sink = nullptr) {
    bool read = false;
    try {
      if constexpr (std::is_same_v<Reply, PullReply>) {
        read = wire_format::decode(bytes, reply, shm, sink);
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
  if (!request.dense.empty() && !state.no_segment) {
    std::unique_lock<std::mutex> lock(state.segment_mutex, std::try_to_lock);
    if (lock.owns_lock() && state.segment && !state.no_segment) {
      const SharedValues shared = state.segment->values();
      try {
        grpc::ByteBuffer bytes;
        state.call("Pull", &Methods::pull, timeout, wire_format::encode(request), bytes,
                   &state.segment->handle());
        state.convert("Pull", "PullReply", bytes, reply, &shared, sink);
        ++state.shared_calls;
        return;
      } catch (const SegmentUnusable&) {
        state.no_segment = true;  // this server cannot map it: values inline from now on
      } catch (...) {
        // A server may still answer a call the client gave up on, into this segment: the next
        // call gets a new one.
        state.segment.reset();
        throw;
      }
    }
  }
  grpc::ByteBuffer bytes;
  const auto left = timeout - std::chrono::duration_cast<Duration>(SteadyClock::now() - start);
  state.call("Pull", &Methods::pull, left, wire_format::encode(request), bytes);
  state.convert("Pull", "PullReply", bytes, reply);
}

PushReply RpcClient::push(const PushRequest& request, Duration timeout) {
  const auto start = SteadyClock::now();
  if (auto reply = push_shared(request, timeout, nullptr)) return *reply;
  return push_inline(request,
                     timeout - std::chrono::duration_cast<Duration>(SteadyClock::now() - start));
}

PushReply RpcClient::push(PushRequest& request, Duration timeout, const DenseSource& source) {
  const auto start = SteadyClock::now();
  if (auto reply = push_shared(request, timeout, &source)) return *reply;
  source.fill_slices(request.dense);  // in the message, from the request's slices
  return push_inline(request,
                     timeout - std::chrono::duration_cast<Duration>(SteadyClock::now() - start));
}

std::optional<PushReply> RpcClient::push_shared(const PushRequest& request, Duration timeout,
                                                const DenseSource* source) {
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
               wire_format::encode(request, segment->values(), source), reply, &segment->handle());
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
