#include "model/internal/skinny_matmul.h"

#include <immintrin.h>

#include <atomic>

namespace kvpool::model::internal {
namespace {

std::atomic<bool> force_portable{false};

bool HaveAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// Weight rows [o0, o1) against every input row.
void PortableRows(const float* x, int32_t m, const float* w, int32_t in, float* y, int32_t out,
                  bool accumulate, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* wr = w + o * in;
    for (int32_t r = 0; r < m; ++r) {
      const float* xr = x + static_cast<int64_t>(r) * in;
      float acc = 0;
      for (int32_t k = 0; k < in; ++k) acc += wr[k] * xr[k];
      float& dst = y[static_cast<int64_t>(r) * out + o];
      dst = accumulate ? dst + acc : acc;
    }
  }
}

__attribute__((target("avx2,fma"))) inline float Sum(__m256 v) {
  const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// Four weight rows at a time: they stay in L1 while every input row is multiplied with them.
__attribute__((target("avx2,fma"))) void Avx2Rows(const float* x, int32_t m, const float* w,
                                                  int32_t in, float* y, int32_t out,
                                                  bool accumulate, int64_t o0, int64_t o1) {
  const int32_t vec = in / 8 * 8;
  int64_t o = o0;
  for (; o + 4 <= o1; o += 4) {
    const float* w0 = w + o * in;
    const float* w1 = w0 + in;
    const float* w2 = w1 + in;
    const float* w3 = w2 + in;
    for (int32_t r = 0; r < m; ++r) {
      const float* xr = x + static_cast<int64_t>(r) * in;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int32_t k = 0; k < vec; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xr + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
      }
      float s[4] = {Sum(a0), Sum(a1), Sum(a2), Sum(a3)};
      for (int32_t k = vec; k < in; ++k) {
        s[0] += w0[k] * xr[k];
        s[1] += w1[k] * xr[k];
        s[2] += w2[k] * xr[k];
        s[3] += w3[k] * xr[k];
      }
      float* dst = y + static_cast<int64_t>(r) * out + o;
      for (int j = 0; j < 4; ++j) dst[j] = accumulate ? dst[j] + s[j] : s[j];
    }
  }
  PortableRows(x, m, w, in, y, out, accumulate, o, o1);
}

}  // namespace

void ForcePortableSkinnyForTesting(bool portable) { force_portable.store(portable); }

void SkinnyMatMul(const float* x, int32_t m, const float* w, int32_t out, int32_t in, float* y,
                  bool accumulate, kernels::ThreadPool* threads) {
  static const bool avx2 = HaveAvx2();
  const bool fast = avx2 && !force_portable.load(std::memory_order_relaxed);
  auto rows = [&](int64_t o0, int64_t o1) {
    if (fast) {
      Avx2Rows(x, m, w, in, y, out, accumulate, o0, o1);
    } else {
      PortableRows(x, m, w, in, y, out, accumulate, o0, o1);
    }
  };
  if (threads == nullptr) return rows(0, out);
  // Chunks of 64 weight rows (a multiple of the 4-row tile): enough to balance, few enough to
  // keep the dispatch cost small.
  const int64_t chunks = (out + 63) / 64;
  threads->ParallelFor(
      chunks, 1, [&](int64_t c0, int64_t c1) { rows(c0 * 64, std::min<int64_t>(c1 * 64, out)); });
}

}  // namespace kvpool::model::internal
