#include "kvpool/block_pool.h"

#include <algorithm>
#include <array>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {

// Reaches into a pool to break it on purpose: CheckInvariants() must name the violation.
class BlockPoolTestPeer {
 public:
  static void SetRefs(BlockPool& pool, BlockId block, uint32_t refs) {
    pool.meta_[static_cast<size_t>(block.value())].refs = refs;
  }
  static void ListTwice(BlockPool& pool, BlockId block) { pool.free_list_.push_back(block); }
  static void SetOwner(BlockPool& pool, BlockId block, uint16_t slot, uint16_t epoch) {
    pool.meta_[static_cast<size_t>(block.value())].owner = {.slot = slot, .epoch = epoch};
  }
};

namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Timelines whose completed values the test moves by hand.
using testing::ManualFences;

class BlockPoolTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks, int32_t trace_depth = 8,
            int32_t max_namespaces = kMaxNamespaceSlots) {
    auto pool = BlockPool::Create({.num_blocks = num_blocks,
                                   .trace_depth = trace_depth,
                                   .max_namespaces = max_namespaces,
                                   .fences = &fences_});
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    ns_a_ = *pool_->RegisterNamespace(NamespaceId(100));
    ns_b_ = *pool_->RegisterNamespace(NamespaceId(200));
  }

  std::vector<BlockId> Alloc(int32_t n, NamespaceSlot slot,
                             std::vector<BlockFill>* fills = nullptr) {
    std::vector<BlockId> out;
    std::vector<BlockFill> ignored;
    EXPECT_TRUE(pool_->Allocate(n, slot, ctx_, &out, fills ? fills : &ignored).ok());
    return out;
  }

  void ExpectInvariants() {
    EXPECT_TRUE(pool_->CheckInvariants().ok()) << pool_->CheckInvariants();
  }

  ManualFences fences_;
  std::unique_ptr<BlockPool> pool_;
  NamespaceSlot ns_a_, ns_b_;
  TraceContext ctx_{.session = SessionId(1), .sequence = SequenceId(9), .time_ns = 1000};
};

TEST_F(BlockPoolTest, CreateRejectsBadOptions) {
  EXPECT_EQ(BlockPool::Create({.num_blocks = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create({.num_blocks = 4, .trace_depth = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create({.num_blocks = 4, .max_namespaces = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create({.num_blocks = 4, .max_namespaces = kMaxNamespaceSlots + 1})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(BlockPoolTest, AllocateHandsOutActiveBlocksWithFreshGenerations) {
  Make(4);
  const std::vector<BlockId> blocks = Alloc(3, ns_a_);
  EXPECT_THAT(blocks, ElementsAre(BlockId(0), BlockId(1), BlockId(2)));
  for (BlockId b : blocks) {
    EXPECT_EQ(pool_->state(b), BlockState::kActive);
    EXPECT_EQ(pool_->refs(b), 1u);
    EXPECT_EQ(pool_->generation(b), 1u);
    EXPECT_EQ(pool_->owner(b), NamespaceId(100));
  }
  EXPECT_EQ(pool_->num_free(), 1);
  EXPECT_EQ(pool_->num_active(), 3);
  EXPECT_EQ(pool_->active_blocks(ns_a_), 3);
  ExpectInvariants();
}

TEST_F(BlockPoolTest, FreeListIsLifoAndGenerationBumpsOnEveryHandOut) {
  Make(4);
  const BlockId b = Alloc(1, ns_a_)[0];
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  EXPECT_EQ(Alloc(1, ns_a_)[0], b);  // the warmest block comes back first
  EXPECT_EQ(pool_->generation(b), 2u);
  ExpectInvariants();
}

TEST_F(BlockPoolTest, ExhaustionReportsShortfallAndChangesNothing) {
  Make(4);
  Alloc(1, ns_a_);
  const std::string before = pool_->DebugString();
  std::vector<BlockId> out;
  std::vector<BlockFill> fills;
  const absl::Status status = pool_->Allocate(5, ns_a_, ctx_, &out, &fills);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(GetShortfall(status).has_value());
  EXPECT_EQ(GetShortfall(status)->blocks, 2);
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(fills.empty());
  EXPECT_EQ(pool_->DebugString(), before);
}

TEST_F(BlockPoolTest, OverReleaseIsReportedAndLeavesOneFreeListEntry) {
  Make(4);
  const BlockId b = Alloc(1, ns_a_)[0];
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  const absl::Status status = pool_->Release(b, ctx_);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("no reference"));
  EXPECT_EQ(pool_->refs(b), 0u);  // not UINT32_MAX
  EXPECT_EQ(pool_->state(b), BlockState::kFree);
  EXPECT_EQ(pool_->stats().over_releases, 1u);
  // The free list holds four distinct blocks: handing them all out never repeats one.
  const std::vector<BlockId> all = Alloc(4, ns_a_);
  EXPECT_EQ(absl::flat_hash_set<BlockId>(all.begin(), all.end()).size(), 4u);
  EXPECT_EQ(pool_->num_free(), 0);
  ExpectInvariants();
  // The trace recorded the bad release, with this file as the site.
  const std::vector<BlockTraceEntry> history = pool_->trace().History(b);
  const auto bad = std::find_if(history.begin(), history.end(), [](const BlockTraceEntry& e) {
    return e.op == BlockOp::kOverRelease;
  });
  ASSERT_NE(bad, history.end());
  EXPECT_THAT(bad->site.file_name(), HasSubstr("block_pool_test.cc"));
}

TEST_F(BlockPoolTest, ReleaseCannotTakeTheCachesReference) {
  Make(2);
  const BlockId b = Alloc(1, ns_a_)[0];
  ASSERT_TRUE(pool_->AddCacheRef(b, ctx_).ok());
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  EXPECT_EQ(pool_->state(b), BlockState::kCached);
  EXPECT_EQ(pool_->Release(b, ctx_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool_->state(b), BlockState::kCached);
  EXPECT_EQ(pool_->refs(b), 1u);
  ExpectInvariants();
}

TEST_F(BlockPoolTest, CacheReferenceMovesBlocksBetweenActiveAndCached) {
  Make(2);
  const BlockId b = Alloc(1, ns_a_)[0];
  ASSERT_TRUE(pool_->AddCacheRef(b, ctx_).ok());
  EXPECT_EQ(pool_->AddCacheRef(b, ctx_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool_->state(b), BlockState::kActive);
  EXPECT_EQ(pool_->refs(b), 2u);
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  EXPECT_EQ(pool_->state(b), BlockState::kCached);
  EXPECT_EQ(pool_->active_blocks(ns_a_), 0);
  ASSERT_TRUE(pool_->Retain(b, ctx_).ok());  // a prefix hit
  EXPECT_EQ(pool_->state(b), BlockState::kActive);
  EXPECT_EQ(pool_->active_blocks(ns_a_), 1);
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  ASSERT_TRUE(pool_->DropCacheRef(b, ctx_).ok());  // eviction
  EXPECT_EQ(pool_->state(b), BlockState::kFree);
  EXPECT_EQ(pool_->DropCacheRef(b, ctx_).code(), absl::StatusCode::kFailedPrecondition);
  ExpectInvariants();
}

TEST_F(BlockPoolTest, RetainOfFreeBlockFails) {
  Make(2);
  EXPECT_EQ(pool_->Retain(BlockId(0), ctx_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool_->Retain(BlockId(7), ctx_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->Release(BlockId(-1), ctx_).code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(BlockPoolTest, HandOutAcrossNamespacesMustBeScrubbed) {
  Make(1);
  std::vector<BlockFill> fills;
  BlockId b = Alloc(1, ns_a_, &fills)[0];
  EXPECT_THAT(fills, ElementsAre(BlockFill{b, false}));  // never owned: pristine
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  fills.clear();
  Alloc(1, ns_a_, &fills);
  EXPECT_THAT(fills, ElementsAre(BlockFill{b, false}));  // same tenant
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  fills.clear();
  Alloc(1, ns_b_, &fills);
  EXPECT_THAT(fills, ElementsAre(BlockFill{b, true}));  // another tenant's stale KV
  EXPECT_EQ(pool_->stats().scrubs, 1u);
}

TEST_F(BlockPoolTest, ReleaseWhileInFlightRetiresUntilTheFencePasses) {
  Make(2);
  const BlockId b = Alloc(1, ns_a_)[0];
  ASSERT_TRUE(pool_->MarkInFlight(b, Fence{1, 5}, ctx_).ok());
  ASSERT_TRUE(pool_->MarkInFlight(b, Fence{2, 3}, ctx_).ok());
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  EXPECT_EQ(pool_->state(b), BlockState::kRetiring);
  EXPECT_EQ(pool_->num_retiring(), 1);
  ExpectInvariants();

  // The retiring block is never handed out.
  std::vector<BlockId> out;
  std::vector<BlockFill> fills;
  EXPECT_EQ(pool_->Allocate(2, ns_a_, ctx_, &out, &fills).code(),
            absl::StatusCode::kResourceExhausted);
  fences_.Complete(1, 5);
  EXPECT_EQ(pool_->ReclaimRetired(ctx_), 0);  // timeline 2 still owes work
  fences_.Complete(2, 3);
  EXPECT_EQ(pool_->ReclaimRetired(ctx_), 1);
  EXPECT_EQ(pool_->state(b), BlockState::kFree);
  EXPECT_EQ(pool_->stats().retired, 1u);
  ExpectInvariants();

  // Fences are forgotten once free: the next owner's release does not wait on them.
  const BlockId again = Alloc(1, ns_a_)[0];
  ASSERT_EQ(again, b);
  ASSERT_TRUE(pool_->Release(again, ctx_).ok());
  EXPECT_EQ(pool_->state(b), BlockState::kFree);
}

TEST_F(BlockPoolTest, ReleaseAfterTheFencePassedFreesAtOnce) {
  Make(1);
  const BlockId b = Alloc(1, ns_a_)[0];
  ASSERT_TRUE(pool_->MarkInFlight(b, Fence{0, 1}, ctx_).ok());
  fences_.Complete(0, 1);
  ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  EXPECT_EQ(pool_->state(b), BlockState::kFree);
}

TEST_F(BlockPoolTest, MarkInFlightRejectsBadUse) {
  Make(2);
  const BlockId b = Alloc(1, ns_a_)[0];
  EXPECT_EQ(pool_->MarkInFlight(b, Fence{kMaxTimelines, 1}, ctx_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->MarkInFlight(BlockId(1), Fence{0, 1}, ctx_).code(),
            absl::StatusCode::kFailedPrecondition);  // FREE: no work may touch it
  auto no_fences = BlockPool::Create({.num_blocks = 1});
  ASSERT_TRUE(no_fences.ok());
  EXPECT_EQ((*no_fences)->MarkInFlight(BlockId(0), Fence{0, 1}, ctx_).code(),
            absl::StatusCode::kFailedPrecondition);
  ExpectInvariants();
}

TEST_F(BlockPoolTest, TraceKeepsTheLastOperationsOfEachBlock) {
  Make(1, /*trace_depth=*/4);
  for (int i = 0; i < 5; ++i) {
    const BlockId b = Alloc(1, ns_a_)[0];
    ASSERT_TRUE(pool_->Release(b, ctx_).ok());
  }
  const std::vector<BlockTraceEntry> history = pool_->trace().History(BlockId(0));
  ASSERT_EQ(history.size(), 4u);
  EXPECT_EQ(history[0].op, BlockOp::kAllocate);
  EXPECT_EQ(history[1].op, BlockOp::kFree);
  EXPECT_EQ(history[3].op, BlockOp::kFree);
  EXPECT_EQ(history[3].op_seq, 10u);
  EXPECT_EQ(history[2].generation, 5u);
  EXPECT_EQ(history[2].session, SessionId(1));
  EXPECT_EQ(history[2].sequence, SequenceId(9));
  EXPECT_EQ(history[2].time_ns, 1000);
  for (size_t i = 1; i < history.size(); ++i) EXPECT_LT(history[i - 1].op_seq, history[i].op_seq);
  EXPECT_THAT(pool_->trace().Format(BlockId(0)), HasSubstr("block_pool_test.cc"));
}

TEST_F(BlockPoolTest, TraceDepthZeroRecordsNothing) {
  Make(1, /*trace_depth=*/0);
  Alloc(1, ns_a_);
  EXPECT_TRUE(pool_->trace().History(BlockId(0)).empty());
  EXPECT_TRUE(pool_->trace().All().empty());
}

TEST_F(BlockPoolTest, NamespacesRegisterOnce) {
  Make(1);
  EXPECT_EQ(*pool_->RegisterNamespace(NamespaceId(100)), ns_a_);
  EXPECT_EQ(pool_->FindNamespace(NamespaceId(200)), ns_b_);
  EXPECT_FALSE(pool_->FindNamespace(NamespaceId(300)).has_value());
  EXPECT_EQ(pool_->RegisterNamespace(kNoNamespace).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The whole table of a full-size pool: once every namespace's blocks are back on the free list,
// one sweep makes all their slots reusable and a new namespace registers and allocates.
TEST_F(BlockPoolTest, AFullNamespaceTableIsRecycledOnceIdle) {
  Make(4);  // registers 100 and 200
  for (uint64_t ns = 1; pool_->namespaces_left() > 0; ++ns) {
    ASSERT_TRUE(pool_->RegisterNamespace(NamespaceId(1000 + ns)).ok());
  }
  EXPECT_EQ(pool_->stats().namespaces, kMaxNamespaceSlots);
  const std::string full = pool_->DebugString();
  EXPECT_EQ(pool_->RegisterNamespace(NamespaceId(7)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool_->DebugString(), full);
  const std::vector<BlockId> held = Alloc(2, ns_a_);  // A still owns blocks: not idle
  const std::vector<NamespaceSlot> idle = pool_->IdleNamespaces({});
  ASSERT_EQ(idle.size(), static_cast<size_t>(kMaxNamespaceSlots - 1));
  EXPECT_EQ(std::count(idle.begin(), idle.end(), ns_a_), 0);
  pool_->RecycleNamespaces(idle);
  ExpectInvariants();
  EXPECT_EQ(pool_->namespaces_left(), kMaxNamespaceSlots - 1);
  EXPECT_EQ(pool_->FindNamespace(NamespaceId(100)), ns_a_);
  EXPECT_FALSE(pool_->FindNamespace(NamespaceId(200)).has_value());
  absl::StatusOr<NamespaceSlot> fresh = pool_->RegisterNamespace(NamespaceId(7));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Alloc(2, *fresh);
  EXPECT_EQ(pool_->owner(BlockId(2)), NamespaceId(7));
  EXPECT_EQ(pool_->stats().namespaces_recycled, static_cast<uint64_t>(kMaxNamespaceSlots - 1));
  ExpectInvariants();
}

// The stale-KV hole: A's block goes back FREE still tagged with A's slot; the slot is recycled
// and given to B; B's next hand-out is that very block. It must be scrubbed, or B reads A's KV.
TEST_F(BlockPoolTest, ABlockOfARecycledNamespaceIsScrubbedWhoeverGetsTheSlot) {
  Make(1, 8, /*max_namespaces=*/2);  // slots: A, B
  std::vector<BlockFill> fills;
  const BlockId block = Alloc(1, ns_a_, &fills)[0];
  EXPECT_FALSE(fills[0].scrub);  // never handed out before: still zero
  ASSERT_TRUE(pool_->Release(block, ctx_).ok());
  EXPECT_EQ(pool_->RegisterNamespace(NamespaceId(300)).status().code(),
            absl::StatusCode::kResourceExhausted);
  // B is held by its owner's records (say, a sequence without blocks): only A is recycled.
  const std::vector<uint8_t> held = {0, 0, 1};
  ASSERT_THAT(pool_->IdleNamespaces(held), ElementsAre(ns_a_));
  pool_->RecycleNamespaces(pool_->IdleNamespaces(held));
  EXPECT_EQ(pool_->owner(block), kNoNamespace);
  const NamespaceSlot c = *pool_->RegisterNamespace(NamespaceId(300));
  EXPECT_EQ(c, ns_a_);  // A's old slot
  fills.clear();
  ASSERT_EQ(Alloc(1, c, &fills)[0], block);
  EXPECT_TRUE(fills[0].scrub) << "a block of the previous owner of this slot was not scrubbed";
  EXPECT_EQ(pool_->stats().scrubs, 1u);
  ExpectInvariants();
}

// Tallies (a quota group's running count): every ACTIVE transition counts, a namespace brings its
// blocks along when it is filed elsewhere, and its filing outlives its slot.
TEST_F(BlockPoolTest, TalliesFollowTheirNamespacesBlocksAndSlots) {
  Make(8, 8, /*max_namespaces=*/2);  // slots: A (100), B (200)
  pool_->SetTally(NamespaceId(100), 1);
  pool_->SetTally(NamespaceId(200), 1);
  const std::vector<BlockId> a = Alloc(3, ns_a_);
  const std::vector<BlockId> b = Alloc(2, ns_b_);
  EXPECT_EQ(pool_->tally_active(1), 5);
  ASSERT_TRUE(pool_->AddCacheRef(a[0], ctx_).ok());
  ASSERT_TRUE(pool_->Release(a[0], ctx_).ok());  // CACHED: no longer ACTIVE
  ASSERT_TRUE(pool_->Retain(b[0], ctx_).ok());   // shared: still one ACTIVE block
  EXPECT_EQ(pool_->tally_active(1), 4);
  ASSERT_TRUE(pool_->Retain(a[0], ctx_).ok());  // CACHED -> ACTIVE
  EXPECT_EQ(pool_->tally_active(1), 5);
  ExpectInvariants();
  // B moves to tally 2 with its two blocks, then to none.
  pool_->SetTally(NamespaceId(200), 2);
  EXPECT_EQ(pool_->tally_active(1), 3);
  EXPECT_EQ(pool_->tally_active(2), 2);
  ExpectInvariants();
  pool_->SetTally(NamespaceId(200), 0);
  EXPECT_EQ(pool_->tally_active(2), 0);
  EXPECT_EQ(pool_->tally_of(NamespaceId(200)), 0u);
  ExpectInvariants();
  // A lets everything go; its slot goes to C (untallied), and A keeps tally 1 for when it is
  // registered again.
  ASSERT_TRUE(pool_->Release(a[0], ctx_).ok());
  ASSERT_TRUE(pool_->DropCacheRef(a[0], ctx_).ok());
  for (size_t k = 1; k < a.size(); ++k) ASSERT_TRUE(pool_->Release(a[k], ctx_).ok());
  EXPECT_EQ(pool_->tally_active(1), 0);
  const std::vector<uint8_t> held = {0, 0, 1};  // B is still named by its owner's records
  pool_->RecycleNamespaces(pool_->IdleNamespaces(held));
  ExpectInvariants();  // a free slot is filed under no tally
  const NamespaceSlot c = *pool_->RegisterNamespace(NamespaceId(300));
  EXPECT_EQ(c, ns_a_);
  Alloc(2, c);
  EXPECT_EQ(pool_->tally_active(1), 0) << "the recycled slot still counts for A's tally";
  EXPECT_EQ(pool_->tally_of(NamespaceId(100)), 1u);
  ExpectInvariants();
}

TEST_F(BlockPoolTest, CachedAndRetiringBlocksKeepTheirNamespaceBusy) {
  Make(3);
  const std::vector<BlockId> a = Alloc(1, ns_a_);
  const std::vector<BlockId> b = Alloc(1, ns_b_);
  ASSERT_TRUE(pool_->AddCacheRef(a[0], ctx_).ok());
  ASSERT_TRUE(pool_->Release(a[0], ctx_).ok());  // CACHED
  ASSERT_TRUE(pool_->MarkInFlight(b[0], Fence{0, 5}, ctx_).ok());
  ASSERT_TRUE(pool_->Release(b[0], ctx_).ok());  // RETIRING
  EXPECT_TRUE(pool_->IdleNamespaces({}).empty());
  ASSERT_TRUE(pool_->DropCacheRef(a[0], ctx_).ok());
  EXPECT_THAT(pool_->IdleNamespaces({}), ElementsAre(ns_a_));
  fences_.Complete(0, 5);
  pool_->ReclaimRetired(ctx_);
  EXPECT_THAT(pool_->IdleNamespaces({}), ElementsAre(ns_a_, ns_b_));
}

TEST_F(BlockPoolTest, CheckInvariantsNamesTheWholeViolation) {
  Make(4);
  BlockPoolTestPeer::SetRefs(*pool_, BlockId(2), 3);
  EXPECT_EQ(pool_->CheckInvariants().message(), "block 2 is FREE with refs 3");
  BlockPoolTestPeer::SetRefs(*pool_, BlockId(2), 0);
  ASSERT_TRUE(pool_->CheckInvariants().ok());
  BlockPoolTestPeer::ListTwice(*pool_, BlockId(1));
  EXPECT_EQ(pool_->CheckInvariants().message(), "free list has 5 entries but 4 blocks are FREE");
}

TEST_F(BlockPoolTest, CheckInvariantsCatchesAFreeBlockRememberingARecycledSlot) {
  Make(2);
  ASSERT_TRUE(pool_->Release(Alloc(1, ns_b_)[0], ctx_).ok());
  pool_->RecycleNamespaces(pool_->IdleNamespaces({}));
  ExpectInvariants();
  BlockPoolTestPeer::SetOwner(*pool_, BlockId(0), ns_b_.value(), 1);  // as if not recycled
  EXPECT_EQ(pool_->CheckInvariants().message(),
            "FREE block 0 remembers slot 2 at epoch 1; the slot is at 1 and was recycled since");
}

// A slot's epoch is 16 bits: recycled 65,536 times, it comes back to the epoch a FREE block of
// its first namespace remembers. That block must still be scrubbed for whoever holds the slot
// then (the wrap re-tags the slot's FREE blocks, one walk of the pool).
TEST_F(BlockPoolTest, ASlotRecycledUntilItsEpochWrapsStillScrubsItsOldBlocks) {
  Make(1, 8, /*max_namespaces=*/2);
  ASSERT_TRUE(pool_->Release(Alloc(1, ns_a_)[0], ctx_).ok());  // A's block, epoch 0
  const std::vector<uint8_t> keep_b = {0, 0, 1};
  for (int k = 0; k < 65536; ++k) {
    const std::vector<NamespaceSlot> idle = pool_->IdleNamespaces(keep_b);
    ASSERT_THAT(idle, ElementsAre(ns_a_));
    pool_->RecycleNamespaces(idle);
    ASSERT_EQ(*pool_->RegisterNamespace(NamespaceId(1000 + k)), ns_a_);
  }
  EXPECT_EQ(pool_->blocks_swept(), 1u);  // the one walk, at the wrap
  ExpectInvariants();
  std::vector<BlockFill> fills;
  ASSERT_EQ(Alloc(1, ns_a_, &fills), std::vector<BlockId>{BlockId(0)});
  EXPECT_TRUE(fills[0].scrub) << "A's block went to the slot's 65,536th successor unscrubbed";
  ExpectInvariants();
}

}  // namespace
}  // namespace kvpool
