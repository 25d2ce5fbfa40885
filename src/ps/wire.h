// The structs of messages.h to and from their protobuf messages (ps.proto). Reading checks what
// the transport can check without the tables: counts and indices not negative, enum values
// known, float data a whole number of float32 values, pull requests without values, sparse
// values a whole number of rows. A failed check is a UsageError with a one-line message naming
// the field; nothing is read past a size it was not checked against. Private to src/ps.
#pragma once

#include "messages.h"
#include "ps.pb.h"

namespace shoal::ps::detail::wire_format {

namespace pb = ::shoal::ps::wire;

void to_wire(const RegisterRequest& in, pb::RegisterRequest& out);
void to_wire(const PullRequest& in, pb::PullRequest& out);
void to_wire(const PullReply& in, pb::PullReply& out);
void to_wire(const PushRequest& in, pb::PushRequest& out);
void to_wire(const PushReply& in, pb::PushReply& out);

RegisterRequest from_wire(const pb::RegisterRequest& in);
PullRequest from_wire(const pb::PullRequest& in);
PullReply from_wire(const pb::PullReply& in);
PushRequest from_wire(const pb::PushRequest& in);
PushReply from_wire(const pb::PushReply& in);

}  // namespace shoal::ps::detail::wire_format
