// Collectives among co-located workers through shared memory (src/comm/shm, docs/comm.md "Shared
// memory among co-located workers (in progress)"). Members are real forked processes (forked
// before this process has any thread) that report through a pipe (tests/child_process.h); member
// 0 creates the segment and hands its handle to the others through another pipe, as the store
// will. Oracles: closed forms for every element, and results bitwise equal on every member.
// Fault tests SIGKILL and SIGSTOP a member; their bounds (2 s for a kill that is noticed in
// ~10 ms, the deadline plus 1 s for a stop) hold on a loaded 2-core machine.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "child_process.h"
#include "comm/shm/executor.h"
#include "comm/shm/local_group.h"
#include "comm/shm/locality.h"
#include "comm/shm/reduce.h"
#include "comm/shm/segment.h"
#include "shoal/core/error.h"

namespace shoal::comm::shm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Child = shoal::testing::ChildProcess;
using Say = Child::Say;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Handles pass through a pipe in records of this size: a write of at most PIPE_BUF bytes is
// atomic, so each reader takes exactly one record.
constexpr size_t kRecord = 512;

std::string read_record(int fd, Duration timeout) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) {
    throw CommError("no handle from member 0 within " + format_duration(timeout));
  }
  char record[kRecord];
  if (::read(fd, record, kRecord) != static_cast<ssize_t>(kRecord))
    throw CommError("short handle record");
  return std::string(record, strnlen(record, kRecord));
}

using Body = std::function<void(LocalGroup&, const Say&)>;

// k members running `body` on one group; each says "done ..." or "error: ..." at the end.
class Job {
 public:
  Job(int k, const Body& body, SegmentSizes sizes = {}, Duration timeout = 30s) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    for (int r = 0; r < k; ++r) {
      members_.push_back(std::make_unique<Child>([=](const Say& say) {
        Segment segment = [&] {
          if (r > 0) return Segment::open(read_record(fds[0], 10s), k);
          Segment created = Segment::create(k, sizes);
          char record[kRecord] = {};
          std::snprintf(record, kRecord, "%s", created.handle().c_str());
          for (int i = 1; i < k; ++i) (void)!::write(fds[1], record, kRecord);
          say("handle " + created.handle());
          return created;
        }();
        LocalGroup group(std::move(segment), r, timeout);
        body(group, say);
      }));
    }
    ::close(fds[0]);
    ::close(fds[1]);
  }
  Child& operator[](int r) { return *members_[r]; }
  int size() const { return static_cast<int>(members_.size()); }

  // Each member's last line (skipping member 0's handle).
  std::vector<std::string> finish(Duration timeout = 120s) {
    std::vector<std::string> lines;
    for (auto& m : members_) {
      std::string line = m->read_line(timeout);
      if (line.rfind("handle ", 0) == 0) line = m->read_line(timeout);
      lines.push_back(line);
    }
    return lines;
  }

 private:
  std::vector<std::unique_ptr<Child>> members_;
};

// ---- closed forms ----------------------------------------------------------------------------

const std::vector<DType> kDTypes = {DType::kFloat32, DType::kFloat64, DType::kInt32,
                                    DType::kInt64,   DType::kUInt8,   DType::kInt8,
                                    DType::kFloat16, DType::kBFloat16};

bool is_signed_int(DType t) {
  return t == DType::kInt32 || t == DType::kInt64 || t == DType::kInt8;
}

// Member r's value at index i: small integers (and halves), so that every partial sum of up to 4
// members is exact in every dtype, bfloat16 included; uint8's sums wrap, which the forms follow.
double value(DType t, int r, size_t i) {
  const double base = static_cast<double>((i + 7 * static_cast<size_t>(r)) % 23);
  if (is_signed_int(t)) return base - 11;
  if (t == DType::kUInt8) return base * 11;
  return base + 0.5 * r;
}

void encode(DType t, double d, unsigned char* out) {
  const int64_t n = static_cast<int64_t>(d);
  switch (t) {
    case DType::kFloat32: {
      float v = static_cast<float>(d);
      std::memcpy(out, &v, 4);
      return;
    }
    case DType::kFloat64:
      std::memcpy(out, &d, 8);
      return;
    case DType::kInt32: {
      auto v = static_cast<int32_t>(static_cast<uint32_t>(n));
      std::memcpy(out, &v, 4);
      return;
    }
    case DType::kInt64:
      std::memcpy(out, &n, 8);
      return;
    case DType::kUInt8:
    case DType::kInt8:
      *out = static_cast<unsigned char>(static_cast<uint64_t>(n));
      return;
    case DType::kFloat16: {
      uint16_t v = float_to_half(static_cast<float>(d));
      std::memcpy(out, &v, 2);
      return;
    }
    case DType::kBFloat16: {
      uint16_t v = float_to_bfloat16(static_cast<float>(d));
      std::memcpy(out, &v, 2);
      return;
    }
  }
}

using Buffer = std::vector<unsigned char>;

// n elements f(i) for i < n.
Buffer make(DType t, size_t n, const std::function<double(size_t)>& f) {
  const size_t e = dtype_size(t);
  Buffer b(n * e + 1);  // +1: never empty, so data() is a real pointer even for count 0
  for (size_t i = 0; i < n; ++i) encode(t, f(i), b.data() + i * e);
  return b;
}

double reduced(DType t, ReduceOp op, int k, size_t i) {
  double acc = value(t, 0, i);
  for (int r = 1; r < k; ++r) {
    const double v = value(t, r, i);
    acc = op == ReduceOp::kSum || op == ReduceOp::kAvg ? acc + v
          : op == ReduceOp::kMax                       ? std::max(acc, v)
                                                       : std::min(acc, v);
  }
  if (op != ReduceOp::kAvg) return acc;
  // The (exact) sum times the reciprocal of k, in double for float64 and in float otherwise.
  if (t == DType::kFloat64) return acc * (1.0 / k);
  return static_cast<double>(static_cast<float>(acc) * (1.0f / static_cast<float>(k)));
}

bool is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

uint64_t fnv(const unsigned char* p, size_t n, uint64_t h = 1469598103934665603ULL) {
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

// ---- the grid --------------------------------------------------------------------------------

// Every collective on every dtype and count, checked against the closed forms. Says "done <hash>"
// with a hash of every result that must be the same on every member, or "error: <first wrong>".
void grid(LocalGroup& g, const Say& say, const std::vector<size_t>& counts) {
  const int k = g.size(), r = g.rank();
  uint64_t hash = 1469598103934665603ULL;
  // all_reduce again in a shared buffer, at an offset (Note [All-reduce in shared buffers]).
  const size_t largest = *std::max_element(counts.begin(), counts.end());
  const std::shared_ptr<unsigned char> shared = k > 1 ? g.allocate(largest * 8 + 64) : nullptr;
  if (k > 1 && shared == nullptr) throw std::runtime_error("allocate gave no shared buffer");
  auto check = [&](const char* what, DType t, size_t n, const Buffer& got, const Buffer& want) {
    const size_t e = dtype_size(t);
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(got.data() + i * e, want.data() + i * e, e) != 0) {
        throw std::runtime_error(std::string(what) + " " + dtype_name(t) + " count " +
                                 std::to_string(n) + ": element " + std::to_string(i) +
                                 " differs from the closed form");
      }
    }
  };
  for (DType t : kDTypes) {
    const size_t e = dtype_size(t);
    for (size_t count : counts) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kAvg}) {
        if (op == ReduceOp::kAvg && !is_floating(t)) continue;
        Buffer data = make(t, count, [&](size_t i) { return value(t, r, i); });
        g.all_reduce(data.data(), count, t, op);
        check("all_reduce", t, count, data,
              make(t, count, [&](size_t i) { return reduced(t, op, k, i); }));
        hash = fnv(data.data(), count * e, hash);
        if (shared != nullptr && count > 0) {
          unsigned char* at = shared.get() + 3 * e;
          Buffer in = make(t, count, [&](size_t i) { return value(t, r, i); });
          std::memcpy(at, in.data(), count * e);
          if (!g.in_shared_buffer(at, count * e))
            throw std::runtime_error("not in the shared buffer");
          g.all_reduce(at, count, t, op);
          Buffer got(at, at + count * e);
          got.push_back(0);
          check("all_reduce in a shared buffer", t, count, got, data);  // bit for bit
        }
        // reduce_scatter with even parts and with uneven ones (the last part largest).
        for (bool even : {true, false}) {
          std::vector<size_t> parts(k);
          for (int m = 0; m < k; ++m)
            parts[m] =
                even ? count / k + (static_cast<size_t>(m) < count % k) : count * (m + 1) / k;
          size_t offset = 0;
          for (int m = 0; m < r; ++m) offset += parts[m];
          size_t total = 0;
          for (size_t p : parts) total += p;
          Buffer in = make(t, total, [&](size_t i) { return value(t, r, i); });
          Buffer out(parts[r] * e + 1);
          g.reduce_scatter(in.data(), out.data(), parts, t, op);
          check("reduce_scatter", t, parts[r], out,
                make(t, parts[r], [&](size_t i) { return reduced(t, op, k, offset + i); }));
        }
      }
      const int root = static_cast<int>(count % k);
      Buffer b = make(t, count, [&](size_t i) { return value(t, r, i); });
      g.broadcast(b.data(), count, t, root);
      check("broadcast", t, count, b, make(t, count, [&](size_t i) { return value(t, root, i); }));
      hash = fnv(b.data(), count * e, hash);
      for (bool equal : {true, false}) {
        std::vector<size_t> parts(k);
        for (int m = 0; m < k; ++m) parts[m] = equal ? count : count + 3 * m;
        size_t total = 0;
        for (size_t p : parts) total += p;
        Buffer in = make(t, parts[r], [&](size_t i) { return value(t, r, i); });
        Buffer out(total * e + 1);
        g.all_gather(in.data(), out.data(), parts, t);
        size_t at = 0;
        for (int m = 0; m < k; ++m) {
          Buffer want = make(t, parts[m], [&](size_t i) { return value(t, m, i); });
          Buffer got(out.begin() + at * e, out.begin() + (at + parts[m]) * e);
          got.push_back(0);
          check("all_gather", t, parts[m], got, want);
          at += parts[m];
        }
        hash = fnv(out.data(), total * e, hash);
      }
      // all_to_all: member j sends member m (count + 3j + 5m) % (count + 1) elements.
      auto part = [&](int j, int m) { return (count + 3 * j + 5 * m) % (count + 1); };
      std::vector<size_t> send(k), recv(k);
      size_t send_total = 0, recv_total = 0;
      for (int m = 0; m < k; ++m) {
        send[m] = part(r, m);
        recv[m] = part(m, r);
        send_total += send[m];
        recv_total += recv[m];
      }
      Buffer in(send_total * e + 1), out(recv_total * e + 1);
      size_t at = 0;
      for (int m = 0; m < k; ++m) {
        Buffer chunk = make(t, send[m], [&](size_t i) { return value(t, r, 131 * m + i); });
        std::memcpy(in.data() + at * e, chunk.data(), send[m] * e);
        at += send[m];
      }
      g.all_to_all(in.data(), send, out.data(), recv, t);
      at = 0;
      for (int j = 0; j < k; ++j) {
        Buffer got(out.begin() + at * e, out.begin() + (at + recv[j]) * e);
        got.push_back(0);
        check("all_to_all", t, recv[j], got,
              make(t, recv[j], [&](size_t i) { return value(t, j, 131 * r + i); }));
        at += recv[j];
      }
      g.barrier();
      if (k > 1) {  // a ring: even members send first, odd ones receive first
        const int next = (r + 1) % k, prev = (r + k - 1) % k;
        Buffer mine = make(t, count, [&](size_t i) { return value(t, r, i); });
        Buffer got(count * e + 1);
        const uint32_t tag = static_cast<uint32_t>(count % 1000);
        if (r % 2 == 0) g.send(mine.data(), count * e, next, tag);
        g.recv(got.data(), count * e, prev, tag);
        if (r % 2 == 1) g.send(mine.data(), count * e, next, tag);
        check("send/recv", t, count, got,
              make(t, count, [&](size_t i) { return value(t, prev, i); }));
      }
    }
  }
  say("done " + std::to_string(hash));
}

void expect_done_and_equal(const std::vector<std::string>& lines) {
  for (size_t r = 0; r < lines.size(); ++r) {
    EXPECT_EQ(lines[r].rfind("done ", 0), 0u) << "member " << r << ": " << lines[r];
    EXPECT_EQ(lines[r], lines[0]) << "member " << r << "'s results differ from member 0's";
  }
}

class Grid : public ::testing::TestWithParam<int> {};

// Slots of 4 KiB: 65537 elements and more go in many pieces through both buffers; the last count
// is larger than the whole segment's collective data for every dtype.
TEST_P(Grid, EveryCollectiveDTypeAndCountMatchesTheClosedForm) {
  const int k = GetParam();
  SegmentSizes sizes;
  sizes.slot_bytes = 4096;
  sizes.channel_bytes = 4096;
  const size_t larger = 2 * k * sizes.slot_bytes + 4099;  // elements, > the segment in bytes
  Job job(
      k,
      [&](LocalGroup& g, const Say& say) {
        grid(g, say, {0, 1, 7, 1001, 65537, larger});
      },
      sizes);
  expect_done_and_equal(job.finish());
}
INSTANTIATE_TEST_SUITE_P(WorldSize, Grid, ::testing::Values(1, 2, 3, 4));

// The default segment (1 MiB slots): a float32 sum larger than all of it, and again with a count
// that does not divide into the members.
TEST(LocalGroup, AllReduceLargerThanTheDefaultSegment) {
  for (int k : {2, 3}) {
    const size_t count = 2 * k * (size_t{1} << 20) / 4 * 3 + 12345;
    Job job(k, [&](LocalGroup& g, const Say& say) {
      Buffer data = make(DType::kFloat32, count,
                         [&](size_t i) { return value(DType::kFloat32, g.rank(), i); });
      g.all_reduce(data.data(), count, DType::kFloat32, ReduceOp::kSum);
      Buffer want = make(DType::kFloat32, count,
                         [&](size_t i) { return reduced(DType::kFloat32, ReduceOp::kSum, k, i); });
      if (std::memcmp(data.data(), want.data(), count * 4) != 0)
        throw std::runtime_error("wrong sum");
      say("done " + std::to_string(fnv(data.data(), count * 4)));
    });
    expect_done_and_equal(job.finish());
  }
}

// Note [Taking chunks]: in a shared buffer, the members awake take the chunks of an all-reduce.
// In each round another member arrives 20 ms after the others, which sleep by then (Note
// [Spinning]), and it finds every chunk left to it; in the last round all arrive together. Every
// round's result is the closed form, whoever reduced what, for a buffer of a few chunks and for
// one cut into the most chunks a call has.
TEST(LocalGroup, InPlaceAllReducesAreRightWhoeverTakesTheChunks) {
  for (int k : {2, 3}) {
    Job job(k, [&](LocalGroup& g, const Say& say) {
      uint64_t hash = 1469598103934665603ULL;
      for (size_t count : {size_t{70001}, size_t{5000003}}) {
        const std::shared_ptr<unsigned char> shared = g.allocate(count * 4 + 64);
        if (shared == nullptr) throw std::runtime_error("allocate gave no shared buffer");
        unsigned char* at = shared.get() + 12;
        for (int late = 0; late <= k; ++late) {
          Buffer in = make(DType::kFloat32, count,
                           [&](size_t i) { return value(DType::kFloat32, g.rank(), i + late); });
          std::memcpy(at, in.data(), count * 4);
          if (g.rank() == late) std::this_thread::sleep_for(20ms);
          g.all_reduce(at, count, DType::kFloat32, ReduceOp::kSum);
          Buffer want = make(DType::kFloat32, count, [&](size_t i) {
            return reduced(DType::kFloat32, ReduceOp::kSum, k, i + late);
          });
          if (std::memcmp(at, want.data(), count * 4) != 0) {
            throw std::runtime_error("count " + std::to_string(count) + ", member " +
                                     std::to_string(late) + " late: not the closed form");
          }
          hash = fnv(at, count * 4, hash);
        }
      }
      say("done " + std::to_string(hash));
    });
    expect_done_and_equal(job.finish());
  }
}

// ---- the executor's lanes ------------------------------------------------------------------------

// Note [Running on the waiter] (executor.cpp): a waiter runs the operation at the front of an idle
// lane on its own thread; one queued behind another, or on a lane that runs something, is left to
// the lane, whose operations still run one at a time in their order; and an error ends the Task
// wherever it ran.
TEST(Executor, AWaiterRunsWhatNoLaneRunsYetAndALaneKeepsItsOrder) {
  Executor executor(std::make_unique<LocalGroup>(Segment::create(1), 0, 30s));
  std::mutex mutex;
  std::vector<int> order;
  auto record = [&](int n) {
    std::lock_guard<std::mutex> lock(mutex);
    order.push_back(n);
  };
  // The lane runs 1, which holds it until released; 2 and 3 queue behind it.
  std::promise<void> started, release;
  auto released = release.get_future().share();
  auto first = executor.submit([&, released](LocalGroup&) {
    record(1);
    started.set_value();
    released.wait();
  });
  started.get_future().wait();
  std::thread::id ran_second, ran_third;
  auto second = executor.submit([&](LocalGroup&) { record(2); ran_second = std::this_thread::get_id(); });
  auto third = executor.submit([&](LocalGroup&) { record(3); ran_third = std::this_thread::get_id(); });
  EXPECT_FALSE(executor.run_here(third)) << "3 is queued behind 2";
  EXPECT_FALSE(executor.run_here(second)) << "the lane runs 1";
  release.set_value();
  ASSERT_TRUE(third->wait_for(10s));
  EXPECT_TRUE(first->done() && second->done());
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  EXPECT_NE(ran_second, std::this_thread::get_id());
  EXPECT_NE(ran_third, std::this_thread::get_id());

  // Submitted without waking the lane, as a blocking collective does, an operation runs on the
  // waiter, ended when run_here returns, errors included.
  std::thread::id ran;
  auto failing = executor.submit(
      [&](LocalGroup&) {
        ran = std::this_thread::get_id();
        throw CommError("failed on purpose");
      },
      /*wake=*/false);
  ASSERT_TRUE(executor.run_here(failing));
  EXPECT_TRUE(failing->done());
  EXPECT_EQ(ran, std::this_thread::get_id());
  ASSERT_TRUE(failing->error() != nullptr);
  try {
    std::rethrow_exception(failing->error());
  } catch (const CommError& e) {
    EXPECT_STREQ(e.what(), "failed on purpose");
  }
  // One queued without waking the lane is not stranded when its waiter cannot take it: a waiter
  // of a later operation wakes the lane, which runs both in order.
  auto unwoken = executor.submit([&](LocalGroup&) { record(5); }, /*wake=*/false);
  auto later = executor.submit([&](LocalGroup&) { record(6); }, /*wake=*/false);
  EXPECT_FALSE(executor.run_here(later)) << "6 is queued behind 5";
  ASSERT_TRUE(later->wait_for(10s));
  EXPECT_TRUE(unwoken->done());
  EXPECT_EQ(std::vector<int>(order.end() - 2, order.end()), (std::vector<int>{5, 6}));
  // One left to its caller holds back what is queued after it, woken or not, until the caller runs
  // it; one whose caller will not run it after all is handed to the lane.
  auto own = executor.submit([&](LocalGroup&) { record(8); }, /*wake=*/false);
  auto behind = executor.submit([&](LocalGroup&) { record(9); });
  EXPECT_FALSE(behind->wait_for(50ms)) << "9 ran before 8";
  ASSERT_TRUE(executor.run_here(own));
  ASSERT_TRUE(behind->wait_for(10s));
  auto handed = executor.submit([&](LocalGroup&) { record(10); ran = std::this_thread::get_id(); },
                                /*wake=*/false);
  executor.hand_over(handed);
  ASSERT_TRUE(handed->wait_for(10s));
  EXPECT_NE(ran, std::this_thread::get_id());
  EXPECT_EQ(std::vector<int>(order.end() - 3, order.end()), (std::vector<int>{8, 9, 10}));
  // A woken lane may take its operation before the waiter does; wherever it ran, it has ended.
  for (int attempt = 0; attempt < 20; ++attempt) {
    std::thread::id where;
    auto task = executor.submit([&](LocalGroup&) { where = std::this_thread::get_id(); });
    const bool here = executor.run_here(task);
    ASSERT_TRUE(task->wait_for(10s));
    EXPECT_EQ(where == std::this_thread::get_id(), here);
  }
  // The lane goes on with what is queued after.
  auto after = executor.submit([&](LocalGroup&) { record(11); });
  ASSERT_TRUE(after->wait_for(10s));
  EXPECT_EQ(order.back(), 11);
}

// ---- mismatched calls --------------------------------------------------------------------------

TEST(LocalGroup, MismatchedAllToAllCountsRaiseTheSameUsageErrorEverywhereAndTheGroupGoesOn) {
  Job job(3, [](LocalGroup& g, const Say& say) {
    std::vector<size_t> send(3, 2), recv(3, 2);
    if (g.rank() == 2) recv[0] = 3;  // member 0 sends 2, member 2 expects 3
    std::vector<int32_t> in(6, g.rank()), out(7, -1);
    try {
      g.all_to_all(in.data(), send, out.data(), recv, DType::kInt32);
      say("no error");
      return;
    } catch (const UsageError& e) {
      say(std::string("usage: ") + e.what());
    }
    int32_t x = g.rank() + 1;
    g.all_reduce(&x, 1, DType::kInt32, ReduceOp::kSum);
    say("done " + std::to_string(x));
  });
  for (int r = 0; r < 3; ++r) {
    std::string line = job[r].read_line(30s);
    if (r == 0) line = job[r].read_line(30s);  // after the handle
    EXPECT_EQ(
        line,
        "usage: shared-memory all_to_all: member 0 sends 2 elements to member 2, which expects 3");
    EXPECT_EQ(job[r].read_line(30s), "done 6");
  }
}

// Note [Checking a call]: members that pass a shared buffer and memory of their own, different
// places of a shared buffer, or different counts to one all_reduce, or different sizes to one
// allocate, all raise the same UsageError, and the group goes on.
TEST(LocalGroup, MismatchedAllReducesRaiseTheSameUsageErrorEverywhereAndTheGroupGoesOn) {
  Job job(3, [](LocalGroup& g, const Say& say) {
    const std::shared_ptr<unsigned char> shared = g.allocate(64);
    if (!g.in_shared_buffer(shared.get(), 64) || g.in_shared_buffer(shared.get() + 1, 64)) {
      say("wrong extent");
      return;
    }
    auto* floats = reinterpret_cast<float*>(shared.get());
    std::vector<float> own(16, 1.0f);
    auto attempt = [&](float* data, size_t count) {
      try {
        g.all_reduce(data, count, DType::kFloat32, ReduceOp::kSum);
        say("no error");
      } catch (const UsageError& e) {
        say(std::string("usage: ") + e.what());
      }
    };
    attempt(g.rank() == 1 ? own.data() : floats, 4);
    attempt(g.rank() == 2 ? floats + 4 : floats, 4);
    attempt(own.data(), g.rank() == 2 ? 5 : 4);
    try {
      g.allocate(g.rank() == 1 ? 128 : 64);
      say("no error");
    } catch (const UsageError& e) {
      say(std::string("usage: ") + e.what());
    }
    floats[0] = static_cast<float>(g.rank() + 1);
    g.all_reduce(floats, 1, DType::kFloat32, ReduceOp::kSum);
    say("done " + std::to_string(static_cast<int>(floats[0])));
  });
  const std::string rule =
      "; every member must pass the same count, dtype and op, in memory of its own or at the same "
      "place of the "
      "same shared buffer";
  for (int r = 0; r < 3; ++r) {
    std::string line = job[r].read_line(30s);
    if (r == 0) line = job[r].read_line(30s);  // after the handle
    EXPECT_EQ(line,
              "usage: shared-memory all_reduce: member 1 passed 4 float32 to sum in memory of its "
              "own, member 0 "
              "4 float32 to sum at byte 0 of shared buffer 0" +
                  rule);
    EXPECT_EQ(job[r].read_line(30s),
              "usage: shared-memory all_reduce: member 2 passed 4 float32 to sum at byte 16 of "
              "shared buffer 0, "
              "member 0 4 float32 to sum at byte 0 of shared buffer 0" +
                  rule);
    EXPECT_EQ(job[r].read_line(30s),
              "usage: shared-memory all_reduce: member 2 passed 5 float32 to sum in memory of its "
              "own, member 0 "
              "4 float32 to sum in memory of its own" +
                  rule);
    EXPECT_EQ(job[r].read_line(30s),
              "usage: shared-memory allocate: member 1 asked for 128 bytes, member 0 for 64");
    EXPECT_EQ(job[r].read_line(30s), "done 6");
  }
}

TEST(LocalGroup, ARecvOfAnotherTagOrSizeIsRefused) {
  Job job(2, [](LocalGroup& g, const Say& say) {
    int64_t x = 42;
    if (g.rank() == 0) {
      g.send(&x, sizeof(x), 1, 7);
      say("done");
      return;
    }
    try {
      g.recv(&x, sizeof(x), 0, 8);
      say("no error");
    } catch (const UsageError& e) {
      say(std::string("done ") + e.what());
    }
  });
  const auto lines = job.finish();
  EXPECT_EQ(lines[0], "done");
  EXPECT_EQ(lines[1],
            "done shared-memory recv: member 1 expected tag 8 of 8 bytes from member 0, "
            "the next message has tag 7 of 8 bytes");
}

// A message larger than the ring waits for the receiver; one that fits does not.
TEST(LocalGroup, SendsUpToTheRingDoNotWaitForTheReceiver) {
  SegmentSizes sizes;
  sizes.channel_bytes = 4096;
  Job job(
      2,
      [](LocalGroup& g, const Say& say) {
        std::vector<unsigned char> small(4096 - 16, 5), large(100000);
        for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<unsigned char>(i * 31);
        if (g.rank() == 0) {
          g.send(small.data(), small.size(), 1, 1,
                 2s);  // the receiver sleeps: fits, returns at once
          say("small sent");
          g.send(large.data(), large.size(), 1, 2, 10s);
          say("done");
        } else {
          ::usleep(300 * 1000);
          std::vector<unsigned char> got(small.size());
          g.recv(got.data(), got.size(), 0, 1);
          std::vector<unsigned char> got_large(large.size());
          g.recv(got_large.data(), got_large.size(), 0, 2);
          say(got == small && got_large == large ? "done" : "wrong bytes");
        }
      },
      sizes);
  EXPECT_EQ(job[0].read_line(30s).rfind("handle", 0), 0u);
  const auto start = Clock::now();
  EXPECT_EQ(job[0].read_line(30s), "small sent");
  EXPECT_LT(ms_since(start), 250);
  EXPECT_EQ(job[0].read_line(30s), "done");
  EXPECT_EQ(job[1].read_line(30s), "done");
}

// ---- faults ------------------------------------------------------------------------------------

// Members all-reduce `count` floats in a loop, in memory of their own or in a shared buffer; each
// says "running" after its first, and on an error "error <ms since that all_reduce began>
// <message>".
Body all_reduce_loop(size_t count, Duration timeout, bool shared = false) {
  return [=](LocalGroup& g, const Say& say) {
    std::vector<float> own(shared ? 0 : count);
    const std::shared_ptr<unsigned char> buffer = shared ? g.allocate(count * 4) : nullptr;
    if (shared && buffer == nullptr) throw std::runtime_error("allocate gave no shared buffer");
    float* data = shared ? reinterpret_cast<float*>(buffer.get()) : own.data();
    std::fill(data, data + count, 1.0f);
    for (int i = 0;; ++i) {
      const auto start = Clock::now();
      try {
        g.all_reduce(data, count, DType::kFloat32, ReduceOp::kSum, timeout);
      } catch (const CommError& e) {
        say("error " + std::to_string(static_cast<long>(ms_since(start))) + " " + e.what());
        return;
      }
      std::fill(data, data + count, 1.0f);
      if (i == 0) say("running");
    }
  };
}

void await_running(Job& job) {
  ASSERT_EQ(job[0].read_line(30s).rfind("handle", 0), 0u);
  for (int r = 0; r < job.size(); ++r)
    ASSERT_EQ(job[r].read_line(30s), "running") << "member " << r;
}

// (count, in a shared buffer)
using FaultCase = std::tuple<size_t, bool>;

std::string fault_case_name(const ::testing::TestParamInfo<FaultCase>& info) {
  return std::to_string(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_shared" : "_own");
}

// A small all-reduce (one piece), a medium one (a few pieces) and a large one (64 MiB, 32 pieces
// of the default segment), each in memory of its own and in a shared buffer.
const auto kFaultCases = ::testing::Combine(
    ::testing::Values(size_t{1001}, size_t{1} << 18, size_t{1} << 24), ::testing::Bool());

class Kill : public ::testing::TestWithParam<FaultCase> {};

TEST_P(Kill, SurvivorsNameTheKilledMemberWithinTwoSeconds) {
  const auto [count, shared] = GetParam();
  Job job(3, all_reduce_loop(count, 60s, shared));
  await_running(job);
  ::usleep(50 * 1000);
  const pid_t victim = job[1].pid();
  ::kill(victim, SIGKILL);
  const auto killed = Clock::now();
  for (int r : {0, 2}) {
    const std::string line = job[r].read_line(5s);
    const double ms = ms_since(killed);
    std::printf("[ measured ] member %d raised %.0f ms after the kill: %s\n", r, ms, line.c_str());
    EXPECT_EQ(line.rfind("error ", 0), 0u) << line;
    EXPECT_NE(line.find("member 1 (pid " + std::to_string(victim) + ")"), std::string::npos)
        << line;
    EXPECT_LT(ms, 2000);
    EXPECT_EQ(line.find('\n'), std::string::npos);
  }
}
INSTANTIATE_TEST_SUITE_P(Size, Kill, kFaultCases, fault_case_name);

class Stop : public ::testing::TestWithParam<FaultCase> {};

TEST_P(Stop, SurvivorsTimeOutAtTheDeadlineNamingTheStoppedMember) {
  const auto [count, shared] = GetParam();
  Job job(3, all_reduce_loop(count, 600ms, shared));
  await_running(job);
  const pid_t victim = job[1].pid();
  ::kill(victim, SIGSTOP);
  // The member whose operation began first times out at its deadline; the other may quote it
  // (Note [Waiting with a deadline]), a little before its own deadline when it began later.
  int own_timeouts = 0;
  for (int r : {0, 2}) {
    const std::string line = job[r].read_line(5s);
    std::printf("[ measured ] member %d: %s\n", r, line.c_str());
    long ms = -1;
    ASSERT_EQ(std::sscanf(line.c_str(), "error %ld", &ms), 1) << line;
    EXPECT_LT(ms, 1600) << line;
    EXPECT_NE(line.find("timed out after 600 ms waiting for member 1 (pid " +
                        std::to_string(victim) + ")"),
              std::string::npos)
        << line;
    if (line.find("failed first") == std::string::npos) {
      ++own_timeouts;
      EXPECT_GE(ms, 600) << line;
    }
  }
  EXPECT_GE(own_timeouts, 1);
  ::kill(victim, SIGCONT);
}
INSTANTIATE_TEST_SUITE_P(Size, Stop, kFaultCases, fault_case_name);

// Links in /proc/*/fd and lines of /proc/*/maps that name `name`, as "pid: what".
std::vector<std::string> holders_of(const std::string& name) {
  std::vector<std::string> found;
  DIR* proc = ::opendir("/proc");
  while (dirent* d = proc != nullptr ? ::readdir(proc) : nullptr) {
    if (d->d_name[0] < '0' || d->d_name[0] > '9') continue;
    const std::string dir = std::string("/proc/") + d->d_name;
    if (DIR* fds = ::opendir((dir + "/fd").c_str())) {
      while (dirent* f = ::readdir(fds)) {
        char target[512];
        const ssize_t n =
            ::readlink((dir + "/fd/" + f->d_name).c_str(), target, sizeof(target) - 1);
        if (n > 0 && std::string(target, n).find(name) != std::string::npos) {
          found.push_back(std::string(d->d_name) + ": fd " + std::string(target, n));
        }
      }
      ::closedir(fds);
    }
    std::ifstream maps(dir + "/maps");
    for (std::string line; std::getline(maps, line);) {
      if (line.find(name) != std::string::npos)
        found.push_back(std::string(d->d_name) + ": " + line);
    }
  }
  if (proc != nullptr) ::closedir(proc);
  return found;
}

// The segment and the shared buffers alike (their memfds are named after the segment's tag).
TEST(Cleanup, NothingOfAGroupIsLeftAfterEveryMemberIsKilled) {
  auto job = std::make_unique<Job>(3, all_reduce_loop(size_t{1} << 20, 60s, true));
  const std::string handle = (*job)[0].read_line(30s);
  ASSERT_EQ(handle.rfind("handle shm1 ", 0), 0u) << handle;
  char tag[33] = {};
  ASSERT_EQ(std::sscanf(handle.c_str(), "handle shm1 %*d %*d %*s %32s", tag), 1) << handle;
  const std::string name = std::string("memfd:") + kMemfdPrefix + std::string(tag, 16);
  for (int r = 0; r < 3; ++r) ASSERT_EQ((*job)[r].read_line(30s), "running");
  // While the job runs, each member holds the segment (member 0 its fd, all a mapping) and maps
  // every member's shared buffer.
  const auto held = holders_of(name);
  for (int r = 0; r < 3; ++r) {
    const std::string pid = std::to_string((*job)[r].pid()) + ":";
    EXPECT_TRUE(
        std::any_of(held.begin(), held.end(), [&](auto& h) { return h.rfind(pid, 0) == 0; }))
        << "member " << r << " does not hold " << name;
    EXPECT_EQ(std::count_if(held.begin(), held.end(),
                            [&](auto& h) {
                              return h.rfind(pid, 0) == 0 &&
                                     h.find(name + "-0") != std::string::npos;
                            }),
              3)
        << "member " << r
        << " does not map the 3 shared buffers: " << ::testing::PrintToString(held);
  }
  for (int r = 0; r < 3; ++r) ::kill((*job)[r].pid(), SIGKILL);
  job.reset();  // reaps them
  EXPECT_EQ(holders_of(name), std::vector<std::string>{});
  // Nothing was ever named in /dev/shm.
  if (DIR* shm = ::opendir("/dev/shm")) {
    while (dirent* d = ::readdir(shm)) {
      EXPECT_EQ(std::string(d->d_name).find(std::string(tag, 16)), std::string::npos) << d->d_name;
      EXPECT_EQ(std::string(d->d_name).find(kMemfdPrefix), std::string::npos) << d->d_name;
    }
    ::closedir(shm);
  }
}

// ---- who may share a segment
// ---------------------------------------------------------------------

// A handle with job A's pid and fd but job B's tag (what a mix-up of two jobs' keys would give) is
// refused, and so are a wrong size, a gone creator and another host's key.
TEST(Segments, AnotherGroupsSegmentIsRefused) {
  Job a(2, [](LocalGroup& g, const Say& say) {
    g.barrier();
    say("joined");
    ::pause();
  });
  const std::string handle_a = a[0].read_line(30s).substr(7);
  ASSERT_EQ(a[0].read_line(30s), "joined");
  Segment b = Segment::create(2);
  char version[8], key[300], tag_a[40], tag_b[40];
  long long pid = 0, fd = 0, bytes = 0;
  ASSERT_EQ(std::sscanf(handle_a.c_str(), "%7s %lld %lld %299s %39s %lld", version, &pid, &fd, key,
                        tag_a, &bytes),
            6);
  ASSERT_EQ(std::sscanf(b.handle().c_str(), "%*s %*d %*d %*s %39s", tag_b), 1);
  ASSERT_STRNE(tag_a, tag_b);
  auto handle = [&](long long p, long long f, const std::string& k, const char* t, long long n) {
    return "shm1 " + std::to_string(p) + " " + std::to_string(f) + " " + k + " " + t + " " +
           std::to_string(n);
  };
  auto refusal = [](const std::string& h, int size) -> std::string {
    try {
      Segment::open(h, size);
    } catch (const CommError& e) {
      return e.what();
    }
    return "opened";
  };
  EXPECT_NE(refusal(handle(pid, fd, key, tag_b, bytes), 2)
                .find("not the group's (a segment of another group or job)"),
            std::string::npos);
  EXPECT_NE(
      refusal(handle(pid, fd, key, tag_a, bytes), 3).find("it is for 2 members, the group has 3"),
      std::string::npos);
  EXPECT_NE(refusal(handle(pid, fd, key, tag_a, bytes + 4096), 2).find("is not a segment of"),
            std::string::npos);
  EXPECT_NE(refusal(handle(pid, fd, "other-boot/net:1/pid:1/uid:0", tag_a, bytes), 2)
                .find("locality key"),
            std::string::npos);
  EXPECT_NE(refusal("shm1 nonsense", 2).find("expected \"shm1 <pid>"), std::string::npos);
  EXPECT_EQ(refusal(handle_a, 2), "opened");  // the right handle does open (same user)
  // A member index that has joined already is refused, before anything is written.
  try {
    LocalGroup twice(Segment::open(handle_a, 2), 1, 1s);
    ADD_FAILURE() << "joined as member 1 a second time";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("member 1 has joined the segment already"),
              std::string::npos)
        << e.what();
  }
  ::kill(a[0].pid(), SIGKILL);
  ::waitpid(a[0].pid(), nullptr, 0);
  EXPECT_NE(refusal(handle_a, 2).find("cannot open /proc/"), std::string::npos);
}

// Note [Ring size]: 4 MiB rings up to 8 members, then halving to keep the k x k rings within
// 256 MiB, never under 256 KiB; a size asked for is kept.
TEST(Segments, RingsShrinkPastEightMembersUnlessASizeIsAsked) {
  const std::vector<std::pair<int, size_t>> expected = {
      {1, 4u << 20},  {2, 4u << 20},    {8, 4u << 20},    {9, 2u << 20},
      {16, 1u << 20}, {17, 512u << 10}, {32, 256u << 10}, {64, 256u << 10}};
  for (const auto& [members, bytes] : expected) {
    EXPECT_EQ(Segment::create(members).channel_bytes(), bytes) << members << " members";
  }
  SegmentSizes asked;
  asked.channel_bytes = 8192;
  EXPECT_EQ(Segment::create(32, asked).channel_bytes(), 8192u);
}

// A member that never joins: the others' join fails at the deadline naming it.
TEST(Segments, JoinTimesOutNamingTheMissingMember) {
  Child creator([](const Say& say) {
    Segment s = Segment::create(3);
    say(s.handle());
    const auto start = Clock::now();
    try {
      LocalGroup g(std::move(s), 0, 400ms);
    } catch (const CommError& e) {
      say("error " + std::to_string(static_cast<long>(ms_since(start))) + " " + e.what());
    }
  });
  const std::string handle = creator.read_line(10s);
  Child joiner([&](const Say& say) { LocalGroup g(Segment::open(handle, 3), 2, 400ms); });
  const std::string line = creator.read_line(5s);
  long ms = -1;
  ASSERT_EQ(std::sscanf(line.c_str(), "error %ld", &ms), 1) << line;
  EXPECT_GE(ms, 400);
  // Member 0 began waiting first, but member 2's deadline may be seen first (both sleep in
  // 10 ms slices); then member 0 quotes it. Either way member 1 is named.
  EXPECT_NE(line.find("shared-memory join: timed out after 400 ms waiting for member 1 (not joined "
                      "yet) (this member: "),
            std::string::npos)
      << line;
}

TEST(Locality, KeyIsSharedByAForkAndDiffersInAnotherNetworkNamespace) {
  const std::string here = locality_key();
  EXPECT_EQ(here.rfind(boot_id() + "/net:", 0), 0u) << here;
  Child same([](const Say& say) { say(locality_key()); });
  EXPECT_EQ(same.read_line(10s), here);
  Child other([](const Say& say) {
    if (::unshare(CLONE_NEWNET) != 0) {
      say("skip: unshare(CLONE_NEWNET): " + std::string(std::strerror(errno)));
      return;
    }
    say(locality_key());
  });
  const std::string there = other.read_line(10s);
  if (there.rfind("skip", 0) == 0) GTEST_SKIP() << there;
  EXPECT_NE(there, here);
  EXPECT_EQ(there.substr(0, 36), here.substr(0, 36));  // the same kernel
}

// ---- conversions
// ---------------------------------------------------------------------------------

TEST(Reduce, HalfAndBfloat16RoundTripAndRoundToNearestEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f))));
      continue;
    }
    ASSERT_EQ(float_to_half(f), h) << h;
    ASSERT_EQ(float_to_bfloat16(bfloat16_to_float(static_cast<uint16_t>(h))), h) << h;
  }
  EXPECT_EQ(half_to_float(float_to_half(2049.0f)), 2048.0f);  // a tie: to even
  EXPECT_EQ(half_to_float(float_to_half(2051.0f)), 2052.0f);
  EXPECT_EQ(half_to_float(float_to_half(65520.0f)), INFINITY);
  EXPECT_EQ(half_to_float(float_to_half(5.9604645e-08f)), 5.9604645e-08f);  // smallest subnormal
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(257.0f)), 256.0f);
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(259.0f)), 260.0f);
}

}  // namespace
}  // namespace shoal::comm::shm
