// State checkpoints in the prefix tree (docs/hybrid-groups.md §4): a prompt of a model with
// state-space layers resumes from the deepest checkpoint its attention match reaches; checkpoints
// are planned for steps, kept once the state has passed them, taken at the end of committed
// sequences, give way to working states, leave with their blocks, and are fenced like blocks.

#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kTenant(100);
constexpr int32_t kBlock = 16;

using testing::ManualFences;

std::vector<int32_t> Prompt(int32_t n, int32_t salt = 0) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = 7 * i + 3 + salt * 1000;
  return out;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class StateCheckpointTest : public ::testing::Test {
 protected:
  void Make(int32_t state_slots, int32_t checkpoint_slots, int32_t interval = 4,
            int32_t num_blocks = 64,
            KvCacheOptions::CheckpointEviction eviction =
                KvCacheOptions::CheckpointEviction::kByTokensSaved) {
    auto cache = KvCacheManager::Create({.block_size = kBlock,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 32,
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .state_slots = state_slots,
                                         .checkpoint_slots = checkpoint_slots,
                                         .checkpoint_interval = interval,
                                         .checkpoint_eviction = eviction,
                                         .evict_unresumable_first = unresumable_first_});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  // What the step planner does for a prefill of `prompt` (new sequence): allocate, plan the
  // step's checkpoints, "run" it (the state advances), record the tokens and commit full blocks.
  SequenceId Prefill(SessionId session, const std::vector<int32_t>& prompt,
                     std::vector<PlannedCheckpoint>* planned = nullptr) {
    plan_ = DevicePlan{};
    absl::StatusOr<AllocateResult> a = cache_->Allocate(
        session, {.ns = kTenant, .num_tokens = static_cast<int64_t>(prompt.size()), .prompt = {}},
        &plan_);
    KVPOOL_CHECK_OK(a.status());
    Compute(session, a->sequence, prompt, 0, planned);
    return a->sequence;
  }

  // The step of `seq` from `start` to prompt.size(), with its checkpoints and commit.
  void Compute(SessionId session, SequenceId seq, const std::vector<int32_t>& prompt, int64_t start,
               std::vector<PlannedCheckpoint>* planned = nullptr) {
    const auto end = static_cast<int64_t>(prompt.size());
    std::vector<PlannedCheckpoint> out;
    KVPOOL_CHECK_OK(cache_->PlanCheckpoints(session, seq, start, end, /*prefill=*/true, &out));
    if (planned != nullptr) *planned = out;
    KVPOOL_CHECK_OK(cache_->AdvanceState(session, seq, end));
    const std::span<const int32_t> fresh =
        std::span(prompt).subspan(std::min(cache_->Find(seq)->tokens.size(), prompt.size()));
    KVPOOL_CHECK_OK(cache_->Commit(session, seq, end / kBlock * kBlock, fresh));
  }

  absl::StatusOr<AllocateResult> Resume(SessionId session, const std::vector<int32_t>& prompt) {
    plan_ = DevicePlan{};
    return cache_->Allocate(
        session,
        {.ns = kTenant, .num_tokens = static_cast<int64_t>(prompt.size()) + 1, .prompt = prompt},
        &plan_);
  }

  BlockId Slot(SequenceId id) { return cache_->Find(id)->state_slot; }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    EXPECT_TRUE(status.ok()) << status;
  }

  // A prefill of `prompt` whose checkpoints are planned for its first `checkpointed` tokens only
  // (a step to there, then one to the end), committed and freed without its end: the blocks past
  // `checkpointed` hold no checkpoint.
  void PublishCheckpointedUpTo(SessionId session, const std::vector<int32_t>& prompt,
                               int64_t checkpointed) {
    plan_ = DevicePlan{};
    absl::StatusOr<AllocateResult> a = cache_->Allocate(
        session, {.ns = kTenant, .num_tokens = static_cast<int64_t>(prompt.size()), .prompt = {}},
        &plan_);
    KVPOOL_CHECK_OK(a.status());
    if (checkpointed > 0) {
      Compute(session, a->sequence, std::vector(prompt.begin(), prompt.begin() + checkpointed), 0);
    }
    const auto end = static_cast<int64_t>(prompt.size());
    KVPOOL_CHECK_OK(cache_->AdvanceState(session, a->sequence, end));
    KVPOOL_CHECK_OK(cache_->Commit(session, a->sequence, end / kBlock * kBlock,
                                   std::span(prompt).subspan(static_cast<size_t>(checkpointed))));
    KVPOOL_CHECK_OK(cache_->Free(session, a->sequence));
  }

  ManualClock clock_;
  ManualFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
  DevicePlan plan_;
  bool unresumable_first_ = true;
};

// A checkpoint every this many blocks costs as many bytes as the blocks' K/V between two.
TEST(BreakEvenCheckpointIntervalTest, IsTheStateOverTheBlockRoundedUp) {
  EXPECT_EQ(BreakEvenCheckpointInterval(100, 10), 10);
  EXPECT_EQ(BreakEvenCheckpointInterval(101, 10), 11);
  EXPECT_EQ(BreakEvenCheckpointInterval(5, 10), 1);  // a state smaller than a block: every one
  // tiny-hybrid in bf16: 3 states of 539,648 B over blocks of 16 tokens x 1,024 B.
  EXPECT_EQ(BreakEvenCheckpointInterval(3 * 539'648, 16 * 1024), 99);
  EXPECT_EQ(BreakEvenCheckpointInterval(int64_t{1} << 62, 1), INT32_MAX);
  EXPECT_EQ(BreakEvenCheckpointInterval(0, 10), 0);  // no state group
  EXPECT_EQ(BreakEvenCheckpointInterval(10, 0), 0);
}

TEST(DefaultCheckpointIntervalTest, IsThriceTheBreakEvenSaturating) {
  EXPECT_EQ(DefaultCheckpointInterval(101, 10), 33);
  EXPECT_EQ(DefaultCheckpointInterval(5, 10), 3);
  EXPECT_EQ(DefaultCheckpointInterval(3 * 539'648, 16 * 1024), 297);  // tiny-hybrid in bf16
  EXPECT_EQ(DefaultCheckpointInterval(int64_t{1} << 62, 1), INT32_MAX);
  EXPECT_EQ(DefaultCheckpointInterval(0, 10), 0);
}

TEST_F(StateCheckpointTest, ACommittedSequencesStateIsTheCheckpointAtItsEnd) {
  Make(/*state_slots=*/8, /*checkpoint_slots=*/4);
  const std::vector<int32_t> turn1 = Prompt(40);
  const SequenceId a = Prefill(kAlice, turn1);
  const BlockId working = Slot(a);
  ASSERT_TRUE(cache_->Free(kAlice, a, OnFree::kCommit).ok());
  // No copy: the working slot itself is now the checkpoint after token 40.
  EXPECT_EQ(cache_->states()->state(working), BlockState::kCached);
  EXPECT_EQ(cache_->stats().checkpoints.cached, 2);  // 32 (prefill's last boundary) and 40
  ExpectInvariants();

  // The next turn resumes after the 40 tokens: its state is a copy of the checkpoint.
  absl::StatusOr<AllocateResult> b = Resume(kBob, Concat(turn1, Prompt(20, 1)));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->matched_tokens, 40);
  EXPECT_THAT(plan_.state_copies, ElementsAre(BlockCopy{working, Slot(b->sequence)}));
  EXPECT_THAT(plan_.state_zeros, IsEmpty());
  EXPECT_EQ(cache_->Find(b->sequence)->state_tokens, 40);
  EXPECT_EQ(cache_->Find(b->sequence)->resumed_from, working);
  // Held while the sequence lives, so no pressure can evict it under the copy.
  EXPECT_EQ(cache_->states()->state(working), BlockState::kActive);
  EXPECT_EQ(cache_->stats().checkpoints.resumed, 1u);
  ExpectInvariants();
  ASSERT_TRUE(cache_->Free(kBob, b->sequence).ok());
  EXPECT_EQ(cache_->states()->state(working), BlockState::kCached);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, AMatchStopsWhereACheckpointIsMissingAndResumesFromTheOneBefore) {
  Make(8, 4, /*interval=*/2);
  const std::vector<int32_t> doc = Prompt(100);
  std::vector<PlannedCheckpoint> planned;
  const SequenceId a = Prefill(kAlice, doc, &planned);
  // Every 2 blocks (32, 64, 96) and the prefill's last block boundary (96).
  ASSERT_EQ(planned.size(), 3u);
  EXPECT_EQ(planned[0].position, 32);
  EXPECT_EQ(planned[1].position, 64);
  EXPECT_EQ(planned[2].position, 96);
  EXPECT_EQ(cache_->stats().checkpoints.cached, 3);  // kept by the commit of 96 tokens
  ASSERT_TRUE(cache_->Free(kAlice, a).ok());
  ExpectInvariants();

  // 90 tokens cached for attention; the deepest checkpoint at or below is at 64.
  std::vector<int32_t> other = doc;
  other.resize(90);
  other = Concat(other, Prompt(30, 2));
  absl::StatusOr<AllocateResult> b = Resume(kBob, other);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->matched_tokens, 64);
  EXPECT_THAT(plan_.state_copies, ElementsAre(BlockCopy{planned[1].slot, Slot(b->sequence)}));
  EXPECT_EQ(cache_->stats().missed_no_checkpoint, 90u - 64u);
  // It holds exactly the blocks of the 64 tokens it resumes from, and computes the rest.
  EXPECT_EQ(cache_->Find(b->sequence)->path.full.size(), 4u);
  ExpectInvariants();
  // Routers and operators see the same: 64 resumable, 90 cached for full attention.
  EXPECT_EQ(cache_->MatchPrefix(kTenant, other), 64);
  const MatchExplanation why = cache_->ExplainMatch(kTenant, other);
  EXPECT_EQ(why.matched_tokens, 90);
  EXPECT_EQ(why.resumable_tokens, 64);
  EXPECT_THAT(why.ToString(), HasSubstr("the state group resumes only 64 of them"));

  // The whole document: resumes from 96.
  absl::StatusOr<AllocateResult> c = Resume(kAlice, doc);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->matched_tokens, 96);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, APlannedCheckpointIsKeptOnlyOnceTheStateHasPassedIt) {
  Make(8, 4);
  const std::vector<int32_t> prompt = Prompt(70);
  plan_ = DevicePlan{};
  absl::StatusOr<AllocateResult> a =
      cache_->Allocate(kAlice, {.ns = kTenant, .num_tokens = 70}, &plan_);
  ASSERT_TRUE(a.ok());
  std::vector<PlannedCheckpoint> planned;
  ASSERT_TRUE(cache_->PlanCheckpoints(kAlice, a->sequence, 0, 70, true, &planned).ok());
  ASSERT_EQ(planned.size(), 1u);  // 64: the interval and the last boundary
  // A client commits the tokens before the step ran: the checkpoint holds nothing yet.
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 64, std::span(prompt).first(64)).ok());
  EXPECT_EQ(cache_->stats().checkpoints.cached, 0);
  EXPECT_EQ(cache_->stats().checkpoints.pending, 1);
  ExpectInvariants();
  ASSERT_TRUE(cache_->AdvanceState(kAlice, a->sequence, 70).ok());
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 64).ok());
  EXPECT_EQ(cache_->stats().checkpoints.cached, 1);
  EXPECT_EQ(cache_->stats().checkpoints.pending, 0);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, ARewindDropsThePlannedCheckpointsPastIt) {
  Make(8, 4);
  plan_ = DevicePlan{};
  absl::StatusOr<AllocateResult> a =
      cache_->Allocate(kAlice, {.ns = kTenant, .num_tokens = 70}, &plan_);
  ASSERT_TRUE(a.ok());
  std::vector<PlannedCheckpoint> planned;
  ASSERT_TRUE(cache_->PlanCheckpoints(kAlice, a->sequence, 0, 70, true, &planned).ok());
  ASSERT_EQ(planned.size(), 1u);
  // The step failed (UndoItem): the sequence goes back to where it started.
  ASSERT_TRUE(cache_->Truncate(kAlice, a->sequence, 0).ok());
  EXPECT_EQ(cache_->stats().checkpoints.pending, 0);
  EXPECT_EQ(cache_->states()->state(planned[0].slot), BlockState::kFree);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, NothingIsPlannedFromAStateThatDoesNotHoldTheStepsStart) {
  Make(8, 4);
  plan_ = DevicePlan{};
  absl::StatusOr<AllocateResult> a =
      cache_->Allocate(kAlice, {.ns = kTenant, .num_tokens = 200}, &plan_);
  ASSERT_TRUE(a.ok());
  std::vector<PlannedCheckpoint> planned;
  // Its state holds 0 tokens; a step said to start at 64 cannot give the state after 128.
  ASSERT_TRUE(cache_->PlanCheckpoints(kAlice, a->sequence, 64, 200, true, &planned).ok());
  EXPECT_THAT(planned, IsEmpty());
  EXPECT_EQ(cache_->PlanCheckpoints(kAlice, a->sequence, 10, 10, true, &planned).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->PlanCheckpoints(kAlice, a->sequence, 0, 201, true, &planned).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->PlanCheckpoints(kBob, a->sequence, 0, 10, true, &planned).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->AdvanceState(kAlice, a->sequence, 201).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, ABranchPointGetsACheckpointOnTheLastSharedBlock) {
  Make(8, 4, /*interval=*/0);
  const std::vector<int32_t> system = Prompt(40);
  const SequenceId a = Prefill(kAlice, Concat(system, Prompt(30, 1)));
  ASSERT_TRUE(cache_->Free(kAlice, a).ok());  // checkpoint only at 64 (last boundary)
  ASSERT_EQ(cache_->stats().checkpoints.cached, 1);

  // Shares 40 tokens (two whole blocks): nothing to resume from, a checkpoint wanted at 32.
  const std::vector<int32_t> second = Concat(system, Prompt(30, 2));
  absl::StatusOr<AllocateResult> b =
      Resume(kBob, std::vector<int32_t>(second.begin(), second.begin() + 69));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->matched_tokens, 0);
  EXPECT_EQ(cache_->Find(b->sequence)->branch_at, 32);
  std::vector<PlannedCheckpoint> planned;
  Compute(kBob, b->sequence, second, 0, &planned);
  ASSERT_EQ(planned.size(), 2u);
  EXPECT_EQ(planned[0].position, 32);
  EXPECT_EQ(planned[1].position, 64);
  ASSERT_TRUE(cache_->Free(kBob, b->sequence).ok());

  // A third prompt through the same system prompt resumes at the branch point.
  absl::StatusOr<AllocateResult> c = Resume(kAlice, Concat(system, Prompt(30, 3)));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->matched_tokens, 32);
  EXPECT_THAT(plan_.state_copies, ElementsAre(BlockCopy{planned[0].slot, Slot(c->sequence)}));
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, AnEvictedBlockTakesItsCheckpointWithItFenced) {
  Make(8, 4);
  const SequenceId a = Prefill(kAlice, Prompt(70));
  const BlockId checkpoint = Slot(a);
  ASSERT_TRUE(cache_->MarkStatesInFlight(std::span(&checkpoint, 1), Fence{0, 5}).ok());
  ASSERT_TRUE(cache_->Free(kAlice, a, OnFree::kCommit).ok());
  EXPECT_EQ(cache_->stats().checkpoints.cached, 2);  // 64 and the end, 70
  EXPECT_EQ(cache_->EvictCached(64), 5);
  EXPECT_EQ(cache_->stats().checkpoints.cached, 0);
  EXPECT_EQ(cache_->stats().checkpoints.evicted, 2u);
  // The step that wrote the end checkpoint is still in flight: its slot is not free yet.
  EXPECT_EQ(cache_->states()->state(checkpoint), BlockState::kRetiring);
  ExpectInvariants();
  fences_.Complete(0, 5);
  cache_->ReclaimRetired();
  EXPECT_EQ(cache_->states()->state(checkpoint), BlockState::kFree);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, WorkingStatesEvictCachedCheckpointsNeverTheOtherWayRound) {
  Make(/*state_slots=*/5, /*checkpoint_slots=*/2, /*interval=*/0);
  for (int32_t k = 0; k < 2; ++k) {
    const SequenceId s = Prefill(kAlice, Prompt(20, k));
    ASSERT_TRUE(cache_->Free(kAlice, s, OnFree::kCommit).ok());
  }
  // Each left two (16 and its end, 20); the second's pushed the first's out.
  ASSERT_EQ(cache_->stats().checkpoints.cached, 2);
  const uint64_t evicted = cache_->stats().checkpoints.evicted;
  for (int32_t k = 0; k < 3; ++k) {
    ASSERT_TRUE(Resume(kBob, Prompt(5, 10 + k)).ok());
  }
  EXPECT_EQ(cache_->stats().checkpoints.cached, 2);  // three free slots were enough
  // No free slot left: the checkpoint it does not resume from makes way.
  absl::StatusOr<AllocateResult> held = Resume(kBob, Prompt(20, 1));
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->matched_tokens, 20);
  EXPECT_EQ(cache_->stats().checkpoints.evicted, evicted + 1);
  EXPECT_EQ(cache_->stats().checkpoints.cached, 1);
  ExpectInvariants();
  // The last checkpoint is held by the sequence resumed from it: nothing more to give.
  const std::string before = cache_->DebugString();
  absl::StatusOr<AllocateResult> refused = Resume(kBob, Prompt(5, 20));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(refused.status())->resource, Resource::kStateSlots);
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();
}

// No prompt resumes past a path's last checkpoint, so the K/V there goes first: Bob's four
// blocks without one, released last, go before Alice's older prefix that resumes. Least
// recently used, as before (evict_unresumable_first false), Alice's went.
class UnresumableFirstTest : public StateCheckpointTest,
                             public ::testing::WithParamInterface<bool> {};

TEST_P(UnresumableFirstTest, BlocksNoPromptCanResumeAtGoBeforeOlderOnesItCan) {
  unresumable_first_ = GetParam();
  Make(/*state_slots=*/8, /*checkpoint_slots=*/4, /*interval=*/0, /*num_blocks=*/12);
  const std::vector<int32_t> doc = Prompt(64);
  ASSERT_TRUE(cache_->Free(kAlice, Prefill(kAlice, doc), OnFree::kCommit).ok());
  const std::vector<int32_t> theirs = Prompt(64, 1);
  PublishCheckpointedUpTo(kBob, theirs, 0);
  EXPECT_EQ(cache_->ExplainMatch(kTenant, theirs).matched_tokens, 64);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, theirs), 0);
  ExpectInvariants();

  // Eight blocks for a new prompt, four of them evicted.
  ASSERT_TRUE(Resume(kAlice, Prompt(127, 2)).ok());
  ExpectInvariants();
  if (GetParam()) {
    EXPECT_EQ(cache_->MatchPrefix(kTenant, doc), 64);
    EXPECT_EQ(cache_->ExplainMatch(kTenant, theirs).matched_tokens, 0);
    EXPECT_EQ(cache_->stats().cache.unresumable_evicted, 4u);
  } else {
    EXPECT_EQ(cache_->MatchPrefix(kTenant, doc), 0);
    EXPECT_EQ(cache_->ExplainMatch(kTenant, theirs).matched_tokens, 64);
    EXPECT_EQ(cache_->stats().cache.unresumable_evicted, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Both, UnresumableFirstTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "UnresumableFirst" : "LeastRecentlyUsed";
                         });

// A path loses its blocks from its leaf up to its last checkpoint, in one plan (a freed parent
// without a checkpoint is taken next), and keeps the rest: Bob still resumes at 32, and Alice's
// older leaf, which holds a checkpoint, stays. An evicted checkpoint turns the blocks down to the
// one before into first-out blocks too.
TEST_F(StateCheckpointTest, APathLosesItsBlocksPastItsLastCheckpointFirst) {
  Make(/*state_slots=*/8, /*checkpoint_slots=*/6, /*interval=*/2, /*num_blocks=*/16);
  const std::vector<int32_t> doc = Prompt(64);
  const SequenceId a = Prefill(kAlice, doc);  // checkpoints at 32, 48 and 64
  ASSERT_TRUE(cache_->Free(kAlice, a, OnFree::kCommit).ok());
  const std::vector<int32_t> theirs = Prompt(64, 1);
  PublishCheckpointedUpTo(kBob, theirs, 32);  // at 16 and 32; none in 32..64
  EXPECT_EQ(cache_->MatchPrefix(kTenant, theirs), 32);
  ExpectInvariants();

  EXPECT_EQ(cache_->EvictCached(2), 2);
  EXPECT_EQ(cache_->stats().cache.unresumable_evicted, 2u);
  EXPECT_EQ(cache_->ExplainMatch(kTenant, theirs).matched_tokens, 32);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, theirs), 32);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, doc), 64);
  ExpectInvariants();

  // Now the least recently used leaf: Alice's, with its checkpoint at 64; the block holding the
  // one at 48 is a leaf with a checkpoint and stays for the policy.
  EXPECT_EQ(cache_->EvictCached(1), 1);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, doc), 48);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, theirs), 32);
  ExpectInvariants();
}

// A decode keeps one rolling checkpoint, in one slot, rewritten at each block boundary it
// reaches (32, then 48), and kept in the tree when the sequence ends with commit.
TEST_F(StateCheckpointTest, ADecodesRollingCheckpointMovesOnInItsOwnSlot) {
  Make(/*state_slots=*/12, /*checkpoint_slots=*/8, /*interval=*/0);
  const std::vector<int32_t> all = Prompt(50);
  const SequenceId s = Prefill(kAlice, std::vector<int32_t>(all.begin(), all.begin() + 20));
  DevicePlan plan;
  ASSERT_TRUE(cache_->Grow(kAlice, s, 50, &plan).ok());
  BlockId rolling = kInvalidBlock;
  for (int64_t t = 20; t < 50; ++t) {
    std::vector<PlannedCheckpoint> out;
    ASSERT_TRUE(cache_->PlanCheckpoints(kAlice, s, t, t + 1, /*prefill=*/false, &out).ok());
    if ((t + 1) % kBlock == 0) {
      ASSERT_EQ(out.size(), 1u) << t;
      EXPECT_TRUE(out[0].rolling);
      EXPECT_EQ(out[0].position, t + 1);
      if (rolling == kInvalidBlock) rolling = out[0].slot;
      EXPECT_EQ(out[0].slot, rolling);
    } else {
      EXPECT_THAT(out, IsEmpty()) << t;
    }
    ASSERT_TRUE(cache_->AdvanceState(kAlice, s, t + 1).ok());
    ASSERT_TRUE(
        cache_->Commit(kAlice, s, (t + 1) / kBlock * kBlock, std::span(all).subspan(t, 1)).ok());
  }
  EXPECT_EQ(cache_->stats().checkpoints.rolled, 1u);  // 32, then 48
  ASSERT_TRUE(cache_->Free(kAlice, s, OnFree::kCommit).ok());
  const std::vector<int32_t> head(all.begin(), all.begin() + 48);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, Concat(head, Prompt(3, 9))), 48);
  ExpectInvariants();
}

class CheckpointEvictionTest : public StateCheckpointTest,
                               public ::testing::WithParamInterface<bool> {
 protected:
  static constexpr KvCacheOptions::CheckpointEviction kLru =
      KvCacheOptions::CheckpointEviction::kLeastRecentlyUsed;
  bool lru() const { return GetParam(); }
  void MakeOrder(int32_t checkpoint_slots) {
    Make(/*state_slots=*/checkpoint_slots + 4, checkpoint_slots, /*interval=*/0, 64,
         lru() ? kLru : KvCacheOptions::CheckpointEviction::kByTokensSaved);
  }
  void Keep(const std::vector<int32_t>& prompt) {
    ASSERT_TRUE(cache_->Free(kAlice, Prefill(kAlice, prompt), OnFree::kCommit).ok());
  }
  // Resumes from the checkpoint at the end of `prompt` (a use) and lets the sequence go.
  void Use(const std::vector<int32_t>& prompt) {
    absl::StatusOr<AllocateResult> r = Resume(kBob, Concat(prompt, Prompt(3, 77)));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->matched_tokens, static_cast<int64_t>(prompt.size()));
    ASSERT_TRUE(cache_->Free(kBob, r->sequence, OnFree::kDiscard).ok());
  }
  // Whether a prompt can resume after all of `prompt` (its end checkpoint is cached).
  bool Resumable(const std::vector<int32_t>& prompt) {
    return cache_->MatchPrefix(kTenant, Concat(prompt, Prompt(3, 77))) ==
           static_cast<int64_t>(prompt.size());
  }
};

// A checkpoint is worth the tokens a prompt resuming from it does not compute that it would
// without it (Marconi's FLOP-aware eviction, as GreedyDual-Size): those since the next checkpoint
// up its path. Of two used as recently, the shallow one goes first, where least-recently-used
// order would evict the deep one, used before it.
TEST_P(CheckpointEvictionTest, AShallowCheckpointGoesBeforeADeepOneUsedEarlier) {
  MakeOrder(/*checkpoint_slots=*/2);
  const std::vector<int32_t> deep = Prompt(80, 1);     // checkpoints at 64 and 80
  const std::vector<int32_t> shallow = Prompt(16, 2);  // one checkpoint: its end, 16
  const std::vector<int32_t> head(deep.begin(), deep.begin() + 64);
  Keep(deep);
  ASSERT_EQ(cache_->stats().checkpoints.cached, 2);  // 64 (the prefill's last boundary) and 80
  // The shallow one takes the slot of 80, which saves 16 tokens over 64 (or, least recently
  // used, that of 64, kept first).
  Keep(shallow);
  ASSERT_EQ(cache_->stats().checkpoints.cached, 2);
  ASSERT_TRUE(Resumable(shallow));
  ASSERT_EQ(Resumable(head), !lru());
  ASSERT_EQ(Resumable(deep), lru());
  const std::vector<int32_t>& kept = lru() ? deep : head;  // 80 alone, or 64 alone
  Use(kept);
  Use(shallow);  // the most recently used now
  // A third needs a slot: 16 tokens saved against 64 (80 now has nothing above it), or the
  // least recently used.
  Keep(Prompt(16, 3));
  EXPECT_EQ(Resumable(kept), !lru());
  EXPECT_EQ(Resumable(shallow), lru());
  EXPECT_TRUE(Resumable(Prompt(16, 3)));
  ExpectInvariants();
}

// What a checkpoint saves is counted over the next one up its path: of a prompt's checkpoints at
// 64 (its prefill's last boundary) and 80 (its end), the one at 80 saves 16 tokens, as much as a
// 16-token prompt's own, and, kept before it, gives way first. Counted by the tokens before them
// (the order before), the 16-token one would go; least recently used, the one at 64.
TEST_P(CheckpointEvictionTest, ACheckpointCloseBehindAnotherSavesOnlyTheTokensBetween) {
  MakeOrder(/*checkpoint_slots=*/3);
  const std::vector<int32_t> deep = Prompt(80, 1);
  const std::vector<int32_t> head(deep.begin(), deep.begin() + 64);
  Keep(deep);
  Keep(Prompt(16, 2));  // the free slot
  ASSERT_EQ(cache_->stats().checkpoints.cached, 3);
  Keep(Prompt(16, 3));  // needs one
  EXPECT_TRUE(Resumable(Prompt(16, 3)));
  EXPECT_TRUE(Resumable(Prompt(16, 2)));
  EXPECT_EQ(Resumable(head), !lru());
  EXPECT_EQ(Resumable(deep), lru());
  ExpectInvariants();
}

// Each eviction raises the floor every later keep or use starts from to the victim's worth, so a
// deep checkpoint nobody uses any more gives way once shallower ones have been evicted up to its
// worth: it outlives them for a while, not for good. Least recently used, it goes first.
TEST_P(CheckpointEvictionTest, ADeepCheckpointUnusedAgesOut) {
  MakeOrder(/*checkpoint_slots=*/3);
  const std::vector<int32_t> deep = Prompt(64, 1);  // checkpoints at 48 and 64
  const std::vector<int32_t> head(deep.begin(), deep.begin() + 48);
  Keep(deep);
  ASSERT_EQ(cache_->stats().checkpoints.cached, 2);
  // 16-token prompts, one checkpoint each, worth 16 over the floor when kept. By tokens saved,
  // 48 is worth 48 and 64 only the 16 past it: the first takes the free slot (16), the next
  // evicts 64 (floor 16: its own is 32), the next the first (32), the next two the two before
  // (floor 32: 48 each), and the sixth finds 48 the oldest of three worth 48.
  int32_t kept = 0;
  while (Resumable(head) && kept < 20) {
    Keep(Prompt(16, 10 + kept++));
    ASSERT_TRUE(cache_->CheckInvariants().ok());
  }
  EXPECT_EQ(kept, lru() ? 2 : 6);
  ExpectInvariants();
}

INSTANTIATE_TEST_SUITE_P(Orders, CheckpointEvictionTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "LeastRecentlyUsed" : "ByTokensSaved";
                         });

// kByExpectedTokensSaved weighs a checkpoint's tokens by how often its kind is resumed from.
class CheckpointKindTest : public StateCheckpointTest, public ::testing::WithParamInterface<bool> {
 protected:
  bool by_kind() const { return GetParam(); }
  void MakeKinds(int32_t checkpoint_slots) {
    Make(/*state_slots=*/checkpoint_slots + 4, checkpoint_slots, /*interval=*/0, 64,
         by_kind() ? KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved
                   : KvCacheOptions::CheckpointEviction::kByTokensSaved);
  }
  void Keep(const std::vector<int32_t>& prompt) {
    ASSERT_TRUE(cache_->Free(kAlice, Prefill(kAlice, prompt), OnFree::kCommit).ok());
  }
  // Resumes a prompt that extends `prompt` and lets the sequence go; returns the tokens matched.
  int64_t Use(const std::vector<int32_t>& prompt) {
    absl::StatusOr<AllocateResult> r = Resume(kBob, Concat(prompt, Prompt(3, 77)));
    KVPOOL_CHECK_OK(r.status());
    KVPOOL_CHECK_OK(cache_->Free(kBob, r->sequence, OnFree::kDiscard));
    return r->matched_tokens;
  }
  bool Resumable(const std::vector<int32_t>& prompt) {
    return cache_->MatchPrefix(kTenant, Concat(prompt, Prompt(3, 77))) ==
           static_cast<int64_t>(prompt.size());
  }
  const CheckpointKindRate& Rate(CheckpointKind kind) {
    return cache_->CheckpointKindRates()[static_cast<size_t>(kind)];
  }
};

// Every resume counts for the kind of the checkpoint resumed from, which then counts as
// kResumed; so does a prompt that passes a checkpoint evicted while its block stayed cached (it
// would have resumed there), or else a kind evicted early would look unused for that reason.
TEST_P(CheckpointKindTest, ResumesAreCountedByKindEvictedOnesIncluded) {
  MakeKinds(/*checkpoint_slots=*/1);
  const std::vector<int32_t> first = Prompt(16, 1);
  Keep(first);  // the checkpoint at its end
  EXPECT_EQ(Rate(CheckpointKind::kSequenceEnd).kept, 1);
  EXPECT_EQ(Use(first), 16);
  EXPECT_EQ(Rate(CheckpointKind::kSequenceEnd).resumed, 1);
  EXPECT_EQ(Rate(CheckpointKind::kResumed).kept, 1);
  Keep(Prompt(16, 2));  // takes the one slot: `first`'s checkpoint is evicted, its block stays
  EXPECT_EQ(cache_->stats().checkpoints.evicted, 1);
  EXPECT_EQ(Use(first), 0);  // passes where it was
  EXPECT_EQ(Rate(CheckpointKind::kResumed).resumed, 1);
  EXPECT_EQ(Rate(CheckpointKind::kSequenceEnd).kept, 2);
  EXPECT_EQ(Rate(CheckpointKind::kSequenceEnd).resumed, 1);
  // (resumed + 1) / (kept + 1), in 256ths.
  EXPECT_EQ(Rate(CheckpointKind::kSequenceEnd).weight(), 256 * 2 / 3);
  EXPECT_EQ(Rate(CheckpointKind::kResumed).weight(), 256);
  EXPECT_EQ(Rate(CheckpointKind::kInterval).weight(), 256);  // nothing measured
  ExpectInvariants();
  // Its block evicted, the evicted checkpoint is forgotten.
  ASSERT_GT(cache_->EvictCached(64), 0);
  EXPECT_EQ(Use(first), 0);
  EXPECT_EQ(Rate(CheckpointKind::kResumed).resumed, 1);
  ExpectInvariants();
}

// Prompts that come back to the end of earlier ones, never to their prefill's last block
// boundary: that kind's checkpoints, though they save more tokens, give way first once measured.
// Unweighed, the end gives way (it saves only the 16 tokens past the boundary's).
TEST_P(CheckpointKindTest, AKindNobodyComesBackToGivesWayFirst) {
  MakeKinds(/*checkpoint_slots=*/2);
  for (int32_t k = 0; k < 6; ++k) {
    const std::vector<int32_t> p = Prompt(48, 10 + k);  // checkpoints at 32 and 48
    Keep(p);
    ASSERT_EQ(Use(p), 48);
  }
  EXPECT_EQ(Rate(CheckpointKind::kPrefillEnd).kept, 6);
  EXPECT_EQ(Rate(CheckpointKind::kPrefillEnd).resumed, 0);
  EXPECT_EQ(Rate(CheckpointKind::kSequenceEnd).resumed, 6);
  // An empty tree (the rates stay), so that both keep at one floor.
  ASSERT_GT(cache_->EvictCached(64), 0);
  ASSERT_EQ(cache_->stats().checkpoints.cached, 0);
  const std::vector<int32_t> p = Prompt(48, 1);
  const std::vector<int32_t> head(p.begin(), p.begin() + 32);
  Keep(p);
  ASSERT_TRUE(Resumable(p));
  ASSERT_TRUE(Resumable(head));
  Keep(Prompt(16, 2));  // needs one of the two slots
  EXPECT_EQ(Resumable(p), by_kind());
  EXPECT_EQ(Resumable(head), !by_kind());
  ExpectInvariants();
}

INSTANTIATE_TEST_SUITE_P(Orders, CheckpointKindTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "ByExpectedTokensSaved" : "ByTokensSaved";
                         });

// Found by state_checkpoint_random_test: a sequence that resumed inside a partially matched block
// writes into a copy of it, while its path still names the shared block. When the sequence the
// block belongs to extends and publishes it with other tokens, a checkpoint of the first sequence
// past its own published tokens must not be hung on that block: it holds another state.
TEST_F(StateCheckpointTest, ACheckpointIsNeverKeptOnABlockHoldingOtherTokens) {
  Make(8, 4, /*interval=*/1);
  const std::vector<int32_t> head = Prompt(8);
  const SequenceId x = Prefill(kAlice, head);
  ASSERT_TRUE(cache_->Free(kAlice, x, OnFree::kCommit).ok());  // a checkpoint at 8, mid-block
  ASSERT_EQ(cache_->stats().checkpoints.cached, 1);

  // C resumes at 8 and writes into the partially matched block itself; A, resuming there too,
  // gets a copy of it (C holds it).
  absl::StatusOr<AllocateResult> c = Resume(kBob, head);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<AllocateResult> a = Resume(kAlice, head);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->matched_tokens, 8);
  const std::vector<int32_t> theirs = Concat(head, Prompt(12, 2));
  const std::vector<int32_t> ours = Concat(head, Prompt(12, 1));
  ASSERT_TRUE(cache_->Grow(kAlice, a->sequence, 20, &plan_).ok());
  ASSERT_TRUE(cache_->Grow(kBob, c->sequence, 20, &plan_).ok());

  // A's step computes its tokens 8..20 and is to checkpoint the state after 16 of them.
  std::vector<PlannedCheckpoint> planned;
  ASSERT_TRUE(cache_->PlanCheckpoints(kAlice, a->sequence, 8, 20, true, &planned).ok());
  ASSERT_EQ(planned.size(), 1u);
  ASSERT_EQ(planned[0].position, 16);
  ASSERT_TRUE(cache_->AdvanceState(kAlice, a->sequence, 20).ok());
  // C publishes the block with its own tokens 8..16; then A tells of its tokens and publishes 8.
  ASSERT_TRUE(cache_->Commit(kBob, c->sequence, 16, std::span(theirs).subspan(8, 8)).ok());
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 8, std::span(ours).subspan(8)).ok());
  ExpectInvariants();

  // A prompt through C's 16 tokens resumes at most from the checkpoint at 8: A's state after 16
  // tokens is not the state after C's.
  absl::StatusOr<AllocateResult> d = Resume(kBob, theirs);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->matched_tokens, 8);
  EXPECT_THAT(plan_.state_copies,
              Not(Contains(::testing::Field(&BlockCopy::src, planned[0].slot))));
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, CheckpointsStayWithinTheirShareOfTheSlots) {
  Make(/*state_slots=*/6, /*checkpoint_slots=*/2, /*interval=*/1);
  std::vector<PlannedCheckpoint> planned;
  const SequenceId a = Prefill(kAlice, Prompt(100), &planned);
  // Six block boundaries wanted; two slots to hold them: the oldest cached ones make way.
  EXPECT_EQ(planned.size(), 2u);
  EXPECT_GE(cache_->stats().checkpoints.skipped, 4u);
  EXPECT_LE(cache_->stats().checkpoints.cached + cache_->stats().checkpoints.pending, 2);
  ASSERT_TRUE(cache_->Free(kAlice, a, OnFree::kCommit).ok());
  EXPECT_LE(cache_->stats().checkpoints.cached, 2);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, TruncateNamesTheNearestCheckpoint) {
  Make(8, 4);
  const std::vector<int32_t> prompt = Prompt(100);
  const SequenceId a = Prefill(kAlice, prompt);
  const absl::Status status = cache_->Truncate(kAlice, a, 80);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("nearest checkpoint on its path is at 64"));
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, ARewindCopiesTheCheckpointThereBackIntoTheState) {
  Make(8, 4);
  const SequenceId a = Prefill(kAlice, Prompt(100));  // checkpoints at 64 and 96
  const BlockId working = Slot(a);
  const std::string before = cache_->DebugString();
  // Without a plan to copy with, or where there is none: refused, nothing changed.
  EXPECT_EQ(cache_->Truncate(kAlice, a, 96).code(), absl::StatusCode::kFailedPrecondition);
  DevicePlan plan;
  EXPECT_EQ(cache_->Truncate(kAlice, a, 70, &plan).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(plan.empty());
  EXPECT_EQ(cache_->DebugString(), before);
  ASSERT_TRUE(cache_->Truncate(kAlice, a, 64, &plan).ok());
  ASSERT_EQ(plan.state_copies.size(), 1u);
  EXPECT_EQ(plan.state_copies[0].dst, working);
  EXPECT_EQ(cache_->states()->state(plan.state_copies[0].src), BlockState::kCached);
  EXPECT_EQ(cache_->Find(a)->state_tokens, 64);
  // The copy's source is marked in flight with the plan, cached as it is.
  const BlockId src = plan.state_copies[0].src;
  EXPECT_TRUE(cache_->MarkStatesInFlight(std::span(&src, 1), Fence{0, 3}).ok());
  ExpectInvariants();
  plan = DevicePlan{};
  ASSERT_TRUE(cache_->Truncate(kAlice, a, 0, &plan).ok());
  EXPECT_THAT(plan.state_zeros, ElementsAre(working));
  EXPECT_EQ(cache_->Find(a)->state_tokens, 0);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, WithoutCheckpointSlotsAPromptResumesNothing) {
  Make(8, 0);
  const SequenceId a = Prefill(kAlice, Prompt(40));
  ASSERT_TRUE(cache_->Free(kAlice, a, OnFree::kCommit).ok());
  absl::StatusOr<AllocateResult> b = Resume(kBob, Prompt(40));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->matched_tokens, 0);
  EXPECT_EQ(cache_->stats().missed_no_checkpoint, 40u);
  ExpectInvariants();
}

TEST_F(StateCheckpointTest, BadCheckpointOptionsAreRefused) {
  for (auto [slots, checkpoints, interval] :
       std::vector<std::tuple<int32_t, int32_t, int32_t>>{{4, 4, 4}, {4, -1, 4}, {4, 2, -1}}) {
    EXPECT_EQ(KvCacheManager::Create({.block_size = kBlock,
                                      .num_blocks = 8,
                                      .max_blocks_per_seq = 8,
                                      .state_slots = slots,
                                      .checkpoint_slots = checkpoints,
                                      .checkpoint_interval = interval})
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// A checkpoint slot that cannot be had costs no cached checkpoint. Before, TakeCheckpointSlot
// evicted one for its share of checkpoint_slots first (its slot still fenced, so RETIRING) and
// then found no free slot: the refused import (and a step's skipped checkpoint) had dropped a
// checkpoint prompts resumed from.
TEST_F(StateCheckpointTest, ARefusedCheckpointSlotEvictsNoCheckpoint) {
  Make(/*state_slots=*/3, /*checkpoint_slots=*/2, /*interval=*/0);
  std::vector<PlannedCheckpoint> planned;
  const SequenceId a = Prefill(kAlice, Prompt(20), &planned);  // plans 16
  ASSERT_EQ(planned.size(), 1u);
  // The step that wrote both is still in flight.
  const BlockId slots[] = {planned[0].slot, Slot(a)};
  ASSERT_TRUE(cache_->MarkStatesInFlight(slots, Fence{0, 5}).ok());
  ASSERT_TRUE(cache_->Free(kAlice, a, OnFree::kCommit).ok());  // keeps its end, 20
  ASSERT_EQ(cache_->stats().checkpoints.cached, 2);
  ASSERT_EQ(cache_->MatchPrefix(kTenant, Prompt(20)), 20);
  DevicePlan plan;  // takes the last free state slot
  absl::StatusOr<AllocateResult> b =
      cache_->Allocate(kBob, {.ns = kTenant, .num_tokens = 32}, &plan);
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string before = cache_->DebugString();
  EXPECT_EQ(cache_->ImportCheckpoint(kBob, b->sequence, kBlock).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache_->stats().checkpoints.cached, 2);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, Prompt(20)), 20);
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();
  // Once the step's fences pass, the same import evicts one (a free slot at once) and succeeds.
  fences_.Complete(0, 5);
  EXPECT_TRUE(cache_->ImportCheckpoint(kBob, b->sequence, kBlock).ok());
  EXPECT_EQ(cache_->stats().checkpoints.cached, 1);
  ExpectInvariants();
}

}  // namespace
}  // namespace kvpool
