// A parameter-server trained program as a user writes it (shoal::init, shoal::ps::Optimizer,
// shoal::ps::Embedding), for tests/ps_client_test.cpp. Each worker trains its share of a fixed
// global batch for a few sync steps; then worker 0 trains the one-process reference on the whole
// batches with torch::optim and checks that the servers' dense parameters and every row of the
// table equal the reference's (relative 1e-5), rows no batch touched bit-identical to their
// initial values. Prints "ps train ok" and exits 0, or says what differed and exits 1.
//
//   ps_train sgd|adagrad|adam [STEPS]
//   ps_train noise STEPS: the gradient noise the servers measure, against its oracles
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "../noise_problem.h"
#include "core/hash.h"
#include "ps/messages.h"
#include "ps/table.h"
#include "shoal/comm/group.h"
#include "shoal/data/loader.h"
#include "shoal/ps/ps.h"
#include "shoal/init.h"

namespace {

constexpr int64_t kRows = 64, kDim = 4, kFeatures = 3, kBatch = 12, kIdsPerSample = 2;
constexpr uint64_t kSeed = 7;

// Sample i of step t: two ids among the first 48 rows (rows 48..63 are never touched), three
// features, a target.
struct Batch {
  torch::Tensor ids, x, y;
};
Batch batch(int t, int64_t begin, int64_t end) {
  Batch b{torch::empty({end - begin, kIdsPerSample}, torch::kLong),
          torch::empty({end - begin, kFeatures}), torch::empty({end - begin, 1})};
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t key = shoal::detail::hash_of(static_cast<uint64_t>(t), static_cast<uint64_t>(i));
    for (int64_t j = 0; j < kIdsPerSample; ++j)
      b.ids[i - begin][j] = static_cast<int64_t>(shoal::detail::hash_of(key, j) % 48);
    for (int64_t j = 0; j < kFeatures; ++j)
      b.x[i - begin][j] = static_cast<float>(
          shoal::detail::uniform_of(shoal::detail::hash_of(key, 10 + j)) * 2 - 1);
    b.y[i - begin][0] =
        static_cast<float>(shoal::detail::uniform_of(shoal::detail::hash_of(key, 99)));
  }
  return b;
}

// PS_TRAIN_WIDE=W adds a branch of W units beside the hidden layer, averaged into the output so
// that training stays as tame as without it: its many values make each server's share of the
// dense ones large enough to cross through shared memory (docs/ps.md, "Transport").
int64_t wide_width() {
  const char* width = std::getenv("PS_TRAIN_WIDE");
  return width != nullptr && *width != '\0' ? std::atoll(width) : 0;
}

// The worker's shared segments with servers on its host: memfds named "shoal-ps".
int shared_segments() {
  int count = 0;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const auto target = std::filesystem::read_symlink(fd.path(), error);
    if (!error && target.string().rfind("/memfd:shoal-ps", 0) == 0) ++count;
  }
  return count;
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    table =
        register_module("table", shoal::ps::Embedding(shoal::ps::EmbeddingOptions(kRows, kDim)
                                                          .init(shoal::ps::RowInit::normal(0, 0.5))
                                                          .seed(kSeed)));
    hidden = register_module("hidden", torch::nn::Linear(kIdsPerSample * kDim + kFeatures, 5));
    out = register_module("out", torch::nn::Linear(5, 1));
    if (wide_width() > 0)
      wide = register_module("wide",
                             torch::nn::Linear(kIdsPerSample * kDim + kFeatures, wide_width()));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& x) {
    return head(table->forward(ids), x);
  }
  torch::Tensor head(const torch::Tensor& rows, const torch::Tensor& x) {
    const torch::Tensor input = torch::cat({rows.flatten(1), x}, 1);
    torch::Tensor y = out->forward(torch::tanh(hidden->forward(input)));
    if (wide) y = y + torch::tanh(wide->forward(input)).mean(1, /*keepdim=*/true);
    return y;
  }
  shoal::ps::Embedding table{nullptr};
  torch::nn::Linear hidden{nullptr}, out{nullptr}, wide{nullptr};
};
TORCH_MODULE(Net);

// PyTorch 1.13's SparseAdam (torch.optim._functional.sparse_adam) on rows that are each their
// own parameter, which LibTorch lacks: unlike Adam, it adds eps to sqrt(v) before the bias
// correction, folded into the step size.
class SparseAdamRows {
 public:
  SparseAdamRows(std::vector<torch::Tensor> rows, double lr) : rows_(std::move(rows)), lr_(lr) {
    for (const auto& row : rows_)
      state_.push_back({torch::zeros_like(row), torch::zeros_like(row), 0});
  }
  void step() {
    torch::NoGradGuard no_grad;
    const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
    for (size_t i = 0; i < rows_.size(); ++i) {
      if (!rows_[i].grad().defined()) continue;
      State& s = state_[i];
      const torch::Tensor g = rows_[i].grad();
      ++s.step;
      s.m.add_((g - s.m).mul_(1 - beta1));
      s.v.add_((g * g - s.v).mul_(1 - beta2));
      const double step_size =
          lr_ * std::sqrt(1 - std::pow(beta2, s.step)) / (1 - std::pow(beta1, s.step));
      rows_[i].add_(s.m / (s.v.sqrt() + eps), -step_size);
    }
  }

 private:
  struct State {
    torch::Tensor m, v;
    int64_t step;
  };
  std::vector<torch::Tensor> rows_;
  double lr_;
  std::vector<State> state_;
};

// The reference's optimizer: each table row its own parameter, so that torch::optim keeps a
// state per row and skips rows without a gradient, as the servers' lazy row-wise rules do
// (SGD, Adagrad: their sparse rules are the dense ones on the touched rows).
std::unique_ptr<torch::optim::Optimizer> make(const std::string& kind,
                                              const std::vector<torch::Tensor>& parameters) {
  if (kind == "sgd")
    return std::make_unique<torch::optim::SGD>(parameters,
                                               torch::optim::SGDOptions(0.1).momentum(0.9));
  if (kind == "adagrad")
    return std::make_unique<torch::optim::Adagrad>(parameters, torch::optim::AdagradOptions(0.1));
  return std::make_unique<torch::optim::Adam>(parameters, torch::optim::AdamOptions(0.05));
}

double relative_error(const torch::Tensor& got, const torch::Tensor& expected) {
  return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item<double>();
}


// The table's initial rows (a pure function of seed, table and id), for the reference.
std::vector<torch::Tensor> initial_rows() {
  shoal::ps::detail::TableSpec spec;
  spec.name = "table";
  spec.sparse = true;
  spec.shape = {kRows, kDim};
  spec.init = {shoal::ps::detail::InitSpec::Kind::kNormal, 0, 0.5};
  spec.seed = kSeed;
  std::vector<torch::Tensor> initial;
  for (int64_t id = 0; id < kRows; ++id) {
    initial.push_back(torch::empty({kDim}));
    shoal::ps::detail::initial_row(spec, id, initial.back().data_ptr<float>(), kDim);
  }
  return initial;
}

// The reference's forward and backward on `b`: its rows picked from `rows`, each its own parameter.
void reference_backward(Net& first, const std::vector<torch::Tensor>& rows, const Batch& b) {
  std::vector<torch::Tensor> picked;
  for (int64_t i = 0; i < b.ids.size(0); ++i)
    for (int64_t j = 0; j < kIdsPerSample; ++j) picked.push_back(rows[b.ids[i][j].item<int64_t>()]);
  const auto looked_up = torch::stack(picked).view({b.ids.size(0), kIdsPerSample, kDim});
  torch::mse_loss(first->head(looked_up, b.x), b.y).backward();
}

// Whether the servers' values (pulled into `net`) equal the reference's within 1e-5 (relative),
// rows from `untouched` on bit-identical to their initial values; else says what differs.
bool equals_reference(Net& net, Net& first, const std::vector<torch::Tensor>& rows,
                      const std::vector<torch::Tensor>& initial, int64_t untouched = kRows) {
  const auto dense = net->named_parameters();
  for (const auto& p : first->named_parameters()) {
    const double error = relative_error(dense[p.key()], p.value());
    if (!(error < 1e-5)) {
      std::cout << "parameter " << p.key() << " off by " << error << " (relative)" << std::endl;
      return false;
    }
  }
  torch::NoGradGuard no_grad;
  const auto held = net->table->forward(torch::arange(kRows, torch::kLong));
  for (int64_t id = 0; id < kRows; ++id) {
    const bool equal = id >= untouched ? torch::equal(held[id], initial[id])
                                       : relative_error(held[id], rows[id]) < 1e-5;
    if (!equal) {
      std::cout << "row " << id << " is " << held[id] << ", expected " << rows[id] << std::endl;
      return false;
    }
  }
  return true;
}

// ---- leased batches (ps::Optimizer::train_on; docs/ps.md, "Leased batches") ----

constexpr int64_t kSamples = 50, kLeasedBatch = 4;  // 13 batches, the last of 2 samples

// The features of data set samples `ids`: sample i is batch(0, i, i + 1).
Batch samples(const torch::Tensor& ids) {
  Batch out{torch::empty({ids.size(0), kIdsPerSample}, torch::kLong),
            torch::empty({ids.size(0), kFeatures}), torch::empty({ids.size(0), 1})};
  for (int64_t k = 0; k < ids.size(0); ++k) {
    const int64_t i = ids[k].item<int64_t>();
    const Batch one = batch(0, i, i + 1);
    out.ids[k] = one.ids[0];
    out.x[k] = one.x[0];
    out.y[k] = one.y[0];
  }
  return out;
}

// The data set of sample ids 0..kSamples-1 in shuffled batches of kLeasedBatch, for train_on.
auto leased_loader() {
  shoal::data::LoaderOptions options;
  options.batch_size = kLeasedBatch;
  options.per_worker = true;
  options.shuffle = true;
  return shoal::data::make_loader(
      torch::data::datasets::TensorDataset(torch::arange(kSamples).view({kSamples, 1})), options);
}

// Whether `seen` (per epoch, per sample: the times it was trained) holds one everywhere; else
// says where not.
bool each_sample_once(const std::vector<std::vector<int>>& seen) {
  for (size_t epoch = 0; epoch < seen.size(); ++epoch)
    for (size_t id = 0; id < seen[epoch].size(); ++id)
      if (seen[epoch][id] != 1) {
        std::cout << "epoch " << epoch << " trained sample " << id << " " << seen[epoch][id]
                  << " times; expected once" << std::endl;
        return false;
      }
  return true;
}

// The one-process reference of leased batches: from worker 0's initial values (`first`, and the
// table's initial rows into `rows`), each step's batches (step clock -> samples) trained together
// with torch::optim, in clock order.
void train_reference(Net& first, std::vector<torch::Tensor>& rows,
                     const std::map<int64_t, std::vector<int64_t>>& steps) {
  rows.clear();
  for (const auto& row : initial_rows()) rows.push_back(row.clone().requires_grad_(true));
  std::vector<torch::Tensor> parameters = first->parameters();
  parameters.insert(parameters.end(), rows.begin(), rows.end());
  auto reference = make("sgd", parameters);
  for (const auto& [clock, ids] : steps) {
    for (auto& p : parameters) p.mutable_grad() = torch::Tensor();
    reference_backward(first, rows, samples(torch::tensor(ids, torch::kLong)));
    reference->step();
  }
}

// Every worker trains EPOCHS epochs of a loader whose batches it leases, and writes each step it
// trained a batch in to DIR/worker-R: "epoch clock id id ...". Worker 1 is slowed (async shows
// the others taking more batches). Then worker 0 reads every worker's lines and checks that each
// epoch trained every sample once; in sync, also that the servers' values equal one process
// training each step's batches together with torch::optim. Prints "ps leased ok".
int leased(const std::string& mode, int epochs, const std::string& dir) {
  shoal::init();
  torch::manual_seed(shoal::rank());
  Net net;
  shoal::ps::Optimizer optimizer(*net, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(0);
  Net first;  // worker 0's initial values, which every worker now holds
  const int64_t rank = shoal::rank();
  auto loader = leased_loader();
  optimizer.train_on(loader);
  {
    std::ofstream log(dir + "/worker-" + std::to_string(rank));
    for (int64_t epoch = 0; epoch < epochs; ++epoch) {
      for (auto& b : loader.epoch(epoch)) {
        const auto ids = b.data.reshape({-1});
        const Batch in = samples(ids);
        optimizer.zero_grad();
        torch::mse_loss(net->forward(in.ids, in.x), in.y).backward();  // NaN when idle: not pushed
        const int64_t clock = optimizer.steps();
        optimizer.step();
        if (ids.size(0) == 0) continue;
        log << epoch << " " << clock;
        for (int64_t k = 0; k < ids.size(0); ++k) log << " " << ids[k].item<int64_t>();
        log << "\n";
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  shoal::world().barrier();
  if (!shoal::is_main()) return 0;

  // step clock -> the samples of every worker's batch in it, in worker order
  std::map<int64_t, std::vector<int64_t>> steps;
  std::vector<std::vector<int>> seen(static_cast<size_t>(epochs), std::vector<int>(kSamples, 0));
  std::string counts;
  for (int r = 0; r < shoal::world_size(); ++r) {
    std::ifstream log(dir + "/worker-" + std::to_string(r));
    std::string line;
    int lines = 0;
    while (std::getline(log, line)) {
      std::istringstream fields(line);
      int64_t epoch = 0, clock = 0, id = 0;
      fields >> epoch >> clock;
      while (fields >> id) {
        ++seen.at(static_cast<size_t>(epoch)).at(static_cast<size_t>(id));
        steps[clock].push_back(id);
      }
      ++lines;
    }
    counts += (r == 0 ? "" : ", ") + std::to_string(lines);
  }
  if (!each_sample_once(seen)) return 1;
  if (mode == "sync") {
    std::vector<torch::Tensor> rows;
    train_reference(first, rows, steps);
    if (!equals_reference(net, first, rows, initial_rows())) return 1;
  }
  std::cout << "ps leased ok: " << mode << ", " << shoal::world_size() << " workers, " << epochs
            << " epochs of " << kSamples << " samples, " << steps.size()
            << " steps with a batch; batches per worker " << counts << std::endl;
  return 0;
}

// ---- elastic workers (shoal run --servers S --min A --max B; docs/ps.md, "Elastic workers") ----

// Every worker trains epochs of leased batches until DIR/stop exists (looked for before each
// epoch, so that every epoch begun is finished), writing to DIR/log-<pid> "s CLOCK" (the clock it
// joined at), then "t EPOCH CLOCK id id ..." before each step with a batch and "c CLOCK" once
// that step returned: its push then was sealed on every server, so it counts whatever happens
// next. Each step sleeps 10 ms before step() and 10 ms after, so that a worker killed between
// its "t" and "c" lines died before its push (the batch is leased again) or after it (it counts)
// about as often. At the end it
// writes DIR/final-<pid>: its clock, then the values it pulled last (dense parameters in
// named_parameters' order, then every row of the table).
//
// With `backup` (shoal run --ps-backup-workers): three epochs, worker 1 slowed by 40 ms a step so
// that its pushes come late and are dropped, and no "c" lines (a step that returned may have been
// dropped): the check takes each batch's last step as the one that counts.
int elastic(const std::string& dir, bool backup) {
  shoal::init();
  torch::manual_seed(shoal::rank());  // the first worker's (rank 0, id 0) values win
  Net net;
  shoal::ps::Optimizer optimizer(*net, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto loader = leased_loader();
  optimizer.train_on(loader);
  const std::string me = std::to_string(::getpid());
  std::ofstream log(dir + "/log-" + me);
  log << "s " << optimizer.steps() << std::endl;
  const int64_t epochs = backup ? 3 : 1000;
  for (int64_t epoch = 0; epoch < epochs && !std::filesystem::exists(dir + "/stop"); ++epoch) {
    for (auto& b : loader.epoch(epoch)) {
      const auto ids = b.data.reshape({-1});
      const Batch in = samples(ids);
      optimizer.zero_grad();
      torch::mse_loss(net->forward(in.ids, in.x), in.y).backward();  // NaN when idle: not pushed
      const int64_t clock = optimizer.steps();
      if (ids.size(0) > 0) {
        log << "t " << epoch << " " << clock;
        for (int64_t k = 0; k < ids.size(0); ++k) log << " " << ids[k].item<int64_t>();
        log << std::endl;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(backup && shoal::rank() == 1 ? 50 : 10));
      optimizer.step();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (ids.size(0) > 0 && !backup) log << "c " << clock << std::endl;
    }
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor rows = net->table->forward(torch::arange(kRows, torch::kLong));
  {
    std::ofstream final(dir + "/final-" + me + ".tmp");
    final << optimizer.steps() << "\n" << std::setprecision(10);
    for (const auto& p : net->named_parameters()) {
      const auto values = p.value().reshape({-1});
      for (int64_t i = 0; i < values.numel(); ++i) final << values[i].item<float>() << " ";
      final << "\n";
    }
    const auto flat = rows.reshape({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) final << flat[i].item<float>() << " ";
    final << "\n";
  }
  std::filesystem::rename(dir + "/final-" + me + ".tmp", dir + "/final-" + me);
  return 0;
}

// Reads the logs of an elastic run in DIR and checks that every epoch trained each sample
// exactly once in the steps that count: a step confirmed by its worker ("c"), or the last step
// of a worker that died, unless its batch was leased again (its push was dropped; the same
// samples then appear in a later step). Without "c" lines (backup workers), the last step of each
// batch counts: a dropped push's batch goes back and is leased again, at a later step. A batch counted twice, or a sample missing, fails. In
// sync it also checks that the servers' values (the final file of the highest clock) equal one
// process training each step's counted batches together with torch::optim. Prints "ps elastic
// ok: ..." and exits 0, or says what differed and exits 1.
int elastic_check(const std::string& dir, const std::string& mode) {
  struct Step {
    int64_t epoch = 0, clock = 0;
    std::vector<int64_t> ids;
    bool confirmed = false;
  };
  std::vector<Step> all;
  int logs = 0;
  for (const auto& file : std::filesystem::directory_iterator(dir)) {
    if (file.path().filename().string().rfind("log-", 0) != 0) continue;
    ++logs;
    std::ifstream in(file.path());
    std::map<int64_t, size_t> by_clock;
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string kind;
      fields >> kind;
      if (kind == "t") {
        Step step;
        fields >> step.epoch >> step.clock;
        for (int64_t id; fields >> id;) step.ids.push_back(id);
        by_clock[step.clock] = all.size();
        all.push_back(step);
      } else if (kind == "c") {
        int64_t clock = -1;
        fields >> clock;
        all.at(by_clock.at(clock)).confirmed = true;
      }
    }
  }
  // Steps by batch (epoch and its samples): which of them counts.
  std::map<std::pair<int64_t, std::vector<int64_t>>, std::vector<size_t>> batches;
  for (size_t i = 0; i < all.size(); ++i) {
    std::vector<int64_t> key = all[i].ids;
    std::sort(key.begin(), key.end());
    batches[{all[i].epoch, key}].push_back(i);
  }
  std::vector<const Step*> counted;
  int64_t unconfirmed = 0, dropped = 0, epochs = 0;
  for (const auto& [key, steps] : batches) {
    const Step* count = nullptr;
    int confirmed = 0;
    for (size_t i : steps) confirmed += all[i].confirmed ? 1 : 0;
    if (confirmed > 1) {
      std::cout << "a batch of epoch " << key.first << " was trained in " << confirmed
                << " confirmed steps; expected one" << std::endl;
      return 1;
    }
    for (size_t i : steps) {
      const Step& step = all[i];
      if (step.confirmed || (confirmed == 0 && (!count || step.clock > count->clock))) count = &step;
    }
    unconfirmed += confirmed == 0 ? 1 : 0;
    dropped += static_cast<int64_t>(steps.size()) - 1;
    counted.push_back(count);
    epochs = std::max(epochs, key.first + 1);
  }
  std::vector<std::vector<int>> seen(static_cast<size_t>(epochs), std::vector<int>(kSamples, 0));
  for (const Step* step : counted)
    for (int64_t id : step->ids) ++seen.at(static_cast<size_t>(step->epoch)).at(static_cast<size_t>(id));
  if (!each_sample_once(seen)) return 1;
  if (mode == "sync") {
    // The values the last worker pulled.
    int64_t last = -1;
    std::vector<std::vector<float>> held;
    for (const auto& file : std::filesystem::directory_iterator(dir)) {
      const std::string name = file.path().filename().string();
      if (name.rfind("final-", 0) != 0 || name.find(".tmp") != std::string::npos) continue;
      std::ifstream in(file.path());
      int64_t clock = -1;
      in >> clock;
      if (clock <= last) continue;
      last = clock;
      held.clear();
      std::string line;
      std::getline(in, line);
      while (std::getline(in, line)) {
        std::istringstream values(line);
        held.emplace_back();
        for (float v; values >> v;) held.back().push_back(v);
      }
    }
    std::map<int64_t, std::vector<int64_t>> steps;
    for (const Step* step : counted)
      steps[step->clock].insert(steps[step->clock].end(), step->ids.begin(), step->ids.end());
    torch::manual_seed(0);
    Net first;  // worker 0's initial values, which the servers started from
    const auto named = first->named_parameters();
    if (held.size() != named.size() + 1) {
      std::cout << "no final values of the last worker in " << dir << std::endl;
      return 1;
    }
    std::vector<torch::Tensor> rows;
    train_reference(first, rows, steps);
    size_t at = 0;
    for (const auto& p : named) {
      const auto got = torch::tensor(held[at++]).view(p.value().sizes());
      const double error = relative_error(got, p.value());
      if (!(error < 1e-5)) {
        std::cout << "parameter " << p.key() << " off by " << error << " (relative)" << std::endl;
        return 1;
      }
    }
    const auto got = torch::tensor(held[at]).view({kRows, kDim});
    const auto expected = torch::stack(rows).detach();
    if (!(relative_error(got, expected) < 1e-5)) {
      std::cout << "the table's rows off by " << relative_error(got, expected) << " (relative)"
                << std::endl;
      return 1;
    }
  }
  std::cout << "ps elastic ok: " << mode << ", " << logs << " workers, " << epochs
            << " epochs of " << kSamples << " samples, " << counted.size() << " batches counted, "
            << unconfirmed << " of them unconfirmed, " << dropped << " dropped" << std::endl;
  return 0;
}

}  // namespace

// The mode the program asks for (ps::ServerOptions::mode), as a test sets it: PS_TRAIN_OPTION_MODE
// is a comma-separated list whose entry at this worker's rank (or its last) is this worker's.
shoal::ps::ServerOptions server_options() {
  shoal::ps::ServerOptions options;
  const char* modes = std::getenv("PS_TRAIN_OPTION_MODE");
  if (modes == nullptr) return options;
  std::vector<std::string> list;
  std::stringstream in(modes);
  for (std::string mode; std::getline(in, mode, ',');) list.push_back(mode);
  if (!list.empty())
    options.mode = list[std::min<size_t>(static_cast<size_t>(shoal::rank()), list.size() - 1)];
  return options;
}

// Mode noise: the gradient noise measured through the servers (Note [The gradient noise on
// servers], src/ps/server_sum.cpp) on tests/noise_problem.h's problem, with nothing trained (lr 0:
// w stays). After each step every worker's measurement equals the one-process estimate of all
// workers' samples (smoothing 0: each step's own), and over all steps the closed form. w's first
// half is a dense parameter, its second row 0 of a ps::Embedding, so that a push's dense values
// and its sparse rows both count; with three servers one may hold neither.
struct NoiseNetImpl : torch::nn::Module {
  explicit NoiseNetImpl(const torch::Tensor& head) {
    dense = register_parameter("dense", head.clone());
    table = register_module(
        "table",
        shoal::ps::Embedding(
            shoal::ps::EmbeddingOptions(1, head.numel()).init(shoal::ps::RowInit::zeros())));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor w =
        torch::cat({dense, table(torch::zeros({1}, torch::kLong)).reshape({-1})});
    return x.matmul(w);
  }
  torch::Tensor dense;
  shoal::ps::Embedding table{nullptr};
};
TORCH_MODULE(NoiseNet);

int noise(int steps) {
  namespace noise = shoal::testing::noise;
  shoal::init();
  const int n = shoal::world_size();
  const noise::Problem p = noise::problem(noise::kDim / 2);
  NoiseNet net(p.w.narrow(0, 0, noise::kDim / 2).to(torch::kFloat));
  shoal::ps::ServerOptions options = server_options();
  options.measure_gradient_noise = true;
  options.gradient_noise_smoothing = 0.0;
  options.batch_size = noise::kPerWorker;
  shoal::ps::Optimizer optimizer(*net, torch::optim::SGDOptions(0.0), options);
  std::vector<double> sqrs, variances;
  for (int t = 0; t < steps; ++t) {
    std::vector<torch::Tensor> means;
    for (int worker = 0; worker < n; ++worker)
      means.push_back(noise::gradient(p, noise::samples(p, t, worker)));
    const auto [x, y] = noise::samples(p, t, shoal::rank());
    optimizer.zero_grad();
    (0.5 * (net->forward(x.to(torch::kFloat)) - y.to(torch::kFloat)).pow(2).mean()).backward();
    optimizer.step();
    const auto measured = optimizer.gradient_noise();
    const noise::Estimate oracle = noise::estimate(means);
    const double scale = std::abs(oracle.sqr) + oracle.variance / noise::kPerWorker;
    if (!measured || measured->measurements != t + 1 || measured->batch != n * noise::kPerWorker ||
        std::abs(measured->gradient_sqr - oracle.sqr) > 1e-4 * scale ||
        std::abs(measured->variance - oracle.variance) > 1e-4 * scale * noise::kPerWorker * n) {
      std::cout << "step " << t << ": measured "
                << (measured ? std::to_string(measured->measurements) + " steps, batch " +
                                   std::to_string(measured->batch) + ", |G|^2 " +
                                   std::to_string(measured->gradient_sqr) + ", tr(Sigma) " +
                                   std::to_string(measured->variance)
                             : std::string("nothing"))
                << "; expected " << t + 1 << " steps, batch " << n * noise::kPerWorker << ", |G|^2 "
                << oracle.sqr << ", tr(Sigma) " << oracle.variance << std::endl;
      return 1;
    }
    sqrs.push_back(measured->gradient_sqr);
    variances.push_back(measured->variance);
  }
  // Enough steps that the comparison can tell (a standard error under 5% of the value), and the
  // means within four standard errors of the closed form.
  const noise::Standard sqr = noise::standard(sqrs), variance = noise::standard(variances);
  if (sqr.error > 0.05 * noise::kTrueSqr || variance.error > 0.05 * noise::kTrueVariance ||
      std::abs(sqr.mean - noise::kTrueSqr) > 4 * sqr.error ||
      std::abs(variance.mean - noise::kTrueVariance) > 4 * variance.error) {
    std::cout << "closed form missed: |G|^2 " << sqr.mean << " +- " << sqr.error << " (expected "
              << noise::kTrueSqr << "), tr(Sigma) " << variance.mean << " +- " << variance.error
              << " (expected " << noise::kTrueVariance << ")" << std::endl;
    return 1;
  }
  std::cout << "ps noise ok: " << n << " workers, |G|^2 " << sqr.mean << " +- " << sqr.error
            << ", tr(Sigma) " << variance.mean << " +- " << variance.error << std::endl;
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && (std::string(argv[1]) == "elastic" || std::string(argv[1]) == "backup")) {
    try {
      return elastic(argv[2], std::string(argv[1]) == "backup");
    } catch (const std::exception& e) {
      std::cout << "error: " << e.what() << std::endl;
      return 1;
    }
  }
  if (argc == 4 && std::string(argv[1]) == "elastic-check") {
    try {
      return elastic_check(argv[2], argv[3]);
    } catch (const std::exception& e) {
      std::cout << "error: " << e.what() << std::endl;
      return 1;
    }
  }
  if (argc == 3 && std::string(argv[1]) == "noise") {
    try {
      return noise(std::atoi(argv[2]));
    } catch (const std::exception& e) {
      std::cout << "error: " << e.what() << std::endl;
      return 1;
    }
  }
  if (argc > 1 && std::string(argv[1]) == "leased") {
    if (argc != 4) {
      std::cerr << "usage: ps_train leased EPOCHS DIR" << std::endl;
      return 2;
    }
    try {
      const std::string mode = std::getenv("SHOAL_PS_MODE") ? std::getenv("SHOAL_PS_MODE") : "sync";
      return leased(mode, std::atoi(argv[2]), argv[3]);
    } catch (const std::exception& e) {
      std::cout << "error: " << e.what() << std::endl;
      return 1;
    }
  }
  const std::string kind = argc > 1 ? argv[1] : "";
  const int kSteps = argc > 2 ? std::atoi(argv[2]) : 5;
  if (kind != "sgd" && kind != "adagrad" && kind != "adam") {
    std::cerr << "usage: ps_train sgd|adagrad|adam" << std::endl;
    return 2;
  }
  try {
    shoal::init();
    torch::manual_seed(shoal::rank());  // the workers' dense values differ; worker 0's must win
    Net net;
    std::unique_ptr<shoal::ps::Optimizer> optimizer;
    if (kind == "sgd")
      optimizer = std::make_unique<shoal::ps::Optimizer>(
          *net, torch::optim::SGDOptions(0.1).momentum(0.9), server_options());
    else if (kind == "adagrad")
      optimizer = std::make_unique<shoal::ps::Optimizer>(*net, torch::optim::AdagradOptions(0.1),
                                                         server_options());
    else
      optimizer = std::make_unique<shoal::ps::Optimizer>(*net, torch::optim::AdamOptions(0.05),
                                                         server_options());
    // The reference starts from worker 0's dense values, which every worker now holds.
    torch::manual_seed(0);
    Net first;
    const auto dense = net->named_parameters();
    for (const auto& p : first->named_parameters()) {
      const double error = relative_error(dense[p.key()], p.value());
      if (error != 0) {
        std::cout << "parameter " << p.key() << " does not start from worker 0's values (off by "
                  << error << ")" << std::endl;
        return 1;
      }
    }

    const int64_t rank = shoal::rank(), workers = shoal::world_size();
    for (int t = 0; t < kSteps; ++t) {
      const Batch b = batch(t, kBatch * rank / workers, kBatch * (rank + 1) / workers);
      optimizer->zero_grad();
      torch::mse_loss(net->forward(b.ids, b.x), b.y).backward();
      optimizer->step();
    }
    if (!shoal::is_main()) return 0;

    // The one-process reference on the whole batches.
    const std::vector<torch::Tensor> initial = initial_rows();
    std::vector<torch::Tensor> rows;
    for (const auto& row : initial) rows.push_back(row.clone().requires_grad_(true));
    std::vector<torch::Tensor> parameters = first->parameters();
    parameters.insert(parameters.end(), rows.begin(), rows.end());
    auto reference = make(kind, kind == "adam" ? first->parameters() : parameters);
    SparseAdamRows sparse_adam(rows, 0.05);
    for (int t = 0; t < kSteps; ++t) {
      for (auto& p : parameters) p.mutable_grad() = torch::Tensor();  // untouched rows: no grad
      reference_backward(first, rows, batch(t, 0, kBatch));
      reference->step();
      if (kind == "adam") sparse_adam.step();
    }
    // Rows 48.. are in no batch: bit-identical to their initial values.
    if (!equals_reference(net, first, rows, initial, 48)) return 1;
    std::cout << "ps train ok: " << kind << ", " << workers << " workers, " << kSteps
              << " sync steps, " << shared_segments() << " shared segments" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
    return 1;
  }
}
