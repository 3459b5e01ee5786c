// The CPU attention tiles (prefill_tile.inc, decode_tile.inc) in portable C++: a "vector" is 8
// floats in an array (the compiler vectorizes what the baseline instruction set allows), 4 query
// rows per prefill tile.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

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
  template <DType kType>
  static V LoadKv(const char* p) {
    return Map([p](int i) { return LoadAsFloat(p + i * DTypeSize(kType), kType); });
  }
  template <DType kType>
  static void WidenRow(const char* src, int n, float* dst) {
    for (int i = 0; i < n; ++i) dst[i] = LoadAsFloat(src + i * DTypeSize(kType), kType);
  }
  template <DType kType>
  static void WidenTranspose8x8(const char* const* rows, int64_t offset, float* dst,
                                int64_t dst_stride) {
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 8; ++j) {
        dst[j * dst_stride + i] = LoadAsFloat(rows[i] + offset + j * DTypeSize(kType), kType);
      }
    }
  }
  static void PrefetchL2(const char* p) { __builtin_prefetch(p, 0, 2); }
};

#include "kernels/internal/decode_tile.inc"
#include "kernels/internal/prefill_tile.inc"

}  // namespace

PrefillTaskFn PrefillTaskPortable(DType dtype) { return TaskFor(dtype); }
DecodeFns DecodePortable() { return DecodeTaskFns(); }

}  // namespace kvpool::kernels::cpu::internal
