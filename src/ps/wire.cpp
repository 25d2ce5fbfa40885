#include "wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpc/slice.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>

#include "shm.h"
#include "wire_io.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail::wire_format {
namespace {

static_assert(sizeof(float) == 4, "float32 values travel as 4 bytes");
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "values travel as little-endian float32; this build copies them as the host stores them"
#endif


// ---- checks, shared by the generated classes' path (Register) and the hand-written one ----

template <typename Values>
std::vector<int64_t> all_non_negative(const Values& in, const std::string& where) {
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

// `odd_bytes`: the length of a values field that was not a whole number of float32 (then not
// read), or -1.
void check_values_bytes(int64_t odd_bytes, const std::string& where) {
  if (odd_bytes >= 0) {
    throw UsageError(where + ".values has " + std::to_string(odd_bytes) +
                     " bytes; expected a multiple of 4 (little-endian float32)");
  }
}

// `values`: whether the slices carry values (pushes, pull replies) or must not (pull requests).
void check_dense(const DenseSlice& slice, int64_t odd_bytes, const std::string& where,
                 bool values) {
  non_negative(slice.table, where + ".table");
  all_non_negative(slice.chunks, where + ".chunks");
  check_values_bytes(odd_bytes, where);
  if (!values && slice.count() != 0) {
    throw UsageError(where + " carries " + std::to_string(slice.count()) +
                     " values; a pull request names chunks only");
  }
  if (values && !slice.chunks.empty() && slice.count() == 0) {
    throw UsageError(where + " names " + std::to_string(slice.chunks.size()) +
                     " chunks but carries no values");
  }
}

void check_sparse(const SparseSlice& slice, int64_t odd_bytes, const std::string& where,
                  bool values) {
  non_negative(slice.table, where + ".table");
  check_values_bytes(odd_bytes, where);
  if (!values && !slice.values.empty()) {
    throw UsageError(where + " carries " + std::to_string(slice.values.size()) +
                     " values; a pull request names rows only");
  }
  const size_t rows = slice.ids.size(), count = slice.values.size();
  if (values && (rows == 0 ? count != 0 : count == 0 || count % rows != 0)) {
    throw UsageError(where + " carries " + std::to_string(count) + " values for " +
                     std::to_string(rows) +
                     " rows; expected a whole number of rows of at least one value");
  }
}

using WireType = WireFormat::WireType;
constexpr WireType kVarint = WireFormat::WIRETYPE_VARINT;
constexpr WireType kLength = WireFormat::WIRETYPE_LENGTH_DELIMITED;
constexpr WireType kFixed64 = WireFormat::WIRETYPE_FIXED64;

// One DenseSlice or SparseSlice submessage; `indices` is its chunks or ids.
// `shared`: a dense slice's count of values in the shared segment (nullptr: sparse);
// `mirror_at`: a dense slice's place in the server's mirror, plus 1 (0: none).
bool read_slice(Reader& r, int32_t& table, std::vector<int64_t>& indices,
                std::vector<float>& values, int64_t& odd_bytes, uint64_t* shared,
                uint64_t* mirror_at = nullptr) {
  return r.submessage([&] {
    return r.fields([&](int number, WireType type, uint32_t tag) {
      if (number == 1 && type == kVarint) return r.varint(table);
      if (number == 2 && (type == kVarint || type == kLength)) return r.int64s(type, indices);
      if (number == 3 && type == kLength) return r.values(values, odd_bytes);
      if (number == 4 && type == kVarint && shared != nullptr) return r.varint(*shared);
      if (number == 5 && type == kVarint && mirror_at != nullptr) return r.varint(*mirror_at);
      return r.skip(tag);
    });
  });
}

// The repeated slices of a pull or push (fields `dense` and `sparse`), checked once read.
// A struct read before is read into again with its vectors' storage (Note [Values without
// copies]): slice i reuses the struct's slice i, and slices it had beyond those read are dropped.
struct Slices {
  std::vector<DenseSlice>& dense;
  std::vector<SparseSlice>& sparse;
  std::vector<int64_t> dense_odd, sparse_odd;
  std::vector<uint64_t> dense_shared;
  std::vector<uint64_t> dense_mirror_at;  // a reply's: in the server's mirror, plus 1
  bool sunk = false;  // shared values left to a DenseSink: those slices carry none

  template <typename Slice>
  static Slice& next(std::vector<Slice>& slices, size_t used) {
    if (used == slices.size()) return slices.emplace_back();
    Slice& s = slices[used];
    s.table = 0;
    indices_of_mutable(s).clear();
    s.values.clear();
    forget_view(s);
    return s;
  }
  static void forget_view(DenseSlice& s) {
    s.view = nullptr;
    s.view_count = 0;
  }
  static void forget_view(SparseSlice&) {}
  static std::vector<int64_t>& indices_of_mutable(DenseSlice& s) { return s.chunks; }
  static std::vector<int64_t>& indices_of_mutable(SparseSlice& s) { return s.ids; }

  bool read_dense(Reader& r) {
    DenseSlice& s = next(dense, dense_odd.size());
    return read_slice(r, s.table, s.chunks, s.values, dense_odd.emplace_back(-1),
                      &dense_shared.emplace_back(0), &dense_mirror_at.emplace_back(0));
  }
  bool read_sparse(Reader& r) {
    SparseSlice& s = next(sparse, sparse_odd.size());
    return read_slice(r, s.table, s.ids, s.values, sparse_odd.emplace_back(-1), nullptr);
  }
  // Note [Values in shared memory]: dense slices that name a count of values in the segment
  // take them from it, in slice order; every count is checked against what the segment holds
  // before a value is read.
  // `in_place`: the slices read their values where they are (DenseSlice::view) rather than copy
  // them (Note [Pushes read in place] in server_steps.cpp).
  //
  // A reply's slices may name values in the server's mirror instead (`mirror`, Note [The values'
  // mirror] in mirror.h), each at its own place, checked alike.
  void take_shared(const SharedValues* shm, const DenseSink* sink = nullptr, bool in_place = false,
                   const SharedValues* mirror = nullptr) {
    sunk = sink != nullptr;
    size_t at = 0;
    for (size_t i = 0; i < dense.size(); ++i) {
      const uint64_t count = dense_shared[i];
      const uint64_t mirror_at = dense_mirror_at[i];
      const std::string where = "dense[" + std::to_string(i) + "]";
      if (count == 0) {
        if (mirror_at != 0)
          throw UsageError(where + " names a place in the mirror but no values; expected both");
        continue;
      }
      if (!dense[i].values.empty() || dense_odd[i] >= 0) {
        throw UsageError(where + " carries values and names " + std::to_string(count) +
                         " in the shared segment; expected one or the other");
      }
      const SharedValues* from = mirror_at != 0 ? mirror : shm;
      const char* what = mirror_at != 0 ? "the server's mirror" : "the shared segment";
      const size_t first = mirror_at != 0 ? mirror_at - 1 : at;
      if (from == nullptr) {
        throw UsageError(where + " names " + std::to_string(count) + " values in " +
                         (mirror_at != 0
                              ? std::string("the server's mirror, but the reply names none")
                              : std::string("a shared segment, but the call brought none")));
      }
      if (first > from->capacity || count > from->capacity - first) {
        throw UsageError(where + " names " + std::to_string(count) + " values from value " +
                         std::to_string(first) + " of " + what + ", which holds " +
                         std::to_string(from->capacity) + "; expected values within it");
      }
      if (in_place) {
        dense[i].view = from->data + first;
        dense[i].view_count = count;
      } else if (sink == nullptr) {
        dense[i].values.assign(from->data + first, from->data + first + count);
      }
      if (mirror_at == 0) at += count;
    }
  }
  // With a sink, once the whole message is checked: hands it the values take_shared left in the
  // segment or the mirror.
  void deliver(const SharedValues* shm, const DenseSink* sink,
               const SharedValues* mirror = nullptr) const {
    if (sink == nullptr) return;
    size_t at = 0;
    for (size_t i = 0; i < dense.size(); ++i) {
      const uint64_t mirror_at = dense_mirror_at[i];
      if (dense_shared[i] == 0) continue;
      if (mirror_at != 0) {
        (*sink)(i, dense[i], mirror->data + mirror_at - 1, dense_shared[i]);
        continue;
      }
      (*sink)(i, dense[i], shm->data + at, dense_shared[i]);
      at += dense_shared[i];
    }
  }
  // After reading: the slices read, no more.
  void trim() {
    dense.resize(dense_odd.size());
    sparse.resize(sparse_odd.size());
  }
  void check(bool values) const {
    for (size_t i = 0; i < dense.size(); ++i) {
      const bool taken = sunk && dense_shared[i] > 0;
      check_dense(dense[i], dense_odd[i], "dense[" + std::to_string(i) + "]", values && !taken);
    }
    for (size_t i = 0; i < sparse.size(); ++i) {
      check_sparse(sparse[i], sparse_odd[i], "sparse[" + std::to_string(i) + "]", values);
    }
  }
};

template <typename Message>
void write_slices(Writer& w, int dense_field, int sparse_field, const Message& in) {
  for (const DenseSlice& s : in.dense)
    w.slice(dense_field, s.table, indices_of(s), s.data(), s.count());
  for (const SparseSlice& s : in.sparse) w.slice(sparse_field, s.table, indices_of(s), s.values);
}

// Registrations' initial values, through the generated classes.
void dense_to_pb(const DenseSlice& in, pb::DenseSlice& out) {
  out.set_table(in.table);
  out.mutable_chunks()->Add(in.chunks.begin(), in.chunks.end());
  out.set_values(in.values.data(), values_bytes(in.values));
}
DenseSlice dense_from_pb(const pb::DenseSlice& in, const std::string& where) {
  DenseSlice out;
  out.table = in.table();
  out.chunks.assign(in.chunks().begin(), in.chunks().end());
  const std::string& bytes = in.values();
  int64_t odd_bytes = -1;
  if (bytes.size() % sizeof(float) != 0) {
    odd_bytes = static_cast<int64_t>(bytes.size());
  } else if (!bytes.empty()) {
    out.values.resize(bytes.size() / sizeof(float));
    std::memcpy(out.values.data(), bytes.data(), bytes.size());
  }
  check_dense(out, odd_bytes, where, /*values=*/true);
  return out;
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
  for (const DenseSlice& slice : in.initial) dense_to_pb(slice, *out.add_initial());
  out.set_mode(in.mode);
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
    out.initial.push_back(dense_from_pb(in.initial(i), "initial[" + std::to_string(i) + "]"));
  }
  out.mode = in.mode();
  return out;
}

void to_wire(const LeaseRequest& in, pb::LeaseRequest& out) {
  out.set_worker(in.worker);
  out.set_epoch(in.epoch);
  out.set_dataset_size(in.dataset_size);
  out.set_batch_size(in.batch_size);
  out.set_drop_last(in.drop_last);
}

LeaseRequest from_wire(const pb::LeaseRequest& in) {
  LeaseRequest out{in.worker(), in.epoch(), in.dataset_size(), in.batch_size(), in.drop_last()};
  non_negative(out.worker, "worker");
  non_negative(out.epoch, "epoch");
  return out;  // the ledger checks the sizes
}

void to_wire(const LeaseReply& in, pb::LeaseReply& out) {
  out.set_kind(static_cast<int32_t>(in.kind));
  out.set_epoch(in.epoch);
  out.set_batch(in.batch);
  out.set_begin(in.begin);
  out.set_end(in.end);
}

LeaseReply from_wire(const pb::LeaseReply& in) {
  if (in.kind() < 0 || in.kind() > 2)
    throw UsageError("kind = " + std::to_string(in.kind()) + "; expected 0, 1 or 2");
  return {static_cast<LeaseReply::Kind>(in.kind()), in.epoch(), in.batch(), in.begin(), in.end()};
}

void to_wire(const MembershipRequest& in, pb::MembershipRequest& out) {
  out.set_op(static_cast<int32_t>(in.op));
  out.set_worker(in.worker);
  out.set_clock(in.clock);
}

MembershipRequest from_wire(const pb::MembershipRequest& in) {
  if (in.op() < 0 || in.op() > 2)
    throw UsageError("op = " + std::to_string(in.op()) + "; expected 0 (join), 1 (fence) or 2 (leave)");
  MembershipRequest out{static_cast<MembershipRequest::Op>(in.op()), in.worker(), in.clock()};
  non_negative(out.worker, "worker");
  non_negative(out.clock, "clock");
  return out;
}

namespace {

// A pull reply's noise part (fields 5-9) and a push's |g|^2 (field 9): sizes and writes.
size_t noise_size(const NoisePart& noise) {
  if (noise.step < 0) return 0;
  return varint_field_size(noise.step + 1) + double_field_size(noise.local_sqr) +
         double_field_size(noise.average_sqr) + double_field_size(noise.small) +
         double_field_size(noise.big);
}
void write_noise(Writer& w, const NoisePart& noise) {
  if (noise.step < 0) return;
  w.varint_field(5, noise.step + 1);  // 0, the field's default: none
  w.double_field(6, noise.local_sqr);
  w.double_field(7, noise.average_sqr);
  w.double_field(8, noise.small);
  w.double_field(9, noise.big);
}
size_t gradient_sqr_size(double sqr) {
  return sqr < 0 ? 0 : double_field_size(sqr, /*always=*/true);
}
void write_gradient_sqr(Writer& w, double sqr) {
  if (sqr >= 0) w.double_field(9, sqr, /*always=*/true);  // present: measured, even when 0
}

}  // namespace

grpc::ByteBuffer encode(const PullRequest& in) {
  Writer w(varint_field_size(in.worker) + varint_field_size(in.clock) + slices_size(in.dense) +
           slices_size(in.sparse));
  w.varint_field(1, in.worker);
  w.varint_field(2, in.clock);
  write_slices(w, 3, 4, in);
  return w.finish();
}

grpc::ByteBuffer encode(const PushRequest& in) {
  Writer w(varint_field_size(in.worker) + varint_field_size(in.clock) + varint_field_size(in.rows) +
           slices_size(in.dense) + slices_size(in.sparse) + varint_field_size(in.epoch) +
           varint_field_size(in.batch + 1) + varint_field_size(static_cast<int32_t>(in.verdict)) +
           gradient_sqr_size(in.gradient_sqr));
  w.varint_field(1, in.worker);
  w.varint_field(2, in.clock);
  w.varint_field(3, in.rows);
  write_slices(w, 4, 5, in);
  w.varint_field(6, in.epoch);
  w.varint_field(7, in.batch + 1);  // 0, the field's default: no batch
  w.varint_field(8, static_cast<int32_t>(in.verdict));
  write_gradient_sqr(w, in.gradient_sqr);
  return w.finish();
}

size_t dense_values(const std::vector<DenseSlice>& dense) {
  size_t count = 0;
  for (const DenseSlice& s : dense) count += s.count();
  return count;
}

namespace {

// The dense slices' values copied into the segment in slice order, and the slices written with
// their counts (Note [Values in shared memory]); the sparse ones as before.
// `count(i)`: the number of values of dense slice i in the segment; `mirror_at(i)`: their place
// in the server's mirror plus 1, 0 where they are in the segment.
template <typename Message, typename Count, typename MirrorAt>
size_t shared_slices_size(const Message& in, const Count& count, const MirrorAt& mirror_at) {
  size_t size = slices_size(in.sparse);
  for (size_t i = 0; i < in.dense.size(); ++i) {
    const DenseSlice& s = in.dense[i];
    size += length_field_size(shared_slice_size(s.table, s.chunks, count(i), mirror_at(i)), true);
  }
  return size;
}
template <typename Message, typename Count>
size_t shared_slices_size(const Message& in, const Count& count) {
  return shared_slices_size(in, count, [](size_t) { return uint64_t{0}; });
}
template <typename Message>
size_t shared_slices_size(const Message& in) {
  return shared_slices_size(in, [&](size_t i) { return in.dense[i].count(); });
}
// Dense slice i's `count(i)` values written by `put(i, at)` into the segment, in slice order.
template <typename Message, typename Count, typename Put>
void write_shared_slices(Writer& w, int dense_field, int sparse_field, const Message& in,
                         const SharedValues& shm, const Count& count, const Put& put) {
  size_t total = 0;
  for (size_t i = 0; i < in.dense.size(); ++i) total += count(i);
  SHOAL_CHECK(total <= shm.capacity) << total << " values for a shared segment of " << shm.capacity;
  float* at = shm.data;
  for (size_t i = 0; i < in.dense.size(); ++i) {
    const DenseSlice& s = in.dense[i];
    put(i, at);
    at += count(i);
    w.shared_slice(dense_field, s.table, s.chunks, count(i));
  }
  for (const SparseSlice& s : in.sparse) w.slice(sparse_field, s.table, s.ids, s.values);
}
template <typename Message>
void write_shared_slices(Writer& w, int dense_field, int sparse_field, const Message& in,
                         const SharedValues& shm) {
  write_shared_slices(
      w, dense_field, sparse_field, in, shm, [&](size_t i) { return in.dense[i].count(); },
      [&](size_t i, float* at) {
        const DenseSlice& s = in.dense[i];
        if (s.count() != 0) std::memcpy(at, s.data(), s.count() * sizeof(float));
      });
}

}  // namespace

grpc::ByteBuffer encode(const PushRequest& in, const SharedValues& shm, const DenseSource* source,
                        bool in_place) {
  const auto count = [&](size_t i) { return source ? source->counts.at(i) : in.dense[i].count(); };
  Writer w(varint_field_size(in.worker) + varint_field_size(in.clock) + varint_field_size(in.rows) +
           shared_slices_size(in, count) + varint_field_size(in.epoch) +
           varint_field_size(in.batch + 1) + varint_field_size(static_cast<int32_t>(in.verdict)) +
           gradient_sqr_size(in.gradient_sqr) + varint_field_size(in_place ? 1 : 0));
  w.varint_field(1, in.worker);
  w.varint_field(2, in.clock);
  w.varint_field(3, in.rows);
  if (source) {
    SHOAL_CHECK(source->counts.size() == in.dense.size())
        << source->counts.size() << " counts for " << in.dense.size() << " dense slices";
    write_shared_slices(w, 4, 5, in, shm, count, source->fill);
  } else {
    write_shared_slices(w, 4, 5, in, shm);
  }
  w.varint_field(6, in.epoch);
  w.varint_field(7, in.batch + 1);  // as encode(const PushRequest&)
  w.varint_field(8, static_cast<int32_t>(in.verdict));
  write_gradient_sqr(w, in.gradient_sqr);
  w.varint_field(10, in_place ? 1 : 0);
  return w.finish();
}

grpc::ByteBuffer encode(const PullReply& in, const SharedValues& shm) {
  Writer w(shared_slices_size(in) + varint_field_size(in.clock) + varint_field_size(in.staleness) +
           noise_size(in.noise));
  write_shared_slices(w, 1, 2, in, shm);
  w.varint_field(3, in.clock);
  w.varint_field(4, in.staleness);
  write_noise(w, in.noise);
  return w.finish();
}

grpc::ByteBuffer encode(const PullReply& in, const DenseOut& out) {
  const std::vector<size_t>& counts = out.counts;
  SHOAL_CHECK(counts.size() == in.dense.size())
      << counts.size() << " counts for " << in.dense.size() << " dense slices";
  const bool mirrored = !out.mirror.empty();
  SHOAL_CHECK(!mirrored || out.mirrored.size() == counts.size())
      << out.mirrored.size() << " places in the mirror for " << counts.size() << " dense slices";
  const auto mirror_at = [&](size_t i) { return mirrored ? uint64_t{out.mirrored[i]} + 1 : 0; };
  Writer w(shared_slices_size(
               in, [&](size_t i) { return counts[i]; }, mirror_at) +
           varint_field_size(in.clock) + varint_field_size(in.staleness) + noise_size(in.noise) +
           length_field_size(out.mirror.size()) +
           varint_field_size(static_cast<int64_t>(mirrored ? out.sequence : 0)));
  for (size_t i = 0; i < in.dense.size(); ++i)
    w.shared_slice(1, in.dense[i].table, in.dense[i].chunks, counts[i], mirror_at(i));
  for (const SparseSlice& s : in.sparse) w.slice(2, s.table, s.ids, s.values);
  w.varint_field(3, in.clock);
  w.varint_field(4, in.staleness);
  write_noise(w, in.noise);
  w.string_field(10, out.mirror);
  w.varint_field(11, static_cast<int64_t>(mirrored ? out.sequence : 0));
  return w.finish();
}

grpc::ByteBuffer encode(const PushReply& in) {
  Writer w(varint_field_size(in.counted ? 1 : 0) + varint_field_size(in.clock));
  w.varint_field(1, in.counted ? 1 : 0);
  w.varint_field(2, in.clock);
  return w.finish();
}

grpc::ByteBuffer encode(PullReply&& in) {
  return encode(std::make_shared<const PullReply>(std::move(in)));
}

grpc::ByteBuffer encode(std::shared_ptr<const PullReply> in) {
  const std::shared_ptr<const PullReply> owner = std::move(in);
  Writer w(owner);
  write_slices(w, 1, 2, *owner);
  w.varint_field(3, owner->clock);
  w.varint_field(4, owner->staleness);
  write_noise(w, owner->noise);
  return w.finish();
}

bool decode(const grpc::ByteBuffer& in, PullRequest& out) {
  out.worker = 0;
  out.clock = 0;
  Reader r(in);
  Slices slices{out.dense, out.sparse, {}, {}, {}, {}};
  const bool read = r.fields([&](int number, WireType type, uint32_t tag) {
    if (number == 1 && type == kVarint) return r.varint(out.worker);
    if (number == 2 && type == kVarint) return r.varint(out.clock);
    if (number == 3 && type == kLength) return slices.read_dense(r);
    if (number == 4 && type == kLength) return slices.read_sparse(r);
    return r.skip(tag);
  });
  if (!read) return false;
  slices.trim();
  non_negative(out.worker, "worker");
  non_negative(out.clock, "clock");
  slices.take_shared(nullptr);  // a pull request carries no values, shared or not
  slices.check(/*values=*/false);
  return true;
}

bool decode(const grpc::ByteBuffer& in, PullReply& out, const SharedValues* shm,
            const DenseSink* sink, MirrorReader* mirror) {
  out.clock = 0;
  out.staleness = 0;
  out.noise = {};
  int64_t noise_step = 0;
  std::string mirror_handle;
  uint64_t mirror_sequence = 0;
  if (mirror != nullptr) mirror->used = false;
  Reader r(in);
  Slices slices{out.dense, out.sparse, {}, {}, {}, {}, {}};
  const bool read = r.fields([&](int number, WireType type, uint32_t tag) {
    if (number == 10 && type == kLength) return r.text(mirror_handle, 4096);
    if (number == 11 && type == kVarint) return r.varint(mirror_sequence);
    if (number == 1 && type == kLength) return slices.read_dense(r);
    if (number == 2 && type == kLength) return slices.read_sparse(r);
    if (number == 3 && type == kVarint) return r.varint(out.clock);
    if (number == 4 && type == kVarint) return r.varint(out.staleness);
    if (number == 5 && type == kVarint) return r.varint(noise_step);
    if (number == 6 && type == kFixed64) return r.fixed64(out.noise.local_sqr);
    if (number == 7 && type == kFixed64) return r.fixed64(out.noise.average_sqr);
    if (number == 8 && type == kFixed64) return r.fixed64(out.noise.small);
    if (number == 9 && type == kFixed64) return r.fixed64(out.noise.big);
    return r.skip(tag);
  });
  if (!read) return false;
  non_negative(noise_step, "noise_step");
  out.noise.step = noise_step - 1;
  slices.trim();
  // Note [The values' mirror] (mirror.h): a reply naming the server's mirror is read from it.
  SharedValues mirror_values;
  const bool mirrored = !mirror_handle.empty();
  if (mirrored) {
    if (mirror == nullptr || !mirror->open)
      throw UsageError("the reply names the server's mirror, which the pull did not offer to read");
    mirror_values = mirror->open(mirror_handle);
    mirror->sequence = mirror_sequence;
    mirror->used = true;
  }
  slices.take_shared(shm, sink, false, mirrored ? &mirror_values : nullptr);
  slices.check(/*values=*/true);
  non_negative(out.clock, "clock");
  non_negative(out.staleness, "staleness");
  slices.deliver(shm, sink, mirrored ? &mirror_values : nullptr);
  return true;
}

bool decode(const grpc::ByteBuffer& in, PushRequest& out, const SharedValues* shm,
            std::shared_ptr<const void> keep) {
  out.keep.reset();
  out.worker = 0;
  out.clock = 0;
  out.rows = 0;
  Reader r(in);
  out.epoch = 0;
  int64_t batch = 0;
  int32_t verdict = 0;
  bool in_place = false;
  out.gradient_sqr = -1;
  Slices slices{out.dense, out.sparse, {}, {}, {}, {}};
  const bool read = r.fields([&](int number, WireType type, uint32_t tag) {
    if (number == 1 && type == kVarint) return r.varint(out.worker);
    if (number == 2 && type == kVarint) return r.varint(out.clock);
    if (number == 3 && type == kVarint) return r.varint(out.rows);
    if (number == 4 && type == kLength) return slices.read_dense(r);
    if (number == 5 && type == kLength) return slices.read_sparse(r);
    if (number == 6 && type == kVarint) return r.varint(out.epoch);
    if (number == 7 && type == kVarint) return r.varint(batch);
    if (number == 8 && type == kVarint) return r.varint(verdict);
    if (number == 9 && type == kFixed64) return r.fixed64(out.gradient_sqr);
    if (number == 10 && type == kVarint) return r.varint(in_place);
    return r.skip(tag);
  });
  if (!read) return false;
  slices.trim();
  out.batch = batch - 1;
  if (verdict < 0 || verdict > 2)
    throw UsageError("verdict = " + std::to_string(verdict) +
                     "; expected 0 (the server decides), 1 (counted) or 2 (dropped)");
  out.verdict = static_cast<PushRequest::Verdict>(verdict);
  non_negative(out.worker, "worker");
  non_negative(out.clock, "clock");
  non_negative(out.rows, "rows");
  non_negative(out.epoch, "epoch");
  if (batch < 0)
    throw UsageError("batch = " + std::to_string(batch) + "; expected 0 (none) or the batch + 1");
  in_place = in_place && keep != nullptr;
  slices.take_shared(shm, nullptr, in_place);
  slices.check(/*values=*/true);
  if (in_place) out.keep = std::move(keep);
  return true;
}

bool decode(const grpc::ByteBuffer& in, PushReply& out) {
  Reader r(in);
  int64_t counted = 0;
  const bool read = r.fields([&](int number, WireType type, uint32_t tag) {
    if (number == 1 && type == kVarint) return r.varint(counted);
    if (number == 2 && type == kVarint) return r.varint(out.clock);
    return r.skip(tag);
  });
  if (!read) return false;
  out.counted = counted != 0;
  non_negative(out.clock, "clock");
  return true;
}

}  // namespace shoal::ps::detail::wire_format
