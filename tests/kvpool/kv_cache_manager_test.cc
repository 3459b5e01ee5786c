#include "kvpool/kv_cache_manager.h"

#include <array>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kTenantA(100);
constexpr NamespaceId kTenantB(200);

using testing::ManualFences;

class KvCacheManagerTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks, int32_t max_blocks_per_seq, int32_t block_size = 16) {
    auto cache = KvCacheManager::Create({.block_size = block_size,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = max_blocks_per_seq,
                                         .clock = &clock_,
                                         .fences = &fences_});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  SequenceId Alloc(SessionId session, int64_t tokens, NamespaceId ns = kTenantA) {
    DevicePlan plan;
    absl::StatusOr<AllocateResult> result = cache_->Allocate(session, {ns, tokens}, &plan);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? result->sequence : SequenceId(0);
  }

  const std::vector<BlockId>& Table(SequenceId id) { return cache_->Find(id)->table; }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    EXPECT_TRUE(status.ok()) << status;
  }

  ManualClock clock_;
  ManualFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
};

TEST_F(KvCacheManagerTest, CreateRejectsBadOptions) {
  EXPECT_FALSE(
      KvCacheManager::Create({.block_size = 0, .num_blocks = 4, .max_blocks_per_seq = 4}).ok());
  EXPECT_FALSE(
      KvCacheManager::Create({.block_size = 4, .num_blocks = 0, .max_blocks_per_seq = 4}).ok());
  EXPECT_FALSE(
      KvCacheManager::Create({.block_size = 4, .num_blocks = 4, .max_blocks_per_seq = 0}).ok());
  EXPECT_FALSE(KvCacheManager::Create(
                   {.block_size = 4, .num_blocks = 4, .max_blocks_per_seq = 4, .clock = nullptr})
                   .ok());
}

// The regression real engines shipped: growing re-appended blocks the sequence already had.
TEST_F(KvCacheManagerTest, GrowAppendsOnlyTheMissingBlocks) {
  Make(/*num_blocks=*/64, /*max_blocks_per_seq=*/32);
  const SequenceId seq = Alloc(kAlice, 100);
  EXPECT_EQ(Table(seq).size(), 7u);
  const std::vector<BlockId> first(Table(seq).begin(), Table(seq).end());

  DevicePlan plan;
  ASSERT_TRUE(cache_->Grow(kAlice, seq, 200, &plan).ok());
  EXPECT_EQ(Table(seq).size(), 13u);
  EXPECT_EQ(plan.fills.size(), 6u);
  EXPECT_THAT(plan.copies, IsEmpty());
  EXPECT_TRUE(std::equal(first.begin(), first.end(), Table(seq).begin()));  // kept, not redone

  DevicePlan again;
  ASSERT_TRUE(cache_->Grow(kAlice, seq, 200, &again).ok());  // covered: a no-op
  EXPECT_EQ(Table(seq).size(), 13u);
  EXPECT_TRUE(again.empty());
  ASSERT_TRUE(cache_->Grow(kAlice, seq, 150, &again).ok());  // shorter: a no-op, not a rewind
  EXPECT_EQ(cache_->Find(seq)->num_tokens, 200);
  EXPECT_EQ(cache_->pool().num_free(), 64 - 13);
  ExpectInvariants();

  ASSERT_TRUE(cache_->Free(kAlice, seq).ok());
  EXPECT_EQ(cache_->pool().num_free(), 64);
  EXPECT_EQ(cache_->Find(seq), nullptr);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, RepeatedGrowthNeverPassesTheTableBound) {
  Make(/*num_blocks=*/64, /*max_blocks_per_seq=*/8);
  const SequenceId seq = Alloc(kAlice, 1);
  for (int64_t n = 2; n <= 8 * 16 + 40; ++n) {
    DevicePlan plan;
    const absl::Status status = cache_->Grow(kAlice, seq, n, &plan);
    if (n <= 8 * 16) {
      ASSERT_TRUE(status.ok()) << n << ": " << status;
    } else {
      ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << n;
      ASSERT_EQ(GetShortfall(status)->resource, Resource::kTableBound);
      ASSERT_TRUE(plan.empty());
    }
    ASSERT_LE(Table(seq).size(), 8u);
  }
  EXPECT_EQ(cache_->Find(seq)->num_tokens, 128);
  DevicePlan plan;
  const absl::Status huge = cache_->Grow(kAlice, seq, std::numeric_limits<int64_t>::max(), &plan);
  EXPECT_EQ(huge.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Table(seq).size(), 8u);
  EXPECT_EQ(cache_->pool().num_free(), 64 - 8);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, AllocateBeyondTheTableBoundFails) {
  Make(64, 4);
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> id = cache_->Allocate(kAlice, {kTenantA, 65}, &plan);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(id.status())->resource, Resource::kTableBound);
  EXPECT_EQ(GetShortfall(id.status())->blocks, 1);
  EXPECT_EQ(cache_->pool().num_free(), 64);
  EXPECT_EQ(cache_->stats().exhausted, 1u);
}

TEST_F(KvCacheManagerTest, ExhaustionMidBatchLeavesEverythingUnchanged) {
  Make(/*num_blocks=*/10, /*max_blocks_per_seq=*/10);
  const SequenceId a = Alloc(kAlice, 20);  // 2 blocks
  const SequenceId b = Alloc(kAlice, 30);  // 2 blocks
  const SequenceId c = Alloc(kAlice, 16);  // 1 block
  const std::string before = cache_->DebugString();
  clock_.Advance(1000);  // a failed call must not even leave a trace entry

  // a: +2, b: +2 fit in the 5 free blocks; c: +3 does not.
  const std::vector<GrowRequest> batch = {{a, 64}, {b, 64}, {c, 64}};
  DevicePlan plan;
  const absl::Status status = cache_->GrowBatch(kAlice, batch, &plan);
  ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(status)->resource, Resource::kPoolBlocks);
  EXPECT_EQ(GetShortfall(status)->blocks, 2);
  EXPECT_TRUE(plan.empty());
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();

  // Without c the same step fits, and is applied whole.
  ASSERT_TRUE(cache_->GrowBatch(kAlice, std::span(batch).first(2), &plan).ok());
  EXPECT_EQ(Table(a).size(), 4u);
  EXPECT_EQ(Table(b).size(), 4u);
  EXPECT_EQ(cache_->pool().num_free(), 1);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, AllocateBatchIsAllOrNothing) {
  Make(8, 8);
  const std::string before = cache_->DebugString();
  const std::vector<AllocateRequest> batch = {{kTenantA, 64}, {kTenantB, 64}, {kTenantA, 16}};
  std::vector<AllocateResult> ids;
  DevicePlan plan;
  EXPECT_EQ(cache_->AllocateBatch(kAlice, batch, &ids, &plan).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(ids, IsEmpty());
  EXPECT_EQ(cache_->DebugString(), before);
  ASSERT_TRUE(cache_->AllocateBatch(kAlice, std::span(batch).first(2), &ids, &plan).ok());
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_EQ(plan.fills.size(), 8u);
  EXPECT_EQ(cache_->Find(ids[1].sequence)->ns, kTenantB);
  ExpectInvariants();
}

// Requests of one batch that match the same cached prefix turn its blocks ACTIVE once: the
// namespace quota is charged for them once, then for each request's fresh blocks.
TEST_F(KvCacheManagerTest, ABatchSharingACachedPrefixChargesItOnce) {
  Make(16, 8);
  std::vector<int32_t> prompt(32);
  for (int32_t i = 0; i < 32; ++i) prompt[static_cast<size_t>(i)] = 500 + i;
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> first =
      cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 32, .prompt = prompt}, &plan);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(cache_->Free(kAlice, first->sequence, OnFree::kCommit).ok());
  // Two requests, each the 2 cached blocks and 1 fresh one: 2 + 2 ACTIVE blocks in all.
  const std::vector<AllocateRequest> batch = {{.ns = kTenantA, .num_tokens = 48, .prompt = prompt},
                                              {.ns = kTenantA, .num_tokens = 48, .prompt = prompt}};
  std::vector<AllocateResult> ids;
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenantA, 3).ok());
  EXPECT_EQ(cache_->AllocateBatch(kAlice, batch, &ids, &plan).code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenantA, 4).ok());
  ASSERT_TRUE(cache_->AllocateBatch(kAlice, batch, &ids, &plan).ok());
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0].matched_tokens, 32);
  EXPECT_EQ(ids[1].matched_tokens, 32);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, BadRequestsGetTheirCodesAndChangeNothing) {
  Make(16, 8);
  const SequenceId seq = Alloc(kAlice, 20);
  const std::string before = cache_->DebugString();
  DevicePlan plan;
  EXPECT_EQ(cache_->Grow(kAlice, SequenceId(999), 40, &plan).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->Grow(kBob, seq, 40, &plan).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->Truncate(kBob, seq, 0).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->Free(kBob, seq).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->Fork(kBob, seq, &plan).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->Grow(kAlice, seq, -1, &plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Truncate(kAlice, seq, 21).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Truncate(kAlice, seq, -3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->GrowBatch(kAlice, {}, &plan).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<GrowRequest> twice = {{seq, 40}, {seq, 50}};
  EXPECT_EQ(cache_->GrowBatch(kAlice, twice, &plan).code(), absl::StatusCode::kInvalidArgument);
  std::vector<AllocateResult> ids;
  EXPECT_EQ(cache_->AllocateBatch(kAlice, {}, &ids, &plan).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Allocate(kAlice, {kTenantA, -5}, &plan).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Allocate(kAlice, {kNoNamespace, 5}, &plan).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Allocate(kNoSession, {kTenantA, 5}, &plan).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A batch whose second entry is bad fails before the first is applied.
  const std::vector<GrowRequest> mixed = {{seq, 40}, {SequenceId(999), 40}};
  EXPECT_EQ(cache_->GrowBatch(kAlice, mixed, &plan).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(plan.empty());
  EXPECT_EQ(cache_->DebugString(), before);
}

TEST_F(KvCacheManagerTest, TruncateReleasesBlocksPastTheNewEnd) {
  Make(16, 8);
  const SequenceId seq = Alloc(kAlice, 64);
  ASSERT_TRUE(cache_->Truncate(kAlice, seq, 17).ok());
  EXPECT_EQ(Table(seq).size(), 2u);
  EXPECT_EQ(cache_->Find(seq)->num_tokens, 17);
  EXPECT_EQ(cache_->pool().num_free(), 14);
  ASSERT_TRUE(cache_->Truncate(kAlice, seq, 0).ok());
  EXPECT_THAT(Table(seq), IsEmpty());
  EXPECT_EQ(cache_->pool().num_free(), 16);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, ForkSharesFullBlocksAndCopiesThePartialOne) {
  Make(16, 8);
  const SequenceId parent = Alloc(kAlice, 40);  // 2 full blocks + 8 of 16
  DevicePlan plan;
  const absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, parent, &plan);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::vector<BlockId>& p = Table(parent);
  const std::vector<BlockId>& c = Table(*child);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0], p[0]);
  EXPECT_EQ(c[1], p[1]);
  EXPECT_NE(c[2], p[2]);
  EXPECT_THAT(plan.copies, ElementsAre(BlockCopy{p[2], c[2]}));
  EXPECT_THAT(plan.fills, IsEmpty());  // the copy overwrites the whole block
  EXPECT_EQ(cache_->pool().refs(p[0]), 2u);
  EXPECT_EQ(cache_->pool().refs(p[2]), 1u);
  EXPECT_EQ(cache_->Find(*child)->num_tokens, 40);
  ExpectInvariants();

  // Both can now append without touching each other's blocks.
  DevicePlan grow;
  ASSERT_TRUE(cache_->Grow(kAlice, parent, 41, &grow).ok());
  ASSERT_TRUE(cache_->Grow(kAlice, *child, 41, &grow).ok());
  EXPECT_TRUE(grow.empty());
  ASSERT_TRUE(cache_->Free(kAlice, parent).ok());
  EXPECT_EQ(cache_->pool().refs(c[0]), 1u);
  ASSERT_TRUE(cache_->Free(kAlice, *child).ok());
  EXPECT_EQ(cache_->pool().num_free(), 16);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, ForkOfABlockAlignedSequenceCopiesNothing) {
  Make(8, 8);
  const SequenceId parent = Alloc(kAlice, 32);
  DevicePlan plan;
  ASSERT_TRUE(cache_->Fork(kAlice, parent, &plan).ok());
  EXPECT_TRUE(plan.empty());
  EXPECT_EQ(cache_->pool().num_free(), 6);
}

TEST_F(KvCacheManagerTest, WritingIntoASharedBlockCopiesItFirst) {
  Make(16, 8);
  const SequenceId parent = Alloc(kAlice, 48);  // three full blocks
  DevicePlan plan;
  const SequenceId child = *cache_->Fork(kAlice, parent, &plan);
  const BlockId shared = Table(parent)[2];
  ASSERT_TRUE(cache_->Truncate(kAlice, parent, 40).ok());  // rewind into the shared block
  ASSERT_TRUE(cache_->Grow(kAlice, parent, 44, &plan).ok());
  ASSERT_EQ(plan.copies.size(), 1u);
  EXPECT_EQ(plan.copies[0].src, shared);
  EXPECT_EQ(plan.copies[0].dst, Table(parent)[2]);
  EXPECT_EQ(Table(child)[2], shared);  // the child's tokens are untouched
  EXPECT_EQ(cache_->pool().refs(shared), 1u);
  EXPECT_EQ(cache_->stats().cow_copies, 1u);
  ExpectInvariants();

  // The child now holds that block alone and writes in place.
  ASSERT_TRUE(cache_->Truncate(kAlice, child, 40).ok());
  DevicePlan in_place;
  ASSERT_TRUE(cache_->Grow(kAlice, child, 44, &in_place).ok());
  EXPECT_TRUE(in_place.empty());
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, SiblingsWritingOneSharedBlockInOneBatchCopyOnce) {
  Make(8, 8);
  const SequenceId a = Alloc(kAlice, 32);
  DevicePlan plan;
  const SequenceId b = *cache_->Fork(kAlice, a, &plan);
  ASSERT_TRUE(cache_->Truncate(kAlice, a, 20).ok());
  ASSERT_TRUE(cache_->Truncate(kAlice, b, 20).ok());
  const std::vector<GrowRequest> step = {{a, 21}, {b, 21}};
  ASSERT_TRUE(cache_->GrowBatch(kAlice, step, &plan).ok());
  EXPECT_EQ(plan.copies.size(), 1u);  // a moves off; b is then alone
  EXPECT_NE(Table(a)[1], Table(b)[1]);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, NamespaceQuotaBoundsPhysicalBlocks) {
  Make(32, 16);
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenantA, 4).ok());
  const SequenceId seq = Alloc(kAlice, 64);
  DevicePlan plan;
  // A fork shares full blocks: no new physical blocks, so it fits the quota.
  const SequenceId child = *cache_->Fork(kAlice, seq, &plan);
  const absl::Status status = cache_->Grow(kAlice, child, 65, &plan);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(status)->resource, Resource::kNamespaceQuota);
  EXPECT_EQ(GetShortfall(status)->blocks, 1);
  Alloc(kBob, 64, kTenantB);  // other tenants are not limited by it
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenantA, kUnlimited).ok());
  ASSERT_TRUE(cache_->Grow(kAlice, child, 65, &plan).ok());
  EXPECT_EQ(cache_->SetNamespaceQuota(kTenantA, -1).code(), absl::StatusCode::kInvalidArgument);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, SessionQuotaBoundsReferences) {
  Make(32, 16);
  ASSERT_TRUE(cache_->SetSessionQuota(kAlice, 5).ok());
  const SequenceId seq = Alloc(kAlice, 64);
  DevicePlan plan;
  const absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, seq, &plan);  // +4 references
  EXPECT_EQ(child.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(child.status())->resource, Resource::kSessionQuota);
  EXPECT_EQ(GetShortfall(child.status())->blocks, 3);
  ASSERT_TRUE(cache_->Grow(kAlice, seq, 80, &plan).ok());  // 5th reference fits
  EXPECT_EQ(cache_->Grow(kAlice, seq, 81, &plan).code(), absl::StatusCode::kResourceExhausted);
  Alloc(kBob, 64);  // Bob is unlimited
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, FreeSessionReleasesEverythingItHeld) {
  Make(32, 8);
  const SequenceId a = Alloc(kAlice, 40);
  DevicePlan plan;
  ASSERT_TRUE(cache_->Fork(kAlice, a, &plan).ok());
  Alloc(kAlice, 100);
  const SequenceId bob = Alloc(kBob, 30);
  EXPECT_EQ(cache_->FreeSession(kAlice), 3);
  EXPECT_EQ(cache_->stats().sequences, 1);
  EXPECT_EQ(cache_->stats().sessions, 1);
  EXPECT_EQ(cache_->pool().num_free(), 32 - 2);
  EXPECT_EQ(Table(bob).size(), 2u);
  EXPECT_EQ(cache_->FreeSession(kAlice), 0);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, BlocksMovingToAnotherTenantAreScrubbed) {
  Make(2, 2);
  const SequenceId a = Alloc(kAlice, 32, kTenantA);
  ASSERT_TRUE(cache_->Free(kAlice, a).ok());
  DevicePlan plan;
  ASSERT_TRUE(cache_->Allocate(kBob, {kTenantB, 20}, &plan).ok());
  ASSERT_EQ(plan.fills.size(), 2u);
  EXPECT_TRUE(plan.fills[0].scrub);
  EXPECT_TRUE(plan.fills[1].scrub);
}

TEST_F(KvCacheManagerTest, BlocksInFlightAreReusedOnlyAfterTheirFence) {
  Make(4, 4);
  const SequenceId seq = Alloc(kAlice, 64);
  const std::vector<BlockId> blocks = Table(seq);
  ASSERT_TRUE(cache_->MarkInFlight(blocks, Fence{0, 7}).ok());
  ASSERT_TRUE(cache_->Free(kAlice, seq).ok());
  EXPECT_EQ(cache_->pool().num_retiring(), 4);
  ExpectInvariants();
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> early = cache_->Allocate(kAlice, {kTenantA, 1}, &plan);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kResourceExhausted);
  fences_.Complete(0, 7);
  const absl::StatusOr<AllocateResult> later = cache_->Allocate(kAlice, {kTenantA, 64}, &plan);
  ASSERT_TRUE(later.ok()) << later.status();  // the allocation reclaimed them
  EXPECT_EQ(cache_->pool().num_retiring(), 0);
  ExpectInvariants();
  // Marking is all-or-nothing: a free block in the list fails the whole call.
  const std::vector<BlockId> mixed = {Table(later->sequence)[0], BlockId(99)};
  EXPECT_EQ(cache_->MarkInFlight(mixed, Fence{0, 9}).code(), absl::StatusCode::kNotFound);
}

// A freed sequence's token buffer is the next one's (a long prompt's copy then writes pages
// already mapped), holding exactly the new sequence's tokens; a fork's tokens are its parent's.
TEST_F(KvCacheManagerTest, FreedTokenBuffersAreReusedHoldingOnlyTheNewTokens) {
  Make(/*num_blocks=*/512, /*max_blocks_per_seq=*/128);
  std::vector<int32_t> prompt(1000);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i);
  DevicePlan plan;
  auto first =
      cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 1000, .prompt = prompt}, &plan);
  ASSERT_TRUE(first.ok()) << first.status();
  const int32_t* buffer = cache_->Find(first->sequence)->tokens.data();
  ASSERT_TRUE(cache_->Free(kAlice, first->sequence, OnFree::kDiscard).ok());
  const std::vector<int32_t> shorter = {7, 8, 9};
  auto second =
      cache_->Allocate(kBob, {.ns = kTenantB, .num_tokens = 40, .prompt = shorter}, &plan);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(cache_->Find(second->sequence)->tokens.data(), buffer);
  EXPECT_EQ(cache_->Find(second->sequence)->tokens, shorter);
  auto child = cache_->Fork(kBob, second->sequence, &plan);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(cache_->Find(*child)->tokens, shorter);
  // Freeing more sequences than spare buffers are kept leaves the live ones' tokens alone.
  std::vector<SequenceId> many;
  for (int i = 0; i < 40; ++i) {
    auto r = cache_->Allocate(
        kAlice, {.ns = kTenantA, .num_tokens = 100, .prompt = std::span(prompt).first(100)}, &plan);
    ASSERT_TRUE(r.ok()) << r.status();
    many.push_back(r->sequence);
  }
  for (SequenceId id : many) ASSERT_TRUE(cache_->Free(kAlice, id, OnFree::kDiscard).ok());
  EXPECT_EQ(cache_->Find(second->sequence)->tokens, shorter);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, StatsCountCallsAndGauges) {
  Make(8, 8);
  const SequenceId seq = Alloc(kAlice, 20);
  DevicePlan plan;
  ASSERT_TRUE(cache_->Grow(kAlice, seq, 40, &plan).ok());
  ASSERT_TRUE(cache_->Truncate(kAlice, seq, 10).ok());
  const KvCacheStats s = cache_->stats();
  EXPECT_EQ(s.allocate_calls, 1u);
  EXPECT_EQ(s.grow_calls, 1u);
  EXPECT_EQ(s.truncate_calls, 1u);
  EXPECT_EQ(s.sequences, 1);
  EXPECT_EQ(s.pool.active, 1);
  EXPECT_EQ(s.pool.free, 7);
  EXPECT_EQ(s.pool.allocated, 3u);
  EXPECT_EQ(s.pool.freed, 2u);
}

// Two forks share every block of a block-aligned sequence; their clients then write different
// tokens into the shared block. The block holds one of them: publishing the other must be refused
// and leave the tree as it was (it used to corrupt the tree for good).
TEST_F(KvCacheManagerTest, APublishThatContradictsTheBlocksPublishedTokensIsRefused) {
  Make(64, 64);
  std::vector<int32_t> prompt(20);
  for (int32_t i = 0; i < 20; ++i) prompt[static_cast<size_t>(i)] = 1000 + i;
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> s1 =
      cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 48, .prompt = prompt}, &plan);
  ASSERT_TRUE(s1.ok()) << s1.status();
  const absl::StatusOr<SequenceId> s2 = cache_->Fork(kAlice, s1->sequence, &plan);
  ASSERT_TRUE(s2.ok()) << s2.status();
  const std::vector<int32_t> x(28, 7), y(20, 9);
  ASSERT_TRUE(cache_->Commit(kAlice, *s2, 17, x).ok());
  ASSERT_TRUE(cache_->Commit(kAlice, s1->sequence, 40, y).ok());
  ExpectInvariants();
  const std::string before = cache_->DebugString();
  const absl::Status refused = cache_->Free(kAlice, *s2, OnFree::kCommit);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(cache_->DebugString() == before) << "the refused free changed the pool";
  ExpectInvariants();
  // A commit that contradicts the published tokens is refused the same way.
  EXPECT_EQ(cache_->Commit(kAlice, *s2, 48).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(cache_->DebugString() == before) << "the refused commit changed the pool";
  ASSERT_TRUE(cache_->Free(kAlice, *s2).ok());
  ASSERT_TRUE(cache_->Free(kAlice, s1->sequence, OnFree::kCommit).ok());
  ExpectInvariants();
  cache_->EvictCached(64);
  ExpectInvariants();
  EXPECT_EQ(cache_->stats().pool.free, 64);
}

// The block a commit checks may straddle the tokens the sequence already holds and the ones the
// commit brings: both halves are compared with what was published.
TEST_F(KvCacheManagerTest, ACommitIsCheckedAcrossTheBlockItsNewTokensStartIn) {
  Make(64, 64);
  std::vector<int32_t> prompt(20);
  for (int32_t i = 0; i < 20; ++i) prompt[static_cast<size_t>(i)] = 1000 + i;
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> s1 =
      cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 48, .prompt = prompt}, &plan);
  ASSERT_TRUE(s1.ok()) << s1.status();
  const absl::StatusOr<SequenceId> s2 = cache_->Fork(kAlice, s1->sequence, &plan);
  ASSERT_TRUE(s2.ok()) << s2.status();
  // s1 publishes block 1 as prompt tokens 16..19, then twelve 9s.
  ASSERT_TRUE(cache_->Commit(kAlice, s1->sequence, 40, std::vector<int32_t>(20, 9)).ok());
  const std::string before = cache_->DebugString();
  // s2 holds tokens 16..19 of block 1 and brings four more: 7s contradict the 9s there.
  EXPECT_EQ(cache_->Commit(kAlice, *s2, 24, std::vector<int32_t>(4, 7)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(cache_->DebugString() == before) << "the refused commit changed the pool";
  EXPECT_TRUE(cache_->Commit(kAlice, *s2, 24, std::vector<int32_t>(4, 9)).ok());
  ExpectInvariants();
  ASSERT_TRUE(cache_->Free(kAlice, *s2, OnFree::kCommit).ok());
  ASSERT_TRUE(cache_->Free(kAlice, s1->sequence, OnFree::kCommit).ok());
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, FreeBatchIsAllOrNothing) {
  Make(8, 8);
  const SequenceId a = Alloc(kAlice, 20), b = Alloc(kAlice, 20), c = Alloc(kBob, 5);
  const std::vector<SequenceId> missing = {a, SequenceId(999)}, twice = {a, b, a}, foreign = {b, c},
                                both = {a, b};
  EXPECT_EQ(cache_->FreeBatch(kAlice, missing).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->FreeBatch(kAlice, twice).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->FreeBatch(kAlice, foreign).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->FreeBatch(kAlice, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->stats().sequences, 3);
  ASSERT_TRUE(cache_->FreeBatch(kAlice, both).ok());
  EXPECT_EQ(cache_->stats().sequences, 1);
  ExpectInvariants();
}

TEST_F(KvCacheManagerTest, GrowReportsWhatChangedAndRevertUndoesIt) {
  Make(16, 16);
  std::vector<int32_t> prompt(20);
  for (int32_t i = 0; i < 20; ++i) prompt[static_cast<size_t>(i)] = i;
  DevicePlan plan;
  const SequenceId seq =
      cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 20, .prompt = prompt}, &plan)
          ->sequence;
  const SequenceId other = Alloc(kAlice, 16);
  ASSERT_TRUE(cache_->Commit(kAlice, seq, 20).ok());  // block 1 is published up to token 20
  ASSERT_TRUE(cache_->Truncate(kAlice, seq, 18).ok());
  const std::vector<BlockId> table = Table(seq);
  const KvCacheStats before = cache_->stats();
  // Token 18 lands below block 1's published coverage: copy-on-write, plus one new block.
  const std::vector<GrowRequest> grows = {{seq, 40}, {other, 16}};
  std::vector<TableChange> changes;
  plan = {};
  ASSERT_TRUE(cache_->GrowBatch(kAlice, grows, &plan, &changes).ok());
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_EQ(changes[0].sequence, seq);
  EXPECT_EQ(changes[0].old_num_tokens, 18);
  EXPECT_EQ(changes[0].first_changed, 1);
  EXPECT_EQ(changes[0].replaced, table[1]);
  EXPECT_EQ(changes[1].first_changed, 1);  // a no-op: nothing changed
  EXPECT_EQ(changes[1].replaced, kInvalidBlock);
  ASSERT_EQ(plan.copies.size(), 1u);
  EXPECT_EQ(plan.copies[0].src, table[1]);
  EXPECT_EQ(Table(seq).size(), 3u);
  EXPECT_NE(Table(seq)[1], table[1]);
  cache_->RevertGrow(kAlice, changes);
  EXPECT_EQ(Table(seq), table);
  EXPECT_EQ(cache_->Find(seq)->num_tokens, 18);
  const KvCacheStats after = cache_->stats();
  EXPECT_EQ(after.pool.free, before.pool.free);
  EXPECT_EQ(after.pool.active, before.pool.active);
  EXPECT_EQ(after.pool.cached, before.pool.cached);
  ExpectInvariants();
}

}  // namespace
}  // namespace kvpool
