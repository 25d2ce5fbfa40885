// Element types and reductions of the shared-memory collectives, on raw buffers. Torch-free.
//
// Note [Fixed summation order]: an element's result is ((x_0 op x_1) op x_2) ... op x_{k-1}, with
// x_m member m's value, whoever computes it and however the members' timing falls; a result is
// computed once, by one member, and copied by the others, so it is bitwise equal everywhere.
// float16 and bfloat16 are combined in float and rounded to nearest-even after every step, as
// Gloo's half type does, so each step is the correctly rounded half result. Integer sums wrap
// (two's complement). max/min keep the earlier operand unless the later one compares greater
// (less), so a NaN is kept only when it comes first. avg is the sum, then multiplied by 1/k in the
// same pass (as torch's division by a scalar does: a multiplication by its reciprocal), for
// floating types only; it saves the caller a pass over the result.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shoal::comm::shm {

enum class DType : uint8_t {
  kFloat32,
  kFloat64,
  kInt32,
  kInt64,
  kUInt8,
  kInt8,
  kFloat16,
  kBFloat16
};
enum class ReduceOp : uint8_t { kSum, kMax, kMin, kAvg };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* op_name(ReduceOp op);

// out[o][i] = in[0][i] op in[1][i] op ... op in[k-1][i] for i < n and each of the `outputs`
// outputs (Note [Fixed summation order]). An output may be the same buffer as an input (not a
// shifted overlap).
void reduce(DType dtype, ReduceOp op, const void* const* in, int k, size_t n, void* const* out,
            int outputs);

// IEEE half and bfloat16 bits to float and back (round to nearest even; NaN stays NaN).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace shoal::comm::shm
