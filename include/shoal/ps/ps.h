// Parameter-server training (docs/ps.md): the job's servers hold the parameters and apply the
// optimizer; the workers pull the values, compute gradients on their share of the data and push
// them. A program becomes parameter-server trained by replacing its torch optimizer with
// shoal::ps::Optimizer, and its large torch::nn::Embedding tables with shoal::ps::Embedding:
//
//   shoal::init();
//   auto net = std::make_shared<Net>();                                  // may hold ps::Embedding
//   shoal::ps::Optimizer optimizer(*net, torch::optim::AdagradOptions(0.02));
//   ... optimizer.zero_grad(); loss.backward(); optimizer.step(); ...
//
// started with `shoal run --servers 2 -n 4 ./train` (the mode: ServerOptions::mode). Nothing in
// the program names a server or a worker. Run without servers (one process), the same program
// trains with the servers' update rules in-process.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "shoal/core/timeout.h"
#include "shoal/data/sampler.h"
#include "shoal/dp/gradient_noise.h"

namespace shoal::ps {

namespace detail {
class Client;
}

// A sparse table's rows start as a pure function of (seed, table, id): zeros, uniform(a, b) or
// normal(mean a, standard deviation b), on whichever server and in whatever order they are first
// touched (docs/ps.md, "Sharding").
struct RowInit {
  enum class Kind { kZeros, kUniform, kNormal };
  static RowInit zeros() { return {Kind::kZeros, 0, 0}; }
  static RowInit uniform(double low, double high) { return {Kind::kUniform, low, high}; }
  static RowInit normal(double mean, double std) { return {Kind::kNormal, mean, std}; }
  Kind kind = Kind::kNormal;
  double a = 0;
  double b = 1;
};

struct EmbeddingOptions {
  // num_embeddings: the ids are 0 <= id < num_embeddings, or any int64 when 0 (hashed ids; the
  // servers create rows as they are trained).
  EmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  // torch::nn::Embedding's default: normal(0, 1).
  TORCH_ARG(RowInit, init) = RowInit::normal(0, 1);
  TORCH_ARG(uint64_t, seed) = 0;
};

// A torch::nn::Embedding whose rows live on the parameter servers. forward(ids) pulls the rows
// of the batch's distinct ids and returns them as torch's Embedding does ([ids..., dim]); the
// gradient of those rows goes to the servers at the optimizer's step, which updates only them
// (the lazy row-wise rules of PyTorch's SparseAdam and sparse Adagrad). The table is not a
// torch parameter of the module: it is never whole on a worker. Its name on the servers is the
// module's path in the model ("embedding", "tower.ids").
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit EmbeddingImpl(EmbeddingOptions options);

  // ids: an integer tensor of any shape. UsageError before a shoal::ps::Optimizer has taken the
  // model, or for an id outside [0, num_embeddings).
  torch::Tensor forward(const torch::Tensor& ids);

  const EmbeddingOptions& options() const { return options_; }
  void pretty_print(std::ostream& stream) const override;

 private:
  friend class detail::Client;
  EmbeddingOptions options_;
  // Set by the optimizer that took the model; expires with it.
  std::weak_ptr<detail::Client> client_;
  int32_t table_ = -1;
  // This step's pulled rows: distinct ids and a leaf whose gradient the step pushes.
  struct Piece {
    torch::Tensor ids;
    torch::Tensor rows;
  };
  std::vector<Piece> pieces_;
};
TORCH_MODULE(Embedding);

// How a ps::Optimizer trains with the job's servers.
struct ServerOptions {
  // The consistency mode (docs/ps.md, "Consistency"): "sync" (every step applies the mean of all
  // workers' gradients), "ssp:S" (bounded staleness: a worker runs at most S steps ahead of the
  // slowest) or "async" (nothing waits). Empty: sync. SHOAL_PS_MODE, when set, overrides it (as
  // for every worker of the job, so that a run can change it without a rebuild). The servers
  // take the mode from the workers' registration; every worker must ask for the same one.
  std::string mode;
  // The deadline of every pull and push (a sync pull waits for the slowest worker's push);
  // kUnsetTimeout: the job's collective timeout (SHOAL_TIMEOUT, else 10 minutes).
  Duration timeout = kUnsetTimeout;
  // Measure the gradient noise scale during training, as DataParallel does
  // (DataParallelOptions::measure_gradient_noise; docs/ps.md, "Gradient noise"): sync mode only,
  // on every worker alike. Each push carries |g|^2 of its values (a pass over the gradient), each
  // server sums |applied gradient|^2 over what it holds; read it with
  // Optimizer::gradient_noise(). Steps of one worker alone are not measured.
  bool measure_gradient_noise = false;
  // The moving averages' weight of the past, in [0, 1), as DataParallel's.
  double gradient_noise_smoothing = 0.99;
  // Each worker's batch in samples: the noise scale's unit when the loader's batches are not
  // leased (train_on leases carry their rows). Needed with measure_gradient_noise without
  // train_on; 0: not given.
  int64_t batch_size = 0;
};

// The optimizer of a parameter-server trained model. It takes the model's dense parameters and
// its ps::Embedding tables to the job's servers, whose optimizer follows the options given (the
// rules of torch::optim's SGD, Adagrad and Adam for dense parameters, their lazy row-wise
// versions for the tables). Construction registers the tables and loads the first worker's
// values into every worker's parameters, as DataParallel broadcasts them.
//
// step() pushes this worker's gradients (dense: the parameters' .grad(); sparse: the rows this
// step's forwards pulled) and pulls the values of the next step into the parameters. In sync mode
// every step applies the mean of all workers' gradients, so the parameters equal one process
// training on the workers' concatenated batches (equal batches per worker, as DataParallel; with
// train_on, each worker's gradient weighs as many as its batch's rows).
// Needs shoal::init(); without servers (a job of one) the update runs in this process.
class Optimizer {
 public:
  Optimizer(torch::nn::Module& model, const torch::optim::SGDOptions& options, ServerOptions servers = {});
  Optimizer(torch::nn::Module& model, const torch::optim::AdagradOptions& options,
            ServerOptions servers = {});
  Optimizer(torch::nn::Module& model, const torch::optim::AdamOptions& options, ServerOptions servers = {});
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Clears the dense parameters' gradients and the tables' pulled rows.
  void zero_grad();
  // Pushes this step's gradients and pulls the next step's values (sync: after every worker's
  // push of this step is applied). CommError when a server does not answer within the timeout.
  void step();

  // From now on the loader's batches are leased from the servers' ledger (docs/ps.md, "Leased
  // batches"): each epoch's samples are trained once over all workers together, whatever their
  // speed or consistency mode; a fast worker takes more batches than a slow one, and a worker with
  // nothing left gets an empty batch (its step is idle) until the epoch's last batches are done.
  // Each step() carries the gradient of the batch the loader handed out last, weighed by its rows.
  // Call before iterating the loader; one loader per optimizer.
  void train_on(data::Sampler& sampler);
  template <typename Loader>
  void train_on(Loader& loader) {
    train_on(loader.sampler());
  }

  // Steps this worker has pushed.
  int64_t steps() const;
  // The servers' staleness gauge at the last pull: the fastest worker's step count minus the
  // slowest's (0 in sync).
  int64_t staleness() const;
  // The gradient noise measured so far (ServerOptions::measure_gradient_noise), the same on every
  // worker; empty when not measured. See shoal/dp/gradient_noise.h.
  std::optional<GradientNoise> gradient_noise() const;

 private:
  std::shared_ptr<detail::Client> client_;
};

}  // namespace shoal::ps
