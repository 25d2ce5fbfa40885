// OneFlow's data-parallel matmul on global tensors: x split by rows, w whole on every worker;
// each worker multiplies its rows, and y comes out split by rows. No communication.
//   build/bin/shoal run -n 2 build/examples/global_data_parallel
#include <iomanip>
#include <iostream>

#include <shoal/global/ops.h>
#include <shoal/shoal.h>

namespace g = shoal::global;

int main() {
  shoal::init();
  torch::manual_seed(0);
  const auto all = g::Placement::all();
  const auto x = g::randn({4, 5}, all, g::split(0));
  const auto w = g::randn({5, 8}, all, g::broadcast());
  const auto y = g::matmul(x, w);
  const torch::Tensor whole = y.full();
  if (shoal::is_main())
    std::cout << y.describe() << "\n" << std::setprecision(6) << whole << std::endl;
}
