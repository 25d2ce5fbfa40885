// DataParallel against its oracle: the same training on one process over the concatenated
// global batch. Each worker starts from a different random model (DataParallel must broadcast
// the first worker's), trains on its shard, and ends with the reference's parameters.
#include <algorithm>
#include <csignal>
#include <cstdint>
#include <numeric>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compare.h"
#include "dp/replication.h"
#include "harness.h"
#include "shoal/data/torch_sampler.h"
#include "shoal/shoal.h"

namespace {

using shoal::testing::run_workers;

constexpr int64_t kIn = 6, kHidden = 8, kOut = 3, kPerWorker = 4, kSteps = 10;

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(bool with_norm = false, bool with_unused = false) {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    if (with_norm) norm = register_module("norm", torch::nn::BatchNorm1d(kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
    // Used only for batches whose first input is positive: on some workers, not others.
    gate = register_parameter("gate", torch::ones({kOut}));
    if (with_unused) unused = register_parameter("unused", torch::randn({5}));
  }
  torch::Tensor forward(torch::Tensor x, bool use_gate = false) {
    auto h = fc1(x);
    if (norm) h = norm(h);
    auto y = fc2(torch::tanh(h));
    return use_gate ? y * gate : y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::Tensor gate, unused;
};
TORCH_MODULE(Mlp);

// The global batches, the same on every worker: kSteps batches of n * kPerWorker samples.
std::pair<torch::Tensor, torch::Tensor> global_data(int n, int64_t per_worker = kPerWorker) {
  torch::manual_seed(1234);
  return {torch::randn({kSteps, n * per_worker, kIn}), torch::randint(kOut, {kSteps, n * per_worker})};
}

torch::Tensor loss_of(Mlp& net, const torch::Tensor& x, const torch::Tensor& y, bool gated) {
  return torch::nn::functional::cross_entropy(net->forward(x, gated), y);
}

// Largest |a - b| over largest |b|, across all parameters (or buffers).
using shoal::testing::relative_difference;

double relative_difference(Mlp& a, Mlp& b) { return relative_difference(a->parameters(), b->parameters()); }

enum class Optim { kSgd, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Mlp& net, Optim kind) {
  if (kind == Optim::kSgd) return std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  // Adam normalizes each component by its own history, so a component whose gradient is zero up
  // to rounding (summation order differs between the reference and the all-reduce) would step
  // by +-lr either way; an eps above that rounding keeps the comparison about the averaging.
  return std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01).eps(1e-4));
}

// Trains a reference on one process and the distributed model on this worker's shards, both for
// kSteps, and checks they agree. Shards use their own control flow (the gate) in both.
// With `with_unused`, the model also has a parameter no worker uses and one (the gate) that only
// the workers whose shard starts with a positive input use.
void train_and_compare(Optim kind, bool with_norm, bool with_unused, shoal::DataParallelOptions options = {}) {
  const int n = shoal::world_size(), r = shoal::rank();
  auto [x, y] = global_data(n);
  auto gated = [with_unused](const torch::Tensor& shard) { return with_unused && shard[0][0].item<float>() > 0; };

  torch::manual_seed(100);  // the first worker's model: what DataParallel broadcasts
  Mlp reference(with_norm, with_unused);
  torch::manual_seed(100 + r);  // every worker starts elsewhere
  Mlp net(with_norm, with_unused);
  shoal::DataParallel model(net, options);

  auto ref_opt = make_optimizer(reference, kind);
  auto opt = make_optimizer(net, kind);
  for (int64_t step = 0; step < kSteps; ++step) {
    // Reference: the mean over shards of each shard's mean loss, i.e. the global batch's mean.
    ref_opt->zero_grad();
    torch::Tensor total = torch::zeros({});
    std::vector<torch::Tensor> first_buffers;
    for (int w = 0; w < n; ++w) {
      auto shard_x = x[step].narrow(0, w * kPerWorker, kPerWorker);
      total = total + loss_of(reference, shard_x, y[step].narrow(0, w * kPerWorker, kPerWorker), gated(shard_x));
      if (w == 0) {
        for (auto& b : reference->buffers()) first_buffers.push_back(b.clone());
      }
    }
    (total / n).backward();
    ref_opt->step();
    // The first worker's buffers win (DataParallel broadcasts them after backward).
    {
      torch::NoGradGuard no_grad;
      auto buffers = reference->buffers();
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(first_buffers[i]);
    }

    opt->zero_grad();
    auto shard_x = x[step].narrow(0, r * kPerWorker, kPerWorker);
    loss_of(net, shard_x, y[step].narrow(0, r * kPerWorker, kPerWorker), gated(shard_x)).backward();
    opt->step();
  }
  EXPECT_LT(relative_difference(net, reference), 1e-5);
  if (with_norm) {
    std::vector<torch::Tensor> nb, rb;  // running mean and variance (num_batches_tracked is an integer)
    for (auto& b : net->buffers()) if (b.is_floating_point()) nb.push_back(b);
    for (auto& b : reference->buffers()) if (b.is_floating_point()) rb.push_back(b);
    EXPECT_LT(relative_difference(nb, rb), 1e-5);
    EXPECT_TRUE(torch::equal(net->norm->num_batches_tracked, reference->norm->num_batches_tracked));
  }
  if (with_unused) {
    if (options.find_unused_parameters) {
      // No worker used it: like a single process, its gradient was never set.
      EXPECT_FALSE(net->unused.grad().defined());
    } else {
      // Without the option it joins its bucket's average with a zero gradient (docs/dp.md).
      ASSERT_TRUE(net->unused.grad().defined());
      EXPECT_EQ(net->unused.grad().abs().max().item<float>(), 0.0f);
    }
  }
}

class Equivalence : public ::testing::TestWithParam<int> {};

TEST_P(Equivalence, Sgd) { run_workers(GetParam(), [] { train_and_compare(Optim::kSgd, false, false); }); }
TEST_P(Equivalence, Adam) { run_workers(GetParam(), [] { train_and_compare(Optim::kAdam, false, false); }); }
TEST_P(Equivalence, BatchNormBuffers) { run_workers(GetParam(), [] { train_and_compare(Optim::kSgd, true, false); }); }
TEST_P(Equivalence, UnusedParameters) {
  run_workers(GetParam(), [] {
    shoal::DataParallelOptions options;
    options.find_unused_parameters = true;
    train_and_compare(Optim::kAdam, false, true, options);
  });
}
TEST_P(Equivalence, UnusedParametersWithoutTheOptionDoNotHang) {
  // Without the option, parameters no worker used get a zero gradient instead of none. For SGD
  // with momentum that is the same step; Adam would count it as a step (see docs/dp.md).
  run_workers(GetParam(), [] { train_and_compare(Optim::kSgd, false, true); });
}
TEST_P(Equivalence, SmallBucketsManyCollectives) {
  run_workers(GetParam(), [] {
    shoal::DataParallelOptions options;
    options.bucket_bytes = 64;  // a bucket per parameter or two
    train_and_compare(Optim::kAdam, true, false, options);
  });
}

TEST_P(Equivalence, SeparateGradientTensors) {
  // gradient_as_bucket_view off: gradients are copied into buckets and the averages back.
  run_workers(GetParam(), [] {
    shoal::DataParallelOptions options;
    options.gradient_as_bucket_view = false;
    options.find_unused_parameters = true;
    train_and_compare(Optim::kSgd, true, true, options);
  });
}

TEST_P(Equivalence, GradientsAreSlicesOfTheirBuckets) {
  run_workers(GetParam(), [] {
    auto [x, y] = global_data(shoal::world_size());
    Mlp net(true, false);
    shoal::DataParallelOptions options;
    options.bucket_bytes = 200;  // several buckets
    shoal::DataParallel model(net, options);
    torch::optim::SGD opt(net->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      loss_of(net, x[step], y[step], true).backward();
      opt.step();
    }
    // Every parameter is in exactly one bucket, and the gradients of a bucket share its storage
    // and fill one range of it, which no other bucket's overlaps (the buckets of one dtype are
    // parts of one tensor: Note [Buckets in shared memory]).
    const auto assignment = model.bucket_assignment();
    auto params = net->parameters();
    std::vector<int> seen(params.size(), 0);
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    for (const auto& bucket : assignment) {
      ASSERT_FALSE(bucket.empty());
      uintptr_t begin = UINTPTR_MAX, end = 0;
      size_t bytes = 0;
      for (size_t k : bucket) {
        ++seen.at(k);
        const at::Tensor& grad = params[k].grad();
        EXPECT_TRUE(grad.storage().is_alias_of(params[bucket.front()].grad().storage())) << k;
        begin = std::min(begin, reinterpret_cast<uintptr_t>(grad.data_ptr()));
        end = std::max(end, reinterpret_cast<uintptr_t>(grad.data_ptr()) + grad.nbytes());
        bytes += grad.nbytes();
      }
      EXPECT_EQ(end - begin, bytes);
      for (const auto& [b, e] : ranges) EXPECT_TRUE(end <= b || begin >= e);
      ranges.emplace_back(begin, end);
    }
    EXPECT_EQ(seen, std::vector<int>(params.size(), 1));
    EXPECT_GT(assignment.size(), 1u);
  });
}

TEST_P(Equivalence, NoSyncAccumulationEqualsOneLargeBatch) {
  run_workers(GetParam(), [] {
    const int n = shoal::world_size(), r = shoal::rank();
    constexpr int kMicro = 4;
    auto [x, y] = global_data(n, kPerWorker * kMicro);
    torch::manual_seed(100);
    Mlp reference;
    torch::manual_seed(100 + r);
    Mlp net;
    shoal::DataParallel model(net);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(net->parameters(), 0.1);
    for (int64_t step = 0; step < 3; ++step) {
      ref_opt.zero_grad();
      loss_of(reference, x[step], y[step], false).backward();
      ref_opt.step();

      opt.zero_grad();
      // This worker's rows of the large batch, in kMicro micro-batches.
      const int64_t rows = kPerWorker * kMicro;
      for (int m = 0; m < kMicro; ++m) {
        auto xs = x[step].narrow(0, r * rows + m * kPerWorker, kPerWorker);
        auto ys = y[step].narrow(0, r * rows + m * kPerWorker, kPerWorker);
        if (m + 1 < kMicro) {
          auto guard = model.no_sync();
          (loss_of(net, xs, ys, false) / kMicro).backward();
        } else {
          (loss_of(net, xs, ys, false) / kMicro).backward();
        }
      }
      opt.step();
    }
    EXPECT_LT(relative_difference(net, reference), 1e-5);
  });
}

TEST_P(Equivalence, CompressionHooksStayClose) {
  run_workers(GetParam(), [] {
    for (auto hook : {shoal::dp::fp16_compress_hook(), shoal::dp::bf16_compress_hook()}) {
      const int n = shoal::world_size(), r = shoal::rank();
      auto [x, y] = global_data(n);
      torch::manual_seed(100);
      Mlp reference;
      torch::manual_seed(100 + r);
      Mlp net;
      shoal::DataParallelOptions options;
      options.comm_hook = hook;
      shoal::DataParallel model(net, options);
      torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(net->parameters(), 0.1);
      for (int64_t step = 0; step < kSteps; ++step) {
        ref_opt.zero_grad();
        loss_of(reference, x[step], y[step], false).backward();
        ref_opt.step();
        opt.zero_grad();
        loss_of(net, x[step].narrow(0, r * kPerWorker, kPerWorker), y[step].narrow(0, r * kPerWorker, kPerWorker), false)
            .backward();
        opt.step();
      }
      const double difference = relative_difference(net, reference);
      EXPECT_LT(difference, 1e-2);
      EXPECT_GT(difference, 0.0);  // the compression really happened
    }
  });
}

TEST_P(Equivalence, CompressedAveragesAgreeEverywhere) {
  run_workers(GetParam(), [] {
    const int n = shoal::world_size(), r = shoal::rank();
    auto group = shoal::world();
    for (auto [hook, tolerance] : {std::pair{shoal::dp::fp16_compress_hook(), 1e-3},
                                   std::pair{shoal::dp::bf16_compress_hook(), 1e-2}}) {
      // Sizes below the world size leave some members without a part; 1.5 MB spans chunks.
      for (int64_t count : {1, 2, 7, 1001, 400000}) {
        torch::manual_seed(7 + r);
        auto bucket = torch::rand({count}) + r;
        std::vector<torch::Tensor> all;
        for (int w = 0; w < n; ++w) {
          torch::manual_seed(7 + w);
          all.push_back(torch::rand({count}) + w);
        }
        auto expected = torch::stack(all).mean(0);
        hook(group, bucket).wait();
        EXPECT_LT((bucket - expected).abs().max().item<double>(), tolerance * n) << count;
        // Every member ends with the same values, bit for bit.
        auto gathered = group.all_gather(bucket.view({1, -1}));
        for (int w = 1; w < n; ++w) EXPECT_TRUE(torch::equal(gathered[w], gathered[0])) << count;
      }
    }
  });
}

// The same training over a group on Gloo's TCP path and over one on shared memory (docs/comm.md,
// "Shared memory among co-located workers") ends with the same parameters: the paths differ only
// in summation order. SHOAL_COMM=shm makes the second group fail rather than quietly take TCP.
void train_on_both_paths(shoal::DataParallelOptions options) {
  const int n = shoal::world_size(), r = shoal::rank();
  auto [x, y] = global_data(n);
  std::vector<int> everyone(n);
  std::iota(everyone.begin(), everyone.end(), 0);
  setenv("SHOAL_COMM", "tcp", 1);
  auto tcp = shoal::world().subgroup(everyone);
  setenv("SHOAL_COMM", "shm", 1);
  auto shm = shoal::world().subgroup(everyone);
  unsetenv("SHOAL_COMM");
  std::vector<std::vector<torch::Tensor>> results;
  for (auto& group : {tcp, shm}) {
    torch::manual_seed(100 + r);
    Mlp net(true, false);
    options.group = group;
    shoal::DataParallel model(net, options);
    // SGD: Adam divides each component by its own history, which magnifies a difference in the
    // last bit of a near-zero gradient (make_optimizer); the paths differ in exactly such bits.
    auto opt = make_optimizer(net, Optim::kSgd);
    for (int64_t step = 0; step < kSteps; ++step) {
      opt->zero_grad();
      auto shard_x = x[step].narrow(0, r * kPerWorker, kPerWorker);
      loss_of(net, shard_x, y[step].narrow(0, r * kPerWorker, kPerWorker), false).backward();
      opt->step();
    }
    results.push_back(net->parameters());
    for (auto& b : net->buffers()) {
      if (b.is_floating_point()) results.back().push_back(b);
    }
  }
  EXPECT_LT(relative_difference(results[1], results[0]), 1e-6);
}

TEST_P(Equivalence, SharedMemoryEqualsTcp) {
  run_workers(GetParam(), [] { train_on_both_paths({}); });
}

TEST_P(Equivalence, SharedMemoryEqualsTcpWithSmallBuckets) {
  run_workers(GetParam(), [] {
    shoal::DataParallelOptions options;
    options.bucket_bytes = 64;  // a bucket per parameter or two: many collectives in flight
    train_on_both_paths(options);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Equivalence, ::testing::Values(2, 3),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// ----- Uneven shares of the global batch -----
// The workers' gradients are weighed by their shares of each global batch (Note [Weighing
// gradients by batch share]), so whatever the cut the result is the one-process run's: 64
// samples over 3 workers are 22, 21, 21; a last batch of 1 gives shares 1, 0, 0; a batch of 2
// gives 1, 1, 0 at every step.

// Rows of x with targets y.
class Rows : public torch::data::datasets::Dataset<Rows> {
 public:
  Rows(torch::Tensor x, torch::Tensor y) : x_(std::move(x)), y_(std::move(y)) {}
  torch::data::Example<> get(size_t index) override { return {x_[index], y_[index]}; }
  c10::optional<size_t> size() const override { return static_cast<size_t>(x_.size(0)); }

 private:
  torch::Tensor x_, y_;
};

struct UnevenCase {
  int64_t samples;
  int64_t batch;
  std::string name;
};
void PrintTo(const UnevenCase& c, std::ostream* out) { *out << c.name; }

// kTorchLoaderPrefetching: torch's loader with two worker threads, which asks the sampler for
// batches ahead of the one the program trains on.
enum class Feed { kShoalLoader, kTorchLoader, kTorchLoaderPrefetching };

// Trains on one process over each global batch (the reference), and data parallel on this
// worker's share from `feed`, for 3 epochs of SGD with momentum; with `accumulate`, two batches
// per optimizer step (no_sync on the first); with `evaluate`, a second loader (5 evaluation
// samples a batch, cut 2, 2, 1) hands out a batch between each training forward and its
// backward, which the model evaluates. The oracle: the same parameters to 1e-5.
void train_on_uneven_shares(const UnevenCase& c, Feed feed, bool accumulate, bool evaluate = false) {
  constexpr int kEpochs = 3;
  torch::manual_seed(7);
  const auto x = torch::randn({c.samples, kIn});
  const auto y = torch::randint(kOut, {c.samples});
  shoal::data::SamplerOptions options;
  options.batch_size = c.batch;
  options.shuffle = true;

  torch::manual_seed(100);
  Mlp reference;
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  int64_t batches = 0;
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    shoal::data::Sampler whole(c.samples, options, 0, 1);  // the global batches, not a loader's
    whole.set_epoch(epoch);
    for (; !whole.epoch_done(); whole.advance(), ++batches) {
      if (!accumulate || batches % 2 == 0) ref_opt.zero_grad();
      const auto part = whole.batch();
      const auto index = torch::tensor(std::vector<int64_t>(part.begin(), part.end()));
      loss_of(reference, x.index_select(0, index), y.index_select(0, index), false).backward();
      if (!accumulate || batches % 2 == 1) ref_opt.step();
    }
  }

  torch::manual_seed(100 + shoal::rank());  // the first worker has the reference's start; DataParallel must broadcast it
  Mlp net;
  shoal::DataParallel model(net);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  shoal::data::SamplerOptions evaluation;
  evaluation.batch_size = 5;
  auto evaluation_loader = shoal::data::make_loader(Rows(torch::randn({5, kIn}), torch::randint(kOut, {5})), evaluation);
  int64_t step = 0;
  // The loss goes through the wrapper's forward, which sees the batch (Note [Weighing gradients
  // by batch share], dp/data_parallel.h).
  auto loss_through_model = [&](const torch::Tensor& data, const torch::Tensor& target) {
    auto loss = torch::nn::functional::cross_entropy(model(data, false), target);
    if (evaluate) {
      torch::NoGradGuard no_grad;
      for (auto& batch : evaluation_loader.epoch(step)) {
        model(batch.data, false);
        break;
      }
    }
    return loss;
  };
  auto train = [&](const torch::Tensor& data, const torch::Tensor& target) {
    if (!accumulate || step % 2 == 0) opt.zero_grad();
    if (accumulate && step % 2 == 0) {
      auto guard = model.no_sync();
      loss_through_model(data, target).backward();
    } else {
      loss_through_model(data, target).backward();
      opt.step();
    }
    ++step;
  };
  if (feed == Feed::kShoalLoader) {
    auto loader = shoal::data::make_loader(Rows(x, y), options);
    for (int epoch = 0; epoch < kEpochs; ++epoch) {
      for (auto& batch : loader.epoch(epoch)) train(batch.data, batch.target);
    }
  } else {
    const size_t workers = feed == Feed::kTorchLoaderPrefetching ? 2 : 0;
    auto loader = torch::data::make_data_loader<shoal::data::RandomSampler>(
        Rows(x, y).map(torch::data::transforms::Stack<>()),
        torch::data::DataLoaderOptions(c.batch).workers(workers));
    for (int epoch = 0; epoch < kEpochs; ++epoch) {
      for (auto& batch : *loader) train(batch.data, batch.target);
    }
  }
  EXPECT_EQ(step, batches);
  EXPECT_LT(relative_difference(net, reference), 1e-5);
}

class UnevenShares : public ::testing::TestWithParam<UnevenCase> {};

TEST_P(UnevenShares, ShoalLoaderEqualsOneProcess) {
  run_workers(3, [] { train_on_uneven_shares(GetParam(), Feed::kShoalLoader, false); });
}
TEST_P(UnevenShares, TorchLoaderWithShoalSamplerEqualsOneProcess) {
  run_workers(3, [] { train_on_uneven_shares(GetParam(), Feed::kTorchLoader, false); });
}
TEST_P(UnevenShares, NoSyncAccumulationEqualsOneProcess) {
  run_workers(3, [] { train_on_uneven_shares(GetParam(), Feed::kShoalLoader, true); });
}
// The share of the batch trained on, not of one torch's loader fetched ahead of it.
TEST_P(UnevenShares, PrefetchingTorchLoaderEqualsOneProcess) {
  run_workers(3, [] { train_on_uneven_shares(GetParam(), Feed::kTorchLoaderPrefetching, false); });
}
// The training batch's share, not the evaluation batch's handed out after its forward.
TEST_P(UnevenShares, EvaluationLoaderBesideTrainingEqualsOneProcess) {
  run_workers(3, [] { train_on_uneven_shares(GetParam(), Feed::kShoalLoader, false, true); });
}

INSTANTIATE_TEST_SUITE_P(Cuts, UnevenShares,
                         ::testing::Values(UnevenCase{64, 64, "s64_b64_22_21_21"},
                                           UnevenCase{65, 64, "s65_b64_last_1_0_0"},
                                           UnevenCase{10, 2, "s10_b2_1_1_0"}),
                         [](const auto& info) { return info.param.name; });

// The equal-weight average of PyTorch's DDP stays available, and differs from one process when
// the shares are uneven: what the weights correct.
TEST(DataParallel, EqualWeightsWhenAskedDifferFromOneProcessOnUnevenShares) {
  run_workers(3, [] {
    torch::manual_seed(7);
    const auto x = torch::randn({64, kIn});
    const auto y = torch::randint(kOut, {64});
    torch::manual_seed(100);
    Mlp reference, net;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < net->parameters().size(); ++i) net->parameters()[i].copy_(reference->parameters()[i]);
    }
    shoal::DataParallelOptions options;
    options.weigh_by_batch_share = false;
    shoal::DataParallel model(net, options);
    shoal::data::SamplerOptions sampling;
    sampling.batch_size = 64;
    auto loader = shoal::data::make_loader(Rows(x, y), sampling);
    for (auto& batch : loader.epoch(0)) loss_of(net, batch.data, batch.target, false).backward();
    loss_of(reference, x, y, false).backward();
    std::vector<torch::Tensor> grads, ref_grads;  // of the linears: the gate is unused here
    for (auto* layer : {&net->fc1, &net->fc2}) {
      for (auto& p : (*layer)->parameters()) grads.push_back(p.grad());
    }
    for (auto* layer : {&reference->fc1, &reference->fc2}) {
      for (auto& p : (*layer)->parameters()) ref_grads.push_back(p.grad());
    }
    EXPECT_GT(relative_difference(grads, ref_grads), 1e-4);
  });
}

TEST(DataParallel, MismatchedModelsRaiseOnEveryWorker) {
  run_workers(3, [] {
    auto net = std::make_shared<torch::nn::LinearImpl>(shoal::rank() == 2 ? 5 : 4, 3);
    auto start = std::chrono::steady_clock::now();
    try {
      shoal::DataParallel model(net);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "DataParallel: the model differs across workers: parameter 'weight' has shape [3, 4] (Float) on "
                   "worker 0 but [3, 5] (Float) on worker 2; expected the same parameters and buffers, in the same "
                   "order, everywhere");
    }
    // A failure bound: far below the 60 s a worker waiting on the others would take.
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  });
}

// A backward counts as synchronized (the elastic commit's sign that the optimizer may have
// stepped, Note [Commits without copies]) only when every collective of it returned. Here the
// first worker dies right after its bucket's all-reduce completed, before the first backward's
// rebuild broadcast (from it): the second worker's all-reduce completes, its broadcast fails, and
// its parameters, which no step changed, must not look changed. On both paths.
TEST(DataParallel, ABackwardThatFailsAfterItsAllReduceIsNotCountedAsSynchronized) {
  for (const std::string path : {"shm", "tcp"}) {
    SCOPED_TRACE("SHOAL_COMM=" + path);
    shoal::testing::WorkersOptions options;
    options.env["SHOAL_COMM"] = path;
    options.may_fail = {0};
    const auto exits = run_workers(2, [] {
      auto [x, y] = global_data(2);
      Mlp net;
      shoal::DataParallelOptions dp;
      dp.comm_hook = [average = shoal::dp::allreduce_hook()](shoal::comm::Group& group, at::Tensor& bucket) {
        auto work = average(group, bucket);
        if (shoal::rank() == 0) {
          work.wait();
          ::raise(SIGKILL);
        }
        return work;
      };
      shoal::DataParallel model(net, dp);
      const auto replication = shoal::dp::replication_of(net->fc1->weight);
      ASSERT_NE(replication, nullptr);
      const uint64_t before = replication->synchronized_backwards();
      try {
        loss_of(net, x[0].narrow(0, shoal::rank() * kPerWorker, kPerWorker),
                y[0].narrow(0, shoal::rank() * kPerWorker, kPerWorker), false)
            .backward();
        ADD_FAILURE() << "expected CommError: the first worker died before the broadcast";
      } catch (const shoal::CommError& e) {
        EXPECT_NE(std::string(e.what()).find("worker 0"), std::string::npos) << e.what();
      }
      EXPECT_EQ(replication->synchronized_backwards(), before);
    }, options);
    if (shoal::testing::is_worker()) continue;  // a worker of the other path's call
    ASSERT_EQ(exits.size(), 2u);
    EXPECT_EQ(exits[0].signal, SIGKILL) << exits[0].output;
    EXPECT_EQ(exits[1].exit_code, 0) << exits[1].output;
  }
}

TEST(DataParallel, AJobOfOneIsPlainTraining) {
  shoal::testing::WorkersOptions options;
  options.launcher = shoal::testing::Launcher::kNone;
  run_workers(1, [] {
    auto [x, y] = global_data(1);
    torch::manual_seed(0);
    Mlp reference;
    torch::manual_seed(0);
    Mlp net;
    shoal::DataParallel model(net);
    EXPECT_TRUE(model.bucket_assignment().empty());
    torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(net->parameters(), 0.1);
    for (int64_t step = 0; step < kSteps; ++step) {
      ref_opt.zero_grad();
      loss_of(reference, x[step], y[step], false).backward();
      ref_opt.step();
      opt.zero_grad();
      loss_of(net, x[step], y[step], false).backward();
      opt.step();
    }
    EXPECT_EQ(relative_difference(net, reference), 0.0);
  }, options);
}

}  // namespace
