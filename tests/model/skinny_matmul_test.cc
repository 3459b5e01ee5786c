#include "model/internal/skinny_matmul.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::model::internal {
namespace {

class SkinnyMatMulTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { ForcePortableSkinnyForTesting(GetParam()); }
  void TearDown() override { ForcePortableSkinnyForTesting(false); }
};

TEST_P(SkinnyMatMulTest, MatchesTheTextbookProductForEveryShape) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  kernels::ThreadPool threads(2);
  // Rows of 1..16, output counts that are and are not multiples of the 4-row tile and of the
  // 64-row chunk, inner sizes with and without a vector tail.
  for (int32_t m : {1, 3, 8, 16}) {
    for (int32_t out : {1, 7, 64, 130}) {
      for (int32_t in : {8, 13, 96}) {
        for (bool accumulate : {false, true}) {
          std::vector<float> x(static_cast<size_t>(m * in)), w(static_cast<size_t>(out * in));
          for (float& v : x) v = u(rng);
          for (float& v : w) v = u(rng);
          std::vector<float> y(static_cast<size_t>(m * out), 0.5f), want = y;
          for (int32_t r = 0; r < m; ++r) {
            for (int32_t o = 0; o < out; ++o) {
              double acc = 0;
              for (int32_t k = 0; k < in; ++k) acc += double{x[r * in + k]} * w[o * in + k];
              float& dst = want[static_cast<size_t>(r * out + o)];
              dst = static_cast<float>(accumulate ? dst + acc : acc);
            }
          }
          SkinnyMatMul(x.data(), m, w.data(), out, in, y.data(), accumulate,
                       out > 64 ? &threads : nullptr);
          for (size_t i = 0; i < y.size(); ++i) {
            ASSERT_NEAR(y[i], want[i], 1e-4) << "m " << m << " out " << out << " in " << in
                                             << " accumulate " << accumulate << " at " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, SkinnyMatMulTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Portable" : "Native"; });

}  // namespace
}  // namespace kvpool::model::internal
