#pragma once

// <immintrin.h> for the AVX-512 files (kernels and the model's GEMM). GCC 12's AVX-512
// intrinsics start from _mm512_undefined_*() and warn about it where they are inlined (GCC bug
// 105593, fixed in 13): those two warnings are silenced for the intrinsic headers only.

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
