// A worker for the multi-host tests of real launchers (mpi_test.cpp): it reports where it ran,
// all-reduces known values and trains a small model, so that a test can compare the job with the
// same program run alone. It prints two lines the tests parse:
//   result rank=R world=W local=L/LW host=NAME netns=net:[INODE] via=ADDR master=HOST:PORT
//          candidates=ADDR,ADDR|- sum=S vector=OK|BAD                     (one line)
//   trained rank=R steps=N loss=L params=P0,P1,...
// `via` is this worker's address on the route to the master, `netns` its network namespace,
// `candidates` the master's addresses that the launcher named when it named several.
// `params` are the trained parameters, flattened in the module's order, printed with %.9g.
// Run with no launcher it is a job of one: the single-process result of the same training.
// A shoal::Error is printed as "host_worker: WHAT" on stderr, exit code 1.
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <string>

#include <torch/torch.h>

#include "shoal/shoal.h"

namespace {

// 60 samples in global batches of 10: shares of 3+3+2+2 on four workers and 4+3+3 on three, so
// that DataParallel's weighing by batch share is what makes the job equal one process.
constexpr int64_t kSamples = 60, kGlobalBatch = 10, kEpochs = 2, kIn = 6, kHidden = 8;

class Points : public torch::data::datasets::Dataset<Points> {
 public:
  Points() {
    torch::manual_seed(7);
    x_ = torch::randn({kSamples, kIn});
    y_ = x_.matmul(torch::linspace(-1, 1, kIn)).unsqueeze(1).sin();
  }
  torch::data::Example<> get(size_t i) override {
    return {x_[static_cast<int64_t>(i)], y_[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(kSamples); }

 private:
  torch::Tensor x_, y_;
};

std::string network_namespace() {
  char target[PATH_MAX] = {};
  const ssize_t length = ::readlink("/proc/self/ns/net", target, sizeof(target) - 1);
  return length > 0 ? std::string(target, length) : "unknown";
}

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

// Trains on every worker's share of each global batch; prints the "trained" line.
void train(int rank) {
  torch::manual_seed(1);  // the same initial model everywhere (DataParallel also broadcasts it)
  auto net = torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
                                   torch::nn::Linear(kHidden, 1));
  shoal::DataParallel model(net);
  shoal::data::LoaderOptions options;
  options.batch_size = kGlobalBatch;
  options.shuffle = true;
  options.seed = 5;
  auto loader = shoal::data::make_loader(Points(), options);
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  int steps = 0;
  double last_loss = 0;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    for (auto& batch : loader.epoch(epoch)) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model(batch.data), batch.target);
      loss.backward();
      optimizer.step();
      // The job's mean loss of the step: each worker's mean weighed by its share of the batch.
      auto weighted = (loss * batch.data.size(0) / kGlobalBatch).detach().reshape({1});
      shoal::world().all_reduce(weighted);
      last_loss = weighted.item<double>();
      ++steps;
    }
  }
  std::string params;
  for (const auto& p : net->parameters()) {
    auto flat = p.detach().flatten();
    for (int64_t i = 0; i < flat.numel(); ++i) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.9g", flat[i].item<double>());
      params += (params.empty() ? "" : ",") + std::string(text);
    }
  }
  std::printf("trained rank=%d steps=%d loss=%.9g params=%s\n", rank, steps, last_loss,
              params.c_str());
}

}  // namespace

int main(int argc, char**) {
  if (argc != 1) {
    std::fprintf(stderr, "usage: host_worker (no arguments)\n");
    return 2;
  }
  try {
    shoal::init();
    auto& world = shoal::world();
    world.set_timeout(std::chrono::seconds(60));
    const int rank = shoal::rank();
    const int n = shoal::world_size();

    // Rank r contributes r + 1: the sum is n(n+1)/2. The vector adds a per-element term, so
    // that a reduction that mixed up elements or ranks could not pass by accident.
    auto sum = torch::full({1}, static_cast<float>(rank + 1));
    world.all_reduce(sum);
    auto vector = torch::arange(1000, torch::kFloat32) * (rank + 1);
    world.all_reduce(vector);
    const bool vector_ok = vector.equal(torch::arange(1000, torch::kFloat32) * (n * (n + 1) / 2));

    const auto& job = shoal::job();
    const std::string via = job.master_addr.empty() ? "-"
                                                    : shoal::comm::local_address_towards(
                                                          job.master_addr, job.master_port);
    std::string candidates;
    for (const auto& address : job.master_candidates)
      candidates += (candidates.empty() ? "" : ",") + address;
    std::printf(
        "result rank=%d world=%d local=%d/%d host=%s netns=%s via=%s master=%s:%d candidates=%s "
        "sum=%g vector=%s\n",
        rank, n, shoal::local_rank(), job.local_world_size, host_name().c_str(),
        network_namespace().c_str(), via.c_str(), job.master_addr.c_str(), job.master_port,
        candidates.empty() ? "-" : candidates.c_str(), sum.item<float>(), vector_ok ? "OK" : "BAD");
    train(rank);
    std::fflush(stdout);
    world.barrier();
    return vector_ok ? 0 : 1;
  } catch (const shoal::Error& e) {
    std::fprintf(stderr, "host_worker: %s\n", e.what());
    return 1;
  }
}
