// OneFlow's model-parallel matmul on global tensors: x whole on every worker, w split by
// columns; each worker computes its columns of y, which comes out split by columns.
//   build/bin/shoal run -n 2 build/examples/global_model_parallel
#include <iomanip>
#include <iostream>

#include <shoal/shoal.h>

#include "cli.h"

namespace g = shoal::global;

int main(int argc, char** argv) {
  CLI::App app{"OneFlow's model-parallel matmul on global tensors; run under `shoal run -n N`.",
               "global_model_parallel"};
  if (const int code = examples::parse(app, argc, argv); code >= 0) return code;
  shoal::init();
  torch::manual_seed(0);
  const auto all = g::Placement::all();
  const auto x = g::randn({4, 5}, all, g::broadcast());
  const auto w = g::randn({5, 8}, all, g::split(1));
  const auto y = g::matmul(x, w);
  const torch::Tensor whole = y.full();
  if (shoal::is_main())
    std::cout << y.describe() << "\n" << std::setprecision(6) << whole << std::endl;
}
