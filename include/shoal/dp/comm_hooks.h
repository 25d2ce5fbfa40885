// Communication hooks: how DataParallel turns one bucket of local gradients into their average.
#pragma once

#include <functional>

#include <ATen/ATen.h>

#include "shoal/comm/group.h"
#include "shoal/comm/work.h"

namespace shoal::dp {

// Starts the averaging of `bucket` (a flat tensor of gradients) over `group` and returns its
// Work; when that Work's wait() returns, `bucket` must hold the average. Called on every worker
// for the same buckets in the same order.
using CommHook = std::function<comm::Work(comm::Group& group, at::Tensor& bucket)>;

// The default: an all-reduce (average) in the gradients' own dtype.
CommHook allreduce_hook();

// Sends the bucket as float16 (half the bytes of float32), sums each member's part in the
// bucket's dtype, and writes the average back rounded to float16, the same on every member.
// PyTorch's fp16_compress_hook. Its messages use point-to-point tags from 1 << 24 up.
CommHook fp16_compress_hook();

// The same with bfloat16: float32's range, 8 bits of mantissa.
CommHook bf16_compress_hook();

}  // namespace shoal::dp
