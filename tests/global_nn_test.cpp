// Global layers and GradientSync: after backward every worker's .grad is the gradient of its
// piece, as one process computes it, in data-, tensor- and 2-D-parallel layouts; the workers
// summed over are those holding the same piece; plain parameters are refused. And the oracle
// outside shoal: Linear, Embedding, LayerNorm, the GPT-2 block and a small GPT give the outputs
// and gradients of the same model written in plain LibTorch (torch::nn, with the same weights
// copied in), on one worker and on 4 in the data, tensor and hybrid plans.
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "shoal/global/nn.h"
#include "shoal/shoal.h"

namespace {

namespace g = shoal::global;
using shoal::testing::run_workers;

// Two linears (column- then row-parallel where the layout says) and a layer norm.
class MlpImpl : public g::nn::Module {
 public:
  explicit MlpImpl(const g::nn::Layout& layout) {
    up = register_module("up", g::nn::Linear(6, 8, layout.placement, layout.column()));
    down = register_module("down", g::nn::Linear(8, 6, layout.placement, layout.row()));
    norm = register_module("norm", g::nn::LayerNorm(6, layout.placement));
  }
  g::GlobalTensor forward(const g::GlobalTensor& x) { return norm(down(g::relu(up(x)))); }
  g::nn::Linear up{nullptr}, down{nullptr};
  g::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Mlp);

// The gradients of every parameter, whole, after one step on a batch of `rows` rows in `batch`.
std::vector<torch::Tensor> gradients(const g::nn::Layout& layout, const g::NdSbp& batch, int64_t rows = 5) {
  torch::manual_seed(11);
  Mlp model(layout);
  g::nn::GradientSync sync(model);
  const auto x = g::randn({rows, 6}, layout.placement, batch);
  const auto target = g::randn({rows, 6}, layout.placement, batch);
  const auto diff = model->forward(x) - target;
  g::mean(diff * diff).backward();
  std::vector<torch::Tensor> grads;
  for (const auto& named : model->named_global_parameters()) {
    // Each worker's .grad is its piece's whole gradient: broadcast where the parameter is.
    const auto& local = named.second.to_local();
    const auto grad =
        g::GlobalTensor(local.grad().defined() ? local.grad() : torch::zeros_like(local),
                        named.second.placement(), named.second.sbp(), named.second.shape());
    grads.push_back(grad.full());
  }
  return grads;
}

TEST(GradientSync, GradientsEqualOneProcessInEveryLayout) {
  run_workers(4, [] {
    const auto one = gradients({g::Placement({0}), {}}, g::broadcast());
    const auto all = g::Placement::all();
    const auto mesh = g::Placement::mesh({2, 2});
    const std::vector<std::pair<std::string, std::vector<torch::Tensor>>> plans = {
        {"data", gradients({all, {}}, g::split(0))},
        {"tensor", gradients({all, {0}}, g::broadcast())},
        {"2-D", gradients({mesh, {1}}, g::NdSbp{g::split(0), g::broadcast()})},
        {"2-D, batch split on both axes",
         gradients({mesh, {}}, g::NdSbp{g::split(0), g::split(0)})},
    };
    for (const auto& [name, grads] : plans) {
      ASSERT_EQ(grads.size(), one.size());
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_TRUE(grads[i].allclose(one[i], 1e-5, 1e-6)) << name << ", parameter " << i << "\n"
                                                           << grads[i] << "\n"
                                                           << one[i];
      }
    }
  });
}

// A global loss is the mean over the global batch, so GradientSync needs no weights for uneven
// shares (docs/dp.md, "The loss and uneven shares"): 3 rows over 4 workers leave one with none.
TEST(GradientSync, GradientsEqualOneProcessWhenAWorkerHoldsNoRows) {
  run_workers(4, [] {
    const auto one = gradients({g::Placement({0}), {}}, g::broadcast(), 3);
    const auto all = g::Placement::all();
    const auto mesh = g::Placement::mesh({2, 2});
    const std::vector<std::pair<std::string, std::vector<torch::Tensor>>> plans = {
        {"data, rows 1, 1, 1, 0", gradients({all, {}}, g::split(0), 3)},
        {"2-D, rows 1, 1, 1, 0", gradients({mesh, {}}, g::NdSbp{g::split(0), g::split(0)}, 3)},
    };
    for (const auto& [name, grads] : plans) {
      ASSERT_EQ(grads.size(), one.size());
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_TRUE(grads[i].allclose(one[i], 1e-5, 1e-6)) << name << ", parameter " << i << "\n"
                                                           << grads[i] << "\n"
                                                           << one[i];
      }
    }
  });
}

TEST(GradientSync, SumsOverTheWorkersHoldingThePiece) {
  run_workers(4, [] {
    const auto mesh = g::Placement::mesh({2, 2});
    Mlp model(g::nn::Layout{mesh, {1}});
    g::nn::GradientSync sync(model);
    // Weights split on axis 1 are summed along axis 0; the layer norm's over all four.
    const int r = shoal::rank();
    const std::vector<int> column = {r % 2, r % 2 + 2};
    EXPECT_EQ(sync.groups(), (std::vector<std::vector<int>>{column, {0, 1, 2, 3}}))
        << "worker " << r;
  });
}

// ZeRO on the data axes (GradientSyncOptions::zero_stage): on the 2 x 2 mesh each piece is cut
// over the workers holding it (2 for the linears, 4 for the layer norm), and after backward each
// worker's slice holds its part of the piece's summed gradient, as stage 0 sums it whole. At
// stages 2 and 3 the pieces keep no gradient; at stage 3 no memory either.
TEST(GradientSync, ZeroSlicesGetTheirPartOfTheSummedGradient) {
  run_workers(4, [] {
    const g::nn::Layout layout{g::Placement::mesh({2, 2}), {1}};
    const g::NdSbp batch{g::split(0), g::broadcast()};
    const auto backward = [&](Mlp& model) {
      torch::manual_seed(12);
      const auto x = g::randn({5, 6}, layout.placement, batch);
      const auto target = g::randn({5, 6}, layout.placement, batch);
      const auto diff = model->forward(x) - target;
      g::mean(diff * diff).backward();
    };
    torch::manual_seed(11);
    Mlp plain(layout);
    g::nn::GradientSync whole(plain);
    backward(plain);
    for (int stage : {1, 2, 3}) {
      torch::manual_seed(11);
      Mlp sharded(layout);
      g::nn::GradientSyncOptions options;
      options.zero_stage = stage;
      g::nn::GradientSync sync(sharded, options);
      backward(sharded);
      const auto slices = sync.parameters();
      const auto pieces = plain->parameters();
      const auto globals = sharded->named_global_parameters();
      ASSERT_EQ(slices.size(), pieces.size());
      for (size_t i = 0; i < slices.size(); ++i) {
        const auto holders = g::nn::piece_holders(globals[i].second);
        const int n = static_cast<int>(holders.size());
        const int r = static_cast<int>(std::find(holders.begin(), holders.end(), shoal::rank()) -
                                       holders.begin());
        const auto sizes = shoal::comm::split_sizes(pieces[i].numel(), n);
        int64_t start = 0;
        for (int j = 0; j < r; ++j) start += sizes[j];
        const auto expected = pieces[i].grad().reshape(-1).narrow(0, start, sizes[r]);
        const std::string what = "stage " + std::to_string(stage) + ", " + globals[i].first;
        ASSERT_EQ(slices[i].numel(), sizes[r]) << what;
        if (sizes[r] == 0) continue;
        ASSERT_TRUE(slices[i].grad().defined()) << what;
        EXPECT_TRUE(slices[i].grad().allclose(expected, 1e-5, 1e-6)) << what;
        const auto& piece = globals[i].second.to_local();
        if (stage >= 2) EXPECT_FALSE(piece.grad().defined()) << what;
        if (stage == 3) EXPECT_EQ(piece.storage().nbytes(), 0u) << what;
      }
    }
  });
}

TEST(GradientSync, ZeroStageOutOfRangeIsRefused) {
  run_workers(1, [] {
    g::nn::GradientSyncOptions options;
    options.zero_stage = 4;
    try {
      g::nn::GradientSync sync(Mlp(g::nn::Layout{g::Placement({0}), {}}), options);
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(), "GradientSync: zero_stage must be 0, 1, 2 or 3, got 4");
    }
  });
}

// TransformerBlockOptions::recompute on 2 tensor-parallel workers, with dropout: the gradients
// of x and of every weight equal the block kept whole, bit for bit on one thread (the dropout
// masks drawn again alike, the all-reduces run again), and between forward and backward the
// recomputed block holds less.
TEST(TransformerBlock, RecomputedGivesTheSameGradientsAndHoldsLess) {
  run_workers(2, [] {
    at::set_num_threads(1);
    const g::nn::Layout layout{g::Placement::all(), {0}};
    const auto run = [&](bool recompute, int64_t* held) {
      torch::manual_seed(5);
      g::nn::TransformerBlock block(g::nn::TransformerBlockOptions{32, 4, 0, 0.1, recompute},
                                    layout);
      torch::manual_seed(6);
      auto x = g::randn({16, 24, 32}, layout.placement, layout.replicated());
      x.requires_grad_();
      const auto in_use = [] {
        const auto info = mallinfo2();
        return static_cast<int64_t>(info.uordblks + info.hblkhd);
      };
      const int64_t before = in_use();
      const auto loss = g::mean(block->forward(x));
      *held = in_use() - before;
      loss.backward();
      std::vector<torch::Tensor> grads{x.to_local().grad()};
      for (const auto& p : block->parameters()) grads.push_back(p.grad());
      return grads;
    };
    int64_t warm = 0, plain_held = 0, recomputed_held = 0;
    run(false, &warm);
    const auto plain = run(false, &plain_held);
    const auto recomputed = run(true, &recomputed_held);
    ASSERT_EQ(plain.size(), recomputed.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_TRUE(plain[i].defined() && recomputed[i].defined()) << i;
      EXPECT_TRUE(torch::equal(plain[i], recomputed[i])) << "gradient " << i;
    }
    EXPECT_LT(recomputed_held, plain_held / 2) << recomputed_held << " against " << plain_held;
  });
}

class PlainImpl : public g::nn::Module {
 public:
  PlainImpl() { register_parameter("scale", torch::ones({3})); }
};
TORCH_MODULE(Plain);

TEST(GradientSync, RefusesPlainParameters) {
  run_workers(2, [] {
    try {
      g::nn::GradientSync sync(Plain{});
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "GradientSync: parameter 'scale' is a plain tensor; register it with "
                   "register_global_parameter so that its layout says how its gradient is shared");
    }
  });
}

// ---- Against plain LibTorch ----
//
// Each reference below is the textbook torch::nn model, written without shoal; its parameters
// carry the global layers' names, so that the global model's weights (whole, by .full()) can be
// copied into it by name. Both then run forward and backward on the same data; the global
// outputs, input gradients and parameter gradients (each worker's .grad is the gradient of its
// piece after GradientSync; see gradients() above) must equal the reference's.

// A GPT-2 block as torch::nn writes it: pre-norm causal self-attention and a GELU MLP, each in
// a residual. As in shoal's block, the key projection has no bias (softmax cancels it).
class ReferenceBlockImpl : public torch::nn::Module {
 public:
  ReferenceBlockImpl(int64_t dim, int64_t heads) : heads_(heads) {
    using torch::nn::LayerNormOptions;
    using torch::nn::LinearOptions;
    norm1 = register_module("norm1", torch::nn::LayerNorm(LayerNormOptions({dim})));
    query = register_module("query", torch::nn::Linear(dim, dim));
    key = register_module("key", torch::nn::Linear(LinearOptions(dim, dim).bias(false)));
    value = register_module("value", torch::nn::Linear(dim, dim));
    projection = register_module("projection", torch::nn::Linear(dim, dim));
    norm2 = register_module("norm2", torch::nn::LayerNorm(LayerNormOptions({dim})));
    up = register_module("up", torch::nn::Linear(dim, 4 * dim));
    down = register_module("down", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t batch = x.size(0), time = x.size(1), dim = x.size(2), head_dim = dim / heads_;
    auto heads = [&](const torch::Tensor& t) {
      return t.view({batch, time, heads_, head_dim}).transpose(1, 2);
    };
    const auto h = norm1(x);
    const auto q = heads(query(h)), k = heads(key(h)), v = heads(value(h));
    const auto future = torch::ones({time, time}, torch::kBool).triu(1);
    const auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(head_dim));
    const auto attention =
        torch::softmax(scores.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    const auto y = x + projection(torch::matmul(attention, v).transpose(1, 2).reshape(x.sizes()));
    return y + down(torch::gelu(up(norm2(y))));
  }
  int64_t heads_;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear query{nullptr}, key{nullptr}, value{nullptr}, projection{nullptr}, up{nullptr},
      down{nullptr};
};
TORCH_MODULE(ReferenceBlock);

struct GptConfig {
  int64_t vocabulary = 16, time = 8, dim = 16, heads = 4, layers = 2;
};

// examples/global_gpt.cpp's model, without dropout.
class GlobalGptImpl : public g::nn::Module {
 public:
  GlobalGptImpl(const GptConfig& c, const g::nn::Layout& layout) : layout_(layout) {
    const auto& p = layout.placement;
    tokens = register_module("tokens", g::nn::Embedding(c.vocabulary, c.dim, p, layout.column()));
    positions =
        register_module("positions", g::nn::Embedding(c.time, c.dim, p, layout.replicated()));
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks.push_back(register_module(
          "block" + std::to_string(i),
          g::nn::TransformerBlock(g::nn::TransformerBlockOptions{c.dim, c.heads, 0, 0}, layout)));
    }
    norm = register_module("norm", g::nn::LayerNorm(c.dim, p));
    head = register_module("head", g::nn::Linear(c.dim, c.vocabulary, p, layout.column(), false));
  }
  g::GlobalTensor forward(const g::GlobalTensor& ids) {
    const auto where = g::arange(ids.shape()[1], layout_.placement, layout_.replicated());
    g::GlobalTensor x = tokens(ids) + positions(where);
    for (auto& block : blocks) x = block(x);
    return head(norm(x));
  }
  g::nn::Layout layout_;
  g::nn::Embedding tokens{nullptr}, positions{nullptr};
  std::vector<g::nn::TransformerBlock> blocks;
  g::nn::LayerNorm norm{nullptr};
  g::nn::Linear head{nullptr};
};
TORCH_MODULE(GlobalGpt);

class ReferenceGptImpl : public torch::nn::Module {
 public:
  explicit ReferenceGptImpl(const GptConfig& c) {
    tokens = register_module("tokens", torch::nn::Embedding(c.vocabulary, c.dim));
    positions = register_module("positions", torch::nn::Embedding(c.time, c.dim));
    for (int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(
          register_module("block" + std::to_string(i), ReferenceBlock(c.dim, c.heads)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    head = register_module(
        "head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocabulary).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    torch::Tensor x = tokens(ids) + positions(torch::arange(ids.size(1)));
    for (auto& block : blocks) x = block(x);
    return head(norm(x));
  }
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  std::vector<ReferenceBlock> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ReferenceGpt);

// The parallel plans of examples/global_gpt.cpp: where the weights are, and the batch's SBP.
struct Plan {
  std::string name;
  g::nn::Layout layout;
  g::NdSbp batch;
};

// On one worker in a job of one; on 4: data, tensor and hybrid (2 x 2 mesh: data x tensor).
std::vector<Plan> plans() {
  if (shoal::world_size() == 1) return {{"one worker", {g::Placement::all(), {}}, g::broadcast()}};
  const auto all = g::Placement::all();
  return {{"data", {all, {}}, g::split(0)},
          {"tensor", {all, {0}}, g::broadcast()},
          {"hybrid", {g::Placement::mesh({2, 2}), {1}}, g::NdSbp{g::split(0), g::broadcast()}}};
}

// Copies the global module's parameters into the reference, by name; every name must match.
void copy_into(g::nn::Module& global, torch::nn::Module& reference) {
  auto targets = reference.named_parameters();
  const auto sources = global.named_global_parameters();
  ASSERT_EQ(sources.size(), targets.size()) << "the reference has other parameters";
  torch::NoGradGuard no_grad;
  for (const auto& [name, parameter] : sources) {
    torch::Tensor* target = targets.find(name);
    ASSERT_NE(target, nullptr) << "the reference has no parameter '" << name << "'";
    const auto whole = parameter.full();
    ASSERT_EQ(target->sizes(), whole.sizes()) << name;
    target->copy_(whole);
  }
}

void expect_equal(const torch::Tensor& got, const torch::Tensor& expected,
                  const std::string& what) {
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  const double error = (got - expected).abs().max().item<double>();
  EXPECT_TRUE(got.allclose(expected, 1e-4, 1e-5))
      << what << ": largest difference " << error << " (worker " << shoal::rank() << ")";
}

// After backward on both: every parameter's gradient, whole, against the reference's.
void expect_gradients_equal(g::nn::Module& global, torch::nn::Module& reference,
                            const std::string& plan) {
  auto expected = reference.named_parameters();
  for (const auto& [name, parameter] : global.named_global_parameters()) {
    const auto& local = parameter.to_local();
    const auto grad =
        g::GlobalTensor(local.grad().defined() ? local.grad() : torch::zeros_like(local),
                        parameter.placement(), parameter.sbp(), parameter.shape());
    const torch::Tensor* want = expected.find(name);
    ASSERT_NE(want, nullptr) << name;
    ASSERT_TRUE(want->grad().defined()) << "the reference's " << name << " got no gradient";
    expect_equal(grad.full(), want->grad(), plan + ", gradient of " + name);
  }
}

// One layer on a float input [rows, ...]: output, input gradient and parameter gradients of
// loss = sum(output * weights) against the reference's. `make` builds the global layer for a
// layout (after torch::manual_seed(5) on every worker).
template <typename Global, typename Reference>
void check_layer(const std::function<Global(const g::nn::Layout&)>& make, Reference reference,
                 std::vector<int64_t> input_shape) {
  for (const auto& plan : plans()) {
    SCOPED_TRACE(plan.name);
    torch::manual_seed(5);
    Global layer = make(plan.layout);
    g::nn::GradientSync sync(layer);
    copy_into(*layer, *reference);
    reference->zero_grad();
    const auto x_full = torch::randn(input_shape);
    auto x = g::GlobalTensor::from_full(x_full, plan.layout.placement, plan.batch);
    x.requires_grad_();
    const auto out = layer->forward(x);
    const auto x_ref = x_full.clone().requires_grad_();
    const auto out_ref = reference->forward(x_ref);
    const auto weights = torch::randn(out_ref.sizes());
    const auto replicated = plan.layout.replicated();
    g::sum(out * g::GlobalTensor::from_full(weights, plan.layout.placement, replicated)).backward();
    (out_ref * weights).sum().backward();
    expect_equal(out.full(), out_ref, plan.name + ", output");
    expect_equal(x.grad().full(), x_ref.grad(), plan.name + ", input gradient");
    expect_gradients_equal(*layer, *reference, plan.name);
  }
}

void linear_layers() {
  for (const std::string kind : {"column", "row", "replicated"}) {
    SCOPED_TRACE(kind);
    check_layer<g::nn::Linear>(
        [&](const g::nn::Layout& layout) {
          const auto sbp = kind == "column" ? layout.column()
                           : kind == "row"  ? layout.row()
                                            : layout.replicated();
          return g::nn::Linear(8, 12, layout.placement, sbp);
        },
        torch::nn::Linear(8, 12), {8, 8});
  }
}

void layer_norm() {
  check_layer<g::nn::LayerNorm>(
      [](const g::nn::Layout& layout) { return g::nn::LayerNorm(12, layout.placement); },
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({12})), {8, 3, 12});
}

void transformer_block() {
  check_layer<g::nn::TransformerBlock>(
      [](const g::nn::Layout& layout) {
        return g::nn::TransformerBlock(g::nn::TransformerBlockOptions{16, 4, 0, 0}, layout);
      },
      ReferenceBlock(16, 4), {4, 8, 16});
}

// Embeddings take indices: loss = sum(output * weights), gradients of the weight only.
void embeddings() {
  for (const std::string kind : {"vocabulary-parallel", "replicated"}) {
    for (const auto& plan : plans()) {
      SCOPED_TRACE(kind + ", " + plan.name);
      torch::manual_seed(5);
      g::nn::Embedding layer(
          16, 12, plan.layout.placement,
          kind == "replicated" ? plan.layout.replicated() : plan.layout.column());
      g::nn::GradientSync sync(layer);
      torch::nn::Embedding reference(16, 12);
      copy_into(*layer, *reference);
      const auto ids = torch::randint(16, {4, 8});
      const auto out =
          layer->forward(g::GlobalTensor::from_full(ids, plan.layout.placement, plan.batch));
      const auto out_ref = reference->forward(ids);
      const auto weights = torch::randn(out_ref.sizes());
      g::sum(out *
             g::GlobalTensor::from_full(weights, plan.layout.placement, plan.layout.replicated()))
          .backward();
      (out_ref * weights).sum().backward();
      expect_equal(out.full(), out_ref, plan.name + ", output");
      expect_gradients_equal(*layer, *reference, kind + ", " + plan.name);
    }
  }
}

// The GPT, two blocks, on a batch of token ids with cross entropy: logits, loss and every
// parameter's gradient against the reference; then 3 AdamW steps on both, and the losses and
// parameters must still agree.
void gpt() {
  const GptConfig config;
  for (const auto& plan : plans()) {
    SCOPED_TRACE(plan.name);
    torch::manual_seed(7);
    GlobalGpt model(config, plan.layout);
    g::nn::GradientSync sync(model);
    ReferenceGpt reference(config);
    copy_into(*model, *reference);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW reference_optimizer(reference->parameters(),
                                            torch::optim::AdamWOptions(1e-2));
    const int64_t batch = 4, rows = batch * config.time;
    for (int step = 0; step < 3; ++step) {
      const auto ids = torch::randint(config.vocabulary, {batch, config.time});
      const auto targets = torch::randint(config.vocabulary, {batch, config.time});
      optimizer.zero_grad();
      reference_optimizer.zero_grad();
      const auto& p = plan.layout.placement;
      const auto logits = model->forward(g::GlobalTensor::from_full(ids, p, plan.batch));
      const auto loss =
          g::cross_entropy(g::reshape(logits, {rows, config.vocabulary}),
                           g::reshape(g::GlobalTensor::from_full(targets, p, plan.batch), {rows}));
      loss.backward();
      const auto logits_ref = reference->forward(ids);
      const auto loss_ref = torch::nn::functional::cross_entropy(
          logits_ref.view({rows, config.vocabulary}), targets.view({rows}));
      loss_ref.backward();
      const std::string at = plan.name + ", step " + std::to_string(step);
      expect_equal(logits.detach().full(), logits_ref.detach(), at + ", logits");
      expect_equal(loss.detach().full(), loss_ref.detach(), at + ", loss");
      expect_gradients_equal(*model, *reference, at);
      optimizer.step();
      reference_optimizer.step();
    }
    auto expected = reference->named_parameters();
    for (const auto& [name, parameter] : model->named_global_parameters())
      expect_equal(parameter.detach().full(), expected[name].detach(),
                   plan.name + ", trained " + name);
  }
}

TEST(AgainstPlainLibTorch, LayersOnOneWorker) {
  run_workers(1, [] {
    linear_layers();
    layer_norm();
    embeddings();
    transformer_block();
  });
}

TEST(AgainstPlainLibTorch, LayersInEveryPlanOnFourWorkers) {
  run_workers(4, [] {
    linear_layers();
    layer_norm();
    embeddings();
    transformer_block();
  });
}

TEST(AgainstPlainLibTorch, GptOnOneWorker) {
  run_workers(1, gpt);
}

TEST(AgainstPlainLibTorch, GptInEveryPlanOnFourWorkers) {
  run_workers(4, gpt);
}

}  // namespace
