// docs/getting-started.md's two programs: examples/getting_started/plain.cpp, a plain LibTorch
// program, and distributed.cpp, the same made data parallel. The change stays as small as the
// page says, and the distributed program on 3 workers (64 samples a batch cut 22, 21, 21; the
// last batch of 32 cut 11, 11, 10) ends with the parameters it reaches as one process.
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoal_run.h"
#include "test_paths.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// The programs' model.
struct Net : torch::nn::Module {
  Net() : fc1(register_module("fc1", torch::nn::Linear(784, 64))), fc2(register_module("fc2", torch::nn::Linear(64, 10))) {}
  torch::nn::Linear fc1, fc2;
};

// The code lines of a file: its leading comment block (which says what the file is) left out.
std::vector<std::string> code_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  std::string line;
  bool header = true;
  while (std::getline(in, line)) {
    if (header && (line.rfind("//", 0) == 0 || line.rfind("#", 0) == 0) && line.rfind("#include", 0) != 0) continue;
    header = false;
    lines.push_back(line);
  }
  return lines;
}

// Lines of `b` not in a longest common subsequence with `a`: what was added or changed.
size_t lines_not_kept(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  std::vector<std::vector<size_t>> common(a.size() + 1, std::vector<size_t>(b.size() + 1, 0));
  for (size_t i = a.size(); i-- > 0;) {
    for (size_t j = b.size(); j-- > 0;) {
      common[i][j] = a[i] == b[j] ? common[i + 1][j + 1] + 1 : std::max(common[i + 1][j], common[i][j + 1]);
    }
  }
  return b.size() - common[0][0];
}

TEST(GettingStartedChange, TheDistributedProgramAddsTwoLinesAndChangesTwo) {
  const auto plain = code_lines(examples_source_dir() + "/getting_started/plain.cpp");
  const auto distributed = code_lines(examples_source_dir() + "/getting_started/distributed.cpp");
  ASSERT_GT(plain.size(), 20u);
  EXPECT_EQ(distributed.size() - plain.size(), 2u) << "lines added";
  EXPECT_EQ(lines_not_kept(distributed, plain), 3u) << "lines of the plain program changed";
  EXPECT_EQ(lines_not_kept(plain, distributed), 5u) << "lines of the distributed program new or changed";
}

// What the same change takes with PyTorch's DDP (pytorch_plain.py to pytorch_ddp.py): the process
// group, the sampler and its set_epoch, the per-worker batch size, the wrapper's forward, a save
// on one rank, and the teardown.
TEST(GettingStartedChange, PyTorchDdpAddsNineLinesAndChangesThree) {
  const auto plain = code_lines(examples_source_dir() + "/getting_started/pytorch_plain.py");
  const auto ddp = code_lines(examples_source_dir() + "/getting_started/pytorch_ddp.py");
  ASSERT_GT(plain.size(), 20u);
  EXPECT_EQ(ddp.size() - plain.size(), 9u) << "lines added";
  EXPECT_EQ(lines_not_kept(ddp, plain), 3u) << "lines of the plain program changed";
  EXPECT_EQ(lines_not_kept(plain, ddp), 12u) << "lines of the DDP program new or changed";
}

class GettingStartedRun : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string source = "/usr/share/datasets/fashion-mnist";
    if (!fs::exists(source + "/train-images-idx3-ubyte.gz")) {
      GTEST_SKIP() << "Fashion-MNIST is not installed (scripts/setup.sh installs dataset-fashion-mnist)";
    }
    char pattern[] = "/tmp/shoal-getting-started-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    // torch's MNIST reader takes the IDX files uncompressed; Fashion-MNIST has MNIST's format.
    for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte"}) {
      const std::string command = "gunzip -c " + source + "/" + name + ".gz > " + dir_ + "/" + name;
      ASSERT_EQ(std::system(command.c_str()), 0) << command;
    }
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // The parameters of a model the programs saved, read into the programs' own Net.
  static std::vector<torch::Tensor> parameters(const std::string& file) {
    auto net = std::make_shared<Net>();
    torch::load(net, file);
    return net->parameters();
  }

  std::string dir_;
};

TEST_F(GettingStartedRun, ThreeWorkersEndWhereOneProcessEnds) {
  const std::string program = examples_dir() + "/getting_started_distributed";
  const RunResult one = run_shoal({"-n", "1", program, dir_, dir_ + "/one.pt", "1"}, 300s);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  const RunResult three = run_shoal({"-n", "3", program, dir_, dir_ + "/three.pt", "1"}, 300s);
  ASSERT_EQ(three.exit_code, 0) << three.out << three.err;
  const auto a = parameters(dir_ + "/one.pt"), b = parameters(dir_ + "/three.pt");
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
    scale = std::max(scale, a[i].abs().max().item<double>());
  }
  // 938 steps of SGD; only the order of summation differs.
  EXPECT_LT(diff / scale, 1e-4);
}

TEST_F(GettingStartedRun, ThePlainProgramRuns) {
  const RunResult plain = run_shoal({"-n", "1", examples_dir() + "/getting_started_plain", dir_, dir_ + "/plain.pt", "1"}, 300s);
  ASSERT_EQ(plain.exit_code, 0) << plain.out << plain.err;
  EXPECT_EQ(parameters(dir_ + "/plain.pt").size(), 4u);
}

// The PyTorch side of the comparison is a working program too: DDP under torchrun, one epoch.
TEST_F(GettingStartedRun, ThePyTorchDdpProgramRuns) {
  if (!fs::exists("/usr/lib/python3/dist-packages/torch/__init__.py")) {
    GTEST_SKIP() << "Debian's python3-torch is not installed (scripts/setup.sh installs it)";
  }
  // Debian 12's torchrun crashes at start on Python 3.11 unless its redirects are given.
  const std::string command = "cd " + examples_source_dir() + "/getting_started && timeout 300 /usr/bin/python3 -m "
                              "torch.distributed.run --redirects=2 --tee=2 --log_dir=" + dir_ + "/logs --nproc_per_node 2 "
                              "pytorch_ddp.py " + dir_ + " " + dir_ + "/ddp.pt 1 > " + dir_ + "/ddp.out 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  EXPECT_TRUE(fs::exists(dir_ + "/ddp.pt"));
}

}  // namespace
}  // namespace shoal::testing
