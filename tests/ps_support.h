// What the parameter server's core tests share (ps_shard_test, ps_optimizer_test,
// ps_server_core_test): a closeness check for float vectors and the table specs they build.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ps/messages.h"

namespace shoal::testing {

using ps::detail::InitSpec;
using ps::detail::OptimizerSpec;
using ps::detail::TableSpec;

// |a - b| <= rel * max(|a|, |b|, rms(b)) element by element, the worst offender in the message.
// The RMS term: an element near zero is the difference of larger terms, whose float rounding
// (LibTorch fuses multiply-adds in its vectorized loops and not in their tails) is relative to
// those terms, not to the small result.
inline ::testing::AssertionResult near_relative(const std::vector<float>& a, const std::vector<float>& b,
                                                double rel) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes " << a.size() << " and " << b.size();
  double sum_sq = 0;
  for (float y : b) sum_sq += double(y) * y;
  const double rms = b.empty() ? 0 : std::sqrt(sum_sq / static_cast<double>(b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = b[i];
    if (!(std::abs(x - y) <= rel * std::max({std::abs(x), std::abs(y), rms})))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << x << " vs " << y << " (relative tolerance " << rel
             << ", rms " << rms << ")";
  }
  return ::testing::AssertionSuccess();
}

inline std::vector<float> to_vector(const torch::Tensor& t) {
  auto c = t.detach().contiguous().to(torch::kFloat).reshape({-1});
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

inline TableSpec sparse_spec(const std::string& name, int64_t rows, int64_t dim, InitSpec init,
                      OptimizerSpec optimizer = {}) {
  TableSpec spec;
  spec.name = name;
  spec.sparse = true;
  spec.shape = {rows, dim};
  spec.init = init;
  spec.optimizer = optimizer;
  spec.seed = 42;
  return spec;
}

inline TableSpec dense_spec(const std::string& name, std::vector<int64_t> shape, OptimizerSpec optimizer) {
  TableSpec spec;
  spec.name = name;
  spec.shape = std::move(shape);
  spec.optimizer = optimizer;
  return spec;
}

}  // namespace shoal::testing
