// Stable hashes and counter-based random numbers: their values are fixed by their definitions,
// the same on every host, build and run, unlike std::hash's, std::*_distribution's or torch's
// generators'. Used where a value must be a pure function of its key: the sampler's epoch
// permutation, the parameter server's shard of a row and a row's first value, the synthetic CTR
// data's samples.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shoal::detail {

inline constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;

// splitmix64's output function (Steele, Lea and Flood): a bijection that spreads every input
// bit over the output.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Bytes as lower-case hex digits, two a byte.
inline std::string hex(const unsigned char* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += kDigits[bytes[i] >> 4];
    out += kDigits[bytes[i] & 15];
  }
  return out;
}

// FNV-1a over bytes.
inline uint64_t fnv1a(std::string_view bytes) {
  uint64_t h = 14695981039346656037ULL;  // the offset basis
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

// A hash of a key made of several numbers, e.g. hash_of(seed, table, row).
inline uint64_t hash_of(uint64_t a) { return mix64(a + kGoldenGamma); }
template <typename... Rest>
uint64_t hash_of(uint64_t a, uint64_t b, Rest... rest) {
  return hash_of(mix64(a + kGoldenGamma) ^ b, static_cast<uint64_t>(rest)...);
}

// Uniform in [0, 1) from 53 of the hash's bits.
inline double uniform_of(uint64_t h) { return static_cast<double>(h >> 11) * 0x1.0p-53; }

// Standard normal from two hashes (Box-Muller).
inline double normal_of(uint64_t h1, uint64_t h2) {
  const double u1 = 1.0 - uniform_of(h1);  // in (0, 1]
  const double u2 = uniform_of(h2);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// splitmix64 as a generator: the stream mix64(state + k * gamma), k = 1, 2, ...
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() { return mix64(state_ += kGoldenGamma); }
  // Uniform in [0, bound), without modulo bias: draws below 2^64 mod bound are rejected.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }

 private:
  uint64_t state_;
};

}  // namespace shoal::detail
