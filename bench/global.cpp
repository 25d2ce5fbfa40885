// One GPT block (shoal::global::nn::TransformerBlock) trained a step at a time in the data,
// tensor (Megatron) and 2-D plans, on the job's workers: step time, and the bytes each worker
// sends per step beside what the same plan needs when written by hand. See bench/RESULTS.md.
//
//   build/bin/shoal run -n 4 build/bench/global [--steps 20] [--batch 8] [--time 64] [--dim 128]
//                                              [--rounds 3] [--raw FILE]
//
// Each plan runs --rounds rounds of both contenders, shoal's plan first on even rounds and the
// hand plan first on odd ones; the table gives median step times and the median of the rounds'
// ratios. --raw FILE appends one line per round (both step times, the order) from the first
// worker.
//
// Bytes are counted per worker as ring algorithms send them (shoal::global::sent_bytes()): an
// all-reduce of T bytes among n sends 2T(n-1)/n. The hand plans:
//   data    no activation traffic; every parameter's gradient all-reduced over all workers;
//   tensor  Megatron: per block two all-reduces of the activations forward (after the attention
//           and after the MLP) and two backward; no gradient traffic (Megatron's replicated
//           layer norms and biases get whole gradients on every worker);
//   2-D     Megatron among the tensor axis's workers on each data shard, and every parameter
//           piece's gradient all-reduced along the data axis.
// The same plans are also run written by hand, for their step time: the block in plain LibTorch
// on this worker's pieces of the same weights, with Megatron's f and g (an all-reduce in
// backward, and one in forward) over the tensor-parallel workers, wrapped in
// shoal::DataParallel over the data-parallel ones.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <limits>

#include <shoal/global/nn.h>
#include <shoal/shoal.h>
#include <CLI/CLI.hpp>

namespace g = shoal::global;

namespace {

struct Plan {
  std::string name;
  g::nn::Layout layout;
  g::NdSbp activations;  // of the block's input and output
  int64_t data_workers = 1, tensor_workers = 1;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double ring_all_reduce(double bytes, int64_t n) {
  return n < 2 ? 0 : 2 * bytes * static_cast<double>(n - 1) / static_cast<double>(n);
}

struct Measured {
  double step_ms = 0;
  double boxing_bytes = 0;    // per step, by sent_bytes()
  double gradient_bytes = 0;  // per step, GradientSync's all-reduces (from the parameters' layouts)
  double piece_bytes = 0;     // this worker's pieces of the parameters
  double loss = 0;            // after the timed steps
};

Measured measure(const Plan& plan, const g::nn::TransformerBlockOptions& options, int64_t batch,
                 int64_t time, int steps) {
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
    m.gradient_bytes +=
        ring_all_reduce(static_cast<double>(parameter.to_local().nbytes()), holders);
    m.piece_bytes += static_cast<double>(parameter.to_local().nbytes());
  }

  g::GlobalTensor loss;
  auto step = [&] {
    optimizer.zero_grad();
    const auto out = block->forward(x).to_global(plan.activations);
    loss = g::mean(out * w);
    loss.backward();
    optimizer.step();
  };
  for (int i = 0; i < 3; ++i) step();  // warm up: groups, buckets rebuilt after the first backward
  shoal::world().barrier();
  const int64_t before = g::sent_bytes();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  shoal::world().barrier();
  m.step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      steps;
  m.boxing_bytes = static_cast<double>(g::sent_bytes() - before) / steps;
  m.loss = loss.detach().full().item<double>();
  return m;
}

// Megatron's f and g over `tensor_group` (one per plan; the bench builds one plan at a time).
shoal::comm::Group* tensor_group = nullptr;

at::Tensor summed(const at::Tensor& x) {
  at::Tensor sum = x.clone(at::MemoryFormat::Contiguous);
  if (tensor_group->size() > 1) tensor_group->all_reduce(sum);
  return sum;
}

// g: the sum of the workers' partial outputs; the whole gradient goes back to each.
class ReduceForward : public torch::autograd::Function<ReduceForward> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return summed(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return g;
  }
};

// f: the whole input to each worker; the workers' partial gradients summed on the way back.
class ReduceBackward : public torch::autograd::Function<ReduceBackward> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {summed(g[0])};
  }
};

// The block by hand: this worker's pieces of the shoal block's weights (whole values `weights`,
// in named_global_parameters() order) for `rank` of `size` tensor-parallel workers.
class HandBlockImpl : public torch::nn::Module {
 public:
  HandBlockImpl(const g::nn::TransformerBlockOptions& options,
                const std::vector<torch::Tensor>& weights, int rank, int size)
      : options_(options), heads_(options.heads / size) {
    size_t next = 0;
    auto take = [&](const std::string& name, int64_t split_dim) {
      torch::Tensor w = weights.at(next++);
      if (split_dim >= 0) w = w.chunk(size, split_dim)[rank];
      return register_parameter(name, w.clone());
    };
    // The order of TransformerBlockImpl's registrations: norm1, query, key (no bias), value,
    // projection, norm2, up, down.
    n1w_ = take("n1w", -1), n1b_ = take("n1b", -1);
    wq_ = take("wq", 0), bq_ = take("bq", 0), wk_ = take("wk", 0), wv_ = take("wv", 0),
    bv_ = take("bv", 0);
    wo_ = take("wo", 1), bo_ = take("bo", -1);
    n2w_ = take("n2w", -1), n2b_ = take("n2b", -1);
    wu_ = take("wu", 0), bu_ = take("bu", 0), wd_ = take("wd", 1), bd_ = take("bd", -1);
  }

  torch::Tensor forward(const torch::Tensor& x) {
    namespace F = torch::nn::functional;
    const int64_t b = x.size(0), t = x.size(1), d = options_.dim, hd = d / options_.heads;
    auto heads = [&](const torch::Tensor& y) { return y.view({b, t, heads_, hd}).transpose(1, 2); };
    const auto h = ReduceBackward::apply(torch::layer_norm(x, {d}, n1w_, n1b_));
    const auto q = heads(F::linear(h, wq_, bq_)), k = heads(F::linear(h, wk_)),
               v = heads(F::linear(h, wv_, bv_));
    const auto mask = torch::full({t, t}, -std::numeric_limits<float>::infinity()).triu(1);
    const auto att = torch::softmax(
        q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd))) + mask, -1);
    const auto merged = att.matmul(v).transpose(1, 2).reshape({b, t, heads_ * hd});
    const auto y = x + ReduceForward::apply(F::linear(merged, wo_)) + bo_;
    const auto h2 = ReduceBackward::apply(torch::layer_norm(y, {d}, n2w_, n2b_));
    return y + ReduceForward::apply(F::linear(torch::gelu(F::linear(h2, wu_, bu_)), wd_)) + bd_;
  }

 private:
  g::nn::TransformerBlockOptions options_;
  int64_t heads_;
  torch::Tensor n1w_, n1b_, wq_, bq_, wk_, wv_, bv_, wo_, bo_, n2w_, n2b_, wu_, bu_, wd_, bd_;
};
TORCH_MODULE(HandBlock);

// The plan written by hand: its step time, and its loss after the timed steps (which must be
// shoal's, as a check that both trained the same block).
std::pair<double, double> measure_hand(const Plan& plan,
                                       const g::nn::TransformerBlockOptions& options, int64_t batch,
                                       int64_t time, int steps) {
  const auto& placement = plan.layout.placement;
  torch::manual_seed(0);
  std::vector<torch::Tensor> weights;
  for (const auto& named :
       g::nn::TransformerBlock(options, plan.layout)->named_global_parameters()) {
    weights.push_back(named.second.detach().full());
  }
  const auto x = g::randn({batch, time, options.dim}, placement, plan.activations);
  const auto w = g::randn({batch, time, options.dim}, placement, plan.activations);
  if (!placement.contains(shoal::rank())) {
    shoal::world().barrier();
    shoal::world().barrier();
    return {0, 0};
  }
  // The workers along the tensor axis (the last axis, or the whole line) and along the data axis.
  const int tensor_axis = plan.layout.tensor_axes.empty() ? -1 : plan.layout.tensor_axes[0];
  const int data_axis = placement.ndim() == 2 ? 0 : (tensor_axis < 0 ? 0 : -1);
  auto subgroup = [&](int axis) {
    return shoal::world().subgroup(axis >= 0 ? placement.axis_ranks(axis, shoal::rank())
                                             : std::vector<int>{shoal::rank()});
  };
  shoal::comm::Group tensor = subgroup(tensor_axis);
  shoal::comm::Group data_group = subgroup(data_axis);
  tensor_group = &tensor;
  const auto coordinate = placement.coordinate(shoal::rank());
  HandBlock block(options, weights, tensor_axis < 0 ? 0 : static_cast<int>(coordinate[tensor_axis]),
                  tensor.size());
  shoal::DataParallelOptions data;
  data.group = data_group;
  shoal::DataParallel model(block, data);
  torch::optim::AdamW optimizer(block->parameters(), torch::optim::AdamWOptions(1e-3));
  // This worker's rows of the batch: its piece along the data axis, whole along the tensor axis.
  const at::Tensor rows = x.to_local(), target = w.to_local();
  double loss = 0;
  auto step = [&] {
    optimizer.zero_grad();
    // The mean over this worker's rows; DataParallel averages the data-parallel workers' gradients.
    const auto l = (model(rows) * target).mean();
    l.backward();
    optimizer.step();
    loss = l.item<double>();
  };
  for (int i = 0; i < 3; ++i) step();
  shoal::world().barrier();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  shoal::world().barrier();
  tensor_group = nullptr;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      steps;
  // The mean over the whole batch: the data-parallel workers' means, averaged.
  at::Tensor mean = at::full({1}, loss, at::kDouble);
  data_group.all_reduce(mean, {shoal::comm::ReduceOp::kAvg});
  return {ms, mean.item<double>()};
}

// What the plan sends per worker per step when written by hand (see the top of this file).
// The gradients: the same pieces as shoal's, all-reduced along the data axis only.
std::pair<double, double> hand_bytes(const Plan& plan,
                                     const g::nn::TransformerBlockOptions& options, int64_t batch,
                                     int64_t time, double piece_bytes) {
  const double shard = 4.0 * static_cast<double>(batch * time * options.dim) /
                       static_cast<double>(plan.data_workers);
  return {4 * ring_all_reduce(shard, plan.tensor_workers),
          ring_all_reduce(piece_bytes, plan.data_workers)};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPT block on global tensors: step time and bytes beside hand-written plans"};
  int steps = 20, rounds = 3;
  std::string raw;
  int64_t batch = 8, time = 64;
  g::nn::TransformerBlockOptions options;
  options.dim = 128;
  options.heads = 8;
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--batch", batch)->check(CLI::PositiveNumber);
  app.add_option("--time", time)->check(CLI::PositiveNumber);
  app.add_option("--dim", options.dim)->check(CLI::PositiveNumber);
  app.add_option("--heads", options.heads)->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "rounds of both contenders, in alternating order")
      ->check(CLI::PositiveNumber);
  app.add_option("--raw", raw, "append each round's step times to this file");
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
    plans.push_back({"2-D " + std::to_string(2) + "x" + std::to_string(n / 2),
                     {g::Placement::mesh({2, n / 2}), {1}},
                     g::NdSbp{g::split(0), g::broadcast()},
                     2,
                     n / 2});
  }
  torch::manual_seed(0);
  double parameter_bytes = 0;
  for (const auto& p :
       g::nn::TransformerBlock(options, g::nn::Layout{g::Placement({0}), {}})->parameters()) {
    parameter_bytes += static_cast<double>(p.numel() * 4);
  }
  if (shoal::is_main()) {
    std::cout << "GPT block: batch " << batch << ", time " << time << ", dim " << options.dim
              << ", heads " << options.heads << ", " << parameter_bytes / 4 << " parameters; " << n
              << " workers, " << steps << " steps; " << rounds
              << " rounds, the contenders' order alternating (step times: medians; shoal/hand: the "
                 "median of the rounds' ratios)\n\n"
              << "| plan | step ms | hand step ms | shoal/hand | boxing KiB/step | hand KiB/step | "
                 "boxing/hand | "
                 "gradient sync KiB/step | hand KiB/step | loss | hand loss |\n"
              << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  }
  std::FILE* raw_lines = nullptr;
  if (shoal::is_main() && !raw.empty() && !(raw_lines = std::fopen(raw.c_str(), "a"))) {
    std::cerr << "global: --raw " << raw << ": cannot open for appending\n";
    return 2;
  }
  for (const auto& plan : plans) {
    Measured m;
    double hand_loss = 0;
    std::vector<double> shoal_times, hand_times, ratios;
    for (int r = 0; r < rounds; ++r) {
      auto run_shoal = [&] {
        m = measure(plan, options, batch, time, steps);
        shoal_times.push_back(m.step_ms);
      };
      auto run_hand = [&] {
        const auto measured = measure_hand(plan, options, batch, time, steps);
        hand_times.push_back(measured.first);
        hand_loss = measured.second;
      };
      if (r % 2 == 0) {
        run_shoal();
        run_hand();
      } else {
        run_hand();
        run_shoal();
      }
      ratios.push_back(shoal_times.back() / hand_times.back());
      if (raw_lines) {
        std::fprintf(raw_lines,
                     "global workers=%d plan=%s round=%d order=%s step_ms=%.3f hand_step_ms=%.3f\n",
                     n, plan.name.c_str(), r, r % 2 == 0 ? "shoal,hand" : "hand,shoal",
                     shoal_times.back(), hand_times.back());
        std::fflush(raw_lines);
      }
    }
    const double hand_ms = median(hand_times);
    m.step_ms = median(shoal_times);
    const auto [hand_activations, hand_gradients] =
        hand_bytes(plan, options, batch, time, m.piece_bytes);
    if (!shoal::is_main()) continue;
    auto kib = [](double bytes) { return bytes / 1024; };
    auto ratio = [](double a, double b) {
      return b > 0 ? std::to_string(a / b).substr(0, 5) : std::string("-");
    };
    std::cout << std::fixed << std::setprecision(1) << "| " << plan.name << " | " << m.step_ms
              << " | " << hand_ms << " | " << std::to_string(median(ratios)).substr(0, 5) << " | "
              << kib(m.boxing_bytes) << " | " << kib(hand_activations) << " | "
              << ratio(m.boxing_bytes, hand_activations) << " | " << kib(m.gradient_bytes) << " | "
              << kib(hand_gradients) << " | " << std::setprecision(6) << m.loss << " | "
              << hand_loss << " |" << std::endl;
  }
  if (raw_lines) std::fclose(raw_lines);
}
