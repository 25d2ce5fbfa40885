// The epoch's ledger (src/ps/ledger.*, Note [Batches are leased]) alone, and loaders leasing
// their batches from it (Sampler::lease_from) as the workers of a parameter-server job do
// (docs/ps.md, "Leased batches"). The ledger on a server, with pushes, is ps_server_core_test's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "error_of.h"
#include "ps/ledger.h"
#include "shoal/core/error.h"
#include "shoal/data/loader.h"

namespace {

using shoal::UsageError;
using shoal::ps::detail::Ledger;
using shoal::testing::error_of;

TEST(PsLedger, EverySampleOnceThroughDeathsAndJoins) {
  std::mt19937 random(7);
  for (int scenario = 0; scenario < 300; ++scenario) {
    const int64_t size = std::uniform_int_distribution<int64_t>(0, 400)(random);
    const int64_t batch = std::uniform_int_distribution<int64_t>(1, 37)(random);
    const bool drop_last = random() % 2 == 0;
    Ledger ledger({size, batch, drop_last});
    const int64_t covered = drop_last ? size / batch * batch : size;
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      std::vector<int> trained(static_cast<size_t>(size), 0);
      std::map<int32_t, std::vector<Ledger::Lease>> held;  // live workers and their leases
      int32_t next_worker = 0;
      for (int k = 0; k < 3; ++k) held[next_worker++];
      for (int guard = 0;; ++guard) {
        ASSERT_LT(guard, 100000) << "the epoch never ended";
        const int action = static_cast<int>(random() % 10);
        auto it = std::next(held.begin(), static_cast<long>(random() % held.size()));
        const int32_t worker = it->first;
        if (action < 5) {
          const auto lease = ledger.lease(worker, epoch);
          if (lease.kind == Ledger::Lease::Kind::kEpochDone) break;
          if (lease.kind == Ledger::Lease::Kind::kBatch) {
            ASSERT_EQ(lease.epoch, epoch);
            ASSERT_LT(lease.begin, lease.end);
            ASSERT_LE(lease.end, covered);
            it->second.push_back(lease);
          }
        } else if (action < 8 && !it->second.empty()) {
          const auto lease = it->second.back();
          it->second.pop_back();
          ledger.done(worker, lease.epoch, lease.batch);
          for (int64_t i = lease.begin; i < lease.end; ++i) ++trained[static_cast<size_t>(i)];
        } else if (action == 8 && held.size() > 1) {  // dies: its leases come back
          EXPECT_EQ(ledger.release(worker), static_cast<int64_t>(it->second.size()));
          held.erase(it);
        } else if (action == 9 && held.size() < 6) {
          held[next_worker++];
        }
      }
      for (int64_t i = 0; i < size; ++i)
        ASSERT_EQ(trained[static_cast<size_t>(i)], i < covered ? 1 : 0)
            << "position " << i << " of epoch " << epoch << " (size " << size << ", batch " << batch
            << (drop_last ? ", drop_last" : "") << ")";
      EXPECT_TRUE(ledger.epoch_done());
    }
  }
}

TEST(PsLedger, OneEpochIsOpenAtATime) {
  using Kind = Ledger::Lease::Kind;
  Ledger ledger({10, 4, false});
  EXPECT_EQ(ledger.batches_per_epoch(), 3);
  const auto a = ledger.lease(0, 0), b = ledger.lease(1, 0), c = ledger.lease(0, 0);
  EXPECT_EQ(c.begin, 8);
  EXPECT_EQ(c.end, 10);                             // the short last batch
  EXPECT_EQ(ledger.lease(2, 0).kind, Kind::kWait);  // nothing fresh, but batches are out
  EXPECT_EQ(ledger.lease(2, 1).kind, Kind::kWait);  // the next epoch waits for them
  EXPECT_EQ(ledger.release(1), 1);
  const auto again = ledger.lease(2, 0);  // the returned batch goes out first
  EXPECT_EQ(again.batch, b.batch);
  EXPECT_NE(error_of<UsageError>([&] { ledger.done(1, 0, b.batch); })
                .find("worker 1 reported batch 1 of epoch 0 trained; expected a batch of epoch 0 "
                      "leased to it and not yet done"),
            std::string::npos);
  ledger.done(0, 0, a.batch);
  ledger.done(2, 0, again.batch);
  ledger.done(0, 0, c.batch);
  EXPECT_NE(error_of<UsageError>([&] { ledger.done(0, 0, c.batch); }).find("not yet done"),
            std::string::npos);
  EXPECT_EQ(ledger.lease(1, 0).kind, Kind::kEpochDone);
  EXPECT_EQ(ledger.lease(1, 1).kind, Kind::kBatch);  // opens epoch 1
  EXPECT_EQ(ledger.lease(0, 0).kind, Kind::kEpochDone);
  EXPECT_NE(error_of<UsageError>([&] {
              ledger.lease(0, 3);
            }).find("worker 0 asked for a batch of epoch 3; expected epoch 1 (the open one) or 2"),
            std::string::npos);
  EXPECT_EQ(Ledger({10, 4, true}).batches_per_epoch(), 2);
  EXPECT_NE(error_of<UsageError>([] {
              Ledger({10, 0, false});
            }).find("batches of at least 1"),
            std::string::npos);
}

// The loader's sampler leasing from the ledger (Sampler::lease_from), as workers of an elastic
// job do: three workers take turns, one dies holding a batch, one joins mid-epoch; every sample
// of each epoch is loaded and trained once, and workers with nothing left get empty batches.
TEST(PsLedger, LoadersLeasingTheirBatchesTrainEverySampleOnce) {
  using shoal::data::BatchLeases;
  struct Leases : BatchLeases {
    Leases(Ledger& ledger, int32_t worker) : ledger(ledger), worker(worker) {}
    Lease next(int64_t epoch, int64_t dataset_size, int64_t batch_size, bool drop_last) override {
      EXPECT_EQ(dataset_size, 103);
      EXPECT_EQ(batch_size, 8);
      EXPECT_FALSE(drop_last);
      last = ledger.lease(worker, epoch);
      switch (last.kind) {
        case Ledger::Lease::Kind::kBatch:
          return {Lease::Kind::kBatch, last.begin, last.end};
        case Ledger::Lease::Kind::kWait:
          return {Lease::Kind::kIdle, 0, 0};
        case Ledger::Lease::Kind::kEpochDone:
          break;
      }
      return {Lease::Kind::kEpochDone, 0, 0};
    }
    Ledger& ledger;
    int32_t worker;
    Ledger::Lease last;
  };
  const int64_t size = 103;
  auto dataset = torch::data::datasets::TensorDataset(torch::arange(size).view({size, 1}));
  Ledger ledger({size, 8, false});
  shoal::data::LoaderOptions options;
  options.batch_size = 8;
  options.per_worker = true;
  options.shuffle = true;
  struct Worker {
    std::shared_ptr<Leases> leases;
    std::optional<shoal::data::Loader<decltype(dataset)>> loader;
  };
  std::map<int32_t, Worker> workers;
  auto start = [&](int32_t w) {
    Worker& worker = workers[w];
    worker.leases = std::make_shared<Leases>(ledger, w);
    worker.loader.emplace(shoal::data::make_loader(dataset, options, 0, 1));
    worker.loader->sampler().lease_from(worker.leases);
  };
  for (int32_t w : {0, 1, 2}) start(w);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<int> trained(size, 0);
    std::map<int32_t, shoal::data::Loader<decltype(dataset)>::Iterator> at;
    for (auto& [w, worker] : workers) at.emplace(w, worker.loader->epoch(epoch).begin());
    int idle = 0;
    for (int turn = 0; !at.empty(); ++turn) {
      ASSERT_LT(turn, 1000);
      if (epoch == 0 && turn == 2) {  // worker 1 dies holding its third batch
        ASSERT_EQ(workers[1].leases->last.kind, Ledger::Lease::Kind::kBatch);
        EXPECT_EQ(ledger.release(1), 1);
        workers.erase(1);
        at.erase(1);
      }
      if (epoch == 0 && turn == 3) {  // worker 3 joins
        start(3);
        at.emplace(3, workers[3].loader->epoch(epoch).begin());
      }
      for (auto it = at.begin(); it != at.end();) {
        auto& [w, batch] = *it;
        if (batch == decltype(batch)()) {  // this worker's epoch is over
          it = at.erase(it);
          continue;
        }
        const auto rows = batch->data.size(0);
        if (rows == 0) ++idle;
        for (int64_t i = 0; i < rows; ++i) ++trained[batch->data[i][0].item<int64_t>()];
        const auto& lease = workers[w].leases->last;
        if (rows > 0) ledger.done(w, lease.epoch, lease.batch);
        ++batch;
        ++it;
      }
    }
    for (int64_t i = 0; i < size; ++i) ASSERT_EQ(trained[i], 1) << "sample " << i;
    EXPECT_GT(idle, 0);  // 13 batches over 3 workers: some wait for the last ones
  }
  // LastBatch::kPad cannot be leased.
  options.last_batch = shoal::data::LastBatch::kPad;
  auto padded = shoal::data::make_loader(dataset, options, 0, 1);
  EXPECT_NE(error_of<UsageError>([&] {
              padded.sampler().lease_from(workers[0].leases);
            }).find("expected kKeep or kDrop"),
            std::string::npos);
}

}  // namespace
