#include "comm/shm/reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "shoal/core/error.h"

namespace shoal::comm::shm {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Elements reduced at a time: the accumulator stays in L1 while the k inputs stream past it,
// and each input and output is touched once per element (memory-bound, not k - 1 passes).
constexpr size_t kBlockBytes = 4096;

// `scale` multiplies the result (kAvg); 1 leaves it alone.
template <typename T, typename Combine>
void reduce_plain(const void* const* in, int k, size_t n, void* const* out, int outputs,
                  Combine combine, T scale = T(1)) {
  constexpr size_t kBlock = kBlockBytes / sizeof(T);
  alignas(64) T acc[kBlock];
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t m = std::min(kBlock, n - start);
    std::memcpy(acc, static_cast<const T*>(in[0]) + start, m * sizeof(T));
    for (int j = 1; j < k; ++j) {
      const T* __restrict x = static_cast<const T*>(in[j]) + start;
      for (size_t i = 0; i < m; ++i) acc[i] = combine(acc[i], x[i]);
    }
    if (scale != T(1)) {
      for (size_t i = 0; i < m; ++i) acc[i] *= scale;
    }
    for (int o = 0; o < outputs; ++o)
      std::memcpy(static_cast<T*>(out[o]) + start, acc, m * sizeof(T));
  }
}

// 16-bit floats: combined in float, rounded back after each step (Note [Fixed summation order]).
template <float (*kToFloat)(uint16_t), uint16_t (*kFromFloat)(float), typename Combine>
void reduce_half(const void* const* in, int k, size_t n, void* const* out, int outputs,
                 Combine combine, float scale = 1.0f) {
  constexpr size_t kBlock = kBlockBytes / sizeof(float);
  float acc[kBlock];
  uint16_t result[kBlock];
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t m = std::min(kBlock, n - start);
    const uint16_t* x0 = static_cast<const uint16_t*>(in[0]) + start;
    for (size_t i = 0; i < m; ++i) acc[i] = kToFloat(x0[i]);
    for (int j = 1; j < k; ++j) {
      const uint16_t* x = static_cast<const uint16_t*>(in[j]) + start;
      for (size_t i = 0; i < m; ++i) acc[i] = kToFloat(kFromFloat(combine(acc[i], kToFloat(x[i]))));
    }
    for (size_t i = 0; i < m; ++i) result[i] = kFromFloat(acc[i] * scale);
    for (int o = 0; o < outputs; ++o)
      std::memcpy(static_cast<uint16_t*>(out[o]) + start, result, m * 2);
  }
}

template <typename T>
struct Sum {
  T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;  // wraps instead of signed overflow's undefined behaviour
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
template <typename T>
struct Max {
  T operator()(T a, T b) const { return b > a ? b : a; }
};
template <typename T>
struct Min {
  T operator()(T a, T b) const { return b < a ? b : a; }
};

template <typename T>
void reduce_typed(ReduceOp op, const void* const* in, int k, size_t n, void* const* out,
                  int outputs) {
  switch (op) {
    case ReduceOp::kSum:
      return reduce_plain<T>(in, k, n, out, outputs, Sum<T>());
    case ReduceOp::kMax:
      return reduce_plain<T>(in, k, n, out, outputs, Max<T>());
    case ReduceOp::kMin:
      return reduce_plain<T>(in, k, n, out, outputs, Min<T>());
    case ReduceOp::kAvg:
      if constexpr (std::is_floating_point_v<T>) {
        return reduce_plain<T>(in, k, n, out, outputs, Sum<T>(), T(1) / static_cast<T>(k));
      } else {
        throw UsageError("shared memory: avg needs a floating-point dtype");
      }
  }
}

template <float (*kToFloat)(uint16_t), uint16_t (*kFromFloat)(float)>
void reduce_16(ReduceOp op, const void* const* in, int k, size_t n, void* const* out, int outputs) {
  switch (op) {
    case ReduceOp::kSum:
      return reduce_half<kToFloat, kFromFloat>(in, k, n, out, outputs, Sum<float>());
    case ReduceOp::kMax:
      return reduce_half<kToFloat, kFromFloat>(in, k, n, out, outputs, Max<float>());
    case ReduceOp::kMin:
      return reduce_half<kToFloat, kFromFloat>(in, k, n, out, outputs, Min<float>());
    case ReduceOp::kAvg:
      return reduce_half<kToFloat, kFromFloat>(in, k, n, out, outputs, Sum<float>(),
                                               1.0f / static_cast<float>(k));
  }
}

}  // namespace

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return float_of(bits_of(magnitude) | sign);
  }
  if (exponent == 31) return float_of(sign | 0x7f800000u | (mantissa << 13));
  return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest even (F. Giesen's float_to_half_fast3_rtne).
uint16_t float_to_half(float f) {
  uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) {  // 65536 and above, inf, NaN
    return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00));
  }
  if (x < 0x38800000u) {  // below half's smallest normal: let float addition round to 2^-24 units
    const uint32_t rounded = bits_of(float_of(x) + 0.5f) - 0x3f000000u;
    return static_cast<uint16_t>(sign | rounded);
  }
  const uint32_t odd = (x >> 13) & 1;
  x += 0xc8000fffu + odd;  // rebias the exponent (127 -> 15) and round
  return static_cast<uint16_t>(sign | (x >> 13));
}

float bfloat16_to_float(uint16_t b) {
  return float_of(static_cast<uint32_t>(b) << 16);
}

uint16_t float_to_bfloat16(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kUInt8:
    case DType::kInt8:
      return 1;
  }
  throw UsageError("shared memory: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "unknown";
}

void reduce(DType dtype, ReduceOp op, const void* const* in, int k, size_t n, void* const* out,
            int outputs) {
  switch (dtype) {
    case DType::kFloat32:
      return reduce_typed<float>(op, in, k, n, out, outputs);
    case DType::kFloat64:
      return reduce_typed<double>(op, in, k, n, out, outputs);
    case DType::kInt32:
      return reduce_typed<int32_t>(op, in, k, n, out, outputs);
    case DType::kInt64:
      return reduce_typed<int64_t>(op, in, k, n, out, outputs);
    case DType::kUInt8:
      return reduce_typed<uint8_t>(op, in, k, n, out, outputs);
    case DType::kInt8:
      return reduce_typed<int8_t>(op, in, k, n, out, outputs);
    case DType::kFloat16:
      return reduce_16<half_to_float, float_to_half>(op, in, k, n, out, outputs);
    case DType::kBFloat16:
      return reduce_16<bfloat16_to_float, float_to_bfloat16>(op, in, k, n, out, outputs);
  }
}

}  // namespace shoal::comm::shm
