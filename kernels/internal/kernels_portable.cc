// The CPU attention tiles (prefill_tile.inc, decode_tile.inc) in portable C++: a "vector" is 8
// floats in an array (the compiler vectorizes what the baseline instruction set allows), 4 query
// rows per prefill tile.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/internal/convert_rows.h"
#include "kernels/internal/decode_tile.h"
#include "kernels/internal/prefill_tile.h"

namespace kvpool::kernels::cpu::internal {
namespace {

struct Ops {
  struct V {
    float x[8];
  };
  static constexpr int kW = 8;
  static constexpr int kRows = 4;

  template <typename F>
  static V Map(F f) {
    V out;
    for (int i = 0; i < kW; ++i) out.x[i] = f(i);
    return out;
  }
  static V Zero() { return Set1(0.0f); }
  static V Set1(float v) {
    return Map([v](int) { return v; });
  }
  static V Load(const float* p) {
    V out;
    std::memcpy(out.x, p, sizeof(out.x));
    return out;
  }
  static void Store(float* p, const V& v) { std::memcpy(p, v.x, sizeof(v.x)); }
  static V Add(const V& a, const V& b) {
    return Map([&](int i) { return a.x[i] + b.x[i]; });
  }
  static V Sub(const V& a, const V& b) {
    return Map([&](int i) { return a.x[i] - b.x[i]; });
  }
  static V Mul(const V& a, const V& b) {
    return Map([&](int i) { return a.x[i] * b.x[i]; });
  }
  static V Max(const V& a, const V& b) {
    return Map([&](int i) { return std::max(a.x[i], b.x[i]); });
  }
  static V Fma(const V& a, const V& b, const V& c) {
    return Map([&](int i) { return a.x[i] * b.x[i] + c.x[i]; });
  }
  static float ReduceMax(const V& v) { return *std::max_element(v.x, v.x + kW); }
  static float ReduceSum(const V& v) {
    float sum = 0;
    for (float x : v.x) sum += x;
    return sum;
  }
  static V Exp(const V& v) {
    return Map([&](int i) { return std::exp(v.x[i]); });
  }

  static void Sum8(const V* acc, float scale, float* out) {
    for (int j = 0; j < 8; ++j) out[j] = ReduceSum(acc[j]) * scale;
  }
  // One stored value as the vector sets widen it: 8-bit codes unscaled, fp8 / 256 (WidenedUnit).
  template <DType kType>
  static float Widen(const char* p) {
    return LoadAsFloat(p, kType) * (1.0f / WidenedUnit(kType));
  }
  template <DType kType>
  static V LoadKv(const char* p) {
    return Map([p](int i) { return Widen<kType>(p + i * DTypeSize(kType)); });
  }
  template <DType kType>
  static void WidenRow(const char* src, int n, float* dst) {
    for (int i = 0; i < n; ++i) dst[i] = Widen<kType>(src + i * DTypeSize(kType));
  }
  template <DType kType>
  static void WidenTranspose8x8(const char* const* rows, int64_t offset, float* dst,
                                int64_t dst_stride) {
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 8; ++j) {
        dst[j * dst_stride + i] = Widen<kType>(rows[i] + offset + j * DTypeSize(kType));
      }
    }
  }
  static void PrefetchL2(const char* p) { __builtin_prefetch(p, 0, 2); }
};

#include "kernels/internal/decode_tile.inc"
#include "kernels/internal/prefill_tile.inc"

void Store(float x, DType dtype, char* p) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(p, &x, 4);
      return;
    case DType::kF16: {
      const uint16_t h = FloatToF16(x);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kBF16: {
      const uint16_t h = FloatToBF16(x);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kFp8E4M3:
      *p = static_cast<char>(FloatToFp8E4M3(x));
      return;
    case DType::kInt8:
      *p = static_cast<char>(FloatToInt8(x));
      return;
  }
}

template <DType kType>
void NarrowRow(const float* src, int n, float mul, char* dst) {
  for (int i = 0; i < n; ++i) Store(src[i] * mul, kType, dst + i * DTypeSize(kType));
}

template <DType kType>
void RescaleRow(char* row, int n, float ratio) {
  for (int i = 0; i < n; ++i) Store(LoadAsFloat(row + i, kType) * ratio, kType, row + i);
}

float AbsMax(const float* src, int n) {
  float max = 0;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(src[i])) return std::numeric_limits<float>::quiet_NaN();
    max = std::max(max, std::abs(src[i]));
  }
  return max;
}

}  // namespace

PrefillTaskFn PrefillTaskPortable(DType k_dtype, DType v_dtype) {
  return TaskFor(k_dtype, v_dtype);
}
DecodeFns DecodePortable() { return DecodeTaskFns(); }
ConvertFns ConvertPortable() {
  return {.narrow = {&NarrowRow<DType::kF32>, &NarrowRow<DType::kF16>, &NarrowRow<DType::kBF16>,
                     &NarrowRow<DType::kFp8E4M3>, &NarrowRow<DType::kInt8>},
          .rescale = {nullptr, nullptr, nullptr, &RescaleRow<DType::kFp8E4M3>,
                      &RescaleRow<DType::kInt8>},
          .absmax = &AbsMax};
}

}  // namespace kvpool::kernels::cpu::internal
