// The CTR model of examples/ctr.cpp with large tables, trained two ways (bench/ps_ctr.sh runs
// them side by side):
//   --impl ps   on the job's parameter servers: the tables are shoal::ps::Embedding, whose
//               rows a step touched are pulled and pushed; the dense layers are dense tables.
//   --impl dp   with shoal::DataParallel over torch::nn::Embedding tables with dense gradients:
//               every worker holds the whole tables, and every step all-reduces their gradient
//               (and the dense layers') and applies Adagrad to the whole of them.
//
//   SHOAL_PS_MODE=sync shoal run --servers S -n W ps_ctr --impl ps [--vocabulary 100000] ...
//   shoal run -n W ps_ctr --impl dp [--vocabulary 100000] ...
//
// Same data (shoal::datasets::SyntheticCtr with the given vocabulary per field; each worker trains
// its own --batch samples per step, different on every worker), same model (DeepFM: first-order
// weights and 8-wide embeddings of 26 fields in one table each, an MLP 64-32 beside them), same
// optimizer (Adagrad, lr 0.02). Batches are made before anything is timed. After --warmup
// untimed steps, --steps steps are timed between two barriers; the main worker prints
//
//   ps-ctr impl=ps mode=sync workers=2 servers=2 vocabulary=100000 batch=512 steps=20
//     samples_per_s=... step_ms=... distinct_ids=... bytes_per_step=... table_mb=...
//
// on one line. samples_per_s counts every worker's samples over the slowest worker's timed steps.
// bytes_per_step is what one worker sends and receives per step, computed from what the program
// observes, values only (ids and framing not counted):
//   ps: (distinct ids of the worker's batch) x (1 + dim) x 4 bytes, pulled and pushed, plus the
//       dense parameters x 4 bytes, pushed and pulled; distinct_ids is the mean over timed steps
//       and workers;
//   dp: (the tables' and the dense layers' parameters) x 4 bytes x 2 (W - 1) / W, a ring
//       all-reduce's traffic per worker.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include "shoal/datasets/synthetic_ctr.h"
#include "shoal/shoal.h"

namespace {

using Clock = std::chrono::steady_clock;

// DeepFM as examples/ctr.cpp writes it (kept in step with it by hand), with the tables either on
// the servers (ps::Embedding) or in the module (torch::nn::Embedding, dense gradients).
struct DeepFmImpl : torch::nn::Module {
  DeepFmImpl(bool on_servers, int fields, int64_t vocabulary, int dense, int dim,
             std::vector<int64_t> hidden)
      : fields_(fields), vocabulary_(vocabulary) {
    const int64_t rows = fields * vocabulary;
    if (on_servers) {
      using shoal::ps::RowInit;
      ps_first = register_module(
          "first",
          shoal::ps::Embedding(shoal::ps::EmbeddingOptions(rows, 1).init(RowInit::zeros())));
      ps_embedding = register_module(
          "embedding", shoal::ps::Embedding(
                           shoal::ps::EmbeddingOptions(rows, dim).init(RowInit::normal(0, 0.01))));
    } else {
      first = register_module("first", torch::nn::Embedding(rows, 1));
      embedding = register_module("embedding", torch::nn::Embedding(rows, dim));
      torch::NoGradGuard no_grad;
      first->weight.zero_();
      embedding->weight.normal_(0, 0.01);
    }
    dense_linear = register_module("dense_linear", torch::nn::Linear(dense, 1));
    int64_t width = fields * dim + dense;
    for (int64_t h : hidden) {
      mlp->push_back(torch::nn::Linear(width, h));
      mlp->push_back(torch::nn::ReLU());
      width = h;
    }
    mlp->push_back(torch::nn::Linear(width, 1));
    register_module("mlp", mlp);
  }

  // The rows of one table for all fields: each field's ids offset by the field's index.
  torch::Tensor rows(const torch::Tensor& ids) const {
    return ids + torch::arange(fields_, ids.options()) * vocabulary_;
  }

  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& dense) {
    const auto r = rows(ids);
    const auto linear = (ps_first ? ps_first->forward(r) : first->forward(r)).sum({1, 2});
    const auto e = ps_embedding ? ps_embedding->forward(r) : embedding->forward(r);
    const auto fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1);
    const auto deep = mlp->forward(torch::cat({e.flatten(1), dense}, 1)).squeeze(1);
    return linear + fm + deep + dense_linear->forward(dense).squeeze(1);
  }

  int fields_;
  int64_t vocabulary_;
  shoal::ps::Embedding ps_first{nullptr}, ps_embedding{nullptr};
  torch::nn::Embedding first{nullptr}, embedding{nullptr};
  torch::nn::Linear dense_linear{nullptr};
  torch::nn::Sequential mlp;
};
TORCH_MODULE(DeepFm);

std::string env_or(const char* name, const char* otherwise) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : otherwise;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("The CTR model with large tables: parameter server or all-reduce (bench/ps_ctr.sh)");
  std::string impl;
  int64_t vocabulary = 100'000, batch = 512;
  int dim = 8, warmup = 3, steps = 20;
  double lr = 0.02;
  app.add_option("--impl", impl, "ps (tables on the servers) or dp (dense all-reduce)")
      ->required()
      ->check(CLI::IsMember({"ps", "dp"}));
  app.add_option("--vocabulary", vocabulary, "Ids per field (default 100000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "Samples per worker and step (default 512)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dim", dim, "Embedding width (default 8)")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "Adagrad's learning rate (default 0.02)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed steps (default 3)")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", steps, "Timed steps (default 20)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  shoal::init();
  torch::set_num_threads(1);
  auto& world = shoal::world();
  const int n = world.size();
  const int64_t rank = shoal::rank();
  const bool on_servers = impl == "ps";

  // Worker r's batch of step i: samples (i * n + r) * batch ... + batch - 1 of the set.
  shoal::datasets::SyntheticCtrOptions data;
  data.vocabulary = vocabulary;
  data.size = (warmup + steps) * n * batch;
  const shoal::datasets::SyntheticCtr set(data);
  std::vector<shoal::datasets::CtrBatch> batches;
  for (int i = 0; i < warmup + steps; ++i)
    batches.push_back(set.range((i * n + rank) * batch, batch));

  torch::manual_seed(0);
  DeepFm model(on_servers, data.fields, vocabulary, data.dense, dim, std::vector<int64_t>{64, 32});
  int64_t table_numel = 0, dense_numel = 0;
  for (const auto& item : model->named_parameters()) {
    const bool table = item.key().rfind("first.", 0) == 0 || item.key().rfind("embedding.", 0) == 0;
    (table ? table_numel : dense_numel) += item.value().numel();
  }
  if (on_servers) table_numel = data.fields * vocabulary * (1 + dim);  // on the servers

  std::unique_ptr<shoal::ps::Optimizer> ps_optimizer;
  std::unique_ptr<shoal::DataParallel<DeepFmImpl>> dp;
  std::unique_ptr<torch::optim::Adagrad> dp_optimizer;
  if (on_servers) {
    ps_optimizer = std::make_unique<shoal::ps::Optimizer>(*model, torch::optim::AdagradOptions(lr));
  } else {
    dp = std::make_unique<shoal::DataParallel<DeepFmImpl>>(model.ptr());
    dp_optimizer = std::make_unique<torch::optim::Adagrad>(model->parameters(),
                                                           torch::optim::AdagradOptions(lr));
  }

  int64_t distinct_sum = 0;  // over the timed steps
  auto step = [&](int i, bool timed) {
    const auto& b = batches[i];
    if (on_servers) {
      ps_optimizer->zero_grad();
      if (timed) distinct_sum += std::get<0>(at::_unique(model->rows(b.ids))).numel();
    } else {
      dp_optimizer->zero_grad();
    }
    const auto logits = dp ? dp->forward(b.ids, b.dense) : model->forward(b.ids, b.dense);
    torch::binary_cross_entropy_with_logits(logits, b.label).backward();
    if (on_servers)
      ps_optimizer->step();
    else
      dp_optimizer->step();
  };
  for (int i = 0; i < warmup; ++i) step(i, false);
  world.barrier();
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) step(warmup + i, true);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  auto reduced = torch::tensor({seconds}, torch::kFloat64);
  world.all_reduce(reduced, {shoal::comm::ReduceOp::kMax});
  auto distinct = torch::tensor({static_cast<double>(distinct_sum)}, torch::kFloat64);
  world.all_reduce(distinct);

  if (shoal::is_main()) {
    const double t = reduced.item<double>();
    const double mean_distinct = distinct.item<double>() / (static_cast<double>(n) * steps);
    const double bytes = on_servers ? 2.0 * 4 * (mean_distinct * (1 + dim) + dense_numel)
                                    : 4.0 * (table_numel + dense_numel) * 2.0 * (n - 1) / n;
    std::printf(
        "ps-ctr impl=%s mode=%s workers=%d servers=%s vocabulary=%lld batch=%lld steps=%d "
        "samples_per_s=%.2f step_ms=%.3f distinct_ids=%.1f bytes_per_step=%.0f table_mb=%.1f "
        "dense_params=%lld\n",
        impl.c_str(), on_servers ? env_or("SHOAL_PS_MODE", "sync").c_str() : "-", n,
        on_servers ? env_or("SHOAL_PS_SERVERS", "0").c_str() : "-",
        static_cast<long long>(vocabulary), static_cast<long long>(batch), steps,
        n * batch * steps / t, t * 1e3 / steps, on_servers ? mean_distinct : 0.0, bytes,
        table_numel * 4 / 1e6, static_cast<long long>(dense_numel));
    std::fflush(stdout);
  }
  world.barrier();
  return 0;
}
