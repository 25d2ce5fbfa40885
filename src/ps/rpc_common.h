// What the parameter server's transport shares between its server (rpc_server.cpp) and its client
// (rpc_client.cpp): the service's method names, the message bound, gRPC's lifetime, and how a
// status is named. Private to src/ps.
#pragma once

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "ps.grpc.pb.h"

namespace shoal::ps::detail::rpc {

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

inline std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  std::replace(text.begin(), text.end(), '\r', ' ');
  return text;
}

inline const char* code_name(grpc::StatusCode code) {
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

// Note [gRPC stays initialized]
// gRPC counts its users (grpc_init / grpc_shutdown); when the last server or channel goes, the
// one destroying it tears gRPC down and joins gRPC's executor threads, one of which may sit in a
// poll for up to ~10 s. A server that stopped at the end of its job then outlived the launcher's
// stop grace (3 s) about every other time and was SIGKILLed. Holding one count for the process's
// life makes that teardown never happen: the process's exit takes gRPC's threads with it.
inline void keep_grpc_initialized() {
  static const bool initialized = (grpc_init(), true);
  (void)initialized;
}

}  // namespace shoal::ps::detail::rpc
