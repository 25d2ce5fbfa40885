// A small training program for the elastic tests (tests/elastic_test.cpp): an MLP on a synthetic
// classification set, a commit after every step, and a count of how often each sample was
// trained on in committed steps, kept in the elastic state so that it rolls back with it.
//
//   elastic_worker OUT [EPOCHS] [STEP_MS] [POLICY]
//
// POLICY: "global" (keep the global batch of 10, the default: cut 4, 3, 3 on three workers, so
// the tests' one-process oracle also checks DataParallel's weighing of uneven shares), "scale"
// (4 per worker, the learning rate scaled with the world) or "warmup" (the same, reached over 4
// commits). Every
// worker prints "train pid=P rank=R world=W step=S lr=L" when the training function (re)starts;
// the first worker prints "step S world W lr=L" after each commit and, at the end, writes OUT:
// the parameters and the counts, as text.
//
// For the tests of commits without copies (Note [Commits without copies] in src/elastic/state.cpp):
// ELASTIC_WORKER_LATE_COUNT=1 counts the samples with a collective after the optimizer's step
// (by default it runs before the backward); ELASTIC_WORKER_DIE_AFTER=K makes the last worker
// SIGKILL itself right after the optimizer's step of the step after commit K; ELASTIC_WORKER_COPY=1
// sets StateOptions::copy_parameters. ELASTIC_WORKER_EXIT_AT=K makes the last worker of a world of
// several exit with code 3 right after commit K (a crash of the program's own).
// ELASTIC_WORKER_TERM_AT=K sends every worker SIGTERM from itself, the last one right after
// commit K and the others right before it, so that the last one's vote at K does not yet ask to
// leave (Note [The last to be stopped] in src/elastic/state.cpp).
// ELASTIC_WORKER_BESIDE=dp|global trains a second model beside the committed one at the start
// of every step, on the same features, under its own DataParallel ("dp", as a GAN's other half)
// or as a global model under GradientSync ("global"), with its own optimizer; it is not part of
// the elastic state, and is built again for each new world. ELASTIC_WORKER_DIE_BESIDE=K makes
// the last worker SIGKILL itself right after that step, in the step after commit K: the others'
// committed model has not changed since its commit, though the model beside it has.
// ELASTIC_WORKER_NO_INIT=1 leaves out shoal::init(), so that DataParallel comes first.
// ELASTIC_WORKER_ZERO=S shards the model at ZeRO stage S (1-3), each worker seeding its own
// initial parameters; ELASTIC_WORKER_ADAM=1 trains with Adam instead of SGD with momentum.
// ELASTIC_WORKER_DIE_BEFORE_BACKWARD=K makes the last worker SIGKILL itself right before the
// backward of the step after commit K: the others' backward fails, with their slices unchanged.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <thread>

#include <shoal/global/nn.h>
#include <shoal/shoal.h>
#include <torch/torch.h>

namespace {

constexpr int64_t kSamples = 240;
constexpr int64_t kFeatures = 8;
constexpr int64_t kClasses = 4;

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(kFeatures, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, kClasses));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// Each sample's features with its index in the last column, so that a worker knows what it got.
class Synthetic : public torch::data::datasets::Dataset<Synthetic> {
 public:
  Synthetic() {
    torch::manual_seed(0);
    x_ = torch::randn({kSamples, kFeatures});
    y_ = x_.matmul(torch::randn({kFeatures, kClasses})).argmax(1);
  }
  torch::data::Example<> get(size_t i) override {
    auto features = torch::cat({x_[i], torch::tensor({static_cast<float>(i)})});
    return {features, y_[i]};
  }
  torch::optional<size_t> size() const override { return kSamples; }

 private:
  torch::Tensor x_, y_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: elastic_worker OUT [EPOCHS] [STEP_MS] [POLICY: global, scale, warmup, "
                 "adascale, goodput]\n";
    return 2;
  }
  const std::string out_path = argv[1];
  const int64_t epochs = argc > 2 ? std::atoll(argv[2]) : 4;
  const int step_ms = argc > 3 ? std::atoi(argv[3]) : 0;
  const std::string policy = argc > 4 ? argv[4] : "global";

  const char* no_init = std::getenv("ELASTIC_WORKER_NO_INIT");
  if (no_init == nullptr || std::string(no_init) != "1") shoal::init();
  auto flag = [](const char* name) {
    const char* value = std::getenv(name);
    return value != nullptr ? std::atoll(value) : int64_t{-1};
  };
  // A seed of each worker's own under ZeRO: the job's first round gives every worker the first
  // one's parameters.
  const int64_t zero_stage = std::max<int64_t>(0, flag("ELASTIC_WORKER_ZERO"));
  torch::manual_seed(zero_stage > 0 ? 1 + shoal::rank() : 1);
  auto net = std::make_shared<Net>();
  shoal::DataParallelOptions dp_options;
  dp_options.measure_gradient_noise = policy == "adascale" || policy == "goodput";
  dp_options.zero_stage = static_cast<int>(zero_stage);
  if (zero_stage == 3) dp_options.unit_bytes = 256;  // one layer's weight or bias a unit
  shoal::DataParallel model(net, dp_options);
  const bool adam = flag("ELASTIC_WORKER_ADAM") == 1;
  // ELASTIC_WORKER_OPTIMIZE_MODULE=1: the optimizer on the module's parameters, not the
  // DataParallel's (a mistake under ZeRO).
  const auto trained =
      flag("ELASTIC_WORKER_OPTIMIZE_MODULE") == 1 ? net->parameters() : model.parameters();
  std::unique_ptr<torch::optim::Optimizer> made;
  if (adam) {
    made = std::make_unique<torch::optim::Adam>(trained, torch::optim::AdamOptions(0.01));
  } else {
    made =
        std::make_unique<torch::optim::SGD>(trained, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  torch::optim::Optimizer& optimizer = *made;

  shoal::data::LoaderOptions options;
  options.shuffle = true;
  options.seed = 7;
  shoal::elastic::StateOptions state_options;
  if (policy == "scale") {
    options.batch_size = 4;
    options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::scale_learning_rate(1, 0);
  } else if (policy == "warmup") {
    options.batch_size = 4;
    options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::scale_learning_rate(1, 4);
  } else if (policy == "adascale") {
    options.batch_size = 4;
    options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::adascale(1);
  } else if (policy == "goodput") {
    // A base batch of 8 that one worker takes in two backward passes (at most 6 samples each);
    // at most 48 in all. The batch is chosen again every 5 commits.
    options.batch_size = 4;
    options.per_worker = true;
    state_options.policy = shoal::elastic::BatchPolicy::goodput({8, 48, 2, 6, 2}, 5);
  } else {
    options.batch_size = 10;
  }
  const bool late_count = flag("ELASTIC_WORKER_LATE_COUNT") == 1;
  const int64_t die_after = flag("ELASTIC_WORKER_DIE_AFTER");
  const int64_t die_before_backward = flag("ELASTIC_WORKER_DIE_BEFORE_BACKWARD");
  const int64_t exit_at = flag("ELASTIC_WORKER_EXIT_AT");
  const int64_t term_at = flag("ELASTIC_WORKER_TERM_AT");
  // Alone in a round, after this many steps: no more training, only commits every STEP_MS, until
  // newcomers join (the commit that takes them in ends the round). A test's newcomers then find
  // the job still running however slowly they start.
  const int64_t hold_alone_after = flag("ELASTIC_WORKER_HOLD_ALONE_AFTER");
  state_options.copy_parameters = flag("ELASTIC_WORKER_COPY") == 1;
  auto loader = shoal::data::make_loader(Synthetic(), options);
  shoal::elastic::State state(net, optimizer, loader, state_options);
  state.value("counts") = torch::zeros({epochs, kSamples}, torch::kLong);

  // The model beside (ELASTIC_WORKER_BESIDE): a step of its own on a batch's features.
  const char* beside_kind = std::getenv("ELASTIC_WORKER_BESIDE");
  const std::string beside = beside_kind != nullptr ? beside_kind : "";
  const int64_t die_beside = flag("ELASTIC_WORKER_DIE_BESIDE");
  std::function<void(const torch::Tensor&)> beside_step;
  auto build_beside = [&] {
    namespace g = shoal::global;
    if (beside == "dp") {
      auto other = std::make_shared<Net>();
      auto other_model = std::make_shared<shoal::DataParallel<Net>>(other);
      auto other_optimizer = std::make_shared<torch::optim::SGD>(other->parameters(), 0.01);
      beside_step = [other_model, other_optimizer](const torch::Tensor& features) {
        other_optimizer->zero_grad();
        (*other_model)(features).pow(2).mean().backward();
        other_optimizer->step();
      };
    } else if (beside == "global") {
      g::nn::Layout layout;  // every worker, data parallel
      auto other = g::nn::Linear(kFeatures, kClasses, layout.placement, layout.replicated());
      auto sync = std::make_shared<g::nn::GradientSync>(other);
      auto other_optimizer = std::make_shared<torch::optim::SGD>(other->parameters(), 0.01);
      beside_step = [other, sync, other_optimizer, layout](const torch::Tensor& features) mutable {
        other_optimizer->zero_grad();
        const auto x = g::GlobalTensor::from_local(features, layout.placement, g::NdSbp{g::split(0)});
        const auto out = other->forward(x);
        g::mean(out * out).backward();
        other_optimizer->step();
      };
    }
  };
  if (!beside.empty()) {
    build_beside();
    state.on_reset(build_beside);
  }

  shoal::elastic::run(state, [&] {
    std::cout << "train pid=" << getpid() << " rank=" << shoal::rank()
              << " world=" << shoal::world_size() << " step=" << state.version()
              << " lr=" << optimizer.param_groups()[0].options().get_lr() << std::endl;
    int64_t trained_alone = 0;
    for (; state.epoch() < epochs; state.next_epoch()) {
      for (auto& batch : loader.epoch(state.epoch())) {
        auto features = batch.data.narrow(1, 0, kFeatures);
        auto indices = batch.data.select(1, kFeatures).to(torch::kLong);
        if (beside_step) {
          beside_step(features);
          if (state.version() == die_beside && shoal::rank() == shoal::world_size() - 1 &&
              shoal::world_size() > 1) {
            ::kill(::getpid(), SIGKILL);
          }
        }
        optimizer.zero_grad();
        // What every worker trained on in this step, summed over the workers.
        auto seen = torch::zeros({kSamples}, torch::kLong);
        seen.index_add_(0, indices, torch::ones_like(indices));
        if (!late_count) shoal::world().all_reduce(seen);
        // The plain mean over this worker's share: DataParallel weighs it by the share. Under
        // goodput() the share comes in state.accumulation() backward passes, each weighed by
        // its part of the share; all but the last accumulate without exchanging.
        const auto parts =
            features.size(0) > 0 ? features.chunk(state.accumulation()) : std::vector{features};
        const auto targets = batch.target.size(0) > 0 ? batch.target.chunk(state.accumulation())
                                                      : std::vector{batch.target};
        for (size_t i = 0; i < parts.size(); ++i) {
          const double weight =
              features.size(0) > 0 ? static_cast<double>(parts[i].size(0)) / features.size(0) : 1.0;
          auto loss = torch::nn::functional::cross_entropy(model(parts[i]), targets[i]) * weight;
          if (state.version() == die_before_backward && shoal::rank() == shoal::world_size() - 1 &&
              shoal::world_size() > 1) {
            ::kill(::getpid(), SIGKILL);
          }
          if (i + 1 < parts.size()) {
            auto guard = model.no_sync();
            loss.backward();
          } else {
            loss.backward();
          }
        }
        optimizer.step();
        if (state.version() == die_after && shoal::rank() == shoal::world_size() - 1 &&
            shoal::world_size() > 1) {
          ::kill(::getpid(), SIGKILL);
        }
        if (late_count) shoal::world().all_reduce(seen);
        state.value("counts")[state.epoch()] += seen;
        if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
        const bool last = shoal::rank() == shoal::world_size() - 1;
        if (state.version() + 1 == term_at && !last) ::raise(SIGTERM);
        const auto trained = state.batch_choice();
        state.commit();
        if (state.version() == term_at && last) ::raise(SIGTERM);
        if (state.version() == exit_at && shoal::rank() == shoal::world_size() - 1 &&
            shoal::world_size() > 1) {
          std::_Exit(3);
        }
        if (shoal::is_main()) {
          std::cout << "step " << state.version() << " world " << shoal::world_size()
                    << " lr=" << optimizer.param_groups()[0].options().get_lr();
          if (policy == "goodput") {
            std::cout << " batch=" << trained.global_batch << " passes=" << trained.accumulation
                      << " gain=" << state.gain();
          }
          std::cout << std::endl;
        }
        // After the step's commit, before the loader hands out the next batch: the commits
        // below leave the cursor where it is.
        if (hold_alone_after >= 0 && shoal::world_size() == 1 &&
            ++trained_alone >= hold_alone_after) {
          for (;;) {
            std::this_thread::sleep_for(std::chrono::milliseconds(std::max(step_ms, 10)));
            state.commit();
          }
        }
      }
    }
  });

  if (flag("ELASTIC_WORKER_SPREAD") == 1) {
    // How far the last round's workers' parameters are apart (a policy that gave workers
    // different rates would part them).
    std::vector<torch::Tensor> flat;
    for (auto& p : net->parameters()) flat.push_back(p.detach().reshape(-1));
    auto high = torch::cat(flat), low = high.clone();
    shoal::world().all_reduce(high, {shoal::comm::ReduceOp::kMax});
    shoal::world().all_reduce(low, {shoal::comm::ReduceOp::kMin});
    if (shoal::is_main()) std::cout << "parameter spread " << (high - low).max().item<double>() << std::endl;
  }
  if (zero_stage > 0) model.gather_parameters();  // every worker's slices into the parameters
  if (shoal::is_main()) {
    std::ofstream out(out_path + ".tmp");
    out << std::setprecision(9);
    for (auto& p : net->parameters()) {
      auto flat = p.detach().reshape(-1);
      for (int64_t i = 0; i < flat.numel(); ++i) out << flat[i].item<float>() << ' ';
    }
    out << "\ncounts";
    auto counts = state.value("counts").reshape(-1);
    for (int64_t i = 0; i < counts.numel(); ++i) out << ' ' << counts[i].item<int64_t>();
    out << "\n";
    out.close();
    std::rename((out_path + ".tmp").c_str(), out_path.c_str());
  }
  return 0;
}
