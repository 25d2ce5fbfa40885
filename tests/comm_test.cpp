// shoal::comm::sent_bytes(): each operation adds its closed form (docs/comm.md, "Bytes sent") on
// 2 and 3 workers, in the world and in a sub-group, over empty, odd and even sizes.
#include <functional>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "harness.h"
#include "shoal/shoal.h"

namespace {

using shoal::comm::AllToAllOptions;
using shoal::comm::ReduceScatterOptions;
using shoal::testing::run_workers;

// What `op` added to this worker's count.
int64_t sent_by(const std::function<void()>& op) {
  const int64_t before = shoal::comm::sent_bytes();
  op();
  return shoal::comm::sent_bytes() - before;
}

// 0, odd (a ring's 2T(n-1)/n is then rounded down) and even element counts.
const std::vector<int64_t> kCounts = {0, 7, 1200};

class SentBytes : public ::testing::TestWithParam<int> {};

TEST_P(SentBytes, CollectivesAsRingsSendThem) {
  run_workers(GetParam(), [] {
    auto& world = shoal::world();
    const int64_t n = world.size();
    for (const int64_t count : kCounts) {
      SCOPED_TRACE("count " + std::to_string(count));
      const int64_t bytes = count * 4;  // T: the tensor of one worker, in floats
      auto t = torch::ones({count});
      EXPECT_EQ(sent_by([&] { world.all_reduce(t); }), 2 * bytes * (n - 1) / n);
      EXPECT_EQ(sent_by([&] { world.broadcast(t, {static_cast<int>(n) - 1}); }),
                bytes * (n - 1) / n);
      // The whole is n parts of T: (n-1)/n of it is (n-1) T.
      EXPECT_EQ(sent_by([&] { world.all_gather(t); }), (n - 1) * bytes);
      // Inputs of n parts of T: each worker keeps one part and sends the others.
      auto whole = torch::ones({n * count});
      EXPECT_EQ(sent_by([&] { world.reduce_scatter(whole); }), (n - 1) * bytes);
      EXPECT_EQ(sent_by([&] { world.all_to_all(whole); }), (n - 1) * bytes);
      // Counted when launched, before the wait.
      auto work = world.all_reduce_async(t);
      EXPECT_EQ(sent_by([&] { work.wait(); }), 0);
    }
    // Uneven parts: an all-gather sends its part padded to the largest, as Gloo does; a
    // reduce-scatter the rows of the others' parts. Rows of 5 floats, 3n + 1 of them.
    const int64_t rows = 3 * n + 1, row_bytes = 5 * 4;
    const auto sizes = shoal::comm::split_sizes(rows, static_cast<int>(n));
    auto mine = torch::ones({sizes[world.rank()], 5});
    EXPECT_EQ(sent_by([&] { world.all_gather(mine, {sizes}); }), (n - 1) * sizes[0] * row_bytes);
    auto input = torch::ones({rows, 5});
    EXPECT_EQ(sent_by([&] { world.reduce_scatter(input); }),
              (rows - sizes[world.rank()]) * row_bytes);
    // All-to-all with parts of any size: what goes to the others, not what stays.
    AllToAllOptions uneven;
    for (int j = 0; j < n; ++j) uneven.send_sizes.push_back(j + 1);
    for (int j = 0; j < n; ++j) uneven.recv_sizes.push_back(world.rank() + 1);
    auto rising = torch::ones({n * (n + 1) / 2, 5});
    EXPECT_EQ(sent_by([&] { world.all_to_all(rising, uneven); }),
              (n * (n + 1) / 2 - (world.rank() + 1)) * row_bytes);
    // A barrier carries no data.
    EXPECT_EQ(sent_by([&] { world.barrier(); }), 0);
  });
}

TEST_P(SentBytes, SendCountsItsTensorReceiveNothing) {
  run_workers(GetParam(), [] {
    auto& world = shoal::world();
    const int n = world.size(), r = world.rank();
    // A ring: each worker sends 1200 floats to the next and receives from the previous.
    auto out = torch::full({1200}, static_cast<float>(r));
    auto in = torch::empty({1200});
    auto sending = world.send_async(out, (r + 1) % n);
    EXPECT_EQ(sent_by([&] { world.recv(in, (r + n - 1) % n); }), 0);
    sending.wait();
    EXPECT_TRUE(torch::equal(in, torch::full({1200}, static_cast<float>((r + n - 1) % n))));
    // Only the sender counts a one-way message.
    auto one_way = torch::ones({300});
    const int64_t counted = sent_by([&] {
      if (r == 0) world.send(one_way, 1);
      if (r == 1) world.recv(one_way, 0);
    });
    EXPECT_EQ(counted, r == 0 ? 300 * 4 : 0);
  });
}

TEST_P(SentBytes, BroadcastSharesTheTreesBytesEvenly) {
  run_workers(GetParam(), [] {
    auto& world = shoal::world();
    const int64_t n = world.size();
    auto t = torch::ones({1200});  // 4800 bytes, divisible by 2 and 3
    const int64_t mine = sent_by([&] { world.broadcast(t); });
    // Summed over the workers: the (n-1) T any broadcast must move.
    auto counts = world.all_gather(torch::tensor({mine}));
    EXPECT_EQ(counts.sum().item<int64_t>(), (n - 1) * 4800);
  });
}

TEST_P(SentBytes, SubgroupsAndGroupsOfOne) {
  run_workers(GetParam(), [] {
    auto& world = shoal::world();
    const int r = world.rank();
    auto t = torch::ones({1200});
    // A sub-group of workers 1 and 0: a ring of two, 2T(2-1)/2 = T each; others send nothing.
    int64_t counted = 0;
    if (r < 2) {
      auto pair = world.subgroup({1, 0});
      counted = sent_by([&] { pair.all_reduce(t); });
    }
    EXPECT_EQ(counted, r < 2 ? 4800 : 0);
    auto single = shoal::comm::Group::single();
    EXPECT_EQ(sent_by([&] {
                single.all_reduce(t);
                single.broadcast(t);
                (void)single.all_gather(t);
                (void)single.reduce_scatter(t);
                (void)single.all_to_all(t);
              }),
              0);
    world.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Workers, SentBytes, ::testing::Values(2, 3),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

}  // namespace
