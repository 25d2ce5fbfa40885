// The parameter server's transport candidates on loopback between two processes (docs/ps.md,
// "Transport"): round trips of a payload of float32 values to a server that adds it into what it
// holds and sends that back (a push and a pull of the same bytes), through
//   grpc  shoal's own service (src/ps/rpc.h): a Push unary call then a Pull unary call, with the
//         values in a protobuf `bytes` field, validated, into and out of the store-and-sum handler;
//   gloo  c10d ProcessGroupGloo send then recv (as bench/allreduce.cpp builds a group);
//   tcp   one blocking socket, length-prefixed frames written and read whole (TCP_NODELAY).
//
//   ps_transport [--reps R] [--sizes 4K,64K,512K,2M,8M]
//
// The process forks a server before any thread starts; both follow the same schedule: for each
// size and repetition, each transport in turn (order rotated per repetition, so the machine's
// noise falls on all alike), a warm-up of 2 round trips then a timed batch. The table shows the
// median over repetitions of round trips per second, gRPC calls per second (2 per round trip),
// and GB/s counting the payload both ways.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_service_method.h>
#include <grpcpp/support/method_handler.h>

#include "ps/rpc.h"
#include "ps/sum_handler.h"
#include "comm/store.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace shoal;
using namespace shoal::ps::detail;

const std::string kToken = "bench-token";
// "echo": gRPC itself, without shoal's service: a unary call whose request is the payload's
// bytes and whose reply is the same buffer sent back (no protobuf, no copy on the server), the
// floor under the "grpc" column.
const char* kNames[] = {"grpc", "gloo", "tcp", "echo"};
constexpr int kTransports = 4;
const std::string kEchoMethod = "/bench.Echo/Echo";

class EchoService : public grpc::Service {
 public:
  EchoService() {
    AddMethod(new grpc::internal::RpcServiceMethod(
        kEchoMethod.c_str(), grpc::internal::RpcMethod::NORMAL_RPC,
        new grpc::internal::RpcMethodHandler<EchoService, grpc::ByteBuffer, grpc::ByteBuffer>(
            [](EchoService*, grpc::ServerContext*, const grpc::ByteBuffer* in,
               grpc::ByteBuffer* out) {
              *out = *in;
              return grpc::Status::OK;
            },
            this)));
  }
};
constexpr int kWarmup = 2;

// Enough round trips that a batch takes tens of milliseconds at least.
int iterations_for(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>((128 << 20) / bytes, 8, 1000));
}

struct Step {
  size_t size;
  int transport;
};
std::vector<Step> schedule(size_t sizes, int reps) {
  std::vector<Step> steps;
  for (size_t s = 0; s < sizes; ++s)
    for (int r = 0; r < reps; ++r)
      for (int k = 0; k < kTransports; ++k) steps.push_back({s, (k + r) % kTransports});
  return steps;
}

void write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n <= 0) throw CommError("tcp write failed: " + std::string(std::strerror(errno)));
    p += n;
    size -= static_cast<size_t>(n);
  }
}
void read_all(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::read(fd, p, size);
    if (n <= 0)
      throw CommError("tcp read failed: " + std::string(n == 0 ? "closed" : std::strerror(errno)));
    p += n;
    size -= static_cast<size_t>(n);
  }
}
void no_delay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_group(const comm::StorePtr& store, int rank) {
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(600));
  options->threads = 2;
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto scoped = c10::make_intrusive<c10d::PrefixStore>("bench/ps_transport", store);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, rank, 2, options);
}

RegisterRequest tables(const std::vector<int64_t>& sizes) {
  RegisterRequest request;
  for (size_t i = 0; i < sizes.size(); ++i) {
    request.tables.push_back(
        TableSpec{"payload" + std::to_string(i), false, {sizes[i] / 4}, {}, {}, 0});
  }
  return request;
}

std::vector<int64_t> all_chunks(int64_t floats) {
  std::vector<int64_t> chunks((floats + 1023) / 1024);
  for (size_t i = 0; i < chunks.size(); ++i) chunks[i] = static_cast<int64_t>(i);
  return chunks;
}

int serve(int store_port, const std::vector<int64_t>& sizes, int reps) {
  comm::StoreOptions store_options;
  store_options.port = store_port;
  const comm::StorePtr store = comm::open_store(store_options);
  SumHandler handler;  // chunks of 1024 values, as `shoal ps-server` has them
  RpcServerOptions options;
  options.host = "127.0.0.1";
  options.token = kToken;
  RpcServer server(handler, options);
  EchoService echo;
  grpc::ServerBuilder echo_builder;
  int echo_port = 0;
  echo_builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &echo_port);
  echo_builder.RegisterService(&echo);
  echo_builder.SetMaxReceiveMessageSize(1 << 30);
  echo_builder.SetMaxSendMessageSize(1 << 30);
  const std::unique_ptr<grpc::Server> echo_server = echo_builder.BuildAndStart();
  comm::put(store, "bench/echo", "127.0.0.1:" + std::to_string(echo_port));
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      ::listen(listener, 1) != 0) {
    throw CommError("cannot listen");
  }
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  comm::put(store, "bench/grpc", "127.0.0.1:" + std::to_string(server.port()));
  comm::put(store, "bench/tcp", std::to_string(ntohs(address.sin_port)));
  const int tcp = ::accept(listener, nullptr, nullptr);
  no_delay(tcp);
  auto group = make_group(store, 1);

  std::vector<std::vector<float>> held(sizes.size());
  for (size_t s = 0; s < sizes.size(); ++s) held[s].assign(sizes[s] / 4, 0.0f);
  for (const Step& step : schedule(sizes.size(), reps)) {
    const int64_t bytes = sizes[step.size];
    const int rounds = kWarmup + iterations_for(bytes);
    std::vector<float>& sum = held[step.size];
    if (step.transport == 1) {
      std::vector<at::Tensor> buffer{torch::empty({bytes / 4})};
      std::vector<at::Tensor> reply{torch::from_blob(sum.data(), {bytes / 4})};
      for (int i = 0; i < rounds; ++i) {
        group->recv(buffer, 0, 0)->wait();
        const float* in = buffer[0].data_ptr<float>();
        for (int64_t j = 0; j < bytes / 4; ++j) sum[j] += in[j];
        group->send(reply, 0, 1)->wait();
      }
    } else if (step.transport == 2) {
      std::vector<float> buffer(bytes / 4);
      for (int i = 0; i < rounds; ++i) {
        uint64_t frame = 0;
        read_all(tcp, &frame, sizeof(frame));
        if (frame != static_cast<uint64_t>(bytes)) throw CommError("unexpected frame length");
        read_all(tcp, buffer.data(), frame);
        for (int64_t j = 0; j < bytes / 4; ++j) sum[j] += buffer[j];
        write_all(tcp, &frame, sizeof(frame));
        write_all(tcp, sum.data(), frame);
      }
    }
    // grpc: gRPC's threads serve; this thread moves on to the next step's first receive.
  }
  // Wait for the client's last gRPC step before shutting the server down.
  store->wait({"bench/done"}, std::chrono::seconds(600));
  ::close(tcp);
  ::close(listener);
  return 0;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

int measure(const comm::StorePtr& store, const std::vector<int64_t>& sizes, int reps) {
  store->wait({"bench/grpc", "bench/tcp"}, std::chrono::seconds(120));
  RpcClient client(0, comm::try_get(store, "bench/grpc"), kToken);
  store->wait({"bench/echo"}, std::chrono::seconds(120));
  grpc::ChannelArguments echo_args;
  echo_args.SetMaxReceiveMessageSize(1 << 30);
  echo_args.SetMaxSendMessageSize(1 << 30);
  echo_args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);
  grpc::GenericStub echo(grpc::CreateCustomChannel(comm::try_get(store, "bench/echo"),
                                                   grpc::InsecureChannelCredentials(), echo_args));
  client.register_tables(tables(sizes), std::chrono::seconds(30));
  const int tcp = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(std::stoi(comm::try_get(store, "bench/tcp"))));
  if (::connect(tcp, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    throw CommError("cannot connect");
  }
  no_delay(tcp);
  auto group = make_group(store, 0);

  // rates[size][transport]: round trips per second, one per repetition.
  std::vector<std::vector<std::vector<double>>> rates(
      sizes.size(), std::vector<std::vector<double>>(kTransports));
  for (const Step& step : schedule(sizes.size(), reps)) {
    const int64_t bytes = sizes[step.size];
    const int64_t floats = bytes / 4;
    const int timed = iterations_for(bytes);
    std::vector<float> payload(floats);
    for (int64_t j = 0; j < floats; ++j) payload[j] = 1e-3f * static_cast<float>(j % 1000);
    std::function<void()> round_trip;
    PushRequest push;
    PullRequest pull;
    std::vector<at::Tensor> out{torch::from_blob(payload.data(), {floats})};
    std::vector<at::Tensor> in{torch::empty({floats})};
    std::vector<float> back(floats);
    if (step.transport == 0) {
      push.dense = {DenseSlice{static_cast<int32_t>(step.size), all_chunks(floats), payload}};
      pull.dense = {DenseSlice{static_cast<int32_t>(step.size), all_chunks(floats), {}}};
      round_trip = [&] {
        client.push(push, std::chrono::seconds(60));
        const PullReply reply = client.pull(pull, std::chrono::seconds(60));
        if (static_cast<int64_t>(reply.dense.at(0).values.size()) != floats)
          throw CommError("short pull");
      };
    } else if (step.transport == 1) {
      round_trip = [&] {
        group->send(out, 1, 0)->wait();
        group->recv(in, 1, 1)->wait();
      };
    } else if (step.transport == 3) {
      round_trip = [&] {
        grpc::Slice slice(payload.data(), static_cast<size_t>(bytes));
        const grpc::ByteBuffer request(&slice, 1);
        grpc::ByteBuffer reply;
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        grpc::CompletionQueue queue;
        auto call = echo.PrepareUnaryCall(&context, kEchoMethod, request, &queue);
        call->StartCall();
        grpc::Status status;
        call->Finish(&reply, &status, reinterpret_cast<void*>(1));
        void* tag = nullptr;
        bool ok = false;
        queue.Next(&tag, &ok);
        queue.Shutdown();
        while (queue.Next(&tag, &ok)) {
        }
        if (!status.ok() || static_cast<int64_t>(reply.Length()) != bytes) {
          throw CommError("echo failed: " + status.error_message());
        }
      };
    } else {
      round_trip = [&] {
        const uint64_t frame = static_cast<uint64_t>(bytes);
        write_all(tcp, &frame, sizeof(frame));
        write_all(tcp, payload.data(), frame);
        uint64_t answer = 0;
        read_all(tcp, &answer, sizeof(answer));
        read_all(tcp, back.data(), answer);
      };
    }
    for (int i = 0; i < kWarmup; ++i) round_trip();
    const auto start = Clock::now();
    for (int i = 0; i < timed; ++i) round_trip();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    rates[step.size][step.transport].push_back(timed / seconds);
  }
  comm::put(store, "bench/done", "1");
  ::close(tcp);

  std::printf("%-9s %-5s %14s %10s %8s %10s\n", "payload", "via", "round trips/s", "calls/s",
              "GB/s", "ms/rt");
  for (size_t s = 0; s < sizes.size(); ++s) {
    for (int k = 0; k < kTransports; ++k) {
      const double rt = median(rates[s][k]);
      const double calls = k == 0 ? 2 * rt : rt;
      const std::string size = sizes[s] >= (1 << 20) ? std::to_string(sizes[s] >> 20) + " MiB"
                                                     : std::to_string(sizes[s] >> 10) + " KiB";
      std::printf("%-9s %-5s %14.1f %10.1f %8.3f %10.3f\n", size.c_str(), kNames[k], rt,
                  k == 0 ? calls : rt, 2.0 * sizes[s] * rt / 1e9, 1e3 / rt);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("The parameter server's transport candidates, side by side (docs/ps.md)");
  int reps = 5;
  std::vector<int64_t> sizes = {4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20};
  app.add_option("--reps", reps, "Repetitions per size and transport (default 5)")
      ->check(CLI::PositiveNumber);
  // AsSizeValue(false): K and M are 1024 and 1024^2, as the sizes the tables print.
  app.add_option("--sizes", sizes, "Payload sizes in bytes (default 4K,64K,512K,2M,8M)")
      ->delimiter(',')
      ->transform(CLI::AsSizeValue(false))
      ->check(CLI::Range(int64_t{4}, int64_t{1} << 32));
  CLI11_PARSE(app, argc, argv);
  int ports[2];
  if (::pipe(ports) != 0) return 1;
  const pid_t child = ::fork();  // before any thread: the server process starts clean
  torch::set_num_threads(1);
  try {
    if (child == 0) {
      ::close(ports[1]);
      int port = 0;
      read_all(ports[0], &port, sizeof(port));
      return serve(port, sizes, reps);
    }
    ::close(ports[0]);
    comm::StoreOptions options;
    options.is_server = true;
    const comm::StorePtr store = comm::open_store(options);
    const int port = comm::hosted_port(store);
    write_all(ports[1], &port, sizeof(port));
    const int code = measure(store, sizes, reps);
    int status = 0;
    ::waitpid(child, &status, 0);
    return code != 0 ? code : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_transport (%s): %s\n", child == 0 ? "server" : "client", e.what());
    if (child > 0) ::kill(child, SIGKILL);
    return 1;
  }
}
