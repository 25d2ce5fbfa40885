// The checkpoint file's container: a fixed header that says how long the payload is and what
// its checksum must be, then the payload (a torch::serialize archive; see contents.h).
//
//   offset  size  field
//        0     8  magic "SHOALCKP"
//        8     4  format version, 1
//       12     4  reserved, 0
//       16     8  payload length in bytes
//       24     4  CRC-32 of the payload (zlib's crc32)
//       28     4  CRC-32 of bytes 0..27
//
// Integers are little-endian. The header has its own checksum so that a damaged length field
// reads as "corrupt" rather than as a misleading "truncated". Private to src/checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shoal::checkpoint {

inline constexpr std::string_view kMagic = "SHOALCKP";
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr size_t kHeaderSize = 32;

// CRC-32 (zlib's, the one of gzip and PNG) of any number of bytes.
uint32_t crc32_of(std::string_view bytes);

// The header of a file whose payload is `payload`.
std::string encode_header(std::string_view payload);

// Checks that `file`, the whole content of the checkpoint at `path`, is a complete, intact
// shoal checkpoint, and returns its payload (a view into `file`). UsageError otherwise, one line
// naming `path` and what was wrong: not a checkpoint, a newer format, truncated, corrupt.
std::string_view open_container(const std::string& path, std::string_view file);

}  // namespace shoal::checkpoint
