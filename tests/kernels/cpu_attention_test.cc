// The CPU KV kernels: paged decode against the double-precision reference for block sizes 1, 16
// and 64, every dtype, ragged lengths and several query/KV head groupings, on every instruction
// set this processor has (AVX-512, AVX2, portable); the dense kernel likewise; WriteKv,
// CopyBlocks and FillBlocks byte-exact.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels::cpu {
namespace {

using test_util::NormalizedError;
using Isa = cpu::Isa;
using test_util::RandomValues;

struct Case {
  int32_t block_size;
  DType dtype;
  int32_t q_heads;
  int32_t kv_heads;
  int32_t head_dim;
  Isa isa;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string isa(IsaName(c.isa));
  return fmt::format("bs{}_{}_q{}kv{}_d{}_{}", c.block_size, DTypeName(c.dtype), c.q_heads,
                     c.kv_heads, c.head_dim, isa.substr(0, isa.find('+')));
}

class PagedDecodeTest : public test_util::IsaTest<Case> {
 protected:
  static constexpr int32_t kLayer = 1;  // of two

  // Every sequence's K/V (random values of the case's dtype, kept dense in `dense_k`/`dense_v`)
  // scattered through WriteKv into a shuffled set of the pool's blocks, listed in `tables`.
  void Scatter(const std::vector<int32_t>& lens, std::mt19937* rng) {
    const Case& c = GetParam();
    layout_ = {.block_size = c.block_size,
               .num_layers = 2,
               .num_kv_heads = c.kv_heads,
               .head_dim = c.head_dim,
               .dtype = c.dtype};
    int32_t total_blocks = 0;
    for (int32_t len : lens) {
      const int32_t blocks = (len + c.block_size - 1) / c.block_size;
      total_blocks += blocks;
      stride_ = std::max(stride_, blocks);
    }
    layout_.num_blocks = total_blocks + 3;
    arena_.assign(static_cast<size_t>(layout_.arena_bytes()), 0);
    std::vector<int32_t> ids(static_cast<size_t>(layout_.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    tables_.assign(lens.size() * static_cast<size_t>(stride_), -1);
    const int64_t row_values = static_cast<int64_t>(c.kv_heads) * c.head_dim;
    size_t next = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      const int32_t len = lens[s];
      dense_k_.push_back(RandomValues(len * row_values, c.dtype, rng));
      dense_v_.push_back(RandomValues(len * row_values, c.dtype, rng));
      int32_t* table = &tables_[s * static_cast<size_t>(stride_)];
      std::vector<int64_t> slots;
      for (int32_t t = 0; t < len; ++t) {
        if (t % c.block_size == 0) table[t / c.block_size] = ids[next++];
        slots.push_back(static_cast<int64_t>(table[t / c.block_size]) * c.block_size +
                        t % c.block_size);
      }
      // The values are representable in the dtype: WriteKv stores exactly dense_k and dense_v.
      const std::vector<float> k = test_util::Widen(dense_k_.back(), c.dtype);
      const std::vector<float> v = test_util::Widen(dense_v_.back(), c.dtype);
      ASSERT_TRUE(WriteKv(pool(), {.layer = kLayer,
                                   .num_tokens = len,
                                   .k = k.data(),
                                   .v = v.data(),
                                   .slots = slots.data()})
                      .ok());
    }
  }

  KvPoolView pool() { return {arena_.data(), layout_}; }

  PoolLayout layout_;
  std::vector<char> arena_;
  std::vector<int32_t> tables_;  // [sequence][stride_]
  int32_t stride_ = 0;
  std::vector<std::vector<char>> dense_k_, dense_v_;
};

TEST_P(PagedDecodeTest, MatchesTheDenseReference) {
  const Case& c = GetParam();
  std::mt19937 rng(1234);
  const std::vector<int32_t> lens = {1, 17, 64, 65, 200, 513};  // ragged
  const int32_t num_seqs = static_cast<int32_t>(lens.size());
  Scatter(lens, &rng);
  if (HasFatalFailure()) return;

  const int64_t qo = static_cast<int64_t>(num_seqs) * c.q_heads * c.head_dim;
  std::vector<float> q(static_cast<size_t>(qo));
  for (float& x : q) x = test_util::StandardNormal(&rng);
  std::vector<float> paged(q.size(), -1), dense(q.size(), -1), reference(q.size(), -1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  ThreadPool threads(2);
  ASSERT_TRUE(PagedAttentionDecode(pool(),
                                   {.layer = kLayer,
                                    .num_seqs = num_seqs,
                                    .num_q_heads = c.q_heads,
                                    .scale = scale,
                                    .q = q.data(),
                                    .out = paged.data(),
                                    .block_tables = tables_.data(),
                                    .table_stride = stride_,
                                    .seq_lens = lens.data(),
                                    .max_seq_len = 513},
                                   &threads)
                  .ok());
  std::vector<const void*> k, v;
  for (int32_t s = 0; s < num_seqs; ++s) {
    k.push_back(dense_k_[s].data());
    v.push_back(dense_v_[s].data());
  }
  const DenseDecodeArgs dense_args{.num_seqs = num_seqs,
                                   .num_q_heads = c.q_heads,
                                   .num_kv_heads = c.kv_heads,
                                   .head_dim = c.head_dim,
                                   .dtype = c.dtype,
                                   .scale = scale,
                                   .q = q.data(),
                                   .out = dense.data(),
                                   .k = k.data(),
                                   .v = v.data(),
                                   .seq_lens = lens.data()};
  ASSERT_TRUE(DenseAttentionDecode(dense_args, &threads).ok());
  DenseDecodeArgs ref_args = dense_args;
  ref_args.out = reference.data();
  ReferenceAttentionDecode(ref_args);

  bool nan = false;
  // Both kernels read the same stored values as the reference; what differs is f32 vs f64
  // accumulation and the vectorized exp.
  EXPECT_LT(NormalizedError(paged, reference, &nan), 2e-5);
  EXPECT_FALSE(nan);
  EXPECT_LT(NormalizedError(dense, reference, &nan), 2e-5);
  EXPECT_FALSE(nan);
}

INSTANTIATE_TEST_SUITE_P(Shapes, PagedDecodeTest,
                         ::testing::Values(Case{1, DType::kBF16, 8, 2, 64, Isa::kAvx512},
                                           Case{16, DType::kBF16, 8, 2, 64, Isa::kAvx512},
                                           Case{64, DType::kBF16, 8, 2, 64, Isa::kAvx512},
                                           Case{16, DType::kF16, 8, 2, 64, Isa::kAvx512},
                                           Case{16, DType::kF32, 8, 2, 64, Isa::kAvx512},
                                           Case{16, DType::kBF16, 6, 1, 128, Isa::kAvx512},
                                           Case{16, DType::kBF16, 3, 3, 32, Isa::kAvx512},
                                           Case{64, DType::kF16, 12, 2, 128, Isa::kAvx512},
                                           Case{16, DType::kBF16, 4, 2, 72, Isa::kAvx512},
                                           Case{1, DType::kBF16, 8, 2, 64, Isa::kAvx2},
                                           Case{16, DType::kBF16, 8, 2, 64, Isa::kAvx2},
                                           Case{64, DType::kBF16, 8, 2, 64, Isa::kAvx2},
                                           Case{16, DType::kF16, 8, 2, 64, Isa::kAvx2},
                                           Case{16, DType::kF32, 8, 2, 64, Isa::kAvx2},
                                           Case{16, DType::kBF16, 6, 1, 128, Isa::kAvx2},
                                           Case{16, DType::kBF16, 3, 3, 32, Isa::kAvx2},
                                           Case{64, DType::kF16, 12, 2, 128, Isa::kAvx2},
                                           Case{16, DType::kBF16, 4, 2, 72, Isa::kAvx2},
                                           Case{1, DType::kBF16, 8, 2, 64, Isa::kPortable},
                                           Case{16, DType::kF16, 6, 1, 128, Isa::kPortable},
                                           Case{64, DType::kF32, 8, 2, 64, Isa::kPortable}),
                         Name);

class KernelsTest : public ::testing::Test {
 protected:
  KernelsTest() : arena_(static_cast<size_t>(layout_.arena_bytes()), 1) {}
  PoolLayout layout_{.block_size = 4,
                     .num_layers = 2,
                     .num_kv_heads = 2,
                     .head_dim = 8,
                     .dtype = DType::kBF16,
                     .num_blocks = 6};
  std::vector<char> arena_;
  KvPoolView pool_{arena_.data(), layout_};
};

TEST_F(KernelsTest, WriteKvSkipsPaddingAndRejectsOutOfRangeSlots) {
  const int64_t row = layout_.row_bytes(1, KvSide::kK);
  const int64_t values = row / 2;
  // 1.0 and 2.0 in bf16 are 0x3F80 and 0x4000: their high bytes 0x3F and 0x40.
  std::vector<float> k(static_cast<size_t>(3 * values), 1.0f), v(k.size(), 2.0f);
  const std::vector<int64_t> slots = {5, -1, 23};  // block 1 offset 1, padding, block 5 offset 3
  ASSERT_TRUE(
      WriteKv(pool_,
              {.layer = 1, .num_tokens = 3, .k = k.data(), .v = v.data(), .slots = slots.data()})
          .ok());
  EXPECT_EQ(pool_.k(1, 1)[row + 1], 0x3F);
  EXPECT_EQ(pool_.v(1, 1)[row + 1], 0x40);
  EXPECT_EQ(pool_.k(5, 1)[3 * row + 1], 0x3F);
  EXPECT_EQ(pool_.k(1, 0)[row], 1);  // other layer untouched
  const std::vector<char> before = arena_;
  const std::vector<int64_t> bad = {0, 24};  // 24 = block 6: past the pool
  EXPECT_EQ(
      WriteKv(pool_,
              {.layer = 0, .num_tokens = 2, .k = k.data(), .v = v.data(), .slots = bad.data()})
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena_, before);  // nothing written
  EXPECT_EQ(WriteKv(pool_, {.layer = 2, .num_tokens = 0}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(KernelsTest, CopyAndFillWholeBlocks) {
  for (size_t i = 0; i < arena_.size(); ++i) arena_[i] = static_cast<char>(i);
  const std::vector<int32_t> pairs = {2, 4};
  ASSERT_TRUE(CopyBlocks(pool_, {.num_pairs = 1, .pairs = pairs.data()}).ok());
  const int64_t bytes = layout_.block_bytes();
  EXPECT_EQ(std::memcmp(pool_.k(2, 0), pool_.k(4, 0), static_cast<size_t>(bytes)), 0);
  const std::vector<int32_t> blocks = {0, 3};
  ASSERT_TRUE(
      FillBlocks(pool_, {.num_blocks = 2, .blocks = blocks.data(), .pattern = FillPattern::kPoison})
          .ok());
  for (int64_t i = 0; i < bytes / 2; ++i) {
    uint16_t h;
    std::memcpy(&h, pool_.k(3, 0) + 2 * i, 2);
    ASSERT_TRUE(std::isnan(BF16ToFloat(h)));
  }
  ASSERT_TRUE(FillBlocks(pool_, {.num_blocks = 1, .blocks = blocks.data()}).ok());
  EXPECT_EQ(pool_.k(0, 0)[bytes - 1], 0);
  const std::vector<int32_t> bad = {1, 6};
  EXPECT_EQ(CopyBlocks(pool_, {.num_pairs = 1, .pairs = bad.data()}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DTypeTest, ConversionsRoundTripAndPoisonIsNaN) {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 1e-5f, 3.14159f}) {
    EXPECT_NEAR(F16ToFloat(FloatToF16(f)), f, std::abs(f) * 1e-3 + 1e-7) << f;
    EXPECT_NEAR(BF16ToFloat(FloatToBF16(f)), f, std::abs(f) * 1e-2 + 1e-7) << f;
  }
  EXPECT_TRUE(std::isinf(F16ToFloat(FloatToF16(1e6f))));
  EXPECT_TRUE(std::isnan(F16ToFloat(kPoisonF16)));
  EXPECT_TRUE(std::isnan(BF16ToFloat(kPoisonBF16)));
  float f;
  std::memcpy(&f, &kPoisonF32, 4);
  EXPECT_TRUE(std::isnan(f));
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("fp8"), DType::kFp8E4M3);
  EXPECT_EQ(*ParseDType("int8"), DType::kInt8);
  EXPECT_FALSE(ParseDType("fp4").ok());
}

TEST(PoolLayoutTest, BlockMajorOffsetsAndBudget) {
  const PoolLayout l{.block_size = 16,
                     .num_layers = 32,
                     .num_kv_heads = 8,
                     .head_dim = 128,
                     .dtype = DType::kBF16};
  EXPECT_EQ(l.chunk_bytes(), 16 * 8 * 128 * 2);
  EXPECT_EQ(l.block_bytes(), 2 * 32 * l.chunk_bytes());
  EXPECT_EQ(l.v_offset(3, 5) - l.k_offset(3, 5), l.chunk_bytes());
  EXPECT_EQ(l.k_offset(1, 0), l.block_bytes());
  const absl::StatusOr<PoolLayout> sized = LayoutForBudget(l, 256ll << 20);
  ASSERT_TRUE(sized.ok());
  EXPECT_EQ(sized->num_blocks, (256ll << 20) / l.block_bytes());
  EXPECT_FALSE(LayoutForBudget(l, 100).ok());
  PoolLayout bad = l;
  bad.head_dim = 12;
  EXPECT_EQ(ValidateLayout(bad).code(), absl::StatusCode::kInvalidArgument);
  PoolLayout other = l;
  other.dtype = DType::kF16;
  EXPECT_NE(l.Hash(), other.Hash());
  other = l;
  other.num_blocks = 7;  // capacity does not change what a block holds
  EXPECT_EQ(l.Hash(), other.Hash());
}

TEST(ThreadPoolTest, ParallelForCoversEveryIndexOnce) {
  ThreadPool pool(3);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::atomic<int>> hits(1000);
    pool.ParallelFor(1000, 7, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

}  // namespace
}  // namespace kvpool::kernels::cpu
