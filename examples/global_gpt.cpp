// A character-level GPT on global tensors, trained on the GNU GPL's text (which Debian's
// base-files installs). The four plans differ only in placement and SBP; on the same seed they
// train the same model to the same losses:
//
//   build/examples/global_gpt --plan one                               # one process
//   build/bin/shoal run -n 4 build/examples/global_gpt --plan data     # batch split(0)
//   build/bin/shoal run -n 4 build/examples/global_gpt --plan tensor   # Megatron: heads split
//   build/bin/shoal run -n 4 build/examples/global_gpt --plan hybrid   # 2 x 2: data x tensor
//
// --steps N (default 20), --save FILE writes the final parameters (whole values, by name) from
// the first worker, --text FILE trains on another text.
#include <fstream>
#include <iomanip>
#include <iostream>
#include <set>
#include <sstream>

#include <shoal/shoal.h>

#include "cli.h"

namespace g = shoal::global;

struct Config {
  int64_t vocabulary = 0, time = 32, batch = 8, dim = 64, heads = 4, layers = 2;
  double dropout = 0.1;
};

// How the plan lays out the model (Layout) and a batch of character ids.
struct Plan {
  g::nn::Layout layout;
  g::NdSbp batch{g::broadcast()};
};

Plan make_plan(const std::string& name) {
  const int n = shoal::world_size();
  if (name == "one") return {{g::Placement({0}), {}}, g::broadcast()};
  if (name == "data") return {{g::Placement::all(), {}}, g::split(0)};
  if (name == "tensor") return {{g::Placement::all(), {0}}, g::broadcast()};
  if (name == "hybrid") {
    if (n % 2 != 0)
      throw shoal::UsageError("--plan hybrid: expected an even number of workers, got " +
                              std::to_string(n));
    return {{g::Placement::mesh({2, n / 2}), {1}}, g::NdSbp{g::split(0), g::broadcast()}};
  }
  throw shoal::UsageError("--plan: expected one, data, tensor or hybrid, got '" + name + "'");
}

class GptImpl : public g::nn::Module {
 public:
  GptImpl(const Config& config, const g::nn::Layout& layout) : config_(config), layout_(layout) {
    const auto& p = layout.placement;
    tokens_ = register_module("tokens",
                              g::nn::Embedding(config.vocabulary, config.dim, p, layout.column()));
    positions_ = register_module("positions",
                                 g::nn::Embedding(config.time, config.dim, p, layout.replicated()));
    for (int64_t i = 0; i < config.layers; ++i) {
      blocks_.push_back(register_module(
          "block" + std::to_string(i),
          g::nn::TransformerBlock(
              g::nn::TransformerBlockOptions{config.dim, config.heads, 0, config.dropout},
              layout)));
    }
    norm_ = register_module("norm", g::nn::LayerNorm(config.dim, p));
    head_ = register_module(
        "head", g::nn::Linear(config.dim, config.vocabulary, p, layout.column(), false));
  }

  // ids [batch, time] -> logits [batch, time, vocabulary]
  g::GlobalTensor forward(const g::GlobalTensor& ids) {
    const auto where = g::arange(ids.shape()[1], layout_.placement, layout_.replicated());
    g::GlobalTensor x =
        g::dropout(tokens_(ids) + positions_(where), config_.dropout, is_training());
    for (auto& block : blocks_) x = block(x);
    return head_(norm_(x));
  }

 private:
  Config config_;
  g::nn::Layout layout_;
  g::nn::Embedding tokens_{nullptr}, positions_{nullptr};
  std::vector<g::nn::TransformerBlock> blocks_;
  g::nn::LayerNorm norm_{nullptr};
  g::nn::Linear head_{nullptr};
};
TORCH_MODULE(Gpt);

int main(int argc, char** argv) {
  CLI::App app{"A character-level GPT on global tensors, in one of four plans.", "global_gpt"};
  std::string plan_name = "one", save, text_path = "/usr/share/common-licenses/GPL-3";
  int steps = 20;
  app.add_option("--plan", plan_name, "one, data, tensor or hybrid");
  app.add_option("--steps", steps, "training steps")->check(examples::positive());
  app.add_option("--save", save, "write the final parameters here");
  app.add_option("--text", text_path, "the text to train on");
  if (const int code = examples::parse(app, argc, argv); code >= 0) return code;
  try {
    shoal::init();
    const Plan plan = make_plan(plan_name);

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

    Config config;
    config.vocabulary = next;
    if (static_cast<int64_t>(ids.size()) <= config.time + 1)
      throw shoal::UsageError("--text: too short to train on");
    torch::manual_seed(0);
    Gpt model(config, plan.layout);
    g::nn::GradientSync sync(model);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));

    const int64_t rows = config.batch * config.time;
    for (int step = 1; step <= steps; ++step) {
      // Every worker draws the whole batch (the same, after the same seed) and keeps its piece.
      const torch::Tensor starts = torch::randint(corpus.size(0) - config.time - 1, {config.batch});
      std::vector<torch::Tensor> inputs, targets;
      for (int64_t b = 0; b < config.batch; ++b) {
        inputs.push_back(corpus.narrow(0, starts[b].item<int64_t>(), config.time));
        targets.push_back(corpus.narrow(0, starts[b].item<int64_t>() + 1, config.time));
      }
      const auto x =
          g::GlobalTensor::from_full(torch::stack(inputs), plan.layout.placement, plan.batch);
      const auto y =
          g::GlobalTensor::from_full(torch::stack(targets), plan.layout.placement, plan.batch);
      optimizer.zero_grad();
      const auto logits = model->forward(x);
      const auto loss =
          g::cross_entropy(g::reshape(logits, {rows, config.vocabulary}), g::reshape(y, {rows}));
      loss.backward();
      optimizer.step();
      const double value = loss.detach().full().item<double>();
      if (shoal::is_main())
        std::cout << "step " << step << " loss " << std::setprecision(9) << value << std::endl;
    }
    if (!save.empty()) {
      // In named_global_parameters() order, which every plan shares.
      std::vector<torch::Tensor> wholes;
      for (const auto& named : model->named_global_parameters())
        wholes.push_back(named.second.detach().full());
      if (shoal::is_main()) torch::save(wholes, save);
    }
  } catch (const shoal::UsageError& e) {
    std::cerr << "global_gpt: " << e.what() << std::endl;
    return 2;
  }
  return 0;
}
