// The CPU attention tiles (prefill_tile.inc, decode_tile.inc) with AVX2 + FMA + F16C: 8 floats a
// vector; prefill register tiles of 4 query rows (8 accumulators of 16 registers).

#include <immintrin.h>

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

// GCC's target pragma, or clang's equivalent (it ignores GCC's).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "kernels/internal/avx_common.inc"

struct Ops {
  using V = __m256;
  static constexpr int kW = 8;
  static constexpr int kRows = 4;

  static V Zero() { return _mm256_setzero_ps(); }
  static V Set1(float x) { return _mm256_set1_ps(x); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Max(V a, V b) { return _mm256_max_ps(a, b); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

  static float ReduceMax(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  static float ReduceSum(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  static void Sum8(const V* acc, float scale, float* out) {
    _mm256_storeu_ps(out, _mm256_mul_ps(Reduce8Avx(acc), _mm256_set1_ps(scale)));
  }

  // exp(x), Cephes polynomial (relative error ~1e-7 on [-87, 88]); 0 below, NaN stays NaN.
  static V Exp(V x) {
    const V lo = _mm256_set1_ps(-87.3f);
    const V keep = _mm256_cmp_ps(x, lo, _CMP_NLT_UQ);                  // x >= lo, or NaN
    V y = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(lo, x));  // NaN passes through
    V fx = _mm256_floor_ps(
        _mm256_fmadd_ps(y, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    y = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), y);
    y = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), y);
    V p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(y, y), _mm256_add_ps(y, _mm256_set1_ps(1.0f)));
    const __m256i pow2 =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow2)), keep);
  }

  template <DType kType>
  static V LoadKv(const char* p) {
    return Load8Avx<kType>(p);
  }
  template <DType kType>
  static void WidenRow(const char* src, int n, float* dst) {
    WidenRowAvx<kType>(src, n, dst);
  }
  template <DType kType>
  static void WidenTranspose8x8(const char* const* rows, int64_t offset, float* dst,
                                int64_t dst_stride) {
    WidenTranspose8x8Avx<kType>(rows, offset, dst, dst_stride);
  }
  static void PrefetchL2(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
};

#include "kernels/internal/decode_tile.inc"
#include "kernels/internal/prefill_tile.inc"

template <DType kType>
void NarrowRow(const float* src, int n, float mul, char* dst) {
  const __m256 m = _mm256_set1_ps(mul);
  for (int i = 0; i < n; i += 8) {
    Store8Avx<kType>(_mm256_mul_ps(_mm256_loadu_ps(src + i), m), dst + i * DTypeSize(kType));
  }
}

template <DType kType>
void RescaleRow(char* row, int n, float ratio) {
  const __m256 m = _mm256_set1_ps(ratio * WidenedUnit(kType));
  for (int i = 0; i < n; i += 8)
    Store8Avx<kType>(_mm256_mul_ps(Load8Avx<kType>(row + i), m), row + i);
}

float AbsMax(const float* src, int n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 max = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    max = _mm256_max_ps(max, _mm256_and_ps(x, magnitude));
    bad = _mm256_add_ps(bad, _mm256_mul_ps(x, _mm256_setzero_ps()));  // NaN for NaN or inf
  }
  if (Ops::ReduceSum(bad) != 0.0f) return std::numeric_limits<float>::quiet_NaN();
  return Ops::ReduceMax(max);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace

PrefillTaskFn PrefillTaskAvx2(DType k_dtype, DType v_dtype) { return TaskFor(k_dtype, v_dtype); }
DecodeFns DecodeAvx2() { return DecodeTaskFns(); }
ConvertFns ConvertAvx2() {
  return {.narrow = {&NarrowRow<DType::kF32>, &NarrowRow<DType::kF16>, &NarrowRow<DType::kBF16>,
                     &NarrowRow<DType::kFp8E4M3>, &NarrowRow<DType::kInt8>},
          .rescale = {nullptr, nullptr, nullptr, &RescaleRow<DType::kFp8E4M3>,
                      &RescaleRow<DType::kInt8>},
          .absmax = &AbsMax};
}

}  // namespace kvpool::kernels::cpu::internal
