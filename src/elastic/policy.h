// BatchPolicy::goodput()'s step times, the policies' learning rates and the batch chosen by goodput
// (State's members in policy.cpp). Private to src/elastic.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoal/dp/goodput.h"

namespace shoal::elastic {

// BatchPolicy::goodput()'s agreed step times: the mean seconds and the steps at each (world, batch
// per backward, backward passes); as a tensor of five numbers each, and back.
using StepTimes = std::map<std::tuple<int, int64_t, int>, std::pair<double, int64_t>>;
at::Tensor pack_step_times(const StepTimes& step_times);
StepTimes unpack_step_times(const at::Tensor& tensor);
std::vector<StepSample> samples_of(const StepTimes& step_times);

}  // namespace shoal::elastic
