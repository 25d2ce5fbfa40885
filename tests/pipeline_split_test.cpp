// The backward split into I (the input's gradient) and W (the parameters' gradients): on every
// kind of stage (Linear stacks with and without bias, a parameter used twice, a parameter used
// through views, the GPT's layers, a first stage whose input needs no gradient, a last stage
// ending in a loss, a parameter that takes no part, custom autograd Functions), I then W gives
// the input's and every parameter's gradient that one backward() gives on an identical copy,
// for several micro-batches whatever the order of their W's. I accumulates nothing, runs no
// parameter hook and frees what W does not need; W runs the parameters' hooks as backward()
// does, so DataParallel (two real workers) averages in W.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "error_of.h"
#include "harness.h"
#include "pipeline/split_backward.h"
#include "shoal/core/error.h"
#include "shoal/global/nn.h"
#include "shoal/shoal.h"

namespace {

using shoal::pipeline::detail::SplitBackward;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A stage: a module (for its parameters) and its forward for micro-batch `mb`.
struct Stage {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor& x, int mb)> forward;
};

struct Case {
  std::string name;
  std::function<Stage()> make;  // deterministic: two calls give identical parameters
  std::function<at::Tensor(int mb)> input;
  bool input_needs_grad = true;
  // The gradient arriving at the output; undefined for a scalar loss (backward()'s implied 1).
  bool scalar_output = false;
  // Whether a node of the stage computes its weights' gradients with its input's, whatever is
  // asked (the split's fallback, SplitBackward::joint_nodes()).
  bool joint = false;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

at::Tensor floats(std::vector<int64_t> shape, int mb) {
  torch::manual_seed(1000 + mb);
  return torch::randn(shape);
}

Stage linear_stack(bool bias) {
  torch::manual_seed(1);
  auto m = std::make_shared<torch::nn::Module>();
  torch::nn::Linear a =
      m->register_module("a", torch::nn::Linear(torch::nn::LinearOptions(8, 16).bias(bias)));
  torch::nn::Linear b =
      m->register_module("b", torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(bias)));
  torch::nn::Linear c =
      m->register_module("c", torch::nn::Linear(torch::nn::LinearOptions(16, 4).bias(bias)));
  return {m,
          [=](const at::Tensor& x, int) mutable { return c(torch::tanh(b(torch::relu(a(x))))); }};
}

// One Linear applied twice: its weight's gradient is the sum of both uses.
Stage shared_parameter() {
  torch::manual_seed(2);
  auto m = std::make_shared<torch::nn::Module>();
  torch::nn::Linear a = m->register_module("a", torch::nn::Linear(8, 8));
  torch::nn::Linear b = m->register_module("b", torch::nn::Linear(8, 3));
  return {m, [=](const at::Tensor& x, int) mutable { return b(a(torch::gelu(a(x)))); }};
}

// A flat parameter used as a matrix (view) and, sliced, as a bias (another view).
Stage parameter_through_view() {
  torch::manual_seed(3);
  auto m = std::make_shared<torch::nn::Module>();
  auto w = m->register_parameter("w", torch::randn({72}) * 0.3);
  return {m, [=](const at::Tensor& x, int) mutable {
            return torch::relu(x.mm(w.narrow(0, 0, 64).view({8, 8})) + w.narrow(0, 64, 8));
          }};
}

// Causal self-attention and the MLP of a GPT-2 block, pre-norm, on [batch, time, channels].
at::Tensor gpt_block(torch::nn::Module& m, const at::Tensor& x) {
  auto ln1 = m.named_children()["ln1"]->as<torch::nn::LayerNorm>();
  auto qkv = m.named_children()["qkv"]->as<torch::nn::Linear>();
  auto proj = m.named_children()["proj"]->as<torch::nn::Linear>();
  auto ln2 = m.named_children()["ln2"]->as<torch::nn::LayerNorm>();
  auto fc = m.named_children()["fc"]->as<torch::nn::Linear>();
  auto out = m.named_children()["out"]->as<torch::nn::Linear>();
  const int64_t t = x.size(1), c = x.size(2);
  auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
  auto att = parts[0].matmul(parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(c));
  auto mask = torch::ones({t, t}, torch::kBool).triu(1);
  att = att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
  auto h = x + proj->forward(att.matmul(parts[2]));
  return h + out->forward(torch::gelu(fc->forward(ln2->forward(h))));
}

void add_gpt_block(torch::nn::Module& m, int64_t c) {
  m.register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
  m.register_module("qkv", torch::nn::Linear(c, 3 * c));
  m.register_module("proj", torch::nn::Linear(c, c));
  m.register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
  m.register_module("fc", torch::nn::Linear(c, 4 * c));
  m.register_module("out", torch::nn::Linear(4 * c, c));
}

constexpr int64_t kVocab = 11, kTime = 5, kChannels = 8;

at::Tensor tokens(int mb) {
  torch::manual_seed(2000 + mb);
  return torch::randint(kVocab, {3, kTime}, torch::kLong);
}

// A middle stage of the GPT: one block.
Stage gpt_middle() {
  torch::manual_seed(4);
  auto m = std::make_shared<torch::nn::Module>();
  add_gpt_block(*m, kChannels);
  return {m, [m](const at::Tensor& x, int) { return gpt_block(*m, x); }};
}

// The GPT's first stage: token and position embeddings, one block; its input is token ids.
Stage gpt_first() {
  torch::manual_seed(5);
  auto m = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding tok = m->register_module("tok", torch::nn::Embedding(kVocab, kChannels));
  auto pos = m->register_parameter("pos", torch::randn({kTime, kChannels}) * 0.1);
  add_gpt_block(*m, kChannels);
  return {m, [=](const at::Tensor& ids, int) mutable { return gpt_block(*m, tok(ids) + pos); }};
}

// The GPT's last stage: one block, the final norm, the head and the micro-batch's weighted
// loss (a scalar); `unused` is a parameter the forward never touches (its gradient stays
// undefined).
Stage gpt_last() {
  torch::manual_seed(6);
  auto m = std::make_shared<torch::nn::Module>();
  add_gpt_block(*m, kChannels);
  torch::nn::LayerNorm ln =
      m->register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kChannels})));
  torch::nn::Linear head = m->register_module("head", torch::nn::Linear(kChannels, kVocab));
  m->register_parameter("unused", torch::randn({4}));
  return {m, [=](const at::Tensor& x, int mb) mutable {
            auto logits = head(ln(gpt_block(*m, x)));
            auto targets = tokens(100 + mb);
            return torch::nn::functional::cross_entropy(logits.view({-1, kVocab}),
                                                        targets.view({-1})) *
                   0.25;
          }};
}

// The whole GPT in one stage, its head tied to the token embedding: ids in, loss out.
Stage gpt_tied_whole() {
  torch::manual_seed(7);
  auto m = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding tok = m->register_module("tok", torch::nn::Embedding(kVocab, kChannels));
  add_gpt_block(*m, kChannels);
  return {m, [=](const at::Tensor& ids, int mb) mutable {
            auto logits = torch::nn::functional::linear(gpt_block(*m, tok(ids)), tok->weight);
            return torch::nn::functional::cross_entropy(logits.view({-1, kVocab}),
                                                        tokens(100 + mb).view({-1}));
          }};
}

// A first stage whose (float) input needs no gradient.
Stage first_float() {
  torch::manual_seed(8);
  auto m = std::make_shared<torch::nn::Module>();
  torch::nn::Linear a = m->register_module("a", torch::nn::Linear(8, 6));
  torch::nn::LayerNorm norm =
      m->register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
  return {m, [=](const at::Tensor& x, int) mutable { return norm(torch::gelu(a(x))); }};
}

// x @ w^T in a custom autograd Function. `Honest` asks needs_input_grad; the other computes
// both gradients on every call. Both count their backward calls and the gradients they made.
template <bool Honest>
struct CustomLinear : torch::autograd::Function<CustomLinear<Honest>> {
  static inline int calls = 0;
  static inline int input_grads = 0;
  static inline int weight_grads = 0;
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return x.mm(w.t());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    ++calls;
    at::Tensor dx, dw;
    if (!Honest || ctx->needs_input_grad(0)) {
      dx = grads[0].mm(saved[1]);
      ++input_grads;
    }
    if (!Honest || ctx->needs_input_grad(1)) {
      dw = grads[0].t().mm(saved[0]);
      ++weight_grads;
    }
    return {dx, dw};
  }
  static void reset() { calls = input_grads = weight_grads = 0; }
};

template <bool Honest>
Stage custom_function() {
  torch::manual_seed(9);
  auto m = std::make_shared<torch::nn::Module>();
  torch::nn::Linear a = m->register_module("a", torch::nn::Linear(8, 8));
  auto w = m->register_parameter("w", torch::randn({5, 8}) * 0.3);
  return {m, [=](const at::Tensor& x, int) mutable {
            return CustomLinear<Honest>::apply(torch::relu(a(x)), w).tanh();
          }};
}

std::vector<Case> cases() {
  auto mlp_input = [](int mb) { return floats({5, 8}, mb); };
  auto gpt_input = [](int mb) { return floats({3, kTime, kChannels}, mb); };
  return {
      {"linear_stack_bias", [] { return linear_stack(true); }, mlp_input},
      {"linear_stack_no_bias", [] { return linear_stack(false); }, mlp_input},
      {"shared_parameter", shared_parameter, mlp_input},
      {"parameter_through_view", parameter_through_view, mlp_input},
      {"gpt_middle_stage", gpt_middle, gpt_input},
      {"gpt_first_stage", gpt_first, tokens, false},
      {"gpt_last_stage", gpt_last, gpt_input, true, true},
      {"gpt_tied_whole_model", gpt_tied_whole, tokens, false, true},
      {"first_stage_float_input", first_float, mlp_input, false},
      {"custom_function_honest", custom_function<true>, mlp_input},
      {"custom_function_joint", custom_function<false>, mlp_input, true, false, true},
  };
}

at::Tensor grad_output(const Case& c, const at::Tensor& output, int mb) {
  if (c.scalar_output) return at::Tensor();
  torch::manual_seed(3000 + mb);
  return torch::randn(output.sizes());
}

at::Tensor stage_input(const Case& c, int mb) {
  auto x = c.input(mb);
  if (c.input_needs_grad) x.requires_grad_(true);
  return x;
}

// Relative to the tensor's scale: max |actual - expected| <= 1e-6 max |expected|.
void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.defined(), expected.defined()) << what;
  if (!expected.defined()) return;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double scale = expected.abs().max().item<double>();
  const double error = (actual - expected).abs().max().item<double>();
  EXPECT_LE(error, 1e-6 * std::max(scale, 1e-30))
      << what << ": max error " << error << " against a scale of " << scale;
}

// The input's gradient of each micro-batch and every parameter's accumulated gradient.
struct Gradients {
  std::vector<at::Tensor> inputs;
  std::vector<std::pair<std::string, at::Tensor>> parameters;
};

Gradients parameter_gradients(const Stage& stage, std::vector<at::Tensor> inputs) {
  Gradients g{std::move(inputs), {}};
  for (const auto& p : stage.module->named_parameters()) {
    g.parameters.emplace_back(p.key(),
                              p.value().grad().defined() ? p.value().grad().clone() : at::Tensor());
  }
  return g;
}

// One backward() per micro-batch, in micro-batch order.
Gradients reference(const Case& c, int micro_batches) {
  Stage stage = c.make();
  std::vector<at::Tensor> inputs;
  for (int mb = 0; mb < micro_batches; ++mb) {
    auto x = stage_input(c, mb);
    auto out = stage.forward(x, mb);
    out.backward(grad_output(c, out, mb));
    inputs.push_back(c.input_needs_grad ? x.grad() : at::Tensor());
  }
  return parameter_gradients(stage, inputs);
}

void expect_no_gradient(const Stage& stage, const std::string& when) {
  for (const auto& p : stage.module->named_parameters()) {
    EXPECT_FALSE(p.value().grad().defined()) << p.key() << " has a gradient " << when;
  }
}

// Every forward, then every I, then every W in `w_order`.
Gradients split(const Case& c, const std::vector<int>& w_order) {
  Stage stage = c.make();
  const size_t m = w_order.size();
  std::vector<SplitBackward> splits;
  std::vector<at::Tensor> grads_out;
  for (size_t mb = 0; mb < m; ++mb) {
    auto x = stage_input(c, static_cast<int>(mb));
    auto out = stage.forward(x, static_cast<int>(mb));
    grads_out.push_back(grad_output(c, out, static_cast<int>(mb)));
    splits.emplace_back(out, c.input_needs_grad ? x : at::Tensor());
  }
  std::vector<at::Tensor> inputs;
  for (size_t mb = 0; mb < m; ++mb) {
    inputs.push_back(splits[mb].input_gradient(grads_out[mb]));
    EXPECT_EQ(inputs.back().defined(), c.input_needs_grad);
  }
  expect_no_gradient(stage, "after I");
  for (int mb : w_order) splits[static_cast<size_t>(mb)].weight_gradient();
  return parameter_gradients(stage, inputs);
}

void expect_same(const Gradients& actual, const Gradients& expected, const std::string& what) {
  ASSERT_EQ(actual.inputs.size(), expected.inputs.size());
  for (size_t mb = 0; mb < actual.inputs.size(); ++mb) {
    expect_close(actual.inputs[mb], expected.inputs[mb],
                 what + ": input gradient of micro-batch " + std::to_string(mb));
  }
  ASSERT_EQ(actual.parameters.size(), expected.parameters.size());
  for (size_t k = 0; k < actual.parameters.size(); ++k) {
    expect_close(actual.parameters[k].second, expected.parameters[k].second,
                 what + ": gradient of " + actual.parameters[k].first);
  }
}

class SplitBackwardCase : public ::testing::TestWithParam<Case> {};

TEST_P(SplitBackwardCase, OneMicroBatchEqualsBackward) {
  expect_same(split(GetParam(), {0}), reference(GetParam(), 1), GetParam().name);
}

TEST_P(SplitBackwardCase, MicroBatchesAccumulateInAnyOrderOfW) {
  const Case& c = GetParam();
  const Gradients expected = reference(c, 3);
  for (const std::vector<int>& order : {std::vector<int>{0, 1, 2}, {2, 0, 1}, {1, 2, 0}}) {
    expect_same(split(c, order), expected,
                c.name + " with W in order " + std::to_string(order[0]) + std::to_string(order[1]) +
                    std::to_string(order[2]));
  }
}

// As 1F1B with W deferred: F0 F1 I0 F2 I1 W0 I2 W2 W1.
TEST_P(SplitBackwardCase, InterleavedWithForwards) {
  const Case& c = GetParam();
  Stage stage = c.make();
  std::vector<SplitBackward> splits;
  std::vector<at::Tensor> dx(3);
  auto forward = [&](int mb) {
    auto x = stage_input(c, mb);
    auto out = stage.forward(x, mb);
    splits.emplace_back(out, c.input_needs_grad ? x : at::Tensor());
    return out;
  };
  std::vector<at::Tensor> dy;
  auto input_grad = [&](int mb) {
    dx[static_cast<size_t>(mb)] = splits[static_cast<size_t>(mb)].input_gradient(dy[mb]);
  };
  for (int mb = 0; mb < 3; ++mb) {
    auto out = forward(mb);
    dy.push_back(grad_output(c, out, mb));
    if (mb == 1) input_grad(0);
    if (mb == 2) input_grad(1), splits[0].weight_gradient();
  }
  input_grad(2);
  splits[2].weight_gradient();
  splits[1].weight_gradient();
  expect_same(parameter_gradients(stage, dx), reference(c, 3), c.name);
}

// I runs no hook of a parameter (neither on its accumulator, as DataParallel's, nor on the
// tensor); W runs each as often as backward() does.
TEST_P(SplitBackwardCase, ParameterHooksRunInWOnly) {
  const Case& c = GetParam();
  struct Count : torch::autograd::FunctionPostHook {
    explicit Count(int* n) : n(n) {}
    variable_list operator()(const variable_list& out, const variable_list&) override {
      ++*n;
      return out;
    }
    int* n;
  };
  // The accumulators are held, as DataParallel holds them: a parameter keeps only a weak one.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  auto hooked = [&accumulators](const Stage& stage, std::vector<int>& accumulated,
                                std::vector<int>& seen) {
    auto params = stage.module->parameters();
    accumulated.assign(params.size(), 0);
    seen.assign(params.size(), 0);
    for (size_t k = 0; k < params.size(); ++k) {
      accumulators.push_back(torch::autograd::impl::grad_accumulator(params[k]));
      accumulators.back()->add_post_hook(std::make_unique<Count>(&accumulated[k]));
      params[k].register_hook([&seen, k](const at::Tensor&) { ++seen[k]; });
    }
  };
  std::vector<int> ref_accumulated, ref_seen, accumulated, seen;
  Stage ref = c.make();
  hooked(ref, ref_accumulated, ref_seen);
  Stage stage = c.make();
  hooked(stage, accumulated, seen);
  std::vector<SplitBackward> splits;
  for (int mb = 0; mb < 2; ++mb) {
    auto x = stage_input(c, mb);
    auto out = ref.forward(x, mb);
    out.backward(grad_output(c, out, mb));
    auto xs = stage_input(c, mb);
    auto outs = stage.forward(xs, mb);
    splits.emplace_back(outs, c.input_needs_grad ? xs : at::Tensor());
    splits.back().input_gradient(grad_output(c, outs, mb));
  }
  EXPECT_EQ(accumulated, std::vector<int>(accumulated.size(), 0)) << "accumulator hooks ran in I";
  EXPECT_EQ(seen, std::vector<int>(seen.size(), 0)) << "tensor hooks ran in I";
  for (auto& s : splits) s.weight_gradient();
  EXPECT_EQ(accumulated, ref_accumulated);
  EXPECT_EQ(seen, ref_seen);
  // Every parameter but the one that takes no part was reached.
  const auto params = stage.module->named_parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    EXPECT_EQ(ref_accumulated[k], params[k].key() == "unused" ? 0 : 2) << params[k].key();
  }
}

// LibTorch's own layers split: no node computed its weights' gradients during I; only the
// Function that computes both at once is reported.
TEST_P(SplitBackwardCase, OnlyJointNodesComputeWeightGradientsInI) {
  const Case& c = GetParam();
  Stage stage = c.make();
  auto x = stage_input(c, 0);
  auto out = stage.forward(x, 0);
  SplitBackward split(out, c.input_needs_grad ? x : at::Tensor());
  split.input_gradient(grad_output(c, out, 0));
  if (c.joint) {
    ASSERT_EQ(split.joint_nodes().size(), 1u);
    EXPECT_NE(split.joint_nodes()[0].find("CustomLinear"), std::string::npos)
        << split.joint_nodes()[0];
  } else {
    EXPECT_TRUE(split.joint_nodes().empty()) << split.joint_nodes().front();
  }
  split.weight_gradient();
}

INSTANTIATE_TEST_SUITE_P(Stages, SplitBackwardCase, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// The split is real: a custom Function that asks needs_input_grad is called once in I for the
// input's gradient alone and once in W for the weight's alone.
TEST(SplitBackward, HonestCustomFunctionComputesEachHalfOnce) {
  using F = CustomLinear<true>;
  Stage stage = custom_function<true>();
  auto x = floats({5, 8}, 0).requires_grad_(true);
  auto out = stage.forward(x, 0);
  F::reset();
  SplitBackward split(out, x);
  split.input_gradient(torch::ones_like(out));
  EXPECT_EQ(F::calls, 1);
  EXPECT_EQ(F::input_grads, 1);
  EXPECT_EQ(F::weight_grads, 0);
  split.weight_gradient();
  EXPECT_EQ(F::calls, 2);
  EXPECT_EQ(F::input_grads, 1);
  EXPECT_EQ(F::weight_grads, 1);
}

// Fallback: a Function that computes both gradients on every call is run once, in I; it is
// reported, and its weight's gradient is accumulated in W only.
TEST(SplitBackward, JointCustomFunctionRunsOnceAndIsReported) {
  using F = CustomLinear<false>;
  Stage stage = custom_function<false>();
  auto x = floats({5, 8}, 0).requires_grad_(true);
  auto out = stage.forward(x, 0);
  F::reset();
  SplitBackward split(out, x);
  split.input_gradient(torch::ones_like(out));
  EXPECT_EQ(F::calls, 1);
  ASSERT_EQ(split.joint_nodes().size(), 1u);
  EXPECT_NE(split.joint_nodes()[0].find("CustomLinear"), std::string::npos)
      << split.joint_nodes()[0];
  expect_no_gradient(stage, "after I");
  split.weight_gradient();
  EXPECT_EQ(F::calls, 1);
  for (const auto& p : stage.module->named_parameters()) {
    EXPECT_TRUE(p.value().grad().defined()) << p.key();
  }
}

// A hook on an activation (here doubling its gradient) runs once per micro-batch, as in
// backward(), and the result is backward()'s.
TEST(SplitBackward, ActivationHookRunsOnce) {
  auto run = [](bool split_it, int* calls) {
    Stage stage = linear_stack(true);
    auto x = floats({5, 8}, 0).requires_grad_(true);
    auto a = stage.module->named_children()["a"]->as<torch::nn::Linear>();
    auto b = stage.module->named_children()["b"]->as<torch::nn::Linear>();
    auto h = a->forward(x);
    h.register_hook([calls](const at::Tensor& g) {
      ++*calls;
      return g * 2;
    });
    auto out = b->forward(torch::relu(h)).sum();
    if (split_it) {
      SplitBackward split(out, x);
      x.mutable_grad() = split.input_gradient(at::Tensor());
      split.weight_gradient();
    } else {
      out.backward();
    }
    return parameter_gradients(stage, {x.grad()});
  };
  int ref_calls = 0, calls = 0;
  const Gradients expected = run(false, &ref_calls);
  const Gradients actual = run(true, &calls);
  EXPECT_EQ(ref_calls, 1);
  EXPECT_EQ(calls, 1);
  expect_same(actual, expected, "hooked activation");
}

// Between I and W a micro-batch keeps only what W needs: a tensor saved only by a node of the
// input's path (GELU's input) is freed by I; one a weight's gradient needs (the second Linear's
// input) is kept until W.
TEST(SplitBackward, IFreesWhatOnlyTheInputGradientNeeded) {
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  torch::manual_seed(0);
  torch::nn::Linear a(8, 16), b(16, 4);
  auto x = floats({5, 8}, 0).requires_grad_(true);
  std::optional<WeakImpl> gelu_input, b_input;
  std::optional<SplitBackward> split;
  {
    auto h = a(x);
    auto g = torch::gelu(h);
    gelu_input.emplace(h.getIntrusivePtr());
    b_input.emplace(g.getIntrusivePtr());
    split.emplace(b(g), x);
  }
  EXPECT_FALSE(gelu_input->expired());
  EXPECT_FALSE(b_input->expired());
  split->input_gradient(torch::ones({5, 4}));
  EXPECT_TRUE(gelu_input->expired()) << "GELU's saved input outlived I";
  EXPECT_FALSE(b_input->expired()) << "the second Linear's input was freed before W";
  split->weight_gradient();
  EXPECT_TRUE(b_input->expired()) << "W kept the graph";
}

// DataParallel's hooks on the parameters' accumulators run in W: two workers, two micro-batches
// each, the first W under no_sync; the averaged gradients are those of one process on the
// whole batch.
TEST(SplitBackward, DataParallelAveragesInW) {
  shoal::testing::run_workers(2, [] {
    const int n = shoal::world_size(), r = shoal::rank();
    constexpr int64_t kRows = 4, kMicro = 2;
    torch::manual_seed(5);
    const auto x = torch::randn({n * kRows, 8});
    const auto y = torch::randint(4, {n * kRows});

    Stage reference = linear_stack(true);
    torch::nn::functional::cross_entropy(reference.forward(x.requires_grad_(false), 0), y)
        .backward();

    Stage stage = linear_stack(true);
    shoal::DataParallel dp(stage.module);
    std::vector<SplitBackward> splits;
    for (int64_t mb = 0; mb < kMicro; ++mb) {
      const int64_t rows = kRows / kMicro, first = r * kRows + mb * rows;
      auto input = x.narrow(0, first, rows).clone().requires_grad_(true);
      auto loss =
          torch::nn::functional::cross_entropy(stage.forward(input, 0), y.narrow(0, first, rows)) /
          static_cast<double>(kMicro);
      splits.emplace_back(loss, input);
      splits.back().input_gradient(at::Tensor());
    }
    {
      auto local = dp.no_sync();
      splits[0].weight_gradient();
    }
    splits[1].weight_gradient();
    expect_same(parameter_gradients(stage, {}), parameter_gradients(reference, {}),
                "worker " + std::to_string(r));
  });
}

// Two linears of a global model, column- then row-parallel over two workers (Megatron), and a
// layer norm: their backward has collectives on the activation's path and, through the
// GradientSync hooks, on the weights'. I then W on each worker gives what backward() gives,
// without a hang: every worker puts each collective in the same half.
class TensorParallelMlpImpl : public shoal::global::nn::Module {
 public:
  explicit TensorParallelMlpImpl(const shoal::global::nn::Layout& layout) {
    namespace gnn = shoal::global::nn;
    up = register_module("up", gnn::Linear(6, 8, layout.placement, layout.column()));
    down = register_module("down", gnn::Linear(8, 6, layout.placement, layout.row()));
    norm = register_module("norm", gnn::LayerNorm(6, layout.placement));
  }
  shoal::global::GlobalTensor forward(const shoal::global::GlobalTensor& x) {
    return norm(down(shoal::global::relu(up(x))));
  }
  shoal::global::nn::Linear up{nullptr}, down{nullptr};
  shoal::global::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(TensorParallelMlp);

TEST(SplitBackward, TensorParallelStageEqualsBackward) {
  shoal::testing::run_workers(2, [] {
    namespace g = shoal::global;
    const g::nn::Layout layout{g::Placement::all(), {0}};
    auto run = [&](bool split_it) {
      torch::manual_seed(11);
      TensorParallelMlp model(layout);
      g::nn::GradientSync sync(model);
      torch::manual_seed(12);
      auto x = g::randn({5, 6}, layout.placement, g::broadcast());
      x.requires_grad_();
      const at::Tensor out = model->forward(x).to_local();
      torch::manual_seed(13);
      const auto dy = torch::randn(out.sizes());
      at::Tensor dx;
      if (split_it) {
        SplitBackward split(out, x.to_local());
        dx = split.input_gradient(dy);
        split.weight_gradient();
      } else {
        out.backward(dy);
        dx = x.to_local().grad();
      }
      Gradients grads{{dx}, {}};
      for (const auto& named : model->named_global_parameters()) {
        const auto& grad = named.second.to_local().grad();
        grads.parameters.emplace_back(named.first, grad.defined() ? grad.clone() : grad);
      }
      return grads;
    };
    const Gradients expected = run(false);
    ASSERT_TRUE(expected.inputs[0].defined());
    for (const auto& [name, grad] : expected.parameters) EXPECT_TRUE(grad.defined()) << name;
    expect_same(run(true), expected, "worker " + std::to_string(shoal::rank()));
  });
}

// A stage that passes its input through unchanged, and one whose output ignores its input.
TEST(SplitBackward, IdentityAndInputIgnoringStages) {
  auto x = floats({4}, 0).requires_grad_(true);
  SplitBackward identity(x, x);
  auto dy = floats({4}, 1);
  expect_close(identity.input_gradient(dy), dy, "identity");
  identity.weight_gradient();
  EXPECT_FALSE(x.grad().defined());

  auto w = floats({4}, 2).requires_grad_(true);
  auto y = floats({4}, 3).requires_grad_(true);
  SplitBackward ignoring(w * 3, y);
  expect_close(ignoring.input_gradient(dy), torch::zeros({4}), "input-ignoring");
  EXPECT_FALSE(w.grad().defined());
  ignoring.weight_gradient();
  expect_close(w.grad(), dy * 3, "input-ignoring weight");
}

using shoal::testing::error_of;

TEST(SplitBackward, BadArgumentsAreNamed) {
  auto w = torch::randn({3, 4}, torch::requires_grad());
  auto x = torch::randn({2, 3}, torch::requires_grad());
  EXPECT_NE(error_of<shoal::UsageError>([&] {
              SplitBackward(torch::randn({2}), x);
            }).find("output does not require grad"),
            std::string::npos);
  EXPECT_NE(error_of<shoal::UsageError>([&] {
              SplitBackward(x.mm(w), x * 2);
            }).find("input is not a leaf"),
            std::string::npos);
  EXPECT_NE(error_of<shoal::UsageError>([&] {
              SplitBackward(x.mm(w), x).input_gradient(torch::ones({2, 3}));
            }).find("has shape [2, 3], expected the output's shape [2, 4]"),
            std::string::npos);
  EXPECT_NE(error_of<shoal::UsageError>([&] {
              SplitBackward(x.mm(w), x).input_gradient(torch::ones({2, 4}, torch::kDouble));
            }).find("is Double, expected the output's dtype Float"),
            std::string::npos);
  EXPECT_NE(error_of<shoal::UsageError>([&] {
              SplitBackward(x.mm(w), x).input_gradient(at::Tensor());
            }).find("no gradient given for the stage's output of shape [2, 4]"),
            std::string::npos);
  EXPECT_NE(error_of<shoal::InternalError>([&] {
              SplitBackward(x.mm(w), x).weight_gradient();
            }).find("needs one input_gradient() before it"),
            std::string::npos);
  SplitBackward twice(x.mm(w), x);
  twice.input_gradient(torch::ones({2, 4}));
  EXPECT_NE(error_of<shoal::InternalError>([&] {
              twice.input_gradient(torch::ones({2, 4}));
            }).find("called twice"),
            std::string::npos);
  twice.weight_gradient();
  EXPECT_NE(error_of<shoal::InternalError>([&] { twice.weight_gradient(); }).find("runs once"),
            std::string::npos);
}

}  // namespace
