#pragma once

// y[m][out] = x[m][in] · W[out][in]ᵀ (+ y) for the few rows of a decode step, each output summed
// exactly as Gemm's vector path (gemm.h) sums it: acc = fma(w[o][k], x[r][k], acc) for k = 0, 1,
// ..., in - 1 from acc = 0, then y = (accumulate ? y : 0) + acc. A token's products are then the
// same bits whether its step has one row or hundreds, which SkinnyMatMul (eight partial sums per
// output) does not give; models with state-space layers need that for a decode to resume a
// prefill exactly (model.h).
//
// W is packed once (PackOrdered): per tile of kOrderedTile output rows, [in][kOrderedTile] (the
// last tile zero padded), so one vector load advances a tile of outputs by one k. AVX-512 or AVX2
// (kernels::cpu::KernelIsa); without AVX2 Gemm is OpenBLAS and there is nothing to match, so the
// caller does not use this (OrderedMatMulAvailable).

#include <cstdint>

#include "kernels/thread_pool.h"
#include "model/internal/huge_pages.h"

namespace kvpool::model::internal {

inline constexpr int32_t kOrderedTile = 16;

// Whether this processor (as KernelIsa() allows) runs OrderedMatMul, and Gemm in its order.
bool OrderedMatMulAvailable();

// W[out][in] packed for OrderedMatMul: ceil(out / 16) * 16 * in floats.
HugeVector PackOrdered(const float* w, int32_t out, int32_t in);

// REQUIRES: OrderedMatMulAvailable(); m >= 1; `packed` is PackOrdered(w, out, in); y does not
// overlap x. `threads` may be null (run on the caller).
void OrderedMatMul(const float* x, int32_t m, const float* packed, int32_t out, int32_t in,
                   float* y, bool accumulate, kernels::ThreadPool* threads);

}  // namespace kvpool::model::internal
