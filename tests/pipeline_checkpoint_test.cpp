// A pipeline's checkpoint is the whole model's: saved from a pipeline on real workers, it is the
// file shoal::save writes for the plain Sequential on one process, it loads into the plain
// Sequential and into a pipeline of another split, worker count and schedule (or with a data axis),
// and training resumed from it equals, to 1e-5, a one-process run that never stopped on the same
// batches. Buffers come from the worker that holds their layer, and the optimizer and the
// program's loader are saved beside the model through the same shoal::save of pipe.module(). A
// file that does not fit is a UsageError on every worker with nothing changed.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/shoal.h"

namespace {

namespace fs = std::filesystem;
namespace pp = shoal::pipeline;
using shoal::testing::run_workers;

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

torch::nn::Sequential mlp(int64_t seed, int64_t first_width = 6) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(5, first_width), torch::nn::Tanh(),
                               torch::nn::Linear(first_width, 6), torch::nn::Tanh(),
                               torch::nn::Linear(6, 6), torch::nn::Tanh(), torch::nn::Linear(6, 3));
}

// x W and x W^T with one W, as in tests/pipeline_test.cpp: a tie across stages.
struct TiedInImpl : torch::nn::Module {
  explicit TiedInImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedIn);
struct TiedOutImpl : torch::nn::Module {
  explicit TiedOutImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedOut);

torch::nn::Sequential tied_model(int64_t seed) {
  torch::manual_seed(seed);
  auto w = torch::randn({5, 6}) * 0.5;
  return torch::nn::Sequential(TiedIn(w), torch::nn::Tanh(), torch::nn::Linear(6, 6),
                               torch::nn::Tanh(), TiedOut(w));
}

std::pair<torch::Tensor, torch::Tensor> batch(int64_t step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({8, 5}), torch::randn({8, 3})};
}

// Steps [first, last) of plain SGD on the whole model in one process.
void train(torch::nn::Sequential net, int first, int last) {
  torch::optim::SGD opt(net->parameters(), 0.1);
  for (int step = first; step < last; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    mse(net->forward(x), y).backward();
    opt.step();
  }
}

void train(pp::Pipeline& pipe, int first, int last) {
  torch::optim::SGD opt(pipe.parameters(), 0.1);
  for (int step = first; step < last; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    pipe.step(x, y, mse);
    opt.step();
  }
}

// Adam's eps is large enough that a gradient component which is zero up to rounding doesn't step
// by +-lr.
torch::optim::Adam adam(const std::vector<torch::Tensor>& parameters) {
  return torch::optim::Adam(parameters, torch::optim::AdamOptions(0.01).eps(1e-4));
}

// Steps [first, last) with the given optimizer, in one process and in a pipeline.
void train(torch::nn::Sequential net, torch::optim::Optimizer& opt, int first, int last) {
  for (int step = first; step < last; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    mse(net->forward(x), y).backward();
    opt.step();
  }
}

void train(pp::Pipeline& pipe, torch::optim::Optimizer& opt, int first, int last) {
  for (int step = first; step < last; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    pipe.step(x, y, mse);
    opt.step();
  }
}

double max_difference(torch::nn::Sequential a, torch::nn::Sequential b) {
  double most = 0;
  auto b_params = b->named_parameters();
  for (const auto& item : a->named_parameters())
    most = std::max(most, (item.value() - b_params[item.key()]).abs().max().item<double>());
  return most;
}

void expect_same_model(torch::nn::Sequential got, torch::nn::Sequential want) {
  auto got_params = got->named_parameters();
  auto want_params = want->named_parameters();
  ASSERT_EQ(got_params.size(), want_params.size());
  for (const auto& item : want_params) {
    const auto& value = got_params[item.key()];
    const double error = (value - item.value()).abs().max().item<double>();
    EXPECT_LE(error, 1e-5) << item.key();
  }
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

shoal::LoadOptions alone() {
  shoal::LoadOptions options;
  options.group = shoal::comm::Group::single();
  return options;
}

class PipelineCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shoal_pipeline_ckpt_" + std::to_string(getpid()));
    if (!shoal::testing::is_worker()) fs::create_directories(dir_);
    options_.env["PIPELINE_CKPT_DIR"] = dir_.string();
  }
  void TearDown() override {
    if (!shoal::testing::is_worker()) fs::remove_all(dir_);
  }
  // In a worker: the test process's directory.
  static fs::path dir() { return fs::path(std::getenv("PIPELINE_CKPT_DIR")); }
  fs::path dir_;
  shoal::testing::WorkersOptions options_;
};

TEST_F(PipelineCheckpoint, IsTheWholeModelsFile) {
  run_workers(
      3,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 4;
        pp::Pipeline pipe(mlp(0), o);
        shoal::save((dir() / "pipe.pt").string(), pipe.module());
      },
      options_);
  shoal::SaveOptions single;
  single.group = shoal::comm::Group::single();
  shoal::save((dir_ / "plain.pt").string(), *mlp(0), single);
  EXPECT_EQ(read_bytes(dir_ / "pipe.pt"), read_bytes(dir_ / "plain.pt"));
}

// Layers 0 | 1-2 | 3-4 on three workers: the batch norm's buffers live on the last one only.
torch::nn::Sequential with_batch_norm(int64_t seed, double mean) {
  torch::manual_seed(seed);
  auto norm = torch::nn::BatchNorm1d(6);
  norm->running_mean.fill_(mean);
  norm->running_var.fill_(mean + 1);
  norm->num_batches_tracked.fill_(static_cast<int64_t>(mean));
  return torch::nn::Sequential(torch::nn::Linear(5, 6), torch::nn::Tanh(), torch::nn::Linear(6, 6), norm,
                               torch::nn::Linear(6, 3));
}

TEST_F(PipelineCheckpoint, BuffersComeFromTheWorkerThatHoldsThem) {
  run_workers(
      3,
      [] {
        pp::PipelineOptions o;
        o.split = {1, 2, 2};
        pp::Pipeline pipe(with_batch_norm(0, 3), o);
        shoal::save((dir() / "pipe.pt").string(), pipe.module());
        // With its optimizer and the program's loader (one, not sharded: every worker gives
        // step() the same batch), two batches in.
        torch::optim::SGD sgd(pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        shoal::data::SamplerOptions so;
        so.batch_size = 4;
        shoal::data::Sampler sampler(40, so, 0, 1);
        sampler.advance();
        sampler.advance();
        shoal::save((dir() / "with_loader.pt").string(), pipe.module(), sgd, sampler);
        shoal::save((dir() / "no_loader.pt").string(), pipe.module(), sgd);
      },
      options_);
  // Into a pipeline of two workers whose own buffers differ: the file's reach the holder.
  run_workers(
      2,
      [] {
        pp::PipelineOptions o;
        o.split = {3, 2};
        auto net = with_batch_norm(4, 9);
        pp::Pipeline pipe(net, o);
        shoal::load((dir() / "pipe.pt").string(), pipe.module());
        if (shoal::rank() == 1) {
          auto norm = net[3]->as<torch::nn::BatchNorm1d>();
          EXPECT_TRUE(norm->running_mean.equal(torch::full({6}, 3.0)));
          EXPECT_TRUE(norm->running_var.equal(torch::full({6}, 4.0)));
          EXPECT_EQ(norm->num_batches_tracked.item<int64_t>(), 3);
        }
        torch::optim::SGD sgd(pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        shoal::data::SamplerOptions so;
        so.batch_size = 4;
        shoal::data::Sampler sampler(40, so, 0, 1);
        shoal::load((dir() / "with_loader.pt").string(), pipe.module(), sgd, sampler);
        EXPECT_EQ(sampler.cursor(), 8);
        // A file without a loader state, and a loader over another dataset, are refused on every
        // worker with the model unchanged.
        shoal::data::Sampler other(30, so, 0, 1);
        const auto before = net[0]->as<torch::nn::Linear>()->weight.detach().clone();
        const std::vector<std::pair<std::string, std::string>> cases = {
            {"no_loader.pt", "holds no loader state"},
            {"with_loader.pt", "the state was saved for a dataset of 40 samples; this one has 30"}};
        for (const auto& [name, message] : cases) {
          try {
            shoal::load((dir() / name).string(), pipe.module(), sgd, other);
            ADD_FAILURE() << name << ": no error";
          } catch (const shoal::UsageError& e) {
            EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
          }
        }
        EXPECT_TRUE(net[0]->as<torch::nn::Linear>()->weight.equal(before));
      },
      options_);
  shoal::SaveOptions single;
  single.group = shoal::comm::Group::single();
  shoal::save((dir_ / "plain.pt").string(), *with_batch_norm(0, 3), single);
  EXPECT_EQ(read_bytes(dir_ / "pipe.pt"), read_bytes(dir_ / "plain.pt"));
}

TEST_F(PipelineCheckpoint, ResumesUnderAnotherPlan) {
  // Three steps on 3 workers (1f1b), saved.
  run_workers(
      3,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 4;
        o.schedule = shoal::pipeline::ScheduleKind::k1F1B;
        pp::Pipeline pipe(mlp(0), o);
        train(pipe, 0, 3);
        shoal::save((dir() / "step3.pt").string(), pipe.module());
      },
      options_);
  // On 2 workers, another split, zb: two more steps, saved again.
  run_workers(
      2,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 4;
        o.schedule = shoal::pipeline::ScheduleKind::kZeroBubbleH1;
        o.split = {5, 2};
        pp::Pipeline pipe(mlp(7), o);
        shoal::load((dir() / "step3.pt").string(), pipe.module());
        train(pipe, 3, 5);
        shoal::save((dir() / "step5.pt").string(), pipe.module());
      },
      options_);
  // On 4 workers: 2 stages, each replicated over a data axis of 2, gpipe.
  run_workers(
      4,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 4;
        o.schedule = shoal::pipeline::ScheduleKind::kGPipe;
        o.placements = {{0, 1}, {2, 3}};
        pp::Pipeline pipe(mlp(8), o);
        shoal::load((dir() / "step3.pt").string(), pipe.module());
        train(pipe, 3, 5);
        shoal::save((dir() / "step5_data_axis.pt").string(), pipe.module());
      },
      options_);
  // The test process's checks come after the calls: a worker runs the test's body up to its
  // own call, and only the test process has the files' directory's name.
  auto reference = mlp(0);
  train(reference, 0, 3);

  // On one process, into the plain Sequential (built from another seed: the file decides).
  auto plain = mlp(5);
  shoal::load((dir_ / "step3.pt").string(), *plain, alone());
  expect_same_model(plain, reference);
  train(plain, 3, 5);

  train(reference, 3, 5);
  expect_same_model(plain, reference);
  auto resumed = mlp(9);
  shoal::load((dir_ / "step5.pt").string(), *resumed, alone());
  expect_same_model(resumed, reference);
  auto replicated = mlp(10);
  shoal::load((dir_ / "step5_data_axis.pt").string(), *replicated, alone());
  expect_same_model(replicated, reference);
}

TEST_F(PipelineCheckpoint, ResumesWithItsOptimizerStateUnderAnotherPlan) {
  // Three Adam steps on 3 workers (1f1b), saved with the optimizer's state.
  run_workers(
      3,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 4;
        o.schedule = shoal::pipeline::ScheduleKind::k1F1B;
        pp::Pipeline pipe(mlp(0), o);
        auto opt = adam(pipe.parameters());
        train(pipe, opt, 0, 3);
        shoal::save((dir() / "adam3.pt").string(), pipe.module(), opt);
      },
      options_);
  // On 2 workers, another split, zb: an optimizer of another type is refused on both, with
  // nothing changed; Adam takes its state and two more steps follow.
  run_workers(
      2,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 4;
        o.schedule = shoal::pipeline::ScheduleKind::kZeroBubbleH1;
        o.split = {5, 2};
        pp::Pipeline pipe(mlp(7), o);
        torch::optim::SGD sgd(pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        std::vector<torch::Tensor> before;
        for (const auto& p : pipe.parameters()) before.push_back(p.detach().clone());
        try {
          shoal::load((dir() / "adam3.pt").string(), pipe.module(), sgd);
          ADD_FAILURE() << "no error for SGD";
        } catch (const shoal::UsageError& e) {
          EXPECT_NE(std::string(e.what()).find("its optimizer state is torch::optim::Adam's; this "
                                               "optimizer is torch::optim::SGD"),
                    std::string::npos)
              << e.what();
        }
        for (size_t i = 0; i < before.size(); ++i)
          EXPECT_TRUE(pipe.parameters()[i].equal(before[i]));
        EXPECT_TRUE(sgd.state().empty());

        auto opt = adam(pipe.parameters());
        shoal::load((dir() / "adam3.pt").string(), pipe.module(), opt);
        EXPECT_EQ(opt.state().size(), pipe.parameters().size());
        train(pipe, opt, 3, 5);
        shoal::save((dir() / "adam5.pt").string(), pipe.module());
      },
      options_);
  // On 4 workers: 2 stages, each replicated over a data axis of 2, gpipe.
  run_workers(
      4,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 4;
        o.schedule = shoal::pipeline::ScheduleKind::kGPipe;
        o.placements = {{0, 1}, {2, 3}};
        pp::Pipeline pipe(mlp(8), o);
        auto opt = adam(pipe.parameters());
        shoal::load((dir() / "adam3.pt").string(), pipe.module(), opt);
        train(pipe, opt, 3, 5);
        shoal::save((dir() / "adam5_data_axis.pt").string(), pipe.module());
      },
      options_);
  // The oracle: one process, Adam, five steps without a stop.
  auto reference = mlp(0);
  auto reference_opt = adam(reference->parameters());
  train(reference, reference_opt, 0, 5);

  // One process, the plain Sequential and Adam through the overloads for any module.
  auto plain = mlp(5);
  auto plain_opt = adam(plain->parameters());
  shoal::load((dir_ / "adam3.pt").string(), *plain, plain_opt, alone());
  train(plain, plain_opt, 3, 5);
  expect_same_model(plain, reference);
  for (const char* name : {"adam5.pt", "adam5_data_axis.pt"}) {
    auto resumed = mlp(9);
    shoal::load((dir_ / name).string(), *resumed, alone());
    expect_same_model(resumed, reference);
  }
  // Without the state, the same two steps land elsewhere: the oracle tells the difference.
  auto fresh = mlp(6);
  shoal::load((dir_ / "adam3.pt").string(), *fresh, alone());
  auto fresh_opt = adam(fresh->parameters());
  train(fresh, fresh_opt, 3, 5);
  EXPECT_GT(max_difference(fresh, reference), 1e-4);
}

TEST_F(PipelineCheckpoint, TiedWeightsStayTiedAcrossStages) {
  if (!shoal::testing::is_worker()) {
    shoal::SaveOptions single;
    single.group = shoal::comm::Group::single();
    shoal::save((dir_ / "tied.pt").string(), *tied_model(11), single);
  }
  run_workers(
      3,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 2;
        o.split = {1, 3, 1};  // the tie between the first and the last worker
        auto net = tied_model(3);
        pp::Pipeline pipe(net, o);
        shoal::load((dir() / "tied.pt").string(), pipe.module());
        // One process: the file's model, one step with the tied weight stepped once.
        auto reference = tied_model(11);
        torch::optim::SGD ref_opt(
            std::vector<torch::Tensor>{reference[0]->as<TiedIn>()->weight,
                                       reference[2]->as<torch::nn::Linear>()->weight,
                                       reference[2]->as<torch::nn::Linear>()->bias},
            0.1);
        auto [x, y] = batch(0);
        x = x.narrow(1, 0, 5);
        y = torch::randn({8, 5});
        ref_opt.zero_grad();
        mse(reference->forward(x), y).backward();
        ref_opt.step();
        torch::optim::SGD opt(pipe.parameters(), 0.1);
        opt.zero_grad();
        pipe.step(x, y, mse);
        opt.step();
        const auto want = reference[0]->as<TiedIn>()->weight.detach();
        if (shoal::rank() == 0) {
          EXPECT_LE((net[0]->as<TiedIn>()->weight.detach() - want).abs().max().item<double>(),
                    1e-5);
        }
        if (shoal::rank() == 2) {
          EXPECT_LE((net[4]->as<TiedOut>()->weight.detach() - want).abs().max().item<double>(),
                    1e-5);
        }
      },
      options_);
}

TEST_F(PipelineCheckpoint, MismatchIsAUsageErrorOnEveryWorkerWithNothingChanged) {
  shoal::SaveOptions single;
  single.group = shoal::comm::Group::single();
  // Files made by the test process (a worker runs the test's body up to run_workers too).
  if (!shoal::testing::is_worker()) {
    // Layer 0 (held by worker 0 only) has another shape.
    shoal::save((dir_ / "wide.pt").string(), *mlp(0, 4), single);
    // Fewer layers.
    shoal::save((dir_ / "short.pt").string(), *torch::nn::Sequential(torch::nn::Linear(5, 6)),
                single);
    // A damaged byte in a good file.
    shoal::save((dir_ / "corrupt.pt").string(), *mlp(0), single);
    {
      std::fstream file(dir_ / "corrupt.pt", std::ios::in | std::ios::out | std::ios::binary);
      file.seekp(200);
      file.put('\x5a');
    }
  }
  run_workers(
      3,
      [] {
        pp::PipelineOptions o;
        o.micro_batches = 2;
        auto net = mlp(3);
        pp::Pipeline pipe(net, o);
        std::vector<torch::Tensor> before;
        for (const auto& p : pipe.parameters()) before.push_back(p.detach().clone());
        const std::vector<std::pair<std::string, std::string>> cases = {
            {"wide.pt", "'0.weight' has shape [4, 5] in the file but [6, 5] in the module"},
            {"short.pt", "the module has submodule '1', which the file does not"},
            {"corrupt.pt", "corrupt"}};
        for (const auto& [name, message] : cases) {
          try {
            shoal::load((dir() / name).string(), pipe.module());
            ADD_FAILURE() << name << ": no error";
          } catch (const shoal::UsageError& e) {
            EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
          }
          const auto after = pipe.parameters();
          ASSERT_EQ(after.size(), before.size());
          for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(after[i].equal(before[i])) << name;
        }
      },
      options_);
}

}  // namespace
