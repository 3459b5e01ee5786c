#include "kernels/dtype.h"

#include <cmath>

#include "fmt/format.h"

namespace kvpool::kernels {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kFp8E4M3:
      return "fp8";
    case DType::kInt8:
      return "int8";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "f32") return DType::kF32;
  if (name == "f16") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  if (name == "fp8" || name == "fp8_e4m3") return DType::kFp8E4M3;
  if (name == "int8") return DType::kInt8;
  return absl::InvalidArgumentError(
      fmt::format("unknown dtype '{}' (f32, f16, bf16, fp8, int8)", name));
}

// IEEE half conversions in software (the vectorized kernels use F16C instead).
float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      const float f = std::ldexp(static_cast<float>(mantissa), -24);
      std::memcpy(&bits, &f, sizeof(bits));
      bits |= sign;
    }
  } else if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    const float magnitude = std::fabs(f);
    return static_cast<uint16_t>(sign |
                                 static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f)));
  }
  // Normal: round to nearest even on the 13 dropped bits.
  const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace kvpool::kernels
