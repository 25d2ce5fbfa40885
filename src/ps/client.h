// A worker's side of parameter-server training (docs/ps.md, "The program"): what
// shoal::ps::Optimizer and shoal::ps::Embedding share. It names the model's tables, routes each
// dense chunk and sparse row to the server the shard map gives it, and carries registrations,
// pulls and pushes to the servers, one thread per server beyond the first.
//
// Note [A job of one without servers]
// A program run without `shoal run --servers` (one process, no SHOAL_PS_SERVERS) trains on an
// in-process ServerCore holding every virtual shard, in sync mode: the same update rules, the
// same lazy rows, the same initial values as on servers, so a program tried on one process
// behaves as it will on many.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/thread_pool.h>
#include <torch/torch.h>

#include "dp/noise_meter.h"
#include "messages.h"
#include "mode.h"
#include "shard_map.h"
#include "shoal/core/timeout.h"
#include "shoal/data/sampler.h"
#include "shoal/ps/ps.h"

namespace shoal::ps::detail {

class Client : public std::enable_shared_from_this<Client> {
 public:
  // Takes the model's dense parameters and ps::Embedding tables, registers them on every
  // server (the first worker's values create the dense tables) and loads the first pull.
  Client(torch::nn::Module& model, const OptimizerSpec& optimizer,
         const ps::ServerOptions& options);
  ~Client();
  // Hands the model's ps::Embedding modules this client (called once, after construction).
  void bind();

  // The rows of `ids` (any shape) of `table`, pulled for this step: [ids..., dim]. Under grad
  // mode the rows are remembered, and their gradient is pushed at step().
  torch::Tensor lookup(EmbeddingImpl& table, const torch::Tensor& ids);

  void zero_grad();
  void step();
  // ps::Optimizer::train_on: the sampler leases its batches from server 0's ledger.
  void train_on(data::Sampler& sampler);
  int64_t clock() const { return clock_; }
  int64_t staleness() const { return staleness_; }
  std::optional<GradientNoise> gradient_noise() const;

  // One server as the client sees it: the gRPC client of a server process, or the in-process
  // core (Note [A job of one without servers]).
  class Endpoint {
   public:
    virtual ~Endpoint() = default;
    virtual void register_tables(const RegisterRequest& request, Duration timeout) = 0;
    // Writes into `reply`, whose storage a caller keeps from step to step; `sink` may take dense
    // values where they arrived instead (DenseSink, messages.h; an endpoint may ignore it).
    virtual void pull(const PullRequest& request, Duration timeout, PullReply& reply,
                      const DenseSink* sink) = 0;
    // The request is the caller's, kept from step to step: an endpoint may change it (take its
    // storage, fill its values). With `source` its dense slices carry no values: the endpoint has
    // them written where it sends them from (DenseSource, messages.h).
    virtual PushReply push(PushRequest& request, Duration timeout, const DenseSource* source) = 0;
    virtual LeaseReply lease(const LeaseRequest& request, Duration timeout) = 0;
    virtual MembershipReply membership(const MembershipRequest& request, Duration timeout) = 0;
  };

 private:
  struct Dense {
    std::string name;
    torch::Tensor parameter;
    std::vector<std::vector<int64_t>> chunks;  // by server: the chunks it holds, ascending
  };
  struct Sparse {
    std::string name;
    std::shared_ptr<EmbeddingImpl> module;
  };

  // Runs call(s) for every server s, concurrently (fan_out.h, on pool_), and rethrows the lowest
  // server's exception.
  template <typename Call>
  void for_each_server(const Call& call);
  // Splits `ids` (distinct) by server; `at[s]` their positions in `ids`.
  std::vector<std::vector<int64_t>> route_rows(const std::string& table, const int64_t* ids,
                                               int64_t count,
                                               std::vector<std::vector<int64_t>>* at) const;
  void pull_dense();
  // |g|^2 of the dense gradients' chunks each server holds: part of what a push carries when
  // measuring the noise (with its sparse rows').
  std::vector<double> dense_sqr_by_server(const std::vector<torch::Tensor>& grads) const;
  // Adds the step the servers' pull replies measured, once, to noise_.
  void add_noise();
  // An elastic job's worker joins every server (Note [Joins and leaves] in server_membership.cpp).
  void join();
  const Sparse& sparse_of(const EmbeddingImpl& table) const {
    return sparse_.at(static_cast<size_t>(table.table_) - dense_.size());
  }

  // The sampler's leases (train_on): the next batch of `epoch` from server 0's ledger, and the
  // lease the loader handed out last, which the next step() pushes the gradient of.
  class Leases;
  data::BatchLeases::Lease lease(int64_t epoch, int64_t dataset_size, int64_t batch_size,
                                 bool drop_last);

  Duration timeout_;  // before servers_: opening them takes it
  bool leasing_ = false;
  bool async_ = false;  // mode async: an idle step waits a moment, nothing paces it
  std::optional<LeaseReply> leased_;
  std::vector<std::unique_ptr<Endpoint>> servers_;
  ShardMap map_;
  int32_t worker_ = 0;
  // An elastic job (SHOAL_PS_ELASTIC): the worker joins by itself, and every step pulls from every
  // server, which seals its push there (Note [Sealed pushes] in server_membership.cpp).
  bool elastic_ = false;
  // shoal run --ps-backup-workers: a step pushes to server 0 first, whose answer (counted or
  // dropped) goes with the push to the others (Note [Server 0 decides] in server_steps.cpp).
  bool backup_workers_ = false;
  // The consistency mode this worker registers with (ServerOptions::mode, or SHOAL_PS_MODE).
  Mode mode_;
  std::vector<Dense> dense_;
  std::vector<Sparse> sparse_;  // table index dense_.size() + i
  int64_t clock_ = 0;
  int64_t staleness_ = 0;
  // ServerOptions::measure_gradient_noise: the meter, fed from the servers' parts of each sync
  // step (Note [The gradient noise on servers] in server_sum.cpp); the samples of a push's row
  // without leases (ServerOptions::batch_size); the last step measured.
  std::unique_ptr<dp::NoiseMeter> noise_;
  int64_t noise_batch_ = 0;
  int64_t noise_step_ = -1;
  // By server: the dense pushes and pulls, kept from step to step so that a step allocates none of
  // the model's size (docs/ps.md, "Transport").
  std::vector<PushRequest> push_;
  std::vector<PullRequest> pull_;
  std::vector<PullReply> pulled_;
  // The threads of the calls to servers 1.. (server 0's runs on the caller's), started at the
  // first call.
  std::unique_ptr<c10::ThreadPool> pool_;
};

}  // namespace shoal::ps::detail
