// The window group end to end in LocalEngine (issue 28, docs/hybrid-groups.md §3): the sliding
// layers keep their K/V in window blocks of their own, each step's window is slid past after it
// (SlideWindow), and a prompt resumes only where the window group still holds its window. Held
// bit for bit (f32) against an engine that keeps every token in its main blocks and has no prefix
// cache, running the same steps: a long decode, a conversation's next turn, a match the window
// group cut, a fork and a rewind, and sinks.

#include <algorithm>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/check.h"
#include "model/local_engine.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using ::testing::HasSubstr;

// The sequence's live window-group entries.
int64_t LiveWindowEntries(const LocalEngine& e, SequenceId seq) {
  const Sequence* s = const_cast<LocalEngine&>(e).cache().Find(seq);
  KVPOOL_CHECK(s != nullptr);
  return std::count_if(s->window_table.begin(), s->window_table.end(),
                       [](BlockId b) { return b != kInvalidBlock; });
}

class WindowEngineTest : public ::testing::Test {
 protected:
  // `engine_`: a window group of `window_blocks` (0: the default) and a prefix cache;
  // `reference_`: every token in the main blocks, no prefix cache.
  void Make(int32_t window, int32_t sinks, int32_t window_blocks = 0) {
    const ModelWeights w = SyntheticWeights(WindowedTestConfig(window, sinks), 11);
    LocalEngine::Options o{.dtype = kernels::DType::kF32,
                           .pool_bytes = int64_t{8} << 20,
                           .prefix_cache = true,
                           .window_blocks = window_blocks,
                           .threads = 2};
    auto a = LocalEngine::Create(w, o);
    ASSERT_TRUE(a.ok()) << a.status();
    o.prefix_cache = false;
    o.window_blocks = -1;
    auto b = LocalEngine::Create(w, o);
    ASSERT_TRUE(b.ok()) << b.status();
    engine_ = std::move(*a);
    reference_ = std::move(*b);
    ASSERT_NE(engine_->cache().window(), nullptr);
    ASSERT_EQ(reference_->cache().window(), nullptr);
  }

  // One decode step of `seq` on `e` feeding `token`; returns the result.
  static ItemResult Step(LocalEngine& e, SequenceId seq, int32_t token) {
    const DecodeInput in{seq, token};
    auto r = e.Decode(std::span(&in, 1), {.keep_logits = true});
    KVPOOL_CHECK_OK(r.status());
    return std::move((*r)[0]);
  }

  // Decodes `n` steps on both engines from their next tokens, expecting the same logits bit for
  // bit at every step and the engine's sequence within the window bound after each. Returns the
  // next tokens.
  std::pair<int32_t, int32_t> DecodeBoth(SequenceId a, int32_t ta, SequenceId b, int32_t tb,
                                         int n) {
    for (int i = 0; i < n; ++i) {
      const ItemResult ra = Step(*engine_, a, ta), rb = Step(*reference_, b, tb);
      EXPECT_EQ(ra.logits, rb.logits) << "step " << i;
      EXPECT_LE(LiveWindowEntries(*engine_, a), engine_->cache().WindowBound()) << "step " << i;
      ta = ra.next_token;
      tb = rb.next_token;
    }
    return {ta, tb};
  }

  // `prompt` on the engine resumes some prefix (returned with its result); the reference computes
  // the same steps: its sequence `base` (which computed the engine's cached tokens in the same
  // steps) rewound to what the engine resumed, then a prefill of the rest (a new sequence without
  // `base`). Equal logits.
  LocalEngine::PrefillResult PrefillBoth(const std::vector<int32_t>& prompt, SequenceId base,
                                         SequenceId* ref, int32_t* ref_next) {
    auto got = engine_->Prefill(SequenceId(0), prompt, {.keep_logits = true});
    KVPOOL_CHECK_OK(got.status());
    if (base == SequenceId(0)) {
      EXPECT_EQ(got->reused, 0);
    } else {
      KVPOOL_CHECK_OK(reference_->Truncate(base, got->reused));
    }
    auto want = reference_->Prefill(
        base, std::span(prompt).subspan(static_cast<size_t>(got->reused)), {.keep_logits = true});
    KVPOOL_CHECK_OK(want.status());
    EXPECT_EQ(got->result.logits, want->result.logits);
    *ref = want->sequence;
    *ref_next = want->result.next_token;
    return *std::move(got);
  }

  void ExpectInvariants() {
    const absl::Status s = engine_->cache().CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
  }

  std::unique_ptr<LocalEngine> engine_;
  std::unique_ptr<LocalEngine> reference_;
};

// A sequence decoding far past its window holds a bounded number of window blocks while its
// main table grows with it, and computes what keeping every token computes.
TEST_F(WindowEngineTest, ALongDecodeHoldsABoundedWindowAndComputesTheSame) {
  Make(/*window=*/20, /*sinks=*/0);
  EXPECT_EQ(engine_->cache().WindowBound(), 3);  // ceil((20 + 16) / 16)
  SequenceId ref(0);
  int32_t ref_next = 0;
  const LocalEngine::PrefillResult p =
      PrefillBoth(RandomTokens(70, 256, 1), SequenceId(0), &ref, &ref_next);
  EXPECT_EQ(p.reused, 0);
  EXPECT_LE(LiveWindowEntries(*engine_, p.sequence), 3);
  DecodeBoth(p.sequence, p.result.next_token, ref, ref_next, 200);
  const Sequence& seq = *engine_->cache().Find(p.sequence);
  EXPECT_EQ(seq.num_tokens, 270);
  EXPECT_EQ(seq.table.size(), 17u);
  EXPECT_EQ(seq.window_table.size(), 17u);
  const KvCacheStats stats = engine_->cache().stats();
  EXPECT_GE(stats.windows.released, 14u);
  ExpectInvariants();
}

// A conversation's next turn resumes from the cache with its window kept there, and computes what
// recomputing it computes.
TEST_F(WindowEngineTest, ANextTurnResumesWithItsWindow) {
  Make(/*window=*/20, /*sinks=*/0);
  SequenceId ref(0);
  int32_t ref_next = 0;
  std::vector<int32_t> history = RandomTokens(70, 256, 2);
  const LocalEngine::PrefillResult first = PrefillBoth(history, SequenceId(0), &ref, &ref_next);
  // Twelve decodes on both; the engine's answers become the conversation's history.
  int32_t next = first.result.next_token;
  for (int i = 0; i < 12; ++i) {
    history.push_back(next);
    const ItemResult a = Step(*engine_, first.sequence, next), b = Step(*reference_, ref, next);
    EXPECT_EQ(a.logits, b.logits);
    next = a.next_token;
  }
  ASSERT_TRUE(engine_->Free(first.sequence, /*commit=*/true).ok());
  const std::vector<int32_t> more = RandomTokens(9, 256, 3);
  history.insert(history.end(), more.begin(), more.end());
  const LocalEngine::PrefillResult second = PrefillBoth(history, ref, &ref, &ref_next);
  EXPECT_GE(second.reused, 80);  // the first turn's five full blocks (and the partial one)
  DecodeBoth(second.sequence, second.result.next_token, ref, ref_next, 40);
  ExpectInvariants();
}

// With too few window blocks for the cache to keep a document's window, a prompt through it
// resumes only where its window is still there (counted as window_evicted), and computes the same.
TEST_F(WindowEngineTest, AMatchIsCutWhereTheWindowGroupDroppedItsBlocks) {
  Make(/*window=*/20, /*sinks=*/0, /*window_blocks=*/8);
  SequenceId ref(0);
  int32_t ref_next = 0;
  const std::vector<int32_t> document = RandomTokens(96, 256, 4);
  SequenceId doc_ref(0);
  const LocalEngine::PrefillResult a = PrefillBoth(document, SequenceId(0), &doc_ref, &ref_next);
  ASSERT_TRUE(engine_->Free(a.sequence, /*commit=*/true).ok());
  // Another prompt takes the window group's blocks the document's left cached.
  const LocalEngine::PrefillResult b =
      PrefillBoth(RandomTokens(100, 256, 5), SequenceId(0), &ref, &ref_next);
  ASSERT_TRUE(engine_->Free(b.sequence, /*commit=*/false).ok());
  ASSERT_TRUE(reference_->Free(ref, false).ok());
  std::vector<int32_t> prompt = document;
  const std::vector<int32_t> tail = RandomTokens(10, 256, 6);
  prompt.insert(prompt.end(), tail.begin(), tail.end());
  const LocalEngine::PrefillResult c = PrefillBoth(prompt, doc_ref, &ref, &ref_next);
  EXPECT_LT(c.reused, 96);  // the full-attention blocks are all cached: the window group cut it
  EXPECT_GT(engine_->cache().stats().missed_window_evicted, 0u);
  DecodeBoth(c.sequence, c.result.next_token, ref, ref_next, 20);
  ExpectInvariants();
}

// A fork shares its parent's live window blocks (copying the partial one on write), and both
// compute what forks that keep every token compute. A rewind within the window goes on the same;
// one to a length whose window was released is refused, naming the lowest length it can go to.
TEST_F(WindowEngineTest, AForkAndARewindWithinTheWindowComputeTheSame) {
  Make(/*window=*/20, /*sinks=*/0);
  SequenceId ref(0);
  int32_t ref_next = 0;
  const LocalEngine::PrefillResult p =
      PrefillBoth(RandomTokens(50, 256, 7), SequenceId(0), &ref, &ref_next);
  // 77 tokens: the fork shares a partial block, copied on the first write.
  auto [ta, tb] = DecodeBoth(p.sequence, p.result.next_token, ref, ref_next, 27);
  auto child = engine_->Fork(p.sequence);
  auto ref_child = reference_->Fork(ref);
  ASSERT_TRUE(child.ok() && ref_child.ok());
  // The child goes another way (token 7), the parent on.
  DecodeBoth(*child, 7, *ref_child, 7, 25);
  std::tie(ta, tb) = DecodeBoth(p.sequence, ta, ref, tb, 25);
  ExpectInvariants();

  const int64_t length = engine_->cache().Find(p.sequence)->num_tokens;
  ASSERT_TRUE(engine_->Truncate(p.sequence, length - 2).ok());
  ASSERT_TRUE(reference_->Truncate(ref, length - 2).ok());
  DecodeBoth(p.sequence, 9, ref, 9, 10);
  const absl::Status refused = engine_->Truncate(p.sequence, 10);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("window"));
  EXPECT_EQ(engine_->cache().Find(p.sequence)->num_tokens, length + 8);  // unchanged
  ASSERT_TRUE(engine_->Free(*child, /*commit=*/true).ok());
  ASSERT_TRUE(engine_->Free(p.sequence, /*commit=*/true).ok());
  ExpectInvariants();
}

// Sinks: the first blocks stay while the window slides past the rest.
TEST_F(WindowEngineTest, SinksStayWhileTheWindowSlides) {
  Make(/*window=*/12, /*sinks=*/4);
  EXPECT_EQ(engine_->cache().WindowBound(), 3);  // ceil(28 / 16) + ceil(4 / 16)
  SequenceId ref(0);
  int32_t ref_next = 0;
  const LocalEngine::PrefillResult p =
      PrefillBoth(RandomTokens(40, 256, 8), SequenceId(0), &ref, &ref_next);
  DecodeBoth(p.sequence, p.result.next_token, ref, ref_next, 100);
  const Sequence& seq = *engine_->cache().Find(p.sequence);
  EXPECT_NE(seq.window_table[0], kInvalidBlock);  // the sink block
  EXPECT_EQ(seq.window_table[1], kInvalidBlock);
  ExpectInvariants();
}

TEST(WindowEngineOptionsTest, TheWindowGroupIsTheModelsAndOptional) {
  const ModelWeights w = SyntheticWeights(WindowedTestConfig(20, 0), 1);
  LocalEngine::Options o{.dtype = kernels::DType::kF32, .pool_bytes = int64_t{8} << 20};
  o.window_blocks = -2;
  EXPECT_EQ(LocalEngine::Create(w, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.window_blocks = 40;
  auto sized = LocalEngine::Create(w, o);
  ASSERT_TRUE(sized.ok()) << sized.status();
  EXPECT_EQ((*sized)->pool().layout.num_window_blocks, 40);
  EXPECT_EQ((*sized)->pool().layout.num_window_layers, 1);
  // Every attention layer sliding: the main blocks keep them all, as before window groups.
  ModelConfig all = WindowedTestConfig(20, 0);
  all.layer_kinds = {LayerKind::kSlidingAttention, LayerKind::kSlidingAttention};
  o.window_blocks = 0;
  auto every = LocalEngine::Create(SyntheticWeights(all, 1), o);
  ASSERT_TRUE(every.ok()) << every.status();
  EXPECT_EQ((*every)->pool().layout.num_window_layers, 0);
  EXPECT_EQ((*every)->cache().window(), nullptr);
}

}  // namespace
}  // namespace kvpool::model
