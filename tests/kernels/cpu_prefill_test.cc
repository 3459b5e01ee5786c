// The CPU prefill kernel against the double-precision reference (one pseudo-sequence per query
// token, as the decode tests hold decode to it): block sizes 1, 16 and 64, every dtype, ragged
// query counts and reused prefixes, several query/KV head groupings, on every instruction set
// this processor has; and the arguments it must refuse before writing anything.

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

using cpu::Isa;
using test_util::NormalizedError;
using test_util::PrefillProblem;

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
  isa.erase(std::remove_if(isa.begin(), isa.end(), [](char ch) { return !std::isalnum(ch); }),
            isa.end());
  return fmt::format("bs{}_{}_q{}kv{}_d{}_{}", c.block_size, DTypeName(c.dtype), c.q_heads,
                     c.kv_heads, c.head_dim, isa);
}

class PrefillTest : public test_util::IsaTest<Case> {};

// (reused tokens, new tokens) per sequence: a prompt with nothing reused, chunks past a reused
// prefix (ending mid-block and on a block edge), single tokens, and tiles cut at every length.
const std::vector<std::pair<int32_t, int32_t>> kShapes = {{0, 1},  {0, 37},  {16, 1},  {200, 70},
                                                          {63, 2}, {64, 64}, {1, 130}, {500, 13}};

TEST_P(PrefillTest, MatchesTheDenseReference) {
  const Case& c = GetParam();
  PrefillProblem p({.block_size = c.block_size,
                    .num_layers = 2,
                    .num_kv_heads = c.kv_heads,
                    .head_dim = c.head_dim,
                    .dtype = c.dtype},
                   c.q_heads, kShapes, /*seed=*/99);
  ThreadPool threads(2);
  const int64_t workspace_bytes = PrefillWorkspaceBytes(p.layout, 2);
  std::vector<char> workspace(static_cast<size_t>(workspace_bytes) + 1);
  std::vector<float> got(p.q.size(), -1);
  PrefillArgs args = p.Args(got.data());
  args.workspace = workspace.data() + 1;  // any alignment
  args.workspace_bytes = workspace_bytes;
  ASSERT_TRUE(PagedAttentionPrefill(p.pool(), args, &threads).ok());
  bool nan = false;
  // The decode tests' bound: same stored values, f32 vs f64 accumulation and the vector exp.
  EXPECT_LT(NormalizedError(got, p.Reference(), &nan), 2e-5);
  EXPECT_FALSE(nan);

  // Without a thread pool (one worker slice), the same numbers.
  std::vector<float> alone(p.q.size(), -1);
  args.out = alone.data();
  ASSERT_TRUE(PagedAttentionPrefill(p.pool(), args, nullptr).ok());
  EXPECT_EQ(alone, got);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillTest,
    ::testing::Values(Case{1, DType::kBF16, 8, 2, 64, Isa::kAvx512},
                      Case{16, DType::kBF16, 8, 2, 64, Isa::kAvx512},
                      Case{64, DType::kBF16, 8, 2, 64, Isa::kAvx512},
                      Case{16, DType::kF16, 32, 8, 128, Isa::kAvx512},
                      Case{16, DType::kF32, 8, 4, 64, Isa::kAvx512},
                      Case{16, DType::kBF16, 6, 1, 128, Isa::kAvx512},   // group of 6
                      Case{16, DType::kBF16, 3, 3, 32, Isa::kAvx512},    // no grouping
                      Case{64, DType::kF16, 4, 2, 72, Isa::kAvx512},     // padded head_dim
                      Case{16, DType::kBF16, 160, 2, 16, Isa::kAvx512},  // group of 80 > tile
                      Case{1, DType::kBF16, 8, 2, 64, Isa::kAvx2},
                      Case{16, DType::kF16, 32, 8, 128, Isa::kAvx2},
                      Case{64, DType::kF32, 4, 2, 72, Isa::kAvx2},
                      Case{16, DType::kBF16, 6, 1, 128, Isa::kAvx2},
                      Case{1, DType::kBF16, 8, 2, 64, Isa::kPortable},
                      Case{16, DType::kF16, 6, 1, 128, Isa::kPortable},
                      Case{64, DType::kF32, 4, 2, 72, Isa::kPortable}),
    Name);

class PrefillArgsTest : public ::testing::Test {
 protected:
  PrefillArgsTest()
      : p_({.block_size = 16, .num_layers = 1, .num_kv_heads = 2, .head_dim = 32},
           /*q_heads=*/4, {{10, 6}, {0, 3}}, /*seed=*/5),
        workspace_(static_cast<size_t>(PrefillWorkspaceBytes(p_.layout, 1))),
        out_(p_.q.size(), 7.0f) {
    args_ = p_.Args(out_.data());
    args_.workspace = workspace_.data();
    args_.workspace_bytes = static_cast<int64_t>(workspace_.size());
  }

  // Runs with `args` and expects INVALID_ARGUMENT with nothing written.
  void ExpectRejected(const PrefillArgs& args) {
    EXPECT_EQ(PagedAttentionPrefill(p_.pool(), args, nullptr).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(std::all_of(out_.begin(), out_.end(), [](float x) { return x == 7.0f; }));
  }

  PrefillProblem p_;
  std::vector<char> workspace_;
  std::vector<float> out_;
  PrefillArgs args_;
};

TEST_F(PrefillArgsTest, AcceptsTheProblemAsMade) {
  ASSERT_TRUE(PagedAttentionPrefill(p_.pool(), args_, nullptr).ok());
  bool nan = false;
  EXPECT_LT(NormalizedError(out_, p_.Reference(), &nan), 2e-5);
}

TEST_F(PrefillArgsTest, RejectsBadArgumentsBeforeWriting) {
  PrefillArgs a = args_;
  a.workspace_bytes -= 1;
  ExpectRejected(a);
  a = args_;
  a.max_q_len = 5;  // sequence 0 has 6 queries
  ExpectRejected(a);
  std::vector<int32_t> lens = p_.seq_lens;
  lens[1] = 2;  // fewer tokens than its 3 queries
  a = args_;
  a.seq_lens = lens.data();
  ExpectRejected(a);
  std::vector<int32_t> tables = p_.tables;
  tables[1] = p_.layout.num_blocks;  // sequence 0's second block, outside the pool
  a = args_;
  a.block_tables = tables.data();
  ExpectRejected(a);
  std::vector<int32_t> starts = p_.q_starts;
  std::swap(starts[0], starts[1]);  // decreasing
  a = args_;
  a.q_starts = starts.data();
  ExpectRejected(a);
  a = args_;
  a.num_q_heads = 3;
  ExpectRejected(a);
}

}  // namespace
}  // namespace kvpool::kernels::cpu
