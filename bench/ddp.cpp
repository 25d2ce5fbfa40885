// Data-parallel training throughput (bench/ddp.sh runs it beside bench/ddp.py, PyTorch's DDP):
// the same model and batch trained with shoal::DataParallel or with a hand-written LibTorch loop
// that all-reduces each gradient after backward. --impl local averages nothing: each worker
// trains alone, under the same contention for the cores, which bounds what any way of averaging
// can reach. --impl lockstep averages nothing either, but the workers meet at a barrier after
// every backward, as synchronous training must: it bounds what any synchronous way of averaging
// can reach, as a step ends only when the slowest worker's backward has.
//
//   shoal run -n 2 ddp --impl shoal|hand|local|lockstep --model mlp|cnn [--batch 64]
//                      [--warmup 3] [--steps 20] [--gloo-threads T] [--bucket-mb M]
//                      [--no-bucket-view] [--fp16|--bf16] [--alternate B]
//
// mlp: 784-2048-2048-10 with ReLUs; cnn: the demo's NetImpl (examples/fashion_mnist.cpp). Data
// are random (fixed seed per worker), made before timing; loss: cross entropy; SGD, lr 0.01.
// Each worker uses one intra-op thread. After --warmup untimed steps, --steps steps are timed on
// every worker between two barriers; the main worker prints one line of key=value pairs:
//
//   ddp impl=shoal model=mlp workers=2 batch=64 steps=20 samples_per_s=383.2 step_ms=334.1
//       forward_ms=... backward_ms=... comm_ms=... optim_ms=...
//
// --alternate B takes a comma-separated --impl list (e.g. local,lockstep,shoal) and trains each
// its own copy of the model (the same initial weights) in the same processes, in blocks of B
// steps that take turns, the order rotating from cycle to cycle, each block starting at a barrier:
// noise from the rest of the machine that lasts longer than a cycle falls on all alike, which
// separate runs minutes apart cannot promise. Each gets --steps steps; one line per contender, and
// one line comparing each with the first:
//
//   ddp_alternate impl=shoal versus=local model=cnn block=10 cycles=100 ratio=0.97
//       cycle_median=0.97 cycle_q1=0.95 cycle_q3=0.99
//
// ratio is the contender's samples/s over the first's; cycle_* are the quartiles of the same ratio
// taken cycle by cycle (each block's time the slower worker's).
//
// weight_abs_sum (the sum of |w| over all weights after training) tells whether two contenders
// trained alike. samples_per_s counts every worker's samples (workers * batch * steps / slowest
// worker's time). Phase means are the main worker's: backward_ms is the backward() call (with
// DataParallel it includes waiting for the last buckets); comm_ms is the hand loop's all-reduces
// after it.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "../examples/fashion_mnist_net.h"
#include "job_store.h"
#include "shoal/shoal.h"

namespace {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  // Each shoal | hand | local | lockstep; several take turns (--alternate).
  std::vector<std::string> impls{"shoal"};
  std::string model = "mlp";   // mlp | cnn
  int64_t batch = 64;
  int warmup = 3;
  int steps = 20;
  int gloo_threads = 0;  // 0: shoal's default group (2 threads)
  double bucket_mb = 25;
  bool bucket_view = true;  // DataParallelOptions::gradient_as_bucket_view
  bool weigh = true;        // DataParallelOptions::weigh_by_batch_share
  bool fp16 = false;        // average through shoal::dp::fp16_compress_hook()
  bool bf16 = false;        // average through shoal::dp::bf16_compress_hook()
  bool noise = false;       // DataParallelOptions::measure_gradient_noise
  int alternate = 0;        // steps per block when the contenders take turns; 0: one contender
};

// The flags, each checked by its validator; what needs two is checked in the final callback.
void add_flags(CLI::App& app, BenchOptions& o) {
  app.add_option("--impl", o.impls,
                 "shoal, hand, local or lockstep; several, comma-separated, with --alternate")
      ->delimiter(',')
      ->check(CLI::IsMember({"shoal", "hand", "local", "lockstep"}));
  app.add_option("--model", o.model, "mlp or cnn (default mlp)")
      ->check(CLI::IsMember({"mlp", "cnn"}));
  app.add_option("--batch", o.batch, "Samples per worker and step (default 64)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "Untimed steps (default 3)")->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.steps, "Timed steps (default 20)")->check(CLI::PositiveNumber);
  app.add_option("--gloo-threads", o.gloo_threads,
                 "Threads of a group of its own (default: shoal's)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bucket-mb", o.bucket_mb, "DataParallel's bucket size, MB (default 25)")
      ->check(CLI::PositiveNumber);
  app.add_flag_callback(
      "--no-bucket-view", [&o] { o.bucket_view = false; },
      "DataParallelOptions::gradient_as_bucket_view = false");
  app.add_flag_callback(
      "--no-weigh", [&o] { o.weigh = false; }, "DataParallelOptions::weigh_by_batch_share = false");
  app.add_flag("--noise", o.noise, "DataParallelOptions::measure_gradient_noise = true");
  CLI::Option* fp16 = app.add_flag("--fp16", o.fp16, "Average through dp::fp16_compress_hook()");
  app.add_flag("--bf16", o.bf16, "Average through dp::bf16_compress_hook()")->excludes(fp16);
  app.add_option("--alternate", o.alternate, "Steps per block when several --impl take turns")
      ->check(CLI::NonNegativeNumber);
  app.callback([&o] {
    for (size_t k = 0; k < o.impls.size(); ++k) {
      if (std::find(o.impls.begin(), o.impls.begin() + k, o.impls[k]) != o.impls.begin() + k)
        throw CLI::ValidationError("--impl", "names " + o.impls[k] + " twice");
    }
    if (o.impls.size() > 1 && o.alternate < 1)
      throw CLI::ValidationError("--impl", "several need --alternate B (steps per block, >= 1)");
    const bool with_shoal = std::find(o.impls.begin(), o.impls.end(), "shoal") != o.impls.end();
    if ((o.fp16 || o.bf16 || !o.bucket_view || !o.weigh) && !with_shoal) {
      throw CLI::ValidationError(
          "--fp16, --bf16, --no-bucket-view and --no-weigh need --impl shoal");
    }
  });
}

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 2048))),
        fc2(register_module("fc2", torch::nn::Linear(2048, 2048))),
        fc3(register_module("fc3", torch::nn::Linear(2048, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

using Cnn = fashion_mnist::Net;  // the demo's model

// Means over the timed steps, in milliseconds, on this worker.
struct Phases {
  double forward = 0, backward = 0, comm = 0, optim = 0;
  // Per step: the hand loop's all-reduces. On each worker these
  // include waiting for a peer that is still computing; the smallest over workers does not.
  std::vector<double> tail;
};

double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

// One contender: its own copy of the model, its way of averaging and its optimizer.
template <typename Model>
struct Trainer {
  std::string impl;
  Model model;
  std::unique_ptr<shoal::DataParallel<typename Model::ContainedType>> dp;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> raw;
  std::unique_ptr<torch::optim::SGD> optimizer;
  std::vector<torch::Tensor> params;
  Phases sum;
  double seconds = 0;          // this worker's time in timed steps
  std::vector<double> blocks;  // this worker's time in each timed block
};

template <typename Model>
int run(const BenchOptions& o) {
  auto& world = shoal::world();
  const int n = world.size();
  const auto& job = shoal::job();

  // Different data on every worker, the same from run to run; made before anything is timed.
  torch::manual_seed(1000 + job.rank);
  constexpr int kBatches = 4;
  std::vector<torch::Tensor> inputs, labels;
  const std::vector<int64_t> input_shape =
      o.model == "mlp" ? std::vector<int64_t>{784} : std::vector<int64_t>{1, 28, 28};
  for (int b = 0; b < kBatches; ++b) {
    std::vector<int64_t> shape{o.batch};
    shape.insert(shape.end(), input_shape.begin(), input_shape.end());
    inputs.push_back(torch::randn(shape));
    labels.push_back(torch::randint(0, 10, {o.batch}, torch::kLong));
  }

  // The group the gradients travel on: shoal's world, or one with --gloo-threads threads.
  shoal::comm::StorePtr store;
  std::string bind_address = "127.0.0.1";
  if (n > 1) {
    store = open_job_store();
    // Where shoal::init() binds the world group: the hand loop must use the same interface.
    bind_address = shoal::comm::local_address_towards(job.master_addr, job.master_port);
  }
  shoal::comm::Group group = world;
  if (o.gloo_threads > 0 && n > 1) {
    shoal::comm::GroupOptions options;
    options.threads = o.gloo_threads;
    options.bind_address = bind_address;
    options.timeout = std::chrono::seconds(120);
    group = shoal::comm::Group::create(c10::make_intrusive<c10d::PrefixStore>("bench/ddp/group", store), job.rank, n,
                                       options);
  }

  // The ways to average gradients, each on its own copy of the model (the same initial weights).
  // Each first makes its model's parameters equal on every worker.
  std::vector<Trainer<Model>> trainers(o.impls.size());
  for (size_t k = 0; k < o.impls.size(); ++k) {
    Trainer<Model>& t = trainers[k];
    t.impl = o.impls[k];
    torch::manual_seed(0);
    t.model = Model();
    if (t.impl == "shoal") {
      shoal::DataParallelOptions options;
      options.group = group;
      options.bucket_bytes = static_cast<int64_t>(o.bucket_mb * 1024 * 1024);
      options.gradient_as_bucket_view = o.bucket_view;
      options.weigh_by_batch_share = o.weigh;
      options.measure_gradient_noise = o.noise;
      if (o.fp16) options.comm_hook = shoal::dp::fp16_compress_hook();
      if (o.bf16) options.comm_hook = shoal::dp::bf16_compress_hook();
      t.dp = std::make_unique<shoal::DataParallel<typename Model::ContainedType>>(t.model.ptr(),
                                                                                  options);
    } else if (t.impl == "hand" && n > 1) {
      // By hand, as a LibTorch program without shoal would: c10d's Gloo group and its collectives.
      auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
      options->threads = o.gloo_threads > 0 ? o.gloo_threads : 2;
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_address));
      t.raw = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("bench/ddp/raw", store), job.rank, n, options);
      torch::NoGradGuard no_grad;
      for (auto& p : t.model->parameters()) {
        std::vector<at::Tensor> tensors{p};
        t.raw->broadcast(tensors)->wait();
      }
    }
    t.params = t.model->parameters();
    t.optimizer = std::make_unique<torch::optim::SGD>(t.params, torch::optim::SGDOptions(0.01));
  }

  auto step = [&](Trainer<Model>& t, int i, Phases* phases) {
    t.optimizer->zero_grad();
    const auto t0 = Clock::now();
    // shoal's through the wrapper's forward, as a program calls it (it counts the batch's rows).
    const auto& x = inputs[i % kBatches];
    auto loss = torch::nn::functional::cross_entropy(t.dp ? t.dp->forward(x) : t.model->forward(x),
                                                     labels[i % kBatches]);
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    if (t.raw) {
      for (auto& p : t.params) {
        std::vector<at::Tensor> grads{p.mutable_grad()};
        t.raw->allreduce(grads)->wait();
        p.mutable_grad().div_(n);
      }
    }
    if (t.impl == "lockstep") world.barrier();
    const auto t3 = Clock::now();
    t.optimizer->step();
    const auto t4 = Clock::now();
    if (!phases) return;
    phases->forward += ms(t0, t1);
    phases->backward += ms(t1, t2);
    phases->comm += ms(t2, t3);
    phases->optim += ms(t3, t4);
    if (t.raw) phases->tail.push_back(ms(t2, t3));
  };

  for (auto& t : trainers) {
    for (int i = 0; i < o.warmup; ++i) step(t, i, nullptr);
  }
  // One contender: all its steps in one block. Several: blocks of --alternate steps in turn, the
  // order rotating from cycle to cycle so that none always follows the same one.
  const int block = o.alternate > 0 ? o.alternate : o.steps;
  const int cycles = (o.steps + block - 1) / block;
  for (int c = 0; c < cycles; ++c) {
    const int first = std::min(c * block, o.steps);
    const int count = std::min(block, o.steps - first);
    for (size_t turn = 0; turn < trainers.size(); ++turn) {
      Trainer<Model>& t = trainers[(c + turn) % trainers.size()];
      world.barrier();
      const auto start = Clock::now();
      for (int i = 0; i < count; ++i) step(t, o.warmup + first + i, &t.sum);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      t.seconds += seconds;
      t.blocks.push_back(seconds);
    }
  }

  std::vector<double> job_seconds;
  std::vector<std::vector<double>> job_blocks;
  for (auto& t : trainers) {
    // The job's throughput is set by its slowest worker; so is each block's time.
    torch::Tensor slowest = torch::tensor({t.seconds}, torch::kFloat64);
    world.all_reduce(slowest, {shoal::comm::ReduceOp::kMax});
    job_seconds.push_back(slowest.item<double>());
    torch::Tensor blocks = torch::tensor(t.blocks, torch::kFloat64);
    world.all_reduce(blocks, {shoal::comm::ReduceOp::kMax});
    job_blocks.emplace_back(blocks.data_ptr<double>(), blocks.data_ptr<double>() + blocks.numel());

    // The communication that no worker could hide: per step, the least any worker waited.
    double tail_min = 0;
    if (!t.sum.tail.empty()) {
      auto mine = torch::tensor(t.sum.tail, torch::kFloat64);
      tail_min = world.all_gather(mine).view({n, -1}).amin(0).mean().template item<double>();
    }

    // A fingerprint of the trained weights: contenders that average alike end alike.
    double weight_sum = 0;
    for (const auto& p : t.params)
      weight_sum += p.detach().to(torch::kFloat64).abs().sum().template item<double>();

    if (shoal::is_main()) {
      const double steps = o.steps;
      std::printf(
          "ddp impl=%s model=%s workers=%d batch=%lld steps=%d threads=%d gloo_threads=%d "
          "samples_per_s=%.2f step_ms=%.3f forward_ms=%.3f backward_ms=%.3f comm_ms=%.3f "
          "optim_ms=%.3f",
          t.impl.c_str(), o.model.c_str(), n, static_cast<long long>(o.batch), o.steps,
          at::get_num_threads(), o.gloo_threads > 0 ? o.gloo_threads : 2,
          n * o.batch * steps / job_seconds.back(), job_seconds.back() * 1e3 / steps,
          t.sum.forward / steps, t.sum.backward / steps, t.sum.comm / steps, t.sum.optim / steps);
      if (!t.sum.tail.empty()) std::printf(" tail_min_ms=%.3f", tail_min);
      if (o.alternate > 0) std::printf(" alternate=%d", o.alternate);
      std::printf(" weight_abs_sum=%.6f\n", weight_sum);
    }
  }
  // Each contender beside the first: over the whole run, and cycle by cycle.
  if (shoal::is_main()) {
    for (size_t k = 1; k < trainers.size(); ++k) {
      std::vector<double> ratios;
      for (size_t c = 0; c < job_blocks[k].size(); ++c)
        ratios.push_back(job_blocks[0][c] / job_blocks[k][c]);
      std::sort(ratios.begin(), ratios.end());
      auto quantile = [&](double q) {
        return ratios[static_cast<size_t>(q * (ratios.size() - 1) + 0.5)];
      };
      std::printf(
          "ddp_alternate impl=%s versus=%s model=%s block=%d cycles=%zu ratio=%.4f "
          "cycle_median=%.4f cycle_q1=%.4f cycle_q3=%.4f\n",
          trainers[k].impl.c_str(), trainers[0].impl.c_str(), o.model.c_str(), block, ratios.size(),
          job_seconds[0] / job_seconds[k], quantile(0.5), quantile(0.25), quantile(0.75));
    }
    std::fflush(stdout);
  }
  world.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Data-parallel training throughput: shoal::DataParallel beside a hand-written loop"};
  BenchOptions options;
  add_flags(app, options);
  CLI11_PARSE(app, argc, argv);
  shoal::InitOptions init;
  init.intra_op_threads = 1;  // one intra-op thread per worker, as the PyTorch contender
  shoal::init(init);
  if (options.model == "mlp") return run<Mlp>(options);
  return run<Cnn>(options);
}
