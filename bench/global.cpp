// One GPT block (shoal::global::nn::TransformerBlock) trained a step at a time in the data,
// tensor (Megatron) and 2-D plans, on the job's workers: step time, and the bytes each worker
// sends per step beside what the same plan needs when written by hand. See bench/RESULTS.md.
//
//   build/bin/shoal run -n 4 build/bench/global [--steps 20] [--batch 8] [--time 64] [--dim 128]
//
// Bytes are counted per worker as ring algorithms send them (shoal::global::sent_bytes()): an
// all-reduce of T bytes among n sends 2T(n-1)/n. The hand plans:
//   data    no activation traffic; every parameter's gradient all-reduced over all workers;
//   tensor  Megatron: per block two all-reduces of the activations forward (after the attention
//           and after the MLP) and two backward; no gradient traffic (Megatron's replicated
//           layer norms and biases get whole gradients on every worker);
//   2-D     Megatron among the tensor axis's workers on each data shard, and every parameter
//           piece's gradient all-reduced along the data axis.
#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>
#include <shoal/global/nn.h>
#include <shoal/shoal.h>

namespace g = shoal::global;

namespace {

struct Plan {
  std::string name;
  g::nn::Layout layout;
  g::NdSbp activations;  // of the block's input and output
  int64_t data_workers = 1, tensor_workers = 1;
};

double ring_all_reduce(double bytes, int64_t n) { return n < 2 ? 0 : 2 * bytes * static_cast<double>(n - 1) / static_cast<double>(n); }

struct Measured {
  double step_ms = 0;
  double boxing_bytes = 0;     // per step, by sent_bytes()
  double gradient_bytes = 0;   // per step, GradientSync's all-reduces (from the parameters' layouts)
  double piece_bytes = 0;      // this worker's pieces of the parameters
};

Measured measure(const Plan& plan, const g::nn::TransformerBlockOptions& options, int64_t batch, int64_t time,
                 int steps) {
  torch::manual_seed(0);
  g::nn::TransformerBlock block(options, plan.layout);
  g::nn::GradientSync sync(block);
  torch::optim::AdamW optimizer(block->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto& placement = plan.layout.placement;
  const auto x = g::randn({batch, time, options.dim}, placement, plan.activations);
  const auto w = g::randn({batch, time, options.dim}, placement, plan.activations);

  Measured m;
  // GradientSync's traffic: each parameter piece all-reduced among the workers holding it.
  for (const auto& [name, parameter] : block->named_global_parameters()) {
    if (!parameter.is_local()) continue;
    const auto holders = static_cast<int64_t>(g::nn::piece_holders(parameter).size());
    m.gradient_bytes += ring_all_reduce(static_cast<double>(parameter.to_local().nbytes()), holders);
    m.piece_bytes += static_cast<double>(parameter.to_local().nbytes());
  }

  auto step = [&] {
    optimizer.zero_grad();
    const auto out = block->forward(x).to_global(plan.activations);
    g::mean(out * w).backward();
    optimizer.step();
  };
  for (int i = 0; i < 3; ++i) step();  // warm up: groups, buckets rebuilt after the first backward
  shoal::world().barrier();
  const int64_t before = g::sent_bytes();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  shoal::world().barrier();
  m.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
  m.boxing_bytes = static_cast<double>(g::sent_bytes() - before) / steps;
  return m;
}

// What the plan sends per worker per step when written by hand (see the top of this file).
// The gradients: the same pieces as shoal's, all-reduced along the data axis only.
std::pair<double, double> hand_bytes(const Plan& plan, const g::nn::TransformerBlockOptions& options, int64_t batch,
                                     int64_t time, double piece_bytes) {
  const double shard = 4.0 * static_cast<double>(batch * time * options.dim) / static_cast<double>(plan.data_workers);
  return {4 * ring_all_reduce(shard, plan.tensor_workers), ring_all_reduce(piece_bytes, plan.data_workers)};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPT block on global tensors: step time and bytes beside hand-written plans"};
  int steps = 20;
  int64_t batch = 8, time = 64;
  g::nn::TransformerBlockOptions options;
  options.dim = 128;
  options.heads = 8;
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--time", time)->check(CLI::PositiveNumber);
  app.add_option("--dim", options.dim)->check(CLI::PositiveNumber);
  app.add_option("--heads", options.heads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  shoal::init();
  const int n = shoal::world_size();
  const auto all = g::Placement::all();

  std::vector<Plan> plans = {
      {"one process", {g::Placement({0}), {}}, g::broadcast(), 1, 1},
      {"data", {all, {}}, g::split(0), n, 1},
      {"tensor", {all, {0}}, g::broadcast(), 1, n},
  };
  if (n % 2 == 0 && n > 2) {
    plans.push_back({"2-D " + std::to_string(2) + "x" + std::to_string(n / 2), {g::Placement::mesh({2, n / 2}), {1}},
                     g::NdSbp{g::split(0), g::broadcast()}, 2, n / 2});
  }
  torch::manual_seed(0);
  double parameter_bytes = 0;
  for (const auto& p : g::nn::TransformerBlock(options, g::nn::Layout{g::Placement({0}), {}})->parameters()) {
    parameter_bytes += static_cast<double>(p.numel() * 4);
  }
  if (shoal::is_main()) {
    std::cout << "GPT block: batch " << batch << ", time " << time << ", dim " << options.dim << ", heads "
              << options.heads << ", " << parameter_bytes / 4 << " parameters; " << n << " workers, " << steps
              << " steps\n\n"
              << "| plan | step ms | boxing KiB/step | hand KiB/step | boxing/hand | gradient sync KiB/step | hand KiB/step |\n"
              << "|---|---:|---:|---:|---:|---:|---:|\n";
  }
  for (const auto& plan : plans) {
    const Measured m = measure(plan, options, batch, time, steps);
    const auto [hand_activations, hand_gradients] = hand_bytes(plan, options, batch, time, m.piece_bytes);
    if (!shoal::is_main()) continue;
    auto kib = [](double bytes) { return bytes / 1024; };
    std::cout << std::fixed << std::setprecision(1) << "| " << plan.name << " | " << m.step_ms << " | "
              << kib(m.boxing_bytes) << " | " << kib(hand_activations) << " | "
              << (hand_activations > 0 ? std::to_string(m.boxing_bytes / hand_activations).substr(0, 5) : std::string("-"))
              << " | " << kib(m.gradient_bytes) << " | " << kib(hand_gradients) << " |" << std::endl;
  }
}
