// The data-parallel sampler and loader: each index exactly once per epoch across workers,
// determinism, restore and re-shard mid-epoch, and loaders that match torch::data's.
#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "error_of.h"
#include "harness.h"
#include "shoal/checkpoint/savable.h"
#include "shoal/comm/group.h"
#include "shoal/core/error.h"
#include "shoal/datasets/fashion_mnist.h"
#include "shoal/data/loader.h"
#include "shoal/data/sampler.h"
#include "shoal/runtime/init.h"

namespace {

using shoal::data::LastBatch;
using shoal::data::Sampler;
using shoal::data::SamplerOptions;
using Indices = std::vector<size_t>;

using shoal::testing::error_of;

std::vector<Sampler> workers(int64_t n, const SamplerOptions& options, int world) {
  std::vector<Sampler> samplers;
  for (int r = 0; r < world; ++r) samplers.emplace_back(n, options, r, world);
  return samplers;
}

// Takes one step on every worker: checks that each share is the split_sizes slice of the
// global batch and returns the global batch (the shares concatenated in rank order).
Indices step(std::vector<Sampler>& samplers) {
  const int64_t global = samplers[0].global_batch_at_cursor();
  const auto shares = shoal::comm::split_sizes(global, static_cast<int>(samplers.size()));
  Indices batch;
  for (size_t r = 0; r < samplers.size(); ++r) {
    EXPECT_EQ(samplers[r].global_batch_at_cursor(), global);
    const Indices share = samplers[r].batch();
    EXPECT_EQ(static_cast<int64_t>(share.size()), shares[r]) << "rank " << r;
    batch.insert(batch.end(), share.begin(), share.end());
    samplers[r].advance();
  }
  return batch;
}

// Runs the rest of the epoch; returns how often each index was taken.
std::map<size_t, int> finish_epoch(std::vector<Sampler>& samplers, int64_t* steps = nullptr) {
  std::map<size_t, int> seen;
  int64_t taken = 0;
  while (!samplers[0].epoch_done()) {
    for (size_t i : step(samplers)) ++seen[i];
    ++taken;
  }
  for (auto& s : samplers) EXPECT_TRUE(s.epoch_done()) << "rank " << s.rank();
  if (steps != nullptr) *steps = taken;
  return seen;
}

void expect_each_once(const std::map<size_t, int>& seen, int64_t n) {
  ASSERT_EQ(static_cast<int64_t>(seen.size()), n);
  for (const auto& [index, count] : seen) {
    EXPECT_LT(static_cast<int64_t>(index), n);
    EXPECT_EQ(count, 1) << "index " << index;
  }
}

// The grid of the issue: world sizes, dataset sizes that do and don't divide, batch sizes,
// the three last-batch policies and both batch modes.
TEST(Sampler, EveryIndexOncePerEpochAcrossWorkers) {
  for (bool per_worker : {false, true})
    for (LastBatch last : {LastBatch::kKeep, LastBatch::kDrop, LastBatch::kPad})
      for (int world = 1; world <= 4; ++world)
        for (int64_t n : {0, 1, 7, 10, 97, 100})
          for (int64_t b : {1, 3, 8, 32}) {
            SCOPED_TRACE("per_worker " + std::to_string(per_worker) + " last " + std::to_string(int(last)) +
                         " world " + std::to_string(world) + " n " + std::to_string(n) + " b " + std::to_string(b));
            SamplerOptions options{b, /*shuffle=*/true, last, per_worker, /*seed=*/7};
            auto samplers = workers(n, options, world);
            const int64_t global = per_worker ? b * world : b;
            EXPECT_EQ(samplers[0].global_batch_size(), global);
            // The global batches, in order, are the permutation cut into pieces of `global`.
            const Indices& permutation = samplers[0].permutation();
            Indices walked;
            int64_t steps = 0;
            while (!samplers[0].epoch_done()) {
              const Indices batch = step(samplers);
              if (last != LastBatch::kKeep) {
                ASSERT_EQ(static_cast<int64_t>(batch.size()), global);
              }
              walked.insert(walked.end(), batch.begin(), batch.end());
              ++steps;
            }
            for (size_t i = 0; i < walked.size(); ++i) {
              ASSERT_EQ(walked[i], permutation[i % permutation.size()]);
            }
            EXPECT_EQ(steps, samplers[0].batches_per_epoch());
            const int64_t full = n / global, rest = n % global;
            std::map<size_t, int> seen;
            for (size_t i : walked) ++seen[i];
            if (last == LastBatch::kKeep) {
              EXPECT_EQ(steps, full + (rest > 0));
              expect_each_once(seen, n);
            } else if (last == LastBatch::kDrop) {
              EXPECT_EQ(steps, full);
              EXPECT_EQ(static_cast<int64_t>(walked.size()), full * global);
              for (const auto& [index, count] : seen) EXPECT_EQ(count, 1);
            } else {
              EXPECT_EQ(steps, full + (rest > 0));
              EXPECT_EQ(static_cast<int64_t>(seen.size()), n);  // every index, some twice
            }
          }
}

TEST(Sampler, SameSeedAndEpochSameSequence) {
  const SamplerOptions options{8, true, LastBatch::kKeep, false, 3};
  auto sequence = [&](int64_t epoch, uint64_t seed) {
    SamplerOptions o = options;
    o.seed = seed;
    Sampler s(100, o, 1, 3);
    s.set_epoch(epoch);
    std::vector<Indices> batches;
    for (; !s.epoch_done(); s.advance()) batches.push_back(s.batch());
    return batches;
  };
  EXPECT_EQ(sequence(2, 3), sequence(2, 3));
  EXPECT_NE(sequence(2, 3), sequence(3, 3));
  EXPECT_NE(sequence(2, 3), sequence(2, 4));

  // Without shuffle, every epoch is 0..n-1.
  Sampler plain(10, {4}, 0, 1);
  plain.set_epoch(5);
  Indices expected(10);
  std::iota(expected.begin(), expected.end(), size_t{0});
  EXPECT_EQ(plain.permutation(), expected);
  EXPECT_EQ(plain.batch(), (Indices{0, 1, 2, 3}));
}

// The permutation is part of what a saved state means: it must not change between versions.
// These values were also computed by an independent Python version of docs/data.md's algorithm.
TEST(Sampler, PermutationIsPinned) {
  EXPECT_EQ(shoal::data::epoch_permutation(10, 0, 0), (Indices{6, 3, 2, 9, 8, 1, 4, 7, 0, 5}));
  EXPECT_EQ(shoal::data::epoch_permutation(10, 42, 3), (Indices{6, 7, 9, 2, 5, 0, 1, 4, 3, 8}));
  EXPECT_TRUE(shoal::data::epoch_permutation(0, 1, 1).empty());
  // Roughly uniform: where element 0 lands over many epochs.
  std::vector<int> where(4, 0);
  for (int64_t epoch = 0; epoch < 4000; ++epoch) {
    const auto p = shoal::data::epoch_permutation(4, 9, epoch);
    ++where[std::find(p.begin(), p.end(), size_t{0}) - p.begin()];
  }
  for (int count : where) EXPECT_NEAR(count, 1000, 100);
}

TEST(Sampler, RestoreMidEpochContinuesExactly) {
  const SamplerOptions options{8, true, LastBatch::kKeep, false, 11};
  auto original = workers(97, options, 3);
  for (auto& s : original) s.set_epoch(4);
  for (int k = 0; k < 5; ++k) step(original);
  const shoal::data::SamplerState saved = original[0].state();
  EXPECT_EQ(saved.epoch, 4);
  EXPECT_EQ(saved.cursor, 40);

  std::vector<Indices> expected;
  while (!original[0].epoch_done()) expected.push_back(step(original));

  // Fresh samplers (a restarted job): load, then the plain epoch loop's set_epoch resumes.
  auto restored = workers(97, options, 3);
  for (auto& s : restored) {
    s.load_state(saved);
    s.set_epoch(4);
  }
  std::vector<Indices> got;
  while (!restored[0].epoch_done()) got.push_back(step(restored));
  EXPECT_EQ(got, expected);

  // Only the first set_epoch after a restore resumes; the next one starts the epoch over.
  restored[0].set_epoch(4);
  EXPECT_EQ(restored[0].cursor(), 0);
  // A restore followed by another epoch starts that epoch.
  restored[1].load_state(saved);
  restored[1].set_epoch(5);
  EXPECT_EQ(restored[1].cursor(), 0);
}

// See DESIGN.md 3.2: the rest of an epoch is cut among the new workers, from the global cursor.
TEST(Sampler, ReshardMidEpochCoversEachIndexOnce) {
  struct Case {
    int before, after;
    bool per_worker;
  };
  for (Case c : {Case{3, 2, false}, Case{2, 4, false}, Case{3, 2, true}, Case{2, 4, true}, Case{4, 1, true}})
    for (int64_t n : {7, 97, 100}) {
      SCOPED_TRACE(std::to_string(c.before) + " -> " + std::to_string(c.after) + " per_worker " +
                   std::to_string(c.per_worker) + " n " + std::to_string(n));
      const SamplerOptions options{3, true, LastBatch::kKeep, c.per_worker, 5};
      auto samplers = workers(n, options, c.before);
      std::map<size_t, int> seen;
      for (int k = 0; k < 2 && !samplers[0].epoch_done(); ++k)
        for (size_t i : step(samplers)) ++seen[i];
      // Survivors re-shard in place; newcomers build a sampler and load the state.
      const auto saved = samplers[0].state();
      samplers.erase(samplers.begin() + std::min(c.before, c.after), samplers.end());
      for (int r = 0; r < static_cast<int>(samplers.size()); ++r) samplers[r].reshard(r, c.after);
      for (int r = static_cast<int>(samplers.size()); r < c.after; ++r) {
        samplers.emplace_back(n, options, r, c.after);
        samplers.back().load_state(saved);
      }
      for (const auto& [index, count] : finish_epoch(samplers)) seen[index] += count;
      expect_each_once(seen, n);
    }
}

TEST(Sampler, BadInputNamesTheValue) {
  EXPECT_EQ(error_of([] { Sampler(10, {0}, 0, 1); }), "Sampler: batch_size = 0 is out of range: expected at least 1");
  EXPECT_EQ(error_of([] { Sampler(10, {4}, 3, 3); }),
            "Sampler: rank = 3 is out of range: expected 0 <= rank < world_size = 3");
  EXPECT_EQ(error_of([] { Sampler(10, {4}, -1, 3); }),
            "Sampler: rank = -1 is out of range: expected 0 <= rank < world_size = 3");
  EXPECT_EQ(error_of([] { Sampler(10, {4}, 0, 0); }), "Sampler: world_size = 0 is out of range: expected at least 1");
  EXPECT_EQ(error_of([] { Sampler(-1, {4}, 0, 1); }), "Sampler: dataset_size = -1 is out of range: expected at least 0");
  Sampler s(60000, {4, true, LastBatch::kKeep, false, 1}, 0, 2);
  EXPECT_EQ(error_of([&] { s.set_epoch(-1); }), "Sampler: epoch = -1 is out of range: expected at least 0");
  EXPECT_EQ(error_of([&] { s.reshard(2, 2); }), "Sampler: rank = 2 is out of range: expected 0 <= rank < world_size = 2");
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(s.world_size(), 2);

  Sampler other(50000, {4, true, LastBatch::kKeep, false, 1}, 0, 2);
  EXPECT_EQ(error_of([&] { other.load_state(s.state()); }),
            "Sampler: the state was saved for a dataset of 60000 samples; this one has 50000");
  auto state = s.state();
  state.seed = 2;
  EXPECT_EQ(error_of([&] { s.load_state(state); }),
            "Sampler: the state was saved with seed 2; this sampler's seed is 1");
  state = s.state();
  state.shuffle = false;
  EXPECT_EQ(error_of([&] { s.load_state(state); }),
            "Sampler: the state was saved with shuffle = false; this sampler has shuffle = true");
  state = s.state();
  state.cursor = 60001;
  EXPECT_EQ(error_of([&] { s.load_state(state); }),
            "Sampler: the state's cursor = 60001 is out of range: expected 0 <= cursor <= dataset_size = 60000");

}

// state_dict() is state() as named 0-dim int64 tensors; load_state_dict() is load_state().
TEST(Sampler, StateDictRestoresAsLoadStateDoes) {
  const SamplerOptions options{8, true, LastBatch::kKeep, false, 11};
  auto original = workers(97, options, 3);
  for (auto& s : original) s.set_epoch(4);
  for (int k = 0; k < 5; ++k) step(original);
  const shoal::checkpoint::StateDict saved = original[0].state_dict();
  const std::map<std::string, int64_t> expected_values{
      {"seed", 11}, {"shuffle", 1}, {"dataset_size", 97}, {"epoch", 4}, {"cursor", 40}};
  ASSERT_EQ(saved.size(), expected_values.size());
  for (const auto& [name, value] : expected_values) {
    SCOPED_TRACE(name);
    ASSERT_EQ(saved.count(name), 1u);
    EXPECT_EQ(saved.at(name).dim(), 0);
    EXPECT_EQ(saved.at(name).scalar_type(), torch::kInt64);
    EXPECT_EQ(saved.at(name).item<int64_t>(), value);
  }
  const shoal::data::SamplerState position = original[0].state();
  std::vector<Indices> expected;
  while (!original[0].epoch_done()) expected.push_back(step(original));

  auto by_dict = workers(97, options, 3);
  auto by_state = workers(97, options, 3);
  for (int r = 0; r < 3; ++r) {
    by_dict[r].check_state_dict(saved);
    by_dict[r].load_state_dict(saved);
    by_dict[r].set_epoch(4);
    by_state[r].load_state(position);
    by_state[r].set_epoch(4);
  }
  std::vector<Indices> got, got_by_state;
  while (!by_dict[0].epoch_done()) got.push_back(step(by_dict));
  while (!by_state[0].epoch_done()) got_by_state.push_back(step(by_state));
  EXPECT_EQ(got, expected);
  EXPECT_EQ(got_by_state, expected);

  // The seed is stored as its bits: one over 2^63 is a negative int64 and comes back whole.
  const SamplerOptions high{8, true, LastBatch::kKeep, false, ~uint64_t{0}};
  Sampler first(97, high, 0, 1), second(97, high, 0, 1);
  first.set_epoch(2);
  first.advance();
  const auto bits = first.state_dict();
  EXPECT_EQ(bits.at("seed").item<int64_t>(), -1);
  second.load_state_dict(bits);
  second.set_epoch(2);
  EXPECT_EQ(second.batch(), first.batch());
  EXPECT_EQ(second.state().seed, ~uint64_t{0});
}

// Each refusal is one line naming the first thing wrong, and neither check_state_dict nor
// load_state_dict changes the sampler: it hands out the same batch after as before.
TEST(Sampler, StateDictRefusalsChangeNothing) {
  Sampler s(60000, {4, true, LastBatch::kKeep, false, 1}, 0, 2);
  s.set_epoch(3);
  s.advance();
  s.advance();
  const Indices before = s.batch();
  const auto good = s.state_dict();
  auto refused = [&](const std::function<void(shoal::checkpoint::StateDict&)>& spoil) {
    shoal::checkpoint::StateDict state = good;
    spoil(state);
    const std::string message = error_of([&] { s.check_state_dict(state); });
    EXPECT_EQ(error_of([&] { s.load_state_dict(state); }), message);
    EXPECT_EQ(s.batch(), before);
    EXPECT_EQ(s.epoch(), 3);
    EXPECT_EQ(s.cursor(), 8);
    return message;
  };
  auto set = [](const char* name, torch::Tensor value) {
    return [name, value](shoal::checkpoint::StateDict& state) { state[name] = value; };
  };

  EXPECT_EQ(refused([](auto& state) { state.erase("cursor"); }),
            "Sampler: the state has no \"cursor\"; expected the names seed, shuffle, dataset_size, epoch "
            "and cursor");
  EXPECT_EQ(refused(set("epoch", torch::tensor(3.0))),
            "Sampler: the state's \"epoch\" is a Float tensor of shape []; expected a 0-dim integer tensor");
  EXPECT_EQ(refused(set("cursor", torch::tensor({int64_t{8}}))),
            "Sampler: the state's \"cursor\" is a Long tensor of shape [1]; expected a 0-dim integer tensor");
  EXPECT_EQ(refused(set("shuffle", torch::tensor(true))),
            "Sampler: the state's \"shuffle\" is a Bool tensor of shape []; expected a 0-dim integer tensor");
  EXPECT_EQ(refused(set("seed", torch::Tensor())),
            "Sampler: the state's \"seed\" is an undefined tensor; expected a 0-dim integer tensor");
  EXPECT_EQ(refused(set("shuffle", torch::tensor(int64_t{2}))),
            "Sampler: the state's shuffle = 2 is out of range: expected 0 or 1");
  // What load_state() refuses, in its words.
  EXPECT_EQ(refused(set("dataset_size", torch::tensor(int64_t{50000}))),
            "Sampler: the state was saved for a dataset of 50000 samples; this one has 60000");
  EXPECT_EQ(refused(set("seed", torch::tensor(int64_t{2}))),
            "Sampler: the state was saved with seed 2; this sampler's seed is 1");
  EXPECT_EQ(refused(set("shuffle", torch::tensor(int64_t{0}))),
            "Sampler: the state was saved with shuffle = false; this sampler has shuffle = true");
  EXPECT_EQ(refused(set("epoch", torch::tensor(int64_t{-1}))),
            "Sampler: the state's epoch = -1 is out of range: expected at least 0");
  EXPECT_EQ(refused(set("cursor", torch::tensor(int64_t{60001}))),
            "Sampler: the state's cursor = 60001 is out of range: expected 0 <= cursor <= dataset_size = 60000");

  // Integers of other widths are accepted.
  auto narrow = good;
  narrow["cursor"] = torch::tensor(12, torch::kInt32);
  s.check_state_dict(narrow);
  s.load_state_dict(narrow);
  EXPECT_EQ(s.cursor(), 12);
}

// A sampler of the job joins it when the program has not: here, started by nothing, a job of one.
TEST(Sampler, JoinsTheJobItselfWhenTheProgramDidNot) {
  if (shoal::is_initialized()) GTEST_SKIP() << "an earlier test in this process joined a job (ctest runs one per process)";
  Sampler s(10, {4});
  EXPECT_TRUE(shoal::is_initialized());
  EXPECT_EQ(s.world_size(), 1);
  EXPECT_EQ(s.batch(), (std::vector<size_t>{0, 1, 2, 3}));
}

// ----- The loader -----

// A small in-memory dataset: example i has data [i, -i] (float) and target i (int64).
class Rows : public torch::data::datasets::Dataset<Rows> {
 public:
  explicit Rows(int64_t n) : n_(n) {}
  torch::data::Example<> get(size_t i) override {
    const auto v = static_cast<float>(i);
    return {torch::tensor({v, -v}), torch::tensor(static_cast<int64_t>(i))};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n_); }

 private:
  int64_t n_;
};

template <typename Loader>
std::vector<torch::data::Example<>> all_batches(Loader& loader, int64_t epoch) {
  std::vector<torch::data::Example<>> batches;
  for (auto& batch : loader.epoch(epoch)) batches.push_back(batch);
  return batches;
}

void expect_same(const std::vector<torch::data::Example<>>& a, const std::vector<torch::data::Example<>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].data, b[i].data)) << "batch " << i;
    EXPECT_TRUE(torch::equal(a[i].target, b[i].target)) << "batch " << i;
  }
}

TEST(Loader, JobOfOneMatchesTorchSequentialLoader) {
  for (bool drop_last : {false, true})
    for (int64_t b : {1, 3, 4, 16}) {
      SCOPED_TRACE("drop_last " + std::to_string(drop_last) + " b " + std::to_string(b));
      auto plain = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
          Rows(10).map(torch::data::transforms::Stack<>()),
          torch::data::DataLoaderOptions().batch_size(b).drop_last(drop_last));
      std::vector<torch::data::Example<>> expected;
      for (auto& batch : *plain) expected.push_back(batch);

      shoal::data::LoaderOptions options;
      options.batch_size = b;
      options.last_batch = drop_last ? LastBatch::kDrop : LastBatch::kKeep;
      auto loader = shoal::data::make_loader(Rows(10), options, 0, 1);
      EXPECT_EQ(loader.batches_per_epoch(), static_cast<int64_t>(expected.size()));
      expect_same(all_batches(loader, 0), expected);
      expect_same(all_batches(loader, 1), expected);  // every epoch, without shuffle
    }
}

// With shuffle, W workers' batches, concatenated in rank order, are the job of one's batches.
TEST(Loader, WorkersTogetherMatchTheJobOfOne) {
  for (int64_t n : {23, 25}) {
    shoal::data::LoaderOptions options;
    options.batch_size = 8;
    options.shuffle = true;
    options.seed = 17;
    auto single = shoal::data::make_loader(Rows(n), options, 0, 1);
    const auto expected = all_batches(single, 2);
    std::vector<std::vector<torch::data::Example<>>> parts;
    for (int r = 0; r < 3; ++r) {
      auto loader = shoal::data::make_loader(Rows(n), options, r, 3);
      parts.push_back(all_batches(loader, 2));
      ASSERT_EQ(parts.back().size(), expected.size()) << "rank " << r;  // same number of steps
    }
    for (size_t k = 0; k < expected.size(); ++k) {
      std::vector<torch::Tensor> data, target;
      for (auto& part : parts) {
        EXPECT_EQ(part[k].data.dim(), 2);  // shares of 0 rows keep their shape: [0, 2]
        data.push_back(part[k].data);
        target.push_back(part[k].target);
      }
      EXPECT_TRUE(torch::equal(torch::cat(data), expected[k].data)) << "n " << n << " batch " << k;
      EXPECT_TRUE(torch::equal(torch::cat(target), expected[k].target)) << "n " << n << " batch " << k;
    }
  }
}

// A checkpoint taken in the loop's body, after the step, resumes with the next batch.
TEST(Loader, CheckpointBetweenStepsResumesWithTheNextBatch) {
  shoal::data::LoaderOptions options;
  options.batch_size = 4;
  options.shuffle = true;
  options.seed = 3;
  auto loader = shoal::data::make_loader(Rows(30), options, 1, 2);
  const auto whole = all_batches(loader, 6);
  shoal::data::SamplerState saved;
  int step = 0;
  for (auto& batch : loader.epoch(6)) {
    (void)batch;
    if (++step == 3) {
      saved = loader.sampler().state();
      break;
    }
  }
  auto resumed = shoal::data::make_loader(Rows(30), options, 1, 2);
  resumed.sampler().load_state(saved);
  expect_same(all_batches(resumed, 6), std::vector<torch::data::Example<>>(whole.begin() + 3, whole.end()));
}

TEST(Loader, CollatedDatasetsAndDatasetsWithoutTargets) {
  // A dataset mapped with Stack gives collated batches; the loader passes them on.
  auto stacked = shoal::data::make_loader(Rows(10).map(torch::data::transforms::Stack<>()), {3}, 0, 1);
  auto plain = shoal::data::make_loader(Rows(10), {3}, 0, 1);
  expect_same(all_batches(stacked, 0), all_batches(plain, 0));

  // The fast path: a BatchDataset answering get_batch with index_select. Worker 2 of 3 with
  // batches of 4 over 5 samples: shares 2, 1, 1, then 1, 0, 0.
  struct Gathered : torch::data::datasets::BatchDataset<Gathered, torch::data::Example<>> {
    torch::Tensor rows = torch::arange(10, torch::kFloat32).view({5, 2});
    torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
      const auto index = torch::tensor(std::vector<int64_t>(indices.begin(), indices.end()));
      return {rows.index_select(0, index), index};
    }
    torch::optional<size_t> size() const override { return 5; }
  };
  auto gathered = shoal::data::make_loader(Gathered(), {4}, 2, 3);
  const auto batches_of_2 = all_batches(gathered, 0);
  ASSERT_EQ(batches_of_2.size(), 2u);
  EXPECT_TRUE(torch::equal(batches_of_2[0].data, torch::tensor({{6.f, 7.f}})));
  EXPECT_TRUE(torch::equal(batches_of_2[0].target, torch::tensor({int64_t{3}})));
  EXPECT_EQ(batches_of_2[1].data.sizes(), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(batches_of_2[1].target.sizes(), (std::vector<int64_t>{0}));
  EXPECT_EQ(batches_of_2[1].target.scalar_type(), torch::kInt64);

  struct Unlabelled : torch::data::datasets::Dataset<Unlabelled, torch::data::TensorExample> {
    torch::data::TensorExample get(size_t i) override { return torch::full({2}, static_cast<float>(i)); }
    torch::optional<size_t> size() const override { return 5; }
  };
  auto loader = shoal::data::make_loader(Unlabelled(), {4, false, LastBatch::kPad}, 0, 1);
  std::vector<torch::Tensor> batches;
  for (auto& batch : loader.epoch(0)) batches.push_back(batch.data);
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_TRUE(torch::equal(batches[1].select(1, 0), torch::tensor({4.f, 0.f, 1.f, 2.f})));  // padded
}

TEST(Loader, BadInput) {
  EXPECT_EQ(error_of([] { shoal::data::make_loader(Rows(10), {0}, 0, 1); }),
            "Sampler: batch_size = 0 is out of range: expected at least 1");
  EXPECT_EQ(error_of([] { shoal::data::Loader<Rows>(Rows(10), Sampler(12, {4}, 0, 1)); }),
            "Loader: the sampler is for a dataset of 12 samples; this one has 10");
}

TEST(Loader, FashionMnist) {
  shoal::datasets::FashionMnist test(shoal::datasets::kFashionMnistRoot, shoal::datasets::FashionMnist::Split::kTest);
  const auto images = test.images();
  const auto labels = test.labels();
  shoal::data::LoaderOptions options;
  options.batch_size = 64;
  options.shuffle = true;
  options.seed = 1;
  auto loader = shoal::data::make_loader(test, options, 1, 2);
  EXPECT_EQ(loader.batches_per_epoch(), 157);  // ceil(10000 / 64)
  int taken = 0;
  for (auto& batch : loader.epoch(0)) {
    // Worker 1's half of the global batch: permutation positions [32k + 32, 32k + 64).
    const auto& p = loader.sampler().permutation();
    std::vector<int64_t> rows(p.begin() + 64 * taken + 32, p.begin() + 64 * taken + 64);
    const auto index = torch::tensor(rows);
    EXPECT_EQ(batch.data.sizes(), (std::vector<int64_t>{32, 1, 28, 28}));
    EXPECT_TRUE(torch::equal(batch.data, images.index_select(0, index)));
    EXPECT_TRUE(torch::equal(batch.target, labels.index_select(0, index)));
    if (++taken == 3) break;
  }
  EXPECT_EQ(taken, 3);
  EXPECT_EQ(loader.sampler().cursor(), 3 * 64);
}

// The overloads without rank and world size use the job's: real workers, each index once.
TEST(Loader, WorkersOfARealJob) {
  shoal::testing::run_workers(2, [] {
    shoal::data::LoaderOptions options;
    options.batch_size = 4;
    options.shuffle = true;
    auto loader = shoal::data::make_loader(Rows(21), options);
    std::vector<torch::Tensor> targets;
    for (auto& batch : loader.epoch(1)) targets.push_back(batch.target);
    auto all = shoal::world().all_gather(torch::cat(targets), {{11, 10}});
    EXPECT_TRUE(torch::equal(std::get<0>(all.sort()), torch::arange(21)));
  });
}

}  // namespace
