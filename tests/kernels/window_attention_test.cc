// Sliding-window attention in the CPU decode and prefill kernels (kernel_args.h
// AttentionWindow): every query sees its window (p - W, p] and the first S positions (sinks),
// against a double-precision reference over exactly those keys; the blocks no query of a call
// sees are released (table entries -1) and never read; a window as long as the sequence is full
// attention, bit for bit; and bad windows are refused. On every instruction set this processor
// has, every KV dtype.

#include <algorithm>
#include <cctype>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels::cpu {
namespace {

using test_util::NormalizedError;
using test_util::PrefillProblem;

struct Case {
  DType dtype;
  Isa isa;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  std::string isa(IsaName(info.param.isa));
  isa.erase(std::remove_if(isa.begin(), isa.end(), [](char ch) { return !std::isalnum(ch); }),
            isa.end());
  return fmt::format("{}_{}", DTypeName(info.param.dtype), isa);
}

// (window, sinks): a window of one token, windows inside a block and across several, sinks
// inside and past the window's start, and a window longer than every sequence.
const std::vector<AttentionWindow> kWindows = {{1, 0},   {7, 0},  {64, 0},  {100, 4},
                                               {33, 40}, {5, 17}, {2000, 3}};

// (reused tokens, new tokens) per sequence: fresh prompts longer than the windows, chunks past a
// reused prefix, single tokens.
const std::vector<std::pair<int32_t, int32_t>> kShapes = {{0, 300}, {200, 90}, {517, 1},
                                                          {64, 64}, {0, 5},    {130, 2}};

class WindowTest : public test_util::IsaTest<Case> {
 protected:
  static PrefillProblem Problem() {
    return PrefillProblem({.block_size = 16,
                           .num_layers = 2,
                           .num_kv_heads = 2,
                           .head_dim = 64,
                           .dtype = GetParam().dtype},
                          /*q_heads=*/8, kShapes, /*seed=*/31);
  }

  // The bound against the reference over what the pool holds: f32 vs f64 accumulation, and for
  // the 8-bit dtypes the query rounding of the VNNI decode path.
  static double Bound() { return DTypeHasScales(GetParam().dtype) ? 2e-2 : 2e-5; }
};

// The reference: query i of sequence s (at position p) over the keys it sees, gathered densely.
std::vector<float> WindowReference(const PrefillProblem& p, const AttentionWindow& w) {
  const int64_t row = static_cast<int64_t>(p.layout.num_kv_heads) * p.layout.head_dim;
  std::vector<std::vector<float>> ks, vs;
  std::vector<int32_t> lens;
  for (size_t s = 0; s < p.seq_lens.size(); ++s) {
    const int32_t q_len = p.q_starts[s + 1] - p.q_starts[s];
    for (int32_t i = 0; i < q_len; ++i) {
      const int64_t pos = p.seq_lens[s] - q_len + i;
      std::vector<float> k, v;
      for (int64_t key = 0; key <= pos; ++key) {
        if (!w.Sees(pos, key)) continue;
        k.insert(k.end(), p.dense_k[s].begin() + key * row, p.dense_k[s].begin() + (key + 1) * row);
        v.insert(v.end(), p.dense_v[s].begin() + key * row, p.dense_v[s].begin() + (key + 1) * row);
      }
      lens.push_back(static_cast<int32_t>(k.size() / row));
      ks.push_back(std::move(k));
      vs.push_back(std::move(v));
    }
  }
  std::vector<const void*> k, v;
  for (size_t i = 0; i < ks.size(); ++i) {
    k.push_back(ks[i].data());
    v.push_back(vs[i].data());
  }
  std::vector<float> out(p.q.size(), -1);
  ReferenceAttentionDecode({.num_seqs = static_cast<int32_t>(lens.size()),
                            .num_q_heads = p.num_q_heads,
                            .num_kv_heads = p.layout.num_kv_heads,
                            .head_dim = p.layout.head_dim,
                            .dtype = DType::kF32,
                            .scale = p.scale(),
                            .q = p.q.data(),
                            .out = out.data(),
                            .k = k.data(),
                            .v = v.data(),
                            .seq_lens = lens.data()});
  return out;
}

// The tables with every block that no query at a position in [first_pos(s), len(s) - 1] sees
// released (-1), as a pool that frees blocks leaving a window holds them.
std::vector<int32_t> Released(const PrefillProblem& p, const AttentionWindow& w, bool decode_only) {
  std::vector<int32_t> tables = p.tables;
  const int32_t bs = p.layout.block_size;
  for (size_t s = 0; s < p.seq_lens.size(); ++s) {
    const int32_t len = p.seq_lens[s];
    const int64_t first = decode_only ? len - 1 : len - (p.q_starts[s + 1] - p.q_starts[s]);
    for (int32_t b = 0; b * bs < len; ++b) {
      bool seen = false;
      for (int64_t key = int64_t{b} * bs; key < std::min<int64_t>(len, (b + 1) * bs); ++key) {
        for (int64_t pos = first; pos < len && !seen; ++pos) seen = w.Sees(pos, key);
      }
      if (!seen) tables[s * p.stride + b] = -1;
    }
  }
  return tables;
}

TEST_P(WindowTest, PrefillSeesItsWindowAndSinksOnly) {
  PrefillProblem p = Problem();
  ThreadPool threads(2);
  std::vector<char> workspace(static_cast<size_t>(PrefillWorkspaceBytes(p.layout, 2)));
  for (const AttentionWindow& w : kWindows) {
    SCOPED_TRACE(fmt::format("window {} sinks {}", w.window, w.sinks));
    const std::vector<int32_t> tables = Released(p, w, /*decode_only=*/false);
    std::vector<float> got(p.q.size(), -1);
    PrefillArgs args = p.Args(got.data());
    args.block_tables = tables.data();
    args.window = w;
    args.workspace = workspace.data();
    args.workspace_bytes = static_cast<int64_t>(workspace.size());
    ASSERT_TRUE(PagedAttentionPrefill(p.pool(), args, &threads).ok());
    bool nan = false;
    EXPECT_LT(NormalizedError(got, WindowReference(p, w), &nan), 2e-5);
    EXPECT_FALSE(nan);
  }
}

// Decode of each sequence's last query, its table released down to that query's window.
TEST_P(WindowTest, DecodeSeesItsWindowAndSinksOnly) {
  PrefillProblem p = Problem();
  const int64_t row = static_cast<int64_t>(p.num_q_heads) * p.layout.head_dim;
  const auto num_seqs = static_cast<int32_t>(p.seq_lens.size());
  std::vector<float> q;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int64_t last = p.q_starts[s + 1] - 1;
    q.insert(q.end(), p.q.begin() + last * row, p.q.begin() + (last + 1) * row);
  }
  ThreadPool threads(2);
  for (const AttentionWindow& w : kWindows) {
    SCOPED_TRACE(fmt::format("window {} sinks {}", w.window, w.sinks));
    const std::vector<int32_t> tables = Released(p, w, /*decode_only=*/true);
    std::vector<float> got(q.size(), -1);
    const DecodeArgs args{.layer = p.layout.num_layers - 1,
                          .num_seqs = num_seqs,
                          .num_q_heads = p.num_q_heads,
                          .scale = p.scale(),
                          .q = q.data(),
                          .out = got.data(),
                          .block_tables = tables.data(),
                          .table_stride = p.stride,
                          .seq_lens = p.seq_lens.data(),
                          .max_seq_len = p.max_seq_len,
                          .window = w};
    ASSERT_TRUE(PagedAttentionDecode(p.pool(), args, &threads).ok());
    const std::vector<float> all = WindowReference(p, w);
    std::vector<float> want;
    for (int32_t s = 0; s < num_seqs; ++s) {
      const int64_t last = p.q_starts[s + 1] - 1;
      want.insert(want.end(), all.begin() + last * row, all.begin() + (last + 1) * row);
    }
    bool nan = false;
    EXPECT_LT(NormalizedError(got, want, &nan), Bound());
    EXPECT_FALSE(nan);
  }
}

// A window that reaches every key is full attention: the same ranges and chunks, the same bits.
TEST_P(WindowTest, AWindowOverTheWholeSequenceIsFullAttentionBitForBit) {
  PrefillProblem p = Problem();
  std::vector<char> workspace(static_cast<size_t>(PrefillWorkspaceBytes(p.layout, 1)));
  std::vector<float> full(p.q.size(), -1), windowed(p.q.size(), -2);
  PrefillArgs args = p.Args(full.data());
  args.workspace = workspace.data();
  args.workspace_bytes = static_cast<int64_t>(workspace.size());
  ASSERT_TRUE(PagedAttentionPrefill(p.pool(), args, nullptr).ok());
  args.out = windowed.data();
  args.window = {.window = p.max_seq_len, .sinks = 5};
  ASSERT_TRUE(PagedAttentionPrefill(p.pool(), args, nullptr).ok());
  EXPECT_EQ(full, windowed);
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, WindowTest,
    ::testing::Values(Case{DType::kF32, Isa::kAvx512}, Case{DType::kBF16, Isa::kAvx512},
                      Case{DType::kInt8, Isa::kAvx512}, Case{DType::kFp8E4M3, Isa::kAvx512},
                      Case{DType::kF32, Isa::kAvx2}, Case{DType::kBF16, Isa::kPortable}),
    Name);

TEST(WindowArgsTest, RefusesANegativeWindowOrAReleasedBlockInsideIt) {
  PrefillProblem p({.block_size = 16, .num_layers = 1, .num_kv_heads = 2, .head_dim = 32},
                   /*q_heads=*/4, {{40, 8}}, /*seed=*/5);
  std::vector<char> workspace(static_cast<size_t>(PrefillWorkspaceBytes(p.layout, 1)));
  std::vector<float> out(p.q.size(), 7.0f);
  PrefillArgs args = p.Args(out.data());
  args.workspace = workspace.data();
  args.workspace_bytes = static_cast<int64_t>(workspace.size());
  args.window = {.window = -1};
  EXPECT_EQ(PagedAttentionPrefill(p.pool(), args, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  args.window = {.window = 8, .sinks = -2};
  EXPECT_EQ(PagedAttentionPrefill(p.pool(), args, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  // Queries at 40..47 with a window of 8 see keys 33..47, all in block 2: blocks 0 and 1 may go,
  // block 2 may not.
  args.window = {.window = 8};
  std::vector<int32_t> tables = p.tables;
  tables[0] = tables[1] = -1;
  args.block_tables = tables.data();
  EXPECT_TRUE(PagedAttentionPrefill(p.pool(), args, nullptr).ok());
  tables[2] = -1;
  std::fill(out.begin(), out.end(), 7.0f);
  EXPECT_EQ(PagedAttentionPrefill(p.pool(), args, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 7.0f; }));
}

}  // namespace
}  // namespace kvpool::kernels::cpu
