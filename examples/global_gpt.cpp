// A character-level GPT on global tensors, trained on the GNU GPL's text (which Debian's
// base-files installs). The plans differ only in placement and SBP; on the same seed they train
// the same model to the same losses:
//
//   build/examples/global_gpt --plan one                               # one process
//   build/bin/shoal run -n 4 build/examples/global_gpt --plan data     # batch split(0)
//   build/bin/shoal run -n 4 build/examples/global_gpt --plan tensor   # Megatron: heads split
//   build/bin/shoal run -n 4 build/examples/global_gpt --plan hybrid   # 2 x 2: data x tensor
//   build/bin/shoal run -n 4 build/examples/global_gpt --plan pipeline # a stage per worker
//   build/bin/shoal run -n 8 build/examples/global_gpt --plan 3d       # 2 stages x 2 data x 2
//   tensor
//
// The pipeline plans take --schedule gpipe|1f1b|interleaved|zb (default 1f1b) and
// --micro-batches M (default 4). --checkpoint FILE saves the model, its optimizer and the
// batches' stream after training, and --resume FILE goes on from such a file in any plan (train
// in 3d on 8 workers, resume in data on 2). --steps N (default 20), --save FILE writes the final
// parameters (whole values, by name) from the first worker, --text FILE trains on another text,
// --layers and --dropout change the model. A pipeline draws each micro-batch's dropout mask on its
// own, so its losses equal one process's at --dropout 0 (docs/pipeline.md, "Global layers").
// --recompute K recomputes every K-th block in backward instead of keeping its activations
// (g::nn::TransformerBlockOptions::recompute).
// --zero S shards each parameter's piece over its data axes at ZeRO stage S
// (g::nn::GradientSyncOptions::zero_stage, PipelineOptions::zero_stage).
// --report prints one line of measurements after training (bench/gpt_plans.sh, "Report" below).
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <set>
#include <sstream>

#include <shoal/shoal.h>

#include "cli.h"

namespace g = shoal::global;
namespace pp = shoal::pipeline;

struct Config {
  int64_t vocabulary = 0, time = 32, batch = 8, dim = 64, heads = 4, layers = 2;
  double dropout = 0.1;
  int recompute = 0;  // every k-th block recomputed in backward; 0: none
};

// The first layer: token and position embeddings. ids [batch, time] -> [batch, time, dim]
class EmbedImpl : public g::nn::Module {
 public:
  EmbedImpl(const Config& config, const g::nn::Layout& layout)
      : dropout_(config.dropout), layout_(layout) {
    const auto& p = layout.placement;
    tokens_ = register_module("tokens",
                              g::nn::Embedding(config.vocabulary, config.dim, p, layout.column()));
    positions_ = register_module("positions",
                                 g::nn::Embedding(config.time, config.dim, p, layout.replicated()));
  }
  g::GlobalTensor forward(const g::GlobalTensor& ids) {
    const auto where = g::arange(ids.shape()[1], layout_.placement, layout_.replicated());
    return g::dropout(tokens_(ids) + positions_(where), dropout_, is_training());
  }

 private:
  double dropout_;
  g::nn::Layout layout_;
  g::nn::Embedding tokens_{nullptr}, positions_{nullptr};
};
TORCH_MODULE(Embed);

// The last layer: the final norm and the output head. -> logits [batch, time, vocabulary]
class HeadImpl : public g::nn::Module {
 public:
  HeadImpl(const Config& config, const g::nn::Layout& layout) {
    norm_ = register_module("norm", g::nn::LayerNorm(config.dim, layout.placement));
    head_ = register_module("head", g::nn::Linear(config.dim, config.vocabulary, layout.placement,
                                                  layout.column(), false));
  }
  g::GlobalTensor forward(const g::GlobalTensor& x) { return head_(norm_(x)); }

 private:
  g::nn::LayerNorm norm_{nullptr};
  g::nn::Linear head_{nullptr};
};
TORCH_MODULE(Head);

// How a plan lays out each layer (layouts[i] for layer i), the batch's SBP, and for the pipeline
// plans their stages.
struct Plan {
  std::vector<g::nn::Layout> layouts;
  g::NdSbp batch{g::broadcast()};
  bool pipeline = false;
};

Plan make_plan(const std::string& name, int layers, int stages_per_worker) {
  const int n = shoal::world_size();
  auto same = [&](g::nn::Layout layout, g::NdSbp batch) {
    return Plan{std::vector<g::nn::Layout>(layers, layout), batch, false};
  };
  if (name == "one") return same({g::Placement({0}), {}}, g::broadcast());
  if (name == "data") return same({g::Placement::all(), {}}, g::split(0));
  if (name == "tensor") return same({g::Placement::all(), {0}}, g::broadcast());
  if (name == "hybrid") {
    if (n % 2 != 0)
      throw shoal::UsageError("--plan hybrid: expected an even number of workers, got " +
                              std::to_string(n));
    return same({g::Placement::mesh({2, n / 2}), {1}}, g::NdSbp{g::split(0), g::broadcast()});
  }
  // A pipeline: the layers cut into stages (balanced by parameter count, as pp::Pipeline does
  // for plain layers), stage s on the placement of worker group s % groups.
  std::vector<g::nn::Layout> groups;
  Plan plan;
  plan.pipeline = true;
  if (name == "pipeline") {
    for (int w = 0; w < n; ++w) groups.push_back({g::Placement({w}), {}});
  } else if (name == "3d") {
    if (n % 4 != 0)
      throw shoal::UsageError(
          "--plan 3d: expected a multiple of 4 workers (2 stages x 2 data x "
          "tensor), got " +
          std::to_string(n));
    for (int w = 0; w < 2; ++w) {
      std::vector<int> ranks;
      for (int r = w * n / 2; r < (w + 1) * n / 2; ++r) ranks.push_back(r);
      groups.push_back({g::Placement::mesh({2, n / 4}, ranks), {1}});
    }
    plan.batch = g::NdSbp{g::split(0), g::broadcast()};
  } else {
    throw shoal::UsageError("--plan: expected one, data, tensor, hybrid, pipeline or 3d, got '" +
                            name + "'");
  }
  const int stages = static_cast<int>(groups.size()) * stages_per_worker;
  std::vector<int64_t> weights(layers, 12);  // a block's 12 dim^2, about; the ends 2 dim^2
  weights.front() = weights.back() = 2;
  int layer = 0, stage = 0;
  for (int length : pp::balanced_split(weights, stages)) {
    for (int i = 0; i < length; ++i, ++layer) plan.layouts.push_back(groups[stage % groups.size()]);
    ++stage;
  }
  return plan;
}

// The model, as one Sequential of layers in every plan, so that its parameters have the same
// names everywhere ("layers.0.tokens.weight", ...).
class GptImpl : public g::nn::Module {
 public:
  GptImpl(const Config& config, const Plan& plan) {
    layers = register_module("layers", torch::nn::Sequential());
    const int count = static_cast<int>(plan.layouts.size());
    layers->push_back(Embed(config, plan.layouts[0]));
    for (int i = 1; i + 1 < count; ++i) {
      // Blocks 1, 1 + k, 1 + 2k, ... under --recompute k.
      const bool recompute = config.recompute > 0 && (i - 1) % config.recompute == 0;
      layers->push_back(g::nn::TransformerBlock(
          g::nn::TransformerBlockOptions{config.dim, config.heads, 0, config.dropout, recompute},
          plan.layouts[i]));
    }
    layers->push_back(Head(config, plan.layouts[count - 1]));
  }
  // ids [batch, time] -> logits [batch, time, vocabulary]
  g::GlobalTensor forward(const g::GlobalTensor& ids) {
    return layers->forward<g::GlobalTensor>(ids);
  }
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(Gpt);

int main(int argc, char** argv) {
  CLI::App app{"A character-level GPT on global tensors, in one of six plans.", "global_gpt"};
  std::string plan_name = "one", save, text_path = "/usr/share/common-licenses/GPL-3";
  std::string schedule = "1f1b", checkpoint, resume;
  int steps = 20, micro_batches = 4, zero_stage = 0;
  bool report = false;
  Config config;
  app.add_option("--plan", plan_name, "one, data, tensor, hybrid, pipeline or 3d");
  app.add_option("--steps", steps, "training steps")->check(examples::positive());
  app.add_option("--save", save, "write the final parameters here");
  app.add_option("--text", text_path, "the text to train on");
  app.add_option("--schedule", schedule, "pipeline plans: gpipe, 1f1b, interleaved or zb");
  app.add_option("--micro-batches", micro_batches, "pipeline plans: micro-batches per batch")
      ->check(examples::positive());
  app.add_option("--checkpoint", checkpoint,
                 "after training, save the model, its optimizer and where the batches stand");
  app.add_option("--resume", resume, "go on from a --checkpoint file, saved in any plan");
  app.add_option("--layers", config.layers, "transformer blocks")->check(examples::positive());
  app.add_option("--dropout", config.dropout, "dropout probability")->check(CLI::Range(0.0, 1.0));
  app.add_option("--recompute", config.recompute,
                 "recompute every k-th transformer block in backward (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--zero", zero_stage, "ZeRO stage on the data axes (0-3)")
      ->check(CLI::Range(0, 3));
  app.add_flag("--report", report, "print the step time and bytes sent per step at the end");
  if (const int code = examples::parse(app, argc, argv); code >= 0) return code;
  try {
    shoal::init();
    const int stages_per_worker = schedule == "interleaved" ? 2 : 1;
    const Plan plan = make_plan(plan_name, static_cast<int>(config.layers) + 2, stages_per_worker);
    const g::Placement& first = plan.layouts.front().placement;
    const g::Placement& last = plan.layouts.back().placement;

    std::ifstream file(text_path, std::ios::binary);
    if (!file) throw shoal::UsageError("--text: cannot read " + text_path);
    std::stringstream buffer;
    buffer << file.rdbuf();
    const std::string text = buffer.str();
    const std::set<unsigned char> characters(text.begin(), text.end());
    std::vector<int64_t> id_of(256, 0);
    int64_t next = 0;
    for (unsigned char c : characters) id_of[c] = next++;
    std::vector<int64_t> ids;
    for (unsigned char c : text) ids.push_back(id_of[c]);
    const torch::Tensor corpus = torch::tensor(ids);

    config.vocabulary = next;
    if (static_cast<int64_t>(ids.size()) <= config.time + 1)
      throw shoal::UsageError("--text: too short to train on");
    torch::manual_seed(0);
    Gpt model(config, plan);
    // The batches have their own random stream: a pipeline's stages draw different dropout
    // masks from the default one, and every worker must still draw the same batches.
    auto batches = at::make_generator<at::CPUGeneratorImpl>(1);

    // A pipeline plan runs the layers in stages, and sums the gradients itself (GradientSync
    // would sum them at every micro-batch's backward); the other plans run the model whole.
    std::unique_ptr<pp::Pipeline> pipe;
    std::unique_ptr<g::nn::GradientSync> sync;
    if (plan.pipeline) {
      pp::PipelineOptions options;
      options.micro_batches = micro_batches;
      options.schedule = shoal::pipeline::parse_schedule_kind(schedule);
      options.batch = plan.batch.axes();
      options.zero_stage = zero_stage;
      pipe = std::make_unique<pp::Pipeline>(model->layers, options);
    } else {
      g::nn::GradientSyncOptions sync_options;
      sync_options.zero_stage = zero_stage;
      sync = std::make_unique<g::nn::GradientSync>(model, sync_options);
    }
    // Under ZeRO the optimizer updates this worker's slices (GradientSync::parameters()).
    torch::optim::AdamW optimizer(pipe ? pipe->parameters() : sync->parameters(),
                                  torch::optim::AdamWOptions(1e-3));
    const int64_t vocabulary = config.vocabulary;
    auto loss_of = [vocabulary](const g::GlobalTensor& logits, const g::GlobalTensor& y) {
      const int64_t rows = logits.size(0) * logits.size(1);
      return g::cross_entropy(g::reshape(logits, {rows, vocabulary}), g::reshape(y, {rows}));
    };

    int first_step = 1;
    if (!resume.empty()) {
      // The whole model and its optimizer's state, cut for this plan (docs/checkpoint.md).
      shoal::CheckpointExtras extras;
      shoal::LoadOptions load_options;
      load_options.extras = &extras;
      shoal::load(resume, *model, optimizer, load_options);
      if (extras.count("step") == 0 || extras.count("batches") == 0)
        throw shoal::UsageError("--resume: " + resume + " was not saved by --checkpoint");
      first_step = static_cast<int>(extras.at("step").item<int64_t>()) + 1;
      batches.set_state(extras.at("batches"));
    }
    const int last_step = first_step + steps - 1;
    // Report: the steps after the first few (which allocate, learn the pipeline's shapes and
    // warm the caches) are timed on each worker, from one step's start to the next's.
    constexpr int kUntimedSteps = 3;
    if (report && steps <= kUntimedSteps)
      throw shoal::UsageError("--report: expected --steps above " + std::to_string(kUntimedSteps) +
                              ", got " + std::to_string(steps));
    std::vector<double> step_ms;
    int64_t sent_before = 0, sent_after = 0;
    for (int step = first_step; step <= last_step; ++step) {
      const auto started = std::chrono::steady_clock::now();
      const bool timed = step - first_step >= kUntimedSteps;
      if (step - first_step == kUntimedSteps) sent_before = shoal::comm::sent_bytes();
      // Every worker draws the whole batch (the same, after the same seed) and keeps its piece.
      const torch::Tensor starts =
          torch::randint(corpus.size(0) - config.time - 1, {config.batch}, batches);
      std::vector<torch::Tensor> inputs, targets;
      for (int64_t b = 0; b < config.batch; ++b) {
        inputs.push_back(corpus.narrow(0, starts[b].item<int64_t>(), config.time));
        targets.push_back(corpus.narrow(0, starts[b].item<int64_t>() + 1, config.time));
      }
      optimizer.zero_grad();
      double value = 0;
      if (pipe) {
        value = pipe->step(torch::stack(inputs), torch::stack(targets), loss_of).item<double>();
      } else {
        const auto x = g::GlobalTensor::from_full(torch::stack(inputs), first, plan.batch);
        const auto y = g::GlobalTensor::from_full(torch::stack(targets), last, plan.batch);
        const auto loss = loss_of(model->forward(x), y);
        loss.backward();
        value = loss.detach().full().item<double>();
      }
      optimizer.step();
      if (shoal::is_main())
        std::cout << "step " << step << " loss " << std::setprecision(9) << value << std::endl;
      if (timed) {
        step_ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
                .count());
      }
    }
    sent_after = shoal::comm::sent_bytes();
    if (!checkpoint.empty()) {
      shoal::SaveOptions save_options;
      save_options.extras["step"] = torch::tensor(int64_t{last_step});
      save_options.extras["batches"] = batches.get_state();
      shoal::save(checkpoint, *model, optimizer, save_options);
    }
    if (!save.empty()) {
      // In named_global_parameters() order, which every plan shares.
      std::vector<torch::Tensor> wholes;
      for (const auto& named : model->named_global_parameters())
        wholes.push_back(named.second.detach().full());
      if (shoal::is_main()) torch::save(wholes, save);
    }
    if (report) {
      // Gathered after the timed steps, so that gathering is not counted. The time is the first
      // worker's median step; the bytes the mean over workers per timed step; the stash the
      // most micro-batches any stage of any worker kept at once in the last step.
      const int timed = steps - kUntimedSteps;
      int peak_stash = -1;
      if (pipe) {
        for (const auto& stage : pipe->last_step_stats())
          peak_stash = std::max(peak_stash, stage.peak_stashed);
      }
      const auto mine = torch::tensor(
          {static_cast<double>(sent_after - sent_before) / timed, static_cast<double>(peak_stash)},
          torch::kFloat64);
      const auto all = shoal::world().all_gather(mine.view({1, 2}));
      std::nth_element(step_ms.begin(), step_ms.begin() + step_ms.size() / 2, step_ms.end());
      if (shoal::is_main()) {
        std::cout << "report plan=" << plan_name << " workers=" << shoal::world_size()
                  << " schedule=" << (pipe ? schedule : "-")
                  << " micro_batches=" << (pipe ? std::to_string(micro_batches) : "-") << std::fixed
                  << std::setprecision(2) << " step_ms=" << step_ms[step_ms.size() / 2]
                  << " sent_kib_per_step=" << all.select(1, 0).mean().item<double>() / 1024
                  << " peak_stash="
                  << (pipe ? std::to_string(all.select(1, 1).max().item<int64_t>()) : "-")
                  << std::endl;
      }
    }
  } catch (const shoal::UsageError& e) {
    std::cerr << "global_gpt: " << e.what() << std::endl;
    return 2;
  }
  return 0;
}
