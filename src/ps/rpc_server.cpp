// The parameter server's gRPC service (docs/ps.md, "Transport"): a Handler served to the job's
// workers, each call checked for the job's token and parsed here (Note [Raw requests]).
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
namespace {

using namespace rpc;  // NOLINT: the transport's shared names (rpc_common.h)

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
  Service(Handler& handler, const RpcServerOptions& options)
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
      const bool mirror = offers_mirror(*context);
      std::shared_ptr<PullReply> reply = replies_->take();
      if (segment || mirror) {
        // The handler may write the values into the worker's segment itself (Note [Pull replies
        // in place], server_registry.cpp), or name them in its mirror (Note [The values' mirror],
        // mirror.h); a reply is then its slices' counts.
        DenseOut shared;
        if (segment) {
          shared.data = segment->values().data;
          shared.capacity = segment->values().capacity;
        }
        shared.mirror_offered = mirror;
        handler_.pull_into(request, deadline_of(*context), *reply, shared);
        if (!shared.counts.empty()) {
          *out = wire_format::encode(*reply, shared);
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
      // leave other storage here (Note [Taking a push's storage], server_steps.cpp).
      // Values in the worker's segment are read there (Note [Pushes read in place],
      // server_steps.cpp): a push the handler holds keeps the segment mapped, this thread not.
      thread_local PushRequest request;
      struct Forget {
        ~Forget() {
          request.keep.reset();
          for (DenseSlice& slice : request.dense) slice.view = nullptr;
        }
      } forget;
      const auto segment = segment_of(*context);
      const SharedValues shared = segment ? segment->values() : SharedValues{};
      if (!wire_format::decode(*in, request, segment ? &shared : nullptr, segment))
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

  // Whether a pull offers to read the server's mirror (Note [The values' mirror], mirror.h).
  static bool offers_mirror(const grpc::ServerContext& context) {
    const auto& metadata = context.client_metadata();
    const auto offer = metadata.find(kMirrorMetadata);
    return offer != metadata.end() && offer->second == "1";
  }
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

}  // namespace

struct RpcServer::State {
  std::unique_ptr<Service> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

RpcServer::RpcServer(Handler& handler, const RpcServerOptions& options)
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

}  // namespace shoal::ps::detail
