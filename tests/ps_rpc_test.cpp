// The parameter server's transport (docs/ps.md, "Transport" and "Processes"): real `shoal
// ps-server --handler sum` processes (the transport's test handler), real clients over loopback.
// What is checked is the transport: values arrive exactly, malformed and hostile requests are
// refused with the right status and message while the server keeps serving, a dead or silent server
// is a CommError naming it within the call's deadline, and `shoal run --servers` runs and stops
// them (its servers serving the core: sync steps equal one process).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <dirent.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <thread>

#include <gtest/gtest.h>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "ps.pb.h"
#include "ps/connect.h"
#include "ps/server_core.h"
#include "ps/shard_map.h"
#include "ps/shm.h"
#include "ps/wire.h"
#include "shoal_run.h"
#include "test_paths.h"

extern char** environ;

namespace shoal::ps::detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace pb = ::shoal::ps::wire;
using shoal::testing::shoal_bin;
using shoal::testing::test_programs_dir;

const std::string kToken = "0123456789abcdef0123456789abcdef";
constexpr int64_t kChunk = 1024;  // the server's chunk length (SumHandler's default)

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One `shoal ps-server --index I` process of a job whose store the test hosts.
class ServerProcess {
 public:
  // `flags` after --index; `more_env`: KEY=VALUE entries added to the environment.
  ServerProcess(int index, int store_port,
                const std::vector<std::string>& flags = {"--handler", "sum"},
                const std::vector<std::string>& more_env = {}) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.push_back(*e);
    env.insert(env.end(), more_env.begin(), more_env.end());
    env.push_back("SHOAL_MASTER_ADDR=127.0.0.1");
    env.push_back("SHOAL_MASTER_PORT=" + std::to_string(store_port));
    env.push_back("SHOAL_RUN_ID=ps-rpc-test");
    env.push_back("SHOAL_JOB_TOKEN=" + kToken);
    const std::string index_text = std::to_string(index);
    std::vector<char*> envp;
    for (auto& entry : env) envp.push_back(entry.data());
    envp.push_back(nullptr);
    // Read before the fork: the child only calls execve.
    const std::string& shoal = shoal_bin();
    std::vector<const char*> argv = {shoal.c_str(), "ps-server", "--index", index_text.c_str()};
    for (const std::string& flag : flags) argv.push_back(flag.c_str());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execve(shoal.c_str(), const_cast<char**>(argv.data()), envp.data());
      ::_exit(127);
    }
  }
  ~ServerProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::kill(pid_, SIGCONT);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // The exit status after `signal`, or nullopt if it did not exit within `timeout`.
  std::optional<int> stop(int signal, std::chrono::milliseconds timeout) {
    ::kill(pid_, signal);
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        return status;
      }
      std::this_thread::sleep_for(10ms);
    }
    return std::nullopt;
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
};

// The state letter of /proc/PID/stat ('T' once stopped), or 0.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || line.size() < close + 3 ? 0 : line[close + 2];
}

// SIGSTOP is delivered after kill() returns: wait until every thread of `pid` has stopped.
bool stop_process(pid_t pid, std::chrono::milliseconds timeout) {
  ::kill(pid, SIGSTOP);
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    bool all = true;
    DIR* tasks = ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
    if (tasks == nullptr) return false;
    while (dirent* task = ::readdir(tasks)) {
      const int tid = std::atoi(task->d_name);
      if (tid <= 0) continue;
      std::ifstream stat("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat");
      std::string line;
      std::getline(stat, line);
      const auto close = line.rfind(')');
      if (close != std::string::npos && line.size() > close + 2 && line[close + 2] != 'T')
        all = false;
    }
    ::closedir(tasks);
    if (all) return true;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
}

class PsRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    comm::StoreOptions options;
    options.is_server = true;
    options.port = 0;
    options.job_id = "shoal run ps-rpc-test";
    store_ = comm::open_store(options);
  }
  // Starts `count` servers and connects to them; `flags` and `more_env` as ServerProcess's.
  void start(int count, const std::vector<std::string>& flags = {"--handler", "sum"},
             const std::vector<std::string>& more_env = {}) {
    for (int i = 0; i < count; ++i) {
      servers_.push_back(
          std::make_unique<ServerProcess>(i, comm::hosted_port(store_), flags, more_env));
    }
    clients_ = connect_servers(store_, count, kToken, 60s);
  }

  comm::StorePtr store_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::unique_ptr<RpcClient>> clients_;
};

RegisterRequest tables(int worker) {
  RegisterRequest request;
  request.worker = worker;
  TableSpec dense{"w", false, {2, 1250}, {}, {}, 7};  // 2500 values: chunks of 1024, 1024, 452
  dense.optimizer.kind = OptimizerSpec::Kind::kAdam;
  dense.optimizer.lr = 0.125;
  TableSpec sparse{"emb", true, {0, 3}, {}, {}, 9};
  sparse.init.kind = InitSpec::Kind::kNormal;
  sparse.init.b = 0.5;
  request.tables = {dense, sparse};
  return request;
}

std::vector<float> ramp(int64_t n, float scale) {
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = scale * (static_cast<float>(i) - 1000.5f);
  return values;
}

std::string error_of(const std::function<void()>& call, const char* expected_type) {
  try {
    call();
  } catch (const UsageError& e) {
    if (std::string(expected_type) != "UsageError") return std::string("UsageError: ") + e.what();
    return e.what();
  } catch (const CommError& e) {
    if (std::string(expected_type) != "CommError") return std::string("CommError: ") + e.what();
    return e.what();
  }
  return "no error";
}

TEST_F(PsRpcTest, EveryMessageKindRoundTripsExactly) {
  start(1);
  RpcClient& server = *clients_[0];
  EXPECT_EQ(server.ping(5s), 0);
  const std::vector<float> a = ramp(2500, 0.75f), b = ramp(2500, -0.3f), first = ramp(2500, 2);
  RegisterRequest creating = tables(0);
  creating.initial = {DenseSlice{0, {1, 0, 2}, {}}};  // the first values cross in any chunk order
  auto& initial = creating.initial[0].values;
  initial.assign(first.begin() + kChunk, first.begin() + 2 * kChunk);
  initial.insert(initial.end(), first.begin(), first.begin() + kChunk);
  initial.insert(initial.end(), first.begin() + 2 * kChunk, first.end());
  server.register_tables(creating, 5s);
  server.register_tables(tables(1), 5s);  // the same tables again: accepted

  for (int worker : {0, 1}) {
    PushRequest push;
    push.worker = worker;
    push.clock = 0;
    push.rows = 64;
    push.dense = {DenseSlice{0, {0, 1, 2}, worker == 0 ? a : b}};
    push.sparse = {SparseSlice{1, {42, 7}, {1.5f, -2, 3, 0.25f, 8, -9}}};
    const PushReply reply = server.push(push, 5s);
    EXPECT_TRUE(reply.counted);
    EXPECT_EQ(reply.clock, worker + 1);
  }
  PullRequest pull;
  pull.worker = 1;
  pull.clock = 1;
  pull.dense = {DenseSlice{0, {2, 0}, {}}};        // out of order, on purpose
  pull.sparse = {SparseSlice{1, {7, 5, 42}, {}}};  // row 5 was never pushed
  const PullReply reply = server.pull(pull, 5s);
  EXPECT_EQ(reply.clock, 2);
  ASSERT_EQ(reply.dense.size(), 1u);
  EXPECT_EQ(reply.dense[0].table, 0);
  EXPECT_EQ(reply.dense[0].chunks, (std::vector<int64_t>{2, 0}));
  std::vector<float> expected;
  for (int64_t i = 2 * kChunk; i < 2500; ++i) expected.push_back(first[i] + a[i] + b[i]);
  for (int64_t i = 0; i < kChunk; ++i) expected.push_back(first[i] + a[i] + b[i]);
  EXPECT_EQ(reply.dense[0].values, expected);
  ASSERT_EQ(reply.sparse.size(), 1u);
  EXPECT_EQ(reply.sparse[0].ids, (std::vector<int64_t>{7, 5, 42}));
  EXPECT_EQ(reply.sparse[0].values, (std::vector<float>{0.5f, 16, -18, 0, 0, 0, 3, -4, 6}));
}

TEST_F(PsRpcTest, RefusalsAreUsageErrorsWithTheServersMessage) {
  start(1);
  RpcClient& server = *clients_[0];
  server.register_tables(tables(0), 5s);
  const std::string at = "parameter server 0 (" + server.address() + ")";

  RegisterRequest other = tables(1);
  other.tables[0].shape = {2500};
  EXPECT_EQ(error_of([&] { server.register_tables(other, 5s); }, "UsageError"),
            at + " refused Register: Register: worker 1 registers table 0 as 'w' [2500]; the job "
                 "has 'w' [2, 1250]");
  PullRequest unknown;
  unknown.dense = {DenseSlice{5, {0}, {}}};
  EXPECT_EQ(error_of([&] { server.pull(unknown, 5s); }, "UsageError"),
            at + " refused Pull: Pull: table 5 is not registered; the server has 2 tables");
  PushRequest wrong;
  wrong.dense = {DenseSlice{0, {1}, {1, 2, 3}}};
  EXPECT_EQ(error_of([&] { server.push(wrong, 5s); }, "UsageError"),
            at + " refused Push: Push: push to table 'w' carries 3 values for 1 chunks; expected "
                 "1024");
  RpcClient stranger(0, server.address(), "not-the-token");
  EXPECT_EQ(error_of([&] { stranger.ping(5s); }, "UsageError"),
            at + " refused Ping: Ping carries a token that is not this job's");
}

// Raw calls, as a hostile or broken peer would make them.
class RawCaller {
 public:
  explicit RawCaller(const std::string& address)
      : stub_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())) {}

  grpc::Status call(const std::string& method, const std::string& bytes,
                    std::optional<std::string> token = kToken,
                    std::optional<std::string> segment = std::nullopt) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 10s);
    if (token) context.AddMetadata(kTokenMetadata, *token);
    if (segment) context.AddMetadata(kSegmentMetadata, *segment);
    grpc::Slice slice(bytes);
    const grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer reply;
    grpc::CompletionQueue queue;
    auto call = stub_.PrepareUnaryCall(&context, "/shoal.ps.wire.ParameterServer/" + method,
                                       request, &queue);
    call->StartCall();
    grpc::Status status;
    call->Finish(&reply, &status, reinterpret_cast<void*>(1));
    void* tag = nullptr;
    bool ok = false;
    queue.Next(&tag, &ok);
    queue.Shutdown();
    while (queue.Next(&tag, &ok)) {
    }
    return status;
  }

 private:
  grpc::GenericStub stub_;
};

std::string push_bytes(const std::function<void(pb::PushRequest&)>& edit) {
  pb::PushRequest push;
  push.set_worker(0);
  push.set_rows(1);
  pb::DenseSlice& slice = *push.add_dense();
  slice.set_table(0);
  slice.add_chunks(2);
  const std::vector<float> values(452, 1.0f);
  slice.set_values(std::string(reinterpret_cast<const char*>(values.data()), 452 * 4));
  edit(push);
  return push.SerializeAsString();
}

TEST_F(PsRpcTest, MalformedAndHostileRequestsAreRefusedAndTheServerGoesOn) {
  start(1);
  RpcClient& server = *clients_[0];
  server.register_tables(tables(0), 5s);
  RawCaller raw(server.address());
  using grpc::StatusCode;
  struct Case {
    std::string what, method, bytes;
    std::optional<std::string> token;
    StatusCode code;
    std::string message;
  };
  const std::string good = push_bytes([](pb::PushRequest&) {});
  const std::vector<Case> cases = {
      {"truncated", "Push", good.substr(0, good.size() / 2), kToken, StatusCode::INVALID_ARGUMENT,
       "malformed Push request (" + std::to_string(good.size() / 2) +
           " bytes): not a PushRequest message (truncated or corrupt)"},
      {"garbage", "Pull", "\xff\xff\xff", kToken, StatusCode::INVALID_ARGUMENT,
       "malformed Pull request (3 bytes): not a PullRequest message (truncated or corrupt)"},
      {"values not whole floats", "Push",
       push_bytes([](pb::PushRequest& p) { p.mutable_dense(0)->set_values("1234567"); }), kToken,
       StatusCode::INVALID_ARGUMENT,
       "Push: dense[0].values has 7 bytes; expected a multiple of 4 (little-endian float32)"},
      {"values of the wrong length", "Push",
       push_bytes([](pb::PushRequest& p) { p.mutable_dense(0)->set_values(std::string(400, 0)); }),
       kToken, StatusCode::INVALID_ARGUMENT,
       "Push: push to table 'w' carries 100 values for 1 chunks; expected 452"},
      {"sparse values not whole rows", "Push", push_bytes([](pb::PushRequest& p) {
         p.clear_dense();
         pb::SparseSlice& s = *p.add_sparse();
         s.set_table(1);
         s.add_ids(1);
         s.add_ids(2);
         s.set_values(std::string(12, 0));
       }),
       kToken, StatusCode::INVALID_ARGUMENT,
       "Push: sparse[0] carries 3 values for 2 rows; expected a whole number of rows of at least "
       "one value"},
      {"negative rows", "Push", push_bytes([](pb::PushRequest& p) { p.set_rows(-5); }), kToken,
       StatusCode::INVALID_ARGUMENT, "Push: rows = -5; expected a non-negative number"},
      {"negative chunk", "Push",
       push_bytes([](pb::PushRequest& p) { p.mutable_dense(0)->set_chunks(0, -1); }), kToken,
       StatusCode::INVALID_ARGUMENT,
       "Push: dense[0].chunks[0] = -1; expected a non-negative number"},
      {"chunk out of range", "Push",
       push_bytes([](pb::PushRequest& p) { p.mutable_dense(0)->set_chunks(0, 3); }), kToken,
       StatusCode::NOT_FOUND, "Push: table 'w' has no chunk 3; it has 3"},
      {"negative shape", "Register",
       [] {
         pb::RegisterRequest r;
         pb::TableSpec& t = *r.add_tables();
         t.set_name("x");
         t.add_shape(4);
         t.add_shape(-3);
         return r.SerializeAsString();
       }(),
       kToken, StatusCode::INVALID_ARGUMENT,
       "Register: tables[0].shape[1] = -3; expected a non-negative number"},
      {"unknown membership op", "Membership",
       [] {
         pb::MembershipRequest r;
         r.set_op(9);
         r.set_worker(3);
         return r.SerializeAsString();
       }(),
       kToken, StatusCode::INVALID_ARGUMENT,
       "Membership: op = 9; expected 0 (join), 1 (fence) or 2 (leave)"},
      {"a join to a job of fixed workers", "Membership",
       [] {
         pb::MembershipRequest r;
         r.set_worker(3);
         return r.SerializeAsString();
       }(),
       kToken, StatusCode::INVALID_ARGUMENT,
       "Membership: parameter server: worker 3 joins or leaves, but this server serves a job of "
       "fixed workers (expected an elastic job: shoal run --servers S --min A --max B, without "
       "--ps-replicas)"},
      {"no token", "Push", good, std::nullopt, StatusCode::UNAUTHENTICATED,
       "Push carries no job token; expected the job's token in metadata shoal-job-token "
       "(SHOAL_JOB_TOKEN)"},
      {"wrong token", "Push", good, std::string("0123456789abcdef0123456789abcdeX"),
       StatusCode::UNAUTHENTICATED, "Push carries a token that is not this job's"},
      {"unknown method", "Drop", "", kToken, StatusCode::UNIMPLEMENTED, ""},
      // dense[0] holds a values field that claims 1 GiB: refused before anything is reserved.
      {"values longer than the message", "Push", std::string("\x22\x06\x1a\x80\x80\x80\x80\x04", 8),
       kToken, StatusCode::INVALID_ARGUMENT,
       "malformed Push request (8 bytes): not a PushRequest message (truncated or corrupt)"},
      // A length of 2^32 + 2, which 32 bits would read as 2.
      {"length of 33 bits", "Push", std::string("\x22\x82\x80\x80\x80\x10\x08\x00", 8), kToken,
       StatusCode::INVALID_ARGUMENT,
       "malformed Push request (8 bytes): not a PushRequest message (truncated or corrupt)"},
      {"slice longer than the message", "Push", std::string("\x22\x7f\x08\x00", 4), kToken,
       StatusCode::INVALID_ARGUMENT,
       "malformed Push request (4 bytes): not a PushRequest message (truncated or corrupt)"},
  };
  PullRequest pull;
  pull.dense = {DenseSlice{0, {2}, {}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const grpc::Status status = raw.call(c.method, c.bytes, c.token);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    if (!c.message.empty()) {
      EXPECT_EQ(status.error_message(), c.message);
    }
    // The server is still there, and nothing refused reached its tables.
    const PullReply reply = server.pull(pull, 5s);
    EXPECT_EQ(reply.clock, 0);
    EXPECT_EQ(reply.dense.at(0).values, std::vector<float>(452, 0.0f));
  }
  // A good raw request is obeyed: the refusals above were for what they carried.
  EXPECT_TRUE(raw.call("Push", good).ok());
  EXPECT_EQ(server.pull(pull, 5s).dense.at(0).values, std::vector<float>(452, 1.0f));
}

// Note [Values in shared memory] (wire.h): a client whose server shares its host sends a dense
// push's values and receives a dense pull's through its shared segment; they arrive exactly as
// inline ones do, and small pushes stay inline.
TEST_F(PsRpcTest, DenseValuesCrossThroughSharedMemoryOnOneHost) {
  start(1);
  RpcClient& server = *clients_[0];
  constexpr int64_t kValues = 40 * kChunk + 100;  // 41 chunks, the last one short
  RegisterRequest request;
  request.tables = {TableSpec{"big", false, {kValues}, {}, {}, 1}};
  const std::vector<float> first = ramp(kValues, 2), a = ramp(kValues, 0.75f);
  std::vector<int64_t> chunks;
  for (int64_t c = 0; c <= kValues / kChunk; ++c) chunks.push_back(c);
  request.initial = {DenseSlice{0, chunks, first}};
  server.register_tables(request, 5s);
  EXPECT_EQ(server.shared_calls(), 0);

  PushRequest push{0, 0, 1, {DenseSlice{0, chunks, a}}, {}};
  EXPECT_TRUE(server.push(push, 5s).counted);
  EXPECT_EQ(server.shared_calls(), 1) << "the push's values did not go through the segment";
  const std::vector<int64_t> backwards(chunks.rbegin(), chunks.rend());
  PullReply reply;
  server.pull({0, 1, {DenseSlice{0, backwards, {}}}, {}}, 5s, reply);
  EXPECT_EQ(server.shared_calls(), 2) << "the pull's values did not go through the segment";
  EXPECT_TRUE(server.sharing());
  std::vector<float> expected;
  for (int64_t c : backwards)
    for (int64_t i = c * kChunk; i < std::min(kValues, (c + 1) * kChunk); ++i)
      expected.push_back(first[i] + a[i]);
  ASSERT_EQ(reply.dense.size(), 1u);
  EXPECT_EQ(reply.dense[0].chunks, backwards);
  EXPECT_EQ(reply.dense[0].values, expected);

  // With a sink (a worker's pull into its parameters), the same values are handed over where they
  // arrived, and the reply keeps none of them.
  std::vector<float> sunk;
  std::vector<size_t> sunk_slices;
  const DenseSink sink = [&](size_t index, const DenseSlice& slice, const float* values,
                             size_t count) {
    EXPECT_EQ(slice.chunks, backwards);
    EXPECT_TRUE(slice.values.empty());
    sunk_slices.push_back(index);
    sunk.assign(values, values + count);
  };
  PullReply in_place;
  server.pull({0, 1, {DenseSlice{0, backwards, {}}}, {}}, 5s, in_place, &sink);
  EXPECT_EQ(server.shared_calls(), 3);
  EXPECT_EQ(sunk_slices, std::vector<size_t>{0});
  EXPECT_EQ(sunk, expected);
  ASSERT_EQ(in_place.dense.size(), 1u);
  EXPECT_EQ(in_place.dense[0].chunks, backwards);
  EXPECT_TRUE(in_place.dense[0].values.empty());

  // A push of one chunk is below the size worth a segment: inline, and summed all the same.
  PushRequest small{0, 1, 1, {DenseSlice{0, {3}, ramp(kChunk, 1)}}, {}};
  server.push(small, 5s);
  EXPECT_EQ(server.shared_calls(), 3);
  const PullReply after = server.pull({0, 2, {DenseSlice{0, {3}, {}}}, {}}, 5s);
  for (int64_t i = 0; i < kChunk; ++i)
    ASSERT_EQ(after.dense.at(0).values.at(i),
              first[3 * kChunk + i] + a[3 * kChunk + i] + ramp(kChunk, 1)[i])
        << i;

  // From a source (a worker's push from its gradients): the values are written straight into the
  // segment and the request's slices stay empty; too few for a segment, they are written into the
  // slices and go inline.
  const std::vector<float> b = ramp(kValues, -0.25f), c = ramp(kChunk, 3);
  auto source_of = [](const std::vector<float>& values) {
    return DenseSource{{values.size()}, [&values](size_t index, float* out) {
                         EXPECT_EQ(index, 0u);
                         std::copy(values.begin(), values.end(), out);
                       }};
  };
  PushRequest sourced{0, 2, 1, {DenseSlice{0, chunks, {}}}, {}};
  const int shared_before = server.shared_calls();  // the pull of one chunk above went through it
  EXPECT_TRUE(server.push(sourced, 5s, source_of(b)).counted);
  EXPECT_EQ(server.shared_calls(), shared_before + 1)
      << "the sourced push did not go through the segment";
  EXPECT_TRUE(sourced.dense[0].values.empty());
  PushRequest sourced_small{0, 3, 1, {DenseSlice{0, {3}, {}}}, {}};
  EXPECT_TRUE(server.push(sourced_small, 5s, source_of(c)).counted);
  EXPECT_EQ(server.shared_calls(), shared_before + 1);
  EXPECT_EQ(sourced_small.dense[0].values, c);
  PullReply last;
  server.pull({0, 4, {DenseSlice{0, chunks, {}}}, {}}, 5s, last);
  const std::vector<float> one_chunk = ramp(kChunk, 1);
  ASSERT_EQ(last.dense.size(), 1u);
  ASSERT_EQ(last.dense[0].values.size(), static_cast<size_t>(kValues));
  for (int64_t i = 0; i < kValues; ++i) {
    const bool third = i >= 3 * kChunk && i < 4 * kChunk;
    const float expected_i = first[i] + a[i] + (third ? one_chunk[i - 3 * kChunk] : 0.f) + b[i] +
                             (third ? c[i - 3 * kChunk] : 0.f);
    ASSERT_EQ(last.dense[0].values[i], expected_i) << i;
  }
}

// Note [The values' mirror] (src/ps/mirror.h): a parameter server on this host answers a pull of
// its dense values with where they are in its mirror, and the worker copies them from there (one
// copy: the server copies nothing). A copy that a change of the values overlapped (here an async
// push of another worker, applied while the first worker copies) is pulled again without the
// mirror, and the worker ends with the values after the change.
TEST_F(PsRpcTest, APullCopiesFromTheServersMirrorAndAgainWhenAChangeOverlapsIt) {
  start(1, {"--handler", "core", "--mode", "async"}, {"SHOAL_PS_SERVERS=1", "SHOAL_PS_WORKERS=2"});
  RpcClient& first = *clients_[0];
  RpcClient second(0, first.address(), kToken);
  constexpr int64_t kValues = 3 * kChunkElements + 5;
  std::vector<int64_t> chunks;
  for (int64_t c = 0; c * kChunkElements < kValues; ++c) chunks.push_back(c);
  OptimizerSpec sgd;
  sgd.lr = 1;
  RegisterRequest registration;
  registration.tables = {TableSpec{"big", false, {kValues}, sgd, {}, 1}};
  registration.mode = "async";
  const std::vector<float> initial = ramp(kValues, 0.5f);
  registration.initial = {DenseSlice{0, chunks, initial}};
  first.register_tables(registration, 10s);
  registration.worker = 1;
  registration.initial.clear();
  second.register_tables(registration, 10s);

  const PullRequest pull{0, 0, {DenseSlice{0, chunks, {}}}, {}};
  std::vector<float> copied;
  DenseSink keep = [&](size_t, const DenseSlice&, const float* values, size_t count) {
    copied.assign(values, values + count);
  };
  PullReply reply;
  first.pull(pull, 10s, reply, &keep);
  EXPECT_EQ(first.mirrored_calls(), 1) << "the pull was not answered from the mirror";
  EXPECT_EQ(first.mirror_retries(), 0);
  EXPECT_TRUE(reply.dense.at(0).values.empty()) << "the values came in the reply";
  EXPECT_EQ(copied, initial);

  // The second worker's push lands while the first copies its next pull.
  const std::vector<float> gradient = ramp(kValues, 0.25f);
  bool pushed = false;
  DenseSink push_meanwhile = [&](size_t, const DenseSlice&, const float* values, size_t count) {
    if (!pushed) {
      pushed = true;
      EXPECT_TRUE(
          second.push(PushRequest{1, 0, 1, {DenseSlice{0, chunks, gradient}}, {}}, 10s).counted);
    }
    copied.assign(values, values + count);
  };
  copied.clear();
  PullReply again;
  first.pull(pull, 10s, again, &push_meanwhile);
  EXPECT_TRUE(pushed);
  EXPECT_EQ(first.mirror_retries(), 1) << "the overlapped copy was not pulled again";
  const std::vector<float>& after =
      again.dense.at(0).values.empty() ? copied : again.dense[0].values;
  ASSERT_EQ(after.size(), static_cast<size_t>(kValues));
  for (int64_t i = 0; i < kValues; ++i) ASSERT_EQ(after[i], initial[i] - gradient[i]) << i;
}

// A shared segment is the worker's memory: a call that names one the server cannot use (not as
// named, another host) is FAILED_PRECONDITION, so that the client goes on inline; a request whose
// slices name values outside the segment, or name shared values without one, is refused as any
// malformed request, and the server goes on serving.
TEST_F(PsRpcTest, SharedValuesOutOfRangeOrWithoutASegmentAreRefused) {
  start(1);
  RpcClient& server = *clients_[0];
  server.register_tables(tables(0), 5s);
  RawCaller raw(server.address());
  using grpc::StatusCode;
  auto segment = SharedSegment::create(1000);
  ASSERT_NE(segment, nullptr) << "no memfd on this system";
  std::fill(segment->values().data, segment->values().data + 1000, 1.0f);
  const std::string handle = segment->handle();
  std::string other_tag = handle;
  const size_t tag_at = handle.size() - std::to_string(64 + 4000).size() - 1 - 32;
  other_tag[tag_at] = other_tag[tag_at] == '0' ? '1' : '0';
  std::string other_host = handle;
  other_host.replace(other_host.find(boot_id()), boot_id().size(), std::string(36, 'f'));
  auto shared = [](uint64_t count) {
    return push_bytes([count](pb::PushRequest& p) {
      p.mutable_dense(0)->clear_values();
      p.mutable_dense(0)->set_shared(count);
    });
  };
  struct Case {
    std::string what, method, bytes;
    std::optional<std::string> segment;
    StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"shared values, no segment", "Push", shared(452), std::nullopt, StatusCode::INVALID_ARGUMENT,
       "Push: dense[0] names 452 values in a shared segment, but the call brought none"},
      {"past the segment's end", "Push", shared(1001), handle, StatusCode::INVALID_ARGUMENT,
       "Push: dense[0] names 1001 values from value 0 of the shared segment, which holds 1000; "
       "expected values within it"},
      {"a count of 2^64 - 1", "Push", shared(~uint64_t{0}), handle, StatusCode::INVALID_ARGUMENT,
       "Push: dense[0] names 18446744073709551615 values from value 0 of the shared segment, "
       "which holds 1000; expected values within it"},
      {"values and shared values", "Push",
       push_bytes([](pb::PushRequest& p) { p.mutable_dense(0)->set_shared(452); }), handle,
       StatusCode::INVALID_ARGUMENT,
       "Push: dense[0] carries values and names 452 in the shared segment; expected one or the "
       "other"},
      {"a pull naming shared values", "Pull",
       [] {
         pb::PullRequest p;
         pb::DenseSlice& s = *p.add_dense();
         s.add_chunks(2);
         s.set_shared(452);
         return p.SerializeAsString();
       }(),
       handle, StatusCode::INVALID_ARGUMENT,
       "Pull: dense[0] names 452 values in a shared segment, but the call brought none"},
      {"a handle that is not one", "Push", shared(452), std::string("v1 1 2 ../../etc/passwd"),
       StatusCode::FAILED_PRECONDITION, ""},
      {"another segment's tag", "Push", shared(452), other_tag, StatusCode::FAILED_PRECONDITION,
       ""},
      {"another host's segment", "Push", shared(452), other_host, StatusCode::FAILED_PRECONDITION,
       ""},
  };
  PullRequest pull;
  pull.dense = {DenseSlice{0, {2}, {}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const grpc::Status status = raw.call(c.method, c.bytes, kToken, c.segment);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    if (!c.message.empty()) {
      EXPECT_EQ(status.error_message(), c.message);
    }
    const PullReply reply = server.pull(pull, 5s);
    EXPECT_EQ(reply.dense.at(0).values, std::vector<float>(452, 0.0f));
  }
  // The same push naming values inside the segment is obeyed: they are the segment's.
  EXPECT_TRUE(raw.call("Push", shared(452), kToken, handle).ok());
  EXPECT_EQ(server.pull(pull, 5s).dense.at(0).values, std::vector<float>(452, 1.0f));
}

// The server reads a request as protobuf reads ps.proto (src/ps/wire.h): its chunks not packed,
// fields unknown to the server among the known ones, rows after the slices, and a values field
// given twice (the last one counts).
TEST_F(PsRpcTest, ARequestIsReadAsProtobufReadsIt) {
  start(1);
  RpcClient& server = *clients_[0];
  server.register_tables(tables(0), 5s);
  std::vector<float> values(452);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.5f + static_cast<float>(i) * -1.25f;
  const std::string floats(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  std::string slice;
  {
    google::protobuf::io::StringOutputStream out(&slice);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.WriteTag(3 << 3 | 2);  // values, first: 100 zeros that the second replaces
    coded.WriteVarint32(400);
    coded.WriteString(std::string(400, '\0'));
    coded.WriteTag(9 << 3 | 0);  // unknown varint
    coded.WriteVarint64(123456789);
    coded.WriteTag(2 << 3 | 0);  // chunks, one value, not packed
    coded.WriteVarint64(2);
    coded.WriteTag(3 << 3 | 2);  // values
    coded.WriteVarint32(static_cast<uint32_t>(floats.size()));
    coded.WriteString(floats);
  }
  std::string push;
  {
    google::protobuf::io::StringOutputStream out(&push);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.WriteTag(15 << 3 | 2);  // unknown bytes
    coded.WriteVarint32(5);
    coded.WriteString("hello");
    coded.WriteTag(4 << 3 | 2);  // dense
    coded.WriteVarint32(static_cast<uint32_t>(slice.size()));
    coded.WriteString(slice);
    coded.WriteTag(3 << 3 | 0);  // rows, after the slice
    coded.WriteVarint64(1);
  }
  RawCaller raw(server.address());
  const grpc::Status status = raw.call("Push", push);
  ASSERT_TRUE(status.ok()) << status.error_message();
  PullRequest pull;
  pull.dense = {DenseSlice{0, {2}, {}}};
  const PullReply reply = server.pull(pull, 5s);
  EXPECT_EQ(reply.clock, 1);
  EXPECT_EQ(reply.dense.at(0).values, values);
}

TEST_F(PsRpcTest, AKilledServerIsACommErrorNamingIt) {
  start(2);
  clients_[1]->register_tables(tables(0), 5s);
  ASSERT_TRUE(servers_[1]->stop(SIGKILL, 10s));
  PullRequest pull;
  pull.dense = {DenseSlice{0, {0}, {}}};
  const auto start = Clock::now();
  const std::string message = error_of([&] { clients_[1]->pull(pull, 5s); }, "CommError");
  EXPECT_LT(seconds_since(start), 5 + 10);
  EXPECT_EQ(message.rfind("parameter server 1 (" + clients_[1]->address() +
                              ") is unreachable: Pull "
                              "failed after ",
                          0),
            0u)
      << message;
  EXPECT_EQ(clients_[0]->ping(5s), 0);  // the other server is not affected
}

TEST_F(PsRpcTest, ASilentServerIsACommErrorAtTheDeadline) {
  start(1);
  clients_[0]->register_tables(tables(0), 5s);
  ASSERT_TRUE(stop_process(servers_[0]->pid(), 10s)) << process_state(servers_[0]->pid());
  PullRequest pull;
  pull.dense = {DenseSlice{0, {0}, {}}};
  const auto start = Clock::now();
  const std::string message = error_of([&] { clients_[0]->pull(pull, 1500ms); }, "CommError");
  const double waited = seconds_since(start);
  ::kill(servers_[0]->pid(), SIGCONT);
  EXPECT_GE(waited, 1.4);
  EXPECT_LT(waited, 1.5 + 10);
  EXPECT_EQ(message.rfind("parameter server 0 (" + clients_[0]->address() +
                              ") did not answer Pull "
                              "within its deadline of 1.50 s (waited ",
                          0),
            0u)
      << message;
  // Resumed, it serves again.
  EXPECT_EQ(clients_[0]->ping(5s), 0);
}

TEST_F(PsRpcTest, AServerStopsOnSigtermWithCodeZero) {
  start(1);
  const auto status = servers_[0]->stop(SIGTERM, 10s);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
}

TEST_F(PsRpcTest, AServerEndsWithItsJobsStore) {
  start(1);
  store_.reset();  // the launcher that hosts the store is gone: so is the job
  const auto status = servers_[0]->stop(0, 10s);  // signal 0: nothing sent, only waited for
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
}

// A message's bytes cut into slices of `piece` bytes, as gRPC may hand them to the reader.
grpc::ByteBuffer in_pieces(const grpc::ByteBuffer& message, size_t piece) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(message.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  std::vector<grpc::Slice> pieces;
  for (size_t at = 0; at < bytes.size(); at += piece) pieces.emplace_back(bytes.substr(at, piece));
  return grpc::ByteBuffer(pieces.data(), pieces.size());
}

// Values, tags and lengths split between slices at any byte are read exactly, for a request
// (copied into one slice when written) and a pull's reply (its large values lent to gRPC).
TEST(PsWire, MessagesCutIntoAnySlicesAreReadExactly) {
  PushRequest push;
  push.worker = 3;
  push.clock = 17;
  push.rows = 64;
  push.verdict = PushRequest::Verdict::kDropped;
  push.gradient_sqr = 0;  // measured, and 0: written all the same
  push.dense = {DenseSlice{0, {2, 0, 1}, ramp(3000, 0.5f)}, DenseSlice{4, {}, {}}};
  push.sparse = {SparseSlice{1, {42, int64_t{1} << 40, 7}, ramp(12, -2)}};
  PullReply reply;
  reply.clock = 9;
  reply.staleness = 2;
  reply.noise = {5, 1.5, 0.25, 32, 96};
  reply.dense = {DenseSlice{0, {0, 1, 2, 3}, ramp(4096, 0.25f)}};  // 16 KiB: lent, not copied
  reply.sparse = {SparseSlice{1, {5}, {1.5f, 2.5f}}};
  const PullReply sent = reply;
  const grpc::ByteBuffer push_bytes = wire_format::encode(push);
  const grpc::ByteBuffer reply_bytes = wire_format::encode(std::move(reply));
  // The bytes are protobuf's for ps.proto.
  pb::PushRequest message;
  message.set_worker(push.worker);
  message.set_clock(push.clock);
  message.set_rows(push.rows);
  for (const DenseSlice& d : push.dense) {
    pb::DenseSlice& out = *message.add_dense();
    out.set_table(d.table);
    out.mutable_chunks()->Add(d.chunks.begin(), d.chunks.end());
    out.set_values(d.values.data(), d.values.size() * 4);
  }
  pb::SparseSlice& sparse = *message.add_sparse();
  sparse.set_table(1);
  sparse.mutable_ids()->Add(push.sparse[0].ids.begin(), push.sparse[0].ids.end());
  sparse.set_values(push.sparse[0].values.data(), push.sparse[0].values.size() * 4);
  message.set_verdict(2);
  message.set_gradient_sqr(0);
  std::vector<grpc::Slice> written;
  ASSERT_TRUE(push_bytes.Dump(&written).ok());
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(written[0].begin()), written[0].size()),
            message.SerializeAsString());
  std::vector<grpc::Slice> reply_written;
  ASSERT_TRUE(reply_bytes.Dump(&reply_written).ok());
  std::string reply_string;
  for (const grpc::Slice& piece : reply_written)
    reply_string.append(reinterpret_cast<const char*>(piece.begin()), piece.size());
  pb::PullReply parsed;
  ASSERT_TRUE(parsed.ParseFromString(reply_string));
  EXPECT_EQ(std::make_tuple(parsed.clock(), parsed.staleness(), parsed.noise_step()),
            std::make_tuple(9, 2, 6));  // the step plus 1
  EXPECT_EQ(std::make_tuple(parsed.noise_local_sqr(), parsed.noise_average_sqr(),
                            parsed.noise_small(), parsed.noise_big()),
            std::make_tuple(1.5, 0.25, 32.0, 96.0));
  for (size_t piece : {1, 3, 4, 7, 4093, 1 << 20}) {
    SCOPED_TRACE("slices of " + std::to_string(piece) + " bytes");
    PushRequest p;
    ASSERT_TRUE(wire_format::decode(in_pieces(push_bytes, piece), p));
    EXPECT_EQ(std::make_tuple(p.worker, p.clock, p.rows), std::make_tuple(3, 17, 64));
    EXPECT_EQ(p.verdict, PushRequest::Verdict::kDropped);
    EXPECT_EQ(p.gradient_sqr, 0.0);
    ASSERT_EQ(p.dense.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(p.dense[i].table, push.dense[i].table);
      EXPECT_EQ(p.dense[i].chunks, push.dense[i].chunks);
      EXPECT_EQ(p.dense[i].values, push.dense[i].values);
    }
    ASSERT_EQ(p.sparse.size(), 1u);
    EXPECT_EQ(p.sparse[0].table, 1);
    EXPECT_EQ(p.sparse[0].ids, push.sparse[0].ids);
    EXPECT_EQ(p.sparse[0].values, push.sparse[0].values);
    PullReply r;
    ASSERT_TRUE(wire_format::decode(in_pieces(reply_bytes, piece), r));
    EXPECT_EQ(std::make_tuple(r.clock, r.staleness), std::make_tuple(9, 2));
    EXPECT_EQ(std::make_tuple(r.noise.step, r.noise.local_sqr, r.noise.average_sqr, r.noise.small,
                              r.noise.big),
              std::make_tuple(int64_t{5}, 1.5, 0.25, 32.0, 96.0));
    ASSERT_EQ(r.dense.size(), 1u);
    EXPECT_EQ(r.dense[0].chunks, sent.dense[0].chunks);
    EXPECT_EQ(r.dense[0].values, sent.dense[0].values);
    ASSERT_EQ(r.sparse.size(), 1u);
    EXPECT_EQ(r.sparse[0].ids, sent.sparse[0].ids);
    EXPECT_EQ(r.sparse[0].values, sent.sparse[0].values);
  }
  // Cut short anywhere inside the first values, the request is not a message.
  for (size_t end : {size_t{20}, size_t{21}, size_t{1000}, size_t{12001}}) {
    grpc::Slice prefix(written[0].begin(), end);
    PushRequest p;
    EXPECT_FALSE(wire_format::decode(grpc::ByteBuffer(&prefix, 1), p)) << end;
  }
}

// A struct decoded into again (a worker's pull reply, a server thread's push, kept from step to
// step) reads exactly what a fresh one reads: nothing of the message before remains, not its
// scalars, its extra slices, its chunks nor its values; and a message of the same sizes reuses
// the storage instead of allocating it.
TEST(PsWire, AStructReadIntoAgainHoldsOnlyTheNewMessage) {
  PushRequest big;
  big.worker = 2, big.clock = 5, big.rows = 7, big.gradient_sqr = 2.5;
  big.dense = {DenseSlice{0, {0, 1, 2}, ramp(3000, 1)}, DenseSlice{1, {4}, ramp(10, 3)},
               DenseSlice{2, {5}, ramp(4, 4)}};
  big.sparse = {SparseSlice{3, {9, 8}, ramp(4, -1)}};
  PushRequest small;
  small.dense = {DenseSlice{1, {3}, ramp(20, 0.5f)}};  // worker, clock, rows 0: not written
  PullReply reply_big;
  reply_big.clock = 4, reply_big.staleness = 1;
  reply_big.noise = {3, 1, 2, 4, 8};
  reply_big.dense = {DenseSlice{0, {0, 1}, ramp(5000, 2)}, DenseSlice{1, {2}, ramp(7, 1)}};
  reply_big.sparse = {SparseSlice{3, {1}, {1.0f, 2.0f}}};
  PullReply reply_small;
  reply_small.dense = {DenseSlice{0, {1}, ramp(5, 2)}};
  const PullReply sent_big = reply_big, sent_small = reply_small;
  const grpc::ByteBuffer big_bytes = wire_format::encode(big);
  const grpc::ByteBuffer small_bytes = wire_format::encode(small);
  const grpc::ByteBuffer reply_big_bytes = wire_format::encode(std::move(reply_big));
  const grpc::ByteBuffer reply_small_bytes = wire_format::encode(std::move(reply_small));
  auto same = [](const auto& a, const auto& b) {
    EXPECT_EQ(a.dense.size(), b.dense.size());
    for (size_t i = 0; i < std::min(a.dense.size(), b.dense.size()); ++i) {
      EXPECT_EQ(a.dense[i].table, b.dense[i].table) << i;
      EXPECT_EQ(a.dense[i].chunks, b.dense[i].chunks) << i;
      EXPECT_EQ(a.dense[i].values, b.dense[i].values) << i;
    }
    EXPECT_EQ(a.sparse.size(), b.sparse.size());
    for (size_t i = 0; i < std::min(a.sparse.size(), b.sparse.size()); ++i) {
      EXPECT_EQ(a.sparse[i].table, b.sparse[i].table) << i;
      EXPECT_EQ(a.sparse[i].ids, b.sparse[i].ids) << i;
      EXPECT_EQ(a.sparse[i].values, b.sparse[i].values) << i;
    }
  };
  PushRequest push;
  ASSERT_TRUE(wire_format::decode(big_bytes, push));
  same(push, big);
  const float* storage = push.dense[0].values.data();
  ASSERT_TRUE(wire_format::decode(small_bytes, push));
  EXPECT_EQ(std::make_tuple(push.worker, push.clock, push.rows), std::make_tuple(0, 0, 0));
  EXPECT_EQ(push.gradient_sqr, -1.0);  // not measured
  same(push, small);
  ASSERT_TRUE(wire_format::decode(big_bytes, push));
  EXPECT_EQ(std::make_tuple(push.worker, push.clock, push.rows), std::make_tuple(2, 5, 7));
  EXPECT_EQ(push.gradient_sqr, 2.5);
  same(push, big);
  ASSERT_TRUE(wire_format::decode(big_bytes, push));
  same(push, big);
  EXPECT_EQ(push.dense[0].values.data(), storage) << "the values' storage was not reused";

  PullReply reply;
  ASSERT_TRUE(wire_format::decode(reply_big_bytes, reply));
  same(reply, sent_big);
  ASSERT_TRUE(wire_format::decode(reply_small_bytes, reply));
  EXPECT_EQ(std::make_tuple(reply.clock, reply.staleness), std::make_tuple(0, 0));
  EXPECT_EQ(std::make_tuple(reply.noise.step, reply.noise.local_sqr, reply.noise.big),
            std::make_tuple(int64_t{-1}, 0.0, 0.0));
  same(reply, sent_small);
  ASSERT_TRUE(wire_format::decode(reply_big_bytes, reply));
  EXPECT_EQ(std::make_tuple(reply.clock, reply.staleness), std::make_tuple(4, 1));
  EXPECT_EQ(std::make_tuple(reply.noise.step, reply.noise.average_sqr, reply.noise.big),
            std::make_tuple(int64_t{3}, 2.0, 8.0));
  same(reply, sent_big);
}

// Note [Pushes read in place] (server_steps.cpp): a push sent in place through a segment is read
// there until its step is summed, so a sync step that waits for its second worker sums what the
// segment holds then, and the server keeps the segment's memory until that step; one sent without
// the flag (a primary's forward to its backup) is copied when it arrives. The sender below breaks
// its word on purpose, to see which of the two the server did.
TEST(PsWire, APushSentInPlaceIsReadWhereItIsUntilItsStepIsSummed) {
  for (const bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "in place" : "not in place");
    ServerCoreOptions options;
    options.workers = {0, 1};
    options.shards = ShardMap(1).shards_of(0);
    ServerCore core(options);
    OptimizerSpec sgd;
    sgd.lr = 1;
    RegisterRequest request;
    request.tables = {TableSpec{"w", false, {4}, sgd, {}, 1}};
    request.initial = {DenseSlice{0, {0}, std::vector<float>(4, 0.f)}};
    core.register_tables(request, shoal::Deadline(std::chrono::milliseconds(0)));

    auto segment = std::make_shared<std::vector<float>>(16, 0.f);
    const SharedValues shm{segment->data(), segment->size()};
    const PushRequest first{0, 0, 1, {DenseSlice{0, {0}, std::vector<float>(4, 1.f)}}, {}};
    const grpc::ByteBuffer bytes = wire_format::encode(first, shm, nullptr, in_place);
    PushRequest received;
    ASSERT_TRUE(wire_format::decode(bytes, received, &shm, segment));
    ASSERT_EQ(received.dense.size(), 1u);
    EXPECT_EQ(received.dense[0].view == segment->data(), in_place);
    EXPECT_EQ(received.dense[0].values.empty(), in_place);
    core.push_taking(received, shoal::Deadline(std::chrono::milliseconds(0)));
    received = PushRequest();  // as the transport's thread forgets it

    std::fill(segment->begin(), segment->end(), 3.f);
    const std::weak_ptr<std::vector<float>> watch = segment;
    segment.reset();
    EXPECT_EQ(watch.expired(), !in_place) << "the held push keeps the segment only in place";
    core.push(PushRequest{1, 0, 1, {DenseSlice{0, {0}, std::vector<float>(4, 1.f)}}, {}},
              shoal::Deadline(std::chrono::milliseconds(0)));
    ASSERT_EQ(core.step(), 1);
    EXPECT_TRUE(watch.expired()) << "the summed push still keeps the segment";
    // SGD with lr 1 from 0: minus the mean of the two pushes.
    const float expected = in_place ? -(3.f + 1.f) / 2 : -(1.f + 1.f) / 2;
    const PullRequest pull{0, 1, {DenseSlice{0, {0}, {}}}, {}};
    EXPECT_EQ(core.pull(pull, shoal::Deadline(std::chrono::milliseconds(0))).dense.at(0).values,
              std::vector<float>(4, expected));
  }
}

TEST(PsRpc, ConnectingWithoutServersTimesOutNamingTheFirstMissing) {
  comm::StoreOptions options;
  options.is_server = true;
  const comm::StorePtr store = comm::open_store(options);
  comm::put(store, server_key(0), "127.0.0.1:1");
  const auto start = Clock::now();
  EXPECT_EQ(error_of([&] { connect_servers(store, 2, kToken, 300ms); }, "CommError"),
            "parameter server 1 did not publish its address (ps/server/1 in the job's store) "
            "within 300 ms; expected 2 servers (SHOAL_PS_SERVERS)");
  EXPECT_LT(seconds_since(start), 0.3 + 10);
}

const std::string kWorker = test_programs_dir() + "/ps_worker";

// The parameter server's core behind the real transport, in real processes: every worker checks
// after each sync step that the servers hold what one process applying the mean gradient of all
// workers' rows holds (tests/programs/ps_worker.cpp), whatever the number of servers.
TEST(PsLaunch, SyncStepsOnServersEqualOneProcess) {
  for (const auto& [servers, workers] : {std::pair{1, 3}, {2, 2}, {3, 3}}) {
    const testing::RunResult run = testing::run_shoal(
        {"--servers", std::to_string(servers), "-n", std::to_string(workers), kWorker}, 120s);
    EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
    for (int r = 0; r < workers; ++r) {
      const std::string ok =
          "[" + std::to_string(r) + "] ps ok " + std::to_string(servers) + " servers, 4 sync steps";
      EXPECT_NE(run.out.find(ok), std::string::npos) << run.out;
    }
  }
}

// The pid of the launcher's child running `shoal ps-server --index <index>`.
pid_t find_server(pid_t launcher, int index) {
  return shoal::testing::find_child(
      launcher, std::string("ps-server") + '\0' + "--index" + '\0' + std::to_string(index) + '\0');
}

TEST(PsLaunch, AKilledServerFailsTheJobNamingIt) {
  testing::ShoalRun run({"--servers", "2", "-n", "2", kWorker, "--hold"});
  ASSERT_TRUE(run.wait_until(
      [](const testing::RunResult& r) {
        return r.out.find("[0] ps ready") != std::string::npos &&
               r.out.find("[1] ps ready") != std::string::npos;
      },
      60s))
      << run.so_far().out << run.so_far().err;
  const pid_t server = find_server(run.pid(), 1);
  ASSERT_GT(server, 0);
  const auto start = Clock::now();
  ::kill(server, SIGKILL);
  const testing::RunResult result = run.wait(30s);
  EXPECT_LT(seconds_since(start), 20);
  EXPECT_EQ(result.exit_code, 128 + SIGKILL) << result.err;
  EXPECT_NE(result.err.find("shoal run: parameter server 1 was killed by signal 9 (SIGKILL); "
                            "stopping the workers"),
            std::string::npos)
      << result.err;
}

TEST(PsLaunch, ServersFlagIsCheckedAtOnce) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--servers", "-1", kWorker},
       "shoal run: --servers: expected a number of servers from 0 to 1024, got '-1'"},
      {{"--servers", "2", "-n", "3", "--ps-backup-workers", "3", kWorker},
       "shoal run: --ps-backup-workers 3 leaves no worker to aggregate; expected fewer than the "
       "job's 3 workers"},
      {{"-n", "3", "--ps-backup-workers", "1", kWorker},
       "shoal run: --ps-backup-workers needs --servers S; add it"},
      {{"--servers", "2", "--min", "1", "--max", "2", "--quorum", kWorker},
       "shoal run: --quorum is for elastic all-reduce jobs; a job with --servers keeps its state "
       "on the servers (drop it)"},
      {{"--servers", "2", "--min", "1", "--max", "2", "--ps-replicas", "2", kWorker},
       "shoal run: --ps-replicas is not supported with elastic workers (--min/--max) yet; drop "
       "one of them"},
  };
  for (const auto& [args, message] : cases) {
    const testing::RunResult run = testing::run_shoal(args, 30s);
    EXPECT_EQ(run.exit_code, 2);
    EXPECT_EQ(run.err, message + "\n");
  }
}

}  // namespace
}  // namespace shoal::ps::detail
