// How far apart two lists of tensors are: the largest absolute difference of any element over the
// largest magnitude in `expected`, the measure the DataParallel, ZeRO, precision and checkpoint
// tests hold against their one-process oracles.
#pragma once

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>

namespace shoal::testing {

inline double relative_difference(const std::vector<at::Tensor>& actual,
                                  const std::vector<at::Tensor>& expected) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    diff = std::max(diff, (actual[i] - expected[i]).abs().max().item<double>());
    scale = std::max(scale, expected[i].abs().max().item<double>());
  }
  return diff / scale;
}

}  // namespace shoal::testing
