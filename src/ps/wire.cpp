#include "wire.h"

#include <cstring>
#include <string>

#include "shoal/core/error.h"

namespace shoal::ps::detail::wire_format {
namespace {

static_assert(sizeof(float) == 4, "float32 values travel as 4 bytes");
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "values travel as little-endian float32; this build copies them as the host stores them"
#endif

std::string to_bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

std::vector<float> from_bytes(const std::string& bytes, const std::string& where) {
  if (bytes.size() % sizeof(float) != 0) {
    throw UsageError(where + ".values has " + std::to_string(bytes.size()) +
                     " bytes; expected a multiple of 4 (little-endian float32)");
  }
  std::vector<float> values(bytes.size() / sizeof(float));
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

template <typename Repeated>
std::vector<int64_t> all_non_negative(const Repeated& in, const std::string& where) {
  std::vector<int64_t> out(in.begin(), in.end());
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] < 0) {
      throw UsageError(where + "[" + std::to_string(i) + "] = " + std::to_string(out[i]) +
                       "; expected a non-negative number");
    }
  }
  return out;
}

int64_t non_negative(int64_t value, const std::string& where) {
  if (value < 0) {
    throw UsageError(where + " = " + std::to_string(value) + "; expected a non-negative number");
  }
  return value;
}

void dense_to_wire(const DenseSlice& in, pb::DenseSlice& out) {
  out.set_table(in.table);
  out.mutable_chunks()->Add(in.chunks.begin(), in.chunks.end());
  out.set_values(to_bytes(in.values));
}

void sparse_to_wire(const SparseSlice& in, pb::SparseSlice& out) {
  out.set_table(in.table);
  out.mutable_ids()->Add(in.ids.begin(), in.ids.end());
  out.set_values(to_bytes(in.values));
}

// `values`: whether the slices carry values (pushes, pull replies) or must not (pull requests).
DenseSlice dense_from_wire(const pb::DenseSlice& in, const std::string& where, bool values) {
  DenseSlice out;
  out.table = static_cast<int32_t>(non_negative(in.table(), where + ".table"));
  out.chunks = all_non_negative(in.chunks(), where + ".chunks");
  out.values = from_bytes(in.values(), where);
  if (!values && !out.values.empty()) {
    throw UsageError(where + " carries " + std::to_string(out.values.size()) +
                     " values; a pull request names chunks only");
  }
  if (values && !out.chunks.empty() && out.values.empty()) {
    throw UsageError(where + " names " + std::to_string(out.chunks.size()) +
                     " chunks but carries no values");
  }
  return out;
}

SparseSlice sparse_from_wire(const pb::SparseSlice& in, const std::string& where, bool values) {
  SparseSlice out;
  out.table = static_cast<int32_t>(non_negative(in.table(), where + ".table"));
  out.ids.assign(in.ids().begin(), in.ids().end());
  out.values = from_bytes(in.values(), where);
  if (!values && !out.values.empty()) {
    throw UsageError(where + " carries " + std::to_string(out.values.size()) +
                     " values; a pull request names rows only");
  }
  if (values && (out.ids.empty() ? !out.values.empty()
                                 : out.values.empty() || out.values.size() % out.ids.size() != 0)) {
    throw UsageError(where + " carries " + std::to_string(out.values.size()) + " values for " +
                     std::to_string(out.ids.size()) +
                     " rows; expected a whole number of rows of at least one value");
  }
  return out;
}

template <typename In>
void slices_from_wire(const In& in, std::vector<DenseSlice>& dense,
                      std::vector<SparseSlice>& sparse, bool values) {
  for (int i = 0; i < in.dense_size(); ++i) {
    dense.push_back(dense_from_wire(in.dense(i), "dense[" + std::to_string(i) + "]", values));
  }
  for (int i = 0; i < in.sparse_size(); ++i) {
    sparse.push_back(sparse_from_wire(in.sparse(i), "sparse[" + std::to_string(i) + "]", values));
  }
}

template <typename Out>
void slices_to_wire(const std::vector<DenseSlice>& dense, const std::vector<SparseSlice>& sparse,
                    Out& out) {
  for (const DenseSlice& slice : dense) dense_to_wire(slice, *out.add_dense());
  for (const SparseSlice& slice : sparse) sparse_to_wire(slice, *out.add_sparse());
}

}  // namespace

void to_wire(const RegisterRequest& in, pb::RegisterRequest& out) {
  out.set_worker(in.worker);
  for (const TableSpec& spec : in.tables) {
    pb::TableSpec& t = *out.add_tables();
    t.set_name(spec.name);
    t.set_sparse(spec.sparse);
    t.mutable_shape()->Add(spec.shape.begin(), spec.shape.end());
    pb::OptimizerSpec& o = *t.mutable_optimizer();
    o.set_kind(static_cast<int32_t>(spec.optimizer.kind));
    o.set_lr(spec.optimizer.lr);
    o.set_weight_decay(spec.optimizer.weight_decay);
    o.set_momentum(spec.optimizer.momentum);
    o.set_dampening(spec.optimizer.dampening);
    o.set_nesterov(spec.optimizer.nesterov);
    o.set_lr_decay(spec.optimizer.lr_decay);
    o.set_initial_accumulator_value(spec.optimizer.initial_accumulator_value);
    o.set_eps(spec.optimizer.eps);
    o.set_beta1(spec.optimizer.beta1);
    o.set_beta2(spec.optimizer.beta2);
    o.set_amsgrad(spec.optimizer.amsgrad);
    pb::InitSpec& init = *t.mutable_init();
    init.set_kind(static_cast<int32_t>(spec.init.kind));
    init.set_a(spec.init.a);
    init.set_b(spec.init.b);
    t.set_seed(spec.seed);
  }
  for (const DenseSlice& slice : in.initial) dense_to_wire(slice, *out.add_initial());
}

RegisterRequest from_wire(const pb::RegisterRequest& in) {
  RegisterRequest out;
  out.worker = static_cast<int32_t>(non_negative(in.worker(), "worker"));
  for (int i = 0; i < in.tables_size(); ++i) {
    const pb::TableSpec& t = in.tables(i);
    const std::string where = "tables[" + std::to_string(i) + "]";
    TableSpec spec;
    if (t.name().empty()) throw UsageError(where + ".name is empty; expected the table's name");
    spec.name = t.name();
    spec.sparse = t.sparse();
    spec.shape = all_non_negative(t.shape(), where + ".shape");
    const pb::OptimizerSpec& o = t.optimizer();
    if (o.kind() < 0 || o.kind() > 2) {
      throw UsageError(where + ".optimizer.kind = " + std::to_string(o.kind()) +
                       "; expected 0 (SGD), 1 (Adagrad) or 2 (Adam)");
    }
    spec.optimizer.kind = static_cast<OptimizerSpec::Kind>(o.kind());
    spec.optimizer.lr = o.lr();
    spec.optimizer.weight_decay = o.weight_decay();
    spec.optimizer.momentum = o.momentum();
    spec.optimizer.dampening = o.dampening();
    spec.optimizer.nesterov = o.nesterov();
    spec.optimizer.lr_decay = o.lr_decay();
    spec.optimizer.initial_accumulator_value = o.initial_accumulator_value();
    spec.optimizer.eps = o.eps();
    spec.optimizer.beta1 = o.beta1();
    spec.optimizer.beta2 = o.beta2();
    spec.optimizer.amsgrad = o.amsgrad();
    if (t.init().kind() < 0 || t.init().kind() > 2) {
      throw UsageError(where + ".init.kind = " + std::to_string(t.init().kind()) +
                       "; expected 0 (zeros), 1 (uniform) or 2 (normal)");
    }
    spec.init.kind = static_cast<InitSpec::Kind>(t.init().kind());
    spec.init.a = t.init().a();
    spec.init.b = t.init().b();
    spec.seed = t.seed();
    out.tables.push_back(std::move(spec));
  }
  for (int i = 0; i < in.initial_size(); ++i) {
    out.initial.push_back(
        dense_from_wire(in.initial(i), "initial[" + std::to_string(i) + "]", /*values=*/true));
  }
  return out;
}

void to_wire(const PullRequest& in, pb::PullRequest& out) {
  out.set_worker(in.worker);
  out.set_clock(in.clock);
  slices_to_wire(in.dense, in.sparse, out);
}

PullRequest from_wire(const pb::PullRequest& in) {
  PullRequest out;
  out.worker = static_cast<int32_t>(non_negative(in.worker(), "worker"));
  out.clock = non_negative(in.clock(), "clock");
  slices_from_wire(in, out.dense, out.sparse, /*values=*/false);
  return out;
}

void to_wire(const PullReply& in, pb::PullReply& out) {
  slices_to_wire(in.dense, in.sparse, out);
  out.set_clock(in.clock);
  out.set_staleness(in.staleness);
}

PullReply from_wire(const pb::PullReply& in) {
  PullReply out;
  slices_from_wire(in, out.dense, out.sparse, /*values=*/true);
  out.clock = non_negative(in.clock(), "clock");
  out.staleness = non_negative(in.staleness(), "staleness");
  return out;
}

void to_wire(const PushRequest& in, pb::PushRequest& out) {
  out.set_worker(in.worker);
  out.set_clock(in.clock);
  out.set_rows(in.rows);
  slices_to_wire(in.dense, in.sparse, out);
}

PushRequest from_wire(const pb::PushRequest& in) {
  PushRequest out;
  out.worker = static_cast<int32_t>(non_negative(in.worker(), "worker"));
  out.clock = non_negative(in.clock(), "clock");
  out.rows = non_negative(in.rows(), "rows");
  slices_from_wire(in, out.dense, out.sparse, /*values=*/true);
  return out;
}

void to_wire(const PushReply& in, pb::PushReply& out) {
  out.set_counted(in.counted);
  out.set_clock(in.clock);
}

PushReply from_wire(const pb::PushReply& in) {
  PushReply out;
  out.counted = in.counted();
  out.clock = non_negative(in.clock(), "clock");
  return out;
}

}  // namespace shoal::ps::detail::wire_format
