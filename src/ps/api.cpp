// shoal::ps::Optimizer and shoal::ps::Embedding (shoal/ps/ps.h): the API a program uses, over
// the worker's Client (client.h), which does the work.
#include <string>

#include "client.h"
#include "mode.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal::ps {

EmbeddingImpl::EmbeddingImpl(EmbeddingOptions options) : options_(std::move(options)) {
  if (options_.num_embeddings() < 0 || options_.embedding_dim() < 1) {
    throw UsageError("ps::Embedding(" + std::to_string(options_.num_embeddings()) + ", " +
                     std::to_string(options_.embedding_dim()) +
                     "); expected num_embeddings >= 0 (0: any id) and embedding_dim >= 1");
  }
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  const auto client = client_.lock();
  if (!client) {
    throw UsageError(
        "ps::Embedding: forward before a shoal::ps::Optimizer took the model (or after it was "
        "destroyed); expected the optimizer made first, as its rows live on the servers");
  }
  return client->lookup(*this, ids);
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "shoal::ps::Embedding(num_embeddings=" << options_.num_embeddings()
         << ", embedding_dim=" << options_.embedding_dim() << ")";
}

namespace {

detail::OptimizerSpec spec_of(const torch::optim::SGDOptions& o) {
  detail::OptimizerSpec spec;
  spec.kind = detail::OptimizerSpec::Kind::kSgd;
  spec.lr = o.lr();
  spec.momentum = o.momentum();
  spec.dampening = o.dampening();
  spec.weight_decay = o.weight_decay();
  spec.nesterov = o.nesterov();
  return spec;
}
detail::OptimizerSpec spec_of(const torch::optim::AdagradOptions& o) {
  detail::OptimizerSpec spec;
  spec.kind = detail::OptimizerSpec::Kind::kAdagrad;
  spec.lr = o.lr();
  spec.lr_decay = o.lr_decay();
  spec.weight_decay = o.weight_decay();
  spec.initial_accumulator_value = o.initial_accumulator_value();
  spec.eps = o.eps();
  return spec;
}
detail::OptimizerSpec spec_of(const torch::optim::AdamOptions& o) {
  detail::OptimizerSpec spec;
  spec.kind = detail::OptimizerSpec::Kind::kAdam;
  spec.lr = o.lr();
  spec.beta1 = std::get<0>(o.betas());
  spec.beta2 = std::get<1>(o.betas());
  spec.eps = o.eps();
  spec.weight_decay = o.weight_decay();
  spec.amsgrad = o.amsgrad();
  return spec;
}

std::shared_ptr<detail::Client> make_client(torch::nn::Module& model,
                                            const detail::OptimizerSpec& spec,
                                            const ps::ServerOptions& options) {
  if (!shoal::is_initialized()) {
    throw UsageError(
        "shoal::ps::Optimizer before shoal::init(); expected shoal::init() first, as for "
        "DataParallel");
  }
  // A job of one trains without servers, a job with servers through them: either refuses a bad
  // mode (SHOAL_PS_MODE or ServerOptions::mode) with the same line, before anything trains.
  resolve_mode(options.mode);
  return std::make_shared<detail::Client>(model, spec, options);
}

}  // namespace

Optimizer::Optimizer(torch::nn::Module& model, const torch::optim::SGDOptions& options,
                     ServerOptions servers)
    : client_(make_client(model, spec_of(options), servers)) {
  client_->bind();
}
Optimizer::Optimizer(torch::nn::Module& model, const torch::optim::AdagradOptions& options,
                     ServerOptions servers)
    : client_(make_client(model, spec_of(options), servers)) {
  client_->bind();
}
Optimizer::Optimizer(torch::nn::Module& model, const torch::optim::AdamOptions& options,
                     ServerOptions servers)
    : client_(make_client(model, spec_of(options), servers)) {
  client_->bind();
}
Optimizer::~Optimizer() = default;

void Optimizer::zero_grad() {
  client_->zero_grad();
}
void Optimizer::step() {
  client_->step();
}
void Optimizer::train_on(data::Sampler& sampler) {
  client_->train_on(sampler);
}
int64_t Optimizer::steps() const {
  return client_->clock();
}
int64_t Optimizer::staleness() const {
  return client_->staleness();
}
std::optional<GradientNoise> Optimizer::gradient_noise() const {
  return client_->gradient_noise();
}

}  // namespace shoal::ps
