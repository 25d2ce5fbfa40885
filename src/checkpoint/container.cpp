#include "container.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>

#include "shoal/core/error.h"

namespace shoal::checkpoint {
namespace {

constexpr size_t kVersionOffset = 8, kReservedOffset = 12, kLengthOffset = 16, kPayloadCrcOffset = 24,
                 kHeaderCrcOffset = 28;

template <typename T>
void put_le(std::string& out, size_t offset, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) out[offset + i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

template <typename T>
T get_le(std::string_view in, size_t offset) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(static_cast<unsigned char>(in[offset + i])) << (8 * i);
  return value;
}

std::string hex32(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", value);
  return text;
}

// The magic as printable text: what a user sees when they opened the wrong file.
std::string printable(std::string_view bytes) {
  std::string text;
  for (unsigned char c : bytes) {
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '"') {
      text += static_cast<char>(c);
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      text += escaped;
    }
  }
  return "\"" + text + "\"";
}

std::string expected_complete() { return "; expected a complete file written by shoal::save"; }

}  // namespace

uint32_t crc32_of(std::string_view bytes) {
  // crc32_z takes a size_t length; plain crc32 would need chunks for payloads over 4 GiB.
  return static_cast<uint32_t>(
      crc32_z(crc32_z(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

std::string encode_header(std::string_view payload) {
  std::string header(kHeaderSize, '\0');
  std::copy(kMagic.begin(), kMagic.end(), header.begin());
  put_le<uint32_t>(header, kVersionOffset, kFormatVersion);
  put_le<uint32_t>(header, kReservedOffset, 0);
  put_le<uint64_t>(header, kLengthOffset, payload.size());
  put_le<uint32_t>(header, kPayloadCrcOffset, crc32_of(payload));
  put_le<uint32_t>(header, kHeaderCrcOffset, crc32_of(std::string_view(header).substr(0, kHeaderCrcOffset)));
  return header;
}

std::string_view open_container(const std::string& path, std::string_view file) {
  const std::string name = "checkpoint " + path;
  // A prefix of the magic is a cut checkpoint; anything else is some other file.
  const size_t magic_present = std::min(file.size(), kMagic.size());
  if (file.substr(0, magic_present) != kMagic.substr(0, magic_present)) {
    throw UsageError(name + " is not a shoal checkpoint: it starts with " + printable(file.substr(0, magic_present)) +
                     ", not " + printable(kMagic) + "; expected a file written by shoal::save");
  }
  if (file.size() < kHeaderSize) {
    throw UsageError(name + " is truncated: it has " + std::to_string(file.size()) + " bytes, fewer than the " +
                     std::to_string(kHeaderSize) + " of the header" + expected_complete());
  }
  const std::string_view header = file.substr(0, kHeaderSize);
  const uint32_t header_crc = get_le<uint32_t>(header, kHeaderCrcOffset);
  const uint32_t header_actual = crc32_of(header.substr(0, kHeaderCrcOffset));
  if (header_crc != header_actual) {
    throw UsageError(name + " is corrupt: checksum mismatch in the header (computed " + hex32(header_actual) +
                     ", stored " + hex32(header_crc) + ")" + expected_complete());
  }
  const uint32_t version = get_le<uint32_t>(header, kVersionOffset);
  if (version != kFormatVersion) {
    throw UsageError(name + " has format version " + std::to_string(version) + "; this shoal reads version " +
                     std::to_string(kFormatVersion) + " (expected a checkpoint written by this version of shoal)");
  }
  const uint64_t length = get_le<uint64_t>(header, kLengthOffset);
  const uint64_t found = file.size() - kHeaderSize;
  if (found < length) {
    throw UsageError(name + " is truncated: the header says " + std::to_string(length) + " bytes of payload, found " +
                     std::to_string(found) + expected_complete());
  }
  if (found > length) {
    throw UsageError(name + " is corrupt: the header says " + std::to_string(length) + " bytes of payload, found " +
                     std::to_string(found) + " (data after the end)" + expected_complete());
  }
  const std::string_view payload = file.substr(kHeaderSize);
  const uint32_t payload_crc = get_le<uint32_t>(header, kPayloadCrcOffset);
  const uint32_t payload_actual = crc32_of(payload);
  if (payload_crc != payload_actual) {
    throw UsageError(name + " is corrupt: checksum mismatch in the payload (computed " + hex32(payload_actual) +
                     ", stored " + hex32(payload_crc) + ")" + expected_complete());
  }
  return payload;
}

}  // namespace shoal::checkpoint
