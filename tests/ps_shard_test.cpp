// Where the parameter server's values live and how they start (docs/ps.md, "Sharding"): the
// shard map, and tables whose rows start from a pure function of (seed, table, id).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/hash.h"
#include "ps/shard_map.h"
#include "ps/table.h"
#include "ps_support.h"
#include "shoal/core/error.h"

namespace {

using namespace shoal::ps::detail;
using shoal::UsageError;
using shoal::testing::sparse_spec;

// ---------------------------------------------------------------------------------------------
// Sharding

TEST(PsShardMap, HashesAreFixedByTheirDefinitions) {
  // A published value of an ingredient: splitmix64's first output from state 0.
  EXPECT_EQ(shoal::detail::hash_of(0), 0xe220a8397b1dcdafULL);
  // And FNV-1a's published 64-bit value for "a".
  EXPECT_EQ(shoal::detail::fnv1a("a"), 0xaf63dc4c8601ec8cULL);
  // Where chunks and rows live is part of the snapshot format: these values must never change.
  TableSpec spec;
  spec.name = "emb";
  spec.seed = 42;
  spec.init = {InitSpec::Kind::kNormal, 0, 1};
  float row[2];
  initial_row(spec, 7, row, 2);
  EXPECT_EQ(chunk_shard("fc1.weight", 0), 249);
  EXPECT_EQ(chunk_shard("fc1.weight", 1), 92);
  EXPECT_EQ(row_shard("emb", 12345), 541);
  EXPECT_EQ(ShardMap(3).shards_of(1)[0], 2);
  EXPECT_EQ(ShardMap(3).shards_of(2)[0], 1);
  EXPECT_EQ(row[0], 0x1.d9bda8p+0f);
  EXPECT_EQ(row[1], 0x1.a19226p+0f);
}

TEST(PsShardMap, EveryServerHoldsItsShareWithinOne) {
  for (int32_t servers : {1, 2, 3, 5, 7, 8, 32}) {
    ShardMap map(servers);
    const int32_t low = kVirtualShards / servers;
    const int32_t high = low + (kVirtualShards % servers != 0 ? 1 : 0);
    int64_t total = 0;
    for (int32_t s = 0; s < servers; ++s) {
      const auto held = static_cast<int32_t>(map.shards_of(s).size());
      EXPECT_GE(held, low) << servers << " servers, server " << s;
      EXPECT_LE(held, high) << servers << " servers, server " << s;
      total += held;
    }
    EXPECT_EQ(total, kVirtualShards);
  }
}

TEST(PsShardMap, IsAPureFunctionOfShardsAndServers) {
  for (int32_t servers : {2, 3, 4}) {
    ShardMap a(servers), b(servers);
    for (int32_t v = 0; v < kVirtualShards; ++v) ASSERT_EQ(a.owner(v), b.owner(v));
  }
  EXPECT_EQ(chunk_shard("fc.weight", 3), chunk_shard(std::string("fc.") + "weight", 3));
}

TEST(PsShardMap, LosingTheLastServerMovesOnlyItsShards) {
  for (int32_t servers : {2, 3, 4, 8}) {
    ShardMap big(servers), small(servers - 1);
    int32_t moved = 0;
    for (int32_t v = 0; v < kVirtualShards; ++v) {
      if (big.owner(v) == servers - 1)
        ++moved;
      else
        EXPECT_EQ(big.owner(v), small.owner(v))
            << "shard " << v << " moved from a server that stayed";
    }
    EXPECT_EQ(moved, static_cast<int32_t>(big.shards_of(servers - 1).size()));
  }
  EXPECT_THROW(ShardMap(0), UsageError);
}

TEST(PsShardMap, ChunksAndZipfRowsSpreadEvenly) {
  ShardMap map(3);
  // Rows: 1e6 draws from a Zipf-like (log-uniform) law over 1e8 ids; the distinct ids each
  // server holds are within 5% of a third.
  std::mt19937_64 random(7);
  std::uniform_real_distribution<double> unit(0, 1);
  std::set<int64_t> ids;
  for (int i = 0; i < 1000000; ++i)
    ids.insert(static_cast<int64_t>(std::exp(unit(random) * std::log(1e8))) - 1);
  std::vector<double> rows(3, 0);
  for (int64_t id : ids) rows[static_cast<size_t>(map.owner(row_shard("embedding", id)))] += 1;
  for (int s = 0; s < 3; ++s)
    EXPECT_NEAR(rows[static_cast<size_t>(s)] / static_cast<double>(ids.size()), 1.0 / 3, 0.05 / 3)
        << "server " << s << " of " << ids.size() << " distinct rows";
  // Chunks: a 1e9-element table (15259 chunks); within 5% of a third too.
  const int64_t chunks = chunk_count(1000000000);
  EXPECT_EQ(chunks, 15259);
  std::vector<double> held(3, 0);
  for (int64_t c = 0; c < chunks; ++c)
    held[static_cast<size_t>(map.owner(chunk_shard("big", c)))] += 1;
  for (int s = 0; s < 3; ++s)
    EXPECT_NEAR(held[static_cast<size_t>(s)] / static_cast<double>(chunks), 1.0 / 3, 0.05 / 3);
  EXPECT_EQ(chunk_length(1000000000, chunks - 1), 1000000000 - (chunks - 1) * kChunkElements);
  EXPECT_EQ(chunk_length(1000000000, 0), kChunkElements);
}

// ---------------------------------------------------------------------------------------------
// Tables

TEST(PsTable, RowsStartFromAPureFunctionOfSeedTableAndId) {
  const auto spec = sparse_spec("emb", 0, 5, {InitSpec::Kind::kNormal, 0.5, 2.0});
  VirtualShard a(3), b(900);
  // Different shards, different orders, other rows touched in between.
  for (int64_t id : {10, 20, 30, 40}) a.touch_row(0, id, spec, 5);
  for (int64_t id : {99, 40, 7, 30, 20, 10}) b.touch_row(0, id, spec, 5);
  for (int64_t id : {10, 20, 30, 40}) {
    std::vector<float> expected(5);
    initial_row(spec, id, expected.data(), 5);
    const Slot* x = a.find_row(0, id);
    const Slot* y = b.find_row(0, id);
    ASSERT_TRUE(x != nullptr && y != nullptr);
    for (int j = 0; j < 5; ++j) {
      EXPECT_EQ(x->values()[j], expected[static_cast<size_t>(j)]);
      EXPECT_EQ(y->values()[j], expected[static_cast<size_t>(j)]);
    }
  }
  // The seed and the table's name matter.
  std::vector<float> one(5), other(5);
  initial_row(spec, 10, one.data(), 5);
  auto reseeded = spec;
  reseeded.seed = 43;
  initial_row(reseeded, 10, other.data(), 5);
  EXPECT_NE(one, other);
  auto renamed = spec;
  renamed.name = "emb2";
  initial_row(renamed, 10, other.data(), 5);
  EXPECT_NE(one, other);
}

TEST(PsTable, InitialValuesFollowTheirLaw) {
  const int64_t n = 20000, dim = 8;
  std::vector<float> row(dim);
  double sum = 0, sum_sq = 0, low = 1e9, high = -1e9;
  const auto normal = sparse_spec("n", 0, dim, {InitSpec::Kind::kNormal, 1.0, 0.5});
  const auto uniform = sparse_spec("u", 0, dim, {InitSpec::Kind::kUniform, -0.25, 0.75});
  for (int64_t id = 0; id < n; ++id) {
    initial_row(normal, id, row.data(), dim);
    for (float v : row) sum += v, sum_sq += double(v) * v;
    initial_row(uniform, id, row.data(), dim);
    for (float v : row) low = std::min(low, double(v)), high = std::max(high, double(v));
  }
  const double count = n * dim, mean = sum / count;
  EXPECT_NEAR(mean, 1.0, 0.01);  // 5 standard errors: 0.5 / sqrt(160000) = 0.00125
  EXPECT_NEAR(std::sqrt(sum_sq / count - mean * mean), 0.5, 0.01);
  EXPECT_GE(low, -0.25);
  EXPECT_LT(high, 0.75);
  EXPECT_LT(low, -0.24);
  EXPECT_GT(high, 0.74);
  const auto zeros = sparse_spec("z", 0, dim, {});
  initial_row(zeros, 5, row.data(), dim);
  EXPECT_EQ(row, std::vector<float>(dim, 0.f));
}

}  // namespace
