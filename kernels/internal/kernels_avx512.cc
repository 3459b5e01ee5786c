// The CPU attention tiles (prefill_tile.inc, decode_tile.inc) with AVX-512 (F, BW, VL, DQ) and
// avx512_ops.inc's Ops: 16 floats a vector; prefill register tiles of 8 query rows. Prefill widens
// K/V 8 at a time with the 256-bit helpers (head_dim is a multiple of 8, not of 16); decode loads
// 16 at a time and runs only where head_dim is a multiple of 16.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/internal/decode_tile.h"
#include "kernels/internal/immintrin.h"
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
// The Ops the tiles are written against (they use avx_common.inc).
#include "kernels/internal/avx512_ops.inc"
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
