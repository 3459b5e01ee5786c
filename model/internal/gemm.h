#pragma once

// y[m][n] = x[m][k] · W[n][k]ᵀ (+ y) for prefill-sized m, on the host, with the vector code
// chosen at run time (kernels/cpu_isa.h). It replaces OpenBLAS for these products where AVX2 or
// AVX-512 is present: Debian 12's OpenBLAS 0.3.21 does not know recent Xeons (family 6 model
// 207 here) and falls back to its SSE3 "Prescott" kernels, a third of what the same library
// does when told the core type (model_bench, BM_InProcessPrefill). Without AVX2, cblas_sgemm.
//
// x is packed once into the caller's scratch, in panels of 32 rows, each transposed ([k][32]; the
// last panel zero padded), so a register tile streams its panel in order. Each task keeps a tile
// of W rows in L1 and multiplies them with every panel:
// register tiles of (8 W rows x 32 x rows) on AVX-512, (4 x 16) on AVX2, one FMA per weight
// element and x row, summed in order of k. Tasks are tiles of W rows, taken by the thread pool.

#include <cstdint>

#include "kernels/thread_pool.h"

namespace kvpool::model::internal {

// Floats of scratch Gemm needs for m rows of k inputs.
int64_t GemmScratchFloats(int32_t m, int32_t k);

// REQUIRES: m, n, k >= 1; `scratch` holds GemmScratchFloats(m, k) floats; y does not overlap x,
// W or scratch. `threads` may be null (run on the caller).
void Gemm(const float* x, int32_t m, const float* w, int32_t n, int32_t k, float* y,
          bool accumulate, float* scratch, kernels::ThreadPool* threads);

// Rows of x per packed panel.
inline constexpr int32_t kGemmPanel = 32;

// One tile of W rows [n0, n0 + rows) against the packed x (xt: [ceil(m / 32)][k][32]), writing
// y rows [0, m). The instruction-set variants (gemm_avx2.cc, gemm_avx512.cc).
struct GemmTile {
  const float* xt;
  int32_t m, k;
  const float* w;
  int32_t n;  // W rows (and y columns) in all
  float* y;
  bool accumulate;
};
using GemmTileFn = void (*)(const GemmTile& g, int32_t n0);
// W rows each call of the function covers (its register tile).
struct GemmKernel {
  GemmTileFn run;
  int32_t rows;
};
GemmKernel GemmKernelAvx2();
GemmKernel GemmKernelAvx512();

}  // namespace kvpool::model::internal
