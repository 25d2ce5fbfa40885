// Checkpoints: a round trip restores training exactly; a checkpoint saved by 2 workers resumes
// on 3 as the single-process run would; truncated, corrupt, foreign and mismatched files raise
// UsageError on every worker and change nothing; a failed or killed save never leaves a
// half-written file under the real name. An optimizer's per-parameter state is read and set by
// its fields' names (shoal/checkpoint/param_state.h).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compare.h"
#include "error_of.h"
#include "harness.h"
#include "shoal/checkpoint/checkpoint.h"
#include "shoal/checkpoint/param_state.h"
#include "shoal/comm/group.h"
#include "shoal/core/error.h"
#include "shoal/data/loader.h"
#include "shoal/dp/data_parallel.h"
#include "shoal/init.h"

namespace {

using shoal::testing::is_worker;
using shoal::testing::Launcher;
using shoal::testing::run_workers;
using shoal::testing::WorkersOptions;

constexpr int64_t kIn = 6, kOut = 3;

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t hidden = 8, bool with_norm = true) {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, hidden));
    if (with_norm) norm = register_module("norm", torch::nn::BatchNorm1d(hidden));
    // Without a bias: Module::save writes an undefined tensor for it, which must round-trip.
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(hidden, kOut).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fc1(x);
    if (norm) x = norm(x);
    return fc2(torch::tanh(x));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Net);

// Step `step`'s batch, the same on every worker and in every run.
std::pair<torch::Tensor, torch::Tensor> batch_of(int64_t step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({8, kIn}), torch::randint(kOut, {8})};
}

void train(Net& net, torch::optim::Optimizer& optimizer, int64_t first_step, int64_t steps) {
  for (int64_t step = first_step; step < first_step + steps; ++step) {
    auto [x, y] = batch_of(step);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    optimizer.step();
  }
}

// Adam's eps is large enough that a gradient component which is zero up to rounding (the
// all-reduce sums in another order than one process does) doesn't step by +-lr (see dp_test).
torch::optim::Adam make_adam(Net& net) {
  return torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(0.01).eps(1e-4));
}

torch::optim::AdamParamState* adam_state(torch::optim::Optimizer& optimizer, const torch::Tensor& parameter) {
  auto entry = optimizer.state().find(c10::guts::to_string(parameter.unsafeGetTensorImpl()));
  if (entry == optimizer.state().end()) return nullptr;
  return static_cast<torch::optim::AdamParamState*>(entry->second.get());
}

// Everything load may change: parameters, buffers and Adam's state, copied.
struct Snapshot {
  std::vector<torch::Tensor> tensors;
  std::vector<int64_t> steps;  // -1: no state for that parameter
};

Snapshot snapshot(Net& net, torch::optim::Optimizer& optimizer) {
  Snapshot s;
  for (auto& t : net->parameters()) s.tensors.push_back(t.detach().clone());
  for (auto& t : net->buffers()) s.tensors.push_back(t.clone());
  for (auto& p : optimizer.param_groups()[0].params()) {
    auto* state = adam_state(optimizer, p);
    s.steps.push_back(state ? state->step() : -1);
    if (state) {
      s.tensors.push_back(state->exp_avg().clone());
      s.tensors.push_back(state->exp_avg_sq().clone());
    }
  }
  return s;
}

void expect_same(const Snapshot& a, const Snapshot& b, const std::string& context = "") {
  EXPECT_EQ(a.steps, b.steps) << context;
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << context;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.tensors[i], b.tensors[i])) << context << ": tensor " << i << " differs";
  }
}

// Runs `f` and expects a one-line UsageError containing every one of `parts`.
void expect_usage_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no UsageError; expected one containing \"" << parts.front() << "\"";
  } catch (const shoal::UsageError& e) {
    const std::string message = e.what();
    for (const auto& part : parts) EXPECT_NE(message.find(part), std::string::npos) << "\"" << part << "\" not in: " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
  }
}

// The test's own directory: made by the test process, handed to its workers by environment.
class ScratchDir {
 public:
  static constexpr const char* kVariable = "CHECKPOINT_TEST_DIR";
  ScratchDir() {
    if (is_worker()) {
      path_ = std::getenv(kVariable);
      return;
    }
    char name[] = "/tmp/shoal-checkpoint-XXXXXX";
    path_ = mkdtemp(name);
    owner_ = true;
  }
  ~ScratchDir() {
    if (owner_) std::filesystem::remove_all(path_);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  WorkersOptions workers(Launcher launcher = Launcher::kShoal) const {
    WorkersOptions options;
    options.launcher = launcher;
    options.env[kVariable] = path_;
    return options;
  }
  std::set<std::string> listing() const {
    std::set<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path_)) names.insert(entry.path().filename().string());
    return names;
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

// --- Round trip ---------------------------------------------------------------------------

TEST(Checkpoint, RoundTripRestoresTrainingExactly) {
  ScratchDir dir;
  run_workers(1, [&] {
    const std::string path = dir.file("ckpt.pt");
    torch::manual_seed(1);
    Net net;
    auto optimizer = make_adam(net);
    train(net, optimizer, 0, 3);  // Adam has state, BatchNorm running statistics
    shoal::data::SamplerState loader_state;
    loader_state.seed = 0xfedcba9876543210ULL;  // the top bit set: must survive the int64 archive
    loader_state.shuffle = true;
    loader_state.dataset_size = 100;
    loader_state.epoch = 2;
    loader_state.cursor = 40;
    // A sampler standing there, and one for the same data standing at the start.
    shoal::data::SamplerOptions sampler_options;
    sampler_options.batch_size = 10;
    sampler_options.shuffle = loader_state.shuffle;
    sampler_options.seed = loader_state.seed;
    shoal::data::Sampler sampler(loader_state.dataset_size, sampler_options, 0, 1);
    sampler.load_state(loader_state);
    shoal::data::Sampler restored_sampler(loader_state.dataset_size, sampler_options, 0, 1);
    shoal::SaveOptions save_options;
    save_options.extras["lr"] = torch::tensor(0.01, torch::kFloat64);
    save_options.extras["best loss.v2"] = torch::tensor({1.5f, 2.5f});  // any name
    shoal::save(path, *net, optimizer, sampler, save_options);
    EXPECT_EQ(dir.listing(), std::set<std::string>{"ckpt.pt"});  // no temporary file left

    torch::manual_seed(2);
    Net copy;
    auto copy_optimizer = make_adam(copy);
    ASSERT_FALSE(torch::equal(copy->fc1->weight, net->fc1->weight));
    shoal::CheckpointExtras extras;
    shoal::LoadOptions load_options;
    load_options.extras = &extras;
    shoal::load(path, *copy, copy_optimizer, restored_sampler, load_options);
    const auto restored = restored_sampler.state();

    expect_same(snapshot(copy, copy_optimizer), snapshot(net, optimizer), "after load");
    EXPECT_EQ(restored.seed, loader_state.seed);
    EXPECT_EQ(restored.shuffle, loader_state.shuffle);
    EXPECT_EQ(restored.dataset_size, loader_state.dataset_size);
    EXPECT_EQ(restored.epoch, loader_state.epoch);
    EXPECT_EQ(restored.cursor, loader_state.cursor);
    ASSERT_EQ(extras.size(), 2u);
    EXPECT_TRUE(torch::equal(extras.at("lr"), save_options.extras.at("lr")));
    EXPECT_TRUE(torch::equal(extras.at("best loss.v2"), save_options.extras.at("best loss.v2")));
    // The parameters are the module's own tensors still, filled in place: the optimizer steps them.
    EXPECT_TRUE(copy_optimizer.param_groups()[0].params()[0].is_same(copy->parameters()[0]));

    // The loaded copy trains on exactly as the original does.
    train(net, optimizer, 3, 3);
    train(copy, copy_optimizer, 3, 3);
    expect_same(snapshot(copy, copy_optimizer), snapshot(net, optimizer), "after 3 more steps");
  }, dir.workers(Launcher::kNone));
}

TEST(Checkpoint, PartsAreOptional) {
  ScratchDir dir;
  run_workers(1, [&] {
    torch::manual_seed(1);
    Net net;
    auto optimizer = make_adam(net);
    train(net, optimizer, 0, 2);

    // The module alone: loads into a module; asking for an optimizer's state is an error.
    shoal::save(dir.file("module.pt"), *net);
    torch::manual_seed(2);
    Net copy;
    auto copy_optimizer = make_adam(copy);
    shoal::load(dir.file("module.pt"), *copy);
    for (size_t i = 0; i < net->parameters().size(); ++i) {
      EXPECT_TRUE(torch::equal(copy->parameters()[i], net->parameters()[i]));
    }
    const auto before = snapshot(copy, copy_optimizer);
    expect_usage_error([&] { shoal::load(dir.file("module.pt"), *copy, copy_optimizer); },
                       {"checkpoint " + dir.file("module.pt") + " holds no optimizer state",
                        "shoal::load(path, module)"});
    expect_same(snapshot(copy, copy_optimizer), before, "after a failed load");

    // Module and optimizer without a loader state: loading a loader from it is refused, with
    // nothing changed; without the loader it loads.
    shoal::save(dir.file("no_loader.pt"), *net, optimizer);
    shoal::data::Sampler sampler(100, {}, 0, 1);
    sampler.set_epoch(3);
    expect_usage_error([&] { shoal::load(dir.file("no_loader.pt"), *copy, copy_optimizer, sampler); },
                       {"checkpoint " + dir.file("no_loader.pt") + " holds no loader state",
                        "or load it without the loader"});
    expect_same(snapshot(copy, copy_optimizer), before, "after a failed load");
    EXPECT_EQ(sampler.epoch(), 3);
    shoal::load(dir.file("no_loader.pt"), *copy, copy_optimizer);
    expect_same(snapshot(copy, copy_optimizer), snapshot(net, optimizer));

    // A file with everything loads into the module alone (evaluation).
    shoal::save(dir.file("all.pt"), *net, optimizer, sampler);
    // Its loader state is checked with the rest, before anything changes: a loader over another
    // dataset refuses it, and neither the model, the optimizer nor the loader changes.
    shoal::data::Sampler other_data(50, {}, 0, 1);
    other_data.set_epoch(1);
    train(copy, copy_optimizer, 0, 1);  // so that it differs from the file
    const auto trained = snapshot(copy, copy_optimizer);
    expect_usage_error([&] { shoal::load(dir.file("all.pt"), *copy, copy_optimizer, other_data); },
                       {"checkpoint " + dir.file("all.pt") +
                        ": Sampler: the state was saved for a dataset of 100 samples; this one has 50"});
    expect_same(snapshot(copy, copy_optimizer), trained, "after a refused loader state");
    EXPECT_EQ(other_data.epoch(), 1);
    EXPECT_EQ(other_data.cursor(), 0);
    Net eval;
    shoal::load(dir.file("all.pt"), *eval);
    EXPECT_TRUE(torch::equal(eval->fc2->weight, net->fc2->weight));

    shoal::SaveOptions undefined_extra;
    undefined_extra.extras["nothing"] = torch::Tensor();
    expect_usage_error([&] { shoal::save(dir.file("bad.pt"), *net, undefined_extra); },
                       {"extras[\"nothing\"] is an undefined tensor"});
    expect_usage_error([&] { shoal::save("", *net); }, {"shoal::save: the path is empty"});
    EXPECT_EQ(dir.listing(), (std::set<std::string>{"module.pt", "no_loader.pt", "all.pt"}));
  }, dir.workers(Launcher::kNone));
}

TEST(Checkpoint, NeedsTheJobOrAGroup) {
  // The test process itself never called shoal::init().
  ScratchDir dir;
  Net net;
  expect_usage_error([&] { shoal::save(dir.file("x.pt"), *net); },
                     {"shoal::save: the job is not known yet: call shoal::init() first", "comm::Group::single()"});
  expect_usage_error([&] { shoal::load(dir.file("x.pt"), *net); }, {"shoal::load: the job is not known yet"});
  shoal::SaveOptions save_options;
  save_options.group = shoal::comm::Group::single();
  shoal::save(dir.file("x.pt"), *net, save_options);
  Net copy;
  shoal::LoadOptions load_options;
  load_options.group = shoal::comm::Group::single();
  shoal::load(dir.file("x.pt"), *copy, load_options);
  EXPECT_TRUE(torch::equal(copy->fc1->weight, net->fc1->weight));
}

// --- Resume on a different number of workers ------------------------------------------------

// 60 samples: global batches of 12 cut evenly among 2 workers (6 + 6) and 3 (4 + 4 + 4), so
// data parallelism's mean of the workers' means is the single process's mean.
constexpr int64_t kSamples = 60, kGlobalBatch = 12, kStepsBefore = 3;

class Points : public torch::data::datasets::Dataset<Points> {
 public:
  Points() {
    torch::manual_seed(7);
    x_ = torch::randn({kSamples, kIn});
    y_ = torch::randint(kOut, {kSamples});
  }
  torch::data::Example<> get(size_t i) override { return {x_[static_cast<int64_t>(i)], y_[static_cast<int64_t>(i)]}; }
  torch::optional<size_t> size() const override { return static_cast<size_t>(kSamples); }

 private:
  torch::Tensor x_, y_;
};

shoal::data::LoaderOptions loader_options() {
  shoal::data::LoaderOptions options;
  options.batch_size = kGlobalBatch;
  options.shuffle = true;
  options.seed = 3;
  return options;
}

// Largest |a - b| over largest |b|, across all parameters.
double relative_difference(Net& a, Net& b) {
  return shoal::testing::relative_difference(a->parameters(), b->parameters());
}

void train_step(Net& net, torch::optim::Optimizer& optimizer, const torch::data::Example<>& batch) {
  optimizer.zero_grad();
  torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target).backward();
  optimizer.step();
}

TEST(Checkpoint, ResumesOnADifferentNumberOfWorkers) {
  ScratchDir dir;
  const std::string path = dir.file("ckpt.pt");

  // Two workers train the first kStepsBefore global batches of epoch 0 and save.
  run_workers(2, [&] {
    torch::manual_seed(10 + shoal::rank());  // DataParallel starts everyone from worker 0's model
    Net net(8, /*with_norm=*/false);
    shoal::DataParallel model(net);
    auto optimizer = make_adam(net);
    auto loader = shoal::data::make_loader(Points(), loader_options());
    int64_t steps = 0;
    for (auto& batch : loader.epoch(0)) {
      train_step(net, optimizer, batch);
      if (++steps == kStepsBefore) break;
    }
    shoal::save(path, *net, optimizer, loader.sampler());
  }, dir.workers());

  // Three workers, each from a different random model, load it and finish the epoch.
  run_workers(3, [&] {
    torch::manual_seed(100 + shoal::rank());
    Net net(8, false);
    auto optimizer = make_adam(net);
    auto loader = shoal::data::make_loader(Points(), loader_options());
    shoal::load(path, *net, optimizer, loader.sampler());
    EXPECT_EQ(loader.sampler().epoch(), 0);
    EXPECT_EQ(loader.sampler().cursor(), kStepsBefore * kGlobalBatch);
    for (auto& p : net->parameters()) EXPECT_EQ(adam_state(optimizer, p)->step(), kStepsBefore);

    // The oracle: one process training on every global batch of the epoch from the same start.
    torch::manual_seed(10);  // worker 0's model in the first run
    Net reference(8, false);
    auto reference_optimizer = make_adam(reference);
    auto reference_loader = shoal::data::make_loader(Points(), loader_options(), 0, 1);
    int64_t reference_steps = 0;
    for (auto& batch : reference_loader.epoch(0)) {
      train_step(reference, reference_optimizer, batch);
      if (++reference_steps == kStepsBefore) {
        EXPECT_LT(relative_difference(net, reference), 1e-5);  // what was saved, up to rounding
      }
    }

    shoal::DataParallel model(net);
    int64_t steps = 0;
    for (auto& batch : loader.epoch(loader.sampler().epoch())) {
      EXPECT_EQ(batch.data.size(0), kGlobalBatch / 3);
      train_step(net, optimizer, batch);
      ++steps;
    }
    EXPECT_EQ(steps, kSamples / kGlobalBatch - kStepsBefore);
    EXPECT_LT(relative_difference(net, reference), 1e-5);
  }, dir.workers());
}

// Every worker ends load with exactly the saved values, whatever it held before.
TEST(Checkpoint, EveryWorkerGetsExactlyTheSavedValues) {
  ScratchDir dir;
  run_workers(2, [&] {
    torch::manual_seed(1);
    Net net;
    auto optimizer = make_adam(net);
    train(net, optimizer, 0, 2);
    shoal::save(dir.file("ckpt.pt"), *net, optimizer);
    if (shoal::is_main()) torch::save(snapshot(net, optimizer).tensors, dir.file("expected.pt"));
  }, dir.workers());
  run_workers(3, [&] {
    torch::manual_seed(50 + shoal::rank());
    Net net;
    auto optimizer = make_adam(net);
    train(net, optimizer, 10 + shoal::rank(), 1);  // some other state, different on every worker
    shoal::load(dir.file("ckpt.pt"), *net, optimizer);
    std::vector<torch::Tensor> expected;
    torch::load(expected, dir.file("expected.pt"));
    const auto got = snapshot(net, optimizer);
    ASSERT_EQ(got.tensors.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(torch::equal(got.tensors[i], expected[i])) << i;
    EXPECT_EQ(got.steps, std::vector<int64_t>(got.steps.size(), 2));
  }, dir.workers());
}

// --- Bad files, on one worker and on two --------------------------------------------------

class BadFiles : public ::testing::TestWithParam<int> {};

// Saves a good checkpoint of a trained model, then trains one step further, so that a load
// that changed anything would show. Returns the path of the good checkpoint.
std::string prepare(const ScratchDir& dir, Net& net, torch::optim::Optimizer& optimizer) {
  train(net, optimizer, 0, 2);
  const std::string good = dir.file("good.pt");
  shoal::save(good, *net, optimizer, shoal::data::Sampler(16, {}, 0, 1));
  train(net, optimizer, 2, 1);
  return good;
}

TEST_P(BadFiles, TruncatedFilesRaiseOnEveryWorkerAndChangeNothing) {
  ScratchDir dir;
  run_workers(GetParam(), [&] {
    torch::manual_seed(1);
    Net net;
    auto optimizer = make_adam(net);
    const std::string good = prepare(dir, net, optimizer);
    const std::string bytes = read_bytes(good);
    const size_t header = 32, payload = bytes.size() - header;
    // Inside the magic, inside the header, the header alone, inside the payload, one byte short.
    const std::vector<size_t> cuts = {0, 5, 20, header, header + payload / 2, bytes.size() - 1};
    if (shoal::is_main()) {
      for (size_t cut : cuts) write_bytes(dir.file("cut" + std::to_string(cut)), bytes.substr(0, cut));
    }
    shoal::world().barrier();

    const auto before = snapshot(net, optimizer);
    for (size_t cut : cuts) {
      const std::string path = dir.file("cut" + std::to_string(cut));
      std::vector<std::string> expected = {"checkpoint " + path + " is truncated", "expected a complete file written by shoal::save"};
      if (cut < header) {
        expected.push_back("it has " + std::to_string(cut) + " bytes, fewer than the 32 of the header");
      } else {
        expected.push_back("the header says " + std::to_string(payload) + " bytes of payload, found " +
                           std::to_string(cut - header));
      }
      expect_usage_error([&] { shoal::load(path, *net, optimizer); }, expected);
      expect_same(snapshot(net, optimizer), before, "after loading " + path);
    }
  }, dir.workers());
}

uint32_t crc(const std::string& bytes) {
  return static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

TEST_P(BadFiles, CorruptAndForeignFilesRaiseOnEveryWorkerAndChangeNothing) {
  ScratchDir dir;
  run_workers(GetParam(), [&] {
    torch::manual_seed(1);
    Net net;
    auto optimizer = make_adam(net);
    const std::string good = prepare(dir, net, optimizer);
    const std::string bytes = read_bytes(good);
    const size_t header = 32;

    struct Case {
      std::string name, bytes;
      std::vector<std::string> expected;
    };
    std::vector<Case> cases;
    for (size_t at : {header, (header + bytes.size()) / 2, bytes.size() - 1}) {
      std::string flipped = bytes;
      flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
      cases.push_back({"flip" + std::to_string(at), flipped, {"is corrupt: checksum mismatch in the payload"}});
    }
    std::string longer = bytes;
    longer[16] = static_cast<char>(longer[16] + 1);  // the payload length: the header's checksum catches it
    cases.push_back({"length", longer, {"is corrupt: checksum mismatch in the header"}});
    cases.push_back({"trailing", bytes + "xyz", {"is corrupt: the header says", "found " + std::to_string(bytes.size() - header + 3)}});
    std::string newer = bytes;
    newer[8] = 2;  // format version 2, with a header checksum to match
    const uint32_t header_crc = crc(newer.substr(0, 28));
    for (int i = 0; i < 4; ++i) newer[28 + i] = static_cast<char>((header_crc >> (8 * i)) & 0xff);
    cases.push_back({"newer", newer, {"has format version 2; this shoal reads version 1"}});
    cases.push_back({"text", "hello, world\n", {"is not a shoal checkpoint: it starts with \"hello, w\", not \"SHOALCKP\""}});
    std::ostringstream torch_file;
    torch::save(torch::ones({3}), torch_file);
    cases.push_back({"torch", torch_file.str(), {"is not a shoal checkpoint", "expected a file written by shoal::save"}});

    if (shoal::is_main()) {
      for (const auto& c : cases) write_bytes(dir.file(c.name), c.bytes);
    }
    shoal::world().barrier();

    const auto before = snapshot(net, optimizer);
    for (auto& c : cases) {
      const std::string path = dir.file(c.name);
      c.expected.push_back("checkpoint " + path);
      expect_usage_error([&] { shoal::load(path, *net, optimizer); }, c.expected);
      expect_same(snapshot(net, optimizer), before, "after loading " + path);
    }
    expect_usage_error([&] { shoal::load(dir.file("missing.pt"), *net, optimizer); },
                       {"checkpoint " + dir.file("missing.pt") + ": cannot open it", "No such file or directory"});
    expect_usage_error([&] { shoal::load(dir.file(""), *net, optimizer); }, {"is a directory"});
    expect_same(snapshot(net, optimizer), before, "after loading missing files");
  }, dir.workers());
}

TEST_P(BadFiles, AFailedSaveRaisesOnEveryWorkerAndLeavesNothing) {
  ScratchDir dir;
  run_workers(GetParam(), [&] {
    torch::manual_seed(1);
    Net net;
    auto optimizer = make_adam(net);
    const std::string missing = dir.file("no/such/dir/ckpt.pt");
    expect_usage_error([&] { shoal::save(missing, *net, optimizer); },
                       {"checkpoint " + missing + ": cannot create " + missing + ".tmp-", "No such file or directory"});
    // The real name is a directory: the rename fails, and the temporary file must go.
    const std::string occupied = dir.file("occupied");
    if (shoal::is_main()) std::filesystem::create_directory(occupied);
    shoal::world().barrier();
    expect_usage_error([&] { shoal::save(occupied, *net, optimizer); },
                       {"checkpoint " + occupied + ": cannot rename " + occupied + ".tmp-", "Is a directory"});
    shoal::world().barrier();
    EXPECT_EQ(dir.listing(), std::set<std::string>{"occupied"});
    EXPECT_TRUE(std::filesystem::is_empty(occupied));
  }, dir.workers());
}

INSTANTIATE_TEST_SUITE_P(Workers, BadFiles, ::testing::Values(1, 2));

// --- Checkpoints of another model or optimizer ----------------------------------------------

TEST(Checkpoint, AnotherModelRaisesNamingTheFirstMismatchAndChangesNothing) {
  ScratchDir dir;
  run_workers(1, [&] {
    torch::manual_seed(1);
    Net saved;
    auto saved_optimizer = make_adam(saved);
    train(saved, saved_optimizer, 0, 2);
    const std::string path = dir.file("ckpt.pt");
    shoal::save(path, *saved, saved_optimizer);
    const std::string where = "checkpoint " + path + ": ";

    auto expect_refused = [&](Net& net, torch::optim::Optimizer& optimizer, const std::vector<std::string>& parts) {
      train(net, optimizer, 5, 1);
      const auto before = snapshot(net, optimizer);
      expect_usage_error([&] { shoal::load(path, *net, optimizer); }, parts);
      expect_same(snapshot(net, optimizer), before);
    };

    {
      Net wider(16);
      auto optimizer = make_adam(wider);
      expect_refused(wider, optimizer,
                     {where + "parameter 'fc1.weight' has shape [8, 6] in the file but [16, 6] in the module",
                      "expected a checkpoint of this model"});
    }
    {
      Net plain(8, /*with_norm=*/false);
      auto optimizer = make_adam(plain);
      expect_refused(plain, optimizer, {where + "the file has 'norm', which the module does not"});
    }
    {
      struct Bigger : NetImpl {
        Bigger() { extra = register_parameter("extra", torch::zeros({2})); }
        torch::Tensor extra;
      };
      auto bigger = std::make_shared<Bigger>();
      Net net{std::shared_ptr<NetImpl>(bigger)};
      auto optimizer = make_adam(net);
      expect_refused(net, optimizer, {where + "the module has parameter 'extra' of shape [2], which the file does not"});
    }
    {
      // The same model, but an optimizer of another type.
      Net net;
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      train(net, sgd, 5, 1);
      std::vector<torch::Tensor> before;
      for (auto& p : net->parameters()) before.push_back(p.detach().clone());
      const size_t entries = sgd.state().size();
      expect_usage_error([&] { shoal::load(path, *net, sgd); },
                         {where + "its optimizer state is torch::optim::Adam's; this optimizer is torch::optim::SGD"});
      for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(net->parameters()[i], before[i]));
      EXPECT_EQ(sgd.state().size(), entries);
    }
    {
      // Adam over the same parameters in another order: the moments would land on the wrong ones.
      Net net;
      auto params = net->parameters();
      std::reverse(params.begin(), params.end());
      torch::optim::Adam reversed(params, torch::optim::AdamOptions(0.01).eps(1e-4));
      expect_refused(net, reversed, {where + "the optimizer's '", "in the file but the parameter has shape",
                                     "expected an optimizer over the same parameters in the same order"});
    }
    {
      // Two parameter groups instead of one.
      Net net;
      auto params = net->parameters();
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(std::vector<torch::Tensor>(params.begin(), params.begin() + 2));
      groups.emplace_back(std::vector<torch::Tensor>(params.begin() + 2, params.end()));
      torch::optim::Adam grouped(groups, torch::optim::AdamOptions(0.01).eps(1e-4));
      expect_refused(net, grouped, {where + "its optimizer has 1 parameter groups; this one has 2"});
    }
  }, dir.workers(Launcher::kNone));
}

// --- Atomicity ------------------------------------------------------------------------------

void fill(torch::nn::Module& module, double value) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) p.fill_(value);
}

TEST(Checkpoint, SavingOverACheckpointReplacesIt) {
  ScratchDir dir;
  run_workers(2, [&] {
    Net net;
    fill(*net, 1);
    shoal::save(dir.file("ckpt.pt"), *net);
    fill(*net, 2);
    shoal::save(dir.file("ckpt.pt"), *net);
    Net copy;
    shoal::load(dir.file("ckpt.pt"), *copy);
    for (auto& p : copy->parameters()) EXPECT_TRUE(torch::equal(p, torch::full_like(p, 2)));
    EXPECT_EQ(dir.listing(), std::set<std::string>{"ckpt.pt"});
  }, dir.workers());
}

// A worker killed by SIGKILL at some moment of a stream of saves: the real name holds one of
// the complete checkpoints, never a mix or a partial one.
TEST(Checkpoint, AKilledSaveLeavesTheOldOrTheNewCheckpoint) {
  ScratchDir dir;
  const std::string path = dir.file("ckpt.pt");
  for (int delay_ms : {20, 70, 150}) {
    auto options = dir.workers(Launcher::kNone);
    options.may_fail = {0};
    const auto exits = run_workers(1, [&] {
      torch::nn::Linear big(1024, 1024);  // 4 MB: long enough to be killed while writing
      fill(*big, 1);
      shoal::save(path, *big);
      std::thread([delay_ms] {
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        kill(getpid(), SIGKILL);
      }).detach();
      for (int version = 2;; ++version) {
        fill(*big, version);
        shoal::save(path, *big);
      }
    }, options);
    if (is_worker()) continue;
    ASSERT_EQ(exits.size(), 1u);
    EXPECT_EQ(exits[0].signal, SIGKILL) << exits[0].output;

    torch::nn::Linear loaded(1024, 1024);
    fill(*loaded, 0);
    shoal::LoadOptions load_options;
    load_options.group = shoal::comm::Group::single();
    shoal::load(path, *loaded, load_options);
    const double value = loaded->weight[0][0].item<double>();
    EXPECT_GE(value, 1);
    for (auto& p : loaded->parameters()) EXPECT_TRUE(torch::equal(p, torch::full_like(p, value))) << "a mixed checkpoint";
    // What a crash may leave: the temporary file, besides the real one; never anything else.
    bool interrupted_a_write = false;
    for (const auto& name : dir.listing()) {
      EXPECT_TRUE(name == "ckpt.pt" || name.rfind("ckpt.pt.tmp-", 0) == 0) << name;
      interrupted_a_write |= name != "ckpt.pt";
    }
    std::cout << "killed after " << delay_ms << " ms: checkpoint " << value
              << (interrupted_a_write ? ", a temporary file left behind" : ", between writes") << std::endl;
  }
}

// --- Deadlines ------------------------------------------------------------------------------

// The first worker never gets to save (it is busy, then leaves): the other's wait ends at its
// deadline with a CommError that names the checkpoint and what it waited for.
TEST(Checkpoint, WaitingForTheWriterHasADeadline) {
  ScratchDir dir;
  run_workers(2, [&] {
    if (shoal::rank() == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(8));
      return;
    }
    Net net;
    shoal::SaveOptions options;
    options.timeout = std::chrono::milliseconds(500);
    const auto start = std::chrono::steady_clock::now();
    try {
      shoal::save(dir.file("ckpt.pt"), *net, options);
      ADD_FAILURE() << "save returned without the writer";
    } catch (const shoal::CommError& e) {
      EXPECT_NE(std::string(e.what()).find("checkpoint " + dir.file("ckpt.pt") + ": waiting for worker 0 to write it"),
                std::string::npos)
          << e.what();
    }
    // Well before the writer leaves (8 s), which would end the wait anyway: a failure bound
    // generous enough for a loaded machine (the deadline is 0.5 s).
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(5000));
  }, dir.workers());
}

}  // namespace

// A parameter's state by its fields' names: what an optimizer's step made is read as the tensors
// themselves, set into another optimizer of the type it steps on exactly as the first, and bad
// states are refused with their one line and nothing changed.
TEST(ParamState, ReadAndSetByNameAsTheOptimizerHoldsIt) {
  using shoal::checkpoint::param_state;
  using shoal::checkpoint::set_param_state;
  using shoal::testing::error_of;
  auto train = [](torch::nn::Linear& net, torch::optim::Optimizer& optimizer) {
    optimizer.zero_grad();
    net->forward(torch::ones({2, 4})).pow(2).sum().backward();
    optimizer.step();
  };
  torch::manual_seed(3);
  torch::nn::Linear a(4, 2), b(4, 2);
  torch::optim::Adam first(a->parameters(), torch::optim::AdamOptions(0.1).amsgrad(true));
  torch::optim::Adam second(b->parameters(), torch::optim::AdamOptions(0.1).amsgrad(true));
  EXPECT_FALSE(param_state(first, a->weight).has_value());  // no step yet
  train(a, first);
  b->weight.data().copy_(a->weight.data());
  b->bias.data().copy_(a->bias.data());
  for (const auto& p : {a->weight, a->bias}) {
    auto state = param_state(first, p);
    ASSERT_TRUE(state.has_value());
    EXPECT_EQ(state->step, 1);
    ASSERT_EQ(state->fields.size(), 3u);
    EXPECT_TRUE(state->fields.at("exp_avg").is_same(
        static_cast<torch::optim::AdamParamState&>(*first.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())))
            .exp_avg()));
    const at::Tensor& q = p.is_same(a->weight) ? b->weight : b->bias;
    shoal::checkpoint::ParamState copied{state->step, {}};
    for (const auto& [name, value] : state->fields) copied.fields[name] = value.clone();
    set_param_state(second, q, copied);
  }
  train(a, first);
  train(b, second);
  EXPECT_TRUE(torch::equal(a->weight, b->weight));
  EXPECT_TRUE(torch::equal(a->bias, b->bias));
  EXPECT_EQ(shoal::checkpoint::state_fields(first), (std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}));

  const auto before = param_state(second, b->weight)->fields.at("exp_avg").clone();
  const shoal::checkpoint::ParamState good = *param_state(second, b->weight);
  auto with = [&](const std::string& field, const at::Tensor& value) {
    shoal::checkpoint::ParamState state = good;
    state.fields[field] = value;
    return state;
  };
  EXPECT_EQ(error_of([&] { set_param_state(second, b->weight, with("sum", torch::zeros({2, 4}))); }),
            "set_param_state: torch::optim::Adam has no state field 'sum'; expected one of exp_avg, exp_avg_sq, "
            "max_exp_avg_sq");
  EXPECT_EQ(error_of([&] { set_param_state(second, b->weight, with("exp_avg", torch::zeros({4, 2}))); }),
            "set_param_state: the field 'exp_avg' has shape [4, 2] and its parameter [2, 4]; expected the "
            "parameter's shape");
  EXPECT_EQ(error_of([&] { set_param_state(second, b->weight, {std::nullopt, good.fields}); }),
            "set_param_state: torch::optim::Adam counts steps, and the state has no step; expected a step");
  EXPECT_EQ(error_of([&] { set_param_state(second, a->weight, good); }),
            "set_param_state: the tensor is not a parameter of the torch::optim::Adam; expected one of its parameters");
  EXPECT_TRUE(torch::equal(param_state(second, b->weight)->fields.at("exp_avg"), before));
  torch::optim::SGD sgd(b->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  EXPECT_EQ(error_of([&] { set_param_state(sgd, b->weight, {int64_t{1}, {}}); }),
            "set_param_state: torch::optim::SGD counts no steps, and the state has one; expected none");
  torch::optim::LBFGS lbfgs(b->parameters());
  EXPECT_EQ(error_of([&] { param_state(lbfgs, b->weight); }),
            "the optimizer is torch::optim::LBFGS; expected torch::optim::SGD, Adam, AdamW, Adagrad or RMSprop, whose "
            "state shoal saves by parameter name");
}
