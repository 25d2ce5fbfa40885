#include "wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstring>

namespace shoal::elastic::gossip::wire {
namespace {

constexpr char kSealedMagic[] = "SHG1";
constexpr char kRefusalMagic[] = "SHGR";
constexpr size_t kMagicSize = 4;
constexpr size_t kMacSize = 32;  // SHA-256

// Integers little-endian, strings as a 32-bit length then the bytes.
class Writer {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  bool u8(uint8_t* v) {
    if (pos_ + 1 > in_.size()) return false;
    *v = static_cast<uint8_t>(in_[pos_++]);
    return true;
  }
  bool u32(uint32_t* v) { return uint(v, 4); }
  bool u64(uint64_t* v) { return uint(v, 8); }
  bool str(std::string* s) {
    uint32_t size = 0;
    if (!u32(&size) || size > in_.size() - pos_) return false;
    s->assign(in_, pos_, size);
    pos_ += size;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  template <typename T>
  bool uint(T* v, int bytes) {
    if (pos_ + bytes > in_.size()) return false;
    *v = 0;
    for (int i = 0; i < bytes; ++i) *v |= static_cast<T>(static_cast<uint8_t>(in_[pos_++])) << (8 * i);
    return true;
  }
  const std::string& in_;
  size_t pos_ = 0;
};

void write_member(Writer& w, const Member& m) {
  w.str(m.id);
  w.str(m.address);
  w.u8(static_cast<uint8_t>(m.status));
  w.u64(m.incarnation);
  w.str(m.meta);
}

bool read_member(Reader& r, Member* m) {
  uint8_t status = 0;
  if (!r.str(&m->id) || !r.str(&m->address) || !r.u8(&status) || !r.u64(&m->incarnation) || !r.str(&m->meta)) {
    return false;
  }
  if (status > static_cast<uint8_t>(Status::kLeft)) return false;
  m->status = static_cast<Status>(status);
  return true;
}

std::string mac(const std::string& token, const std::string& payload) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(payload.data()), payload.size(), out, &size);
  return std::string(reinterpret_cast<const char*>(out), size);
}

}  // namespace

std::string encode(const Message& message) {
  Writer w;
  w.u8(static_cast<uint8_t>(message.kind));
  w.u64(message.seq);
  w.str(message.from);
  w.str(message.target);
  w.str(message.target_address);
  w.u32(message.nack_after_ms);
  w.u8(message.wants_ack ? 1 : 0);
  w.u32(static_cast<uint32_t>(message.updates.size()));
  for (const auto& m : message.updates) write_member(w, m);
  return w.take();
}

std::optional<Message> decode(const std::string& payload) {
  Reader r(payload);
  Message message;
  uint8_t kind = 0;
  uint8_t wants_ack = 0;
  uint32_t count = 0;
  if (!r.u8(&kind) || kind < static_cast<uint8_t>(Kind::kPing) || kind > static_cast<uint8_t>(Kind::kNews)) {
    return std::nullopt;
  }
  message.kind = static_cast<Kind>(kind);
  if (!r.u64(&message.seq) || !r.str(&message.from) || !r.str(&message.target) ||
      !r.str(&message.target_address) || !r.u32(&message.nack_after_ms) || !r.u8(&wants_ack) || !r.u32(&count)) {
    return std::nullopt;
  }
  message.wants_ack = wants_ack != 0;
  if (count > payload.size()) return std::nullopt;  // each entry takes more than a byte
  message.updates.resize(count);
  for (auto& m : message.updates) {
    if (!read_member(r, &m)) return std::nullopt;
  }
  if (!r.done()) return std::nullopt;
  return message;
}

size_t encoded_size(const Member& member) {
  return 4 + member.id.size() + 4 + member.address.size() + 1 + 8 + 4 + member.meta.size();
}

size_t sealed_overhead(const Message& message) {
  Message bare = message;
  bare.updates.clear();
  return kMagicSize + kMacSize + encode(bare).size();
}

std::string seal(const std::string& token, const std::string& payload) {
  return std::string(kSealedMagic, kMagicSize) + mac(token, payload) + payload;
}

Opened open(const std::string& token, const std::string& datagram, std::string* payload) {
  if (datagram.size() == kMagicSize && datagram.compare(0, kMagicSize, kRefusalMagic) == 0) {
    return Opened::kRefusal;
  }
  if (datagram.size() < kMagicSize + kMacSize || datagram.compare(0, kMagicSize, kSealedMagic) != 0) {
    return Opened::kGarbage;
  }
  payload->assign(datagram, kMagicSize + kMacSize, std::string::npos);
  const std::string expected = mac(token, *payload);
  if (CRYPTO_memcmp(expected.data(), datagram.data() + kMagicSize, kMacSize) != 0) return Opened::kBadToken;
  return Opened::kValid;
}

std::string refusal() { return std::string(kRefusalMagic, kMagicSize); }

}  // namespace shoal::elastic::gossip::wire
