// DeepFM on shoal::datasets::SyntheticCtr, a click-through-rate set whose best possible logloss and
// AUC are known (docs/data.md, "Synthetic CTR"), trained on parameter servers (docs/ps.md). The
// embedding tables (one row per id of every field: 2.6 million rows at the defaults) live on the
// servers, which update only the rows a step touched; the dense layers too. Prints a progress
// line per report and, at the end, the held-out logloss and AUC beside the Bayes optimum's.
//
//   shoal run --servers 2 -n 2 build/examples/ctr [--samples N] [--batch B] [--lr LR] ...
//   SHOAL_PS_MODE=async shoal run --servers 2 -n 2 build/examples/ctr   (or ssp:S)
//   build/examples/ctr                    (one process: the servers' rules, in-process)
//
// Its two parameter-server lines: shoal::init() and shoal::ps::Optimizer; ps::Embedding stands
// where torch::nn::Embedding(...sparse(true)) stood.
#include <chrono>
#include <cstdio>
#include <vector>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "cli.h"
#include "shoal/datasets/synthetic_ctr.h"
#include "shoal/ps/ps.h"
#include "shoal/init.h"

namespace {

using Clock = std::chrono::steady_clock;

// DeepFM (Guo et al. 2017): first-order weights per id, a factorization machine over the ids'
// embeddings, and an MLP over the embeddings and the dense features, added into one logit.
struct DeepFmImpl : torch::nn::Module {
  DeepFmImpl(int fields, int64_t vocabulary, int dense, int dim, std::vector<int64_t> hidden)
      : fields_(fields), vocabulary_(vocabulary) {
    const int64_t rows = fields * vocabulary;
    using shoal::ps::RowInit;
    first = register_module(
        "first", shoal::ps::Embedding(shoal::ps::EmbeddingOptions(rows, 1).init(RowInit::zeros())));
    embedding = register_module(
        "embedding", shoal::ps::Embedding(
                         shoal::ps::EmbeddingOptions(rows, dim).init(RowInit::normal(0, 0.01))));
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

  // ids int64 [rows, fields] (each field's own ids), dense float [rows, dense] -> logits [rows].
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& dense) {
    const auto offsets = torch::arange(fields_, ids.options()) * vocabulary_;
    const auto rows = ids + offsets;                       // one table for all fields
    const auto linear = first->forward(rows).sum({1, 2});  // [rows]
    const auto e = embedding->forward(rows);               // [rows, fields, dim]
    const auto fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1);
    const auto deep = mlp->forward(torch::cat({e.flatten(1), dense}, 1)).squeeze(1);
    return linear + fm + deep + dense_linear->forward(dense).squeeze(1);
  }

  int fields_;
  int64_t vocabulary_;
  shoal::ps::Embedding first{nullptr}, embedding{nullptr};
  torch::nn::Linear dense_linear{nullptr};
  torch::nn::Sequential mlp;
};
TORCH_MODULE(DeepFm);

}  // namespace

int main(int argc, char** argv) {
  int64_t samples = 3'000'000, test_samples = 100'000, batch = 1024;
  int epochs = 1, dim = 8, reports = 10;
  double lr = 0.02;
  uint64_t seed = 0;
  shoal::datasets::SyntheticCtrOptions data;
  CLI::App app{"DeepFM on a synthetic click-through-rate set with a known optimum.", "ctr"};
  app.add_option("--samples", samples, "training samples (the set's first N)")
      ->check(examples::positive());
  app.add_option("--test-samples", test_samples, "held-out samples (the N after the training ones)")
      ->check(examples::positive());
  app.add_option("--epochs", epochs, "passes over the training samples")
      ->check(examples::positive());
  app.add_option("--batch", batch, "samples per step")->check(examples::positive());
  app.add_option("--lr", lr, "Adagrad's learning rate")->check(examples::positive());
  app.add_option("--dim", dim, "embedding width")->check(examples::positive());
  app.add_option("--vocabulary", data.vocabulary, "ids per field")->check(examples::positive());
  app.add_option("--zipf", data.zipf, "the ids' power-law exponent")->check(examples::positive());
  app.add_option("--id-decay", data.id_decay, "how much less rare ids say (docs/data.md)")
      ->check(examples::positive(true));
  app.add_option("--linear-scale", data.linear_scale, "the hidden first-order weights' scale");
  app.add_option("--factor-scale", data.factor_scale, "the hidden factors' scale");
  app.add_option("--seed", seed, "the data set's seed (the model's is 0)");
  app.add_option("--reports", reports, "progress lines per epoch")->check(examples::positive());
  if (const int code = examples::parse(app, argc, argv); code >= 0) return code;

  shoal::init();
  data.seed = seed;
  data.size = samples + test_samples;
  const shoal::datasets::SyntheticCtr set(data);
  torch::manual_seed(0);
  DeepFm model(data.fields, data.vocabulary, data.dense, dim, std::vector<int64_t>{64, 32});
  shoal::ps::Optimizer optimizer(*model, torch::optim::AdagradOptions(lr));
  const int64_t workers = shoal::world_size(), rank = shoal::rank();

  const auto test = set.range(samples, test_samples);
  // The held-out set's forward pulls the rows of its ids: in sync, the values after every step.
  auto evaluate = [&] {
    torch::NoGradGuard no_grad;
    model->eval();
    const auto p = torch::sigmoid(model->forward(test.ids, test.dense));
    model->train();
    return std::make_pair(shoal::datasets::logloss(p, test.label), shoal::datasets::auc(p, test.label));
  };

  const int64_t steps = (samples + batch - 1) / batch;
  const auto start = Clock::now();
  std::vector<size_t> order(samples);
  for (int epoch = 0; epoch < epochs; ++epoch) {
    // A permutation per epoch, the same on every run.
    const auto perm = torch::randperm(samples, torch::TensorOptions().dtype(torch::kLong));
    const int64_t* p = perm.data_ptr<int64_t>();
    for (int64_t i = 0; i < samples; ++i) order[i] = static_cast<size_t>(p[i]);
    double loss_sum = 0;
    int64_t loss_count = 0;
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t first = step * batch, rows = std::min(batch, samples - first);
      // This worker's share of the global batch.
      const int64_t begin = first + rows * rank / workers,
                    end = first + rows * (rank + 1) / workers;
      const auto b = set.get_batch(c10::ArrayRef<size_t>(order.data() + begin, end - begin));
      optimizer.zero_grad();
      const auto loss =
          torch::binary_cross_entropy_with_logits(model->forward(b.ids, b.dense), b.label);
      loss.backward();
      optimizer.step();
      loss_sum += loss.item<double>();
      ++loss_count;
      const bool report =
          (step + 1) % std::max<int64_t>(1, steps / reports) == 0 || step + 1 == steps;
      if (report && shoal::is_main()) {
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        std::printf("epoch %d step %lld/%lld  train logloss %.4f  %.0f samples/s  staleness %lld\n",
                    epoch + 1, static_cast<long long>(step + 1), static_cast<long long>(steps),
                    loss_sum / loss_count,
                    static_cast<double>(epoch * samples + first + rows) / seconds,
                    static_cast<long long>(optimizer.staleness()));
        std::fflush(stdout);
        loss_sum = 0;
        loss_count = 0;
      }
    }
    if (epoch + 1 < epochs && shoal::is_main()) {
      const auto [logloss, auc] = evaluate();
      std::printf("epoch %d  test logloss %.4f  AUC %.4f\n", epoch + 1, logloss, auc);
    }
  }
  if (!shoal::is_main()) return 0;
  const double bayes_logloss = shoal::datasets::logloss(test.probability, test.label);
  const double bayes_auc = shoal::datasets::auc(test.probability, test.label);
  const auto [logloss, auc] = evaluate();
  std::printf("test logloss %.4f (Bayes %.4f)  AUC %.4f (Bayes %.4f, ratio %.4f)\n", logloss,
              bayes_logloss, auc, bayes_auc, auc / bayes_auc);
  return 0;
}
