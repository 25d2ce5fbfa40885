// The parameter server's codec underneath wire.cpp (Note [Values without copies], wire.h): a
// Writer that fills one slice of a size computed beforehand, or lends large values to gRPC as
// slices of their own, and a Reader over a message's received slices. Varints, tags and sizes
// are protobuf's own (CodedOutputStream, CodedInputStream, WireFormatLite); what is written here
// is where each field's bytes go, so that values are copied at most once. Private to wire.cpp.
#pragma once

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpc/slice.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "messages.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail::wire_format {

using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using WireFormat = google::protobuf::internal::WireFormatLite;

// ---- writing ----

// Sizes as protobuf's coded streams count them. int32 and int64 fields are written as protobuf
// does: negative numbers sign-extended to 64 bits (WireFormatLite::Int64Size).
inline size_t varint_size(uint64_t value) {
  return CodedOutputStream::VarintSize64(value);
}
inline size_t packed_size(const std::vector<int64_t>& values) {
  size_t size = 0;
  for (int64_t value : values) size += WireFormat::Int64Size(value);
  return size;
}
// A field's size with its tag (all field numbers here are below 16: one byte of tag).
inline size_t varint_field_size(int64_t value) {
  return value == 0 ? 0 : 1 + WireFormat::Int64Size(value);
}
// A double (wire type 1, eight bytes) with its tag; 0 is written only when `always`.
inline size_t double_field_size(double value, bool always = false) {
  return value == 0 && !always ? 0 : 1 + sizeof(uint64_t);
}
inline size_t length_field_size(size_t length, bool always = false) {
  return length == 0 && !always ? 0 : 1 + varint_size(length) + length;
}
inline size_t values_bytes(const std::vector<float>& values) {
  return values.size() * sizeof(float);
}

// A slice (dense: chunks, sparse: ids) of `count` values without its own tag and length.
inline size_t slice_size(int32_t table, const std::vector<int64_t>& indices, size_t count) {
  return varint_field_size(table) + length_field_size(packed_size(indices)) +
         length_field_size(count * sizeof(float));
}
inline size_t slice_size(int32_t table, const std::vector<int64_t>& indices,
                  const std::vector<float>& values) {
  return slice_size(table, indices, values.size());
}

// A dense slice whose values are in the shared segment (field 4: their count).
inline size_t shared_slice_size(int32_t table, const std::vector<int64_t>& indices, size_t count,
                                uint64_t mirror_at = 0) {
  return varint_field_size(table) + length_field_size(packed_size(indices)) +
         varint_field_size(static_cast<int64_t>(count)) +
         varint_field_size(static_cast<int64_t>(mirror_at));
}

// Values shorter than this are copied beside the fields around them rather than lent to gRPC as
// a slice of their own, whose bookkeeping costs more than the copy.
constexpr size_t kLendAtLeast = 8 << 10;

// Writes a message either into one slice of the size computed beforehand (values copied), or as
// a list of slices in which values of at least kLendAtLeast bytes are lent from `owner`'s vectors.
class Writer {
 public:
  explicit Writer(size_t size) : slice_(grpc_slice_malloc(size)) {
    at_ = GRPC_SLICE_START_PTR(slice_);
    end_ = at_ + size;
  }
  explicit Writer(std::shared_ptr<const void> owner) : owner_(std::move(owner)) {}
  ~Writer() {
    if (!owner_) grpc_slice_unref(slice_);
  }
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  void varint(uint64_t value) {
    uint8_t bytes[10];  // a varint of 64 bits takes at most 10 bytes
    const uint8_t* end = CodedOutputStream::WriteVarint64ToArray(value, bytes);
    raw(bytes, static_cast<size_t>(end - bytes));
  }
  void tag(int field, WireFormat::WireType type) { varint(WireFormat::MakeTag(field, type)); }
  void varint_field(int field, int64_t value) {
    if (value == 0) return;
    tag(field, WireFormat::WIRETYPE_VARINT);
    varint(static_cast<uint64_t>(value));
  }
  void double_field(int field, double value, bool always = false) {
    if (value == 0 && !always) return;
    tag(field, WireFormat::WIRETYPE_FIXED64);
    uint8_t bytes[sizeof(uint64_t)];
    CodedOutputStream::WriteLittleEndian64ToArray(WireFormat::EncodeDouble(value), bytes);
    raw(bytes, sizeof(bytes));
  }
  void length(int field, size_t length) {
    tag(field, WireFormat::WIRETYPE_LENGTH_DELIMITED);
    varint(length);
  }
  void packed(int field, const std::vector<int64_t>& values) {
    if (values.empty()) return;
    length(field, packed_size(values));
    for (int64_t value : values) varint(static_cast<uint64_t>(value));
  }
  void values(int field, const float* values, size_t count) {
    if (count == 0) return;
    const size_t bytes = count * sizeof(float);
    length(field, bytes);
    if (!owner_ || bytes < kLendAtLeast) {
      raw(values, bytes);
      return;
    }
    flush();
    // Each lent slice holds a reference to the owner, dropped when gRPC frees the slice.
    auto* keep = new std::shared_ptr<const void>(owner_);
    lent_.emplace_back(
        const_cast<float*>(values), bytes,
        [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, keep);
  }
  void slice(int field, int32_t table, const std::vector<int64_t>& indices, const float* values,
             size_t count) {
    length(field, slice_size(table, indices, count));
    varint_field(1, table);
    packed(2, indices);
    this->values(3, values, count);
  }
  void slice(int field, int32_t table, const std::vector<int64_t>& indices,
             const std::vector<float>& values) {
    slice(field, table, indices, values.data(), values.size());
  }

  // `mirror_at`: where the values are in the server's mirror, plus 1; 0: in the segment.
  void shared_slice(int field, int32_t table, const std::vector<int64_t>& indices, size_t count,
                    uint64_t mirror_at = 0) {
    length(field, shared_slice_size(table, indices, count, mirror_at));
    varint_field(1, table);
    packed(2, indices);
    varint_field(4, static_cast<int64_t>(count));
    varint_field(5, static_cast<int64_t>(mirror_at));
  }
  void string_field(int field, const std::string& text) {
    if (text.empty()) return;
    length(field, text.size());
    raw(text.data(), text.size());
  }

  grpc::ByteBuffer finish() {
    if (!owner_) {
      SHOAL_CHECK(at_ == end_) << "a message was written " << (end_ - at_)
                               << " bytes short of its computed size";
      grpc::Slice whole(slice_, grpc::Slice::ADD_REF);
      return grpc::ByteBuffer(&whole, 1);
    }
    flush();
    return grpc::ByteBuffer(lent_.data(), lent_.size());
  }

 private:
  void raw(const void* data, size_t size) {
    if (owner_) {
      head_.append(static_cast<const char*>(data), size);
      return;
    }
    SHOAL_CHECK(size <= static_cast<size_t>(end_ - at_))
        << "a message outgrew its computed size by " << size - (end_ - at_) << " bytes";
    std::memcpy(at_, data, size);
    at_ += size;
  }
  void flush() {
    if (head_.empty()) return;
    lent_.emplace_back(head_);
    head_.clear();
  }

  // Copying: the one slice, and where the next byte goes.
  grpc_slice slice_ = grpc_empty_slice();
  uint8_t* at_ = nullptr;
  uint8_t* end_ = nullptr;
  // Lending: the slices so far, and the bytes written since the last lent values.
  std::shared_ptr<const void> owner_;
  std::vector<grpc::Slice> lent_;
  std::string head_;
};

// A slice's indices: a dense slice's chunks, a sparse slice's row ids (both field 2).
inline const std::vector<int64_t>& indices_of(const DenseSlice& slice) {
  return slice.chunks;
}
inline const std::vector<int64_t>& indices_of(const SparseSlice& slice) {
  return slice.ids;
}
// A slice's count of values: a dense push's may be a view (DenseSlice::view).
inline size_t count_of(const DenseSlice& slice) {
  return slice.count();
}
inline size_t count_of(const SparseSlice& slice) {
  return slice.values.size();
}

// Repeated slices with their tags and lengths (a slice is written even when empty).
template <typename Slice>
size_t slices_size(const std::vector<Slice>& slices) {
  size_t size = 0;
  for (const Slice& s : slices) {
    size += length_field_size(slice_size(s.table, indices_of(s), count_of(s)), /*always=*/true);
  }
  return size;
}

// ---- reading ----

// Reads a message from a ByteBuffer's slices. `left()` bounds every length a message claims by
// what is really there, so a hostile length cannot make the reader reserve memory.
class Reader {
 public:
  explicit Reader(const grpc::ByteBuffer& in)
      : buffer_(in), stream_(&buffer_), in_(&stream_), size_(static_cast<int64_t>(in.Length())) {}

  CodedInputStream& in() { return in_; }
  int64_t left() const {
    const int64_t to_end = size_ - in_.CurrentPosition();
    const int limit = in_.BytesUntilLimit();
    return limit >= 0 ? std::min<int64_t>(to_end, limit) : to_end;
  }
  // A length: read whole (ReadVarint32 would keep the low 32 bits of a longer varint).
  bool length(uint32_t& out) {
    uint64_t value = 0;
    if (!in_.ReadVarint64(&value) || value > static_cast<uint64_t>(left())) return false;
    out = static_cast<uint32_t>(value);
    return true;
  }
  bool varint(uint64_t& out) { return in_.ReadVarint64(&out); }
  template <typename Int>
  bool varint(Int& out) {
    uint64_t value = 0;
    if (!in_.ReadVarint64(&value)) return false;
    out = static_cast<Int>(static_cast<int64_t>(value));  // protobuf's int32: truncated
    return true;
  }

  // A `string` field of at most `most` bytes (a longer one is not a message of this kind).
  bool text(std::string& out, uint32_t most) {
    uint32_t size = 0;
    if (!length(size) || size > most) return false;
    return in_.ReadString(&out, static_cast<int>(size));
  }

  bool fixed64(double& out) {
    uint64_t bits = 0;
    if (!in_.ReadLittleEndian64(&bits)) return false;
    out = WireFormat::DecodeDouble(bits);
    return true;
  }

  // A repeated int64 field, one value (wire type 0) or packed (wire type 2).
  bool int64s(WireFormat::WireType type, std::vector<int64_t>& out) {
    if (type == WireFormat::WIRETYPE_VARINT) {
      int64_t value = 0;
      if (!varint(value)) return false;
      out.push_back(value);
      return true;
    }
    uint32_t size = 0;
    if (!length(size)) return false;
    const auto limit = in_.PushLimit(static_cast<int>(size));
    while (in_.BytesUntilLimit() > 0) {
      int64_t value = 0;
      if (!varint(value)) return false;
      out.push_back(value);
    }
    in_.PopLimit(limit);
    return true;
  }

  // A `bytes` field of float32 values, read straight from the slices into `out`.
  bool values(std::vector<float>& out, int64_t& odd_bytes) {
    uint32_t size = 0;
    if (!length(size)) return false;
    out.clear();
    odd_bytes = -1;
    if (size % sizeof(float) != 0) {
      odd_bytes = size;
      return in_.Skip(static_cast<int>(size));
    }
    out.reserve(size / sizeof(float));
    uint8_t carry[sizeof(float)];
    size_t carried = 0;  // bytes of a value split across two slices
    for (uint32_t left = size; left > 0;) {
      const void* data = nullptr;
      int available = 0;
      if (!in_.GetDirectBufferPointer(&data, &available)) return false;
      const size_t n = std::min<size_t>(left, static_cast<size_t>(available));
      const uint8_t* at = static_cast<const uint8_t*>(data);
      const uint8_t* const end = at + n;
      if (carried > 0) {
        const size_t take = std::min<size_t>(sizeof(float) - carried, n);
        std::memcpy(carry + carried, at, take);
        carried += take;
        at += take;
        if (carried == sizeof(float)) {
          out.push_back(float_at(carry));
          carried = 0;
        }
      }
      const size_t whole = static_cast<size_t>(end - at) / sizeof(float);
      out.insert(out.end(), Floats{at}, Floats{at + whole * sizeof(float)});
      at += whole * sizeof(float);
      std::memcpy(carry + carried, at, static_cast<size_t>(end - at));
      carried += static_cast<size_t>(end - at);
      in_.Skip(static_cast<int>(n));
      left -= static_cast<uint32_t>(n);
    }
    return true;
  }

  // Calls `field(number, type)` for each field of the message (or of the submessage under the
  // current limit); `field` returns false for a malformed one, or skips what it does not know.
  template <typename Field>
  bool fields(Field&& field) {
    for (;;) {
      const uint32_t tag = in_.ReadTag();
      if (tag == 0) return in_.ConsumedEntireMessage();
      if (WireFormat::GetTagFieldNumber(tag) == 0) return false;
      if (!field(WireFormat::GetTagFieldNumber(tag), WireFormat::GetTagWireType(tag), tag)) {
        return false;
      }
    }
  }
  bool skip(uint32_t tag) { return WireFormat::SkipField(&in_, tag); }

  template <typename Body>
  bool submessage(Body&& body) {
    uint32_t size = 0;
    if (!length(size)) return false;
    const auto limit = in_.PushLimit(static_cast<int>(size));
    if (!body()) return false;
    in_.PopLimit(limit);
    return true;
  }

 private:
  // Unaligned float32 values in place, as an iterator: the vector's insert reserves once and
  // copies each value once.
  struct Floats {
    using iterator_category = std::random_access_iterator_tag;
    using value_type = float;
    using difference_type = std::ptrdiff_t;
    using pointer = const float*;
    using reference = float;
    const uint8_t* at;
    float operator*() const { return float_at(at); }
    Floats& operator++() {
      at += sizeof(float);
      return *this;
    }
    Floats operator++(int) {
      Floats old = *this;
      at += sizeof(float);
      return old;
    }
    Floats& operator--() {
      at -= sizeof(float);
      return *this;
    }
    Floats operator+(difference_type n) const {
      Floats moved = *this;
      return moved += n;
    }
    float operator[](difference_type n) const { return *(*this + n); }
    bool operator<(const Floats& other) const { return at < other.at; }
    Floats& operator+=(difference_type n) {
      at += n * static_cast<difference_type>(sizeof(float));
      return *this;
    }
    difference_type operator-(const Floats& other) const {
      return (at - other.at) / static_cast<difference_type>(sizeof(float));
    }
    bool operator==(const Floats& other) const { return at == other.at; }
    bool operator!=(const Floats& other) const { return at != other.at; }
  };
  static float float_at(const uint8_t* at) {
    float value;
    std::memcpy(&value, at, sizeof(value));
    return value;
  }

  grpc::ByteBuffer
      buffer_;  // a reference to the caller's slices; ProtoBufferReader needs it mutable
  grpc::ProtoBufferReader stream_;
  CodedInputStream in_;
  const int64_t size_;
};

}  // namespace shoal::ps::detail::wire_format
