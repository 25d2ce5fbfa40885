// Parameter-server training throughput on bench/ddp's dense MLP (bench/ps.sh runs it beside
// shoal's DataParallel and PyTorch's RPC parameter servers): the same model, batch, data and SGD
// as bench/ddp.cpp, trained through shoal::ps::Optimizer on the job's servers.
//
//   SHOAL_PS_MODE=sync|async|ssp:S shoal run --servers S -n W ps [--batch 64] [--warmup 3]
//       [--steps 10] [--slow-worker R --slow-ms X] [--step-times]
//
// Each worker uses one intra-op thread. After --warmup untimed steps, --steps steps are timed on
// every worker between two barriers; the main worker prints one line in bench/ddp's format:
//
//   ps impl=shoal-ps mode=sync workers=2 servers=1 batch=64 steps=10 samples_per_s=... step_ms=...
//
// samples_per_s counts every worker's samples over the slowest worker's timed steps. Beside it,
// one line per worker with that worker's own rate over its own timed steps (in async a worker
// does not wait for the others, so the job's rate is the sum of the workers' rates):
//
//   ps-worker rank=1 slow=0 samples_per_s=... step_ms=...
//
// --slow-worker R --slow-ms X makes worker R a straggler: it sleeps X ms in every step, before
// its push (bench/ps_straggler.sh). --step-times prints, per worker, the wall-clock time
// (CLOCK_REALTIME, ns) at which each timed step's pull returned, for bench/ps_failover.sh to set
// beside the time it killed a server, and the main worker says when the timed steps begin:
//
//   ps-timed-start
//   ps-steps rank=0 end_ns=T0,T1,...
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include "shoal/core/timeline.h"
#include "shoal/shoal.h"

namespace {

using Clock = std::chrono::steady_clock;

struct MlpImpl : torch::nn::Module {  // bench/ddp.cpp's
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 2048))),
        fc2(register_module("fc2", torch::nn::Linear(2048, 2048))),
        fc3(register_module("fc3", torch::nn::Linear(2048, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

std::string env_or(const char* name, const char* otherwise) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : otherwise;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Parameter-server training throughput on bench/ddp's MLP (bench/ps.sh)");
  int64_t batch = 64;
  int warmup = 3;
  int steps = 10;
  app.add_option("--batch", batch, "Samples per worker and step (default 64)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed steps (default 3)")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", steps, "Timed steps (default 10)")->check(CLI::PositiveNumber);
  int slow_worker = -1;
  int slow_ms = 0;
  bool step_times = false;
  app.add_option("--slow-worker", slow_worker, "The worker that sleeps --slow-ms in every step")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--slow-ms", slow_ms, "The straggler's added sleep per step, in ms (default 0)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--step-times", step_times,
               "Print each worker's wall-clock time at the end of every timed step");
  bool measure_noise = false;
  app.add_flag("--measure-noise", measure_noise,
               "Measure the gradient noise (ServerOptions::measure_gradient_noise; sync only)");
  CLI11_PARSE(app, argc, argv);

  shoal::init();
  torch::set_num_threads(1);
  auto& world = shoal::world();
  const int n = world.size();
  const int rank = static_cast<int>(shoal::job().rank);
  if (slow_worker >= n) {
    std::fprintf(stderr, "ps: --slow-worker %d is not a worker; expected 0..%d\n", slow_worker,
                 n - 1);
    return 2;
  }
  const bool slow = rank == slow_worker && slow_ms > 0;

  // Different data on every worker, the same from run to run; made before anything is timed.
  torch::manual_seed(1000 + shoal::job().rank);
  constexpr int kBatches = 4;
  std::vector<torch::Tensor> inputs, labels;
  for (int b = 0; b < kBatches; ++b) {
    inputs.push_back(torch::randn({batch, 784}));
    labels.push_back(torch::randint(0, 10, {batch}, torch::kLong));
  }
  torch::manual_seed(0);
  Mlp model;
  shoal::ps::ServerOptions servers;
  servers.measure_gradient_noise = measure_noise;
  servers.batch_size = batch;
  shoal::ps::Optimizer optimizer(*model, torch::optim::SGDOptions(0.01), servers);

  // The step's parts as slices of SHOAL_TIMELINE (docs/ps.md, "A step's timeline").
  auto step = [&](int i) {
    shoal::timeline::Slice whole("step " + std::to_string(i), "train", {{"step", i}});
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      shoal::timeline::Slice forward("forward", "train");
      loss = torch::nn::functional::cross_entropy(model->forward(inputs[i % kBatches]),
                                                  labels[i % kBatches]);
    }
    {
      shoal::timeline::Slice backward("backward", "train");
      loss.backward();
    }
    if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    shoal::timeline::Slice optimizer_step("optimizer.step()", "train");
    optimizer.step();
  };
  for (int i = 0; i < warmup; ++i) step(i);
  world.barrier();
  if (step_times && shoal::is_main()) {
    std::printf("ps-timed-start\n");  // bench/ps_failover.sh kills a server after this line
    std::fflush(stdout);
  }
  std::vector<int64_t> end_ns;
  end_ns.reserve(steps);
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) {
    step(warmup + i);
    if (step_times)
      end_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count());
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Each worker's own rate, gathered so that the main worker prints them in rank order.
  const auto own = world.all_gather(torch::tensor({seconds}, torch::kFloat64));
  auto slowest = torch::tensor({seconds}, torch::kFloat64);
  world.all_reduce(slowest,
                   {shoal::comm::ReduceOp::kMax});  // the job is as fast as its slowest worker

  double weight_sum = 0;
  for (const auto& p : model->parameters())
    weight_sum += p.detach().to(torch::kFloat64).abs().sum().item<double>();
  const auto noise = optimizer.gradient_noise();
  if (shoal::is_main()) {
    const double t = slowest.item<double>();
    std::printf(
        "ps impl=shoal-ps mode=%s workers=%d servers=%s batch=%lld steps=%d samples_per_s=%.2f "
        "step_ms=%.3f staleness=%lld weight_abs_sum=%.6f noise_scale=%.1f noise_steps=%lld\n",
        env_or("SHOAL_PS_MODE", "sync").c_str(), n, env_or("SHOAL_PS_SERVERS", "0").c_str(),
        static_cast<long long>(batch), steps, n * batch * steps / t, t * 1e3 / steps,
        static_cast<long long>(optimizer.staleness()), weight_sum,
        noise ? noise->noise_scale() : 0.0, static_cast<long long>(noise ? noise->measurements : 0));
    for (int r = 0; r < n; ++r) {
      const double tr = own[r].item<double>();
      std::printf("ps-worker rank=%d slow=%d samples_per_s=%.2f step_ms=%.3f\n", r,
                  r == slow_worker && slow_ms > 0 ? 1 : 0, batch * steps / tr, tr * 1e3 / steps);
    }
    std::fflush(stdout);
  }
  if (step_times) {
    std::string line = "ps-steps rank=" + std::to_string(rank) + " end_ns=";
    for (size_t i = 0; i < end_ns.size(); ++i)
      line += (i == 0 ? "" : ",") + std::to_string(end_ns[i]);
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  world.barrier();
  return 0;
}
