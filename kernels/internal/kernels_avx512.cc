// The CPU attention tiles (prefill_tile.inc, decode_tile.inc) with AVX-512 (F, BW, VL, DQ): 16
// floats a vector; prefill register tiles of 8 query rows (16 accumulators of 32 registers).
// Prefill widens K/V 8 at a time with the 256-bit helpers (head_dim is a multiple of 8, not of
// 16); decode loads 16 at a time and runs only where head_dim is a multiple of 16.

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() and warn about it where they are
// inlined (GCC bug 105593, fixed in 13): silence those two warnings for the intrinsic headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/internal/decode_tile.h"
#include "kernels/internal/prefill_tile.h"

namespace kvpool::kernels::cpu::internal {
namespace {

// GCC's target pragma, or clang's equivalent (it ignores GCC's).
#if defined(__clang__)
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#include "kernels/internal/avx_common.inc"

struct Ops {
  using V = __m512;
  static constexpr int kW = 16;
  static constexpr int kRows = 8;

  static V Zero() { return _mm512_setzero_ps(); }
  static V Set1(float x) { return _mm512_set1_ps(x); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Max(V a, V b) { return _mm512_max_ps(a, b); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float ReduceMax(V v) { return _mm512_reduce_max_ps(v); }
  static float ReduceSum(V v) { return _mm512_reduce_add_ps(v); }
  static void Sum8(const V* acc, float scale, float* out) {
    __m256 halves[8];  // each vector folded to 8 lanes, then eight horizontal sums at once
    for (int j = 0; j < 8; ++j) {
      halves[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(Reduce8Avx(halves), _mm256_set1_ps(scale)));
  }

  // exp(x), Cephes polynomial (relative error ~1e-7 on [-87, 88]); 0 below, NaN stays NaN.
  static V Exp(V x) {
    const V lo = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);     // x >= lo, or NaN
    V y = _mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_max_ps(lo, x));  // NaN passes through
    const V fx = _mm512_roundscale_ps(
        _mm512_fmadd_ps(y, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    y = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), y);
    y = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), y);
    V p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(y, y), _mm512_add_ps(y, _mm512_set1_ps(1.0f)));
    const __m512i pow2 =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(pow2));
  }

  // 16 stored values (any alignment) widened to 16 floats; 8-bit codes unscaled (fp8 / 256).
  template <DType kType>
  static V LoadKv(const char* p) {
    if constexpr (kType == DType::kF32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    } else if constexpr (kType == DType::kF16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else if constexpr (kType == DType::kBF16) {
      const __m512i wide =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    } else if constexpr (kType == DType::kInt8) {
      return _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    } else {  // fp8 e4m3, through f16 (dtype.h: WidenedUnit)
      const __m256i wide =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_cvtph_ps(
          _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(-16512)));  // 0xBF80
    }
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

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace

PrefillTaskFn PrefillTaskAvx512(DType k_dtype, DType v_dtype) { return TaskFor(k_dtype, v_dtype); }
DecodeFns DecodeAvx512() { return DecodeTaskFns(); }

}  // namespace kvpool::kernels::cpu::internal
