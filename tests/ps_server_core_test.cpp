// The parameter server's core without the network (docs/ps.md, "Consistency"): the clocks of
// sync / backup workers / bounded staleness / async with threads as workers, against one
// process; bad requests; snapshots per virtual shard.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "error_of.h"
#include "ps/ledger.h"
#include "ps/optimizer.h"
#include "ps/server_core.h"
#include "ps/shard_map.h"
#include "ps/shm.h"
#include "ps/table.h"
#include "ps_support.h"
#include "shoal/core/error.h"

namespace {

using namespace shoal::ps::detail;
using shoal::CommError;
using shoal::Duration;
using shoal::UsageError;
using Ms = std::chrono::milliseconds;
using shoal::testing::dense_spec;
using shoal::testing::error_of;
using shoal::testing::near_relative;
using shoal::testing::sparse_spec;
using shoal::testing::to_vector;

constexpr auto kGenerous = Ms(60000);  // a failure bound for waits that should succeed

// ---------------------------------------------------------------------------------------------
// The server core: several cores stand for several servers; the test routes each chunk and row
// to its owner by the shard map, as the client does, and pushes to every server every step.

int64_t numel_of(const TableSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape) n *= d;
  return n;
}

class Cluster {
 public:
  Cluster(int32_t servers, const ServerCoreOptions& base, std::vector<TableSpec> tables)
      : map_(servers), tables_(std::move(tables)) {
    for (int32_t s = 0; s < servers; ++s) {
      auto options = base;
      options.shards = map_.shards_of(s);
      cores_.push_back(std::make_unique<ServerCore>(options));
    }
  }
  ServerCore& core(int32_t s) { return *cores_[static_cast<size_t>(s)]; }
  int32_t servers() const { return map_.servers(); }
  int32_t owner_of_chunk(int32_t table, int64_t chunk) const {
    return map_.owner(chunk_shard(tables_[static_cast<size_t>(table)].name, chunk));
  }
  int32_t owner_of_row(int32_t table, int64_t id) const {
    return map_.owner(row_shard(tables_[static_cast<size_t>(table)].name, id));
  }

  // `initial`: every dense table's values, whole; each server gets its chunks.
  void register_worker(int32_t worker, const std::map<int32_t, std::vector<float>>& initial) {
    for (int32_t s = 0; s < servers(); ++s) {
      RegisterRequest request;
      request.worker = worker;
      request.tables = tables_;
      request.initial = dense_for(s, initial);
      core(s).register_tables(request, shoal::Deadline(kGenerous));
    }
  }

  // Dense tables whole, and the rows `rows[table]` (in that order).
  struct Values {
    std::map<int32_t, std::vector<float>> dense;
    std::map<int32_t, std::vector<float>> rows;
  };
  Values pull(int32_t worker, int64_t clock, const std::map<int32_t, std::vector<int64_t>>& rows,
              Duration timeout) {
    Values out;
    std::map<int32_t, std::vector<float>> want_dense;
    for (size_t t = 0; t < tables_.size(); ++t)
      if (!tables_[t].sparse) want_dense[static_cast<int32_t>(t)] = {};
    for (const auto& [t, ids] : rows)
      out.rows[t].resize(ids.size() *
                         static_cast<size_t>(tables_[static_cast<size_t>(t)].shape[1]));
    for (const auto& [t, values] : want_dense)
      out.dense[t].resize(static_cast<size_t>(numel_of(tables_[static_cast<size_t>(t)])));
    for (int32_t s = 0; s < servers(); ++s) {
      PullRequest request;
      request.worker = worker;
      request.clock = clock;
      for (auto& slice : dense_for(s, want_dense)) request.dense.push_back(std::move(slice));
      std::map<int32_t, std::vector<size_t>> positions;
      for (const auto& [t, ids] : rows) {
        SparseSlice slice{t, {}, {}};
        for (size_t k = 0; k < ids.size(); ++k)
          if (owner_of_row(t, ids[k]) == s) {
            slice.ids.push_back(ids[k]);
            positions[t].push_back(k);
          }
        request.sparse.push_back(std::move(slice));
      }
      const PullReply reply = core(s).pull(request, shoal::Deadline(timeout));
      for (const auto& slice : reply.dense) {
        const int64_t numel = numel_of(tables_[static_cast<size_t>(slice.table)]);
        const float* src = slice.values.data();
        for (int64_t chunk : slice.chunks) {
          std::copy(src, src + chunk_length(numel, chunk),
                    out.dense[slice.table].begin() + chunk_begin(chunk));
          src += chunk_length(numel, chunk);
        }
      }
      for (const auto& slice : reply.sparse) {
        const int64_t dim = tables_[static_cast<size_t>(slice.table)].shape[1];
        for (size_t k = 0; k < slice.ids.size(); ++k)
          std::copy(slice.values.begin() + static_cast<int64_t>(k) * dim,
                    slice.values.begin() + static_cast<int64_t>(k + 1) * dim,
                    out.rows[slice.table].begin() +
                        static_cast<int64_t>(positions[slice.table][k]) * dim);
      }
    }
    return out;
  }

  // Gradients: dense tables whole; rows[table] = (unique ids, their gradients).
  std::vector<PushReply> push(
      int32_t worker, int64_t clock, int64_t samples,
      const std::map<int32_t, std::vector<float>>& dense,
      const std::map<int32_t, std::pair<std::vector<int64_t>, std::vector<float>>>& rows) {
    std::vector<PushReply> replies;
    for (int32_t s = 0; s < servers(); ++s) {
      PushRequest request;
      request.worker = worker;
      request.clock = clock;
      request.rows = samples;
      request.dense = dense_for(s, dense);
      for (const auto& [t, slice_in] : rows) {
        const int64_t dim = tables_[static_cast<size_t>(t)].shape[1];
        SparseSlice slice{t, {}, {}};
        for (size_t k = 0; k < slice_in.first.size(); ++k)
          if (owner_of_row(t, slice_in.first[k]) == s) {
            slice.ids.push_back(slice_in.first[k]);
            slice.values.insert(slice.values.end(),
                                slice_in.second.begin() + static_cast<int64_t>(k) * dim,
                                slice_in.second.begin() + static_cast<int64_t>(k + 1) * dim);
          }
        request.sparse.push_back(std::move(slice));
      }
      replies.push_back(core(s).push(request, shoal::Deadline(Ms(0))));
    }
    return replies;
  }

  size_t row_count() {
    size_t n = 0;
    for (auto& c : cores_) n += c->row_count();
    return n;
  }

 private:
  // The chunks of each dense table in `whole` that server s holds, with their values if any.
  std::vector<DenseSlice> dense_for(int32_t s,
                                    const std::map<int32_t, std::vector<float>>& whole) const {
    std::vector<DenseSlice> out;
    for (const auto& [t, values] : whole) {
      const int64_t numel = numel_of(tables_[static_cast<size_t>(t)]);
      DenseSlice slice{t, {}, {}};
      for (int64_t c = 0; c < chunk_count(numel); ++c) {
        if (owner_of_chunk(t, c) != s) continue;
        slice.chunks.push_back(c);
        if (!values.empty())
          slice.values.insert(slice.values.end(), values.begin() + chunk_begin(c),
                              values.begin() + chunk_begin(c) + chunk_length(numel, c));
      }
      out.push_back(std::move(slice));
    }
    return out;
  }

  ShardMap map_;
  std::vector<TableSpec> tables_;
  std::vector<std::unique_ptr<ServerCore>> cores_;
};

// Runs body(worker) on `workers` threads; rethrows the first failure.
void run_threads(int workers, const std::function<void(int32_t)>& body) {
  std::vector<std::thread> threads;
  std::mutex mutex;
  std::exception_ptr failure;
  for (int32_t w = 0; w < workers; ++w)
    threads.emplace_back([&, w] {
      try {
        body(w);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failure) failure = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
}

// The model of the sync test: out = fc2(tanh(fc1(x))) + sum of the embedding rows of ids, with a
// fc1 of two chunks (300 x 256 > 64 Ki elements); tables 0-3 dense, table 4 sparse.
constexpr int64_t kIn = 256, kHidden = 300, kOut = 4, kRows = 20, kTouchable = 15, kIds = 2;
constexpr int kWorkers = 3, kSyncSteps = 4;
const int64_t kBatch[kWorkers] = {3, 5, 4};

struct Batch {
  torch::Tensor x, ids, y;
};

std::vector<TableSpec> model_tables(const OptimizerSpec& optimizer) {
  std::vector<TableSpec> tables = {dense_spec("fc1.weight", {kHidden, kIn}, optimizer),
                                   dense_spec("fc1.bias", {kHidden}, optimizer),
                                   dense_spec("fc2.weight", {kOut, kHidden}, optimizer),
                                   dense_spec("fc2.bias", {kOut}, optimizer)};
  tables.push_back(sparse_spec("emb", kRows, kOut, {InitSpec::Kind::kNormal, 0, 0.1}, optimizer));
  return tables;
}

// The mean loss of the model and its gradients with respect to `params` (dense tables in order,
// then the rows of `rows`, looked up by `local_ids`).
torch::Tensor model_loss(const std::vector<torch::Tensor>& p, const torch::Tensor& rows,
                         const torch::Tensor& local_ids, const Batch& b) {
  auto h = torch::tanh(torch::nn::functional::linear(b.x, p[0], p[1]));
  auto out =
      torch::nn::functional::linear(h, p[2], p[3]) + torch::embedding(rows, local_ids).sum(1);
  return torch::mse_loss(out, b.y);
}

torch::Tensor from(const std::vector<float>& values, std::vector<int64_t> shape) {
  return torch::tensor(values).reshape(shape).clone();
}

// Runs the model in sync on `servers` servers with 3 threads as workers; returns every dense
// table and every row of the embedding, pulled at the end.
std::vector<std::vector<float>> train_on_servers(
    int32_t servers, const OptimizerSpec& optimizer, const std::vector<std::vector<Batch>>& data,
    const std::map<int32_t, std::vector<float>>& initial, size_t* rows_in_memory) {
  ServerCoreOptions options;
  options.workers = {0, 1, 2};
  const auto tables = model_tables(optimizer);
  Cluster cluster(servers, options, tables);
  for (int32_t w = 0; w < kWorkers; ++w)
    cluster.register_worker(w, w == 0 ? initial : decltype(initial){});
  run_threads(kWorkers, [&](int32_t w) {
    for (int64_t step = 0; step < kSyncSteps; ++step) {
      const Batch& b = data[static_cast<size_t>(step)][static_cast<size_t>(w)];
      auto flat = b.ids.reshape({-1});
      auto [unique, inverse] = torch::_unique(flat, /*sorted=*/true, /*return_inverse=*/true);
      std::vector<int64_t> ids(unique.data_ptr<int64_t>(),
                               unique.data_ptr<int64_t>() + unique.numel());
      auto values = cluster.pull(w, step, {{4, ids}}, kGenerous);
      std::vector<torch::Tensor> p;
      for (int32_t t = 0; t < 4; ++t)
        p.push_back(
            from(values.dense[t], tables[static_cast<size_t>(t)].shape).requires_grad_(true));
      auto rows =
          from(values.rows[4], {static_cast<int64_t>(ids.size()), kOut}).requires_grad_(true);
      model_loss(p, rows, inverse.reshape(b.ids.sizes()), b).backward();
      std::map<int32_t, std::vector<float>> dense;
      for (int32_t t = 0; t < 4; ++t) dense[t] = to_vector(p[static_cast<size_t>(t)].grad());
      std::map<int32_t, std::pair<std::vector<int64_t>, std::vector<float>>> sparse;
      sparse[4] = {ids, to_vector(rows.grad())};
      cluster.push(w, step, b.x.size(0), dense, sparse);
    }
  });
  std::vector<int64_t> all(kRows);
  for (int64_t i = 0; i < kRows; ++i) all[static_cast<size_t>(i)] = i;
  auto values = cluster.pull(0, kSyncSteps, {{4, all}}, kGenerous);
  *rows_in_memory = cluster.row_count();
  std::vector<std::vector<float>> out;
  for (int32_t t = 0; t < 4; ++t) out.push_back(values.dense[t]);
  out.push_back(values.rows[4]);
  return out;
}

TEST(PsServerCore, SyncEqualsOneProcessOnTheConcatenatedBatch) {
  using K = OptimizerSpec::Kind;
  // Adam's and Adagrad's first steps divide a gradient by its own magnitude, so a near-zero
  // gradient element's rounding (the oracle sums 12 samples in float, the servers 3 workers'
  // sums in double) changes the update by up to lr / eps times that rounding. eps and the initial
  // accumulator keep lr / eps near 1, so that 1e-5 compares the aggregation, not the rounding.
  OptimizerSpec sgd, adagrad, adam;
  sgd.kind = K::kSgd, sgd.lr = 0.05, sgd.momentum = 0.9, sgd.weight_decay = 1e-3;
  adagrad.kind = K::kAdagrad, adagrad.lr = 0.05, adagrad.lr_decay = 0.01;
  adagrad.initial_accumulator_value = 0.1;
  adam.kind = K::kAdam, adam.lr = 0.01, adam.eps = 1e-2;
  torch::manual_seed(11);
  std::vector<std::vector<Batch>> data(kSyncSteps);
  for (auto& step : data)
    for (int w = 0; w < kWorkers; ++w)
      step.push_back({torch::randn({kBatch[w], kIn}),
                      torch::randint(0, kTouchable, {kBatch[w], kIds}),
                      torch::randn({kBatch[w], kOut})});
  std::map<int32_t, std::vector<float>> initial;
  std::vector<torch::Tensor> start = {
      torch::randn({kHidden, kIn}) * 0.05, torch::randn({kHidden}) * 0.05,
      torch::randn({kOut, kHidden}) * 0.05, torch::randn({kOut}) * 0.05};
  for (int32_t t = 0; t < 4; ++t) initial[t] = to_vector(start[static_cast<size_t>(t)]);

  for (const auto& [name, optimizer] :
       {std::make_pair("sgd", sgd), std::make_pair("adagrad", adagrad),
        std::make_pair("adam", adam)}) {
    SCOPED_TRACE(name);
    // The oracle: one process on the concatenated batches, torch::optim for the dense tables and
    // the row-wise rule (checked against PyTorch above) on the rows the global batch touched.
    std::vector<torch::Tensor> p;
    for (auto& t : start) p.push_back(t.clone().requires_grad_(true));
    const auto tables = model_tables(optimizer);
    std::vector<float> emb(static_cast<size_t>(kRows * kOut));
    for (int64_t i = 0; i < kRows; ++i) initial_row(tables[4], i, emb.data() + i * kOut, kOut);
    std::vector<float> emb_state(static_cast<size_t>(kRows * kOut * state_width(optimizer)));
    std::vector<int64_t> emb_steps(kRows, 0);
    for (int64_t i = 0; i < kRows; ++i)
      init_state(optimizer, emb_state.data() + i * kOut * state_width(optimizer), kOut);
    std::unique_ptr<torch::optim::Optimizer> torch_optimizer;
    if (optimizer.kind == K::kSgd)
      torch_optimizer = std::make_unique<torch::optim::SGD>(
          p,
          torch::optim::SGDOptions(sgd.lr).momentum(sgd.momentum).weight_decay(sgd.weight_decay));
    else if (optimizer.kind == K::kAdagrad)
      torch_optimizer = std::make_unique<torch::optim::Adagrad>(
          p, torch::optim::AdagradOptions(adagrad.lr)
                 .lr_decay(adagrad.lr_decay)
                 .initial_accumulator_value(adagrad.initial_accumulator_value)
                 .eps(adagrad.eps));
    else
      torch_optimizer = std::make_unique<torch::optim::Adam>(
          p, torch::optim::AdamOptions(adam.lr).betas({adam.beta1, adam.beta2}).eps(adam.eps));
    for (int step = 0; step < kSyncSteps; ++step) {
      std::vector<torch::Tensor> xs, ids, ys;
      for (const auto& b : data[static_cast<size_t>(step)])
        xs.push_back(b.x), ids.push_back(b.ids), ys.push_back(b.y);
      const Batch global{torch::cat(xs), torch::cat(ids), torch::cat(ys)};
      auto table = from(emb, {kRows, kOut}).requires_grad_(true);
      torch_optimizer->zero_grad();
      model_loss(p, table, global.ids, global).backward();
      torch_optimizer->step();
      const auto grad = to_vector(table.grad());
      auto touched = std::get<0>(torch::_unique(global.ids.reshape({-1}), true));
      for (int64_t k = 0; k < touched.numel(); ++k) {
        const int64_t i = touched[k].item<int64_t>();
        apply_row(optimizer, emb.data() + i * kOut,
                  emb_state.data() + i * kOut * state_width(optimizer),
                  emb_steps[static_cast<size_t>(i)], grad.data() + i * kOut, kOut);
      }
    }
    std::vector<std::vector<float>> first;
    for (int32_t servers : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(servers) + " servers");
      size_t rows_in_memory = 0;
      auto got = train_on_servers(servers, optimizer, data, initial, &rows_in_memory);
      for (int32_t t = 0; t < 4; ++t)
        EXPECT_TRUE(
            near_relative(got[static_cast<size_t>(t)], to_vector(p[static_cast<size_t>(t)]), 1e-5))
            << tables[static_cast<size_t>(t)].name;
      EXPECT_TRUE(near_relative(got[4], emb, 1e-5)) << "emb";
      // Rows no batch touched are their initial values, bit for bit, and were never stored.
      size_t touched_rows = 0;
      for (int64_t i = 0; i < kRows; ++i) {
        if (emb_steps[static_cast<size_t>(i)] > 0) {
          ++touched_rows;
          continue;
        }
        std::vector<float> expected(kOut);
        initial_row(tables[4], i, expected.data(), kOut);
        for (int64_t j = 0; j < kOut; ++j)
          EXPECT_EQ(got[4][static_cast<size_t>(i * kOut + j)], expected[static_cast<size_t>(j)])
              << "row " << i;
      }
      EXPECT_LT(touched_rows, static_cast<size_t>(kRows));
      EXPECT_EQ(rows_in_memory, touched_rows);
      if (first.empty())
        first = got;
      else
        EXPECT_EQ(got, first) << "the result depends on the number of servers";
    }
  }
}

// A one-table server for the clock tests: "w" of 8 floats, SGD with lr 1, so a value is its
// start minus the sum of the gradients applied.
struct Small {
  // `mode`: the registering worker's (RegisterRequest::mode; empty: the server's).
  explicit Small(ServerCoreOptions options, int32_t workers = 3, const std::string& mode = "") {
    for (int32_t w = 0; w < workers; ++w) options.workers.push_back(w);
    options.shards = ShardMap(1).shards_of(0);
    core = std::make_unique<ServerCore>(options);
    OptimizerSpec sgd;
    sgd.lr = 1;
    RegisterRequest request;
    request.tables = {dense_spec("w", {8}, sgd),
                      sparse_spec("emb", 100, 4, {InitSpec::Kind::kUniform, -1, 1}, sgd)};
    request.initial = {DenseSlice{0, {0}, std::vector<float>(8, 1.f)}};
    request.mode = mode;
    core->register_tables(request, shoal::Deadline(Ms(0)));
  }
  PullReply pull(int32_t worker, int64_t clock, Duration timeout) {
    PullRequest request;
    request.worker = worker;
    request.clock = clock;
    request.dense = {DenseSlice{0, {0}, {}}};
    return core->pull(request, shoal::Deadline(timeout));
  }
  PushReply push(int32_t worker, int64_t clock, float grad, int64_t rows = 1) {
    PushRequest request;
    request.worker = worker;
    request.clock = clock;
    request.rows = rows;
    request.dense = {DenseSlice{0, {0}, std::vector<float>(8, grad)}};
    return core->push(request, shoal::Deadline(Ms(0)));
  }
  float value() { return pull(0, 0, Ms(0)).dense[0].values[0]; }
  std::unique_ptr<ServerCore> core;
};

TEST(PsServerCore, BoundedStalenessKeepsTheGapWithinTheBound) {
  for (int64_t bound : {1, 2}) {
    SCOPED_TRACE("staleness " + std::to_string(bound));
    ServerCoreOptions options;
    options.consistency = Consistency::kBoundedStaleness;
    options.staleness = bound;
    Small server(options);
    constexpr int64_t kSteps = 8;
    std::mutex mutex;
    std::vector<std::pair<int64_t, int64_t>> trace;  // (clock of the pull, slowest clock then)
    run_threads(kWorkers, [&](int32_t w) {
      for (int64_t c = 0; c < kSteps; ++c) {
        if (w == 2) {
          // The slow worker lets worker 0 run as far ahead as the bound allows before each step.
          const int64_t ahead = std::min(c + bound + 1, kSteps);
          shoal::Deadline deadline(kGenerous);
          while (server.core->clock_of(0) < ahead && !deadline.expired())
            std::this_thread::sleep_for(Ms(1));
        }
        server.pull(w, c, kGenerous);
        int64_t slowest = INT64_MAX;
        for (int32_t v = 0; v < kWorkers; ++v)
          slowest = std::min(slowest, server.core->clock_of(v));
        {
          std::lock_guard<std::mutex> lock(mutex);
          trace.emplace_back(c, slowest);
        }
        server.push(w, c, 0.01f);
      }
    });
    int64_t widest = 0;
    for (const auto& [clock, slowest] : trace) {
      EXPECT_LE(clock - slowest, bound)
          << "a pull at clock " << clock << " ran with the slowest at " << slowest;
      widest = std::max(widest, clock - slowest);
    }
    EXPECT_EQ(widest, bound) << "the slow worker let the fast one reach the bound";
    EXPECT_EQ(trace.size(), static_cast<size_t>(kWorkers * kSteps));
    EXPECT_EQ(server.core->staleness(), 0);
    EXPECT_NEAR(server.value(), 1 - kWorkers * kSteps * 0.01f, 1e-5);
  }
}

TEST(PsServerCore, AStoppedWorkerBlocksTheOthersAfterTheBound) {
  for (int64_t bound : {0, 1, 2}) {
    SCOPED_TRACE("staleness " + std::to_string(bound));
    ServerCoreOptions options;
    options.consistency = Consistency::kBoundedStaleness;
    options.staleness = bound;
    Small server(options);
    // Worker 2 never pushes; 0 and 1 run until their pull times out.
    std::vector<int64_t> steps(2, 0);
    std::vector<std::string> errors(2);
    std::vector<double> waited(2, 0);
    run_threads(2, [&](int32_t w) {
      for (int64_t c = 0;; ++c) {
        const auto start = std::chrono::steady_clock::now();
        try {
          server.pull(w, c, Ms(1000));
        } catch (const CommError& e) {
          waited[static_cast<size_t>(w)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          errors[static_cast<size_t>(w)] = e.what();
          return;
        }
        server.push(w, c, 0.01f);
        steps[static_cast<size_t>(w)] = c + 1;
      }
    });
    for (int w = 0; w < 2; ++w) {
      EXPECT_EQ(steps[static_cast<size_t>(w)], bound + 1);
      EXPECT_GE(waited[static_cast<size_t>(w)], 0.99);
      EXPECT_LT(waited[static_cast<size_t>(w)], 10.0);  // a generous failure bound
      const std::string& e = errors[static_cast<size_t>(w)];
      EXPECT_NE(e.find("pull of worker " + std::to_string(w) + " at clock " +
                       std::to_string(bound + 1) + " timed out after 1"),
                std::string::npos)
          << e;
      if (bound == 0)  // sync: waits for the step
        EXPECT_NE(e.find("waiting for step 0 to be applied (pushed by workers 0, 1; waiting for "
                         "workers 2 at clock 0)"),
                  std::string::npos)
            << e;
      else
        EXPECT_NE(e.find("every live worker to reach clock 1 (staleness bound " +
                         std::to_string(bound) + "; waiting for workers 2 at clock 0)"),
                  std::string::npos)
            << e;
    }
    EXPECT_EQ(server.core->staleness(), bound == 0 ? 1 : bound + 1);
  }
}

TEST(PsServerCore, AsyncNeverWaits) {
  ServerCoreOptions options;
  options.consistency = Consistency::kAsync;
  Small server(options);
  constexpr int64_t kSteps = 20;
  // Worker 2 never pushes; a zero timeout would fail any pull that had to wait.
  run_threads(2, [&](int32_t w) {
    for (int64_t c = 0; c < kSteps; ++c) {
      server.pull(w, c, Ms(0));
      server.push(w, c, w == 0 ? 0.01f : 0.02f);
    }
  });
  EXPECT_EQ(server.core->staleness(), kSteps);
  EXPECT_EQ(server.core->step(), 2 * kSteps);
  EXPECT_NEAR(server.value(), 1 - kSteps * 0.03f, 1e-5);
}

// Note [The mode comes with the workers]: a server started without a mode trains in the first
// registration's, and refuses a worker that names another, or that a fixed mode does not allow.
TEST(PsServerCore, TheModeComesWithTheWorkersRegistration) {
  ServerCoreOptions from_workers;
  from_workers.mode_from_workers = true;
  // Worker 0 asks for async: its pull two steps ahead of workers 1 and 2, which never push,
  // is answered at once (a zero timeout fails a pull that has to wait).
  Small async(from_workers, 3, "async");
  async.push(0, 0, 0.5f);
  EXPECT_NO_THROW(async.pull(0, 1, Ms(0)));
  // Worker 0 asks for sync: the same pull waits for the others' pushes of step 0.
  Small sync(from_workers, 3, "sync");
  sync.push(0, 0, 0.5f);
  EXPECT_THROW(sync.pull(0, 1, Ms(0)), shoal::CommError);

  OptimizerSpec sgd;
  sgd.lr = 1;
  RegisterRequest other;
  other.worker = 1;
  other.tables = {dense_spec("w", {8}, sgd),
                  sparse_spec("emb", 100, 4, {InitSpec::Kind::kUniform, -1, 1}, sgd)};
  other.mode = "ssp:0";  // bounded staleness 0 is sync
  EXPECT_NO_THROW(sync.core->register_tables(other, shoal::Deadline(Ms(0))));
  other.mode = "async";
  try {
    sync.core->register_tables(other, shoal::Deadline(Ms(0)));
    ADD_FAILURE() << "a worker in another mode was not refused";
  } catch (const shoal::UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "parameter server: worker 1 trains in mode async, worker 0 in sync; expected one "
              "mode for the whole job (ps::ServerOptions::mode, or SHOAL_PS_MODE)");
  }

  // A server started in a mode refuses workers of another.
  ServerCoreOptions fixed;
  fixed.consistency = Consistency::kBoundedStaleness;
  fixed.staleness = 2;
  EXPECT_NO_THROW(Small(fixed, 3, "ssp:2"));
  try {
    Small refused(fixed, 3, "async");
    ADD_FAILURE() << "a worker in another mode than the server's was not refused";
  } catch (const shoal::UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "parameter server: worker 0 trains in mode async; expected ssp:2, the servers' "
              "--mode (or SHOAL_PS_MODE where shoal run started them)");
  }
  // Backup workers (replicas_to_aggregate) take a sync step's first pushes: no other mode.
  ServerCoreOptions backup = from_workers;
  backup.replicas_to_aggregate = 2;
  try {
    Small refused(backup, 3, "ssp:1");
    ADD_FAILURE() << "backup workers in bounded staleness were not refused";
  } catch (const shoal::UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "parameter server: worker 0 trains in mode ssp:1; shoal run --ps-backup-workers "
              "expects sync (drop one of them)");
  }
  EXPECT_NO_THROW(Small(backup, 3, "sync"));
}

std::vector<float> everything(ServerCore& core, int32_t worker, int64_t clock) {
  PullRequest request;
  request.worker = worker;
  request.clock = clock;
  request.dense = {DenseSlice{0, {0}, {}}};
  SparseSlice rows{1, {}, {}};
  for (int64_t i = 0; i < 100; ++i) rows.ids.push_back(i);
  request.sparse = {rows};
  auto reply = core.pull(request, shoal::Deadline(Ms(0)));
  auto out = reply.dense[0].values;
  out.insert(out.end(), reply.sparse[0].values.begin(), reply.sparse[0].values.end());
  return out;
}

// Note [Taking a push's storage]: a sync push the transport hands over (push_taking) is held by
// swapping storage, not copied. The transport reads every push into one request it keeps, so the
// same request is refilled here after each call, as its next decode does; the steps must equal
// those of pushes copied, bit for bit, whatever storage each push leaves behind.
TEST(PsServerCore, PushesTakenEqualPushesCopied) {
  Small copied({}), taken({});
  PushRequest request;  // the transport's request, refilled for every push
  for (int64_t clock = 0; clock < 4; ++clock) {
    for (int32_t w : {2, 0, 1}) {  // arrival order differs from worker order
      const float grad = 0.25f * static_cast<float>(w + 1) + 0.125f * static_cast<float>(clock);
      copied.push(w, clock, grad, w + 1);
      request.worker = w;
      request.clock = clock;
      request.rows = w + 1;
      request.dense.resize(1);
      request.dense[0].table = 0;
      request.dense[0].chunks.assign({0});
      request.dense[0].values.assign(8, grad);
      taken.core->push_taking(request, shoal::Deadline(Ms(0)));
    }
    ASSERT_EQ(copied.core->step(), clock + 1);
    ASSERT_EQ(taken.core->step(), clock + 1);
    EXPECT_EQ(taken.pull(0, clock + 1, Ms(0)).dense[0].values,
              copied.pull(0, clock + 1, Ms(0)).dense[0].values)
        << "step " << clock;
  }
  EXPECT_NE(copied.value(), 1.f);  // the steps changed the values
}

// An elastic job's async pushes wait for their seal in storage taken from the transport's request
// as sync's do (Note [Taking a push's storage]); applied, they equal pushes that were copied.
TEST(PsServerCore, UnsealedPushesTakenEqualPushesCopied) {
  ServerCoreOptions options;
  options.consistency = Consistency::kAsync;
  options.sealed_pushes = true;
  Small copied(options, 1), taken(options, 1);
  PushRequest request;  // the transport's request, refilled for every push
  for (int64_t clock = 0; clock < 3; ++clock) {
    const float grad = 0.25f + 0.125f * static_cast<float>(clock);
    copied.push(0, clock, grad);
    request.worker = 0;
    request.clock = clock;
    request.rows = 1;
    request.dense.resize(1);
    request.dense[0].table = 0;
    request.dense[0].chunks.assign({0});
    request.dense[0].values.assign(8, grad);
    taken.core->push_taking(request, shoal::Deadline(Ms(0)));
    EXPECT_EQ(taken.core->step(), clock) << "applied before its seal";
    // The pull of the next clock seals the push.
    const PullReply a = copied.pull(0, clock + 1, Ms(0)), b = taken.pull(0, clock + 1, Ms(0));
    ASSERT_EQ(taken.core->step(), clock + 1);
    EXPECT_EQ(b.dense.at(0).values, a.dense.at(0).values) << "step " << clock;
  }
  EXPECT_NE(copied.value(), 1.f);  // the steps changed the values
}

// Note [A step's sum on two threads]: a step large enough to be summed on two threads gives
// the values one thread gives, to the bit, for chunks on either side of the split.
// Note [The gradient noise on servers]: a sync step's part of the measurement is the mean of its
// pushes' |g|^2, |applied gradient|^2 over the dense chunks and sparse rows the server applied,
// and the harmonic mean and the sum of the pushes' rows; an idle push does not count. A step
// whose pushes did not all measure has no part.
TEST(PsServerCore, ASyncStepsNoisePartIsWhatItsPushesAndItsSumSay) {
  Small small(ServerCoreOptions{}, 4);
  const float grads[] = {1, 2, -1};
  const int64_t rows[] = {2, 4, 4};
  for (int64_t clock : {0, 1}) {
    for (int32_t w = 0; w < 4; ++w) {
      PushRequest push;
      push.worker = w;
      push.clock = clock;
      if (w < 3) {  // worker 3 is idle: no rows, no values
        const float g = grads[w];
        push.rows = rows[w];
        push.dense = {DenseSlice{0, {0}, std::vector<float>(8, g)}};
        push.sparse = {SparseSlice{1, {7}, std::vector<float>(4, 2 * g)}};
        // Step 1: worker 1 does not measure.
        push.gradient_sqr = clock == 1 && w == 1 ? -1 : 8 * g * g + 4 * (2 * g) * (2 * g);
      }
      small.core->push(push, shoal::Deadline(Ms(0)));
    }
    const NoisePart part = small.pull(0, clock + 1, Ms(0)).noise;
    if (clock == 1) {
      EXPECT_EQ(part.step, -1);
      continue;
    }
    EXPECT_EQ(part.step, 0);
    // Applied: dense (2 * 1 + 4 * 2 - 4 * 1) / 10 = 0.6 in 8 values, sparse 1.2 in 4.
    EXPECT_NEAR(part.average_sqr, 8 * 0.36 + 4 * 1.44, 1e-5);
    EXPECT_DOUBLE_EQ(part.local_sqr, (24.0 + 96.0 + 24.0) / 3);
    EXPECT_DOUBLE_EQ(part.small, 3 / (1.0 / 2 + 1.0 / 4 + 1.0 / 4));
    EXPECT_DOUBLE_EQ(part.big, 10);
  }
}

// Adam at `lr`; the chunks of a dense table of `values` values; sin(step * i) for i < n.
OptimizerSpec adam_at(double lr) {
  OptimizerSpec adam;
  adam.kind = OptimizerSpec::Kind::kAdam;
  adam.lr = lr;
  return adam;
}
std::vector<int64_t> every_chunk(int64_t values) {
  std::vector<int64_t> chunks;
  for (int64_t c = 0; c * kChunkElements < values; ++c) chunks.push_back(c);
  return chunks;
}
std::vector<float> sines(int64_t n, float step) {
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[i] = std::sin(step * static_cast<float>(i));
  return values;
}

// Note [The values' mirror] (src/ps/mirror.h): a core whose dense values live in its mirror steps
// exactly as one whose values stay in its shards (Adam: the optimizer state stays in the shard),
// saves the same bytes for every shard, and a shard loaded back into a mirrored core is served
// and stepped from the mirror again.
TEST(PsServerCore, ValuesInTheMirrorStepSaveAndLoadAsInTheShards) {
  constexpr int64_t kValues = 3 * kChunkElements + 77;  // the last chunk short
  const OptimizerSpec adam = adam_at(0.01);
  const std::vector<int64_t> chunks = every_chunk(kValues);
  const std::vector<float> initial = sines(kValues, 0.003f);
  const auto make = [&](bool mirror) {
    ServerCoreOptions options;
    options.workers = {0, 1};
    options.shards = ShardMap(1).shards_of(0);
    options.mirror_values = mirror;
    auto core = std::make_unique<ServerCore>(options);
    RegisterRequest request;
    request.tables = {dense_spec("big", {kValues}, adam), dense_spec("small", {5}, adam)};
    request.initial = {DenseSlice{0, chunks, initial}, DenseSlice{1, {0}, {1, 2, 3, 4, 5}}};
    core->register_tables(request, shoal::Deadline(Ms(0)));
    return core;
  };
  // Both workers' pushes of `clock`, with the gradients of step `seed`.
  const auto step = [&](ServerCore& core, int64_t clock, int64_t seed) {
    for (int32_t w : {0, 1}) {
      PushRequest push{w,
                       clock,
                       w + 1,
                       {DenseSlice{0, chunks, std::vector<float>(kValues)},
                        DenseSlice{1, {0}, std::vector<float>(5, 0.5f)}},
                       {}};
      for (int64_t i = 0; i < kValues; ++i)
        push.dense[0].values[i] = std::cos(0.01f * static_cast<float>(i * (w + 1) + seed));
      core.push(push, shoal::Deadline(Ms(0)));
    }
  };
  const auto values = [&](ServerCore& core, int64_t clock) {
    PullRequest pull{0, clock, {DenseSlice{0, chunks, {}}, DenseSlice{1, {0}, {}}}, {}};
    const PullReply reply = core.pull(pull, shoal::Deadline(Ms(0)));
    std::vector<float> all = reply.dense.at(0).values;
    all.insert(all.end(), reply.dense.at(1).values.begin(), reply.dense.at(1).values.end());
    return all;
  };
  // The same values as the mirror holds them, where a pull offered it names them.
  SegmentMappings mappings(4, /*read_only=*/true);
  const auto in_mirror = [&](ServerCore& core, int64_t clock) {
    PullRequest pull{0, clock, {DenseSlice{0, chunks, {}}, DenseSlice{1, {0}, {}}}, {}};
    PullReply reply;
    DenseOut out;
    out.mirror_offered = true;
    core.pull_into(pull, shoal::Deadline(Ms(0)), reply, out);
    std::vector<float> all;
    if (out.mirror.empty()) return all;
    const SharedValues mirror = mappings.open(out.mirror)->values();
    for (size_t i = 0; i < out.counts.size(); ++i)
      all.insert(all.end(), mirror.data + out.mirrored.at(i),
                 mirror.data + out.mirrored.at(i) + out.counts[i]);
    return all;
  };
  auto plain = make(false), mirrored = make(true);
  EXPECT_TRUE(in_mirror(*plain, 0).empty()) << "a core without a mirror named one";
  for (int64_t clock = 0; clock < 3; ++clock) {
    step(*plain, clock, clock);
    step(*mirrored, clock, clock);
  }
  const std::vector<float> after = values(*plain, 3);
  EXPECT_NE(std::vector<float>(after.begin(), after.begin() + kValues), initial);
  EXPECT_EQ(values(*mirrored, 3), after);
  EXPECT_EQ(in_mirror(*mirrored, 3), after);
  std::map<int32_t, std::string> saved;
  for (int32_t v : ShardMap(1).shards_of(0)) {
    saved[v] = mirrored->save_shard(v);
    ASSERT_EQ(saved[v], plain->save_shard(v)) << "virtual shard " << v;
  }
  // A fresh mirrored core loads the shards (as a restarted server does) and goes on as the plain
  // one does.
  auto loaded = make(true);
  for (const auto& [v, bytes] : saved) loaded->load_shard(v, bytes);
  EXPECT_EQ(values(*loaded, 0), after);
  EXPECT_EQ(in_mirror(*loaded, 0), after) << "the loaded shard's values are not in the mirror";
  step(*plain, 3, 3);
  step(*loaded, 0, 3);  // its workers start at clock 0; the chunks keep their Adam step counts
  EXPECT_EQ(values(*loaded, 1), values(*plain, 4));
  EXPECT_EQ(in_mirror(*loaded, 1), values(*plain, 4));
}

TEST(PsServerCore, ALargeStepSummedOnTwoThreadsEqualsOneThread) {
  constexpr int64_t kValues = 20 * kChunkElements + 123;  // 21 chunks, the last one short
  const OptimizerSpec adam = adam_at(0.01);
  const std::vector<int64_t> chunks = every_chunk(kValues);
  const std::vector<float> initial = sines(kValues, 0.001f);
  std::vector<std::vector<float>> after;
  for (int threads : {1, 2}) {
    ServerCoreOptions options;
    options.workers = {0, 1, 2};
    options.shards = ShardMap(1).shards_of(0);
    options.sum_threads = threads;
    ServerCore core(options);
    RegisterRequest request;
    request.tables = {dense_spec("big", {kValues}, adam)};
    request.initial = {DenseSlice{0, chunks, initial}};
    core.register_tables(request, shoal::Deadline(Ms(0)));
    for (int64_t clock = 0; clock < 2; ++clock) {
      for (int32_t w : {1, 2, 0}) {
        PushRequest push{w, clock, w + 1, {DenseSlice{0, chunks, std::vector<float>(kValues)}}, {}};
        for (int64_t i = 0; i < kValues; ++i) {
          push.dense[0].values[i] = std::cos(0.01f * static_cast<float>(i * (w + 1) + clock));
        }
        core.push(push, shoal::Deadline(Ms(0)));
      }
    }
    ASSERT_EQ(core.step(), 2);
    PullRequest pull{0, 2, {DenseSlice{0, chunks, {}}}, {}};
    after.push_back(core.pull(pull, shoal::Deadline(Ms(0))).dense.at(0).values);
  }
  ASSERT_EQ(after[0].size(), static_cast<size_t>(kValues));
  EXPECT_NE(after[0], initial);
  for (int64_t i = 0; i < kValues; ++i) ASSERT_EQ(after[1][i], after[0][i]) << "value " << i;
}

// Note [Pull replies in place]: offered room enough (a worker's segment), a pull writes the dense
// values there, slice after slice, and leaves none in the reply; offered too little, it answers
// in the reply as pull() does.
TEST(PsServerCore, APullWritesItsValuesWhereItIsOfferedRoom) {
  Small server({});
  for (int32_t w : {0, 1, 2}) server.push(w, 0, 0.5f * static_cast<float>(w + 1));
  PullRequest request;
  request.clock = 1;
  request.dense = {DenseSlice{0, {0}, {}}, DenseSlice{0, {0}, {}}};
  const PullReply expected = server.core->pull(request, shoal::Deadline(Ms(0)));
  ASSERT_EQ(expected.dense.size(), 2u);
  ASSERT_EQ(expected.dense[0].values.size(), 8u);

  std::vector<float> room(17, -7.f);
  DenseOut out{room.data(), room.size(), {}};
  PullReply reply;
  server.core->pull_into(request, shoal::Deadline(Ms(0)), reply, out);
  EXPECT_EQ(out.counts, (std::vector<size_t>{8, 8}));
  ASSERT_EQ(reply.dense.size(), 2u);
  for (const DenseSlice& slice : reply.dense) {
    EXPECT_EQ(slice.chunks, std::vector<int64_t>{0});
    EXPECT_TRUE(slice.values.empty());
  }
  EXPECT_EQ(std::vector<float>(room.begin(), room.begin() + 8), expected.dense[0].values);
  EXPECT_EQ(std::vector<float>(room.begin() + 8, room.begin() + 16), expected.dense[1].values);
  EXPECT_EQ(room[16], -7.f) << "written past the values";
  EXPECT_EQ(reply.clock, expected.clock);

  std::vector<float> small(15, -7.f);
  DenseOut too_small{small.data(), small.size(), {}};
  PullReply inline_reply;
  server.core->pull_into(request, shoal::Deadline(Ms(0)), inline_reply, too_small);
  EXPECT_TRUE(too_small.counts.empty());
  EXPECT_EQ(small, std::vector<float>(15, -7.f));
  ASSERT_EQ(inline_reply.dense.size(), 2u);
  EXPECT_EQ(inline_reply.dense[0].values, expected.dense[0].values);
  EXPECT_EQ(inline_reply.dense[1].values, expected.dense[1].values);
}

TEST(PsServerCore, BackupWorkersApplyTheFirstPushesOfAStep) {
  ServerCoreOptions options;
  options.replicas_to_aggregate = 2;
  Small server(options);
  EXPECT_TRUE(server.push(0, 0, 1.f, 2).counted);
  EXPECT_EQ(server.core->step(), 0);
  EXPECT_TRUE(server.push(1, 0, 3.f, 6).counted);
  EXPECT_EQ(server.core->step(), 1);
  EXPECT_FLOAT_EQ(server.value(), 1 - (2 * 1.f + 6 * 3.f) / 8);
  const auto before = everything(*server.core, 0, 0);
  const auto late = server.push(2, 0, 100.f);
  EXPECT_FALSE(late.counted);
  EXPECT_EQ(late.clock, 1);
  EXPECT_EQ(everything(*server.core, 0, 0), before);
  // Step 1: workers 2 and 0 come first this time.
  EXPECT_TRUE(server.push(2, 1, 1.f, 1).counted);
  EXPECT_TRUE(server.push(0, 1, 2.f, 1).counted);
  EXPECT_FALSE(server.push(1, 1, 100.f).counted);
  EXPECT_FLOAT_EQ(server.value(), 1 - 2.5f - 1.5f);
  EXPECT_EQ(server.core->step(), 2);
}

// Note [Server 0 decides]: with backup workers and two servers, the pushes server 0 counted are
// the ones the other server counts, whatever order they reach it in.
TEST(PsServerCore, BackupWorkersCountWhatServer0CountedOnEveryServer) {
  ServerCoreOptions options;
  options.replicas_to_aggregate = 2;
  Small first(options), other(options);
  auto push = [](Small& server, int32_t worker, float grad, PushRequest::Verdict verdict) {
    PushRequest request;
    request.worker = worker;
    request.clock = 0;
    request.rows = 1;
    request.verdict = verdict;
    request.dense = {DenseSlice{0, {0}, std::vector<float>(8, grad)}};
    return server.core->push(request, shoal::Deadline(Ms(0)));
  };
  using Verdict = PushRequest::Verdict;
  std::map<int32_t, bool> counted;
  for (int32_t w : {1, 2, 0}) counted[w] = push(first, w, w + 1.f, Verdict::kDecide).counted;
  EXPECT_EQ(counted, (std::map<int32_t, bool>{{0, false}, {1, true}, {2, true}}));
  // The other server gets them in another order, each with server 0's answer.
  for (int32_t w : {0, 2, 1}) {
    const PushReply reply =
        push(other, w, w + 1.f, counted[w] ? Verdict::kCounted : Verdict::kDropped);
    EXPECT_EQ(reply.counted, counted[w]);
  }
  EXPECT_EQ(first.core->step(), 1);
  EXPECT_EQ(other.core->step(), 1);
  EXPECT_FLOAT_EQ(first.value(), 1 - (2.f + 3.f) / 2);
  EXPECT_FLOAT_EQ(other.value(), first.value());
  // A push server 0 counted for a step this server applied without it: the servers disagree.
  PushRequest late;
  late.worker = 0;
  late.clock = 1;
  late.rows = 1;
  late.dense = {DenseSlice{0, {0}, std::vector<float>(8, 1.f)}};
  for (int32_t w : {1, 2}) {
    late.worker = w;
    other.core->push(late, shoal::Deadline(Ms(0)));
  }
  late.worker = 0;
  late.verdict = Verdict::kCounted;
  EXPECT_NE(error_of([&] { other.core->push(late, shoal::Deadline(Ms(0))); })
                .find("worker 0's push of step 1 was counted by server 0, but this server applied "
                      "that step without it"),
            std::string::npos);
}

TEST(PsServerCore, ALeaversPushIsCountedOrDiscardedAsAsked) {
  for (auto leavers : {LeaverPush::kCount, LeaverPush::kDiscard}) {
    Small server({});
    server.push(0, 0, 1.f, 1);
    server.push(2, 0, 10.f, 2);
    server.core->set_live_workers({0, 1}, leavers);
    EXPECT_EQ(server.core->step(), 0);  // worker 1's push is still missing
    server.push(1, 0, 4.f, 1);
    EXPECT_EQ(server.core->step(), 1);
    const float expected =
        leavers == LeaverPush::kCount ? 1 - (1.f + 20.f + 4.f) / 4 : 1 - (1.f + 4.f) / 2;
    EXPECT_FLOAT_EQ(server.value(), expected);
    EXPECT_NE(error_of<UsageError>([&] {
                server.push(2, 1, 1.f);
              }).find("worker 2 is not live; expected one of 0, 1"),
              std::string::npos);
    // A joiner starts at the server's step, and the open step waits for it too.
    server.core->set_live_workers({0, 1, 3}, LeaverPush::kDiscard);
    EXPECT_EQ(server.core->clock_of(3), 1);
    server.push(0, 1, 1.f);
    server.push(1, 1, 1.f);
    EXPECT_EQ(server.core->step(), 1);
    server.push(3, 1, 1.f);
    EXPECT_EQ(server.core->step(), 2);
    // A leaver whose push was the last one missing: the step closes without waiting.
    server.push(0, 2, 1.f);
    server.push(1, 2, 1.f);
    server.core->set_live_workers({0, 1}, LeaverPush::kDiscard);
    EXPECT_EQ(server.core->step(), 3);
  }
}

TEST(PsServerCore, BadRequestsAreRefusedAndChangeNothing) {
  ServerCoreOptions async;  // pushes are applied at once, so that there is state to keep
  async.consistency = Consistency::kAsync;
  Small server(async);
  server.push(0, 0, 1.f);
  {
    PushRequest request;
    request.worker = 1;
    request.rows = 1;
    request.sparse = {SparseSlice{1, {3, 4}, std::vector<float>(8, 0.5f)}};
    server.core->push(request, shoal::Deadline(Ms(0)));
  }
  const auto before = everything(*server.core, 0, 0);
  EXPECT_EQ(server.core->row_count(), 2u) << "pulling rows does not store them";
  auto expect_refused = [&](const std::string& message, const std::function<void()>& body) {
    SCOPED_TRACE(message);
    const std::string e = error_of<UsageError>(body);
    EXPECT_NE(e.find(message), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    EXPECT_EQ(everything(*server.core, 0, 0), before);
    EXPECT_EQ(server.core->row_count(), 2u);
    EXPECT_EQ(server.core->step(), 2);
    EXPECT_EQ(server.core->clock_of(0), 1);
    EXPECT_EQ(server.core->clock_of(1), 1);
    EXPECT_EQ(server.core->clock_of(2), 0);
  };
  auto push = [&](std::vector<DenseSlice> dense, std::vector<SparseSlice> sparse,
                  int32_t worker = 2, int64_t clock = 0) {
    PushRequest request;
    request.worker = worker;
    request.clock = clock;
    request.rows = 1;
    request.dense = std::move(dense);
    request.sparse = std::move(sparse);
    server.core->push(request, shoal::Deadline(Ms(0)));
  };
  const DenseSlice good{0, {0}, std::vector<float>(8, 1.f)};
  expect_refused("parameter server: push: unknown table index 7; expected 0 <= index < 2", [&] {
    EXPECT_THROW(push({good, DenseSlice{7, {0}, {}}}, {}), NotFoundError);
    push({good, DenseSlice{7, {0}, {}}}, {});
  });
  expect_refused("table 'w': 9 values for 1 chunks; expected 8", [&] {
    push({DenseSlice{0, {0}, std::vector<float>(9, 1.f)}}, {});
  });
  expect_refused("table 'w': chunk 1 is out of range; expected 0 <= chunk < 1", [&] {
    push({DenseSlice{0, {1}, std::vector<float>(8, 1.f)}}, {});
  });
  expect_refused("table 'emb': 7 values for 2 rows of dim 4; expected 8", [&] {
    push({good}, {SparseSlice{1, {1, 2}, std::vector<float>(7, 1.f)}});
  });
  expect_refused("table 'emb': row 3 is named twice; expected unique ids", [&] {
    push({good}, {SparseSlice{1, {3, 3}, std::vector<float>(8, 1.f)}});
  });
  expect_refused("table 'emb': row 100 is out of range; expected 0 <= id < 100", [&] {
    push({good}, {SparseSlice{1, {100}, std::vector<float>(4, 1.f)}});
  });
  expect_refused("table 'emb' is sparse; expected a dense table for chunks", [&] {
    push({DenseSlice{1, {0}, {}}}, {});
  });
  expect_refused("table 'w' is dense; expected a sparse table for rows", [&] {
    push({}, {SparseSlice{0, {0}, {}}});
  });
  expect_refused("worker 2 pushed step 5; expected its next step 0",
                 [&] { push({good}, {}, 2, 5); });
  // (Its step 0 again would be a retry, answered as before: Note [Retried pushes].)
  expect_refused("worker 0 pushed step 2; expected its next step 1",
                 [&] { push({good}, {}, 0, 2); });
  expect_refused("worker 9 is not live; expected one of 0, 1, 2", [&] { push({good}, {}, 9); });
  expect_refused(
      "worker 2 pushed a gradient of 0 samples with values; expected rows >= 1, or 0 with no "
      "values (an idle step)",
      [&] {
        PushRequest request;
        request.worker = 2;
        request.dense = {good};
        server.core->push(request, shoal::Deadline(Ms(0)));
      });
  expect_refused("worker 2 pushed a gradient of -1 samples; expected rows >= 1", [&] {
    PushRequest request;
    request.worker = 2;
    request.rows = -1;
    server.core->push(request, shoal::Deadline(Ms(0)));
  });
  expect_refused("parameter server: pull: table 'w': 8 values for 1 chunks; expected 0", [&] {
    PullRequest request;
    request.dense = {good};
    server.core->pull(request, shoal::Deadline(Ms(0)));
  });
  expect_refused("worker 2 pulled at clock 1; expected 0 <= clock <= 0", [&] {
    PullRequest request;
    request.worker = 2;
    request.clock = 1;
    server.core->pull(request, shoal::Deadline(Ms(0)));
  });
  OptimizerSpec sgd;
  sgd.lr = 1;
  RegisterRequest again;
  again.worker = 1;
  again.tables = {dense_spec("w", {8}, sgd),
                  sparse_spec("emb", 100, 4, {InitSpec::Kind::kUniform, -1, 1}, sgd)};
  EXPECT_NO_THROW(server.core->register_tables(again, shoal::Deadline(Ms(0))));
  again.tables[0].optimizer.lr = 0.5;
  expect_refused(
      "worker 1's table 0 ('w') differs from the first registration: lr 0.500000 (expected "
      "1.000000)",
      [&] { server.core->register_tables(again, shoal::Deadline(Ms(0))); });
  again.tables[0].optimizer.lr = 1;
  again.tables[1].shape = {100, 5};
  expect_refused(
      "table 1 ('emb') differs from the first registration: shape [100, 5] (expected [100, 4])",
      [&] { server.core->register_tables(again, shoal::Deadline(Ms(0))); });
  again.tables.pop_back();
  expect_refused("worker 1 registers 1 tables; expected 2 as the first registration",
                 [&] { server.core->register_tables(again, shoal::Deadline(Ms(0))); });
}

TEST(PsServerCore, AChunkOrRowOfAnotherServerIsRefused) {
  ServerCoreOptions options;
  options.workers = {0};
  options.shards = ShardMap(2).shards_of(0);
  ServerCore core(options);
  const std::string name = "emb";
  int64_t foreign = 0;
  while (ShardMap(2).owner(row_shard(name, foreign)) == 0) ++foreign;
  RegisterRequest request;
  request.tables = {sparse_spec(name, 0, 2, {})};
  core.register_tables(request, shoal::Deadline(Ms(0)));
  PushRequest push;
  push.rows = 1;
  push.sparse = {SparseSlice{0, {foreign}, {1.f, 1.f}}};
  const std::string e = error_of<NotFoundError>([&] { core.push(push, shoal::Deadline(Ms(0))); });
  EXPECT_NE(e.find("table 'emb': row " + std::to_string(foreign) + " is in virtual shard " +
                   std::to_string(row_shard(name, foreign)) + ", which this server does not hold"),
            std::string::npos)
      << e;
  EXPECT_EQ(core.row_count(), 0u);
  EXPECT_EQ(core.clock_of(0), 0);
}

TEST(PsServerCore, AFailedFirstRegistrationLeavesNoTables) {
  ServerCoreOptions options;
  options.workers = {0};
  options.shards = ShardMap(1).shards_of(0);
  ServerCore core(options);
  OptimizerSpec sgd;
  RegisterRequest request;
  request.tables = {dense_spec("w", {70000}, sgd), sparse_spec("emb", 0, 0, {})};
  EXPECT_NE(
      error_of<UsageError>([&] {
        core.register_tables(request, shoal::Deadline(Ms(0)));
      }).find("sparse table 'emb' has shape [0, 0]; expected {rows (0: unbounded), dim >= 1}"),
      std::string::npos);
  request.tables[1].shape = {0, 3};
  request.initial = {DenseSlice{0, {0}, std::vector<float>(kChunkElements, 1.f)}};
  EXPECT_NE(error_of<UsageError>([&] {
              core.register_tables(request, shoal::Deadline(Ms(0)));
            }).find("table 'w': no initial values for chunk 1, which this server holds"),
            std::string::npos);
  request.initial[0].chunks.push_back(1);
  request.initial[0].values.resize(70000, 2.f);
  EXPECT_NO_THROW(core.register_tables(request, shoal::Deadline(Ms(0))));
  PullRequest pull;
  pull.dense = {DenseSlice{0, {1}, {}}};
  EXPECT_EQ(core.pull(pull, shoal::Deadline(Ms(0))).dense[0].values,
            std::vector<float>(70000 - kChunkElements, 2.f));
}

TEST(PsServerCore, APullOfAWorkerThatLeavesEndsAtOnce) {
  Small server({});
  server.push(0, 0, 1.f);
  std::string error;
  std::thread waiter([&] { error = error_of<CommError>([&] { server.pull(0, 1, kGenerous); }); });
  // The pull waits for step 0 (workers 1 and 2 have not pushed) until worker 0 leaves.
  shoal::Deadline deadline(kGenerous);
  while (server.core->pulls_waiting() != 1 && !deadline.expired())
    std::this_thread::sleep_for(Ms(1));
  server.core->set_live_workers({1, 2}, LeaverPush::kDiscard);
  waiter.join();
  EXPECT_NE(error.find("pull of worker 0 at clock 1 ended after"), std::string::npos) << error;
  EXPECT_NE(error.find("the worker left the live set while it waited"), std::string::npos) << error;
}

// ---------------------------------------------------------------------------------------------
// Snapshots per virtual shard

TEST(PsSnapshot, ACheckpointOfThreeServersLoadsOntoTwo) {
  OptimizerSpec adam;
  adam.kind = OptimizerSpec::Kind::kAdam;
  adam.lr = 0.01;
  adam.eps = 1e-8;
  const std::vector<TableSpec> tables = {
      dense_spec("w", {70000}, adam),
      sparse_spec("emb", 0, 3, {InitSpec::Kind::kNormal, 0, 1}, adam)};
  ServerCoreOptions options;
  options.workers = {0};
  std::mt19937_64 random(5);
  std::normal_distribution<float> normal;
  std::map<int32_t, std::vector<float>> initial;
  for (int i = 0; i < 70000; ++i) initial[0].push_back(normal(random));
  auto gradients = [&](int64_t step) {
    std::map<int32_t, std::vector<float>> dense;
    for (int i = 0; i < 70000; ++i) dense[0].push_back(normal(random));
    std::map<int32_t, std::pair<std::vector<int64_t>, std::vector<float>>> rows;
    std::set<int64_t> ids;
    for (int i = 0; i < 200; ++i) ids.insert(static_cast<int64_t>(random() % 1000) * (step + 1));
    rows[1].first.assign(ids.begin(), ids.end());
    for (size_t i = 0; i < ids.size() * 3; ++i) rows[1].second.push_back(normal(random));
    return std::make_pair(dense, rows);
  };
  std::vector<int64_t> all(4000);
  for (int64_t i = 0; i < 4000; ++i) all[static_cast<size_t>(i)] = i;

  Cluster three(3, options, tables);
  three.register_worker(0, initial);
  for (int64_t step = 0; step < 3; ++step) {
    auto [dense, rows] = gradients(step);
    three.push(0, step, 1, dense, rows);
  }
  std::map<int32_t, std::string> snapshots;
  for (int32_t s = 0; s < 3; ++s)
    for (int32_t v : ShardMap(3).shards_of(s)) snapshots[v] = three.core(s).save_shard(v);

  Cluster two(2, options, tables);
  std::map<int32_t, std::vector<float>> zeros;
  zeros[0].assign(70000, 0.f);
  two.register_worker(0, zeros);
  for (int32_t s = 0; s < 2; ++s)
    for (int32_t v : ShardMap(2).shards_of(s)) two.core(s).load_shard(v, snapshots[v]);
  EXPECT_EQ(two.row_count(), three.row_count());
  EXPECT_GT(two.row_count(), 400u);
  auto before = three.pull(0, 3, {{1, all}}, kGenerous);
  auto after = two.pull(0, 0, {{1, all}}, kGenerous);
  EXPECT_EQ(after.dense, before.dense);
  EXPECT_EQ(after.rows, before.rows);
  // The optimizer state came along: one more step gives the same values on both.
  auto [dense, rows] = gradients(3);
  three.push(0, 3, 1, dense, rows);
  two.push(0, 0, 1, dense, rows);
  before = three.pull(0, 4, {{1, all}}, kGenerous);
  after = two.pull(0, 1, {{1, all}}, kGenerous);
  EXPECT_EQ(after.dense, before.dense);
  EXPECT_EQ(after.rows, before.rows);
  EXPECT_NE(after.dense, zeros);

  // A bad snapshot changes nothing.
  const int32_t v = ShardMap(2).shards_of(1)[0];
  const std::string good = two.core(1).save_shard(v);
  auto refused = [&](const std::string& bytes, const std::string& message) {
    const std::string e = error_of<UsageError>([&] { two.core(1).load_shard(v, bytes); });
    EXPECT_NE(e.find(message), std::string::npos) << e;
    EXPECT_EQ(two.core(1).save_shard(v), good);
  };
  refused(good.substr(0, good.size() - 1),
          "snapshot of virtual shard " + std::to_string(v) + ": truncated");
  refused(good + "x", "unexpected bytes after the last row");
  refused("not a snapshot at all", "not a shard snapshot");
  const int32_t other = ShardMap(2).shards_of(1)[1];
  refused(two.core(1).save_shard(other), "it holds virtual shard " + std::to_string(other));
  EXPECT_NE(
      error_of<UsageError>([&] { two.core(0).save_shard(v); }).find("is not held by this server"),
      std::string::npos);
}

TEST(PsServerCore, TheRegistrationWithValuesCreatesTheTables) {
  ServerCoreOptions options;
  options.workers = {0, 1};
  options.shards = ShardMap(1).shards_of(0);
  ServerCore core(options);
  RegisterRequest first;
  first.tables = {dense_spec("w", {4}, {})};
  first.initial = {DenseSlice{0, {0}, {1, 2, 3, 4}}};
  RegisterRequest other = first;
  other.worker = 1;
  other.initial.clear();
  // Alone, a registration without values waits for the one with them, until its deadline.
  const auto start = std::chrono::steady_clock::now();
  const std::string e =
      error_of<CommError>([&] { core.register_tables(other, shoal::Deadline(Ms(300))); });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(e.find("parameter server: registration of worker 1 timed out after"), std::string::npos)
      << e;
  EXPECT_NE(e.find("waiting for the registration that carries the dense tables' first values"),
            std::string::npos)
      << e;
  EXPECT_GE(waited, 0.29);
  EXPECT_LT(waited, 10.0);  // a generous failure bound
  std::thread late([&] { core.register_tables(other, shoal::Deadline(kGenerous)); });
  core.register_tables(first, shoal::Deadline(Ms(0)));
  late.join();
  PullRequest pull;
  pull.worker = 1;
  pull.dense = {DenseSlice{0, {0}, {}}};
  EXPECT_EQ(core.pull(pull, shoal::Deadline(Ms(0))).dense[0].values,
            (std::vector<float>{1, 2, 3, 4}));
}

// ---- Elastic workers: sealed pushes and the ledger's batches on a server (docs/ps.md) ----

// Waits until `condition` holds, at most kGenerous (a failure bound: it holds within
// milliseconds when the code is right).
void eventually(const std::function<bool()>& condition) {
  const auto until = std::chrono::steady_clock::now() + kGenerous;
  while (!condition()) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "a condition never came true";
    std::this_thread::sleep_for(Ms(1));
  }
}

// Two servers, each holding every shard of the Small model (so both hold the value checked), and
// three workers; worker 2 dies in the middle of a step.
struct TwoServers {
  explicit TwoServers(Consistency consistency) {
    ServerCoreOptions options;
    options.consistency = consistency;
    options.sealed_pushes = true;
    servers.emplace_back(options);
    servers.emplace_back(options);
  }
  // Pulls at `clock` on server s in a thread (a sync pull waits for its step).
  void pull_later(int s, int32_t worker, int64_t clock) {
    pulls.emplace_back([this, s, worker, clock] { servers[s].pull(worker, clock, kGenerous); });
  }
  void join() {
    for (auto& t : pulls) t.join();
    pulls.clear();
  }
  // What the launcher does for a worker that died (Note [Joins and leaves]): fenced off
  // everywhere, then the highest clock it sealed anywhere decides on every server.
  void lost(int32_t worker) {
    int64_t sealed = 0;
    for (auto& s : servers) sealed = std::max(sealed, s.core->fence(worker));
    for (auto& s : servers) s.core->leave(worker, sealed);
  }
  std::vector<Small> servers;
  std::vector<std::thread> pulls;
};

TEST(PsServerCore, ALeaversPushCountsOnEveryServerOrOnNone) {
  // Worker 2 dies after its push reached server 0 only: it sealed nothing, so no server applies
  // it, and step 0 is workers 0 and 1's on both.
  {
    TwoServers job(Consistency::kSync);
    job.servers[0].push(2, 0, 100.f);
    for (int32_t w : {0, 1})
      for (int s : {0, 1}) job.servers[s].push(w, 0, w == 0 ? 1.f : 3.f);
    for (int32_t w : {0, 1})
      for (int s : {0, 1}) job.pull_later(s, w, 1);
    eventually([&] {
      return job.servers[0].core->pulls_waiting() + job.servers[1].core->pulls_waiting() == 4;
    });
    EXPECT_EQ(job.servers[0].core->step(), 0);  // every push is there, worker 2's not sealed
    job.lost(2);
    job.join();
    for (auto& server : job.servers) {
      EXPECT_EQ(server.core->step(), 1);
      EXPECT_FLOAT_EQ(server.value(), 1 - (1.f + 3.f) / 2);
    }
  }
  // Worker 2 dies after sealing on server 0, not on server 1: its push reached both, server 0
  // applied step 0 with it, and server 1 counts it too.
  {
    TwoServers job(Consistency::kSync);
    for (int32_t w : {0, 1, 2})
      for (int s : {0, 1}) job.servers[s].push(w, 0, w == 0 ? 1.f : w == 1 ? 3.f : 8.f);
    for (int32_t w : {0, 1, 2}) job.pull_later(0, w, 1);
    for (int32_t w : {0, 1}) job.pull_later(1, w, 1);
    eventually([&] { return job.servers[1].core->pulls_waiting() == 2; });
    // All three sealed there, and their pulls returned: worker 2's pull answered before it is
    // lost, as the launcher only learns of a death after the fact.
    eventually([&] {
      return job.servers[0].core->step() == 1 && job.servers[0].core->pulls_waiting() == 0;
    });
    EXPECT_EQ(job.servers[1].core->step(), 0);
    job.lost(2);
    job.join();
    for (auto& server : job.servers) {
      EXPECT_EQ(server.core->step(), 1);
      EXPECT_FLOAT_EQ(server.value(), 1 - (1.f + 3.f + 8.f) / 3);
    }
  }
  // Async: a push waits for its seal; the leaver's unsealed push is dropped on every server.
  {
    TwoServers job(Consistency::kAsync);
    for (int s : {0, 1}) job.servers[s].push(0, 0, 1.f);
    job.servers[0].push(2, 0, 100.f);
    EXPECT_EQ(job.servers[0].core->step(), 0);
    for (int s : {0, 1}) job.servers[s].pull(0, 1, Ms(0));  // worker 0 seals step 0
    job.lost(2);
    for (auto& server : job.servers) {
      EXPECT_EQ(server.core->step(), 1);
      EXPECT_FLOAT_EQ(server.value(), 1 - 1.f);
    }
  }
}

// Note [Joins and leaves]: a worker joins every server at one clock, the highest any of them
// answered; a server that made it live from an earlier clock then stops waiting for its pushes of
// the steps before, and no server passes that clock without its push.
TEST(PsServerCore, AJoinerIsLiveFromOneClockOnEveryServer) {
  ServerCoreOptions options;
  options.sealed_pushes = true;
  Small a(options, 1), b(options, 1);  // worker 0 alone; w starts at 1, SGD with lr 1
  for (Small* server : {&a, &b}) {
    server->push(0, 0, 1.f);
    server->pull(0, 1, Ms(0));
    server->push(0, 1, 1.f);
  }
  a.pull(0, 2, Ms(0));  // worker 0 sealed step 1 on a, not yet on b
  EXPECT_EQ(a.core->step(), 2);
  EXPECT_EQ(b.core->step(), 1);
  EXPECT_EQ(a.core->join(7, 0), 2);
  EXPECT_EQ(b.core->join(7, 0), 1);
  EXPECT_EQ(a.core->join(7, 2), 2);
  EXPECT_EQ(b.core->join(7, 2), 2);
  b.pull(0, 2, Ms(0));  // step 1 is applied on b without worker 7
  EXPECT_EQ(b.core->step(), 2);
  for (Small* server : {&a, &b}) {
    server->push(0, 2, 1.f);
    // Step 2 waits for worker 7 (the pull seals worker 0's push, then times out).
    EXPECT_NE(error_of<CommError>([&] { server->pull(0, 3, Ms(20)); })
                  .find("waiting for workers 7 at clock 2"),
              std::string::npos);
    server->push(7, 2, 3.f);
    server->pull(7, 3, Ms(1000));
    EXPECT_EQ(server->core->step(), 3);
    EXPECT_FLOAT_EQ(server->value(), 1 - 1 - 1 - (1.f + 3.f) / 2);
    EXPECT_EQ(server->core->join(7, 9), 3);  // it pushed since it joined: its clock stays
  }
}

// A lost worker is fenced off before it leaves: from then on the server takes no request of it,
// and its id never joins again; fencing and leaving a worker that never joined changes nothing.
TEST(PsServerCore, AFencedWorkerIsRefusedAndNeverJoinsAgain) {
  ServerCoreOptions options;
  options.sealed_pushes = true;
  Small server(options, 2);
  server.push(1, 0, 5.f);  // not sealed
  EXPECT_EQ(server.core->fence(1), 0);
  const std::string gone = "worker 1 has left the job (its launcher saw it exit); expected a live "
                           "worker";
  EXPECT_NE(error_of([&] { server.pull(1, 1, Ms(0)); }).find(gone), std::string::npos);
  EXPECT_NE(error_of([&] { server.push(1, 1, 5.f); }).find(gone), std::string::npos);
  server.core->leave(1, 0);  // its push is dropped
  server.push(0, 0, 1.f);
  server.pull(0, 1, Ms(0));
  EXPECT_EQ(server.core->step(), 1);
  EXPECT_FLOAT_EQ(server.value(), 1 - 1.f);
  EXPECT_NE(error_of([&] { server.core->join(1, 0); })
                .find("worker 1 has left the job; expected a new worker id for a worker that "
                      "joins again"),
            std::string::npos);
  EXPECT_EQ(server.core->fence(5), 0);
  server.core->leave(5, 0);
  EXPECT_EQ(server.core->step(), 1);
  // A server that does not seal pushes serves a job of fixed workers.
  Small fixed(ServerCoreOptions{}, 2);
  EXPECT_NE(error_of([&] { fixed.core->join(3, 0); }).find("expected an elastic job"),
            std::string::npos);
}

// Backup workers (replicas_to_aggregate): a push that came too late is answered counted = false
// and its batch goes back into the epoch, to be leased again.
TEST(PsServerCore, ALatePushsBatchGoesBackIntoTheEpoch) {
  ServerCoreOptions options;
  options.replicas_to_aggregate = 2;
  Small server(options);
  std::vector<LeaseReply> leases;
  for (int32_t w : {0, 1, 2})
    leases.push_back(server.core->lease({w, 0, 100, 10, false}, shoal::Deadline(Ms(0))));
  std::vector<bool> counted;
  for (int32_t w : {0, 1, 2}) {
    PushRequest request;
    request.worker = w;
    request.clock = 0;
    request.rows = 10;
    request.dense = {DenseSlice{0, {0}, std::vector<float>(8, 1.f)}};
    request.epoch = 0;
    request.batch = leases[static_cast<size_t>(w)].batch;
    counted.push_back(server.core->push(request, shoal::Deadline(Ms(0))).counted);
  }
  EXPECT_EQ(counted, (std::vector<bool>{true, true, false}));
  const auto counts = *server.core->ledger_counts();
  EXPECT_EQ(counts[1], 2);  // workers 0 and 1's batches are done
  EXPECT_EQ(counts[2], 0);  // worker 2's is back, not out
  EXPECT_EQ(server.core->lease({0, 0, 100, 10, false}, shoal::Deadline(Ms(0))).batch,
            leases[2].batch);
}

TEST(PsServerCore, AnIdleStepWeighsNothing) {
  // Worker 1 had no batch (the epoch's last ones were out): its push has no rows and no values,
  // the step is the others' mean, and a step of idle pushes only changes nothing.
  Small server({});
  server.push(0, 0, 1.f, 2);
  PushRequest idle;
  idle.worker = 1;
  server.core->push(idle, shoal::Deadline(Ms(0)));
  server.push(2, 0, 4.f, 1);
  EXPECT_EQ(server.core->step(), 1);
  EXPECT_FLOAT_EQ(server.value(), 1 - (2 * 1.f + 4.f) / 3);
  for (int32_t w : {0, 1, 2}) {
    idle.worker = w;
    idle.clock = 1;
    server.core->push(idle, shoal::Deadline(Ms(0)));
  }
  EXPECT_EQ(server.core->step(), 2);
  EXPECT_FLOAT_EQ(server.value(), 1 - (2 * 1.f + 4.f) / 3);
}

TEST(PsServerCore, ALeaversBatchesGoBackUnlessItsGradientCounts) {
  ServerCoreOptions options;
  options.sealed_pushes = true;
  Small server(options);
  auto lease = [&](int32_t w, int64_t batch_size = 10) {
    const auto reply = server.core->lease({w, 0, 100, batch_size, false}, shoal::Deadline(Ms(0)));
    return Ledger::Lease{static_cast<Ledger::Lease::Kind>(reply.kind), reply.epoch, reply.batch,
                         reply.begin, reply.end};
  };
  auto push = [&](int32_t w, int64_t clock, const Ledger::Lease& lease) {
    PushRequest request;
    request.worker = w;
    request.clock = clock;
    request.rows = lease.end - lease.begin;
    request.dense = {DenseSlice{0, {0}, std::vector<float>(8, 1.f)}};
    request.epoch = lease.epoch;
    request.batch = lease.batch;
    return server.core->push(request, shoal::Deadline(Ms(0)));
  };
  std::vector<Ledger::Lease> leases;
  for (int32_t w : {0, 1, 2}) leases.push_back(lease(w));
  // Worker 1 pushes the gradient of worker 0's batch: refused, nothing changes.
  EXPECT_NE(error_of<UsageError>([&] { push(1, 0, leases[0]); })
                .find("worker 1 pushed the gradient of batch 0 of epoch 0; expected a batch "
                      "leased to it and not yet trained"),
            std::string::npos);
  for (int32_t w : {0, 1, 2}) push(w, 0, leases[static_cast<size_t>(w)]);
  // Worker 2 sealed its push (it pulled at clock 1) and dies; worker 1 did not and dies.
  std::string pull2_error;  // its pull ends when it leaves the live set
  std::thread pull2(
      [&] { pull2_error = error_of<CommError>([&] { server.pull(2, 1, kGenerous); }); });
  eventually([&] { return server.core->pulls_waiting() == 1; });
  server.core->leave(1, server.core->sealed_clock(1));
  EXPECT_EQ((*server.core->ledger_counts())[2], 2);  // worker 1's batch came back
  server.core->leave(2, server.core->sealed_clock(2));
  pull2.join();
  EXPECT_NE(pull2_error.find("the worker left the live set while it waited"), std::string::npos);
  EXPECT_EQ(server.core->step(), 0);  // worker 0 has not sealed yet
  server.pull(0, 1, kGenerous);
  EXPECT_EQ(server.core->step(), 1);
  const auto counts = *server.core->ledger_counts();
  EXPECT_EQ(counts[1], 2);  // worker 0's and worker 2's batches are done
  EXPECT_EQ(counts[2], 0);
  EXPECT_EQ(lease(0).batch, leases[1].batch);  // worker 1's, again
  EXPECT_NE(error_of<UsageError>([&] { lease(0, 20); })
                .find("names a data set of 100 samples in batches of 20; expected the ledger's "
                      "100 in batches of 10"),
            std::string::npos);
}

}  // namespace
