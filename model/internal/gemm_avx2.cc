// Gemm's register tile (gemm_tile.inc) with AVX2 + FMA: 4 W rows x 16 x rows (8 accumulators).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "model/internal/gemm.h"

namespace kvpool::model::internal {
namespace {

// GCC's target pragma, or clang's equivalent (it ignores GCC's).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

struct Ops {
  using V = __m256;
  static constexpr int kW = 8;
  static constexpr int kRows = 4;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Set1(float x) { return _mm256_set1_ps(x); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};

#include "model/internal/gemm_tile.inc"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace

GemmKernel GemmKernelAvx2() { return {&RunTile, Ops::kRows}; }

}  // namespace kvpool::model::internal
