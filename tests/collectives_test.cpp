// Collectives over a grid of world sizes x element counts (0, odd, non-divisible) x dtypes,
// against closed forms (gloo's test style: fill with the rank, expect n(n+1)/2).
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <thread>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "harness.h"
#include "netns.h"
#include "shoal/shoal.h"

namespace {

using shoal::comm::AllGatherOptions;
using shoal::comm::AllReduceOptions;
using shoal::comm::AllToAllOptions;
using shoal::comm::ReduceOp;
using shoal::comm::ReduceScatterOptions;
using shoal::testing::run_workers;
using shoal::testing::TwoHosts;

const std::vector<int64_t> kCounts = {0, 1, 7, 1001, 65537};
const std::vector<torch::Dtype> kDtypes = {torch::kFloat32, torch::kFloat64, torch::kInt64};

// 1, 2, 3, ... as `dtype`.
torch::Tensor ramp(int64_t count, torch::Dtype dtype) {
  return torch::arange(1, count + 1, torch::TensorOptions().dtype(torch::kInt64)).to(dtype);
}

// A grid point: `workers` workers, on one host or cut among two (network namespaces joined by a
// veth pair, tests/netns.h): there a group's all-reduce is hierarchical (docs/comm.md, "Across
// hosts"), with two members on each host, or two and one (a host of one member).
struct Layout {
  int workers;
  int hosts;
};

class Collectives : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    if (GetParam().hosts == 1 || shoal::testing::is_worker()) return;
    if (auto problem = hosts_.create()) GTEST_SKIP() << "cannot build the two hosts: " << *problem;
  }
  // Runs `body` in every worker of the layout, after shoal::init().
  void run(const std::function<void()>& body) {
    shoal::testing::WorkersOptions options;
    if (GetParam().hosts > 1 && !shoal::testing::is_worker()) {
      options.hosts = {hosts_.name(0), hosts_.name(1)};
      options.master_address = TwoHosts::kAddressA;
    }
    run_workers(GetParam().workers, body, options);
  }
  TwoHosts hosts_;
};

// The path each layout takes, by SHOAL_COMM (the grid runs again with "tcp" as Tcp.*).
std::string expected_path(int workers, int hosts) {
  const char* comm = std::getenv("SHOAL_COMM");
  if (workers == 1) return "none";
  if (comm != nullptr && std::string(comm) == "tcp") return "gloo";
  return hosts == 1 ? "shared memory" : "hierarchical";
}

// The harness passes the test process's settings on to its workers, but not its job variables
// (docs/testing.md). The Tcp.* tests rely on it, and each worker reads the path it expects from
// its own environment, so nothing else would notice if SHOAL_COMM stopped reaching them.
TEST(WorkerEnvironment, SettingsPassOnAndJobVariablesDoNot) {
  const bool parent = !shoal::testing::is_worker();
  const char* before = std::getenv("SHOAL_COMM");
  const std::string saved = before != nullptr ? before : "";
  if (parent) {
    setenv("SHOAL_COMM", "tcp", 1);
    setenv("SHOAL_WORLD_SIZE", "7", 1);  // as if the test process were worker of a job of 7
  }
  run_workers(2, [] {
    EXPECT_STREQ(std::getenv("SHOAL_COMM"), "tcp");
    EXPECT_EQ(shoal::world().path(), "gloo");
    EXPECT_EQ(shoal::world_size(), 2);
  });
  if (parent) {
    unsetenv("SHOAL_WORLD_SIZE");
    if (before != nullptr) {
      setenv("SHOAL_COMM", saved.c_str(), 1);
    } else {
      unsetenv("SHOAL_COMM");
    }
  }
}

TEST_P(Collectives, AllReduceEveryOp) {
  const std::string path = expected_path(GetParam().workers, GetParam().hosts);
  run([path] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    ASSERT_EQ(world.path(), path);
    for (auto dtype : kDtypes) {
      for (auto count : kCounts) {
        auto base = ramp(count, dtype);
        std::vector<std::pair<ReduceOp, torch::Tensor>> cases = {
            {ReduceOp::kSum, base * (n * (n + 1) / 2)},
            {ReduceOp::kMax, base * n},
            {ReduceOp::kMin, base},
        };
        if (dtype != torch::kInt64) cases.push_back({ReduceOp::kAvg, base * ((n + 1) / 2.0)});
        for (auto& [op, expected] : cases) {
          auto t = base * (r + 1);
          world.all_reduce(t, {op});
          ASSERT_TRUE(torch::equal(t, expected.to(dtype)))
              << "op " << static_cast<int>(op) << " dtype " << dtype << " count " << count;
        }
      }
    }
    // A non-contiguous tensor is reduced in place all the same.
    auto m = torch::arange(12, torch::kFloat32).view({3, 4}).t();
    auto expected = m * n;
    world.all_reduce(m);
    EXPECT_TRUE(torch::equal(m, expected));
    // Average of integers is refused, before anything is sent.
    auto ints = torch::ones({3}, torch::kInt64);
    try {
      world.all_reduce(ints, {ReduceOp::kAvg});
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(), "all_reduce: ReduceOp::kAvg needs a floating-point tensor, got Long");
    }
  });
}

// Tensors of Group::empty_shared, all-reduced at an offset: in place on the shared-memory path,
// like any other tensor elsewhere; the same results either way.
TEST_P(Collectives, AllReduceInSharedBuffers) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    for (auto dtype : kDtypes) {
      auto arena = world.empty_shared(kCounts.back() + 3, dtype);
      ASSERT_EQ(arena.sizes(), (std::vector<int64_t>{kCounts.back() + 3}));
      ASSERT_EQ(arena.scalar_type(), dtype);
      for (auto count : kCounts) {
        auto base = ramp(count, dtype);
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          if (op == ReduceOp::kAvg && dtype == torch::kInt64) continue;
          auto t = arena.narrow(0, 3, count);
          t.copy_(base * (r + 1));
          world.all_reduce(t, {op});
          auto expected = op == ReduceOp::kSum ? base * (n * (n + 1) / 2) : base * ((n + 1) / 2.0);
          ASSERT_TRUE(torch::equal(t, expected.to(dtype)))
              << "op " << static_cast<int>(op) << " dtype " << dtype << " count " << count;
        }
      }
    }
    EXPECT_EQ(world.empty_shared(0, torch::kFloat32).numel(), 0);
    try {
      world.empty_shared(-1, torch::kFloat32);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(), "empty_shared: numel -1, expected 0 or more");
    }
  });
}

TEST_P(Collectives, BroadcastFromEveryRoot) {
  run([] {
    auto& world = shoal::world();
    for (auto dtype : kDtypes) {
      for (auto count : kCounts) {
        for (int root = 0; root < world.size(); ++root) {
          auto t = ramp(count, dtype) + 1000 * world.rank();
          world.broadcast(t, {root});
          ASSERT_TRUE(torch::equal(t, ramp(count, dtype) + 1000 * root)) << "root " << root;
        }
      }
    }
  });
}

TEST_P(Collectives, AllGatherEvenAndUneven) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    for (auto dtype : kDtypes) {
      for (auto count : kCounts) {
        // Even: each worker contributes count rows of [rank, row].
        auto mine = torch::stack({torch::full({count}, r, torch::kInt64), torch::arange(count)}, 1)
                        .to(dtype);
        auto all = world.all_gather(mine);
        std::vector<torch::Tensor> parts;
        for (int j = 0; j < n; ++j)
          parts.push_back(
              torch::stack({torch::full({count}, j, torch::kInt64), torch::arange(count)}, 1)
                  .to(dtype));
        ASSERT_TRUE(torch::equal(all, torch::cat(parts, 0))) << "count " << count;

        // Uneven: the shares of split_sizes, as a split tensor holds them.
        auto sizes = shoal::comm::split_sizes(count, n);
        auto whole = ramp(count, dtype);
        int64_t offset = 0;
        for (int j = 0; j < r; ++j) offset += sizes[j];
        AllGatherOptions options;
        options.sizes = sizes;
        auto gathered = world.all_gather(whole.narrow(0, offset, sizes[r]), options);
        ASSERT_TRUE(torch::equal(gathered, whole)) << "uneven count " << count;
      }
    }
  });
}

TEST_P(Collectives, ReduceScatterEvenAndUneven) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    for (auto dtype : kDtypes) {
      for (auto count : kCounts) {
        auto input = ramp(count * 2, dtype).view({count, 2}) * (r + 1);
        auto total = ramp(count * 2, dtype).view({count, 2}) * (n * (n + 1) / 2);
        auto sizes = shoal::comm::split_sizes(count, n);
        int64_t offset = 0;
        for (int j = 0; j < r; ++j) offset += sizes[j];
        auto part = world.reduce_scatter(input);
        ASSERT_TRUE(torch::equal(part, total.narrow(0, offset, sizes[r]))) << "count " << count;

        // Explicit uneven parts, all of the input to the last worker but one row each.
        ReduceScatterOptions options;
        options.op = ReduceOp::kMax;
        options.sizes.assign(n, 0);
        for (int j = 0; j + 1 < n && j < count; ++j) options.sizes[j] = 1;
        int64_t given = 0;
        for (auto s : options.sizes) given += s;
        options.sizes[n - 1] += count - given;
        offset = 0;
        for (int j = 0; j < r; ++j) offset += options.sizes[j];
        auto biggest = ramp(count * 2, dtype).view({count, 2}) * n;
        auto max_part = world.reduce_scatter(input, options);
        ASSERT_TRUE(torch::equal(max_part, biggest.narrow(0, offset, options.sizes[r])))
            << "count " << count;
      }
    }
  });
}

TEST_P(Collectives, AllToAllUneven) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    for (auto dtype : kDtypes) {
      // Worker r sends r + j + extra rows, each worth 100 r + j, to worker j.
      for (int64_t extra : {0, 3}) {
        AllToAllOptions options;
        std::vector<torch::Tensor> outgoing, incoming;
        for (int j = 0; j < n; ++j) {
          options.send_sizes.push_back(r + j + extra);
          options.recv_sizes.push_back(j + r + extra);
          outgoing.push_back(torch::full({r + j + extra, 3}, 100 * r + j, torch::kInt64));
          incoming.push_back(torch::full({j + r + extra, 3}, 100 * j + r, torch::kInt64));
        }
        auto received = world.all_to_all(torch::cat(outgoing).to(dtype), options);
        ASSERT_TRUE(torch::equal(received, torch::cat(incoming).to(dtype))) << "extra " << extra;
      }
      // Worker 0 sends and receives nothing; it still takes part, so the next call pairs up.
      AllToAllOptions none_to_first;
      std::vector<torch::Tensor> from_others;
      for (int j = 0; j < n; ++j) {
        const int64_t rows = r == 0 || j == 0 ? 0 : 1;
        none_to_first.send_sizes.push_back(rows);
        none_to_first.recv_sizes.push_back(rows);
        if (rows > 0) from_others.push_back(torch::full({1, 2}, j, torch::kInt64));
      }
      const int64_t sent = r == 0 ? 0 : n - 1;
      auto got =
          world.all_to_all(torch::full({sent, 2}, r, torch::kInt64).to(dtype), none_to_first);
      ASSERT_EQ(got.size(0), sent);
      if (sent > 0) {
        ASSERT_TRUE(torch::equal(got, torch::cat(from_others).to(dtype)));
      }
      // Default: even parts of equal inputs.
      auto input = torch::arange(4 * n, torch::kInt64).to(dtype) + 1000 * r;
      auto received = world.all_to_all(input);
      std::vector<torch::Tensor> incoming;
      for (int j = 0; j < n; ++j)
        incoming.push_back(torch::arange(4 * r, 4 * r + 4).to(dtype) + 1000 * j);
      ASSERT_TRUE(torch::equal(received, torch::cat(incoming)));
    }
  });
}

TEST_P(Collectives, SendRecvRingAndBarrier) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    if (n == 1) {
      auto t = torch::zeros({2});
      EXPECT_THROW(world.send(t, 0), shoal::UsageError);
      world.barrier();
      return;
    }
    for (auto count : kCounts) {
      auto out = ramp(count, torch::kFloat64) * r;
      auto in = torch::empty({count}, torch::kFloat64);
      auto sent = world.send_async(out, (r + 1) % n, {7});
      world.recv(in, (r + n - 1) % n, {7});
      sent.wait();
      ASSERT_TRUE(torch::equal(in, ramp(count, torch::kFloat64) * ((r + n - 1) % n)));
    }
    world.barrier();
  });
}

// Receives match messages by source and tag, not by order (as Gloo's do): every worker sends its
// successor messages with tags 0..5, small and larger than a shared-memory channel's ring
// (4 MiB), and posts the receives from its predecessor in reverse order, all at once.
TEST_P(Collectives, ReceivesMatchByTagInAnyOrder) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    if (n == 1) return;
    const std::vector<int64_t> counts = {1, 100000, 7, 0, 1200000, 1001};
    const int from = (r + n - 1) % n;
    std::vector<torch::Tensor> in;
    std::vector<shoal::comm::Work> received, sent;
    for (int tag = static_cast<int>(counts.size()) - 1; tag >= 0; --tag) {
      in.push_back(torch::empty({counts[tag]}, torch::kFloat32));
      received.push_back(world.recv_async(in.back(), from, {tag}));
    }
    std::vector<torch::Tensor> out;
    for (int tag = 0; tag < static_cast<int>(counts.size()); ++tag) {
      out.push_back(ramp(counts[tag], torch::kFloat32) + 1000 * r + tag);
      sent.push_back(world.send_async(out.back(), (r + 1) % n, {tag}));
    }
    for (size_t i = 0; i < received.size(); ++i) {
      received[i].wait(std::chrono::seconds(60));
      const int tag = static_cast<int>(counts.size() - 1 - i);
      ASSERT_TRUE(torch::equal(in[i], ramp(counts[tag], torch::kFloat32) + 1000 * from + tag))
          << "tag " << tag;
    }
    for (auto& work : sent) work.wait(std::chrono::seconds(60));
    world.barrier();
  });
}

TEST_P(Collectives, AsyncOperationsInFlightTogether) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    std::vector<torch::Tensor> tensors;
    std::vector<shoal::comm::Work> works;
    for (int i = 0; i < 8; ++i) {
      tensors.push_back(torch::full({1000 + i}, float(r + i)));
      works.push_back(world.all_reduce_async(tensors.back()));
    }
    for (int i = 0; i < 8; ++i) {
      works[i].wait(std::chrono::seconds(30));
      EXPECT_TRUE(works[i].is_completed());
      EXPECT_TRUE(
          torch::allclose(tensors[i], torch::full({1000 + i}, float(n * (n - 1) / 2 + n * i))));
    }
  });
}

TEST_P(Collectives, SubgroupsOfAnySubset) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    // Evens and odds each form a group, given in descending order: the order sets the ranks.
    std::vector<int> mine;
    for (int j = n - 1; j >= 0; --j)
      if (j % 2 == r % 2) mine.push_back(j);
    auto group = world.subgroup(mine);
    EXPECT_EQ(group.size(), static_cast<int>(mine.size()));
    EXPECT_EQ(group.members(), mine);
    EXPECT_EQ(group.members()[group.rank()], r);
    auto t = torch::full({5}, float(r));
    group.all_reduce(t);
    float sum = 0;
    for (int j : mine) sum += j;
    EXPECT_TRUE(torch::equal(t, torch::full({5}, sum)));
    // The same members again make a second, independent group.
    auto again = world.subgroup(mine);
    auto u = torch::ones({2});
    again.all_reduce(u);
    EXPECT_TRUE(torch::equal(u, torch::full({2}, float(mine.size()))));
    // A worker cannot create a group it is not in.
    if (n > 1) {
      try {
        world.subgroup({(r + 1) % n});
        ADD_FAILURE() << "expected UsageError";
      } catch (const shoal::UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("which is not among its members"), std::string::npos)
            << e.what();
      }
    }
  });
}

// A member may drop a group, or end, as soon as it has it: creation must still succeed on the
// members that were slower to connect (Note [Creating a group ends with a barrier]).
TEST_P(Collectives, GroupsDroppedAtOnceConnectEverywhere) {
  run([] {
    auto& world = shoal::world();
    const int n = world.size();
    std::vector<int> everyone(n);
    std::iota(everyone.begin(), everyone.end(), 0);
    for (int i = 0; i < 40; ++i) {
      // The last member comes late: the others, already waiting for its address, finish
      // connecting first and drop their group while it is still connecting.
      if (world.rank() == n - 1 && i % 2 == 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto group = world.subgroup(everyone);
      ASSERT_EQ(group.size(), n) << "group " << i;
    }
    auto t = torch::ones({3});
    world.all_reduce(t);
    EXPECT_TRUE(torch::equal(t, torch::full({3}, float(n))));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives,
                         ::testing::Values(Layout{1, 1}, Layout{2, 1}, Layout{3, 1}, Layout{4, 1},
                                           Layout{3, 2}, Layout{4, 2}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.workers) +
                                  (info.param.hosts == 1 ? "" : "_on_two_hosts");
                         });

TEST(CollectiveArguments, BadSizesAndRootsAreUsageErrors) {
  run_workers(2, [] {
    auto& world = shoal::world();
    auto t = torch::zeros({5, 2});
    ReduceScatterOptions bad;
    bad.sizes = {2, 2};
    try {
      world.reduce_scatter(t, bad);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "reduce_scatter: sizes [2, 2] add up to 4; expected dim 0 of the input, 5");
    }
    try {
      world.broadcast(t, {5});
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(), "broadcast: root 5 is not a member of a group of 2");
    }
    EXPECT_THROW(world.all_gather(torch::tensor(1.0)), shoal::UsageError);
    // None of this broke the group.
    auto one = torch::ones({1});
    world.all_reduce(one);
    EXPECT_EQ(one.item<float>(), 2.0f);
  });
}

TEST(SplitSizes, FirstPartsTakeTheRemainder) {
  EXPECT_EQ(shoal::comm::split_sizes(10, 3), (shoal::comm::Sizes{4, 3, 3}));
  EXPECT_EQ(shoal::comm::split_sizes(2, 4), (shoal::comm::Sizes{1, 1, 0, 0}));
  EXPECT_EQ(shoal::comm::split_sizes(0, 2), (shoal::comm::Sizes{0, 0}));
}

}  // namespace
