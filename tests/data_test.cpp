// The IDX reader: the real Fashion-MNIST files, and missing, malformed and truncated ones.
#include <zlib.h>

#include <filesystem>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "error_of.h"
#include "shoal/core/error.h"
#include "shoal/datasets/fashion_mnist.h"

namespace {

namespace fs = std::filesystem;

void write_gz(const fs::path& path, const std::vector<unsigned char>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  if (!bytes.empty()) gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(file);
}

using shoal::testing::error_of;

class IdxFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shoal-idx-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(IdxFiles, ReadsShapeAndValues) {
  // 2 images of 2x3, values 0..11.
  std::vector<unsigned char> bytes = {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3};
  for (int i = 0; i < 12; ++i) bytes.push_back(static_cast<unsigned char>(i));
  write_gz(dir_ / "x.gz", bytes);
  auto t = shoal::datasets::read_idx_gz((dir_ / "x.gz").string(), 3);
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 2, 3}));
  EXPECT_TRUE(torch::equal(t, torch::arange(12, torch::kUInt8).view({2, 2, 3})));
}

TEST_F(IdxFiles, MissingMalformedAndTruncatedFilesNameTheProblem) {
  const auto path = (dir_ / "x.gz").string();
  EXPECT_EQ(error_of([&] { shoal::datasets::read_idx_gz(path, 1); }).rfind(path + ": cannot open (", 0), 0u);

  write_gz(dir_ / "x.gz", {0, 0, 13, 1, 0, 0, 0, 1, 7});
  EXPECT_EQ(error_of([&] { shoal::datasets::read_idx_gz(path, 1); }),
            path + ": not an IDX file of unsigned bytes with 1 dimensions: magic 00000d01, expected 00000801");

  write_gz(dir_ / "x.gz", {0, 0, 8, 1, 0, 0, 0, 5, 1, 2});
  EXPECT_EQ(error_of([&] { shoal::datasets::read_idx_gz(path, 1); }),
            path + ": truncated or corrupt IDX file: expected 5 bytes of data, read 2");

  write_gz(dir_ / "x.gz", {0, 0});
  EXPECT_EQ(error_of([&] { shoal::datasets::read_idx_gz(path, 1); }),
            path + ": truncated or corrupt IDX file: expected 4 bytes of header, read 2");
}

TEST(FashionMnist, DebianCopyLoads) {
  shoal::datasets::FashionMnist test(shoal::datasets::kFashionMnistRoot, shoal::datasets::FashionMnist::Split::kTest);
  EXPECT_EQ(test.size().value(), 10000u);
  EXPECT_EQ(test.images().sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_GE(test.images().min().item<float>(), 0.0f);
  EXPECT_LE(test.images().max().item<float>(), 1.0f);
  // Ten classes, a thousand images each.
  EXPECT_TRUE(torch::equal(torch::bincount(test.labels()), torch::full({10}, 1000, torch::kInt64)));
}

}  // namespace
