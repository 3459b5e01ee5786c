#pragma once

// KV storage types and their conversions. Usable from host code and, under nvcc, device code.

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

enum class DType : uint8_t { kF32, kF16, kBF16 };

KVPOOL_HOST_DEVICE constexpr int32_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

std::string_view DTypeName(DType dtype);
// "f32", "f16", "bf16". Errors: INVALID_ARGUMENT for anything else.
absl::StatusOr<DType> ParseDType(std::string_view name);

// The poison pattern of each type: a quiet NaN with a recognisable payload, so a read of a block
// nobody wrote shows up as NaN (and as 0x..DEAD-ish bits in a dump).
inline constexpr uint32_t kPoisonF32 = 0x7FDEAD00u;
inline constexpr uint16_t kPoisonF16 = 0x7EADu;
inline constexpr uint16_t kPoisonBF16 = 0x7FDEu;

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

// One stored value at `p` (any alignment) widened to f32. Host only: the portable kernels'.
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
  }
  return 0;
}

}  // namespace kvpool::kernels
