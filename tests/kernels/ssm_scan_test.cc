// The CPU state-space scan (kernel_args.h SsmScanArgs) against its double-precision reference,
// and the property issue 28's state checkpoints rest on: scanning a sequence's tokens at once, in
// chunks from the state each chunk left, or one token at a time gives the same outputs and the
// same state, bit for bit, with or without threads. Bad arguments are refused before anything
// is written.

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels::cpu {
namespace {

using test_util::NormalizedError;
using test_util::RandomFloats;

struct Shape {
  int32_t heads, groups, head_dim, d_state;
};

// Random inputs for sequences of `lens` tokens, and a random starting state for each.
struct Problem {
  Problem(Shape shape, std::vector<int32_t> lens, uint32_t seed) : s(shape) {
    std::mt19937 rng(seed);
    starts.push_back(0);
    for (int32_t len : lens) starts.push_back(starts.back() + len);
    const int64_t tokens = starts.back();
    x = RandomFloats(tokens * s.heads * s.head_dim, &rng);
    b = RandomFloats(tokens * s.groups * s.d_state, &rng);
    c = RandomFloats(tokens * s.groups * s.d_state, &rng);
    d = RandomFloats(s.heads, &rng);
    std::uniform_real_distribution<float> dt_dist(0.001f, 0.2f), a_dist(-4.0f, -0.5f);
    for (int64_t i = 0; i < tokens * s.heads; ++i) dt.push_back(dt_dist(rng));
    for (int32_t h = 0; h < s.heads; ++h) a.push_back(a_dist(rng));
    for (size_t i = 0; i < lens.size(); ++i) {
      states.push_back(RandomFloats(int64_t{s.heads} * s.d_state * s.head_dim, &rng));
    }
    y.assign(x.size(), -1.0f);
  }

  // Arguments over every sequence's tokens, `states` pointing at each one's state.
  SsmScanArgs AllArgs(std::vector<float*>* states) {
    states->clear();
    for (auto& st : this->states) states->push_back(st.data());
    return {.num_seqs = static_cast<int32_t>(states->size()),
            .num_heads = s.heads,
            .head_dim = s.head_dim,
            .d_state = s.d_state,
            .num_groups = s.groups,
            .starts = starts.data(),
            .x = x.data(),
            .dt = dt.data(),
            .a_log_neg = a.data(),
            .b = b.data(),
            .c = c.data(),
            .d = d.data(),
            .states = states->data(),
            .y = y.data()};
  }

  // Scans tokens [from, to) of every sequence (clamped to its length), one sequence at a time:
  // SsmScanArgs takes one starts array, and each chunk's rows are a pair of their own.
  void Scan(int32_t from, int32_t to, ThreadPool* threads) {
    std::vector<float*> ptrs;
    SsmScanArgs args = AllArgs(&ptrs);
    args.num_seqs = 1;
    for (size_t i = 0; i < ptrs.size(); ++i) {
      const int32_t len = starts[i + 1] - starts[i];
      const int32_t rows[2] = {starts[i] + std::min(from, len), starts[i] + std::min(to, len)};
      args.starts = rows;
      args.states = ptrs.data() + i;
      ASSERT_TRUE(SsmScan(args, threads).ok());
    }
  }

  Shape s;
  std::vector<int32_t> starts;
  std::vector<float> x, b, c, d, dt, a, y;
  std::vector<std::vector<float>> states;
};

const std::vector<int32_t> kLens = {1, 37, 0, 200, 64};

class SsmScanTest : public ::testing::TestWithParam<Shape> {};

TEST_P(SsmScanTest, MatchesTheDoublePrecisionReference) {
  Problem p(GetParam(), kLens, 3);
  Problem ref = p;
  ThreadPool threads(2);
  std::vector<float*> states, ref_states;
  ASSERT_TRUE(SsmScan(p.AllArgs(&states), &threads).ok());
  SsmScanReference(ref.AllArgs(&ref_states));
  bool nan = false;
  EXPECT_LT(NormalizedError(p.y, ref.y, &nan), 1e-5);
  EXPECT_FALSE(nan);
  for (size_t i = 0; i < p.states.size(); ++i) {
    EXPECT_LT(NormalizedError(p.states[i], ref.states[i], &nan), 1e-5) << "sequence " << i;
  }
}

// At once, in chunks from each chunk's state, or token by token: the same bits.
TEST_P(SsmScanTest, AStateIsAnExactResumePoint) {
  Problem whole(GetParam(), kLens, 5);
  Problem chunked = whole, stepped = whole, alone = whole;
  ThreadPool threads(2);
  whole.Scan(0, 200, &threads);
  for (auto [from, to] : {std::pair{0, 13}, {13, 14}, {14, 64}, {64, 200}}) {
    chunked.Scan(from, to, &threads);
  }
  for (int32_t t = 0; t < 200; ++t) stepped.Scan(t, t + 1, &threads);
  alone.Scan(0, 200, nullptr);
  for (const Problem* other : {&chunked, &stepped, &alone}) {
    EXPECT_EQ(other->y, whole.y);
    EXPECT_EQ(other->states, whole.states);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SsmScanTest,
                         ::testing::Values(Shape{4, 2, 16, 16}, Shape{8, 1, 64, 64},
                                           Shape{6, 6, 24, 8}, Shape{2, 1, 128, 128}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           const Shape& s = info.param;
                           return fmt::format("h{}g{}p{}n{}", s.heads, s.groups, s.head_dim,
                                              s.d_state);
                         });

TEST(SsmScanArgsTest, RefusesBadArgumentsBeforeWriting) {
  Problem p({4, 2, 16, 16}, {5, 3}, 9);
  std::vector<float*> states;
  const std::vector<std::vector<float>> before = p.states;
  const SsmScanArgs good = p.AllArgs(&states);
  auto refused = [&](SsmScanArgs a) {
    EXPECT_EQ(SsmScan(a, nullptr).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(p.states, before);
    EXPECT_TRUE(std::all_of(p.y.begin(), p.y.end(), [](float v) { return v == -1.0f; }));
  };
  SsmScanArgs a = good;
  a.num_groups = 3;  // does not divide 4 heads
  refused(a);
  a = good;
  a.d_state = 0;
  refused(a);
  a = good;
  a.b = nullptr;
  refused(a);
  std::vector<int32_t> backwards = {0, 5, 2};
  a = good;
  a.starts = backwards.data();
  refused(a);
  std::vector<float*> missing = {states[0], nullptr};
  a = good;
  a.states = missing.data();
  refused(a);
  EXPECT_TRUE(SsmScan(good, nullptr).ok());
}

}  // namespace
}  // namespace kvpool::kernels::cpu
