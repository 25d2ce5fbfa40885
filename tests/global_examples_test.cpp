// The global-tensor examples end to end under the real `shoal run`: OneFlow's three matmul
// programs give the one-process values on 2 and 3 workers with the SBP the guide shows, and the
// character-level GPT trains 20 steps to the one-process loss curve and parameters in each of
// its plans, the pipeline and 3-D ones included (relative 1e-4).
#include <array>
#include <cstdlib>
#include <filesystem>
#include <regex>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal_run.h"
#include "test_paths.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string example(const std::string& name) {
  return fs::path(test_programs_dir()).parent_path() / "examples" / name;
}

// The first worker's lines, without shoal run's "[0] " prefix.
std::vector<std::string> printed(const RunResult& result) {
  std::vector<std::string> lines;
  for (const auto& line : split_lines(result.out))
    lines.push_back(line.rfind("[0] ", 0) == 0 ? line.substr(4) : line);
  return lines;
}

RunResult run(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 120s) {
  RunResult result = run_shoal(args, timeout);
  EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
  return result;
}

TEST(GlobalExamples, MatmulProgramsGiveTheOneProcessValues) {
  const std::vector<std::pair<std::string, std::string>> programs = {
      {"global_data_parallel", "as split(0)"},
      {"global_model_parallel", "as split(1)"},
      {"global_pipeline", "as broadcast"}};
  for (const auto& [program, sbp] : programs) {
    const auto one = printed(run({"-n", "1", example(program)}));
    ASSERT_GE(one.size(), 2u) << program;
    for (const std::string n : {"2", "3"}) {
      const auto many = printed(run({"-n", n, example(program)}));
      ASSERT_EQ(many.size(), one.size()) << program << " on " << n;
      EXPECT_NE(many[0].find(sbp), std::string::npos) << program << ": " << many[0];
      for (size_t i = 1; i < one.size(); ++i)
        EXPECT_EQ(many[i], one[i]) << program << " on " << n << " workers";
    }
  }
  // The pipeline's output lives on the last worker.
  const auto pipeline = printed(run({"-n", "3", example("global_pipeline")}));
  EXPECT_NE(pipeline[0].find("on [2] as broadcast"), std::string::npos) << pipeline[0];
}

std::vector<double> losses(const RunResult& result) {
  std::vector<double> found;
  static const std::regex line(R"(step \d+ loss ([-0-9.e+na]+))");
  for (std::sregex_iterator it(result.out.begin(), result.out.end(), line), end; it != end; ++it) {
    found.push_back(std::stod((*it)[1]));
  }
  return found;
}

class GlobalGpt : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/shoal-gpt-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // One process's 20 steps (with `args` added): the losses of steps `from` to 20, and the final
  // parameters.
  struct Reference {
    std::vector<double> losses;
    std::vector<torch::Tensor> parameters;
  };
  Reference one_process(const std::vector<std::string>& args, int from = 1) {
    std::vector<std::string> command = {"-n",  "1",      example("global_gpt"), "--plan",
                                        "one", "--save", dir_ / "one.pt"};
    command.insert(command.end(), args.begin(), args.end());
    const auto one = run(command);
    Reference reference;
    reference.losses = losses(one);
    EXPECT_EQ(reference.losses.size(), 20u) << one.out;
    reference.losses.erase(
        reference.losses.begin(),
        reference.losses.begin() + std::min<size_t>(from - 1, reference.losses.size()));
    torch::load(reference.parameters, dir_ / "one.pt");
    EXPECT_FALSE(reference.parameters.empty());
    return reference;
  }
  fs::path dir_;
};

// `result`'s losses and saved parameters (`file`) against one process's.
void expect_as_one_process(const RunResult& result, const std::string& file,
                           const std::vector<double>& expected,
                           const std::vector<torch::Tensor>& reference, const std::string& plan) {
  const auto got = losses(result);
  ASSERT_EQ(got.size(), expected.size()) << plan << ":\n" << result.out << result.err;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], expected[i], 1e-4 * std::abs(expected[i])) << plan << ", step " << i + 1;
  }
  std::vector<torch::Tensor> parameters;
  torch::load(parameters, file);
  ASSERT_EQ(parameters.size(), reference.size()) << plan;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const double error = (parameters[i] - reference[i]).norm().item<double>();
    EXPECT_LE(error, 1e-4 * reference[i].norm().item<double>()) << plan << ", parameter " << i;
    EXPECT_TRUE(parameters[i].allclose(reference[i], 1e-4, 1e-5)) << plan << ", parameter " << i;
  }
}

TEST_F(GlobalGpt, EveryPlanTrainsAsOneProcess) {
  const std::string gpt = example("global_gpt");
  const auto one = run({"-n", "1", gpt, "--plan", "one", "--save", dir_ / "one.pt"});
  const auto expected = losses(one);
  ASSERT_EQ(expected.size(), 20u) << one.out;
  std::vector<torch::Tensor> reference;
  torch::load(reference, dir_ / "one.pt");
  ASSERT_FALSE(reference.empty());
  for (const std::string plan : {"data", "tensor", "hybrid"}) {
    const std::string file = dir_ / (plan + ".pt");
    const auto result = run({"-n", "4", gpt, "--plan", plan, "--save", file}, 240s);
    expect_as_one_process(result, file, expected, reference, plan);
  }
}

// ZeRO on the data axes (GradientSyncOptions::zero_stage, docs/memory.md "Global models"): the
// hybrid plan's 2 x 2 mesh shards each piece over its 2 data workers (the layer norms, broadcast
// on both axes, over all 4), the data plan over every worker (3: no shape divides evenly). The
// losses and the final parameters (gathered by --save's reads) are the one process's.
TEST_F(GlobalGpt, ZeroOnTheDataAxesTrainsAsOneProcess) {
  const std::string gpt = example("global_gpt");
  const auto [expected, reference] = one_process({});
  // The last: every block recomputed in backward (TransformerBlockOptions::recompute), with
  // dropout: its masks drawn again alike, its weights gathered again at stage 3.
  const std::vector<std::array<std::string, 4>> runs = {
      {"hybrid", "4", "1", "0"}, {"hybrid", "4", "2", "0"}, {"hybrid", "4", "3", "0"},
      {"data", "3", "2", "0"},   {"data", "3", "3", "0"},   {"hybrid", "4", "3", "1"}};
  for (const auto& [plan, workers, stage, recompute] : runs) {
    const std::string name =
        plan + " on " + workers + " at zero stage " + stage + ", recompute " + recompute;
    const std::string file = dir_ / (plan + workers + "zero" + stage + "r" + recompute + ".pt");
    const auto result = run({"-n", workers, gpt, "--plan", plan, "--zero", stage, "--recompute",
                             recompute, "--save", file},
                            240s);
    expect_as_one_process(result, file, expected, reference, name);
  }
}

// The pipeline plans, with each schedule, micro-batches that don't divide the batch of 8 and
// fewer micro-batches than stages. Without dropout: a pipeline draws each micro-batch's mask on
// its own (docs/pipeline.md, "Global layers").
TEST_F(GlobalGpt, PipelinePlansTrainAsOneProcess) {
  const std::string gpt = example("global_gpt");
  const auto one =
      run({"-n", "1", gpt, "--plan", "one", "--dropout", "0", "--save", dir_ / "one.pt"});
  const auto expected = losses(one);
  ASSERT_EQ(expected.size(), 20u) << one.out;
  std::vector<torch::Tensor> reference;
  torch::load(reference, dir_ / "one.pt");
  struct Run {
    std::string plan, workers, schedule, micro_batches, recompute = "0", zero = "0";
  };
  // Then: every block recomputed in backward, inside the stages (split backward too); ZeRO on
  // the 3-D plan's data axis (PipelineOptions::zero_stage), its sums reduce-scattered at the end
  // of the step.
  const std::vector<Run> runs = {
      {"pipeline", "2", "1f1b", "4"},     {"pipeline", "2", "interleaved", "3"},
      {"pipeline", "4", "gpipe", "3"},    {"pipeline", "4", "zb", "2"},
      {"3d", "8", "1f1b", "4"},           {"3d", "8", "zb", "3"},
      {"3d", "8", "1f1b", "4", "1"},      {"pipeline", "2", "zb", "2", "1"},
      {"3d", "8", "1f1b", "4", "0", "1"}, {"3d", "8", "zb", "3", "0", "3"},
      {"3d", "8", "gpipe", "4", "1", "3"}};
  for (const auto& r : runs) {
    const std::string name = r.plan + " on " + r.workers + ", " + r.schedule + ", " +
                             r.micro_batches + " micro-batches, recompute " + r.recompute +
                             ", zero stage " + r.zero;
    const std::string file =
        dir_ / (r.plan + r.workers + r.schedule + r.recompute + "z" + r.zero + ".pt");
    const auto result = run({"-n", r.workers, gpt, "--plan", r.plan, "--dropout", "0", "--schedule",
                             r.schedule, "--micro-batches", r.micro_batches, "--recompute",
                             r.recompute, "--zero", r.zero, "--save", file},
                            240s);
    expect_as_one_process(result, file, expected, reference, name);
  }
}

// docs/comm.md: the plans train alike through shared memory (the default for workers on one
// host) and over Gloo's TCP (SHOAL_COMM=tcp), up to summation order: relative 1e-6, on the losses
// and the parameters. The hybrid plan's data-parallel all-reduces and tensor-parallel boxing, and
// a pipeline's sends and receives.
TEST_F(GlobalGpt, PlansTrainAlikeOnSharedMemoryAndOverTcp) {
  const std::string gpt = example("global_gpt");
  const std::vector<std::vector<std::string>> plans = {
      {"-n", "4", gpt, "--plan", "hybrid"},
      {"-n", "2", gpt, "--plan", "pipeline", "--dropout", "0", "--schedule", "1f1b",
       "--micro-batches", "4"}};
  for (const auto& plan : plans) {
    const std::string name = plan[4];
    std::vector<double> loss[2];
    std::vector<torch::Tensor> parameters[2];
    for (int tcp : {0, 1}) {
      const std::string file = dir_ / (name + (tcp ? "-tcp.pt" : "-shm.pt"));
      std::vector<std::string> args = plan;
      args.insert(args.end(), {"--save", file});
      if (tcp) ::setenv("SHOAL_COMM", "tcp", 1);
      const auto result = run(args, 240s);
      ::unsetenv("SHOAL_COMM");
      loss[tcp] = losses(result);
      ASSERT_EQ(loss[tcp].size(), 20u) << name << (tcp ? " over TCP" : "") << ":\n" << result.out;
      torch::load(parameters[tcp], file);
    }
    for (size_t i = 0; i < loss[0].size(); ++i)
      EXPECT_NEAR(loss[0][i], loss[1][i], 1e-6 * std::abs(loss[1][i])) << name << ", step " << i + 1;
    ASSERT_EQ(parameters[0].size(), parameters[1].size()) << name;
    for (size_t i = 0; i < parameters[0].size(); ++i) {
      const double error = (parameters[0][i] - parameters[1][i]).norm().item<double>();
      EXPECT_LE(error, 1e-6 * parameters[1][i].norm().item<double>()) << name << ", parameter " << i;
    }
  }
}

// Checkpoints across plans: 10 steps in 3d on 8 workers, saved (model, AdamW's state, the
// batches' stream), then 10 more in data on 2 workers, in a pipeline on 2 and on one process:
// each ends as one process that never stopped (losses of steps 11-20 and parameters, 1e-4).
TEST_F(GlobalGpt, CheckpointSavedIn3dResumesInOtherPlans) {
  const std::string gpt = example("global_gpt");
  const auto [expected, reference] = one_process({"--dropout", "0"}, 11);
  const std::string saved = dir_ / "3d.ckpt";
  run({"-n", "8", gpt, "--plan", "3d", "--dropout", "0", "--steps", "10", "--checkpoint", saved},
      240s);
  ASSERT_TRUE(fs::exists(saved));
  const std::vector<std::pair<std::string, std::string>> resumes = {
      {"data", "2"}, {"pipeline", "2"}, {"one", "1"}};
  for (const auto& [plan, workers] : resumes) {
    const std::string file = dir_ / ("resumed-" + plan + ".pt");
    const auto result = run({"-n", workers, gpt, "--plan", plan, "--dropout", "0", "--steps", "10",
                             "--resume", saved, "--save", file},
                            240s);
    EXPECT_NE(result.out.find("step 11 loss"), std::string::npos) << result.out;
    expect_as_one_process(result, file, expected, reference, "resumed in " + plan);
  }
}

TEST_F(GlobalGpt, BadPlansAreUsageErrors) {
  const auto result = run_shoal({"-n", "3", example("global_gpt"), "--plan", "hybrid"}, 60s);
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("--plan hybrid: expected an even number of workers, got 3"),
            std::string::npos)
      << result.err;
  const auto heads = run_shoal({"-n", "3", example("global_gpt"), "--plan", "tensor"}, 60s);
  EXPECT_EQ(heads.exit_code, 2);
  EXPECT_NE(heads.err.find("TransformerBlock: expected dim (64) to be a multiple of heads (4) and "
                           "heads a multiple of the "
                           "3 tensor-parallel workers"),
            std::string::npos)
      << heads.err;
}

// Checkpoints under ZeRO (Note [Saving a sharded global model], src/global/nn.cpp): 10 steps in
// hybrid at stage 3, saved, then 10 more in data at stage 1 on 3 workers, in hybrid at stage 2,
// in tensor at stage 0, on one process and in 3d at stage 3: each ends as one process that never
// stopped. And the other way: saved at stage 0 in tensor, resumed at stage 3 in hybrid.
TEST_F(GlobalGpt, CheckpointUnderZeroResumesInOtherPlansAndStages) {
  const std::string gpt = example("global_gpt");
  const auto [expected, reference] = one_process({"--dropout", "0"}, 11);
  const std::string sharded = dir_ / "zero3.ckpt", plain = dir_ / "tensor.ckpt";
  run({"-n", "4", gpt, "--plan", "hybrid", "--zero", "3", "--dropout", "0", "--steps", "10",
       "--checkpoint", sharded},
      240s);
  run({"-n", "4", gpt, "--plan", "tensor", "--dropout", "0", "--steps", "10", "--checkpoint",
       plain},
      240s);
  ASSERT_TRUE(fs::exists(sharded));
  ASSERT_TRUE(fs::exists(plain));
  const std::vector<std::array<std::string, 4>> resumes = {
      {sharded, "data", "3", "1"}, {sharded, "hybrid", "4", "2"}, {sharded, "tensor", "4", "0"},
      {sharded, "one", "1", "0"},  {sharded, "3d", "8", "3"},     {plain, "hybrid", "4", "3"}};
  for (const auto& [saved, plan, workers, stage] : resumes) {
    const std::string name = "saved as " + fs::path(saved).filename().string() + ", resumed in " +
                             plan + " at stage " + stage;
    const std::string file = dir_ / ("resumed-" + plan + stage + ".pt");
    const auto result = run({"-n", workers, gpt, "--plan", plan, "--zero", stage, "--dropout", "0",
                             "--steps", "10", "--resume", saved, "--save", file},
                            240s);
    EXPECT_NE(result.out.find("step 11 loss"), std::string::npos) << result.out;
    expect_as_one_process(result, file, expected, reference, name);
  }
}

}  // namespace
}  // namespace shoal::testing
