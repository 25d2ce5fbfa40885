// Pipeline parallelism: a stack of equal layers (Linear(d, d) + Tanh, L times; by default d = 512,
// L = 8, batch 1024: about 150 ms a step on one core here; --activation none drops the Tanh, so
// that a layer's forward, input gradient and weight gradient are one matrix product each, the
// costs the closed forms of zero-bubble schedules assume) trained by
//   shoal  shoal::pipeline::Pipeline under a schedule (gpipe, 1f1b, interleaved, zb),
//   hand   the same GPipe written by hand in plain LibTorch: c10d ProcessGroupGloo send/recv
//          between the stages, built over the job's store as bench/allreduce.cpp builds it,
//   local  one process running the whole stack on the whole batch (no micro-batches),
//   local-mb  one process running the whole stack on the m micro-batches in turn,
// and two helpers for bench/pipeline.sh:
//   theory  shoal::pipeline::simulate() of a schedule under given costs (no job needed),
//   stash   the bytes one micro-batch's forward keeps alive in one stage (no job needed).
//
//   shoal run -n P build/bench/pipeline --impl shoal|hand [--schedule S] [--micro-batches M] ...
//   build/bench/pipeline --impl local|theory|stash ...
//
// A run prints one line "pipeline impl=... step_ms=..." (medians over the timed steps, measured on
// worker 0 between barriers); every step is forward and backward of the batch's mean MSE loss
// with the gradients cleared before it (no optimizer: its cost is the same in every contender).
// Under SHOAL_TIMELINE the pipeline's actions and steps are in the trace, which
// bench/pipeline_trace.py reads for the bubble and the stashed micro-batches.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "job_store.h"
#include "shoal/shoal.h"

namespace {

namespace pp = shoal::pipeline;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string impl = "shoal";
  std::string schedule = "1f1b";
  int micro_batches = 8;
  int stages_per_worker = 0;  // 0: 2 for interleaved, else 1
  int layers = 8;
  std::string activation = "tanh";  // or "none": Linear layers alone
  int64_t dim = 512;
  int64_t batch = 1024;
  int warmup = 2;
  int steps = 5;
  int threads = 1;
  int workers = 2;            // theory, stash: p
  std::vector<double> costs;  // theory: f, b, i, w
  bool describe = false;      // theory: print the schedule's lists instead
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// Modules per layer of the stack: Linear and Tanh, or Linear alone.
int modules_per_layer(const Options& o) {
  return o.activation == "tanh" ? 2 : 1;
}

// The stack: layers x (Linear(dim, dim), Tanh), or layers x Linear(dim, dim) with --activation
// none, the same on every worker (seed 0).
torch::nn::Sequential make_stack(const Options& o) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int l = 0; l < o.layers; ++l) {
    net->push_back(torch::nn::Linear(o.dim, o.dim));
    if (o.activation == "tanh") net->push_back(torch::nn::Tanh());
  }
  return net;
}

void make_batch(const Options& o, torch::Tensor& x, torch::Tensor& y) {
  torch::manual_seed(1);
  x = torch::randn({o.batch, o.dim});
  y = torch::randn({o.batch, o.dim});
}

int stages_per_worker(const Options& o) {
  if (o.stages_per_worker > 0) return o.stages_per_worker;
  return o.schedule == "interleaved" ? 2 : 1;
}

// Equal layers per stage (the stack's modules cut evenly); the stack must divide.
std::vector<int> even_split(const Options& o, int stages) {
  if (o.layers % stages != 0) {
    throw shoal::UsageError("--layers " + std::to_string(o.layers) + " does not divide into " +
                            std::to_string(stages) +
                            " stages; expected a multiple of workers x stages per worker");
  }
  return std::vector<int>(static_cast<size_t>(stages), modules_per_layer(o) * o.layers / stages);
}

void print_line(const Options& o, int workers, int v, const std::vector<double>& step_ms) {
  const double ms = median(step_ms);
  std::printf(
      "pipeline impl=%s schedule=%s p=%d v=%d m=%d layers=%d activation=%s dim=%lld batch=%lld "
      "steps=%zu "
      "step_ms=%.2f min_ms=%.2f samples_per_s=%.1f\n",
      o.impl.c_str(), o.impl == "shoal" ? o.schedule.c_str() : (o.impl == "hand" ? "gpipe" : "-"),
      workers, v, o.impl == "local" ? 1 : o.micro_batches, o.layers, o.activation.c_str(),
      static_cast<long long>(o.dim), static_cast<long long>(o.batch), step_ms.size(), ms,
      *std::min_element(step_ms.begin(), step_ms.end()), 1000.0 * o.batch / ms);
  std::fflush(stdout);
}

template <typename Step, typename Barrier>
std::vector<double> time_steps(const Options& o, Step step, Barrier barrier) {
  std::vector<double> ms;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    barrier();
    const auto start = Clock::now();
    step();
    barrier();
    if (s >= o.warmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
  }
  return ms;
}

void clear_grads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) p.mutable_grad() = torch::Tensor();
}

int run_local(const Options& o) {
  auto net = make_stack(o);
  torch::Tensor x, y;
  make_batch(o, x, y);
  const auto params = net->parameters();
  // local-mb: the same micro-batches as the pipeline, one after the other (gradient
  // accumulation), to tell what the smaller matrix products cost from what pipelining does.
  const int m = o.impl == "local-mb" ? o.micro_batches : 1;
  const auto xs = x.chunk(m), ys = y.chunk(m);
  auto ms = time_steps(
      o,
      [&] {
        clear_grads(params);
        for (int k = 0; k < m; ++k) {
          const double share = static_cast<double>(xs[k].size(0)) / static_cast<double>(o.batch);
          (torch::mse_loss(net->forward(xs[k]), ys[k]) * share).backward();
        }
      },
      [] {});
  print_line(o, 1, 1, ms);
  return 0;
}

int run_shoal(const Options& o) {
  shoal::init();
  auto& world = shoal::world();
  const int v = stages_per_worker(o);
  pp::PipelineOptions po;
  po.micro_batches = o.micro_batches;
  po.schedule = shoal::pipeline::parse_schedule_kind(o.schedule);
  po.stages_per_worker = v;
  po.split = even_split(o, world.size() * v);
  pp::Pipeline pipe(make_stack(o), po);
  torch::Tensor x, y;
  make_batch(o, x, y);
  const auto params = pipe.parameters();
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target);
  };
  auto ms = time_steps(
      o,
      [&] {
        clear_grads(params);
        pipe.step(x, y, loss);
      },
      [&] { world.barrier(); });
  if (world.rank() == 0) print_line(o, world.size(), v, ms);
  // What the last step stashed on each of this worker's stages (docs/pipeline.md, "What a step
  // stashed"): bytes of the stages' inputs and outputs only, not the graphs' inner tensors.
  for (const auto& st : pipe.last_step_stats()) {
    std::printf("runtime_stash rank=%d stage=%d peak_stashed=%d peak_stashed_bytes=%lld\n",
                world.rank(), st.stage, st.peak_stashed,
                static_cast<long long>(st.peak_stashed_bytes));
  }
  std::fflush(stdout);
  return 0;
}

// GPipe by hand: worker r holds layers [r L / p, (r + 1) L / p); every forward (receive the
// input, run, send the output), then every backward in reverse order (receive the output's
// gradient, run, send the input's gradient); sends are waited at the end of the step, as a
// torch.distributed user would with isend. The loss is summed to every worker, as shoal's is.
int run_hand(const Options& o) {
  shoal::init();
  const auto& job = shoal::job();
  const int p = job.world_size, r = job.rank, m = o.micro_batches;
  auto raw_options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
  raw_options->threads = 2;
  raw_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(
      shoal::comm::local_address_towards(job.master_addr, job.master_port)));
  auto store = c10::make_intrusive<c10d::PrefixStore>("bench/pipeline_hand", open_job_store());
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, r, p, raw_options);

  auto whole = make_stack(o);
  const auto split = even_split(o, p);
  torch::nn::Sequential mine;
  for (int k = 0; k < split[static_cast<size_t>(r)]; ++k) {
    mine->push_back(whole->begin()[r * split[0] + k]);
  }
  torch::Tensor x, y;
  make_batch(o, x, y);
  const auto xs = x.chunk(m), ys = y.chunk(m);
  const auto params = mine->parameters();
  const bool first = r == 0, last = r == p - 1;

  auto step = [&] {
    clear_grads(params);
    std::vector<torch::Tensor> inputs(m), outputs(m);
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    double loss_sum = 0;
    for (int k = 0; k < m; ++k) {
      if (first) {
        inputs[k] = xs[k];
      } else {
        std::vector<torch::Tensor> buf{torch::empty({xs[k].size(0), o.dim})};
        group->recv(buf, r - 1, k)->wait();
        inputs[k] = buf[0].requires_grad_(true);
      }
      outputs[k] = mine->forward(inputs[k]);
      if (last) {
        const double share = static_cast<double>(xs[k].size(0)) / static_cast<double>(o.batch);
        outputs[k] = torch::mse_loss(outputs[k], ys[k]) * share;
        loss_sum += outputs[k].item<double>();
      } else {
        std::vector<torch::Tensor> buf{outputs[k].detach()};
        sends.push_back(group->send(buf, r + 1, k));
      }
    }
    for (int k = m - 1; k >= 0; --k) {
      if (last) {
        outputs[k].backward();
      } else {
        std::vector<torch::Tensor> buf{torch::empty_like(outputs[k])};
        group->recv(buf, r + 1, m + k)->wait();
        outputs[k].backward(buf[0]);
      }
      if (!first) {
        std::vector<torch::Tensor> buf{inputs[k].grad()};
        sends.push_back(group->send(buf, r - 1, m + k));
      }
      inputs[k] = outputs[k] = torch::Tensor();
    }
    for (auto& s : sends) s->wait();
    std::vector<torch::Tensor> loss{torch::full({}, loss_sum, torch::kFloat64)};
    group->allreduce(loss)->wait();
  };
  auto ms = time_steps(o, step, [&] { group->barrier()->wait(); });
  if (r == 0) print_line(o, p, 1, ms);
  return 0;
}

std::string join(const std::vector<int>& values) {
  std::ostringstream out;
  for (size_t k = 0; k < values.size(); ++k) out << (k ? "," : "") << values[k];
  return out.str();
}

int run_theory(const Options& o) {
  const auto kind = pp::parse_schedule_kind(o.schedule);
  const auto s = pp::make_schedule(kind, o.workers, stages_per_worker(o), o.micro_batches);
  // --costs: f, b, i, w for every stage, or for each stage in turn (4 x stages numbers).
  const size_t stages = static_cast<size_t>(s.stages);
  if (!o.costs.empty() && o.costs.size() != 4 && o.costs.size() != 4 * stages) {
    throw shoal::UsageError(
        "pipeline bench: --costs takes 4 numbers (f, b, i, w) or 4 per stage (" +
        std::to_string(4 * stages) + "); got " + std::to_string(o.costs.size()));
  }
  std::vector<pp::Costs> c(stages);
  for (size_t st = 0; st < stages && !o.costs.empty(); ++st) {
    const size_t at = o.costs.size() == 4 ? 0 : 4 * st;
    c[st].forward = o.costs[at];
    c[st].backward = o.costs[at + 1];
    c[st].backward_input = o.costs[at + 2];
    c[st].backward_weight = o.costs[at + 3];
  }
  if (o.describe) {
    std::printf("%s", s.describe().c_str());
    return 0;
  }
  const auto sim = pp::simulate(s, c);
  std::printf("theory schedule=%s p=%d v=%d m=%d bubble=%.4f makespan=%.4f peak_in_flight=%s\n",
              o.schedule.c_str(), o.workers, stages_per_worker(o), o.micro_batches, sim.bubble,
              sim.makespan, join(sim.peak_in_flight).c_str());
  return 0;
}

// Heap bytes in use (glibc: small blocks from the arenas plus mmapped large ones; LibTorch's CPU
// allocator takes tensors' memory from malloc and caches nothing).
size_t heap_in_use() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

// What one micro-batch's forward leaves alive in one stage of layers / (p v) blocks until its
// backward: the heap's growth from before its input exists until after the forward, with the
// output (and so its autograd graph and saved tensors) held. The input counts (the stage keeps it
// for the backward), and so does the output (the last Tanh saves it; without Tanh it is held
// alone). Analytic: each Linear saves its input and each Tanh its output, the same tensors, so
// (layers + 1) x rows x dim x 4 bytes.
// Median of 5 tries.
int run_stash(const Options& o) {
  const int stages = o.workers * stages_per_worker(o);
  const auto split = even_split(o, stages);
  auto whole = make_stack(o);
  torch::nn::Sequential stage;
  for (int k = 0; k < split[0]; ++k) stage->push_back(whole->begin()[k]);
  const int64_t rows = (o.batch + o.micro_batches - 1) / o.micro_batches;
  std::vector<double> bytes;
  for (int t = 0; t < 5; ++t) {
    const size_t before = heap_in_use();
    auto input = torch::randn({rows, o.dim}).requires_grad_(true);
    auto output = stage->forward(input);
    const size_t after = heap_in_use();
    bytes.push_back(static_cast<double>(after) - static_cast<double>(before));
    output.sum().backward();
  }
  const int layers = split[0] / modules_per_layer(o);
  const double analytic = static_cast<double>(layers + 1) * rows * o.dim * 4;
  std::printf("stash p=%d v=%d m=%d rows=%lld layers_per_stage=%d bytes=%.0f analytic_bytes=%.0f\n",
              o.workers, stages_per_worker(o), o.micro_batches, static_cast<long long>(rows),
              layers, median(bytes), analytic);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline parallelism: shoal's schedules, a hand-written GPipe, one process"};
  Options o;
  app.add_option("--impl", o.impl, "shoal, hand, local, local-mb, theory or stash")
      ->check(CLI::IsMember({"shoal", "hand", "local", "local-mb", "theory", "stash"}));
  app.add_option("--schedule", o.schedule, "gpipe, 1f1b, interleaved or zb")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb"}));
  app.add_option("--micro-batches", o.micro_batches, "m")->check(CLI::PositiveNumber);
  app.add_option("--stages-per-worker", o.stages_per_worker, "v (0: 2 for interleaved, else 1)");
  app.add_option("--layers", o.layers, "layers: Linear + Tanh, or Linear alone")
      ->check(CLI::PositiveNumber);
  app.add_option("--activation", o.activation, "tanh (a Tanh after every Linear) or none")
      ->check(CLI::IsMember({"tanh", "none"}));
  app.add_option("--dim", o.dim, "features of every layer")->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "rows of the global batch")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "intra-op threads")->check(CLI::PositiveNumber);
  app.add_option("--workers", o.workers, "p, for theory and stash")->check(CLI::PositiveNumber);
  app.add_option("--costs", o.costs, "theory: f,b,i,w, or f,b,i,w of each stage in turn")
      ->delimiter(',');
  app.add_flag("--describe", o.describe, "theory: print the schedule's action lists");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(o.threads);
  try {
    if (o.impl == "local" || o.impl == "local-mb") return run_local(o);
    if (o.impl == "theory") return run_theory(o);
    if (o.impl == "stash") return run_stash(o);
    if (o.impl == "hand") return run_hand(o);
    return run_shoal(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline bench: %s\n", e.what());
    return 1;
  }
}
