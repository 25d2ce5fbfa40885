#include "shoal/dp/comm_hooks.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "dp/compressed_scatter.h"
#include "shoal/core/error.h"

namespace shoal::dp {
namespace {

// The compressed hooks' point-to-point messages use tags above what programs use: one block per
// call (the calls in flight at once are a DataParallel's buckets, far fewer than kCallSlots),
// per phase and per chunk.
constexpr int kTagBase = 1 << 24;
constexpr int kCallSlots = 4096;
constexpr int kMaxChunks = 16;
// Parts travel in chunks of about this size, all in flight together: one large message each way
// over a shaped link ran at half the link's rate, chunks near it (bench/RESULTS.md, "ddp"); and
// each chunk is summed and sent on as soon as it is in.
constexpr int64_t kChunkBytes = 256 * 1024;

int tag_of(int64_t call, int phase, int chunk) {
  return kTagBase + static_cast<int>(((call % kCallSlots) * 2 + phase) * kMaxChunks + chunk);
}

// How a part of `count` values is cut into chunks: the same on the sending and the receiving
// side, which both know the part's size.
comm::Sizes chunks_of(int64_t count, int64_t value_bytes) {
  const int64_t chunks = std::clamp<int64_t>((count * value_bytes + kChunkBytes - 1) / kChunkBytes, 1, kMaxChunks);
  return comm::split_sizes(count, static_cast<int>(chunks));
}

// One compressed average in flight: phase 1 sends each member its part of the bucket in 16 bits
// (a reduce-scatter's traffic); each member sums its own part in the bucket's precision as its
// chunks come in, and sends each averaged chunk, rounded to 16 bits, to every member at once
// (an all-gather's traffic). Together that is a ring all-reduce's traffic at 16 bits a value,
// with the summing overlapped with the transfers, and every member ends with the same values.
// Without `gather_back`, phase 1 alone: a reduce-scatter whose result is this member's averaged
// part in the bucket's precision (ZeRO's buckets under mixed precision).
struct Exchange {
  bool gather_back = true;
  at::Tensor result;  // without gather_back: this member's average, bucket's dtype
  comm::Group* group = nullptr;
  at::Tensor bucket;
  at::ScalarType wire;
  int64_t call = 0;
  int n = 0, me = 0;
  comm::Sizes parts;
  std::vector<int64_t> offsets;
  comm::Sizes my_chunks;          // chunks of this member's part
  at::Tensor copies;              // [n, my part]: row j is member j's copy of it, 16 bits
  at::Tensor average;             // this member's averaged part, 16 bits
  std::vector<at::Tensor> theirs; // member j's averaged part, 16 bits
  std::vector<comm::Work> works;  // every operation but the one whose wait() runs finish()
  std::vector<std::vector<size_t>> copy_in;  // [j][k]: where in works the receive of chunk k from j is
  std::vector<bool> waited;

  void post(size_t* index, bool send, const at::Tensor& values, int peer, int phase, int chunk) {
    comm::PointToPointOptions options;
    options.tag = tag_of(call, phase, chunk);
    at::Tensor bytes = values.view(at::kByte);
    works.push_back(send ? group->send_async(bytes, peer, options) : group->recv_async(bytes, peer, options));
    if (index) *index = works.size() - 1;
  }

  // Posts every chunk of phase 1 and every receive of phase 2.
  void start(const at::Tensor& compressed) {
    copy_in.assign(n, std::vector<size_t>(my_chunks.size(), SIZE_MAX));
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      int64_t at = 0;
      const auto theirs_chunks = chunks_of(parts[j], compressed.element_size());
      for (size_t k = 0; k < theirs_chunks.size(); ++k) {
        if (theirs_chunks[k] > 0) {
          post(nullptr, true, compressed.narrow(0, offsets[j] + at, theirs_chunks[k]), j, 0, static_cast<int>(k));
        }
        at += theirs_chunks[k];
      }
      at = 0;
      for (size_t k = 0; k < my_chunks.size(); ++k) {
        if (my_chunks[k] > 0) post(&copy_in[j][k], false, copies[j].narrow(0, at, my_chunks[k]), j, 0, static_cast<int>(k));
        at += my_chunks[k];
      }
      if (!gather_back) continue;
      theirs[j] = at::empty({parts[j]}, compressed.options());
      at = 0;
      for (size_t k = 0; k < theirs_chunks.size(); ++k) {
        if (theirs_chunks[k] > 0) post(nullptr, false, theirs[j].narrow(0, at, theirs_chunks[k]), j, 1, static_cast<int>(k));
        at += theirs_chunks[k];
      }
    }
    waited.assign(works.size(), false);
  }

  void wait(size_t index) {
    if (index == SIZE_MAX || waited[index]) return;
    works[index].wait();
    waited[index] = true;
  }

  void finish() {
    at::Tensor mine = bucket.narrow(0, offsets[me], parts[me]);
    int64_t at = 0;
    for (size_t k = 0; k < my_chunks.size(); ++k) {
      if (my_chunks[k] == 0) continue;
      at::Tensor sum = mine.narrow(0, at, my_chunks[k]).clone();
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        wait(copy_in[j][k]);
        sum.add_(copies[j].narrow(0, at, my_chunks[k]).to(bucket.scalar_type()));
      }
      sum.div_(n);
      if (!gather_back) {
        result.narrow(0, at, my_chunks[k]).copy_(sum);
        at += my_chunks[k];
        continue;
      }
      at::Tensor chunk = average.narrow(0, at, my_chunks[k]);
      chunk.copy_(sum);
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        post(nullptr, true, chunk, j, 1, static_cast<int>(k));
        waited.push_back(false);
      }
      at += my_chunks[k];
    }
    for (size_t i = 0; i < works.size(); ++i) wait(i);
    if (!gather_back) return;
    for (int j = 0; j < n; ++j) bucket.narrow(0, offsets[j], parts[j]).copy_(j == me ? average : theirs[j]);
  }
};

// Starts an exchange of `bucket` (n > 1, not empty), cut into `parts`, on the wire in `wire`.
comm::Work start_exchange(std::shared_ptr<Exchange> exchange, comm::Group& group,
                          const at::Tensor& bucket, comm::Sizes parts, at::ScalarType wire,
                          int64_t call) {
  Exchange& x = *exchange;
  const int n = group.size();
  x.group = &group;
  x.bucket = bucket;
  x.wire = wire;
  x.call = call;
  x.n = n;
  x.me = group.rank();
  x.parts = std::move(parts);
  x.offsets.assign(n, 0);
  for (int j = 1; j < n; ++j) x.offsets[j] = x.offsets[j - 1] + x.parts[j - 1];
  at::Tensor compressed = bucket.to(wire);
  x.my_chunks = chunks_of(x.parts[x.me], compressed.element_size());
  x.copies = at::empty({n, x.parts[x.me]}, compressed.options());
  if (x.gather_back) {
    x.average = at::empty({x.parts[x.me]}, compressed.options());
  } else {
    x.result = at::empty({x.parts[x.me]}, bucket.options());
  }
  x.theirs.resize(n);
  x.start(compressed);
  // Never empty: with n > 1 and a non-empty bucket some part is not empty, and its member
  // receives it from every other, who send it.
  SHOAL_CHECK(!x.works.empty()) << "compressed average of " << bucket.numel()
                                << " values posted nothing";
  // The first operation posted (of phase 1, which needs nothing from finish() on any member)
  // carries the exchange: its wait() runs the rest, and finish() does not wait for it again.
  comm::Work carrier = x.works.front();
  x.waited[0] = true;
  carrier.then([exchange, compressed](const at::Tensor&) { exchange->finish(); });
  return carrier;
}

CommHook compress_hook(at::ScalarType wire) {
  auto calls = std::make_shared<int64_t>(0);
  return [wire, calls](comm::Group& group, at::Tensor& bucket) {
    const int n = group.size();
    if (n == 1 || bucket.numel() == 0) return group.all_reduce_async(bucket, {comm::ReduceOp::kAvg});
    return start_exchange(std::make_shared<Exchange>(), group, bucket,
                          comm::split_sizes(bucket.numel(), n), wire, (*calls)++);
  };
}

}  // namespace

CompressedScatter::CompressedScatter(at::ScalarType wire) : wire_(wire) {}

CompressedScatter::Started CompressedScatter::start(comm::Group& group, const at::Tensor& bucket,
                                                    const comm::Sizes& parts) {
  if (group.size() == 1) {
    comm::ReduceScatterOptions options;
    options.sizes = parts;
    return {group.reduce_scatter_async(bucket, options), nullptr};
  }
  auto exchange = std::make_shared<Exchange>();
  exchange->gather_back = false;
  comm::Work work = start_exchange(exchange, group, bucket, parts, wire_, calls_++);
  return {std::move(work), std::shared_ptr<at::Tensor>(exchange, &exchange->result)};
}

CommHook allreduce_hook() {
  return [](comm::Group& group, at::Tensor& bucket) {
    return group.all_reduce_async(bucket, {comm::ReduceOp::kAvg});
  };
}

CommHook fp16_compress_hook() { return compress_hook(at::kHalf); }
CommHook bf16_compress_hook() { return compress_hook(at::kBFloat16); }

}  // namespace shoal::dp
