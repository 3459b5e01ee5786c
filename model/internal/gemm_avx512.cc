// Gemm's register tile (gemm_tile.inc) with AVX-512: 8 W rows x 32 x rows (16 accumulators).

#include <algorithm>
#include <cstdint>

#include "kernels/internal/immintrin.h"
#include "model/internal/gemm.h"

namespace kvpool::model::internal {
namespace {

// GCC's target pragma, or clang's equivalent (it ignores GCC's).
#if defined(__clang__)
#pragma clang attribute push( \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif

struct Ops {
  using V = __m512;
  static constexpr int kW = 16;
  static constexpr int kRows = 8;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Set1(float x) { return _mm512_set1_ps(x); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};

#include "model/internal/gemm_tile.inc"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace

GemmKernel GemmKernelAvx512() { return {&RunTile, Ops::kRows}; }

}  // namespace kvpool::model::internal
