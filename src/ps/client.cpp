#include "client.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <numeric>
#include <sstream>
#include <thread>

#include "comm/store.h"
#include "connect.h"
#include "fan_out.h"
#include "mode.h"
#include "rpc.h"
#include "server_core.h"
#include "shoal/comm/group.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"
#include "shoal/core/timeline.h"
#include "shoal/runtime/init.h"
#include "squares.h"

namespace shoal::ps {
namespace detail {
namespace {

class RemoteEndpoint : public Client::Endpoint {
 public:
  explicit RemoteEndpoint(std::unique_ptr<RpcClient> client) : client_(std::move(client)) {}
  void register_tables(const RegisterRequest& request, Duration timeout) override {
    client_->register_tables(request, timeout);
  }
  void pull(const PullRequest& request, Duration timeout, PullReply& reply,
            const DenseSink* sink) override {
    client_->pull(request, timeout, reply, sink);
  }
  PushReply push(PushRequest& request, Duration timeout, const DenseSource* source) override {
    return source ? client_->push(request, timeout, *source) : client_->push(request, timeout);
  }
  LeaseReply lease(const LeaseRequest& request, Duration timeout) override {
    return client_->lease(request, timeout);
  }
  MembershipReply membership(const MembershipRequest& request, Duration timeout) override {
    return client_->membership(request, timeout);
  }

 private:
  std::unique_ptr<RpcClient> client_;
};

// Note [A job of one without servers].
class LocalEndpoint : public Client::Endpoint {
 public:
  LocalEndpoint() : core_(options()) {}
  void register_tables(const RegisterRequest& request, Duration timeout) override {
    core_.register_tables(request, Deadline(timeout));
  }
  void pull(const PullRequest& request, Duration timeout, PullReply& reply,
            const DenseSink* /*sink*/) override {
    core_.pull(request, Deadline(timeout), reply);
  }
  PushReply push(PushRequest& request, Duration timeout, const DenseSource* source) override {
    if (source) source->fill_slices(request.dense);
    return core_.push_taking(request, Deadline(timeout));
  }
  LeaseReply lease(const LeaseRequest& request, Duration timeout) override {
    return core_.lease(request, Deadline(timeout));
  }
  MembershipReply membership(const MembershipRequest& request, Duration timeout) override {
    return core_.membership(request, Deadline(timeout));
  }

 private:
  static ServerCoreOptions options() {
    ServerCoreOptions options;
    options.mode_from_workers = true;  // one worker: every mode trains alike
    options.workers = {0};
    options.shards.resize(kVirtualShards);
    std::iota(options.shards.begin(), options.shards.end(), 0);
    return options;
  }
  ServerCore core_;
};

// The worker's id at the servers: its rank, or in an elastic job the id its launcher gave it,
// which no other worker of the job ever had (a restarted worker gets a new one).
int32_t worker_id() {
  const auto id = env::get_int(env::current(), "SHOAL_PS_WORKER", 0, INT32_MAX);
  return id ? static_cast<int32_t>(*id) : static_cast<int32_t>(shoal::rank());
}

std::vector<std::unique_ptr<Client::Endpoint>> open_servers(Duration timeout) {
  std::vector<std::unique_ptr<Client::Endpoint>> servers;
  const env::Environment env = env::current();
  const int count = server_count(env);
  if (count == 0) {
    if (shoal::world_size() > 1) {
      throw UsageError("shoal::ps::Optimizer: this job's " + std::to_string(shoal::world_size()) +
                       " workers have no parameter servers (SHOAL_PS_SERVERS is not set); "
                       "expected a job started with shoal run --servers S");
    }
    servers.push_back(std::make_unique<LocalEndpoint>());
    return servers;
  }
  const JobSpec& job = shoal::job();
  comm::StoreOptions options;
  options.host = job.master_addr;
  options.port = job.master_port;
  options.described_as =
      job.master_described_as.empty() ? options.described_as : job.master_described_as;
  options.timeout = timeout;
  const comm::StorePtr store = comm::open_store(options);
  for (auto& client : connect_servers(store, count, job_token(env), timeout)) {
    servers.push_back(std::make_unique<RemoteEndpoint>(std::move(client)));
  }
  return servers;
}

// The model's ps::Embedding modules with their paths, in named_modules' order.
std::vector<std::pair<std::string, std::shared_ptr<EmbeddingImpl>>> tables_of(
    torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<EmbeddingImpl>>> tables;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (auto table = std::dynamic_pointer_cast<EmbeddingImpl>(item.value())) {
      tables.emplace_back(item.key().empty() ? "embedding" : item.key(), table);
    }
  }
  return tables;
}

InitSpec init_spec(const RowInit& init) {
  switch (init.kind) {
    case RowInit::Kind::kZeros:
      return {InitSpec::Kind::kZeros, 0, 0};
    case RowInit::Kind::kUniform:
      return {InitSpec::Kind::kUniform, init.a, init.b};
    case RowInit::Kind::kNormal:
      return {InitSpec::Kind::kNormal, init.a, init.b};
  }
  throw InternalError("unknown RowInit kind");
}

}  // namespace

Client::Client(torch::nn::Module& model, const OptimizerSpec& optimizer, const ps::ServerOptions& options)
    : timeout_(options.timeout == kUnsetTimeout ? shoal::world().timeout() : options.timeout),
      servers_(open_servers(timeout_)),
      map_(static_cast<int32_t>(servers_.size())),
      worker_(worker_id()),
      elastic_(env::get_bool(env::current(), "SHOAL_PS_ELASTIC").value_or(false)),
      backup_workers_(env::get_int(env::current(), "SHOAL_PS_BACKUP_WORKERS", 0).value_or(0) > 0),
      mode_(resolve_mode(options.mode)) {
  if (options.measure_gradient_noise) {
    if (mode_.kind != Mode::kSync) {
      throw UsageError("shoal::ps::Optimizer: measure_gradient_noise in mode " + mode_name(mode_) +
                       "; expected sync, whose steps average every worker's gradient");
    }
    if (options.batch_size < 0) {
      throw UsageError("shoal::ps::Optimizer: batch_size is " + std::to_string(options.batch_size) +
                       "; expected each worker's batch in samples (0: not given)");
    }
    noise_ = std::make_unique<dp::NoiseMeter>(options.gradient_noise_smoothing,
                                              "shoal::ps::Optimizer: gradient_noise_smoothing");
    noise_batch_ = options.batch_size;
  }
  const int32_t server_count = map_.servers();
  std::vector<TableSpec> tables;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const torch::Tensor& parameter = item.value();
    if (parameter.scalar_type() != torch::kFloat || !parameter.device().is_cpu() ||
        !parameter.is_contiguous()) {
      throw UsageError("shoal::ps::Optimizer: parameter '" + item.key() + "' is " +
                       std::string(parameter.dtype().name()) + " on " + parameter.device().str() +
                       (parameter.is_contiguous() ? "" : ", not contiguous") +
                       "; expected contiguous float32 on the CPU");
    }
    Dense dense{item.key(), parameter, std::vector<std::vector<int64_t>>(server_count)};
    for (int64_t k = 0; k < chunk_count(parameter.numel()); ++k) {
      dense.chunks[map_.owner(chunk_shard(dense.name, k))].push_back(k);
    }
    TableSpec spec;
    spec.name = dense.name;
    spec.shape = parameter.sizes().vec();
    spec.optimizer = optimizer;
    tables.push_back(spec);
    dense_.push_back(std::move(dense));
  }
  for (auto& [name, module] : tables_of(model)) {
    if (!module->client_.expired()) {
      throw UsageError("shoal::ps::Optimizer: ps::Embedding '" + name +
                       "' already belongs to another shoal::ps::Optimizer; expected one per model");
    }
    TableSpec spec;
    spec.name = name;
    spec.sparse = true;
    spec.shape = {module->options_.num_embeddings(), module->options_.embedding_dim()};
    spec.optimizer = optimizer;
    spec.init = init_spec(module->options_.init());
    spec.seed = module->options_.seed();
    tables.push_back(spec);
    sparse_.push_back({name, module});
  }

  for_each_server([&](int32_t s) {
    RegisterRequest request{worker_, tables, {}, mode_name(mode_)};
    // The first worker's values create the dense tables (docs/ps.md, "Sharding").
    if (worker_ == 0) {
      for (size_t t = 0; t < dense_.size(); ++t) {
        DenseSlice slice{static_cast<int32_t>(t), dense_[t].chunks[s], {}};
        const float* values = dense_[t].parameter.data_ptr<float>();
        const int64_t numel = dense_[t].parameter.numel();
        for (int64_t k : slice.chunks) {
          slice.values.insert(slice.values.end(), values + chunk_begin(k),
                              values + chunk_begin(k) + chunk_length(numel, k));
        }
        request.initial.push_back(std::move(slice));
      }
    }
    servers_[s]->register_tables(request, timeout_);
  });
  if (elastic_) join();
  pull_dense();
}

void Client::join() {
  std::vector<int64_t> clocks(servers_.size(), 0);
  for (int round = 0; round < 2; ++round) {
    const int64_t highest = *std::max_element(clocks.begin(), clocks.end());
    for_each_server([&](int32_t s) {
      clocks[s] = servers_[s]
                      ->membership({MembershipRequest::Op::kJoin, worker_, highest}, timeout_)
                      .clock;
    });
  }
  const int64_t clock = *std::max_element(clocks.begin(), clocks.end());
  if (*std::min_element(clocks.begin(), clocks.end()) != clock) {
    throw CommError("worker " + std::to_string(worker_) +
                    " joined the parameter servers at different clocks (" +
                    std::to_string(*std::min_element(clocks.begin(), clocks.end())) + " and " +
                    std::to_string(clock) + "); expected one after the second round");
  }
  clock_ = clock;
}

Client::~Client() = default;

class Client::Leases : public data::BatchLeases {
 public:
  explicit Leases(std::weak_ptr<Client> client) : client_(std::move(client)) {}
  Lease next(int64_t epoch, int64_t dataset_size, int64_t batch_size, bool drop_last) override {
    const auto client = client_.lock();
    if (!client) {
      throw UsageError(
          "shoal::ps::Optimizer::train_on: the loader asked for a batch after its optimizer was "
          "destroyed; expected the optimizer to outlive the loop");
    }
    return client->lease(epoch, dataset_size, batch_size, drop_last);
  }

 private:
  std::weak_ptr<Client> client_;
};

void Client::train_on(data::Sampler& sampler) {
  if (leasing_) {
    throw UsageError(
        "shoal::ps::Optimizer::train_on: called twice; expected one loader per optimizer (the "
        "servers keep one ledger of batches)");
  }
  async_ = mode_.kind == Mode::kAsync;
  sampler.lease_from(std::make_shared<Leases>(weak_from_this()));
  leasing_ = true;
}

data::BatchLeases::Lease Client::lease(int64_t epoch, int64_t dataset_size, int64_t batch_size,
                                       bool drop_last) {
  using Kind = data::BatchLeases::Lease::Kind;
  if (leased_) {
    throw UsageError("shoal::ps::Optimizer::train_on: the loader handed out batch " +
                     std::to_string(leased_->batch) + " of epoch " +
                     std::to_string(leased_->epoch) +
                     " and no step() pushed its gradient; expected one step() per batch");
  }
  const LeaseReply reply = servers_[0]->lease(
      LeaseRequest{worker_, epoch, dataset_size, batch_size, drop_last}, timeout_);
  leased_.reset();
  switch (reply.kind) {
    case LeaseReply::Kind::kBatch:
      leased_ = reply;
      return {Kind::kBatch, reply.begin, reply.end};
    case LeaseReply::Kind::kWait:
      // The epoch's last batches are out with other workers: an idle step. In async nothing
      // paces it (no pull waits), so it waits a moment before it asks again.
      if (async_) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return {Kind::kIdle, 0, 0};
    case LeaseReply::Kind::kEpochDone:
      return {Kind::kEpochDone, 0, 0};
  }
  throw CommError("parameter server 0 answered a lease with an unknown kind " +
                  std::to_string(static_cast<int32_t>(reply.kind)));
}

void Client::bind() {
  for (size_t t = 0; t < sparse_.size(); ++t) {
    sparse_[t].module->client_ = weak_from_this();
    sparse_[t].module->table_ = static_cast<int32_t>(dense_.size() + t);
  }
}

template <typename Call>
void Client::for_each_server(const Call& call) {
  const int count = static_cast<int>(servers_.size());
  if (count > 1 && !pool_) pool_ = make_pool(count - 1);
  fan_out(pool_.get(), count, [&](int s) { call(static_cast<int32_t>(s)); });
}

std::vector<std::vector<int64_t>> Client::route_rows(const std::string& table, const int64_t* ids,
                                                     int64_t count,
                                                     std::vector<std::vector<int64_t>>* at) const {
  std::vector<std::vector<int64_t>> by_server(servers_.size());
  at->assign(servers_.size(), {});
  for (int64_t i = 0; i < count; ++i) {
    const int32_t s = map_.owner(row_shard(table, ids[i]));
    by_server[s].push_back(ids[i]);
    (*at)[s].push_back(i);
  }
  return by_server;
}

void Client::pull_dense() {
  // Measuring the noise, every server is asked: each holds a part of the measurement.
  if (dense_.empty() && !elastic_ && !noise_) return;
  const size_t count = servers_.size();
  if (pull_.size() != count) {
    pull_.assign(count, {});
    pulled_.assign(count, {});
    for (size_t s = 0; s < count; ++s) {
      for (size_t t = 0; t < dense_.size(); ++t) {
        if (!dense_[t].chunks[s].empty()) {
          pull_[s].dense.push_back({static_cast<int32_t>(t), dense_[t].chunks[s], {}});
        }
      }
    }
  }
  for_each_server([&](int32_t s) {
    PullRequest& request = pull_[s];
    // elastic: the pull seals the step's push; measuring: it brings the server's part
    if (request.dense.empty() && !elastic_ && !noise_) return;
    request.worker = worker_;
    request.clock = clock_;
    const auto server = [s] { return "parameter server " + std::to_string(s); };
    // Slice i of the reply, `count` values at `values`, into the parameters' chunks it names.
    std::vector<bool> scattered(request.dense.size(), false);
    auto scatter = [&](size_t i, const DenseSlice& slice, const float* from, size_t count) {
      if (i >= request.dense.size()) {
        throw CommError(server() + " answered a pull of " + std::to_string(request.dense.size()) +
                        " dense tables with more");
      }
      if (slice.table != request.dense[i].table || slice.chunks != request.dense[i].chunks) {
        throw CommError(server() + " answered a pull of table " +
                        std::to_string(request.dense[i].table) + " with other chunks");
      }
      const Dense& dense = dense_.at(static_cast<size_t>(slice.table));
      const int64_t numel = dense.parameter.numel();
      const size_t length = chunks_length(numel, slice.chunks);
      if (length > count) {
        throw CommError(server() + " answered a pull of '" + dense.name + "' with " +
                        std::to_string(count) + " values, fewer than its chunks hold");
      }
      float* values = dense.parameter.data_ptr<float>();
      size_t at = 0;
      for (int64_t k : slice.chunks) {
        const int64_t n = chunk_length(numel, k);
        std::memcpy(values + chunk_begin(k), from + at, static_cast<size_t>(n) * sizeof(float));
        at += static_cast<size_t>(n);
      }
      scattered[i] = true;
    };
    // Note [Pulled values in place]: values that came through the shared segment go from there
    // straight into the parameters, one copy where decoding them into the reply and copying that
    // into the parameters were two passes over the model's size per step.
    const DenseSink sink = scatter;
    PullReply& reply = pulled_[s];
    {
      // The name is made only when the timeline records (a step's calls are its hot path).
      timeline::Slice slice(timeline::enabled() ? "pull from server " + std::to_string(s) : "",
                            "ps", {{"server", s}, {"clock", clock_}});
      servers_[s]->pull(request, timeout_, reply, &sink);
    }
    if (reply.dense.size() != request.dense.size()) {
      throw CommError(server() + " answered a pull of " + std::to_string(request.dense.size()) +
                      " dense tables with " + std::to_string(reply.dense.size()));
    }
    if (s == 0) staleness_ = reply.staleness;
    for (size_t i = 0; i < reply.dense.size(); ++i) {
      const DenseSlice& slice = reply.dense[i];
      if (!scattered[i]) scatter(i, slice, slice.values.data(), slice.values.size());
    }
  });
  if (noise_) add_noise();
}

void Client::add_noise() {
  const NoisePart& first = pulled_.at(0).noise;
  if (first.step < 0 || first.step <= noise_step_) return;
  double local_sqr = 0, average_sqr = 0;
  for (const PullReply& reply : pulled_) {
    const NoisePart& part = reply.noise;
    // A server that measured another step (or none) leaves this one out.
    if (part.step != first.step || part.small != first.small || part.big != first.big) return;
    local_sqr += part.local_sqr;
    average_sqr += part.average_sqr;
  }
  if (!(first.small > 0 && first.big > first.small)) {
    throw CommError("parameter server 0 measured step " + std::to_string(first.step) +
                    " over batches of " + std::to_string(first.small) + " and " +
                    std::to_string(first.big) + " rows; expected 0 < the first < the second");
  }
  noise_step_ = first.step;
  // Rows are samples with leases; without them each push is one row of batch_size samples.
  const double unit = leasing_ ? 1.0 : static_cast<double>(noise_batch_);
  noise_->add(local_sqr, average_sqr, first.small * unit, first.big * unit,
              std::llround(first.big * unit));
}

std::optional<GradientNoise> Client::gradient_noise() const {
  if (!noise_) return std::nullopt;
  return noise_->value();
}

std::vector<double> Client::dense_sqr_by_server(const std::vector<torch::Tensor>& grads) const {
  std::vector<double> sqr(servers_.size(), 0.0);
  for (size_t t = 0; t < dense_.size(); ++t) {
    if (!grads[t].defined()) continue;
    const float* g = grads[t].data_ptr<float>();
    for (size_t s = 0; s < servers_.size(); ++s) {
      for (int64_t k : dense_[t].chunks[s])
        sqr[s] += sum_of_squares(g + chunk_begin(k), chunk_length(grads[t].numel(), k));
    }
  }
  return sqr;
}

torch::Tensor Client::lookup(EmbeddingImpl& table, const torch::Tensor& ids) {
  const int64_t dim = table.options_.embedding_dim();
  const std::string& name = sparse_of(table).name;
  if (!c10::isIntegralType(ids.scalar_type(), /*includeBool=*/false)) {
    throw UsageError("ps::Embedding '" + name + "': ids are " + std::string(ids.dtype().name()) +
                     "; expected an integer tensor");
  }
  const auto [distinct, inverse] =
      torch::_unique(ids.reshape({-1}).to(torch::kLong), /*sorted=*/true, /*return_inverse=*/true);
  const int64_t count = distinct.numel();
  const int64_t* id = distinct.data_ptr<int64_t>();
  const int64_t rows = table.options_.num_embeddings();
  if (count > 0 && (id[0] < 0 || (rows > 0 && id[count - 1] >= rows))) {
    throw UsageError("ps::Embedding '" + name + "': id " +
                     std::to_string(id[0] < 0 ? id[0] : id[count - 1]) +
                     " is out of range; expected 0 <= id" +
                     (rows > 0 ? " < " + std::to_string(rows) : std::string()));
  }
  torch::Tensor values = torch::empty({count, dim}, torch::kFloat);
  std::vector<std::vector<int64_t>> at;
  const auto by_server = route_rows(name, id, count, &at);
  for_each_server([&](int32_t s) {
    if (by_server[s].empty()) return;
    PullRequest request{worker_, clock_, {}, {{table.table_, by_server[s], {}}}};
    PullReply reply;
    servers_[s]->pull(request, timeout_, reply, nullptr);
    const size_t expected = by_server[s].size() * static_cast<size_t>(dim);
    if (reply.sparse.size() != 1 || reply.sparse[0].values.size() != expected) {
      throw CommError("parameter server " + std::to_string(s) + " answered a pull of " +
                      std::to_string(by_server[s].size()) + " rows of '" + name +
                      "' with another number of values");
    }
    float* out = values.data_ptr<float>();
    const float* in = reply.sparse[0].values.data();
    for (size_t i = 0; i < at[s].size(); ++i) {
      std::memcpy(out + at[s][i] * dim, in + i * dim, static_cast<size_t>(dim) * sizeof(float));
    }
  });
  if (torch::GradMode::is_enabled()) {
    values.requires_grad_(true);
    table.pieces_.push_back({distinct, values});
  }
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(dim);
  return values.index_select(0, inverse.reshape({-1})).view(shape);
}

void Client::zero_grad() {
  for (auto& dense : dense_) {
    if (dense.parameter.grad().defined()) dense.parameter.mutable_grad().zero_();
  }
  for (auto& sparse : sparse_) sparse.module->pieces_.clear();
}

void Client::step() {
  // Each table's gradient rows: the distinct ids its forwards pulled this step, their gradients
  // summed over the forwards.
  struct Rows {
    torch::Tensor ids, grads;
    std::vector<std::vector<int64_t>> by_server, at;
  };
  std::vector<Rows> rows(sparse_.size());
  for (size_t t = 0; t < sparse_.size(); ++t) {
    std::vector<torch::Tensor> ids, grads;
    for (const auto& piece : sparse_[t].module->pieces_) {
      if (!piece.rows.grad().defined()) continue;
      ids.push_back(piece.ids);
      grads.push_back(piece.rows.grad());
    }
    sparse_[t].module->pieces_.clear();
    if (ids.empty()) continue;
    Rows& r = rows[t];
    if (ids.size() == 1) {
      r.ids = ids[0];
      r.grads = grads[0].contiguous();
    } else {
      const auto [distinct, inverse] =
          torch::_unique(torch::cat(ids), /*sorted=*/true, /*return_inverse=*/true);
      r.ids = distinct;
      r.grads = torch::zeros({distinct.numel(), grads[0].size(1)}, torch::kFloat)
                    .index_add_(0, inverse, torch::cat(grads));
    }
    r.by_server = route_rows(sparse_[t].name, r.ids.data_ptr<int64_t>(), r.ids.numel(), &r.at);
  }

  std::vector<torch::Tensor> grads(dense_.size());
  for (size_t t = 0; t < dense_.size(); ++t) {
    const torch::Tensor& grad = dense_[t].parameter.grad();
    if (grad.defined()) grads[t] = grad.to(torch::kFloat).contiguous();
  }

  // With leased batches (train_on) the push carries its batch and weighs as many as its rows; a
  // step without a batch is idle: no rows, no gradients (docs/ps.md, "Leased batches").
  int64_t samples = 1, epoch = 0, batch = -1;
  if (noise_ && !leasing_ && noise_batch_ == 0) {
    throw UsageError(
        "shoal::ps::Optimizer: measure_gradient_noise needs each worker's batch in samples; "
        "expected ServerOptions::batch_size > 0, or train_on(loader), whose leases carry it");
  }
  if (leasing_) {
    samples = leased_ ? leased_->end - leased_->begin : 0;
    if (leased_) {
      epoch = leased_->epoch;
      batch = leased_->batch;
    }
    leased_.reset();
  }
  // Every server gets a push every step, empty where it holds nothing of this step, so that every
  // server sees every worker's clock (docs/ps.md, "Consistency").
  push_.resize(servers_.size());
  PushRequest::Verdict verdict = PushRequest::Verdict::kDecide;
  // Note [Pushed values in place]: a push's dense gradients are written by its endpoint where it
  // sends them from (the shared segment of a server on this host), straight from the parameters'
  // gradients: one pass over the model's size per step where gathering them into the request and
  // copying that into the segment were two.
  std::vector<DenseSource> sources(servers_.size());
  std::vector<double> sqr;  // Note [The gradient noise on servers] (server_sum.cpp)
  if (noise_ && samples > 0) {
    sqr = dense_sqr_by_server(grads);
    for (const Rows& r : rows) {
      if (!r.grads.defined()) continue;
      const int64_t dim = r.grads.size(1);
      const float* g = r.grads.data_ptr<float>();
      for (size_t s = 0; s < servers_.size(); ++s) {
        for (int64_t row : r.at[s]) sqr[s] += sum_of_squares(g + row * dim, dim);
      }
    }
  }
  auto push_to = [&](int32_t s) {
    // The request kept from the step before: its slices' storage is refilled, not allocated.
    PushRequest& request = push_[s];
    request.worker = worker_;
    request.clock = clock_;
    request.rows = samples;
    request.epoch = epoch;
    request.batch = batch;
    request.verdict = s == 0 ? PushRequest::Verdict::kDecide : verdict;
    request.gradient_sqr = sqr.empty() ? -1 : sqr[s];
    size_t used = 0;
    if (samples == 0) {  // idle: no gradients
      request.dense.clear();
      request.sparse.clear();
      return servers_[s]->push(request, timeout_, nullptr);
    }
    DenseSource& source = sources[s];
    for (size_t t = 0; t < dense_.size(); ++t) {
      if (!grads[t].defined() || dense_[t].chunks[s].empty()) continue;
      if (used == request.dense.size()) request.dense.emplace_back();
      DenseSlice& slice = request.dense[used++];
      slice.table = static_cast<int32_t>(t);
      slice.chunks = dense_[t].chunks[s];
      slice.values.clear();
      source.counts.push_back(chunks_length(grads[t].numel(), slice.chunks));
    }
    request.dense.resize(used);
    source.fill = [&request, &grads](size_t i, float* out) {
      const DenseSlice& slice = request.dense[i];
      const torch::Tensor& grad = grads[static_cast<size_t>(slice.table)];
      const float* g = grad.data_ptr<float>();
      for (int64_t k : slice.chunks) {
        const int64_t n = chunk_length(grad.numel(), k);
        std::memcpy(out, g + chunk_begin(k), static_cast<size_t>(n) * sizeof(float));
        out += n;
      }
    };
    request.sparse.clear();
    for (size_t t = 0; t < sparse_.size(); ++t) {
      const Rows& r = rows[t];
      if (!r.ids.defined() || r.by_server[s].empty()) continue;
      const int64_t dim = r.grads.size(1);
      SparseSlice slice{static_cast<int32_t>(dense_.size() + t), r.by_server[s], {}};
      slice.values.resize(r.by_server[s].size() * static_cast<size_t>(dim));
      const float* g = r.grads.data_ptr<float>();
      for (size_t i = 0; i < r.at[s].size(); ++i) {
        std::memcpy(slice.values.data() + i * dim, g + r.at[s][i] * dim,
                    static_cast<size_t>(dim) * sizeof(float));
      }
      request.sparse.push_back(std::move(slice));
    }
    timeline::Slice slice(timeline::enabled() ? "push to server " + std::to_string(s) : "", "ps",
                          {{"server", s}, {"clock", clock_}});
    return servers_[s]->push(request, timeout_, &source);
  };
  if (backup_workers_ && servers_.size() > 1) {
    // Note [Server 0 decides] (server_steps.cpp): server 0's answer goes to the others.
    verdict = push_to(0).counted ? PushRequest::Verdict::kCounted : PushRequest::Verdict::kDropped;
    for_each_server([&](int32_t s) {
      if (s > 0) push_to(s);
    });
  } else {
    for_each_server([&](int32_t s) { push_to(s); });
  }
  ++clock_;
  pull_dense();
}

}  // namespace detail
}  // namespace shoal::ps
