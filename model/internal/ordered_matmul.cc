#include "model/internal/ordered_matmul.h"

#include <immintrin.h>

#include <algorithm>

#include "kernels/cpu_isa.h"

namespace kvpool::model::internal {
namespace {

constexpr int32_t kRows = 4;  // rows of x per pass over a tile (each tile load serves them all)

// Adds (or writes) one tile's sums into y, as Gemm's tile does.
inline void Store(const float* sums, int32_t r, int32_t o0, int32_t out, float* y,
                  bool accumulate) {
  const int32_t live = std::min(kOrderedTile, out - o0);
  float* dst = y + static_cast<int64_t>(r) * out + o0;
  for (int32_t i = 0; i < live; ++i) dst[i] = (accumulate ? dst[i] : 0.0f) + sums[i];
}

__attribute__((target("avx512f"))) void TileAvx512(const float* x, int32_t m, const float* p,
                                                   int32_t in, float* y, int32_t out,
                                                   bool accumulate, int32_t o0) {
  alignas(64) float sums[kOrderedTile];
  for (int32_t r0 = 0; r0 < m; r0 += kRows) {
    const int32_t rows = std::min(kRows, m - r0);
    __m512 acc[kRows];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    for (int32_t k = 0; k < in; ++k) {
      const __m512 w = _mm512_loadu_ps(p + static_cast<int64_t>(k) * kOrderedTile);
      for (int32_t j = 0; j < rows; ++j) {
        acc[j] =
            _mm512_fmadd_ps(w, _mm512_set1_ps(x[static_cast<int64_t>(r0 + j) * in + k]), acc[j]);
      }
    }
    for (int32_t j = 0; j < rows; ++j) {
      _mm512_store_ps(sums, acc[j]);
      Store(sums, r0 + j, o0, out, y, accumulate);
    }
  }
}

__attribute__((target("avx2,fma"))) void TileAvx2(const float* x, int32_t m, const float* p,
                                                  int32_t in, float* y, int32_t out,
                                                  bool accumulate, int32_t o0) {
  alignas(32) float sums[kOrderedTile];
  for (int32_t r0 = 0; r0 < m; r0 += kRows) {
    const int32_t rows = std::min(kRows, m - r0);
    __m256 lo[kRows], hi[kRows];
    for (int32_t j = 0; j < kRows; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int32_t k = 0; k < in; ++k) {
      const float* pk = p + static_cast<int64_t>(k) * kOrderedTile;
      const __m256 w0 = _mm256_loadu_ps(pk), w1 = _mm256_loadu_ps(pk + 8);
      for (int32_t j = 0; j < rows; ++j) {
        const __m256 xv = _mm256_set1_ps(x[static_cast<int64_t>(r0 + j) * in + k]);
        lo[j] = _mm256_fmadd_ps(w0, xv, lo[j]);
        hi[j] = _mm256_fmadd_ps(w1, xv, hi[j]);
      }
    }
    for (int32_t j = 0; j < rows; ++j) {
      _mm256_store_ps(sums, lo[j]);
      _mm256_store_ps(sums + 8, hi[j]);
      Store(sums, r0 + j, o0, out, y, accumulate);
    }
  }
}

}  // namespace

bool OrderedMatMulAvailable() { return kernels::cpu::KernelIsa() != kernels::cpu::Isa::kPortable; }

HugeVector PackOrdered(const float* w, int32_t out, int32_t in) {
  const int64_t tiles = (out + kOrderedTile - 1) / kOrderedTile;
  HugeVector packed(static_cast<size_t>(tiles * kOrderedTile * in), 0.0f);
  for (int64_t o = 0; o < out; ++o) {
    float* tile = packed.data() + o / kOrderedTile * kOrderedTile * in + o % kOrderedTile;
    for (int64_t k = 0; k < in; ++k) tile[k * kOrderedTile] = w[o * in + k];
  }
  return packed;
}

void OrderedMatMul(const float* x, int32_t m, const float* packed, int32_t out, int32_t in,
                   float* y, bool accumulate, kernels::ThreadPool* threads) {
  const bool avx512 = kernels::cpu::KernelIsa() == kernels::cpu::Isa::kAvx512;
  auto tiles = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* p = packed + t * kOrderedTile * in;
      const auto o0 = static_cast<int32_t>(t * kOrderedTile);
      if (avx512) {
        TileAvx512(x, m, p, in, y, out, accumulate, o0);
      } else {
        TileAvx2(x, m, p, in, y, out, accumulate, o0);
      }
    }
  };
  const int64_t n = (out + kOrderedTile - 1) / kOrderedTile;
  if (threads == nullptr) return tiles(0, n);
  threads->ParallelFor(n, 4, tiles);  // 64 outputs a task at least, as SkinnyMatMul's chunks
}

}  // namespace kvpool::model::internal
