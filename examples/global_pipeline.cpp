// OneFlow's two-stage pipeline on global tensors: the first stage's matmul runs on the first
// worker, its output moves to the last worker's placement with to_global (a send and a receive),
// and the second stage's matmul runs there.
//   build/bin/shoal run -n 2 build/examples/global_pipeline
#include <iomanip>
#include <iostream>

#include <shoal/shoal.h>

#include "cli.h"

namespace g = shoal::global;

int main(int argc, char** argv) {
  CLI::App app{"OneFlow's two-stage pipeline on global tensors; run under `shoal run -n N`.",
               "global_pipeline"};
  if (const int code = examples::parse(app, argc, argv); code >= 0) return code;
  shoal::init();
  torch::manual_seed(0);
  const g::Placement first({0}), last({shoal::world_size() - 1});
  const auto x = g::randn({4, 5}, first, g::broadcast());
  const auto w0 = g::randn({5, 8}, first, g::broadcast());
  const auto y0 = g::matmul(x, w0);  // stage 1, on the first worker
  const auto w1 = g::randn({8, 3}, last, g::broadcast());
  const auto z = g::matmul(y0.to_global(last, g::broadcast()), w1);  // stage 2, on the last
  const torch::Tensor whole = z.full();
  if (shoal::is_main())
    std::cout << z.describe() << "\n" << std::setprecision(6) << whole << std::endl;
}
