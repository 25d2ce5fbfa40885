// Checkpoints of global models: saved under one plan, loaded under another, training goes on as a
// run that never stopped (one process, same batches, same seed); the optimizer's state crosses
// plans by parameter name; the module part is what one process saves of the same model; bad
// files and other models raise UsageError on every worker and change nothing.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "shoal/checkpoint/checkpoint.h"
#include "shoal/core/error.h"
#include "shoal/global/nn.h"
#include "shoal/runtime/init.h"

namespace {

namespace g = shoal::global;
using shoal::testing::is_worker;
using shoal::testing::run_workers;
using shoal::testing::WorkersOptions;

constexpr int64_t kVocabulary = 8, kDim = 6, kRows = 8;

// A plan: how the model is laid out and how a batch is.
struct Plan {
  g::nn::Layout layout;
  g::NdSbp batch;
};

Plan data_plan() {
  return {{g::Placement::all(), {}}, g::split(0)};
}
// 2 x 2: data x tensor, as the GPT example's hybrid plan.
Plan hybrid_plan() {
  return {{g::Placement::mesh({2, 2}), {1}}, g::NdSbp{g::split(0), g::broadcast()}};
}

// An embedding (vocabulary-parallel on the tensor axes), a column- and a row-parallel linear and
// a layer norm. `hidden` and `extra` make other models for the tests of mismatches.
class TinyImpl : public g::nn::Module {
 public:
  explicit TinyImpl(const g::nn::Layout& layout, int64_t hidden = 8, bool extra = false) {
    const auto& p = layout.placement;
    embed = register_module("embed", g::nn::Embedding(kVocabulary, kDim, p, layout.column()));
    up = register_module("up", g::nn::Linear(kDim, hidden, p, layout.column()));
    down = register_module("down", g::nn::Linear(hidden, kDim, p, layout.row()));
    norm = register_module("norm", g::nn::LayerNorm(kDim, p));
    if (extra) more = register_module("more", g::nn::LayerNorm(kDim, p));
  }
  g::GlobalTensor forward(const g::GlobalTensor& indices) {
    return norm(down(g::relu(up(embed(indices)))));
  }
  g::nn::Embedding embed{nullptr};
  g::nn::Linear up{nullptr}, down{nullptr};
  g::nn::LayerNorm norm{nullptr}, more{nullptr};
};
TORCH_MODULE(Tiny);

// Step `step`'s batch, whole: the same on every worker and in every run.
std::pair<torch::Tensor, torch::Tensor> batch_of(int64_t step) {
  torch::manual_seed(1000 + step);
  return {torch::randint(kVocabulary, {kRows}), torch::randn({kRows, kDim})};
}

// Adam's eps is large enough that a gradient component which is zero up to rounding (summed in
// another order than one process sums it) doesn't step by +-lr.
torch::optim::AdamW make_adamw(const std::vector<torch::Tensor>& parameters) {
  return torch::optim::AdamW(parameters, torch::optim::AdamWOptions(0.01).eps(1e-4));
}

void train(Tiny& model, torch::optim::Optimizer& optimizer, const Plan& plan, int64_t first,
           int64_t steps) {
  for (int64_t step = first; step < first + steps; ++step) {
    auto [indices, target] = batch_of(step);
    const auto x = g::GlobalTensor::from_full(indices, plan.layout.placement, plan.batch);
    const auto t = g::GlobalTensor::from_full(target, plan.layout.placement, plan.batch);
    optimizer.zero_grad();
    const auto diff = model->forward(x) - t;
    g::mean(diff * diff).backward();
    optimizer.step();
  }
}

// Every global parameter's whole value, by name. Collective.
std::vector<std::pair<std::string, torch::Tensor>> whole_values(g::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> values;
  torch::NoGradGuard no_grad;
  for (const auto& [name, parameter] : model.named_global_parameters())
    values.emplace_back(name, parameter.detach().full());
  return values;
}

double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-12);
}

void expect_close(const std::vector<std::pair<std::string, torch::Tensor>>& values,
                  const std::vector<torch::Tensor>& reference, const std::string& context) {
  ASSERT_EQ(values.size(), reference.size()) << context;
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(values[i].second.sizes(), reference[i].sizes()) << context << ": " << values[i].first;
    EXPECT_LT(relative_difference(values[i].second, reference[i]), 1e-5)
        << context << ": " << values[i].first;
  }
}

// The test's own directory: made by the test process, handed to its workers by environment.
class ScratchDir {
 public:
  static constexpr const char* kVariable = "CHECKPOINT_GLOBAL_TEST_DIR";
  ScratchDir() {
    if (is_worker()) {
      path_ = std::getenv(kVariable);
      return;
    }
    char name[] = "/tmp/shoal-checkpoint-global-XXXXXX";
    path_ = mkdtemp(name);
    owner_ = true;
  }
  ~ScratchDir() {
    if (owner_) std::filesystem::remove_all(path_);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  WorkersOptions workers() const {
    WorkersOptions options;
    options.env[kVariable] = path_;
    return options;
  }

 private:
  std::string path_;
  bool owner_ = false;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::vector<torch::Tensor> read_tensors(const std::string& path) {
  std::vector<torch::Tensor> tensors;
  torch::load(tensors, path);
  return tensors;
}

void write_tensors(const std::vector<std::pair<std::string, torch::Tensor>>& values,
                   const std::string& path) {
  std::vector<torch::Tensor> tensors;
  for (const auto& item : values) tensors.push_back(item.second);
  torch::save(tensors, path);
}

int64_t adamw_step(torch::optim::Optimizer& optimizer, const torch::Tensor& parameter) {
  auto entry = optimizer.state().find(c10::guts::to_string(parameter.unsafeGetTensorImpl()));
  if (entry == optimizer.state().end()) return -1;
  return static_cast<torch::optim::AdamWParamState&>(*entry->second).step();
}

constexpr int64_t kStepsBefore = 3, kStepsAfter = 3;

// --- Across plans --------------------------------------------------------------------------

TEST(GlobalCheckpoint, HybridOnFourResumesInTheDataPlanOnTwoAndOnOneProcess) {
  ScratchDir dir;
  const std::string path = dir.file("hybrid.pt");
  // The oracle: one process that never stops.
  run_workers(
      1,
      [&] {
        torch::manual_seed(7);
        Tiny model(data_plan().layout);
        // What LibTorch's Module::save writes of it, through the overload for any torch module.
        shoal::save(dir.file("fresh_one.pt"), static_cast<const torch::nn::Module&>(*model));
        auto optimizer = make_adamw(model->parameters());
        train(model, optimizer, data_plan(), 0, kStepsBefore);
        write_tensors(whole_values(*model), dir.file("at_save.pt"));
        train(model, optimizer, data_plan(), kStepsBefore, kStepsAfter);
        write_tensors(whole_values(*model), dir.file("at_end.pt"));
      },
      dir.workers());

  // 4 workers in the 2 x 2 plan train and save; `*model` of the holder picks the global overload.
  run_workers(
      4,
      [&] {
        torch::manual_seed(7);
        Tiny model(hybrid_plan().layout);
        shoal::save(dir.file("fresh_hybrid.pt"), *model);
        g::nn::GradientSync sync(model);
        auto optimizer = make_adamw(model->parameters());
        train(model, optimizer, hybrid_plan(), 0, kStepsBefore);
        shoal::save(path, *model, optimizer);
        expect_close(whole_values(*model), read_tensors(dir.file("at_save.pt")), "hybrid at save");
      },
      dir.workers());
  // The untrained model's file from 4 workers is the one-process file, byte for byte.
  EXPECT_EQ(read_bytes(dir.file("fresh_hybrid.pt")), read_bytes(dir.file("fresh_one.pt")));

  // 2 workers in the data plan, from another random model, load it and train on.
  run_workers(
      2,
      [&] {
        torch::manual_seed(100 + shoal::rank());
        Tiny model(data_plan().layout);
        g::nn::GradientSync sync(model);
        auto optimizer = make_adamw(model->parameters());
        shoal::load(path, *model, optimizer);
        for (const auto& p : model->parameters()) EXPECT_EQ(adamw_step(optimizer, p), kStepsBefore);
        expect_close(whole_values(*model), read_tensors(dir.file("at_save.pt")), "data, loaded");
        train(model, optimizer, data_plan(), kStepsBefore, kStepsAfter);
        expect_close(whole_values(*model), read_tensors(dir.file("at_end.pt")), "data, trained on");
      },
      dir.workers());

  // One process: the same with the global overload; the plain one reads the same module.
  run_workers(
      1,
      [&] {
        torch::manual_seed(200);
        Tiny model(data_plan().layout);
        auto optimizer = make_adamw(model->parameters());
        shoal::load(path, *model, optimizer);
        train(model, optimizer, data_plan(), kStepsBefore, kStepsAfter);
        expect_close(whole_values(*model), read_tensors(dir.file("at_end.pt")), "one, trained on");

        // The overloads for any torch module read the same file, the optimizer's state by name.
        Tiny plain(data_plan().layout);
        shoal::load(path, static_cast<torch::nn::Module&>(*plain));
        expect_close(whole_values(*plain), read_tensors(dir.file("at_save.pt")), "one, plain load");
        Tiny again(data_plan().layout);
        auto again_optimizer = make_adamw(again->parameters());
        shoal::load(path, static_cast<torch::nn::Module&>(*again), again_optimizer);
        train(again, again_optimizer, data_plan(), kStepsBefore, kStepsAfter);
        expect_close(whole_values(*again), read_tensors(dir.file("at_end.pt")),
                     "one, plain, trained");
      },
      dir.workers());
}

// Two stages, each on one worker (as a pipeline plan puts them), each worker's optimizer over its
// own stage only; resumed in the data plan on 2 workers.
class StagesImpl : public g::nn::Module {
 public:
  StagesImpl(const g::Placement& first, const g::Placement& second) : second_(second) {
    const g::NdSbp whole = g::broadcast();
    in = register_module("first", g::nn::Linear(kDim, 8, first, whole));
    out = register_module("second", g::nn::Linear(8, kDim, second, whole));
  }
  g::GlobalTensor forward(const g::GlobalTensor& x) {
    const auto h = g::relu(in(x));
    return out(h.to_global(second_, h.sbp()));
  }
  g::nn::Linear in{nullptr}, out{nullptr};

 private:
  g::Placement second_;
};
TORCH_MODULE(Stages);

void train_stages(Stages& model, torch::optim::Optimizer& optimizer, const g::Placement& first,
                  const g::Placement& second, const g::NdSbp& batch, int64_t from, int64_t steps) {
  for (int64_t step = from; step < from + steps; ++step) {
    auto [indices, target] = batch_of(step);
    torch::manual_seed(2000 + step);
    const auto x = g::GlobalTensor::from_full(torch::randn({kRows, kDim}), first, batch);
    const auto t = g::GlobalTensor::from_full(target, second, batch);
    optimizer.zero_grad();
    const auto diff = model->forward(x) - t;
    g::mean(diff * diff).backward();
    optimizer.step();
  }
}

std::vector<torch::Tensor> own_pieces(g::nn::Module& model) {
  std::vector<torch::Tensor> pieces;
  for (const auto& [name, parameter] : model.named_global_parameters()) {
    if (parameter.is_local()) pieces.push_back(parameter.to_local());
  }
  return pieces;
}

TEST(GlobalCheckpoint, StagesOnSubPlacementsResumeInTheDataPlan) {
  ScratchDir dir;
  const std::string path = dir.file("stages.pt");
  const auto all = [] { return g::Placement::all(); };
  run_workers(
      1,
      [&] {
        torch::manual_seed(5);
        Stages model(all(), all());
        auto optimizer = make_adamw(model->parameters());
        train_stages(model, optimizer, all(), all(), g::broadcast(), 0, kStepsBefore + kStepsAfter);
        write_tensors(whole_values(*model), dir.file("at_end.pt"));
      },
      dir.workers());

  run_workers(
      2,
      [&] {
        torch::manual_seed(5);
        Stages model(g::Placement({0}), g::Placement({1}));
        g::nn::GradientSync sync(model);
        auto optimizer = make_adamw(own_pieces(*model));
        train_stages(model, optimizer, {0}, {1}, g::broadcast(), 0, kStepsBefore);
        shoal::save(path, *model, optimizer);
      },
      dir.workers());

  run_workers(
      2,
      [&] {
        torch::manual_seed(300 + shoal::rank());
        Stages model(all(), all());
        g::nn::GradientSync sync(model);
        auto optimizer = make_adamw(model->parameters());
        shoal::load(path, *model, optimizer);
        for (const auto& p : model->parameters()) EXPECT_EQ(adamw_step(optimizer, p), kStepsBefore);
        train_stages(model, optimizer, all(), all(), g::split(0), kStepsBefore, kStepsAfter);
        expect_close(whole_values(*model), read_tensors(dir.file("at_end.pt")), "data, trained on");
      },
      dir.workers());
}

// The other direction: saved in the data plan, loaded into the stages (each worker takes the state
// of the parameters its optimizer holds).
TEST(GlobalCheckpoint, DataPlanResumesOnStages) {
  ScratchDir dir;
  const std::string path = dir.file("data.pt");
  run_workers(
      1,
      [&] {
        torch::manual_seed(5);
        Stages model(g::Placement::all(), g::Placement::all());
        auto optimizer = make_adamw(model->parameters());
        train_stages(model, optimizer, g::Placement::all(), g::Placement::all(), g::broadcast(), 0,
                     kStepsBefore + kStepsAfter);
        write_tensors(whole_values(*model), dir.file("at_end.pt"));
      },
      dir.workers());

  run_workers(
      2,
      [&] {
        torch::manual_seed(5);
        Stages model(g::Placement::all(), g::Placement::all());
        g::nn::GradientSync sync(model);
        auto optimizer = make_adamw(model->parameters());
        train_stages(model, optimizer, g::Placement::all(), g::Placement::all(), g::split(0), 0,
                     kStepsBefore);
        shoal::save(path, *model, optimizer);
      },
      dir.workers());

  run_workers(
      2,
      [&] {
        torch::manual_seed(400 + shoal::rank());
        Stages model(g::Placement({0}), g::Placement({1}));
        g::nn::GradientSync sync(model);
        auto optimizer = make_adamw(own_pieces(*model));
        shoal::load(path, *model, optimizer);
        EXPECT_EQ(optimizer.state().size(), 2u);  // this worker's stage: a weight and a bias
        train_stages(model, optimizer, {0}, {1}, g::broadcast(), kStepsBefore, kStepsAfter);
        expect_close(whole_values(*model), read_tensors(dir.file("at_end.pt")),
                     "stages, trained on");
      },
      dir.workers());
}

// Every supported optimizer's state crosses plans: saved in the tensor plan, loaded in the data
// plan, two more steps equal the saving model's own two more steps (a run that never stopped).
TEST(GlobalCheckpoint, EveryOptimizerTypeResumes) {
  ScratchDir dir;
  run_workers(
      2,
      [&] {
        using namespace torch::optim;  // NOLINT
        const Plan tensor{{g::Placement::all(), {0}}, g::broadcast()};
        using Make = std::function<std::unique_ptr<Optimizer>(std::vector<torch::Tensor>)>;
        const std::vector<std::pair<std::string, Make>> optimizers = {
            {"SGD with momentum",
             [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.05).momentum(0.9)); }},
            {"Adam with amsgrad",
             [](auto p) {
               return std::make_unique<Adam>(p, AdamOptions(0.01).eps(1e-4).amsgrad(true));
             }},
            {"Adagrad, with lr decay",
             [](auto p) {
               return std::make_unique<Adagrad>(p, AdagradOptions(0.05).lr_decay(0.1));
             }},
            {"RMSprop, centered, with momentum", [](auto p) {
               return std::make_unique<RMSprop>(
                   p, RMSpropOptions(0.01).eps(1e-4).centered(true).momentum(0.5));
             }}};
        for (const auto& [name, make] : optimizers) {
          const std::string path = dir.file("optimizer.pt");
          torch::manual_seed(9);
          Tiny saved(tensor.layout);
          g::nn::GradientSync saved_sync(saved);
          auto saved_optimizer = make(saved->parameters());
          train(saved, *saved_optimizer, tensor, 0, 2);
          shoal::save(path, *saved, *saved_optimizer);
          train(saved, *saved_optimizer, tensor, 2, 2);

          torch::manual_seed(10 + shoal::rank());
          Tiny loaded(data_plan().layout);
          g::nn::GradientSync loaded_sync(loaded);
          auto loaded_optimizer = make(loaded->parameters());
          shoal::load(path, *loaded, *loaded_optimizer);
          train(loaded, *loaded_optimizer, data_plan(), 2, 2);

          std::vector<torch::Tensor> reference;
          for (const auto& item : whole_values(*saved)) reference.push_back(item.second);
          expect_close(whole_values(*loaded), reference, name);
        }
      },
      dir.workers());
}

// The file's state by name holds, under each field's name, what LibTorch's state object calls
// by that name (read here without shoal's own table of fields).
TEST(GlobalCheckpoint, StateFieldsAreNamedAsLibTorchNamesThem) {
  ScratchDir dir;
  run_workers(
      1,
      [&] {
        using namespace torch::optim;  // NOLINT
        using State = OptimizerParamState;
        using Fields = std::vector<std::pair<std::string, std::function<torch::Tensor(State&)>>>;
        struct Case {
          std::string name;
          std::function<std::unique_ptr<Optimizer>(std::vector<torch::Tensor>)> make;
          std::function<int64_t(State&)> step;
          Fields fields;
        };
        auto adam = [](State& s) -> AdamParamState& { return static_cast<AdamParamState&>(s); };
        auto rms = [](State& s) -> RMSpropParamState& {
          return static_cast<RMSpropParamState&>(s);
        };
        const std::vector<Case> cases = {
            {"SGD",
             [](auto p) { return std::make_unique<SGD>(p, SGDOptions(0.05).momentum(0.9)); },
             [](State&) { return int64_t{0}; },
             {{"momentum_buffer",
               [](State& s) { return static_cast<SGDParamState&>(s).momentum_buffer(); }}}},
            {"Adam",
             [](auto p) { return std::make_unique<Adam>(p, AdamOptions(0.01).amsgrad(true)); },
             [adam](State& s) { return adam(s).step(); },
             {{"exp_avg", [adam](State& s) { return adam(s).exp_avg(); }},
              {"exp_avg_sq", [adam](State& s) { return adam(s).exp_avg_sq(); }},
              {"max_exp_avg_sq", [adam](State& s) { return adam(s).max_exp_avg_sq(); }}}},
            {"Adagrad",
             [](auto p) { return std::make_unique<Adagrad>(p, AdagradOptions(0.05)); },
             [](State& s) { return static_cast<AdagradParamState&>(s).step(); },
             {{"sum", [](State& s) { return static_cast<AdagradParamState&>(s).sum(); }}}},
            {"RMSprop",
             [](auto p) {
               return std::make_unique<RMSprop>(p,
                                                RMSpropOptions(0.01).centered(true).momentum(0.5));
             },
             [rms](State& s) { return rms(s).step(); },
             {{"square_avg", [rms](State& s) { return rms(s).square_avg(); }},
              {"momentum_buffer", [rms](State& s) { return rms(s).momentum_buffer(); }},
              {"grad_avg", [rms](State& s) { return rms(s).grad_avg(); }}}}};
        for (const auto& c : cases) {
          const std::string path = dir.file("fields.pt");
          torch::manual_seed(4);
          Tiny model(data_plan().layout);
          auto optimizer = c.make(model->parameters());
          train(model, *optimizer, data_plan(), 0, 2);
          shoal::save(path, *model, *optimizer);

          const std::string payload = read_bytes(path).substr(32);  // after the header
          torch::serialize::InputArchive archive, by_name;
          archive.load_from(payload.data(), payload.size());
          archive.read("optimizer_by_name", by_name);
          c10::IValue size;
          by_name.read("size", size);
          auto parameters = model->named_parameters();
          ASSERT_EQ(size.toInt(), static_cast<int64_t>(parameters.size())) << c.name;
          for (int64_t i = 0; i < size.toInt(); ++i) {
            const std::string index = std::to_string(i);
            c10::IValue name, step;
            by_name.read("name/" + index, name);
            by_name.read("step/" + index, step);
            const auto& parameter = parameters[name.toStringRef()];
            auto& state =
                *optimizer->state().at(c10::guts::to_string(parameter.unsafeGetTensorImpl()));
            EXPECT_EQ(step.toInt(), c.step(state)) << c.name << ", " << name.toStringRef();
            for (const auto& [field, get] : c.fields) {
              torch::Tensor value;
              ASSERT_TRUE(by_name.try_read(field + "/" + index, value)) << c.name << ", " << field;
              EXPECT_TRUE(torch::equal(value, get(state))) << c.name << ", " << field;
            }
          }
        }
      },
      dir.workers());
}

// --- Bad input -----------------------------------------------------------------------------

// Everything load may change on this worker: its pieces and AdamW's or SGD's state, copied.
std::vector<torch::Tensor> snapshot(Tiny& model, torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> tensors;
  for (const auto& p : model->parameters()) {
    tensors.push_back(p.detach().clone());
    auto entry = optimizer.state().find(c10::guts::to_string(p.unsafeGetTensorImpl()));
    if (entry == optimizer.state().end()) continue;
    if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(entry->second.get())) {
      tensors.push_back(torch::tensor(adamw->step()));
      tensors.push_back(adamw->exp_avg().clone());
      tensors.push_back(adamw->exp_avg_sq().clone());
    } else {
      auto& sgd = dynamic_cast<torch::optim::SGDParamState&>(*entry->second);
      tensors.push_back(sgd.momentum_buffer().clone());
    }
  }
  return tensors;
}

void expect_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                 const std::string& context) {
  ASSERT_EQ(a.size(), b.size()) << context;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], b[i])) << context << ": tensor " << i << " changed";
}

// Runs `f`, expecting a one-line UsageError containing every one of `parts`, within a deadline.
void expect_usage_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  const auto start = std::chrono::steady_clock::now();
  try {
    f();
    ADD_FAILURE() << "no UsageError; expected one containing \"" << parts.front() << "\"";
  } catch (const shoal::UsageError& e) {
    const std::string message = e.what();
    for (const auto& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "\"" << part << "\" not in: " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));  // a failure bound
}

TEST(GlobalCheckpoint, BadFilesAndOtherModelsRaiseOnEveryWorkerAndChangeNothing) {
  ScratchDir dir;
  run_workers(
      2,
      [&] {
        const Plan tensor{{g::Placement::all(), {0}}, g::broadcast()};
        const std::string path = dir.file("ckpt.pt");
        {
          torch::manual_seed(1);
          Tiny saved(tensor.layout);
          g::nn::GradientSync sync(saved);
          auto optimizer = make_adamw(saved->parameters());
          train(saved, optimizer, tensor, 0, 2);
          shoal::save(path, *saved, optimizer);
        }
        const std::string where = "checkpoint " + path;
        auto expect_refused = [&](Tiny& model, const std::string& file,
                                  const std::vector<std::string>& parts) {
          g::nn::GradientSync sync(model);
          auto optimizer = make_adamw(model->parameters());
          train(model, optimizer, tensor, 5, 1);
          const auto before = snapshot(model, optimizer);
          expect_usage_error([&] { shoal::load(file, *model, optimizer); }, parts);
          expect_same(snapshot(model, optimizer), before, parts.front());
        };
        {
          Tiny wider(tensor.layout, 10);
          expect_refused(
              wider, path,
              {where + ": parameter 'up.weight' has shape [8, 6] in the file but [10, 6] "
                       "in the module",
               "expected a checkpoint of this model"});
        }
        {
          Tiny bigger(tensor.layout, 8, /*extra=*/true);
          expect_refused(bigger, path,
                         {where + ": the module has submodule 'more', which the file does not"});
        }
        const std::string bytes = read_bytes(path);
        if (shoal::rank() == 0)
          write_bytes(dir.file("truncated.pt"), bytes.substr(0, bytes.size() / 2));
        std::string flipped = bytes;
        flipped[flipped.size() - 10] = static_cast<char>(flipped[flipped.size() - 10] ^ 0x20);
        if (shoal::rank() == 0) write_bytes(dir.file("corrupt.pt"), flipped);
        {
          Tiny model(tensor.layout);
          expect_refused(model, dir.file("truncated.pt"), {"truncated.pt is truncated"});
          expect_refused(model, dir.file("corrupt.pt"), {"corrupt.pt is corrupt"});
        }
        {
          // The same model, an optimizer of another type.
          Tiny model(tensor.layout);
          torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          expect_usage_error(
              [&] { shoal::load(path, *model, sgd); },
              {where + ": its optimizer state is torch::optim::AdamW's; this optimizer "
                       "is torch::optim::SGD"});
          EXPECT_TRUE(sgd.state().empty());
        }
        {
          // Only worker 1's optimizer is of another type: worker 0, which could load, raises its
          // message too and changes nothing.
          Tiny model(tensor.layout);
          g::nn::GradientSync sync(model);
          auto adamw = make_adamw(model->parameters());
          torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          torch::optim::Optimizer& optimizer =
              shoal::rank() == 0 ? static_cast<torch::optim::Optimizer&>(adamw) : sgd;
          train(model, optimizer, tensor, 5, 1);
          const auto before = snapshot(model, optimizer);
          expect_usage_error([&] { shoal::load(path, *model, optimizer); },
                             {"this optimizer is torch::optim::SGD"});
          expect_same(snapshot(model, optimizer), before, "one worker's optimizer differs");
        }
        {
          // An optimizer whose state shoal can't save by name.
          Tiny model(tensor.layout);
          torch::optim::LBFGS lbfgs(model->parameters());
          expect_usage_error(
              [&] { shoal::save(dir.file("lbfgs.pt"), *model, lbfgs); },
              {"the optimizer is torch::optim::LBFGS; expected torch::optim::SGD, Adam, "
               "AdamW, Adagrad or RMSprop"});
        }
        {
          // Only the job as a whole can save a global model.
          Tiny model(tensor.layout);
          shoal::SaveOptions options;
          options.group = shoal::comm::Group::single();
          expect_usage_error([&] { shoal::save(dir.file("single.pt"), *model, options); },
                             {"options.group is not the world"});
        }
      },
      dir.workers());
}

// The plain modules of one process with the names and shapes of Tiny's parameters.
struct PlainTinyImpl : torch::nn::Module {
  explicit PlainTinyImpl(int64_t hidden = 8) {
    embed = register_module("embed", torch::nn::Embedding(kVocabulary, kDim));
    up = register_module("up", torch::nn::Linear(kDim, hidden));
    down = register_module("down", torch::nn::Linear(hidden, kDim));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(PlainTiny);

// `module`'s parameters against `whole` by name: the same names, the same values.
void expect_whole(const torch::nn::Module& module,
                  const std::vector<std::pair<std::string, torch::Tensor>>& whole, const std::string& context) {
  const auto named = module.named_parameters();
  ASSERT_EQ(named.size(), whole.size()) << context;
  for (const auto& [name, value] : whole) {
    const auto* found = named.find(name);
    ASSERT_NE(found, nullptr) << context << ": " << name;
    ASSERT_EQ(found->sizes(), value.sizes()) << context << ": " << name;
    EXPECT_TRUE(torch::equal(*found, value)) << context << ": " << name;
  }
}

// Whatever holds the global layers (a torch::nn::Sequential) and whatever reference a global
// model is passed through (torch::nn::Module&), save writes the whole model: the file loads into
// one process's plain modules of the whole shapes with the whole values.
TEST(GlobalCheckpoint, SequentialsAndBaseReferencesSaveTheWholeModel) {
  ScratchDir dir;
  run_workers(
      2,
      [&] {
        const g::nn::Layout layout{g::Placement::all(), {0}};  // tensor-parallel over both workers
        shoal::LoadOptions alone;
        alone.group = shoal::comm::Group::single();

        torch::manual_seed(5);
        torch::nn::Sequential layers(g::nn::Linear(kDim, 8, layout.placement, layout.column()),
                                     g::nn::Linear(8, kDim, layout.placement, layout.row()));
        std::vector<std::pair<std::string, torch::Tensor>> layers_whole;
        for (const auto& item : layers->named_children()) {
          auto& layer = dynamic_cast<g::nn::Module&>(*item.value());
          for (auto& [name, value] : whole_values(layer)) layers_whole.emplace_back(item.key() + "." + name, value);
        }
        ASSERT_EQ(layers_whole.size(), 4u);
        shoal::save(dir.file("sequential.pt"), *layers);
        torch::nn::Sequential plain(torch::nn::Linear(kDim, 8), torch::nn::Linear(8, kDim));
        shoal::load(dir.file("sequential.pt"), *plain, alone);
        expect_whole(*plain, layers_whole, "a Sequential of global layers");

        torch::manual_seed(6);
        Tiny model(layout);
        const auto model_whole = whole_values(*model);
        const torch::nn::Module& base = *model;
        shoal::save(dir.file("base.pt"), base);
        PlainTiny plain_model;
        shoal::load(dir.file("base.pt"), *plain_model, alone);
        expect_whole(*plain_model, model_whole, "a global model through torch::nn::Module&");

        // And back through the same references: each worker takes its pieces again.
        torch::manual_seed(7);
        Tiny other(layout);
        torch::nn::Module& other_base = *other;
        shoal::load(dir.file("base.pt"), other_base);
        const auto reloaded = whole_values(*other);
        ASSERT_EQ(reloaded.size(), model_whole.size());
        for (size_t i = 0; i < reloaded.size(); ++i)
          EXPECT_TRUE(torch::equal(reloaded[i].second, model_whole[i].second)) << reloaded[i].first;
      },
      dir.workers());
}

// A parameter whose value is a sum of the workers' pieces has no piece to take back on load.
class SummedImpl : public g::nn::Module {
 public:
  SummedImpl() {
    weight = register_global_parameter(
        "weight",
        g::GlobalTensor::from_full(torch::ones({2}), g::Placement::all(), g::partial_sum()));
  }
  g::GlobalTensor weight;
};
TORCH_MODULE(Summed);

TEST(GlobalCheckpoint, PartialSumParametersAreRefused) {
  ScratchDir dir;
  run_workers(
      2,
      [&] {
        Summed model;
        expect_usage_error(
            [&] { shoal::save(dir.file("summed.pt"), *model); },
            {"parameter 'weight' is", "partial_sum on mesh axis 0", "expected split or broadcast"});
        EXPECT_FALSE(std::filesystem::exists(dir.file("summed.pt")));
      },
      dir.workers());
}

// Before the first step there is no state: the file has none, and loading it leaves none.
TEST(GlobalCheckpoint, NoStepNoState) {
  ScratchDir dir;
  run_workers(
      2,
      [&] {
        const std::string path = dir.file("fresh.pt");
        torch::manual_seed(3);
        Tiny fresh(data_plan().layout);
        auto fresh_optimizer = make_adamw(fresh->parameters());
        shoal::save(path, *fresh, fresh_optimizer);

        Tiny model(data_plan().layout);
        g::nn::GradientSync sync(model);
        auto optimizer = make_adamw(model->parameters());
        train(model, optimizer, data_plan(), 0, 1);
        ASSERT_FALSE(optimizer.state().empty());
        shoal::load(path, *model, optimizer);
        EXPECT_TRUE(optimizer.state().empty());
        const auto loaded = whole_values(*model);
        const auto saved = whole_values(*fresh);
        for (size_t i = 0; i < saved.size(); ++i)
          EXPECT_TRUE(torch::equal(loaded[i].second, saved[i].second)) << saved[i].first;
      },
      dir.workers());
}

}  // namespace
