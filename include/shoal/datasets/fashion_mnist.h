// Fashion-MNIST (and MNIST) in the IDX format, gzip-compressed, as Debian's
// dataset-fashion-mnist installs it under /usr/share/datasets/fashion-mnist.
//
// One of shoal's demo datasets (shoal/datasets/), the data of its examples, tests and benchmarks:
// not part of the library's API (shoal/shoal.h does not include them), and in a library of their
// own, shoal::datasets (libshoal_datasets), which a program links when it uses them.
#pragma once

#include <string>

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

namespace shoal::datasets {

inline constexpr const char* kFashionMnistRoot = "/usr/share/datasets/fashion-mnist";

class FashionMnist : public torch::data::datasets::Dataset<FashionMnist> {
 public:
  enum class Split { kTrain, kTest };

  // Reads {train,t10k}-images-idx3-ubyte.gz and the matching labels from `root`. Images become
  // float32 [N, 1, 28, 28] scaled to [0, 1], labels int64 [N]. A missing, truncated or malformed
  // file raises UsageError naming the file and what was expected.
  explicit FashionMnist(const std::string& root = kFashionMnistRoot, Split split = Split::kTrain);

  // The first `count` images and labels (all of them when there are fewer).
  FashionMnist head(int64_t count) const;

  torch::data::Example<> get(size_t index) override;
  torch::optional<size_t> size() const override;

  const torch::Tensor& images() const { return images_; }
  const torch::Tensor& labels() const { return labels_; }

 private:
  FashionMnist(torch::Tensor images, torch::Tensor labels) : images_(std::move(images)), labels_(std::move(labels)) {}
  torch::Tensor images_;
  torch::Tensor labels_;
};

// Reads one gzip-compressed IDX file of unsigned bytes with `dims` dimensions; the result has
// the file's shape, dtype uint8.
torch::Tensor read_idx_gz(const std::string& path, int dims);

}  // namespace shoal::datasets
