#include "shoal/dp/comm_hooks.h"

namespace shoal::dp {
namespace {

// Gloo in Debian's LibTorch reduces no 16-bit floats ("Invalid scalar type"), so compression
// moves the 16-bit values as bytes and adds them up locally: an all-to-all gives each worker
// every worker's copy of its part (a reduce-scatter's traffic), the part is summed in the
// bucket's own precision, and an all-gather returns the averaged parts (an all-gather's
// traffic). Together that is a ring all-reduce's traffic, at 16 bits a value.
CommHook compress_hook(at::ScalarType wire) {
  return [wire](comm::Group& group, at::Tensor& bucket) {
    const int n = group.size();
    const int64_t count = bucket.numel();
    const auto parts = comm::split_sizes(count, n);
    const int64_t mine = parts[group.rank()];
    auto as_rows = [](const at::Tensor& t) { return t.view(at::kByte).view({-1, 2}); };

    comm::AllToAllOptions exchange;
    exchange.send_sizes = parts;
    exchange.recv_sizes.assign(n, mine);
    auto work = group.all_to_all_async(as_rows(bucket.to(wire)), exchange);
    work.then([&group, bucket, parts, mine, n, wire, as_rows](const at::Tensor& received) mutable {
      auto copies = received.view({-1}).view(wire).to(bucket.scalar_type()).view({n, mine});
      auto averaged = copies.sum(0).div_(n).to(wire);
      comm::AllGatherOptions gather;
      gather.sizes = parts;
      auto whole = group.all_gather(as_rows(averaged), gather);
      bucket.copy_(whole.view({-1}).view(wire));
    });
    return work;
  };
}

}  // namespace

CommHook allreduce_hook() {
  return [](comm::Group& group, at::Tensor& bucket) {
    return group.all_reduce_async(bucket, {comm::ReduceOp::kAvg});
  };
}

CommHook fp16_compress_hook() { return compress_hook(at::kHalf); }
CommHook bf16_compress_hook() { return compress_hook(at::kBFloat16); }

}  // namespace shoal::dp
