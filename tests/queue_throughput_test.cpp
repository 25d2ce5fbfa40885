// A job's measured throughput (src/queue/throughput.h) against closed forms: samples per second
// over a window of one worker count, a new window at each resize, and nothing claimed before a
// window is long enough. Builds without torch, as the policy's tests.
#include <gtest/gtest.h>

#include "queue/throughput.h"

namespace shoal::queue {
namespace {

TEST(QueueThroughput, IsTheSamplesPerSecondOfTheWindowAtOneWorkerCount) {
  Throughput t;
  EXPECT_FALSE(t.current().has_value());
  EXPECT_TRUE(t.to_json().at("samples_per_s").is_null());
  // 2 workers, 120 samples a second, a point every 500 ms.
  for (int i = 0; i <= 3; ++i) t.add(1000 + 500 * i, 60 * i, 2);
  EXPECT_FALSE(t.current().has_value()) << "2 s of points are needed";
  t.add(3500, 300, 2);
  ASSERT_TRUE(t.current().has_value());
  EXPECT_DOUBLE_EQ(*t.current(), 120.0);
  EXPECT_EQ(t.world(), 2);

  // A resize to 4 workers starts a new window: the round's pause is not counted at 4.
  t.add(5000, 310, 4);
  EXPECT_FALSE(t.current().has_value());
  for (int i = 1; i <= 4; ++i) t.add(5000 + 500 * i, 310 + 100 * i, 4);
  ASSERT_TRUE(t.current().has_value());
  EXPECT_DOUBLE_EQ(*t.current(), 200.0);
  EXPECT_EQ(t.by_world().at(2), 120.0);
  EXPECT_EQ(t.by_world().at(4), 200.0);

  // The window keeps the last 10 s: a slower spell replaces the older rate.
  for (int i = 1; i <= 40; ++i) t.add(7000 + 500 * i, 710 + 25 * i, 4);
  EXPECT_DOUBLE_EQ(*t.current(), 50.0);

  const auto doc = t.to_json();
  EXPECT_DOUBLE_EQ(doc.at("samples_per_s").get<double>(), 50.0);
  EXPECT_EQ(doc.at("world"), 4);
  Throughput restored;
  restored.restore(doc);
  EXPECT_EQ(restored.by_world(), t.by_world());
  EXPECT_FALSE(restored.current().has_value());
}

TEST(QueueThroughput, IgnoresPointsOutOfOrderAndAJobThatWentBack) {
  Throughput t;
  t.add(1000, 0, 1);
  t.add(3000, 200, 1);
  t.add(2000, 500, 1);  // older than the last: another worker's stale file
  t.add(3500, 100, 1);  // fewer samples: resumed from an older commit
  ASSERT_TRUE(t.current().has_value());
  EXPECT_DOUBLE_EQ(*t.current(), 100.0);
}

}  // namespace
}  // namespace shoal::queue
