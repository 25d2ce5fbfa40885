// A sync step's sum (part of ServerCore, server_core.h, through ServerSteps; called with the
// core's lock held, it takes no lock itself): the pushes of one step summed (Note [Sync sum]) and
// applied to the tables, in scratch buffers kept from step to step (Note [A step's sum without
// allocations]), the dense sum on two threads when it is large (Note [A step's sum on two
// threads]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "fan_out.h"
#include "messages.h"

namespace shoal::ps::detail {

struct ServerCoreOptions;
class ServerRegistry;

class ServerSum {
 public:
  ServerSum(const ServerCoreOptions& options, ServerRegistry& registry);

  // Sync: applies step `step`'s pushes (Note [Sync sum]); allocates nothing for dense tables once
  // the first step has sized the scratch buffers (Note [A step's sum without allocations]). When
  // the pushes measure the gradient noise, this server's part of it is kept (noise()).
  void sum_step(int64_t step, const std::map<int32_t, PushRequest>& pushes);
  // The last step's part of the gradient-noise measurement (Note [The gradient noise on
  // servers]); step -1 when it was not measured.
  const NoisePart& noise() const { return noise_; }

 private:
  struct SumTerm {
    int32_t table;
    int64_t chunk;
    size_t order;   // the push's place in worker order
    double weight;  // its rows
    const float* grad;
  };
  struct SumScratch {
    std::vector<double> acc;  // one block of a chunk's sum (Note [A chunk's sum in blocks])
    std::vector<float> out;   // one chunk's gradient, rounded
    double sqr = 0;           // measuring the noise: |out|^2 summed over the chunks
  };
  // Where a step's dense sum has at least this many values, a second thread takes half.
  static constexpr size_t kSumSplitAtLeast = 1 << 20;

  // The term after the last one of sum_terms_[first]'s chunk.
  size_t next_chunk(size_t first) const;
  // Sums and applies the chunks of sum_terms_[first, end), which begins and ends at a chunk's
  // first term. `measure`: adds each chunk's |gradient|^2 to scratch.sqr.
  void sum_chunks(size_t first, size_t end, double total, bool measure, SumScratch& scratch);

  const ServerCoreOptions& options_;
  ServerRegistry& registry_;
  // Note [A step's sum without allocations]: storage kept from step to step.
  std::vector<SumTerm> sum_terms_;
  SumScratch sum_scratch_[2];  // one per thread (Note [A step's sum on two threads])
  // The second thread, started by the first step large enough to split (fan_out.h).
  std::unique_ptr<c10::ThreadPool> second_;
  NoisePart noise_;
};

}  // namespace shoal::ps::detail
