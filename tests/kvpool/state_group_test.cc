// The state group of a KvCacheManager (docs/hybrid-groups.md §3): one working slot per live
// sequence, zeroed when made, copied by Fork, released fenced by Free; no prefix hit and no
// rewind below the known tokens until the tree keeps state checkpoints.

#include <array>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kTenant(100);

using testing::ManualFences;

std::vector<int32_t> Prompt(int32_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = 7 * i + 3;
  return out;
}

class StateGroupTest : public ::testing::Test {
 protected:
  void Make(int32_t state_slots, int32_t num_blocks = 64) {
    auto cache = KvCacheManager::Create({.block_size = 16,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 32,
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .state_slots = state_slots});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  absl::StatusOr<AllocateResult> Alloc(SessionId session, int64_t tokens,
                                       std::span<const int32_t> prompt = {}) {
    plan_ = DevicePlan{};
    return cache_->Allocate(session, {.ns = kTenant, .num_tokens = tokens, .prompt = prompt},
                            &plan_);
  }

  BlockId Slot(SequenceId id) { return cache_->Find(id)->state_slot; }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    EXPECT_TRUE(status.ok()) << status;
  }

  ManualClock clock_;
  ManualFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
  DevicePlan plan_;
};

TEST_F(StateGroupTest, EachSequenceGetsItsOwnZeroedSlot) {
  Make(4);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 20);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(plan_.state_zeros, ElementsAre(Slot(a->sequence)));
  EXPECT_THAT(plan_.state_copies, IsEmpty());
  absl::StatusOr<AllocateResult> b = Alloc(kBob, 0);  // no tokens: still a state
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(plan_.state_zeros, ElementsAre(Slot(b->sequence)));
  EXPECT_NE(Slot(a->sequence), Slot(b->sequence));
  EXPECT_EQ(cache_->stats().states.active, 2);
  EXPECT_EQ(cache_->stats().states.num_blocks, 4);
  ExpectInvariants();
}

TEST_F(StateGroupTest, WithoutAStateGroupNoSlotIsTaken) {
  Make(0);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 20);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Slot(a->sequence), kInvalidBlock);
  EXPECT_TRUE(plan_.state_zeros.empty());
  EXPECT_EQ(cache_->stats().states.num_blocks, 0);
  EXPECT_EQ(cache_->MarkStatesInFlight(std::array{BlockId(0)}, Fence{0, 1}).code(),
            absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(StateGroupTest, ABatchPastTheSlotsIsRefusedWholeAndChangesNothing) {
  Make(3);
  ASSERT_TRUE(Alloc(kAlice, 16).ok());
  const std::string before = cache_->DebugString();
  const std::vector<AllocateRequest> batch(3, AllocateRequest{.ns = kTenant, .num_tokens = 16});
  std::vector<AllocateResult> results;
  DevicePlan plan;
  const absl::Status s = cache_->AllocateBatch(kAlice, batch, &results, &plan);
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_TRUE(GetShortfall(s).has_value());
  EXPECT_EQ(GetShortfall(s)->resource, Resource::kStateSlots);
  EXPECT_EQ(GetShortfall(s)->blocks, 1);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("state slots"));
  EXPECT_TRUE(results.empty());
  EXPECT_TRUE(plan.empty());
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();
}

TEST_F(StateGroupTest, ForkCopiesTheParentsStateIntoAFreshSlot) {
  Make(2);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 32);
  ASSERT_TRUE(a.ok());
  DevicePlan plan;
  absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, a->sequence, &plan);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_THAT(plan.state_copies, ElementsAre(BlockCopy{Slot(a->sequence), Slot(*child)}));
  EXPECT_THAT(plan.state_zeros, IsEmpty());
  // The slots are spent: a third sequence, by fork or allocate, is refused and changes nothing.
  const std::string before = cache_->DebugString();
  DevicePlan refused;
  absl::StatusOr<SequenceId> third = cache_->Fork(kAlice, a->sequence, &refused);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(third.status())->resource, Resource::kStateSlots);
  EXPECT_TRUE(refused.empty());
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();
}

TEST_F(StateGroupTest, AFreedSlotIsNotReusedBeforeItsFencePassed) {
  Make(1);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 16);
  ASSERT_TRUE(a.ok());
  const BlockId slot = Slot(a->sequence);
  // A model step reads and writes the state; the sequence is freed while it runs.
  ASSERT_TRUE(cache_->MarkStatesInFlight(std::array{slot}, Fence{0, 5}).ok());
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence).ok());
  EXPECT_EQ(cache_->stats().states.retiring, 1);
  absl::StatusOr<AllocateResult> early = Alloc(kBob, 16);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kResourceExhausted);
  ExpectInvariants();
  fences_.Complete(0, 5);
  absl::StatusOr<AllocateResult> b = Alloc(kBob, 16);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Slot(b->sequence), slot);
  EXPECT_THAT(plan_.state_zeros, ElementsAre(slot));  // the old state never shows through
  ExpectInvariants();
}

TEST_F(StateGroupTest, MarkingAFreeSlotInFlightIsRefused) {
  Make(2);
  const Fence fence{0, 1};
  EXPECT_EQ(cache_->MarkStatesInFlight(std::array{BlockId(0)}, fence).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache_->MarkStatesInFlight(std::array{BlockId(2)}, fence).code(),
            absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(StateGroupTest, APromptMatchesNoCachedPrefixAndTheCutIsCounted) {
  for (int32_t slots : {0, 4}) {
    SCOPED_TRACE(slots);
    Make(slots);
    const std::vector<int32_t> prompt = Prompt(40);
    absl::StatusOr<AllocateResult> a = Alloc(kAlice, 40, prompt);
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
    absl::StatusOr<AllocateResult> b = Alloc(kBob, 48, prompt);
    ASSERT_TRUE(b.ok()) << b.status();
    const KvCacheStats stats = cache_->stats();
    if (slots == 0) {
      EXPECT_EQ(b->matched_tokens, 40);  // the control: attention alone would resume here
      EXPECT_EQ(stats.missed_no_checkpoint, 0u);
    } else {
      EXPECT_EQ(b->matched_tokens, 0);
      EXPECT_EQ(stats.hit_tokens, 0u);
      EXPECT_EQ(stats.missed_no_checkpoint, 40u);
      EXPECT_EQ(stats.prompt_tokens, 80u);
      // Every prompt token is counted missed exactly once.
      EXPECT_EQ(stats.missed_not_cached + stats.missed_evicted + stats.missed_coverage +
                    stats.missed_another_namespace + stats.missed_below_admission_bar +
                    stats.missed_no_checkpoint,
                80u);
      EXPECT_THAT(plan_.copies, IsEmpty());  // nothing was adopted
    }
    ExpectInvariants();
  }
}

TEST_F(StateGroupTest, TruncateNeverRewindsTheState) {
  Make(2);
  const std::vector<int32_t> prompt = Prompt(40);
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 64, prompt);
  ASSERT_TRUE(a.ok());
  // Capacity past the known tokens can go: the state has not seen it.
  EXPECT_TRUE(cache_->Truncate(kAlice, a->sequence, 48).ok());
  EXPECT_TRUE(cache_->Truncate(kAlice, a->sequence, 40).ok());
  const std::string before = cache_->DebugString();
  const absl::Status s = cache_->Truncate(kAlice, a->sequence, 39);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("no checkpoint"));
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();
}

TEST_F(StateGroupTest, FreeSessionGivesEverySlotBack) {
  Make(3);
  ASSERT_TRUE(Alloc(kAlice, 16).ok());
  absl::StatusOr<AllocateResult> a = Alloc(kAlice, 20);
  ASSERT_TRUE(a.ok());
  DevicePlan plan;
  ASSERT_TRUE(cache_->Fork(kAlice, a->sequence, &plan).ok());
  EXPECT_EQ(cache_->stats().states.free, 0);
  EXPECT_EQ(cache_->FreeSession(kAlice), 3);
  EXPECT_EQ(cache_->stats().states.free, 3);
  ExpectInvariants();
}

// One peer (a reference group: the daemon puts a uid's sessions in one) cannot take every slot
// with sequences that hold no block: its share is bounded, and the others keep theirs.
TEST_F(StateGroupTest, AReferenceGroupsShareOfTheSlotsIsBounded) {
  Make(6);
  constexpr uint64_t kUid = 1001;
  ASSERT_TRUE(cache_->SetSessionQuota(kAlice, kUnlimited, kUid).ok());
  ASSERT_TRUE(cache_->SetRefGroupStateSlots(kUid, 2).ok());
  ASSERT_TRUE(Alloc(kAlice, 0).ok());
  absl::StatusOr<AllocateResult> second = Alloc(kAlice, 0);
  ASSERT_TRUE(second.ok());
  const std::string before = cache_->DebugString();
  absl::StatusOr<AllocateResult> third = Alloc(kAlice, 0);
  ASSERT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_EQ(GetShortfall(third.status())->resource, Resource::kStateSlots);
  DevicePlan plan;
  EXPECT_EQ(cache_->Fork(kAlice, second->sequence, &plan).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache_->DebugString(), before);
  // Another session of the same group shares the bound; a session outside it does not.
  ASSERT_TRUE(cache_->SetSessionQuota(kBob, kUnlimited, kUid).ok());
  EXPECT_EQ(Alloc(kBob, 0).status().code(), absl::StatusCode::kResourceExhausted);
  constexpr SessionId kCarol(3);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(Alloc(kCarol, 0).ok()) << i;
  // A freed sequence gives its share back.
  ASSERT_TRUE(cache_->Free(kAlice, second->sequence).ok());
  EXPECT_TRUE(Alloc(kBob, 0).ok());
  ExpectInvariants();
  EXPECT_EQ(cache_->SetRefGroupStateSlots(kUid, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->SetRefGroupStateSlots(0, 1).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StateGroupTest, NegativeSlotsAreRefused) {
  auto cache = KvCacheManager::Create(
      {.block_size = 16, .num_blocks = 8, .max_blocks_per_seq = 8, .state_slots = -1});
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
