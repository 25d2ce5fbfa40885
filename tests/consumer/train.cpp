// A plain LibTorch regression made distributed with shoal's lines, built outside shoal's tree
// against an installed copy (tests/install_test.sh). It holds its own oracle, the same program in
// one process: beside the model trained shoal's way, each worker trains a copy the plain way on
// the whole global batches, and the parameters must agree; a global matmul must equal
// torch::matmul after the same seed. Prints one line per worker and exits 1 on a mismatch.
#include <torch/torch.h>

#include <cstdio>

#include <shoal/global/ops.h>
#include <shoal/shoal.h>

namespace {

struct Points : torch::data::datasets::Dataset<Points> {
  Points(torch::Tensor x, torch::Tensor y) : x(std::move(x)), y(std::move(y)) {}
  torch::data::Example<> get(size_t i) override {
    return {x[static_cast<int64_t>(i)], y[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
  torch::Tensor x, y;
};

constexpr int64_t kSamples = 16, kBatch = 8;

}  // namespace

int main() {
  shoal::init();  // shoal
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({kSamples, 3});
  const torch::Tensor y = x.matmul(torch::tensor({{1.0f}, {-2.0f}, {0.5f}})) + 0.1;
  torch::nn::Linear net(3, 1), reference(3, 1);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i)
      reference->parameters()[i].copy_(net->parameters()[i]);
  }

  shoal::DataParallel model(net);  // shoal
  shoal::data::LoaderOptions options;
  options.batch_size = kBatch;                                    // the global batch
  auto loader = shoal::data::make_loader(Points(x, y), options);  // shoal
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  int64_t steps = 0;
  for (auto& batch : loader.epoch(0)) {
    optimizer.zero_grad();
    torch::mse_loss(net->forward(batch.data), batch.target).backward();
    optimizer.step();
    ++steps;
  }

  torch::optim::SGD plain(reference->parameters(), 0.1);
  for (int64_t i = 0; i < kSamples; i += kBatch) {
    plain.zero_grad();
    torch::mse_loss(reference->forward(x.narrow(0, i, kBatch)), y.narrow(0, i, kBatch)).backward();
    plain.step();
  }
  bool same = steps == kSamples / kBatch;
  for (size_t i = 0; i < net->parameters().size(); ++i)
    same = same && net->parameters()[i].allclose(reference->parameters()[i], 1e-5, 1e-6);

  namespace g = shoal::global;
  torch::manual_seed(1);
  const auto all = g::Placement::all();
  const auto a = g::randn({6, 4}, all, g::split(0));
  const auto b = g::randn({4, 5}, all, g::broadcast());
  const torch::Tensor product = g::matmul(a, b).full();
  torch::manual_seed(1);
  const torch::Tensor ra = torch::randn({6, 4});
  const torch::Tensor rb = torch::randn({4, 5});
  const bool global_same = product.allclose(ra.matmul(rb), 1e-5, 1e-6);

  std::printf("consumer: worker %d of %d: %d steps, parameters %s, global matmul %s\n",
              shoal::rank(), shoal::world_size(), static_cast<int>(steps),
              same ? "as one process" : "DIFFER", global_same ? "as one process" : "DIFFERS");
  return same && global_same ? 0 : 1;
}
