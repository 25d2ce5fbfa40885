// ZeRO stage 3 (DataParallelOptions::zero_stage = 3, docs/memory.md): the module's parameters
// hold no memory between uses; each is gathered, with the rest of its unit, just before an
// operation reads it, in forward and again in backward, and freed when other units need the room.
// Internal to shoal: the Replicator holds one (src/dp/replicator.h).
//
// Note [Gathering a parameter when an operation reads it]
// LibTorch's C++ modules have no forward hooks, and a program's module calls its children's
// forward directly, so nothing tells a wrapper when a layer starts. What every read of a
// parameter does go through is the dispatcher: the operation that reads it (addmm, t, embedding,
// a backward's mm over the saved weight) is called with the parameter, or a view of its storage,
// among its inputs. ATen's RecordFunction calls an observer at the start of every operation with
// its inputs, before the kernel runs. The Gatherer observes the operations of the thread that
// runs the wrapper's forward (which on the CPU runs backward too): when an input's storage is a
// parameter's that is not whole here, it gathers that parameter's unit before the operation
// goes on. So any module trains at stage 3 unchanged, and a parameter read outside forward and
// backward (an evaluation, a print) is gathered as well; every worker must read the same
// parameters in the same order, as FSDP requires, because each gather is a collective.
//
// Units are the parameters of consecutive modules (in registration order, the order forward
// usually runs them) of about unit_bytes together. At most max_units are whole or in flight at
// once: a unit that is needed when there is no room frees the unit used least recently, never
// one the current operation reads. Prefetch: the units gathered in the previous step, in the
// order they were needed, are the plan of this one; each time a unit is needed, the next ones of
// the plan are started while there is room, so that the next layer travels while this one
// computes. Every decision follows from the sequence of operations, never from timing, so every
// worker starts the same collectives in the same order. At the end of each synchronized backward
// every unit is freed: the optimizer's step is about to change the slices.
//
// An error inside an observer cannot leave it (RecordFunction logs and drops it): the unit is
// then given zeros, so that the operation runs, and the error is raised where it can be, after
// the wrapper's forward or at the end of backward (rethrow()).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "dp/shards.h"
#include "shoal/comm/group.h"

namespace shoal::dp {

// Units (above): the trainable parameters of consecutive modules of `module`, in the order the
// module tree registered them, about unit_bytes together, as indices into shards.params(); a
// module's own parameters stay in one unit.
std::vector<std::vector<size_t>> module_units(const torch::nn::Module& module, const Shards& shards,
                                              int64_t unit_bytes);

class Gatherer : public std::enable_shared_from_this<Gatherer> {
 public:
  // `units`: lists of indices into shards->params(), covering each once. Frees every parameter's
  // memory. Held by shared_ptr: the threads it observes hold it weakly.
  // With `keep_memory` (stages 1 and 2 of a GradientSync, whose model has no wrapper's forward
  // to gather in): the parameters keep their memory, every unit starts whole and is never freed
  // for room, and release_all() only marks them stale: the first operation that reads a stale
  // unit gathers it again, in place, and max_units bounds the gathers in flight.
  Gatherer(std::shared_ptr<Shards> shards, comm::Group group,
           std::vector<std::vector<size_t>> units, int max_units, bool keep_memory = false);
  ~Gatherer();
  Gatherer(const Gatherer&) = delete;
  Gatherer& operator=(const Gatherer&) = delete;

  // Observes the calling thread's operations from now on (once per thread). The Replicator
  // calls it on the thread that wraps the model, so that the module's own forward, called there
  // directly, gathers too.
  void observe_this_thread();
  // At the wrapper's forward: observes the calling thread too, and starts following the plan
  // from its beginning.
  void begin_forward();
  // At the end of a synchronized backward: every unit freed (with keep_memory: stale).
  void release_all();
  // Every unit whole (DataParallel::gather_parameters()); they stay whole until needed room or
  // the next release_all(). A collective.
  void gather_all();
  // Raises the first error an observer met since the last call, if any.
  void rethrow();

  // The observer's entry: the storages of parameters an operation reads.
  void on_operation(const std::vector<const void*>& storages);
  // Whether reading `tensor`, over `storage`, needs its parameter whole: it is a parameter's
  // memory, and not (with keep_memory) a slice, which lies in that memory and which the
  // optimizer's step reads and writes on its own.
  bool watches(const void* storage, const void* tensor) const {
    return unit_of_.count(storage) != 0 && slices_.count(tensor) == 0;
  }

 private:
  enum class Status { kFreed, kInFlight, kWhole };
  struct Unit {
    std::vector<size_t> params;
    Shards::Layout layout;
    Status status = Status::kFreed;
    comm::Work work;
    int64_t last_use = 0;
  };
  void need(size_t unit);
  void launch(size_t unit);
  void finish(size_t unit);
  void free(size_t unit);
  // Frees least-recently used whole units (none that the current operation reads) until one more
  // fits; false when none can go.
  bool make_room();
  size_t occupied() const;
  void prefetch();

  std::shared_ptr<Shards> shards_;
  comm::Group group_;
  std::vector<Unit> units_;
  std::unordered_map<const void*, size_t> unit_of_;  // a parameter's StorageImpl -> its unit
  std::unordered_set<const void*> slices_;           // with keep_memory: the slices' TensorImpls
  int max_units_;
  int64_t clock_ = 0;                  // operations observed
  std::vector<size_t> plan_, needed_;  // the previous step's needs, and this step's
  size_t next_ = 0;                    // where this step stands in plan_
  std::exception_ptr error_;
  bool broken_ = false;  // an error was met: units are given zeros from now on
  bool keep_memory_ = false;
};

}  // namespace shoal::dp
