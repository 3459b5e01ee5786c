#pragma once

// y[m][out] = x[m][in] · W[out][in]ᵀ (+ y) for the few rows of a decode step. OpenBLAS 0.3.21's
// sgemm packs the whole weight matrix on every call (5x slower than sgemv at one row) and sgemv
// reads the weights once per row; this reads each weight row once for all m rows (it stays in
// L1 while the m dot products use it), so a step of eight sequences costs about what one does:
// the point of gathering decodes across clients. Prefill-sized products go to OpenBLAS.
//
// AVX2/FMA when the processor has them (checked at run time), portable loops otherwise.

#include <cstdint>

#include "kernels/thread_pool.h"

namespace kvpool::model::internal {

inline constexpr int32_t kMaxSkinnyRows = 16;

// REQUIRES: 1 <= m <= kMaxSkinnyRows. `threads` may be null (run on the caller).
void SkinnyMatMul(const float* x, int32_t m, const float* w, int32_t out, int32_t in, float* y,
                  bool accumulate, kernels::ThreadPool* threads);

// Test seam: use the portable loops even where AVX2 is present.
void ForcePortableSkinnyForTesting(bool portable);

}  // namespace kvpool::model::internal
