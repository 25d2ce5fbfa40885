// The gossip protocol's datagrams: what they carry, their binary encoding, and the token check.
//
// A datagram is "SHG1", an HMAC-SHA256 of the payload keyed by the job's token, then the payload.
// The one exception is the refusal a member sends to a joiner whose token did not check out:
// "SHGR" alone, unauthenticated, since the two processes share no key. Only a joiner waiting for
// its join answer takes notice of it.
//
// The payload is binary rather than JSON because metadata is an arbitrary byte string (JSON
// wants UTF-8) and its size must be known exactly to keep a datagram under kMaxDatagram.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "swim.h"

namespace shoal::elastic::gossip::wire {

// Below the 64 KiB UDP limit, with room for the IP and UDP headers.
constexpr size_t kMaxDatagram = 60000;

enum class Kind : uint8_t {
  kPing = 1,      // from -> target: are you there? (sent to the target's address)
  kAck = 2,       // answer to a ping (or to news that wants_ack), echoing its seq
  kPingReq = 3,   // ask the receiver to ping target_address for us; ack or nack within nack_after_ms
  kNack = 4,      // an intermediary's "I pinged it and got no answer either"
  kJoin = 5,      // a joiner's entry; answered with kJoinAck carrying the whole table
  kJoinAck = 6,
  kSync = 7,      // push-pull: the sender's whole table; answered with kSyncAck carrying ours
  kSyncAck = 8,
  kNews = 9,      // updates only (a member's own changes, pushed to everyone at once)
};

struct Message {
  Message() = default;
  explicit Message(Kind kind, uint64_t seq = 0) : kind(kind), seq(seq) {}

  Kind kind = Kind::kNews;
  uint64_t seq = 0;
  std::string from;            // the sender's member id
  std::string target;          // kPing, kPingReq: the id of the member to ping
  std::string target_address;  // kPingReq
  uint32_t nack_after_ms = 0;  // kPingReq
  bool wants_ack = false;      // kNews
  std::vector<Member> updates; // piggy-backed updates, or a table's entries
};

std::string encode(const Message& message);
// nullopt for a payload that is truncated or malformed.
std::optional<Message> decode(const std::string& payload);

// Bytes one entry adds to an encoded message.
size_t encoded_size(const Member& member);
// Bytes of an encoded message without its updates, as sealed into a datagram.
size_t sealed_overhead(const Message& message);

// The datagram for `payload` under `token`.
std::string seal(const std::string& token, const std::string& payload);

enum class Opened { kValid, kRefusal, kBadToken, kGarbage };
// Checks a datagram's HMAC; with kValid, *payload is what was sealed. With kBadToken, *payload
// holds the unchecked payload (to tell a refused join apart).
Opened open(const std::string& token, const std::string& datagram, std::string* payload);

// The unauthenticated answer to a join whose token did not check out.
std::string refusal();

}  // namespace shoal::elastic::gossip::wire
