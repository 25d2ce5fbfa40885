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
//                      [--no-bucket-view] [--fp16|--bf16]
//
// mlp: 784-2048-2048-10 with ReLUs; cnn: the demo's NetImpl (examples/fashion_mnist.cpp). Data
// are random (fixed seed per worker), made before timing; loss: cross entropy; SGD, lr 0.01.
// Each worker uses one intra-op thread. After --warmup untimed steps, --steps steps are timed on
// every worker between two barriers; the main worker prints one line of key=value pairs:
//
//   ddp impl=shoal model=mlp workers=2 batch=64 steps=20 samples_per_s=383.2 step_ms=334.1
//       forward_ms=... backward_ms=... comm_ms=... optim_ms=...
//
// weight_abs_sum (the sum of |w| over all weights after training) tells whether two contenders
// trained alike. samples_per_s counts every worker's samples (workers * batch * steps / slowest
// worker's time). Phase means are the main worker's: backward_ms is the backward() call (with
// DataParallel it includes waiting for the last buckets); comm_ms is the hand loop's all-reduces
// after it.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "../examples/fashion_mnist_net.h"
#include "job_store.h"
#include "shoal/shoal.h"

namespace {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string impl = "shoal";  // shoal | hand | local | lockstep
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
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr,
               "ddp: %s\nusage: ddp --impl shoal|hand|local|lockstep --model mlp|cnn [--batch B] "
               "[--warmup W] [--steps S] "
               "[--gloo-threads T] [--bucket-mb M] [--no-bucket-view] [--fp16|--bf16]\n",
               problem.c_str());
  std::exit(2);
}

BenchOptions parse(int argc, char** argv) {
  BenchOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--no-bucket-view") { o.bucket_view = false; continue; }
    if (flag == "--no-weigh") { o.weigh = false; continue; }
    if (flag == "--fp16") { o.fp16 = true; continue; }
    if (flag == "--bf16") { o.bf16 = true; continue; }
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--impl") { o.impl = value; continue; }
    if (flag == "--model") { o.model = value; continue; }
    char* end = nullptr;
    const double number = std::strtod(value.c_str(), &end);
    if (*end != '\0' || number < 0) usage(flag + ": expected a non-negative number, got '" + value + "'");
    if (flag == "--batch") o.batch = static_cast<int64_t>(number);
    else if (flag == "--warmup") o.warmup = static_cast<int>(number);
    else if (flag == "--steps") o.steps = static_cast<int>(number);
    else if (flag == "--gloo-threads") o.gloo_threads = static_cast<int>(number);
    else if (flag == "--bucket-mb") o.bucket_mb = number;
    else usage("unknown flag '" + flag + "'");
  }
  if (o.impl != "shoal" && o.impl != "hand" && o.impl != "local" && o.impl != "lockstep")
    usage("--impl must be shoal, hand, local or lockstep");
  if (o.model != "mlp" && o.model != "cnn") usage("--model must be mlp or cnn");
  if (o.batch < 1 || o.steps < 1 || o.bucket_mb <= 0) usage("expected --batch >= 1, --steps >= 1, --bucket-mb > 0");
  if ((o.fp16 || o.bf16 || !o.bucket_view || !o.weigh) && o.impl != "shoal") {
    usage("--fp16, --bf16, --no-bucket-view and --no-weigh need --impl shoal");
  }
  if (o.fp16 && o.bf16) usage("--fp16 and --bf16 exclude each other");
  return o;
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

template <typename Model>
int run(const BenchOptions& o, Model model, const std::vector<int64_t>& input_shape) {
  auto& world = shoal::world();
  const int n = world.size();
  const auto& job = shoal::job();

  // Different data on every worker, the same from run to run; made before anything is timed.
  torch::manual_seed(1000 + job.rank);
  constexpr int kBatches = 4;
  std::vector<torch::Tensor> inputs, labels;
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

  // The ways to average gradients. Each first makes the model's parameters equal on every worker.
  std::unique_ptr<shoal::DataParallel<typename Model::ContainedType>> shoal_dp;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> raw;
  if (o.impl == "shoal") {
    shoal::DataParallelOptions options;
    options.group = group;
    options.bucket_bytes = static_cast<int64_t>(o.bucket_mb * 1024 * 1024);
    options.gradient_as_bucket_view = o.bucket_view;
    options.weigh_by_batch_share = o.weigh;
    if (o.fp16) options.comm_hook = shoal::dp::fp16_compress_hook();
    if (o.bf16) options.comm_hook = shoal::dp::bf16_compress_hook();
    shoal_dp = std::make_unique<shoal::DataParallel<typename Model::ContainedType>>(model.ptr(), options);
  } else if (o.impl == "hand" && n > 1) {
    // By hand, as a LibTorch program without shoal would: c10d's Gloo group and its collectives.
    auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
    options->threads = o.gloo_threads > 0 ? o.gloo_threads : 2;
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_address));
    raw = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("bench/ddp/raw", store),
                                                     job.rank, n, options);
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      std::vector<at::Tensor> tensors{p};
      raw->broadcast(tensors)->wait();
    }
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  auto params = model->parameters();

  Phases sum;
  auto step = [&](int i, Phases* phases) {
    optimizer.zero_grad();
    const auto t0 = Clock::now();
    auto loss = torch::nn::functional::cross_entropy(model->forward(inputs[i % kBatches]), labels[i % kBatches]);
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    if (raw) {
      for (auto& p : params) {
        std::vector<at::Tensor> grads{p.mutable_grad()};
        raw->allreduce(grads)->wait();
        p.mutable_grad().div_(n);
      }
    }
    if (o.impl == "lockstep") world.barrier();
    const auto t3 = Clock::now();
    optimizer.step();
    const auto t4 = Clock::now();
    if (!phases) return;
    phases->forward += ms(t0, t1);
    phases->backward += ms(t1, t2);
    phases->comm += ms(t2, t3);
    phases->optim += ms(t3, t4);
    if (raw) phases->tail.push_back(ms(t2, t3));
  };

  for (int i = 0; i < o.warmup; ++i) step(i, nullptr);
  world.barrier();
  const auto start = Clock::now();
  for (int i = 0; i < o.steps; ++i) step(o.warmup + i, &sum);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // The job's throughput is set by its slowest worker.
  auto slowest = torch::tensor({seconds}, torch::kFloat64);
  world.all_reduce(slowest, {shoal::comm::ReduceOp::kMax});

  // The communication that no worker could hide: per step, the least any worker waited.
  double tail_min = 0;
  if (!sum.tail.empty()) {
    auto mine = torch::tensor(sum.tail, torch::kFloat64);
    tail_min = world.all_gather(mine).view({n, -1}).amin(0).mean().template item<double>();
  }

  // A fingerprint of the trained weights: contenders that average alike end alike.
  double weight_sum = 0;
  for (const auto& p : params) weight_sum += p.detach().to(torch::kFloat64).abs().sum().template item<double>();

  if (shoal::is_main()) {
    const double steps = o.steps;
    std::printf("ddp impl=%s model=%s workers=%d batch=%lld steps=%d threads=%d gloo_threads=%d "
                "samples_per_s=%.2f step_ms=%.3f forward_ms=%.3f backward_ms=%.3f comm_ms=%.3f optim_ms=%.3f",
                o.impl.c_str(), o.model.c_str(), n, static_cast<long long>(o.batch), o.steps, at::get_num_threads(),
                o.gloo_threads > 0 ? o.gloo_threads : 2,
                n * o.batch * steps / slowest.item<double>(), slowest.item<double>() * 1e3 / steps, sum.forward / steps,
                sum.backward / steps, sum.comm / steps, sum.optim / steps);
    if (!sum.tail.empty()) std::printf(" tail_min_ms=%.3f", tail_min);
    std::printf(" weight_abs_sum=%.6f\n", weight_sum);
    std::fflush(stdout);
  }
  world.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const BenchOptions options = parse(argc, argv);
  shoal::InitOptions init;
  init.intra_op_threads = 1;  // one intra-op thread per worker, as the PyTorch contender
  shoal::init(init);
  torch::manual_seed(0);
  if (options.model == "mlp") return run(options, Mlp(), {784});
  return run(options, Cnn(), {1, 28, 28});
}
