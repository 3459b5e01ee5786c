#include "model/internal/gemm.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "model/internal/ordered_matmul.h"

namespace kvpool::model::internal {
namespace {

using kernels::cpu::Isa;

class GemmTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (GetParam() > kernels::cpu::DetectedIsa()) {
      GTEST_SKIP() << "this processor lacks " << kernels::cpu::IsaName(GetParam());
    }
    kernels::cpu::LimitKernelIsaForTesting(GetParam());
  }
  void TearDown() override { kernels::cpu::LimitKernelIsaForTesting(Isa::kAvx512); }
};

TEST_P(GemmTest, MatchesTheTextbookProductForEveryShape) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-1, 1);
  kernels::ThreadPool threads(2);
  // Rows around the 16- and 32-row tiles and panels, outputs around the 4- and 8-row W tiles,
  // inner sizes around the 64-wide packing block.
  for (int32_t m : {17, 32, 33, 100}) {
    for (int32_t n : {1, 8, 13, 100}) {
      for (int32_t k : {1, 64, 70}) {
        for (bool accumulate : {false, true}) {
          std::vector<float> x(static_cast<size_t>(m * k)), w(static_cast<size_t>(n * k));
          for (float& v : x) v = u(rng);
          for (float& v : w) v = u(rng);
          std::vector<float> y(static_cast<size_t>(m * n), 0.5f), want = y;
          for (int32_t r = 0; r < m; ++r) {
            for (int32_t o = 0; o < n; ++o) {
              double acc = 0;
              for (int32_t i = 0; i < k; ++i) acc += double{x[r * k + i]} * w[o * k + i];
              float& dst = want[static_cast<size_t>(r * n + o)];
              dst = static_cast<float>(accumulate ? dst + acc : acc);
            }
          }
          // NaN-filled scratch: every element the product reads must have been packed.
          std::vector<float> scratch(static_cast<size_t>(GemmScratchFloats(m, k)), NAN);
          Gemm(x.data(), m, w.data(), n, k, y.data(), accumulate, scratch.data(),
               n > 8 ? &threads : nullptr);
          for (size_t i = 0; i < y.size(); ++i) {
            ASSERT_NEAR(y[i], want[i], 1e-4) << "m " << m << " n " << n << " k " << k
                                             << " accumulate " << accumulate << " at " << i;
          }
        }
      }
    }
  }
}

// OrderedMatMul (decode-sized products of models with state-space layers) gives Gemm's bits
// for every row count and shape: each output summed in the order of k, one FMA at a time.
TEST_P(GemmTest, OrderedMatMulGivesGemmsBitsForAnyRows) {
  if (!OrderedMatMulAvailable()) GTEST_SKIP() << "Gemm is OpenBLAS here";
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-1, 1);
  kernels::ThreadPool threads(2);
  for (int32_t m : {1, 3, 4, 5, 16}) {
    for (int32_t n : {1, 15, 16, 17, 100}) {
      for (int32_t k : {1, 7, 64, 129}) {
        for (bool accumulate : {false, true}) {
          std::vector<float> x(static_cast<size_t>(m * k)), w(static_cast<size_t>(n * k));
          for (float& v : x) v = u(rng);
          for (float& v : w) v = u(rng);
          std::vector<float> y(static_cast<size_t>(m * n), 0.5f), want = y;
          std::vector<float> scratch(static_cast<size_t>(GemmScratchFloats(m, k)));
          Gemm(x.data(), m, w.data(), n, k, want.data(), accumulate, scratch.data(), nullptr);
          const HugeVector packed = PackOrdered(w.data(), n, k);
          OrderedMatMul(x.data(), m, packed.data(), n, k, y.data(), accumulate,
                        n > 16 ? &threads : nullptr);
          ASSERT_EQ(y, want) << "m " << m << " n " << n << " k " << k << " accumulate "
                             << accumulate;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, GemmTest,
                         ::testing::Values(Isa::kAvx512, Isa::kAvx2, Isa::kPortable),
                         [](const auto& info) {
                           std::string name(kernels::cpu::IsaName(info.param));
                           return name.substr(0, name.find('+'));
                         });

}  // namespace
}  // namespace kvpool::model::internal
