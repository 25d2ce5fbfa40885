// The structs of messages.h on the wire, in the format of ps.proto. Reading checks what the
// transport can check without the tables: counts and indices not negative, enum values known,
// float data a whole number of float32 values, pull requests without values, sparse values a
// whole number of rows. A failed check is a UsageError with a one-line message naming the field;
// nothing is read past a size it was not checked against. Private to src/ps.
//
// Note [Values without copies]: pulls and pushes, which carry the values, are written and read
// here field by field rather than through protobuf's generated classes, which would copy each
// float twice on each side (the struct's vector to a `bytes` string to gRPC's slices, and back).
// encode() of a request copies the values once, into the one slice it sends; encode() of a pull's
// reply copies none: the reply's vectors become gRPC slices that free them when gRPC is done with
// them. decode() copies each value once, from the received slices straight into the struct's
// vector (a value may be split across slices). A struct decoded into again keeps its vectors'
// storage: a client or server that reads each step's pull or push into the same struct allocates
// nothing of the values' size after the first (docs/ps.md, "Transport"). The bytes are
// those protobuf writes for ps.proto, and anything protobuf would read is read alike (fields in
// any order, unknown fields skipped, repeated integers packed or not, the last of a repeated
// singular field winning), so other clients may use ps.proto's generated code. Registrations are
// rare and small and stay on the generated classes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "handler.h"
#include "messages.h"
#include "ps.pb.h"
#include "shm.h"

namespace grpc {
class ByteBuffer;
}

namespace shoal::ps::detail::wire_format {

namespace pb = ::shoal::ps::wire;

void to_wire(const RegisterRequest& in, pb::RegisterRequest& out);
RegisterRequest from_wire(const pb::RegisterRequest& in);
void to_wire(const LeaseRequest& in, pb::LeaseRequest& out);
LeaseRequest from_wire(const pb::LeaseRequest& in);
void to_wire(const LeaseReply& in, pb::LeaseReply& out);
LeaseReply from_wire(const pb::LeaseReply& in);
void to_wire(const MembershipRequest& in, pb::MembershipRequest& out);
MembershipRequest from_wire(const pb::MembershipRequest& in);

grpc::ByteBuffer encode(const PullRequest& in);
grpc::ByteBuffer encode(const PushRequest& in);
grpc::ByteBuffer encode(const PushReply& in);
// Takes the reply's values, which gRPC sends from where they are.
grpc::ByteBuffer encode(PullReply&& in);
// The same from a shared reply, which gRPC holds until it has sent the values (its deleter may
// keep it for the next pull).
grpc::ByteBuffer encode(std::shared_ptr<const PullReply> in);

// Note [Values in shared memory]: a push, or a pull's reply, whose dense values go through the
// connection's shared segment (src/ps/shm.h) rather than the message: they are copied into
// `shm` in slice order (dense_values(...) of them, which must fit), and each dense slice carries
// their count (ps.proto's DenseSlice.shared) instead. Sparse values stay in the message.
size_t dense_values(const std::vector<DenseSlice>& dense);
// With `source`, the push's dense slices carry no values: `source` writes them into `shm`.
// `in_place`: the caller leaves them in `shm` until the push is applied, and the server may read
// them there (ps.proto's PushRequest.in_place; Note [Pushes read in place] in server_steps.cpp).
grpc::ByteBuffer encode(const PushRequest& in, const SharedValues& shm,
                        const DenseSource* source = nullptr, bool in_place = false);
grpc::ByteBuffer encode(const PullReply& in, const SharedValues& shm);
// A reply whose dense values are in the segment already, `out.counts[i]` of them for dense slice
// i in slice order, or in the server's mirror (DenseOut, handler.h); its dense slices carry no
// values.
grpc::ByteBuffer encode(const PullReply& in, const DenseOut& out);
// A reply's values in a server's mirror (Note [The values' mirror] in mirror.h): decode() opens
// the mirror a reply names with `open` (which may throw SegmentUnusable, passed on), and tells
// `sequence` the mirror's sequence the reply carries.
struct MirrorReader {
  std::function<SharedValues(const std::string& handle)> open;
  uint64_t sequence = 0;  // set by decode()
  bool used = false;      // set by decode(): the reply named the mirror
};

// false when `in` is not a message of that type (truncated or corrupt); UsageError when it is
// one whose fields fail a check. `out` is only meaningful after true. `shm`: the segment the call
// brought, whose values dense slices may name (a count past its end, or values named without a
// segment, is a UsageError); nullptr when it brought none.
bool decode(const grpc::ByteBuffer& in, PullRequest& out);
// `sink`: takes the dense values a reply names in `shm` in place of copying them into `out`
// (DenseSink, messages.h), once every slice's count is checked against the segment.
bool decode(const grpc::ByteBuffer& in, PullReply& out, const SharedValues* shm = nullptr,
            const DenseSink* sink = nullptr, MirrorReader* mirror = nullptr);
// `keep`: what `shm` lives in; with it, a push sent in place has its dense values read where they
// are (DenseSlice::view, kept by out.keep: Note [Pushes read in place] in server_steps.cpp)
// rather than copied into `out`.
bool decode(const grpc::ByteBuffer& in, PushRequest& out, const SharedValues* shm = nullptr,
            std::shared_ptr<const void> keep = nullptr);
bool decode(const grpc::ByteBuffer& in, PushReply& out);

}  // namespace shoal::ps::detail::wire_format
