// A reduce-scatter whose parts travel in 16 bits and are summed in the bucket's precision: ZeRO's
// buckets under DataParallelOptions::mixed_precision.reduce (the same exchange as
// fp16_compress_hook's and bf16_compress_hook's first phase, src/dp/comm_hooks.cpp). Internal
// to shoal: the Reducer holds one.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/ATen.h>

#include "shoal/comm/group.h"
#include "shoal/comm/work.h"

namespace shoal::dp {

class CompressedScatter {
 public:
  // `wire`: at::kBFloat16 or at::kHalf.
  explicit CompressedScatter(at::ScalarType wire);

  // Starts the average of `bucket` over `group`, cut into `parts` (one per member, in member
  // order). This member's part of the average, in the bucket's dtype, is `result` once `work`
  // is waited for; with result null, work.result() (a group of one, where nothing travels).
  // Called on every member for the same buckets in the same order.
  struct Started {
    comm::Work work;
    std::shared_ptr<at::Tensor> result;
  };
  Started start(comm::Group& group, const at::Tensor& bucket, const comm::Sizes& parts);

 private:
  at::ScalarType wire_;
  int64_t calls_ = 0;  // tags the exchanges' messages, as a hook's calls
};

}  // namespace shoal::dp
