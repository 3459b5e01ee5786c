#pragma once

// KV storage types and their conversions. Usable from host code and, under nvcc, device code.
//
// The 8-bit formats are scaled: a stored code c of a block's head stands for c * scale, with one
// f32 scale per (block, layer, K or V, KV head) kept in the block itself (pool_layout.h says
// where). WriteKv picks the scale from the head's largest magnitude (ScaleFor): absmax / 127 for
// int8; for fp8 e4m3 the smallest power of two >= absmax / 448 (the format's precision is
// relative, so a power of two costs nothing, and re-encoding under a grown scale is exact).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

#if defined(__CUDACC__)
#define KVPOOL_HOST_DEVICE __host__ __device__
#else
#define KVPOOL_HOST_DEVICE
#endif

namespace kvpool::kernels {

// kFp8E4M3: OCP fp8 e4m3 "fn" (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN, largest finite 448). kInt8: symmetric two's complement, codes
// [-127, 127]. Both carry a scale (above).
enum class DType : uint8_t { kF32, kF16, kBF16, kFp8E4M3, kInt8 };
inline constexpr int kNumDTypes = 5;

KVPOOL_HOST_DEVICE constexpr int32_t DTypeSize(DType dtype) {
  return dtype == DType::kF32 ? 4 : (dtype == DType::kF16 || dtype == DType::kBF16) ? 2 : 1;
}

// True for the formats whose blocks carry a scale per head (the 8-bit ones).
KVPOOL_HOST_DEVICE constexpr bool DTypeHasScales(DType dtype) {
  return dtype == DType::kFp8E4M3 || dtype == DType::kInt8;
}

// The largest code magnitude of a scaled format (what a head's absmax maps to); 0 otherwise.
KVPOOL_HOST_DEVICE constexpr float DTypeMaxCode(DType dtype) {
  return dtype == DType::kFp8E4M3 ? 448.0f : dtype == DType::kInt8 ? 127.0f : 0.0f;
}

std::string_view DTypeName(DType dtype);
// "f32", "f16", "bf16", "fp8" (e4m3), "int8". Errors: INVALID_ARGUMENT naming the valid names.
absl::StatusOr<DType> ParseDType(std::string_view name);

// The poison pattern of each type: a quiet NaN with a recognisable payload, so a read of a block
// nobody wrote shows up as NaN (and as 0x..DEAD-ish bits in a dump).
inline constexpr uint32_t kPoisonF32 = 0x7FDEAD00u;
inline constexpr uint16_t kPoisonF16 = 0x7EADu;
inline constexpr uint16_t kPoisonBF16 = 0x7FDEu;
// 8-bit formats: every code byte 0x7F (NaN in e4m3, 127 in int8) and every scale kPoisonF32, so
// a read of a poisoned 8-bit head is NaN through its scale.
inline constexpr uint8_t kPoison8 = 0x7Fu;

// Scalar conversions (round to nearest even). Vectorized kernels use their own.
KVPOOL_HOST_DEVICE inline float BF16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

KVPOOL_HOST_DEVICE inline uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // keep NaN a NaN
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToFloat(uint16_t h);
uint16_t FloatToF16(float f);

// fp8 e4m3 code -> its value (unscaled). Exact.
KVPOOL_HOST_DEVICE inline float Fp8E4M3ToFloat(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t exponent = (c >> 3) & 0xFu;
  const uint32_t mantissa = c & 0x7u;
  uint32_t bits;
  if (exponent == 0xFu && mantissa == 0x7u) {
    bits = sign | 0x7FC00000u;  // NaN
  } else if (exponent == 0) {
    // Subnormal: mantissa * 2^-9, exact in f32 (build it from the integer).
    const float f = static_cast<float>(mantissa) * 0.001953125f;
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else {
    bits = sign | ((exponent + 120) << 23) | (mantissa << 20);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The scale WriteKv gives a head of an 8-bit `dtype` whose largest magnitude is `absmax`
// (NaN stays NaN, 0 gives 0).
KVPOOL_HOST_DEVICE inline float ScaleFor(DType dtype, float absmax) {
  const float need = absmax / DTypeMaxCode(dtype);
  if (dtype != DType::kFp8E4M3 || !(need > 0.0f) || !(need < 3.0e38f)) return need;
  int exponent;
  const float mantissa = frexpf(need, &exponent);  // need = mantissa * 2^exponent, [0.5, 1)
  return ldexpf(1.0f, mantissa == 0.5f ? exponent - 1 : exponent);
}

// The vector kernels widen fp8 e4m3 codes through f16: a code's bits moved into an f16 (sign to
// the sign, the 7 other bits to the low exponent and top mantissa bits) are its value / 256,
// subnormals included. They multiply the head's scale by this instead of every value.
KVPOOL_HOST_DEVICE constexpr float WidenedUnit(DType dtype) {
  return dtype == DType::kFp8E4M3 ? 256.0f : 1.0f;
}

// f32 -> fp8 e4m3 code: round to nearest even, saturating at +-448 (no infinities in the
// format); NaN -> 0x7F (with the sign).
KVPOOL_HOST_DEVICE inline uint8_t FloatToFp8E4M3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);
  if (abs >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448: saturate
  if (abs < 0x3C800000u) {  // below 2^-6: subnormal codes are multiples of 2^-9
    float magnitude;
    std::memcpy(&magnitude, &abs, sizeof(magnitude));
    // 2^23 + x * 2^9 rounds x * 2^9 to an integer (nearest even) in the low mantissa bits.
    const float shifted = magnitude * 512.0f + 8388608.0f;
    uint32_t q;
    std::memcpy(&q, &shifted, sizeof(q));
    return static_cast<uint8_t>(sign | (q & 0xFu));  // 0 ... 8 (8 is the smallest normal)
  }
  const uint32_t rounded = abs + 0x7FFFFu + ((abs >> 20) & 1u);
  const uint32_t code = (rounded >> 20) - (120u << 3);
  return static_cast<uint8_t>(sign | (code > 0x7Eu ? 0x7Eu : code));
}

// f32 -> int8 code: round to nearest even, saturating at +-127; NaN -> 0 (the head's scale
// carries the NaN, see WriteKv).
KVPOOL_HOST_DEVICE inline int8_t FloatToInt8(float f) {
  if (!(f == f)) return 0;
  const float clamped = f < -127.0f ? -127.0f : (f > 127.0f ? 127.0f : f);
  // 1.5 * 2^23 + x rounds x to an integer (nearest even) for |x| < 2^22.
  const float shifted = clamped + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  return static_cast<int8_t>(bits - 0x4B400000);
}

// One stored value at `p` (any alignment) widened to f32; for the 8-bit formats the code's
// unscaled value (multiply by the head's scale). Host only: the portable kernels'.
inline float LoadAsFloat(const char* p, DType dtype) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, sizeof(f));
      return f;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, sizeof(h));
      return F16ToFloat(h);
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, sizeof(h));
      return BF16ToFloat(h);
    }
    case DType::kFp8E4M3:
      return Fp8E4M3ToFloat(static_cast<uint8_t>(*p));
    case DType::kInt8:
      return static_cast<float>(static_cast<int8_t>(*p));
  }
  return 0;
}

}  // namespace kvpool::kernels
