#include "model/internal/gemm.h"

#include <cblas.h>

#include <algorithm>

#include "kernels/cpu_isa.h"

namespace kvpool::model::internal {
namespace {

constexpr int32_t kKBlock = 64;  // transposition block along k

int32_t PaddedRows(int32_t m) { return (m + kGemmPanel - 1) / kGemmPanel * kGemmPanel; }

// Panel p of xt ([k][kGemmPanel]) = rows [p·kGemmPanel, +kGemmPanel) of x, transposed; rows past
// m are zero.
void Pack(const float* x, int32_t m, int32_t k, int32_t p, float* xt) {
  float* panel = xt + static_cast<int64_t>(p) * k * kGemmPanel;
  const int32_t m0 = p * kGemmPanel;
  const int32_t rows = std::min(kGemmPanel, m - m0);
  for (int32_t k0 = 0; k0 < k; k0 += kKBlock) {
    const int32_t k1 = std::min(k, k0 + kKBlock);
    for (int32_t i = 0; i < rows; ++i) {
      const float* src = x + static_cast<int64_t>(m0 + i) * k;
      for (int32_t kk = k0; kk < k1; ++kk)
        panel[static_cast<int64_t>(kk) * kGemmPanel + i] = src[kk];
    }
    for (int32_t kk = k0; kk < k1; ++kk) {
      std::fill(panel + static_cast<int64_t>(kk) * kGemmPanel + rows,
                panel + static_cast<int64_t>(kk + 1) * kGemmPanel, 0.0f);
    }
  }
}

}  // namespace

int64_t GemmScratchFloats(int32_t m, int32_t k) { return int64_t{PaddedRows(m)} * k; }

void Gemm(const float* x, int32_t m, const float* w, int32_t n, int32_t k, float* y,
          bool accumulate, float* scratch, kernels::ThreadPool* threads) {
  GemmKernel kernel{};
  switch (kernels::cpu::KernelIsa()) {
    case kernels::cpu::Isa::kAvx512:
      kernel = GemmKernelAvx512();
      break;
    case kernels::cpu::Isa::kAvx2:
      kernel = GemmKernelAvx2();
      break;
    case kernels::cpu::Isa::kPortable:
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k,
                  accumulate ? 1.0f : 0.0f, y, n);
      return;
  }
  const int32_t panels = PaddedRows(m) / kGemmPanel;
  auto pack = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) Pack(x, m, k, static_cast<int32_t>(p), scratch);
  };
  const GemmTile g{scratch, m, k, w, n, y, accumulate};
  const int64_t tiles = (n + kernel.rows - 1) / kernel.rows;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) kernel.run(g, static_cast<int32_t>(t * kernel.rows));
  };
  if (threads == nullptr) {
    pack(0, panels);
    run(0, tiles);
    return;
  }
  threads->ParallelFor(panels, 1, pack);
  // Enough tiles per chunk to amortize taking it, small enough to balance two or more workers.
  threads->ParallelFor(tiles, std::max<int64_t>(1, tiles / (8 * threads->threads())), run);
}

}  // namespace kvpool::model::internal
