#include "split_backward.h"

#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "shoal/core/error.h"

// Note [Where the backward splits]
// The forward records a graph of autograd nodes from the output down to leaves: the stage's
// input and the parameters. Call A the nodes from which the input's accumulator can be reached:
// they are all that the input's gradient flows through, and all that I runs. Every other node
// leads only to parameters (a TBackward or ViewBackward on a weight, an EmbeddingBackward, the
// parameters' accumulators): that is W's part. A "weight consumer" is a node of A with an edge
// into W's part (Linear's AddmmBackward, LayerNorm's NativeLayerNormBackward).
//
// I asks the engine for the input's gradient only (accumulate_grad = false, outputs = the
// input's edge, keep_graph = true). The engine then runs only the nodes of A, and each node
// computes only the gradients whose edges lead somewhere needed (task_should_compute_output):
// a consumer computes its input's gradient but not its weight's. A post hook on every consumer
// records the gradients that arrived at it.
//
// W runs the engine once more with those recorded gradients as roots at the consumers, after
// cutting the consumers' edges into A (so no gradient flows down the activation path again,
// which would count every deeper consumer twice) and dropping their pre hooks (which ran in I
// on exactly these gradients). What remains reachable is W's part alone, run with
// accumulate_grad = true and keep_graph = false: the parameters' accumulators and their hooks
// run as in backward(), and the graph is freed.
//
// A consumer that computes every gradient whatever is asked (a custom autograd Function that
// ignores needs_input_grad) shows itself in I: its post hook sees a defined gradient on an edge
// into W's part. Its weight gradients are then kept as computed and fed to W's part in W, at
// the edges they were meant for, instead of computing them a second time.
//
// Between I and W, the nodes of A that W does not run have their saved tensors released, so a
// micro-batch waiting for its W holds only what W needs (the consumers' saved inputs).

namespace shoal::pipeline::detail {

namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// What one consumer's post hook saw during I.
struct Arrival {
  bool seen = false;
  variable_list inputs;          // the gradients that arrived at the node (after its pre hooks)
  variable_list weight_outputs;  // the gradients it computed on its edges into W's part
};

class RecordArrival : public torch::autograd::FunctionPostHook {
 public:
  RecordArrival(Arrival* arrival, std::vector<size_t> weight_edges)
      : arrival_(arrival), weight_edges_(std::move(weight_edges)) {}

  variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
    arrival_->seen = true;
    arrival_->inputs = inputs;
    arrival_->weight_outputs.clear();
    for (size_t i : weight_edges_) arrival_->weight_outputs.push_back(outputs.at(i));
    return outputs;
  }

 private:
  Arrival* arrival_;
  std::vector<size_t> weight_edges_;
};

// Removes the recording hooks however I ends.
class HookGuard {
 public:
  ~HookGuard() {
    for (auto& [node, key] : hooks_) node->del_post_hook(key);
  }
  void add(Node* node, std::unique_ptr<torch::autograd::FunctionPostHook> hook) {
    hooks_.emplace_back(node, node->add_post_hook(std::move(hook)));
  }

 private:
  std::vector<std::pair<Node*, uintptr_t>> hooks_;
};

// The nodes reachable from `root`, in the order the walk finishes them (so that W's roots come in
// the same order on every run), and for each whether `target` can be reached from it. Iterative,
// as a deep model's graph would overflow the stack of a recursive walk.
struct Walk {
  std::vector<Node*> order;
  std::unordered_map<Node*, bool> reaches;
};

Walk nodes_reaching(Node* root, Node* target) {
  Walk walk;
  auto& reaches = walk.reaches;
  std::vector<std::pair<Node*, size_t>> stack;
  auto visit = [&](Node* node) {
    if (reaches.emplace(node, node == target).second) stack.emplace_back(node, 0);
  };
  visit(root);
  while (!stack.empty()) {
    Node* node = stack.back().first;
    size_t i = stack.back().second++;
    const edge_list& edges = node->next_edges();
    if (i < edges.size()) {
      if (edges[i].function) visit(edges[i].function.get());
      continue;
    }
    stack.pop_back();
    bool any = reaches[node];
    for (const Edge& edge : edges) {
      if (edge.function && reaches.at(edge.function.get())) any = true;
    }
    reaches[node] = any;
    walk.order.push_back(node);
  }
  return walk;
}

std::string shape_of(const at::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes();
  return out.str();
}

}  // namespace

struct SplitBackward::State {
  enum class Phase { kForward, kInputDone, kWeightDone };
  Phase phase = Phase::kForward;
  at::Tensor output;
  at::Tensor input;
  // W's roots and the gradients they receive.
  edge_list roots;
  variable_list grads;
  // Consumers W restarts from: their edges into A, which W cuts.
  std::vector<std::pair<std::shared_ptr<Node>, std::vector<size_t>>> cuts;
  std::vector<std::string> joint_nodes;
};

SplitBackward::SplitBackward(at::Tensor output, at::Tensor input) : state_(new State) {
  if (!output.defined() || !output.requires_grad()) {
    throw UsageError(
        "SplitBackward: the stage's output does not require grad (expected the output of a "
        "forward through parameters or a grad-requiring input)");
  }
  if (input.defined() && input.requires_grad() && !input.is_leaf()) {
    throw UsageError(
        "SplitBackward: the stage's input is not a leaf (expected a detached tensor with "
        "requires_grad set, as a stage receives its input)");
  }
  state_->output = std::move(output);
  state_->input = std::move(input);
}

SplitBackward::~SplitBackward() = default;
SplitBackward::SplitBackward(SplitBackward&&) noexcept = default;
SplitBackward& SplitBackward::operator=(SplitBackward&&) noexcept = default;

at::Tensor SplitBackward::input_gradient(const at::Tensor& grad_output) {
  State& s = *state_;
  SHOAL_CHECK(s.phase == State::Phase::kForward)
      << "SplitBackward::input_gradient() called twice for one micro-batch";
  at::Tensor grad = grad_output;
  if (!grad.defined()) {
    if (s.output.numel() != 1) {
      throw UsageError("SplitBackward: no gradient given for the stage's output of shape " +
                       shape_of(s.output) + " (expected one; only a scalar output implies 1)");
    }
    grad = at::ones_like(s.output);
  } else if (grad.sizes() != s.output.sizes()) {
    throw UsageError("SplitBackward: the gradient of the stage's output has shape " +
                     shape_of(grad) + ", expected the output's shape " + shape_of(s.output));
  } else if (grad.scalar_type() != s.output.scalar_type()) {
    throw UsageError(std::string("SplitBackward: the gradient of the stage's output is ") +
                     c10::toString(grad.scalar_type()) + ", expected the output's dtype " +
                     c10::toString(s.output.scalar_type()));
  }

  const Edge root = torch::autograd::impl::gradient_edge(s.output);
  const bool wants_input = s.input.defined() && s.input.requires_grad();
  const Edge input_edge = wants_input ? torch::autograd::impl::gradient_edge(s.input) : Edge();
  Walk walk;
  if (wants_input) walk = nodes_reaching(root.function.get(), input_edge.function.get());
  const auto& reaches = walk.reaches;

  at::Tensor input_grad;
  if (wants_input && root == input_edge) {
    // The stage passes its input through: the engine, started at the input's accumulator,
    // would accumulate into it.
    input_grad = grad;
  } else if (!wants_input || !reaches.at(root.function.get())) {
    // Nothing carries the input's gradient (a first stage): W is the whole backward.
    s.roots = {root};
    s.grads = {grad};
    if (wants_input) input_grad = at::zeros_like(s.input);
  } else {
    // The consumers and, for each, its edges into W's part (Note [Where the backward splits]).
    std::vector<std::pair<Node*, std::vector<size_t>>> consumers;
    for (Node* node : walk.order) {
      if (!reaches.at(node)) continue;
      std::vector<size_t> weight_edges;
      const edge_list& edges = node->next_edges();
      for (size_t i = 0; i < edges.size(); ++i) {
        if (edges[i].function && !reaches.at(edges[i].function.get())) weight_edges.push_back(i);
      }
      if (!weight_edges.empty()) consumers.emplace_back(node, std::move(weight_edges));
    }
    std::vector<Arrival> arrivals(consumers.size());
    {
      HookGuard hooks;
      for (size_t c = 0; c < consumers.size(); ++c) {
        hooks.add(consumers[c].first,
                  std::make_unique<RecordArrival>(&arrivals[c], consumers[c].second));
      }
      variable_list captured = torch::autograd::Engine::get_default_engine().execute(
          {root}, {grad}, /*keep_graph=*/true, /*create_graph=*/false,
          /*accumulate_grad=*/false, {input_edge});
      SHOAL_CHECK_EQ(captured.size(), size_t{1});
      input_grad = captured[0].defined() ? captured[0] : at::zeros_like(s.input);
    }

    std::unordered_set<Node*> restarts;  // consumers W runs again
    for (size_t c = 0; c < consumers.size(); ++c) {
      Node* node = consumers[c].first;
      const std::vector<size_t>& weight_edges = consumers[c].second;
      const Arrival& arrival = arrivals[c];
      if (!arrival.seen) continue;  // no gradient reached it, as backward() would find
      bool joint = false;
      for (const at::Tensor& g : arrival.weight_outputs) joint = joint || g.defined();
      if (joint) {
        s.joint_nodes.push_back(node->name());
        for (size_t k = 0; k < weight_edges.size(); ++k) {
          if (!arrival.weight_outputs[k].defined()) continue;
          s.roots.push_back(node->next_edge(weight_edges[k]));
          s.grads.push_back(arrival.weight_outputs[k]);
        }
        continue;
      }
      bool any = false;
      for (size_t k = 0; k < arrival.inputs.size(); ++k) {
        if (!arrival.inputs[k].defined()) continue;
        s.roots.emplace_back(node->shared_from_this(), static_cast<uint32_t>(k));
        s.grads.push_back(arrival.inputs[k]);
        any = true;
      }
      if (!any) continue;
      std::vector<size_t> activation_edges;
      const edge_list& edges = node->next_edges();
      for (size_t i = 0; i < edges.size(); ++i) {
        if (edges[i].function && reaches.at(edges[i].function.get())) activation_edges.push_back(i);
      }
      s.cuts.emplace_back(node->shared_from_this(), std::move(activation_edges));
      restarts.insert(node);
    }
    // What only the input's gradient needed is not kept until W.
    for (Node* node : walk.order) {
      if (reaches.at(node) && node != input_edge.function.get() && !restarts.count(node)) {
        node->release_variables();
      }
    }
  }
  s.output = at::Tensor();
  s.input = at::Tensor();
  s.phase = State::Phase::kInputDone;
  return input_grad;
}

void SplitBackward::weight_gradient() {
  State& s = *state_;
  SHOAL_CHECK(s.phase == State::Phase::kInputDone)
      << "SplitBackward::weight_gradient() needs one input_gradient() before it, and runs once";
  for (auto& [node, activation_edges] : s.cuts) {
    // Not set_next_edge(), which refuses to touch a node that has parents (it would have to
    // lower the topological number); W passes no outputs, so the engine never reads it.
    for (size_t i : activation_edges) node->next_edges()[i] = Edge();
    node->pre_hooks().clear();
  }
  if (!s.roots.empty()) {
    torch::autograd::Engine::get_default_engine().execute(s.roots, s.grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, {});
  }
  s.roots.clear();
  s.grads.clear();
  s.cuts.clear();
  s.phase = State::Phase::kWeightDone;
}

const std::vector<std::string>& SplitBackward::joint_nodes() const {
  return state_->joint_nodes;
}

}  // namespace shoal::pipeline::detail
