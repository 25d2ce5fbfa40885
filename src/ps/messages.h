// The parameter server's requests and replies as C++ values (docs/ps.md, "Wire"): what a worker's
// client sends and a server's core answers. src/ps/rpc.* carries them over gRPC (ps.proto mirrors
// these structs field by field); src/ps/server_core.* answers them; neither knows of the other.
// Tensors travel as float32 contiguous data with their sizes beside them; a reader checks every
// size against the table before it touches a byte (a malformed request is refused, never obeyed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shoal::ps::detail {

// How a server applies a table's gradients: the user's torch optimizer, mapped (docs/ps.md,
// "Optimizers"). Dense tables follow torch::optim's update rules; sparse tables the lazy
// row-wise versions (PyTorch's SparseAdam, sparse Adagrad): only touched rows change, and each
// row keeps its own state (Adam: its own step count).
struct OptimizerSpec {
  enum class Kind : int32_t { kSgd = 0, kAdagrad = 1, kAdam = 2 };
  Kind kind = Kind::kSgd;
  double lr = 0.01;
  double weight_decay = 0;
  // SGD
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;
  // Adagrad
  double lr_decay = 0;
  double initial_accumulator_value = 0;
  // Adagrad, Adam
  double eps = 1e-10;
  // Adam
  double beta1 = 0.9;
  double beta2 = 0.999;
  bool amsgrad = false;
};

// A sparse row's first value: a pure function of (seed, table name, row id), so that a run does not
// depend on the number of servers or on which worker touched the row first.
struct InitSpec {
  enum class Kind : int32_t { kZeros = 0, kUniform = 1, kNormal = 2 };
  Kind kind = Kind::kZeros;
  double a = 0;  // uniform: low; normal: mean
  double b = 0;  // uniform: high; normal: standard deviation
};

struct TableSpec {
  std::string name;            // unique in the job; the model's parameter name for dense tables
  bool sparse = false;
  std::vector<int64_t> shape;  // dense: the parameter's shape; sparse: {rows (0: unbounded), dim}
  OptimizerSpec optimizer;
  InitSpec init;               // sparse only; dense tables start from the values the first worker sends
  uint64_t seed = 0;
};

// Part of a dense table held by one server: the chunks `chunks` (indices in the table's chunk
// order, docs/ps.md "Sharding"), their values concatenated.
struct DenseSlice {
  int32_t table = 0;            // index in the registration order
  std::vector<int64_t> chunks;
  std::vector<float> values;    // sum of the chunks' lengths
  // A push a server reads where the worker wrote it (Note [Pushes read in place] in
  // server_steps.cpp): `values` is empty and the `view_count` values are at `view`, which the
  // request's `keep` keeps mapped. Readers of a push's values use data() and count().
  const float* view = nullptr;
  size_t view_count = 0;
  const float* data() const { return view != nullptr ? view : values.data(); }
  size_t count() const { return view != nullptr ? view_count : values.size(); }
};

// Rows of a sparse table: ids and their values (ids.size() x dim), in the ids' order.
struct SparseSlice {
  int32_t table = 0;
  std::vector<int64_t> ids;
  std::vector<float> values;
};

// A worker's first call: the tables it trains, in the same order on every worker. The first
// worker to register a table creates it (dense: with `initial`, its part of the values in chunk
// order, see DenseSlice); later registrations must match it exactly or get a UsageError naming
// the difference.
struct RegisterRequest {
  int32_t worker = 0;  // the worker's index in the job
  std::vector<TableSpec> tables;
  // Dense tables' first values: for each dense table, the chunks the server holds, each once.
  // The registration that carries them creates the tables (the client sends them from the first
  // worker only); one without them waits for it. Later registrations' values are not read.
  std::vector<DenseSlice> initial;
  // The worker's consistency mode as src/ps/mode.h names it ("sync", "async", "ssp:S"): the
  // servers train in the first registration's mode and refuse a worker that names another.
  // Empty: the server's own (the transport's tests).
  std::string mode;
};

// Read values for the step a worker is about to train (`clock`: its number of pushed steps).
// Sync: answers once the step before has been applied; bounded staleness s: once the slowest
// live worker's clock is at least clock - s; async: at once.
struct PullRequest {
  int32_t worker = 0;
  int64_t clock = 0;
  std::vector<DenseSlice> dense;    // values empty: which chunks are wanted
  std::vector<SparseSlice> sparse;  // values empty: which rows are wanted
};
// A server's part of one sync step's gradient-noise measurement (Note [The gradient noise on
// servers] in server_sum.cpp): sums over the values this server holds, which the worker adds up
// over all servers.
struct NoisePart {
  int64_t step = -1;       // the step measured; -1: none
  double local_sqr = 0;    // the mean over the step's pushes of each push's |g|^2 here
  double average_sqr = 0;  // |the step's mean gradient|^2 here
  double small = 0;        // the pushes' rows: their harmonic mean ...
  double big = 0;          // ... and their sum
};

struct PullReply {
  std::vector<DenseSlice> dense;
  std::vector<SparseSlice> sparse;
  int64_t clock = 0;      // the server's applied step count when it answered
  int64_t staleness = 0;  // the fastest live worker's clock minus the slowest's
  NoisePart noise;        // sync: the last applied step's, when its pushes measured it
};

// Takes a pull reply's dense values from where they arrived, when they can be read there (a
// shared segment, Note [Pulled values in place] in client.cpp): called with the index of each
// such dense slice in the reply, the slice (its `values` empty) and its `count` values, valid
// only during the call. It throws (CommError) when they do not fit the slice. A slice so taken
// carries no values in the reply.
using DenseSink =
    std::function<void(size_t index, const DenseSlice& slice, const float* values, size_t count)>;

// Writes a push's dense gradients where the transport sends them from, so that each is copied
// once, from the model's gradient (Note [Pushed values in place] in client.cpp): dense slice i has
// `counts[i]` values, which `fill(i, out)` writes to `out`. The request's slices carry none.
struct DenseSource {
  std::vector<size_t> counts;
  std::function<void(size_t index, float* out)> fill;
  // Where no other place takes them: into the slices' own vectors.
  void fill_slices(std::vector<DenseSlice>& dense) const {
    for (size_t i = 0; i < dense.size(); ++i) {
      dense[i].values.resize(counts.at(i));
      fill(i, dense[i].values.data());
    }
  }
};

// A worker's gradients for its step `clock`, of the mean loss over its `rows` samples (0: an idle
// step, with no gradients: the worker had no batch). In sync
// the server applies, per step, sum_w rows_w * grad_w / sum_w rows_w over the live workers in
// worker order: the gradient of the mean loss over the global batch.
struct PushRequest {
  int32_t worker = 0;
  int64_t clock = 0;
  int64_t rows = 0;
  std::vector<DenseSlice> dense;    // gradients
  std::vector<SparseSlice> sparse;  // gradients of the touched rows (ids unique per slice)
  // The batch of the epoch's ledger these gradients are of (ledger.h; -1: none), for the server
  // that keeps the ledger: it is done when this push is applied.
  int64_t epoch = 0;
  int64_t batch = -1;
  // Backup workers with several servers (Note [Server 0 decides] in server_steps.cpp): server 0
  // decides whether a push of a step counts; the worker passes its answer on to the others.
  enum class Verdict : int32_t { kDecide = 0, kCounted = 1, kDropped = 2 };
  Verdict verdict = Verdict::kDecide;
  // The worker measures the gradient noise (ps::ServerOptions::measure_gradient_noise): |g|^2
  // over this push's values, dense and sparse; < 0: not measured.
  double gradient_sqr = -1;
  // What the dense slices' views point into (DenseSlice::view), kept while they are read.
  std::shared_ptr<const void> keep = nullptr;
};
// A batch of the epoch's ledger for `worker` (ledger.h, docs/ps.md "Leased batches"): the data
// set's size and the batch size name the ledger, and every worker must name the same.
struct LeaseRequest {
  int32_t worker = 0;
  int64_t epoch = 0;
  int64_t dataset_size = 0;
  int64_t batch_size = 1;
  bool drop_last = false;
};
struct LeaseReply {
  enum class Kind : int32_t { kBatch = 0, kWait = 1, kEpochDone = 2 };  // as Ledger::Lease::Kind
  Kind kind = Kind::kWait;
  int64_t epoch = 0;
  int64_t batch = -1;
  int64_t begin = 0;  // positions [begin, end) of the epoch's permutation
  int64_t end = 0;
};

// A worker joins or leaves the live set of an elastic job (docs/ps.md, "Elastic workers"; Note
// [Joins and leaves] in server_membership.cpp). kJoin: `worker` is live from step `clock` on (raised to
// the server's own step, or its slowest worker's clock); the reply is the clock it joined at.
// kFence: the worker is gone (its launcher saw it exit): the server takes no further request of
// it and answers its sealed clock. kLeave: the worker leaves with `clock`, the highest sealed
// clock any server answered.
struct MembershipRequest {
  enum class Op : int32_t { kJoin = 0, kFence = 1, kLeave = 2 };
  Op op = Op::kJoin;
  int32_t worker = 0;
  int64_t clock = 0;
};
struct MembershipReply {
  int64_t clock = 0;
};

struct PushReply {
  // Sync with backup workers (replicas_to_aggregate < live workers): false when the step was
  // already full; the gradient was not applied and the worker puts its samples back.
  bool counted = true;
  int64_t clock = 0;
};

}  // namespace shoal::ps::detail
