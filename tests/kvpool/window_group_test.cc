// The window group of a KvCacheManager (docs/hybrid-groups.md §3, §4): a window table beside each
// block table whose entries are released, fenced, as they leave the window (SlideWindow); the
// tree keeps the window blocks still live at Commit, and a prompt resumes only where the window
// group holds the window it needs.

#include <algorithm>
#include <array>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/event_mirror.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kTenant(100);
constexpr int32_t kBlockSize = 16;

using testing::ManualFences;

std::vector<int32_t> Prompt(int32_t n, int32_t salt = 0) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = 7 * i + 3 + salt;
  return out;
}

int64_t Live(const Sequence& seq) {
  int64_t n = 0;
  for (BlockId b : seq.window_table) n += b != kInvalidBlock ? 1 : 0;
  return n;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

class WindowGroupTest : public ::testing::Test {
 protected:
  void Make(int32_t window_blocks, int32_t window_tokens, int32_t sink_tokens = 0,
            int32_t num_blocks = 64, int32_t state_slots = 0, int32_t checkpoint_slots = 0,
            int32_t checkpoint_interval = 4, bool publish_journal = false) {
    auto cache = KvCacheManager::Create({.block_size = kBlockSize,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 64,
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .publish_journal = publish_journal,
                                         .state_slots = state_slots,
                                         .checkpoint_slots = checkpoint_slots,
                                         .checkpoint_interval = checkpoint_interval,
                                         .window_blocks = window_blocks,
                                         .window_tokens = window_tokens,
                                         .sink_tokens = sink_tokens});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  absl::StatusOr<AllocateResult> Alloc(SessionId session, int64_t tokens,
                                       std::span<const int32_t> prompt = {}) {
    plan_ = DevicePlan{};
    return cache_->Allocate(session, {.ns = kTenant, .num_tokens = tokens, .prompt = prompt},
                            &plan_);
  }

  const Sequence& Seq(SequenceId id) { return *cache_->Find(id); }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    EXPECT_TRUE(status.ok()) << status;
  }

  ManualClock clock_;
  ManualFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
  DevicePlan plan_;
};

TEST_F(WindowGroupTest, CreateValidatesTheWindowOptions) {
  const auto make = [](int32_t blocks, int32_t window, int32_t sinks) {
    return KvCacheManager::Create({.block_size = 16,
                                   .num_blocks = 8,
                                   .max_blocks_per_seq = 8,
                                   .window_blocks = blocks,
                                   .window_tokens = window,
                                   .sink_tokens = sinks})
        .status();
  };
  EXPECT_TRUE(make(0, 0, 0).ok());
  EXPECT_TRUE(make(4, 32, 4).ok());
  for (const absl::Status& s : {make(-1, 32, 0), make(4, 0, 0), make(4, 32, -1)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  EXPECT_THAT(std::string(make(4, 0, 0).message()), HasSubstr("window_tokens"));
  EXPECT_THAT(std::string(make(-1, 32, 0).message()), HasSubstr("window_blocks"));
  EXPECT_THAT(std::string(make(4, 32, -1).message()), HasSubstr("sink_tokens"));
}

TEST_F(WindowGroupTest, WithoutAWindowGroupNothingChanges) {
  Make(0, 0);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 40);
  ASSERT_TRUE(a.ok());
  EXPECT_THAT(Seq(a->sequence).window_table, IsEmpty());
  EXPECT_TRUE(plan_.window_fills.empty());
  EXPECT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 40).ok());
  EXPECT_EQ(cache_->WindowBound(), 0);
  EXPECT_EQ(cache_->stats().window.num_blocks, 0);
  ExpectInvariants();
}

// The bound: a long sequence decoded token by token, sliding after every step, never holds
// more than WindowBound() window blocks while its full table grows.
TEST_F(WindowGroupTest, ALongDecodeHoldsABoundedWindow) {
  for (const auto& [window, sinks] : {std::pair{64, 0}, std::pair{50, 5}, std::pair{16, 16}}) {
    SCOPED_TRACE(::testing::Message() << "W=" << window << " S=" << sinks);
    const int64_t bound = CeilDiv(window + kBlockSize, kBlockSize) + CeilDiv(sinks, kBlockSize);
    // Exactly the bound plus the block a one-token Grow may add: any leak is refused.
    Make(static_cast<int32_t>(bound + 1), window, sinks, /*num_blocks=*/64);
    ASSERT_EQ(cache_->WindowBound(), bound);
    absl::StatusOr<AllocateResult> a = Alloc(kAlice, 10);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 10).ok());
    int64_t most = 0;
    for (int64_t n = 11; n <= 64 * kBlockSize; ++n) {
      DevicePlan plan;
      ASSERT_TRUE(cache_->Grow(kAlice, a->sequence, n, &plan).ok()) << n;
      ASSERT_LE(Live(Seq(a->sequence)), bound + 2) << n;  // ceil(1 / block_size) + 1 more
      ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, n).ok());
      const Sequence& seq = Seq(a->sequence);
      ASSERT_LE(Live(seq), bound) << n;
      ASSERT_EQ(seq.window_table.size(), seq.table.size());
      most = std::max(most, Live(seq));
      // The sinks are never released.
      for (int64_t i = 0; i < CeilDiv(sinks, kBlockSize); ++i) {
        ASSERT_NE(seq.window_table[static_cast<size_t>(i)], kInvalidBlock) << n;
      }
      if (n % 97 == 0) ExpectInvariants();
    }
    EXPECT_EQ(Seq(a->sequence).table.size(), 64u);  // the full table grew all the way
    // The most it held: ceil((W + block_size - 2) / block_size) + sinks, the bound when W mod
    // block_size is 0 or 1.
    EXPECT_EQ(most, CeilDiv(window + kBlockSize - 2, kBlockSize) + CeilDiv(sinks, kBlockSize));
    EXPECT_EQ(cache_->stats().window.active, Live(Seq(a->sequence)));
    EXPECT_GT(cache_->stats().windows.released, 0u);
    ExpectInvariants();
  }
}

TEST_F(WindowGroupTest, ReleasedBlocksAreReusedOnlyAfterTheirFence) {
  Make(/*window_blocks=*/6, /*window_tokens=*/32);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 96);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(plan_.window_fills.size(), 6u);
  const std::vector<BlockId> before = Seq(a->sequence).window_table;
  // A step reads every window block; the window slides while it runs.
  ASSERT_TRUE(cache_->MarkWindowInFlight(before, Fence{0, 3}).ok());
  ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 96).ok());
  // 96 computed: the next query reads [65, 96], blocks 4 and 5.
  EXPECT_THAT(Seq(a->sequence).window_table,
              ElementsAre(kInvalidBlock, kInvalidBlock, kInvalidBlock, kInvalidBlock, before[4],
                          before[5]));
  EXPECT_EQ(cache_->stats().window.retiring, 4);
  ExpectInvariants();
  const std::string state = cache_->DebugString();
  absl::StatusOr<AllocateResult> early = Alloc(kBob, 16);
  ASSERT_EQ(early.status().code(), absl::StatusCode::kResourceExhausted) << early.status();
  ASSERT_TRUE(GetShortfall(early.status()).has_value());
  EXPECT_EQ(GetShortfall(early.status())->resource, Resource::kWindowBlocks);
  EXPECT_THAT(std::string(early.status().message()), HasSubstr("window group"));
  EXPECT_EQ(cache_->DebugString(), state);
  fences_.Complete(0, 3);
  absl::StatusOr<AllocateResult> b = Alloc(kBob, 64);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<BlockId> reused = Seq(b->sequence).window_table;
  std::sort(reused.begin(), reused.end());
  std::vector<BlockId> released(before.begin(), before.begin() + 4);
  std::sort(released.begin(), released.end());
  EXPECT_EQ(reused, released);
  EXPECT_EQ(plan_.window_fills.size(), 4u);
  ExpectInvariants();
}

TEST_F(WindowGroupTest, AGrowIsRefusedWholeWhenTheWindowGroupIsShort) {
  Make(/*window_blocks=*/5, /*window_tokens=*/64);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 32);
  absl::StatusOr<AllocateResult> b = Alloc(kAlice, 24);
  ASSERT_TRUE(a.ok() && b.ok());
  const std::string state = cache_->DebugString();
  // a needs one more block, b one more: the full group has them, the window group one.
  const std::array requests{GrowRequest{a->sequence, 40}, GrowRequest{b->sequence, 40}};
  DevicePlan plan;
  std::vector<TableChange> changes;
  const absl::Status s = cache_->GrowBatch(kAlice, requests, &plan, &changes);
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(GetShortfall(s)->resource, Resource::kWindowBlocks);
  EXPECT_EQ(GetShortfall(s)->blocks, 1);
  EXPECT_TRUE(plan.empty());
  EXPECT_TRUE(changes.empty());
  EXPECT_EQ(cache_->DebugString(), state);
  // One of them fits, with a block in each group.
  ASSERT_TRUE(cache_->GrowBatch(kAlice, std::span(requests).first(1), &plan, &changes).ok());
  EXPECT_EQ(plan.fills.size(), 1u);
  EXPECT_EQ(plan.window_fills.size(), 1u);
  EXPECT_EQ(Seq(a->sequence).window_table.back(), plan.window_fills[0].block);
  // RevertGrow undoes both groups.
  cache_->RevertGrow(kAlice, changes);
  EXPECT_EQ(Seq(a->sequence).window_table.size(), 2u);
  EXPECT_EQ(Seq(a->sequence).table.size(), 2u);
  EXPECT_EQ(cache_->stats().window.free, 1);
  EXPECT_EQ(cache_->stats().pool.active, 4);
  ExpectInvariants();
}

TEST_F(WindowGroupTest, ForkSharesLiveWindowBlocksAndCopiesThePartialOne) {
  Make(/*window_blocks=*/16, /*window_tokens=*/16);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 40);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 40).ok());  // reads [25, 40]: from block 1
  const std::vector<BlockId> parent = Seq(a->sequence).window_table;
  ASSERT_EQ(parent[0], kInvalidBlock);
  DevicePlan plan;
  absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, a->sequence, &plan);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::vector<BlockId>& mine = Seq(*child).window_table;
  ASSERT_EQ(mine.size(), 3u);
  EXPECT_EQ(mine[0], kInvalidBlock);
  EXPECT_EQ(mine[1], parent[1]);
  EXPECT_NE(mine[2], parent[2]);
  EXPECT_THAT(plan.window_copies, ElementsAre(BlockCopy{parent[2], mine[2]}));
  EXPECT_EQ(cache_->window()->refs(parent[1]), 2u);
  ExpectInvariants();
  // Both write into the shared block after a rewind into it: each group copies on its own.
  ASSERT_TRUE(cache_->Truncate(kAlice, *child, 31).ok());
  plan = DevicePlan{};
  std::vector<TableChange> changes;
  ASSERT_TRUE(cache_->GrowBatch(kAlice, std::array{GrowRequest{*child, 33}}, &plan, &changes).ok());
  ASSERT_EQ(plan.window_copies.size(), 1u);
  EXPECT_EQ(plan.window_copies[0].src, parent[1]);
  EXPECT_EQ(changes[0].window_replaced, parent[1]);
  EXPECT_EQ(changes[0].first_changed, 1);
  ExpectInvariants();
}

TEST_F(WindowGroupTest, TruncateBelowTheReleasedWindowIsRefusedWithTheLowestLength) {
  Make(/*window_blocks=*/16, /*window_tokens=*/16);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 40);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 40).ok());  // block 0 released
  const std::string state = cache_->DebugString();
  // 20 tokens: the next query reads [5, 20], block 0 among them.
  const absl::Status s = cache_->Truncate(kAlice, a->sequence, 20);
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("lowest length it can go back to is 31"));
  EXPECT_EQ(cache_->DebugString(), state);
  ASSERT_TRUE(cache_->Truncate(kAlice, a->sequence, 31).ok());  // reads [16, 31]: block 1 on
  EXPECT_EQ(Seq(a->sequence).window_table.size(), 2u);
  EXPECT_EQ(cache_->stats().window.active, 1);
  ASSERT_TRUE(cache_->Truncate(kAlice, a->sequence, 0).ok());  // nothing to read
  EXPECT_THAT(Seq(a->sequence).window_table, IsEmpty());
  EXPECT_EQ(cache_->SlideWindow(kAlice, a->sequence, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->SlideWindow(kBob, a->sequence, 0).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->SlideWindow(kAlice, SequenceId(99), 0).code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(WindowGroupTest, SinksAreKeptAndResumedWithTheWindow) {
  Make(/*window_blocks=*/32, /*window_tokens=*/32, /*sink_tokens=*/16);
  const std::vector<int32_t> prompt = Prompt(100);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 100, prompt);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 100).ok());
  // Reads [69, 100] and the sink block 0: blocks 1..3 released.
  const std::vector<BlockId> w = Seq(a->sequence).window_table;
  EXPECT_THAT(w, ElementsAre(w[0], kInvalidBlock, kInvalidBlock, kInvalidBlock, w[4], w[5], w[6]));
  EXPECT_NE(w[0], kInvalidBlock);
  const absl::Status s = cache_->Truncate(kAlice, a->sequence, 17);
  EXPECT_THAT(std::string(s.message()), HasSubstr("(or 16 or fewer, within its sinks)"));
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
  EXPECT_EQ(cache_->stats().windows.kept, 4u);  // the sink and blocks 4, 5, 6
  EXPECT_EQ(cache_->stats().window.cached, 4);
  ExpectInvariants();
  absl::StatusOr<AllocateResult> b = Alloc(kBob, 110, prompt);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->matched_tokens, 100);
  const std::vector<BlockId>& mine = Seq(b->sequence).window_table;
  EXPECT_EQ(mine[0], w[0]);
  EXPECT_EQ(mine[1], kInvalidBlock);
  EXPECT_EQ(mine[4], w[4]);
  EXPECT_EQ(mine[5], w[5]);
  // Block 6 is matched as far as it is published; b writes only past that, alone: shared.
  EXPECT_EQ(mine[6], w[6]);
  EXPECT_THAT(plan_.window_copies, IsEmpty());
  // A third sequence resuming there while b writes into it gets copies, in both groups.
  absl::StatusOr<AllocateResult> c = Alloc(kAlice, 101, prompt);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->matched_tokens, 100);
  EXPECT_THAT(plan_.window_copies, ElementsAre(BlockCopy{w[6], Seq(c->sequence).window_table[6]}));
  EXPECT_EQ(plan_.copies.size(), 1u);
  ExpectInvariants();
}

TEST_F(WindowGroupTest, AMatchIsCutWhereAWindowBlockWasEvictedAndResumesBeforeIt) {
  Make(/*window_blocks=*/8, /*window_tokens=*/32);
  const std::vector<int32_t> prompt = Prompt(96);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 96, prompt);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 96).ok());  // every window block still live
  const std::vector<BlockId> w = Seq(a->sequence).window_table;
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence).ok());
  EXPECT_EQ(cache_->stats().window.cached, 6);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 96);
  // Window pressure: another sequence takes 3 window blocks, 2 free and one evicted (block 5's,
  // the least recently kept). The primary blocks all stay.
  absl::StatusOr<AllocateResult> c = Alloc(kBob, 48);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(cache_->stats().windows.evicted, 1u);
  EXPECT_EQ(cache_->stats().cache.nodes, 6);
  ExpectInvariants();
  // The attention match is 96 tokens; resuming there needs [65, 96): block 5 is a tombstone, so
  // the next candidate is 80, which needs blocks 3 and 4.
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 80);
  const MatchExplanation why = cache_->ExplainMatch(kTenant, prompt);
  EXPECT_EQ(why.matched_tokens, 96);
  EXPECT_EQ(why.resumable_tokens, 80);
  EXPECT_EQ(why.window_evicted_tokens, 16);
  EXPECT_THAT(why.ToString(), HasSubstr("the window group cuts 16"));
  absl::StatusOr<AllocateResult> b = Alloc(kBob, 100, prompt);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->matched_tokens, 80);
  EXPECT_EQ(cache_->stats().missed_window_evicted, 16u);
  const std::vector<BlockId>& mine = Seq(b->sequence).window_table;
  ASSERT_EQ(mine.size(), 7u);
  EXPECT_THAT(std::vector(mine.begin(), mine.begin() + 5),
              ElementsAre(kInvalidBlock, kInvalidBlock, kInvalidBlock, w[3], w[4]));
  EXPECT_EQ(Seq(b->sequence).table.size(), 7u);
  ExpectInvariants();
  // Full-group pressure takes primary blocks and their window blocks with them.
  ASSERT_TRUE(cache_->Free(kBob, b->sequence).ok());
  ASSERT_TRUE(cache_->Free(kBob, c->sequence).ok());
  EXPECT_EQ(cache_->EvictCached(64), 6);
  EXPECT_EQ(cache_->stats().windows.cached, 0);
  EXPECT_EQ(cache_->stats().window.cached, 0);
  ExpectInvariants();
}

TEST_F(WindowGroupTest, BlocksReleasedBeforeTheyArePublishedAreTombstones) {
  Make(/*window_blocks=*/8, /*window_tokens=*/32);
  const std::vector<int32_t> prompt = Prompt(80);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 80, prompt);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 80).ok());  // blocks 0..2 released
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
  EXPECT_EQ(cache_->stats().windows.kept, 2u);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 80);
  // A prompt that leaves at 64 would need blocks 2 and 3 there, 0 and 1 at 32: nothing resumes.
  std::vector<int32_t> other = prompt;
  other.resize(70);
  other[64] = -1;
  absl::StatusOr<AllocateResult> b = Alloc(kBob, 70, other);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->matched_tokens, 0);
  EXPECT_EQ(cache_->stats().missed_window_evicted, 64u);
  ExpectInvariants();
}

// A state group and a window group in one manager: the match is the longest prefix both resume
// from, their cuts alternating until they agree.
TEST_F(WindowGroupTest, CheckpointAndWindowCutsAgree) {
  Make(/*window_blocks=*/6, /*window_tokens=*/32, /*sink_tokens=*/0, /*num_blocks=*/64,
       /*state_slots=*/5, /*checkpoint_slots=*/3, /*checkpoint_interval=*/2);
  const std::vector<int32_t> prompt = Prompt(64);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 64, prompt);
  ASSERT_TRUE(a.ok());
  std::vector<PlannedCheckpoint> planned;
  ASSERT_TRUE(
      cache_->PlanCheckpoints(kAlice, a->sequence, 0, 64, /*prefill=*/false, &planned).ok());
  ASSERT_EQ(planned.size(), 2u);  // at 32 and 64
  ASSERT_TRUE(cache_->AdvanceState(kAlice, a->sequence, 64).ok());
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 64).ok());
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 64);
  // Window pressure evicts block 3's window block (the least recently kept).
  absl::StatusOr<AllocateResult> c = Alloc(kBob, 48);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(cache_->Free(kBob, c->sequence).ok());
  // Window: 64 needs block 3 -> 48; state: no checkpoint at 48 -> 32; window at 32 needs blocks 0
  // and 1, kept: 32.
  const MatchExplanation why = cache_->ExplainMatch(kTenant, prompt);
  EXPECT_EQ(why.resumable_tokens, 32);
  EXPECT_EQ(why.window_evicted_tokens, 16);
  EXPECT_THAT(why.ToString(), HasSubstr("the state group resumes only 32 of them"));
  const KvCacheStats before = cache_->stats();
  absl::StatusOr<AllocateResult> b = Alloc(kBob, 64, prompt);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->matched_tokens, 32);
  const KvCacheStats after = cache_->stats();
  EXPECT_EQ(after.missed_window_evicted - before.missed_window_evicted, 16u);
  EXPECT_EQ(after.missed_no_checkpoint - before.missed_no_checkpoint, 16u);
  EXPECT_EQ(plan_.state_copies.size(), 1u);  // from the checkpoint at 32
  EXPECT_EQ(plan_.window_fills.size(), 2u);  // blocks 2 and 3 are computed again
  ExpectInvariants();
}

// Events name each group's blocks (KvEvent::group, vLLM's group_idx): the window blocks and the
// checkpoints the tree keeps, by the hashes of the full blocks they sit beside, announced after
// their block and withdrawn before it; a Clear is one AllBlocksCleared for every group.
TEST_F(WindowGroupTest, EventsNameEachGroupsBlocks) {
  Make(/*window_blocks=*/6, /*window_tokens=*/32, /*sink_tokens=*/0, /*num_blocks=*/64,
       /*state_slots=*/5, /*checkpoint_slots=*/3, /*checkpoint_interval=*/2);
  const KvEventGroup main{.index = 0, .kind = KvGroupKind::kFullAttention};
  const KvEventGroup window{.index = 1, .kind = KvGroupKind::kSlidingWindow, .sliding_window = 32};
  const KvEventGroup state{.index = 2, .kind = KvGroupKind::kStateSpace};
  EventMirror mirror(/*grouped=*/true);
  const auto read = [&](uint64_t from) {
    std::vector<KvEvent> out;
    EXPECT_TRUE(cache_->events()->ReadFrom(from, 100, &out));
    return out;
  };
  const std::vector<int32_t> prompt = Prompt(72);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 72, prompt);
  ASSERT_TRUE(a.ok());
  std::vector<PlannedCheckpoint> planned;
  ASSERT_TRUE(
      cache_->PlanCheckpoints(kAlice, a->sequence, 0, 64, /*prefill=*/false, &planned).ok());
  ASSERT_TRUE(cache_->AdvanceState(kAlice, a->sequence, 72).ok());
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 72).ok());
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
  ASSERT_TRUE(mirror.Follow(*cache_->events()));
  std::vector<KvEvent> events = read(1);
  // The main blocks (4 full; the partial fifth, tokens 65..72, announces nothing), then the
  // checkpoints at 32 and 64 (block ends) and the window blocks beside them.
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].type, KvEventType::kBlockStored);
  EXPECT_EQ(events[0].group, main);
  ASSERT_EQ(events[0].block_hashes.size(), 4u);
  const std::vector<BlockHash> hashes = events[0].block_hashes;
  EXPECT_EQ(events[1].group, state);
  EXPECT_THAT(events[1].block_hashes, ElementsAre(hashes[1]));
  EXPECT_EQ(events[1].parent_hash, hashes[0]);
  EXPECT_EQ(events[2].group, state);
  EXPECT_THAT(events[2].block_hashes, ElementsAre(hashes[3]));
  EXPECT_EQ(events[3].group, window);
  EXPECT_EQ(events[3].block_hashes, hashes);  // every window entry still live at Commit
  EXPECT_EQ(events[3].token_ids, events[0].token_ids);
  EXPECT_EQ(events[3].parent_hash, std::nullopt);
  uint64_t resume = 0;
  EXPECT_TRUE(mirror.Matches(cache_->SnapshotEvents(&resume)));
  EXPECT_EQ(mirror.held(1), 4u);
  EXPECT_EQ(mirror.held(2), 2u);

  // Window pressure evicts the least recently kept window block alone: block 0's.
  absl::StatusOr<AllocateResult> c = Alloc(kBob, 48);
  ASSERT_TRUE(c.ok()) << c.status();
  events = read(resume);
  ASSERT_THAT(events, ::testing::SizeIs(::testing::Ge(1u)));
  EXPECT_EQ(events[0].type, KvEventType::kBlockRemoved);
  EXPECT_EQ(events[0].group, window);
  ASSERT_TRUE(mirror.Follow(*cache_->events()));
  EXPECT_TRUE(mirror.Matches(cache_->SnapshotEvents(&resume)));
  EXPECT_EQ(mirror.held(1), 4u - events[0].block_hashes.size());

  // The tree lets every block go: each one's components leave before it does.
  ASSERT_TRUE(cache_->Free(kBob, c->sequence).ok());
  EXPECT_EQ(cache_->EvictCached(64), 5);
  ASSERT_TRUE(mirror.Follow(*cache_->events()));
  EXPECT_TRUE(mirror.Matches(cache_->SnapshotEvents(&resume)));
  EXPECT_EQ(mirror.held(0) + mirror.held(1) + mirror.held(2), 0u);

  // A Clear: one AllBlocksCleared, nothing per group.
  a = Alloc(kAlice, 72, prompt);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
  const uint64_t before = cache_->events()->next_seq();
  ASSERT_TRUE(cache_->ClearCache().ok());
  events = read(before);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, KvEventType::kAllBlocksCleared);
  ASSERT_TRUE(mirror.Follow(*cache_->events()));
  EXPECT_TRUE(mirror.Matches(cache_->SnapshotEvents(&resume)));
  ExpectInvariants();
}

// A lower tier's event in a hybrid pool: a block's is the main group's, a window block's the
// window group's, numbered as the device's are; a checkpoint's is refused in a pool with no state
// group, and nothing is recorded.
TEST_F(WindowGroupTest, ATiersEventsAreTheirComponentsGroups) {
  Make(/*window_blocks=*/6, /*window_tokens=*/32);
  const auto tier_event = [&](std::optional<KvGroupKind> component) {
    KvEvent e{.type = KvEventType::kBlockStored,
              .ns = kTenant,
              .block_hashes = {BlockHash{.lo = 1, .hi = 2}},
              .medium = KvMedium::kHost};
    if (component) e.group = KvEventGroup{.kind = *component};
    return e;
  };
  ASSERT_TRUE(cache_->AppendTierEvent(tier_event(std::nullopt)).ok());
  ASSERT_TRUE(cache_->AppendTierEvent(tier_event(KvGroupKind::kSlidingWindow)).ok());
  EXPECT_EQ(cache_->AppendTierEvent(tier_event(KvGroupKind::kStateSpace)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<KvEvent> events;
  ASSERT_TRUE(cache_->events()->ReadFrom(1, 10, &events));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].group, (KvEventGroup{.index = 0, .kind = KvGroupKind::kFullAttention}));
  EXPECT_EQ(events[1].group,
            (KvEventGroup{.index = 1, .kind = KvGroupKind::kSlidingWindow, .sliding_window = 32}));
  EXPECT_EQ(events[1].medium, KvMedium::kHost);
}

// The lower tiers' events in a hybrid pool with a committed prompt on the device, as the tiers
// tell them (daemon/engine/tiers.cc: one block an event, its parent beside it): host h1 <- h2
// and h2's checkpoint, h3 stored then removed, h5 told before its parent h4 (as the disk's
// records found at start may be); disk h3 and its checkpoint, told first (each disk store
// writes on a thread of its own).
class TierSnapshotTest : public WindowGroupTest {
 protected:
  void SetUp() override {
    Make(/*window_blocks=*/6, /*window_tokens=*/32, /*sink_tokens=*/0, /*num_blocks=*/64,
         /*state_slots=*/5, /*checkpoint_slots=*/3, /*checkpoint_interval=*/2);
    const std::vector<int32_t> prompt = Prompt(72);
    absl::StatusOr<AllocateResult> a = Alloc(kAlice, 72, prompt);
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
    const KvEventType stored = KvEventType::kBlockStored, removed = KvEventType::kBlockRemoved;
    Tell(stored, KvMedium::kHost, h1, std::nullopt);
    Tell(stored, KvMedium::kHost, h2, h1);
    Tell(stored, KvMedium::kHost, h2, h1, KvGroupKind::kStateSpace);
    Tell(stored, KvMedium::kHost, h3, h2);
    Tell(stored, KvMedium::kDisk, h3, h2, KvGroupKind::kStateSpace);
    Tell(stored, KvMedium::kDisk, h3, h2);
    Tell(removed, KvMedium::kHost, h3, std::nullopt);
    Tell(stored, KvMedium::kHost, h5, h4);
    Tell(stored, KvMedium::kHost, h4, std::nullopt);
    ASSERT_TRUE(mirror_.Follow(*cache_->events()));
    EXPECT_EQ(mirror_.held(0, KvMedium::kHost), 4u);
    EXPECT_EQ(mirror_.held(2, KvMedium::kHost), 1u);
    EXPECT_EQ(mirror_.held(0, KvMedium::kDisk), 1u);
    EXPECT_EQ(mirror_.held(2, KvMedium::kDisk), 1u);
  }
  void Tell(KvEventType type, KvMedium medium, BlockHash hash, std::optional<BlockHash> parent,
            std::optional<KvGroupKind> component = std::nullopt) {
    KvEvent e{.type = type,
              .ns = kTenant,
              .block_hashes = {hash},
              .parent_hash = parent,
              .block_size = kBlockSize,
              .medium = medium};
    if (component) e.group = KvEventGroup{.kind = *component};
    ASSERT_TRUE(cache_->AppendTierEvent(std::move(e)).ok());
  }
  // The pool's snapshot, checked against the mirror, and its tiers' part, which must follow
  // every device event.
  std::vector<KvEvent> TiersPartOfTheSnapshot() {
    uint64_t resume = 0;
    const std::vector<KvEvent> snapshot = cache_->SnapshotEvents(&resume);
    EXPECT_EQ(resume, cache_->events()->next_seq());
    EXPECT_TRUE(mirror_.Matches(snapshot));
    std::vector<KvEvent> tiers;
    for (const KvEvent& e : snapshot) {
      if (e.medium != KvMedium::kDevice) {
        tiers.push_back(e);
      } else {
        EXPECT_THAT(tiers, IsEmpty()) << "a device block after the tiers'";
      }
    }
    return tiers;
  }

  const BlockHash h1{.lo = 1, .hi = 11}, h2{.lo = 2, .hi = 12}, h3{.lo = 3, .hi = 13},
      h4{.lo = 4, .hi = 14}, h5{.lo = 5, .hi = 15};
  EventMirror mirror_{/*grouped=*/true};
};

// The tiers' blocks are in the pool's snapshot as their events told them, by medium and group,
// each after its parent, a parent chain in one event: a consumer that rebuilds from a snapshot
// (its view cleared, as WatchEvents says) keeps them. Before, the snapshot held the device's.
TEST_F(TierSnapshotTest, TheTiersBlocksAreInTheSnapshotEachAfterItsParent) {
  const std::vector<KvEvent> tiers = TiersPartOfTheSnapshot();
  // Host main (h1 then h2, one chain; h4 then h5, whatever the order told), host state, disk
  // main, disk state.
  ASSERT_EQ(tiers.size(), 5u);
  EXPECT_EQ(tiers[0].medium, KvMedium::kHost);
  EXPECT_EQ(tiers[0].group, (KvEventGroup{.index = 0, .kind = KvGroupKind::kFullAttention}));
  EXPECT_THAT(tiers[0].block_hashes, ElementsAre(h1, h2));
  EXPECT_EQ(tiers[0].parent_hash, std::nullopt);
  EXPECT_EQ(tiers[0].ns, kTenant);
  EXPECT_EQ(tiers[0].block_size, kBlockSize);
  EXPECT_THAT(tiers[1].block_hashes, ElementsAre(h4, h5));
  EXPECT_EQ(tiers[1].parent_hash, std::nullopt);
  EXPECT_EQ(tiers[2].medium, KvMedium::kHost);
  EXPECT_EQ(tiers[2].group, (KvEventGroup{.index = 2, .kind = KvGroupKind::kStateSpace}));
  EXPECT_THAT(tiers[2].block_hashes, ElementsAre(h2));
  EXPECT_EQ(tiers[2].parent_hash, h1);
  EXPECT_EQ(tiers[3].medium, KvMedium::kDisk);
  EXPECT_THAT(tiers[3].block_hashes, ElementsAre(h3));
  EXPECT_EQ(tiers[3].parent_hash, h2);
  EXPECT_EQ(tiers[4].medium, KvMedium::kDisk);
  EXPECT_EQ(tiers[4].group->index, 2);
}

// A Clear's AllBlocksCleared clears every medium, and the tiers' blocks, which stay, are told
// again right after it, as the snapshot names them; the device's are gone.
TEST_F(TierSnapshotTest, AClearTellsTheTiersBlocksAgainAfterItsAllBlocksCleared) {
  const std::vector<KvEvent> tiers = TiersPartOfTheSnapshot();
  const uint64_t before = cache_->events()->next_seq();
  ASSERT_TRUE(cache_->ClearCache().ok());
  std::vector<KvEvent> events;
  ASSERT_TRUE(cache_->events()->ReadFrom(before, 100, &events));
  ASSERT_EQ(events.size(), 1 + tiers.size());
  EXPECT_EQ(events[0].type, KvEventType::kAllBlocksCleared);
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].type, KvEventType::kBlockStored);
    EXPECT_EQ(events[i].block_hashes, tiers[i - 1].block_hashes);
    EXPECT_EQ(events[i].medium, tiers[i - 1].medium);
    EXPECT_EQ(events[i].group, tiers[i - 1].group);
  }
  ASSERT_TRUE(mirror_.Follow(*cache_->events()));
  EXPECT_EQ(TiersPartOfTheSnapshot().size(), tiers.size());
  EXPECT_EQ(mirror_.held(0) + mirror_.held(1) + mirror_.held(2), 0u);
  EXPECT_EQ(mirror_.held(0, KvMedium::kHost), 4u);
  EXPECT_EQ(mirror_.held(2, KvMedium::kDisk), 1u);
  ExpectInvariants();
}

// A tier loader's window (ImportWindow): blocks only for the entries the window at its end reads,
// the sinks' included, none for the rest, and entries it adopted before that window released. The
// tree keeps what it committed, and the journal names each kept block beside a full one for the
// tiers (TakePublishedWindowBlocks).
TEST_F(WindowGroupTest, ImportWindowTakesBlocksForTheWindowAloneAndTheJournalNamesThem) {
  Make(/*window_blocks=*/8, /*window_tokens=*/32, /*sink_tokens=*/16, /*num_blocks=*/64,
       /*state_slots=*/0, /*checkpoint_slots=*/0, /*checkpoint_interval=*/4,
       /*publish_journal=*/true);
  KvCacheManager& cache = *cache_;
  const std::vector<int32_t> prompt = Prompt(224);
  DevicePlan plan;
  const auto loader = cache.Allocate(
      kAlice,
      {.ns = kTenant, .num_tokens = 160, .prompt = std::span(prompt).first(160), .window_ahead = 0},
      &plan);
  ASSERT_TRUE(loader.ok()) << loader.status();
  EXPECT_THAT(cache.Find(loader->sequence)->window_table, IsEmpty());
  // At 160 tokens the window reads [129, 160) and the sink: entries 0, 8 and 9.
  const auto imported = cache.ImportWindow(kAlice, loader->sequence);
  ASSERT_TRUE(imported.ok()) << imported.status();
  const std::vector<BlockId>& table = cache.Find(loader->sequence)->window_table;
  ASSERT_EQ(table.size(), 10u);
  ASSERT_EQ(imported->size(), 3u);
  EXPECT_EQ((*imported)[0], std::pair(int64_t{0}, table[0]));
  EXPECT_EQ((*imported)[1], std::pair(int64_t{8}, table[8]));
  EXPECT_EQ((*imported)[2], std::pair(int64_t{9}, table[9]));
  EXPECT_EQ(std::count(table.begin(), table.end(), kInvalidBlock), 7);
  EXPECT_THAT(*cache.ImportWindow(kAlice, loader->sequence), IsEmpty());  // nothing lacks
  EXPECT_TRUE(cache.CheckInvariants().ok());

  ASSERT_TRUE(cache.Commit(kAlice, loader->sequence, 160).ok());
  std::vector<PublishedBlock> blocks;
  cache.TakePublished(&blocks);
  ASSERT_EQ(blocks.size(), 10u);
  std::vector<PublishedWindowBlock> windows;
  cache.TakePublishedWindowBlocks(&windows);
  ASSERT_EQ(windows.size(), 3u);
  for (size_t i = 0; i < windows.size(); ++i) {
    const size_t entry = static_cast<size_t>((*imported)[i].first);
    EXPECT_EQ(windows[i].block.hash, blocks[entry].hash);
    EXPECT_EQ(windows[i].window, (*imported)[i].second);
  }
  cache.TakePublishedWindowBlocks(&windows);
  EXPECT_THAT(windows, IsEmpty());  // taken once
  ASSERT_TRUE(cache.Free(kAlice, loader->sequence).ok());

  // A longer prompt resumes at 160 with entries 0, 8 and 9; its window at 224 reads 12 and 13:
  // 8 and 9 go back to the tree, 10 and 11 get none.
  const auto longer = cache.Allocate(
      kBob, {.ns = kTenant, .num_tokens = 224, .prompt = prompt, .window_ahead = 0}, &plan);
  ASSERT_TRUE(longer.ok()) << longer.status();
  ASSERT_EQ(longer->matched_tokens, 160);
  const auto more = cache.ImportWindow(kBob, longer->sequence);
  ASSERT_TRUE(more.ok()) << more.status();
  ASSERT_EQ(more->size(), 2u);
  EXPECT_EQ((*more)[0].first, 12);
  EXPECT_EQ((*more)[1].first, 13);
  const std::vector<BlockId>& grown = cache.Find(longer->sequence)->window_table;
  ASSERT_EQ(grown.size(), 14u);
  EXPECT_EQ(std::count(grown.begin(), grown.end(), kInvalidBlock), 11);
  EXPECT_TRUE(cache.CheckInvariants().ok());
}

TEST_F(WindowGroupTest, ImportWindowIsRefusedWholeWhenTheWindowGroupIsShort) {
  Make(/*window_blocks=*/4, /*window_tokens=*/32);
  KvCacheManager& cache = *cache_;
  DevicePlan plan;
  // Bob holds 2 of the 4 window blocks; the window at 161 tokens reads [130, 161): entries 8, 9
  // and the partial 10.
  const auto bob = cache.Allocate(kBob, {.ns = kTenant, .num_tokens = 32}, &plan);
  ASSERT_TRUE(bob.ok()) << bob.status();
  const std::vector<int32_t> prompt = Prompt(161, 5);
  const auto loader = cache.Allocate(
      kAlice, {.ns = kTenant, .num_tokens = 161, .prompt = prompt, .window_ahead = 0}, &plan);
  ASSERT_TRUE(loader.ok()) << loader.status();
  const absl::StatusOr<std::vector<std::pair<int64_t, BlockId>>> refused =
      cache.ImportWindow(kAlice, loader->sequence);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(cache.Find(loader->sequence)->window_table, IsEmpty());  // nothing changed
  EXPECT_EQ(cache.ImportWindow(kBob, loader->sequence).status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(cache.Free(kBob, bob->sequence).ok());
  const auto imported = cache.ImportWindow(kAlice, loader->sequence);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->size(), 3u);  // entries 8, 9 and 10
  EXPECT_TRUE(cache.CheckInvariants().ok());
}

// A long prefill in chunks takes its window blocks chunk by chunk (AllocateRequest::window_ahead,
// ExtendWindow), so that a prompt whose whole length the window group could never hold at once
// goes through it within about a chunk plus a window of blocks.
class WindowAheadTest : public WindowGroupTest {
 protected:
  // A 20-token window of 16-token blocks (a bound of 3) in a window group of 8 blocks.
  void SetUp() override { Make(/*window_blocks=*/8, /*window_tokens=*/20); }
};

TEST_F(WindowAheadTest, AChunkedPrefillTakesItsWindowChunkByChunk) {
  // 30 blocks of prompt: more than the window group's 8 all at once...
  EXPECT_TRUE(absl::IsResourceExhausted(Alloc(kAlice, 480).status()));
  ExpectInvariants();
  // ...but in chunks of 64 tokens: the first chunk's 4 blocks now, the rest as it goes.
  plan_ = DevicePlan{};
  auto r = cache_->Allocate(kAlice, {.ns = kTenant, .num_tokens = 480, .window_ahead = 64}, &plan_);
  ASSERT_TRUE(r.ok()) << r.status();
  const SequenceId id = r->sequence;
  EXPECT_EQ(Seq(id).table.size(), 30u);
  EXPECT_EQ(Seq(id).window_table.size(), 4u);
  EXPECT_EQ(plan_.window_fills.size(), 4u);
  ExpectInvariants();
  for (int64_t done = 64; done < 480; done += 64) {
    ASSERT_TRUE(cache_->SlideWindow(kAlice, id, done).ok());
    DevicePlan plan;
    const int64_t end = std::min<int64_t>(done + 64, 480);
    ASSERT_TRUE(cache_->ExtendWindow(kAlice, id, end, &plan).ok()) << "at " << done;
    EXPECT_EQ(Seq(id).window_table.size(), static_cast<size_t>(CeilDiv(end, kBlockSize)));
    EXPECT_LE(Live(Seq(id)), 6) << "at " << done;  // the window's 2 blocks and the chunk's 4
    ExpectInvariants();
  }
  ASSERT_TRUE(cache_->SlideWindow(kAlice, id, 480).ok());
  EXPECT_LE(Live(Seq(id)), cache_->WindowBound());
  ExpectInvariants();
}

TEST_F(WindowAheadTest, ExtendWindowIsRefusedWholeAndChecksItsArguments) {
  auto r = cache_->Allocate(kAlice, {.ns = kTenant, .num_tokens = 480, .window_ahead = 16}, &plan_);
  ASSERT_TRUE(r.ok()) << r.status();
  DevicePlan plan;
  // Nine blocks at once: more than the group has.
  const absl::Status refused = cache_->ExtendWindow(kAlice, r->sequence, 9 * kBlockSize, &plan);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_EQ(Seq(r->sequence).window_table.size(), 1u);
  EXPECT_TRUE(plan.window_fills.empty());
  EXPECT_EQ(cache_->ExtendWindow(kAlice, r->sequence, 481, &plan).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->ExtendWindow(kBob, r->sequence, 32, &plan).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->ExtendWindow(kAlice, SequenceId(999), 32, &plan).code(),
            absl::StatusCode::kNotFound);
  // Already there: nothing to do.
  EXPECT_TRUE(cache_->ExtendWindow(kAlice, r->sequence, 10, &plan).ok());
  EXPECT_TRUE(plan.window_fills.empty());
  ExpectInvariants();
}

// A fork shares its parent's full tree blocks; truncated into one, it commits only part of that
// block, and its own window block there holds only those tokens. The tree must not keep it
// beside the whole block: a prompt resuming the whole block would read the rest unwritten.
// (Found by window_group_random_test at 40,000 operations, seed 5.)
TEST_F(WindowAheadTest, AForkCommittingPartOfASharedBlockLeavesItsWindowBlockOut) {
  const std::vector<int32_t> prompt = Prompt(48);
  plan_ = DevicePlan{};
  auto a = cache_->Allocate(
      kAlice, {.ns = kTenant, .num_tokens = 48, .prompt = prompt, .window_ahead = 16}, &plan_);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 48).ok());  // 3 full blocks, 1 window entry
  EXPECT_EQ(cache_->stats().windows.kept, 1u);
  DevicePlan plan;
  absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, a->sequence, &plan);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_TRUE(cache_->Truncate(kAlice, *child, 40).ok());
  ASSERT_TRUE(cache_->ExtendWindow(kAlice, *child, 40, &plan).ok());
  ASSERT_EQ(Seq(*child).table[2], Seq(a->sequence).table[2]);  // the parent's, shared
  // The child computes tokens 16..39 into its new window blocks, then commits 40 tokens.
  ASSERT_TRUE(cache_->Commit(kAlice, *child, 40).ok());
  EXPECT_EQ(cache_->stats().windows.kept, 2u);  // block 1's, not block 2's
  // A window of 20 tokens at 48 needs blocks 1 and 2; block 2 has none: 32 resume.
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 32);
  ExpectInvariants();
}

TEST_F(WindowAheadTest, AGrowAheadIsRevertedToItsWindowEntriesAndAForkCopiesNoMissingBlock) {
  // 40 tokens, window blocks for the first 8 only.
  auto r = cache_->Allocate(kAlice, {.ns = kTenant, .num_tokens = 40, .window_ahead = 8}, &plan_);
  ASSERT_TRUE(r.ok()) << r.status();
  const SequenceId id = r->sequence;
  EXPECT_EQ(Seq(id).window_table.size(), 1u);
  // Grown to 200 tokens, window blocks up to 40 + 24: the 3 missing below the old length and 1.
  DevicePlan plan;
  std::vector<TableChange> changes;
  const GrowRequest grow{id, 200, /*window_ahead=*/24};
  ASSERT_TRUE(cache_->GrowBatch(kAlice, std::span(&grow, 1), &plan, &changes).ok());
  EXPECT_EQ(Seq(id).table.size(), 13u);
  EXPECT_EQ(Seq(id).window_table.size(), 4u);
  EXPECT_EQ(plan.window_fills.size(), 3u);
  ExpectInvariants();
  // A fork ends inside block 12, whose window entry is not allocated: nothing to copy there.
  DevicePlan fork_plan;
  auto child = cache_->Fork(kAlice, id, &fork_plan);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_TRUE(fork_plan.window_copies.empty());
  EXPECT_EQ(Seq(*child).window_table, Seq(id).window_table);
  ExpectInvariants();
  ASSERT_TRUE(cache_->Free(kAlice, *child).ok());
  // Reverting the grow gives back every window entry it added, below the old length too.
  cache_->RevertGrow(kAlice, changes);
  EXPECT_EQ(Seq(id).num_tokens, 40);
  EXPECT_EQ(Seq(id).table.size(), 3u);
  EXPECT_EQ(Seq(id).window_table.size(), 1u);
  EXPECT_EQ(cache_->window()->stats().active, 1);
  ExpectInvariants();
}

}  // namespace
}  // namespace kvpool
