// The pipeline runtime on real workers. The oracle is the same model on one process: every
// worker builds the whole model with the same seed, trains its stages under the schedule, and
// compares the loss and its parameters' gradients with its own one-process run of the whole
// model on the whole batch (relative 1e-5), for two steps (the second with the shapes learned
// at the first). Every parameter is checked on some worker: the counts are summed over the job.
// Also: one worker (every stage local), a hand-written schedule, stages with a data axis. Errors:
// a wrong activation shape, a killed middle stage, a stopped stage, placements the schedule
// forbids, bad options and batches.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "harness.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/shoal.h"

namespace {

namespace pp = shoal::pipeline;
namespace g = shoal::global;
using shoal::testing::run_workers;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

// Nine layers (five with parameters): enough for 8 stages (4 workers x 2 interleaved).
torch::nn::Sequential mlp(int64_t seed = 0) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(5, 6), torch::nn::Tanh(), torch::nn::Linear(6, 6),
                               torch::nn::Tanh(), torch::nn::Linear(6, 6), torch::nn::Tanh(),
                               torch::nn::Linear(6, 6), torch::nn::Tanh(), torch::nn::Linear(6, 3));
}

// A batch every worker draws alike: the global batch.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t rows, int64_t in, int64_t out, int64_t seed) {
  torch::manual_seed(1000 + seed);
  return {torch::randn({rows, in}), torch::randn({rows, out})};
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": no gradient";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  const double error = (got - want).abs().max().item<double>();
  EXPECT_LE(error, 1e-5 * scale) << what << ": got " << got << " want " << want;
}

// LibTorch's parameters() lists a shared tensor once per module that registers it (PyTorch's
// lists it once); the one-process optimizer must step it once.
std::vector<torch::Tensor> distinct_parameters(torch::nn::Sequential net) {
  std::vector<torch::Tensor> distinct;
  for (const auto& p : net->parameters()) {
    if (std::none_of(distinct.begin(), distinct.end(), [&](auto& d) { return d.is_same(p); }))
      distinct.push_back(p);
  }
  return distinct;
}

// The width of the model's input: the first layer's weight's (Linear: [out, in]; the tied
// embedding: [in, out]).
int64_t input_width(torch::nn::Sequential net) {
  if (auto* linear = net[0]->as<torch::nn::Linear>()) return linear->options.in_features();
  return net[0]->parameters()[0].size(0);
}

// Trains `net` under `options` and its one-process twin `reference` for two SGD steps on the
// batch; checks the loss and the gradients of this worker's stages' parameters at each step.
// Returns how many parameters this worker checked.
int64_t train_and_compare(torch::nn::Sequential net, torch::nn::Sequential reference,
                          const pp::PipelineOptions& options, int64_t rows,
                          const std::string& tag) {
  pp::Pipeline pipe(net, options);
  torch::optim::SGD opt(pipe.parameters(), 0.1);
  torch::optim::SGD ref_opt(distinct_parameters(reference), 0.1);
  const int64_t in = input_width(net);
  const int64_t out = reference->forward(torch::zeros({1, in})).size(1);
  int64_t checked = 0;
  for (int step = 0; step < 2; ++step) {
    auto [x, y] = batch(rows, in, out, step);
    opt.zero_grad();
    ref_opt.zero_grad();
    const double loss = pipe.step(x, y, mse).item<double>();
    auto ref_loss = mse(reference->forward(x), y);
    ref_loss.backward();
    const std::string at = tag + " step " + std::to_string(step);
    EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-5 * std::abs(ref_loss.item<double>())) << at;
    // Layer by layer: the pipeline's copy of each layer this worker holds against the twin's.
    int layer = 0;
    checked = 0;
    const auto mine = pipe.local_stages();
    for (int s = 0; s < pipe.stages(); ++s) {
      const bool here = std::find(mine.begin(), mine.end(), s) != mine.end();
      for (int k = 0; k < pipe.split()[s]; ++k, ++layer) {
        if (!here) continue;
        auto got = net[layer]->parameters();
        auto want = reference[layer]->parameters();
        for (size_t i = 0; i < got.size(); ++i, ++checked) {
          expect_close(got[i].grad(), want[i].grad(),
                       at + " layer " + std::to_string(layer) + " parameter " + std::to_string(i));
        }
      }
    }
    opt.step();
    ref_opt.step();
  }
  return checked;
}

int64_t parameter_count(torch::nn::Sequential net) {
  return static_cast<int64_t>(net->parameters().size());
}

// Every parameter was checked by some worker.
void expect_all_checked(int64_t checked, int64_t total, const std::string& what) {
  auto count = torch::full({1}, static_cast<double>(checked), torch::kFloat64);
  shoal::world().all_reduce(count);
  EXPECT_EQ(count.item<double>(), static_cast<double>(total)) << what;
}

// ----- every schedule on p = 2, 3, 4 with m in {1, p, 2p + 1} -----

struct GridCase {
  std::string schedule;
  int workers;
};

void PrintTo(const GridCase& grid, std::ostream* out) {
  *out << grid.schedule << " on " << grid.workers << " workers";
}

class Schedules : public ::testing::TestWithParam<GridCase> {};

TEST_P(Schedules, LossAndGradientsEqualOneProcess) {
  const GridCase grid = GetParam();
  run_workers(grid.workers, [grid] {
    const int p = grid.workers;
    for (int m : {1, p, 2 * p + 1}) {
      pp::PipelineOptions options;
      options.schedule = shoal::pipeline::parse_schedule_kind(grid.schedule);
      options.micro_batches = m;
      // 13 rows: no m of the grid divides it, so micro-batches are uneven.
      const std::string what =
          grid.schedule + " p=" + std::to_string(p) + " m=" + std::to_string(m);
      {
        // The schedule is the one asked for: zero bubble runs I and W, interleaved 2p stages.
        pp::Pipeline probe(mlp(), options);
        EXPECT_EQ(probe.schedule().splits_backward(), grid.schedule == "zb") << what;
        EXPECT_EQ(probe.stages(), grid.schedule == "interleaved" ? 2 * p : p) << what;
      }
      const int64_t checked = train_and_compare(mlp(), mlp(), options, 13, what);
      expect_all_checked(checked, parameter_count(mlp()), what);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Grid, Schedules,
                         ::testing::Values(GridCase{"gpipe", 1}, GridCase{"1f1b", 1},
                                           GridCase{"interleaved", 1}, GridCase{"zb", 1},
                                           GridCase{"gpipe", 2}, GridCase{"gpipe", 3},
                                           GridCase{"gpipe", 4}, GridCase{"1f1b", 2},
                                           GridCase{"1f1b", 3}, GridCase{"1f1b", 4},
                                           GridCase{"interleaved", 2}, GridCase{"interleaved", 3},
                                           GridCase{"interleaved", 4}, GridCase{"zb", 2},
                                           GridCase{"zb", 3}, GridCase{"zb", 4}),
                         [](const auto& info) {
                           return info.param.schedule + "_p" + std::to_string(info.param.workers);
                         });

// ----- a schedule of one's own -----

TEST(Pipeline, HandWrittenScheduleRunsAndIsValidated) {
  run_workers(2, [] {
    using K = pp::ActionKind;
    // GPipe on 2 workers and 2 micro-batches, backwards in micro-batch order.
    auto schedule = std::make_shared<pp::Schedule>();
    schedule->name = "hand-written GPipe";
    schedule->workers = 2;
    schedule->stages = 2;
    schedule->micro_batches = 2;
    schedule->stage_worker = {0, 1};
    schedule->actions = {{{K::kForward, 0, 0},
                          {K::kSendActivation, 0, 0},
                          {K::kForward, 0, 1},
                          {K::kSendActivation, 0, 1},
                          {K::kRecvGradient, 0, 0},
                          {K::kBackward, 0, 0},
                          {K::kRecvGradient, 0, 1},
                          {K::kBackward, 0, 1}},
                         {{K::kRecvActivation, 1, 0},
                          {K::kForward, 1, 0},
                          {K::kRecvActivation, 1, 1},
                          {K::kForward, 1, 1},
                          {K::kBackward, 1, 0},
                          {K::kSendGradient, 1, 0},
                          {K::kBackward, 1, 1},
                          {K::kSendGradient, 1, 1}}};
    pp::PipelineOptions options;
    options.micro_batches = 2;
    options.custom_schedule = schedule;
    const int64_t checked = train_and_compare(mlp(), mlp(), options, 7, "hand-written");
    expect_all_checked(checked, parameter_count(mlp()), "hand-written");
    // The same list with worker 1's first backward before its forward: refused before running.
    auto broken = std::make_shared<pp::Schedule>(*schedule);
    std::swap(broken->actions[1][1], broken->actions[1][4]);
    options.custom_schedule = broken;
    try {
      pp::Pipeline pipe(mlp(), options);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "invalid pipeline schedule 'hand-written GPipe': worker 1, action 1 (backward "
                   "of stage 1, micro-batch 0): expected after the forward of stage 1, "
                   "micro-batch 0, which is action 4");
    }
  });
}

// ----- uneven stages -----

torch::nn::Sequential five_layers() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 2));
}

TEST(Pipeline, FiveLayersOnTwoAndThreeWorkersBalancedAndExplicit) {
  for (int p : {2, 3}) {
    run_workers(p, [p] {
      for (const std::vector<int>& split :
           {std::vector<int>{}, p == 2 ? std::vector<int>{1, 4} : std::vector<int>{3, 1, 1}}) {
        pp::PipelineOptions options;
        options.micro_batches = 3;
        options.split = split;
        const std::string what = "p=" + std::to_string(p) + (split.empty() ? " balanced" : "");
        if (split.empty()) {
          pp::Pipeline probe(five_layers(), options);
          // By parameter count: 80 | 0 | 272 | 0 | 34 (each layer counting at least one).
          EXPECT_EQ(probe.split(), (p == 2 ? std::vector<int>{2, 3} : std::vector<int>{2, 1, 2}))
              << what;
        }
        const int64_t checked = train_and_compare(five_layers(), five_layers(), options, 10, what);
        expect_all_checked(checked, parameter_count(five_layers()), what);
      }
    });
  }
}

// One Linear per stage, widths 4 -> 6 -> 5 (-> 3): each stage's input and output differ.
torch::nn::Sequential linears(int p) {
  torch::manual_seed(3);
  if (p == 2) return torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Linear(6, 3));
  return torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Linear(6, 5),
                               torch::nn::Linear(5, 3));
}

TEST(Pipeline, StashedMicroBatchesAreWhatTheSimulationCountsAndGrowWithRows) {
  for (int p : {2, 3}) {
    run_workers(p, [p] {
      const std::vector<int64_t> width =
          p == 2 ? std::vector<int64_t>{4, 6, 3} : std::vector<int64_t>{4, 6, 5, 3};
      for (const char* schedule : {"gpipe", "1f1b", "zb"}) {
        pp::PipelineOptions options;
        options.schedule = shoal::pipeline::parse_schedule_kind(schedule);
        options.micro_batches = 2 * p;
        options.split = std::vector<int>(static_cast<size_t>(p), 1);
        pp::Pipeline pipe(linears(p), options);
        EXPECT_TRUE(pipe.last_step_stats().empty());
        const auto simulated = pp::simulate(pipe.schedule()).peak_in_flight;
        for (int64_t rows : {2, 4}) {
          const std::string what =
              std::string(schedule) + " p=" + std::to_string(p) + " rows=" + std::to_string(rows);
          auto [x, y] = batch(rows * options.micro_batches, 4, 3, rows);
          pipe.step(x, y, mse);
          const auto& stats = pipe.last_step_stats();
          ASSERT_EQ(stats.size(), 1u) << what;
          const int stage = stats[0].stage;
          ASSERT_EQ(pipe.local_stages(), std::vector<int>{stage}) << what;
          const int peak = simulated[static_cast<size_t>(pipe.schedule().worker_of(stage))];
          EXPECT_EQ(stats[0].peak_stashed, peak) << what << " stage " << stage;
          // Each stashed micro-batch keeps its float input and output: rows x (in + out) x 4
          // bytes, the last stage's output being the scalar loss.
          const auto s = static_cast<size_t>(stage);
          const int64_t each =
              stage == p - 1 ? rows * width[s] * 4 + 4 : rows * (width[s] + width[s + 1]) * 4;
          EXPECT_EQ(stats[0].peak_stashed_bytes, peak * each) << what << " stage " << stage;
        }
      }
    });
  }
}

// evaluate(): the batch's mean loss without backward, under every plan's stages (interleaved
// included), equal to one process's; no gradient is left anywhere.
TEST(Pipeline, EvaluateGivesTheOneProcessLossAndNoGradient) {
  run_workers(2, [] {
    for (const std::string schedule : {"1f1b", "interleaved"}) {
      pp::PipelineOptions options;
      options.micro_batches = 3;
      options.schedule = shoal::pipeline::parse_schedule_kind(schedule);
      pp::Pipeline pipe(mlp(), options);
      auto [x, y] = batch(7, 5, 3, 3);
      const double want = torch::mse_loss(mlp()->forward(x), y).item<double>();
      for (int round = 0; round < 2; ++round) {
        const double got = pipe.evaluate(x, y, mse).item<double>();
        EXPECT_NEAR(got, want, 1e-6 * std::abs(want)) << schedule << ", round " << round;
      }
      for (const auto& p : pipe.parameters()) EXPECT_FALSE(p.grad().defined()) << schedule;
      // Training after evaluating works as usual.
      const double trained = pipe.step(x, y, mse).item<double>();
      EXPECT_NEAR(trained, want, 1e-6 * std::abs(want)) << schedule;
    }
  });
}

TEST(BalancedSplit, MinimisesTheLargestStage) {
  EXPECT_EQ(pp::balanced_split({10, 10, 10, 10}, 2), (std::vector<int>{2, 2}));
  EXPECT_EQ(pp::balanced_split({30, 10, 10, 10}, 2), (std::vector<int>{1, 3}));
  EXPECT_EQ(pp::balanced_split({1, 1, 1, 1, 1}, 5), (std::vector<int>{1, 1, 1, 1, 1}));
  EXPECT_EQ(pp::balanced_split({0, 0, 100, 0, 0}, 3).size(), 3u);
  try {
    pp::balanced_split({1, 2}, 3);
    ADD_FAILURE() << "expected UsageError";
  } catch (const shoal::UsageError& e) {
    EXPECT_STREQ(e.what(),
                 "pipeline: cannot cut 2 layers into 3 stages: every stage needs at least one "
                 "layer");
  }
}

// ----- tied weights -----

// x W and x W^T with one W: the GPT's token embedding and its output head.
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

torch::nn::Sequential tied_model() {
  torch::manual_seed(3);
  auto w = torch::randn({4, 6}) * 0.5;
  return torch::nn::Sequential(TiedIn(w), torch::nn::Tanh(), torch::nn::Linear(6, 6),
                               torch::nn::Tanh(), TiedOut(w));
}

TEST(Pipeline, TiedWeightsGradientSummedOverStagesAndCopiesStayEqual) {
  run_workers(3, [] {
    auto net = tied_model();
    auto reference = tied_model();
    pp::PipelineOptions options;
    options.micro_batches = 4;
    options.schedule = shoal::pipeline::ScheduleKind::k1F1B;
    options.split = {1, 3, 1};  // the tie between the first and the last worker
    pp::Pipeline pipe(net, options);
    torch::optim::SGD opt(pipe.parameters(), 0.1);
    const auto distinct = distinct_parameters(reference);
    ASSERT_EQ(distinct.size(), reference->parameters().size() - 1);
    torch::optim::SGD ref_opt(distinct, 0.1);
    const auto tied = net[0]->as<TiedIn>()->weight;
    ASSERT_TRUE(tied.is_same(net[4]->as<TiedOut>()->weight));
    const auto ref_tied = reference[0]->as<TiedIn>()->weight;
    for (int round = 0; round < 2; ++round) {
      opt.zero_grad();
      ref_opt.zero_grad();
      // Two steps accumulate before each optimizer step (gradient accumulation): the second
      // step's sum must not count the first's again.
      for (int step = 0; step < 2; ++step) {
        auto [x, y] = batch(9, 4, 4, round * 2 + step);
        const double loss = pipe.step(x, y, mse).item<double>();
        auto ref_loss = mse(reference->forward(x), y);
        ref_loss.backward();
        EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-5 * ref_loss.item<double>());
      }
      if (shoal::rank() != 1) expect_close(tied.grad(), ref_tied.grad(), "the tied weight");
      if (shoal::rank() == 1) {
        auto g = net[2]->as<torch::nn::Linear>()->weight.grad();
        expect_close(g, reference[2]->as<torch::nn::Linear>()->weight.grad(), "the middle");
      }
      opt.step();
      ref_opt.step();
      // Both copies (workers 0 and 2) stay the one-process weight.
      if (shoal::rank() != 1) expect_close(tied.detach(), ref_tied.detach(), "the tied copy");
    }
    // Worker 0's copy and worker 2's are equal bit for bit.
    auto copy = tied.detach().clone();
    auto other = copy.clone();
    if (shoal::rank() == 0) shoal::world().send(copy, 2);
    if (shoal::rank() == 2) {
      shoal::world().recv(other, 0);
      EXPECT_TRUE(torch::equal(other, copy));
    }
  });
}

// ----- the timeline records what ran -----

// Each worker's trace slices of category "pipeline" are its schedule's actions, in order, with
// their stage and micro-batch: what was planned is what ran.
TEST(Pipeline, TimelineRecordsEveryActionOfTheSchedule) {
  char pattern[] = "/tmp/shoal-pipeline-trace-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::string dir = pattern;
  const std::string trace = dir + "/trace.json";
  shoal::testing::WorkersOptions workers;
  workers.env["SHOAL_TIMELINE"] = trace;
  run_workers(
      2,
      [] {
        pp::PipelineOptions options;
        options.schedule = shoal::pipeline::ScheduleKind::kZeroBubbleH1;
        options.micro_batches = 3;
        pp::Pipeline pipe(mlp(), options);
        auto [x, y] = batch(7, 5, 3, 0);
        pipe.step(x, y, mse);
      },
      workers);
  if (shoal::testing::is_worker()) return;
  std::ifstream in(trace);
  std::stringstream text;
  text << in.rdbuf();
  const auto events = nlohmann::json::parse(text.str() + "]");
  std::map<int64_t, int> rank_of;  // pid -> rank, from "worker R (pid P on HOST)"
  for (const auto& e : events) {
    if (e.at("ph") == "M" && e.at("name") == "process_name") {
      const std::string name = e.at("args").at("name");
      rank_of[e.at("pid").get<int64_t>()] = std::stoi(name.substr(name.find(' ') + 1));
    }
  }
  std::vector<std::vector<std::tuple<double, std::string, int, int>>> ran(2);
  int steps = 0;
  for (const auto& e : events) {
    if (e.value("cat", "") != "pipeline" || e.at("ph") != "X") continue;
    if (e.at("name") == "step") {
      ++steps;
      continue;
    }
    ran.at(rank_of.at(e.at("pid").get<int64_t>()))
        .emplace_back(e.at("ts").get<double>(), e.at("name").get<std::string>(),
                      e.at("args").at("stage").get<int>(),
                      e.at("args").at("micro_batch").get<int>());
  }
  EXPECT_EQ(steps, 2);  // one per worker
  const auto planned = pp::zero_bubble_h1(2, 3);
  for (int w = 0; w < 2; ++w) {
    std::sort(ran[w].begin(), ran[w].end());
    ASSERT_EQ(ran[w].size(), planned.actions[w].size()) << "worker " << w;
    for (size_t k = 0; k < ran[w].size(); ++k) {
      const auto& action = planned.actions[w][k];
      EXPECT_EQ(std::get<1>(ran[w][k]), action.short_name()) << "worker " << w << " action " << k;
      EXPECT_EQ(std::get<2>(ran[w][k]), action.stage);
      EXPECT_EQ(std::get<3>(ran[w][k]), action.micro_batch);
    }
  }
  std::filesystem::remove_all(dir);
}

// ----- a data axis: each stage on two workers -----

TEST(Pipeline, StagesReplicatedOverADataAxisTrainAsOneProcess) {
  run_workers(4, [] {
    for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb"}) {
      pp::PipelineOptions options;
      options.schedule = shoal::pipeline::parse_schedule_kind(schedule);
      options.micro_batches = 3;  // 13 rows: 7 and 6 per replica, micro-batches of 3, 2, 2 and 2
      options.placements = {{0, 1}, {2, 3}};
      if (schedule == "interleaved") options.placements = {{0, 1}, {2, 3}, {0, 1}, {2, 3}};
      const std::string what = schedule + " on [0, 1], [2, 3]";
      const int64_t checked = train_and_compare(mlp(), mlp(), options, 13, what);
      expect_all_checked(checked, 2 * parameter_count(mlp()), what);
    }
    // The tie between the first and the last stage, each on two replicas.
    pp::PipelineOptions options;
    options.micro_batches = 2;
    options.placements = {{0, 1}, {2, 3}};
    options.split = {2, 3};
    const int64_t checked = train_and_compare(tied_model(), tied_model(), options, 9, "tied");
    expect_all_checked(checked, 2 * parameter_count(tied_model()), "tied");
  });
}

// ----- errors -----

// Passes its input on, but cut to two columns when the input's first column holds a value
// above 100: an output shape that depends on the batch's content.
struct ContentShapedImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) {
    if (x.select(1, 0).max().item<double>() > 100) return x.narrow(1, 0, 2);
    return x;
  }
};
TORCH_MODULE(ContentShaped);

TEST(PipelineErrors, WrongActivationShapeIsAUsageErrorOnBothSides) {
  run_workers(2, [] {
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(ContentShaped(), torch::nn::Linear(4, 3));
    pp::PipelineOptions options;
    options.micro_batches = 3;
    options.split = {1, 1};
    options.timeout = std::chrono::seconds(10);
    pp::Pipeline pipe(net, options);
    auto [x, y] = batch(8, 4, 3, 0);  // micro-batches of 3, 3 and 2 rows
    pipe.step(x, y, mse);             // learns the shapes
    x[4][0] = 1000;                   // micro-batch 1 now comes out of stage 0 as [3, 2]
    const auto start = Clock::now();
    try {
      pipe.step(x, y, mse);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      std::printf("worker %d: %.2f s: %s\n", shoal::rank(), seconds_since(start), e.what());
      EXPECT_STREQ(e.what(),
                   "pipeline: the activation from stage 0 (worker 0) to stage 1 (worker 1) for "
                   "micro-batch 1 has shape [3, 2] Float, but the first step with a batch of 8 "
                   "rows sent [3, 4] Float (a stage's output shape may depend only on its "
                   "input's)");
      EXPECT_LT(seconds_since(start), 10.0);  // not the transfer's deadline
    }
    // The pipeline is unusable after the error, and says so at once.
    EXPECT_THROW(pipe.step(x, y, mse), shoal::UsageError);
  });
}

// Passes its input on; SIGKILLs its worker when armed.
std::atomic<bool> armed{false};
struct KillSwitchImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) {
    if (armed) raise(SIGKILL);
    return x;
  }
};
TORCH_MODULE(KillSwitch);

// Passes its input on; SIGSTOPs its worker when armed (the harness kills it at the end).
std::atomic<bool> stop_armed{false};
struct StopSwitchImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) {
    if (stop_armed) raise(SIGSTOP);
    return x;
  }
};
TORCH_MODULE(StopSwitch);

TEST(PipelineErrors, KilledMiddleStageIsACommErrorNamingIt) {
  constexpr auto kTimeout = std::chrono::seconds(5);
  shoal::testing::WorkersOptions workers;
  workers.may_fail = {1};
  run_workers(
      3,
      [kTimeout] {
        torch::manual_seed(0);
        auto net =
            torch::nn::Sequential(torch::nn::Linear(4, 4), KillSwitch(), torch::nn::Linear(4, 3));
        pp::PipelineOptions options;
        options.micro_batches = 4;
        options.split = {1, 1, 1};
        options.timeout = kTimeout;
        pp::Pipeline pipe(net, options);
        auto [x, y] = batch(8, 4, 3, 0);
        pipe.step(x, y, mse);
        pipe.step(x, y, mse);
        armed = shoal::rank() == 1;  // worker 1 dies in its first forward of the next step
        const auto start = Clock::now();
        try {
          pipe.step(x, y, mse);
          ADD_FAILURE() << "expected CommError";
        } catch (const shoal::CommError& e) {
          const double waited = seconds_since(start);
          const std::string message = e.what();
          std::printf("worker %d: %.2f s: %s\n", shoal::rank(), waited, e.what());
          EXPECT_LT(waited, 2 * 5.0);
          EXPECT_EQ(message.rfind("pipeline: ", 0), 0u) << message;
          EXPECT_NE(message.find("stage 1 (worker 1)"), std::string::npos) << message;
          EXPECT_NE(message.find("lost worker 1, which was killed by signal 9 (SIGKILL)"),
                    std::string::npos)
              << message;
        }
      },
      workers);
}

TEST(PipelineErrors, StoppedStageIsACommErrorAtTheDeadline) {
  constexpr auto kTimeout = std::chrono::seconds(2);
  shoal::testing::WorkersOptions workers;
  workers.stragglers = {1};
  run_workers(
      2,
      [kTimeout] {
        torch::manual_seed(0);
        auto net =
            torch::nn::Sequential(torch::nn::Linear(4, 4), StopSwitch(), torch::nn::Linear(4, 3));
        pp::PipelineOptions options;
        options.micro_batches = 2;
        options.split = {1, 2};
        options.timeout = kTimeout;
        pp::Pipeline pipe(net, options);
        auto [x, y] = batch(6, 4, 3, 0);
        pipe.step(x, y, mse);
        stop_armed = shoal::rank() == 1;  // worker 1 stops in its next forward
        const auto start = Clock::now();
        try {
          pipe.step(x, y, mse);
          ADD_FAILURE() << "expected CommError";
        } catch (const shoal::CommError& e) {
          const double waited = seconds_since(start);
          const std::string message = e.what();
          std::printf("worker %d: %.2f s: %s\n", shoal::rank(), waited, e.what());
          // A failure bound, as fault_test's for a stopped peer: the deadline, plus room for a
          // machine loaded by other work (docs/testing.md).
          EXPECT_GE(waited, 2.0);
          EXPECT_LT(waited, 3 * 2.0);
          EXPECT_EQ(message.rfind("pipeline: stage 0 (worker 0) receiving its output's gradient "
                                  "for micro-batch ",
                                  0),
                    0u)
              << message;
          EXPECT_NE(message.find("from stage 1 (worker 1): recv on "), std::string::npos)
              << message;
          EXPECT_NE(message.find("timed out after 2."), std::string::npos) << message;
        }
      },
      workers);
}

TEST(PipelineErrors, PlacementsTheScheduleForbidsAreUsageErrors) {
  run_workers(2, [] {
    auto expect_usage = [](const pp::PipelineOptions& options, const std::string& text) {
      try {
        pp::Pipeline pipe(mlp(), options);
        ADD_FAILURE() << "expected UsageError: " << text;
      } catch (const shoal::UsageError& e) {
        EXPECT_EQ(std::string(e.what()), text);
      }
    };
    pp::PipelineOptions options;
    options.schedule = shoal::pipeline::ScheduleKind::k1F1B;
    options.placements = {{1}, {1}};
    expect_usage(options,
                 "pipeline: stages 0 and 1 are both placed on [1], but the 1f1b schedule runs one "
                 "stage per worker (schedule \"interleaved\" runs several)");
    options.placements = {{0, 1}, {1}};
    expect_usage(options,
                 "pipeline: stage 1's placement [1] shares worker 1 with another stage's "
                 "placement [0, 1]; stages on one worker must have the same placement");
    options.placements = {{0}, {2}};
    expect_usage(options,
                 "pipeline: stage 1's placement [2] names worker 2, which is not in this job of 2");
    options.placements = {g::Placement::mesh({1, 2}), {0}};
    expect_usage(options,
                 "pipeline: stage 0's placement [0, 1] as 1x2 is a mesh; a stage's placement is a "
                 "line of workers (its data axis)");
    // Interleaved puts stage s on the (s % p)-th placement: 0, 1, 0, 1, not 0, 1, 1, 0.
    options.schedule = shoal::pipeline::ScheduleKind::kInterleaved1F1B;
    options.placements = {{0}, {1}, {1}, {0}};
    expect_usage(options,
                 "pipeline: the interleaved 1F1B (v = 2) schedule runs stage 2 on the worker of "
                 "stage 0, placed on [0], but stage 2 is placed on [1]");
    options.placements = {{1}, {0}, {1}, {0}};  // allowed: worker 1 is the schedule's first
    pp::Pipeline pipe(mlp(), options);
    EXPECT_EQ(pipe.placement(0), g::Placement({1}));
    EXPECT_EQ(pipe.placement(3), g::Placement({0}));
  });
}

TEST(PipelineErrors, BadOptionsAndBatchesAreUsageErrors) {
  run_workers(2, [] {
    auto expect_usage = [](const std::function<void()>& f, const std::string& text) {
      try {
        f();
        ADD_FAILURE() << "expected UsageError: " << text;
      } catch (const shoal::UsageError& e) {
        EXPECT_EQ(std::string(e.what()), text);
      }
    };
    pp::PipelineOptions options;
    options.split = {4, 4};
    expect_usage([&] { pp::Pipeline pipe(mlp(), options); },
                 "pipeline: split [4, 4] has 8 layers; the model has 9");
    options.split = {9, 0};
    expect_usage([&] { pp::Pipeline pipe(mlp(), options); },
                 "pipeline: split [9, 0] gives stage 1 no layer; every stage needs at least one");
    options.split = {};
    options.zero_stage = 2;  // ZeRO shards global layers' pieces (tests/global_examples_test.cpp)
    expect_usage([&] { pp::Pipeline pipe(mlp(), options); },
                 "pipeline: zero_stage shards global layers' pieces over their data axes, but this "
                 "model's layers are plain torch modules; expected zero_stage 0");
    options.zero_stage = 4;
    expect_usage([&] { pp::Pipeline pipe(mlp(), options); },
                 "pipeline: zero_stage must be 0, 1, 2 or 3, got 4");
    options.zero_stage = 0;
    options.micro_batches = 4;
    pp::Pipeline pipe(mlp(), options);
    auto [x, y] = batch(3, 5, 3, 0);
    expect_usage([&] { pipe.step(x, y, mse); },
                 "pipeline: a batch of 3 rows cannot be cut into 4 micro-batches; expected at "
                 "least one row each");
    expect_usage([&] { pipe.step(x, y.narrow(0, 0, 2), mse); },
                 "pipeline: the input has 3 rows and the target 2; expected the same batch");
  });
}

}  // namespace
