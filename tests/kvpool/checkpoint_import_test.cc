// State checkpoints between the tree and a lower tier (docs/hybrid-groups.md §4, Tiers): the
// journal of checkpoints kept at a full block's end (TakePublishedCheckpoints), which kvpoold
// copies to its host tier beside the block, and ImportCheckpoint, through which a promotion puts
// a tier's copy back into the tree, so that a prompt resumes from it.

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr SessionId kLoader(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kTenant(100);
constexpr int32_t kBlock = 16;

using testing::ManualFences;

std::vector<int32_t> Prompt(int32_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = 11 * i + 5;
  return out;
}

class CheckpointImportTest : public ::testing::Test {
 protected:
  void Make(int32_t checkpoint_slots, int32_t interval = 0, bool journal = true) {
    auto cache = KvCacheManager::Create({.block_size = kBlock,
                                         .num_blocks = 64,
                                         .max_blocks_per_seq = 16,
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .publish_journal = journal,
                                         .state_slots = 8,
                                         .checkpoint_slots = checkpoint_slots,
                                         .checkpoint_interval = interval});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  // A loader's sequence: the prompt's blocks, nothing computed (its state holds no token).
  SequenceId Load(const std::vector<int32_t>& prompt) {
    DevicePlan plan;
    absl::StatusOr<AllocateResult> a = cache_->Allocate(
        kLoader,
        {.ns = kTenant, .num_tokens = static_cast<int64_t>(prompt.size()), .prompt = prompt},
        &plan);
    KVPOOL_CHECK_OK(a.status());
    return a->sequence;
  }

  absl::StatusOr<AllocateResult> Resume(const std::vector<int32_t>& prompt) {
    plan_ = DevicePlan{};
    return cache_->Allocate(
        kBob,
        {.ns = kTenant, .num_tokens = static_cast<int64_t>(prompt.size()) + 1, .prompt = prompt},
        &plan_);
  }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    EXPECT_TRUE(status.ok()) << status;
  }

  ManualClock clock_;
  ManualFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
  DevicePlan plan_;
};

TEST_F(CheckpointImportTest, AnImportedCheckpointIsResumedFromOnceCommitted) {
  Make(/*checkpoint_slots=*/4);
  const std::vector<int32_t> prompt = Prompt(4 * kBlock);
  const SequenceId loader = Load(prompt);
  absl::StatusOr<BlockId> slot = cache_->ImportCheckpoint(kLoader, loader, 3 * kBlock);
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_THAT(cache_->Find(loader)->checkpoints,
              ElementsAre(PlannedCheckpoint{3 * kBlock, *slot, /*imported=*/true}));
  ExpectInvariants();
  // Planned, not in the tree: nothing to resume yet.
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 0);
  ASSERT_TRUE(cache_->Commit(kLoader, loader, 4 * kBlock, {}).ok());
  EXPECT_THAT(cache_->Find(loader)->checkpoints, IsEmpty());
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 3 * kBlock);
  ASSERT_TRUE(cache_->Free(kLoader, loader).ok());
  absl::StatusOr<AllocateResult> resumed = Resume(prompt);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->matched_tokens, 3 * kBlock);
  // Its working state is a copy of the imported one.
  EXPECT_THAT(plan_.state_copies,
              ElementsAre(BlockCopy{*slot, cache_->Find(resumed->sequence)->state_slot}));
  ExpectInvariants();
}

// A checkpoint the steps plan goes into the tree only once the state has passed it; an imported
// one was taken elsewhere, so its loader's state (which holds nothing) does not hold it back.
TEST_F(CheckpointImportTest, AStepsCheckpointStillWaitsForTheState) {
  Make(/*checkpoint_slots=*/4, /*interval=*/1);
  const std::vector<int32_t> prompt = Prompt(4 * kBlock);
  const SequenceId loader = Load(prompt);
  std::vector<PlannedCheckpoint> planned;
  ASSERT_TRUE(cache_->PlanCheckpoints(kLoader, loader, 0, kBlock, false, &planned).ok());
  ASSERT_EQ(planned.size(), 1u);
  ASSERT_TRUE(cache_->ImportCheckpoint(kLoader, loader, 2 * kBlock).ok());
  ASSERT_TRUE(cache_->Commit(kLoader, loader, 4 * kBlock, {}).ok());
  // The step's (at 16) waits for AdvanceState; the imported one (at 32) is in the tree.
  ASSERT_EQ(cache_->Find(loader)->checkpoints.size(), 1u);
  EXPECT_EQ(cache_->Find(loader)->checkpoints[0].position, kBlock);
  EXPECT_EQ(cache_->MatchPrefix(kTenant, prompt), 2 * kBlock);
  ExpectInvariants();
}

TEST_F(CheckpointImportTest, ARefusedImportChangesNothing) {
  Make(/*checkpoint_slots=*/2);
  const std::vector<int32_t> prompt = Prompt(4 * kBlock);
  const SequenceId loader = Load(prompt);
  for (const int64_t position : {int64_t{0}, int64_t{kBlock + 1}, int64_t{5 * kBlock}}) {
    const absl::Status bad = cache_->ImportCheckpoint(kLoader, loader, position).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << position << " " << bad;
  }
  EXPECT_EQ(cache_->ImportCheckpoint(kBob, loader, kBlock).status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(cache_->ImportCheckpoint(kLoader, loader, kBlock).ok());
  EXPECT_THAT(std::string(cache_->ImportCheckpoint(kLoader, loader, kBlock).status().message()),
              HasSubstr("planned at 16 already"));
  ASSERT_TRUE(cache_->ImportCheckpoint(kLoader, loader, 2 * kBlock).ok());
  // Both checkpoint slots are planned: none can be spared.
  const absl::Status full = cache_->ImportCheckpoint(kLoader, loader, 3 * kBlock).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(GetShortfall(full)->resource, Resource::kStateSlots);
  EXPECT_EQ(cache_->Find(loader)->checkpoints.size(), 2u);
  ExpectInvariants();
  // Freed without a commit, the loader gives its slots back (fenced).
  ASSERT_TRUE(cache_->Free(kLoader, loader).ok());
  EXPECT_EQ(cache_->stats().states.active, 0);
  ExpectInvariants();

  Make(/*checkpoint_slots=*/0);
  const SequenceId plain = Load(prompt);
  EXPECT_EQ(cache_->ImportCheckpoint(kLoader, plain, kBlock).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// What kvpoold stages for its host tier: each checkpoint kept at a full block's end, keyed as the
// block is (its chained hash and parent's), and only while it is still kept.
TEST_F(CheckpointImportTest, TheJournalListsCheckpointsAtFullBlocksStillKept) {
  Make(/*checkpoint_slots=*/2);
  const std::vector<int32_t> prompt = Prompt(3 * kBlock);
  const SequenceId loader = Load(prompt);
  const BlockId at_one = *cache_->ImportCheckpoint(kLoader, loader, kBlock);
  const BlockId at_three = *cache_->ImportCheckpoint(kLoader, loader, 3 * kBlock);
  ASSERT_TRUE(cache_->Commit(kLoader, loader, 3 * kBlock, {}).ok());
  std::vector<PublishedBlock> blocks;
  cache_->TakePublished(&blocks);
  ASSERT_EQ(blocks.size(), 3u);
  std::vector<PublishedCheckpoint> checkpoints;
  cache_->TakePublishedCheckpoints(&checkpoints);
  ASSERT_EQ(checkpoints.size(), 2u);
  EXPECT_EQ(checkpoints[0].slot, at_one);
  EXPECT_EQ(checkpoints[0].block.hash, blocks[0].hash);
  EXPECT_EQ(checkpoints[0].block.parent, BlockHash{});
  EXPECT_EQ(checkpoints[0].block.ns, kTenant);
  EXPECT_EQ(checkpoints[1].slot, at_three);
  EXPECT_EQ(checkpoints[1].block.hash, blocks[2].hash);
  EXPECT_EQ(checkpoints[1].block.parent, blocks[1].hash);
  cache_->TakePublishedCheckpoints(&checkpoints);
  EXPECT_THAT(checkpoints, IsEmpty());  // taken once

  // One evicted before the journal is read is not listed.
  const std::vector<int32_t> other = Prompt(2 * kBlock + 1);
  const SequenceId second = Load(std::vector<int32_t>(other.begin() + 1, other.end()));
  ASSERT_TRUE(cache_->ImportCheckpoint(kLoader, second, kBlock).ok());
  ASSERT_TRUE(cache_->Commit(kLoader, second, 2 * kBlock, {}).ok());
  ASSERT_TRUE(cache_->Free(kLoader, loader).ok());
  ASSERT_TRUE(cache_->Free(kLoader, second).ok());
  EXPECT_GT(cache_->EvictCached(64), 0);
  cache_->TakePublishedCheckpoints(&checkpoints);
  EXPECT_THAT(checkpoints, IsEmpty());
  ExpectInvariants();

  // Without the journal nothing is recorded.
  Make(/*checkpoint_slots=*/2, 0, /*journal=*/false);
  const SequenceId quiet = Load(prompt);
  ASSERT_TRUE(cache_->ImportCheckpoint(kLoader, quiet, kBlock).ok());
  ASSERT_TRUE(cache_->Commit(kLoader, quiet, 3 * kBlock, {}).ok());
  cache_->TakePublishedCheckpoints(&checkpoints);
  EXPECT_THAT(checkpoints, IsEmpty());
}

}  // namespace
}  // namespace kvpool
