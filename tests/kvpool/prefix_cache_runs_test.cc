// Run-length radix nodes seen through the KvCacheManager: a served prompt is one run, a prompt
// diverging inside it splits it, evicting the branch merges it back, eviction trims a run from its
// tail, and locks, pins and events stay per block inside a run.

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "tests/kvpool/tokens.h"

namespace kvpool {
namespace {

using ::testing::SizeIs;

constexpr SessionId kAlice(1);
constexpr NamespaceId kNs(100);
constexpr int32_t kBs = 4;

using test_tokens::Tokens;

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class PrefixCacheRunsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cache = KvCacheManager::Create({.block_size = kBs,
                                         .num_blocks = 32,
                                         .max_blocks_per_seq = 16,
                                         .clock = &clock_,
                                         .eviction_policy = "lru"});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  SequenceId Alloc(const std::vector<int32_t>& prompt) {
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> r = cache_->Allocate(
        kAlice, {.ns = kNs, .num_tokens = static_cast<int64_t>(prompt.size()), .prompt = prompt},
        &plan);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->sequence : SequenceId(0);
  }

  void Serve(const std::vector<int32_t>& prompt) {
    clock_.Advance(1000);
    ASSERT_TRUE(cache_->Free(kAlice, Alloc(prompt), OnFree::kCommit).ok());
    ExpectInvariants();
  }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
  }

  PrefixCacheStats Stats() const { return cache_->stats().cache; }
  int64_t Cached(const std::vector<int32_t>& prompt) const {
    return cache_->MatchPrefix(kNs, prompt);
  }

  ManualClock clock_;
  std::unique_ptr<KvCacheManager> cache_;
};

const std::vector<int32_t> kA = Tokens(0, 4 * kBs);
// Shares kA's first two blocks, then diverges.
const std::vector<int32_t> kB = Concat(Tokens(0, 2 * kBs), Tokens(500, 2 * kBs));

TEST_F(PrefixCacheRunsTest, ADivergingPromptSplitsTheRunAndEvictingTheBranchMergesItBack) {
  Serve(kA);
  EXPECT_EQ(Stats().runs, 1);
  EXPECT_EQ(Stats().nodes, 4);
  Serve(kB);
  EXPECT_EQ(Stats().runs, 3);  // the shared two blocks, then kA's rest and kB's rest below them
  EXPECT_EQ(Stats().splits, 1u);
  EXPECT_EQ(Stats().nodes, 6);
  EXPECT_EQ(Cached(kA), 4 * kBs);
  EXPECT_EQ(Cached(kB), 4 * kBs);

  // kA's rest was released first: LRU takes it, and the shared run merges with kB's rest.
  EXPECT_EQ(cache_->EvictCached(2), 2);
  ExpectInvariants();
  EXPECT_EQ(Stats().runs, 1);
  EXPECT_EQ(Stats().merges, 1u);
  EXPECT_EQ(Cached(kA), 2 * kBs);
  EXPECT_EQ(Cached(kB), 4 * kBs);
}

TEST_F(PrefixCacheRunsTest, EvictionTrimsARunFromItsTailBlockByBlock) {
  Serve(Tokens(0, 6 * kBs));
  EXPECT_EQ(cache_->EvictCached(1), 1);
  EXPECT_EQ(Cached(Tokens(0, 6 * kBs)), 5 * kBs);
  EXPECT_EQ(cache_->EvictCached(2), 2);
  ExpectInvariants();
  EXPECT_EQ(Cached(Tokens(0, 6 * kBs)), 3 * kBs);
  EXPECT_EQ(Stats().runs, 1);
  EXPECT_EQ(Stats().nodes, 3);
  EXPECT_EQ(Stats().candidates, 1);  // the run's last block only
}

// A sequence adopting part of a run locks those blocks only: the rest of the run stays
// evictable, without a split.
TEST_F(PrefixCacheRunsTest, AHitEndingInsideARunHoldsOnlyTheBlocksItUses) {
  Serve(kA);
  const SequenceId holder = Alloc(Tokens(0, 2 * kBs));
  EXPECT_EQ(Stats().runs, 1);
  EXPECT_EQ(Stats().evictable, 2);
  EXPECT_EQ(cache_->EvictCached(10), 2);
  ExpectInvariants();
  EXPECT_EQ(Cached(kA), 2 * kBs);
  ASSERT_TRUE(cache_->Free(kAlice, holder).ok());
  EXPECT_EQ(cache_->EvictCached(10), 2);
  EXPECT_EQ(Stats().runs, 0);
}

TEST_F(PrefixCacheRunsTest, APinInsideARunPinsOnlyItsBlocks) {
  Serve(kA);
  const absl::StatusOr<PinId> pin = cache_->PinPrefix(kAlice, kNs, Tokens(0, 2 * kBs),
                                                      /*ttl_ns=*/1'000'000, /*priority=*/1);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(Stats().pinned, 2);
  EXPECT_EQ(cache_->EvictCached(10), 2);
  ExpectInvariants();
  EXPECT_EQ(Cached(kA), 2 * kBs);
  ASSERT_THAT(cache_->ListPins(), SizeIs(1));
  EXPECT_EQ(cache_->ListPins()[0].blocks, 2);
}

// A branch hung inside a run is announced with the hash of the block it hangs below, and an
// evicted run's blocks are announced one hash each.
TEST_F(PrefixCacheRunsTest, EventsNameEveryBlockOfARun) {
  Serve(kA);
  Serve(kB);
  std::vector<KvEvent> events;
  ASSERT_TRUE(cache_->events()->ReadFrom(1, 100, &events));
  ASSERT_THAT(events, SizeIs(2));
  ASSERT_THAT(events[0].block_hashes, SizeIs(4));
  ASSERT_THAT(events[1].block_hashes, SizeIs(2));
  EXPECT_EQ(events[1].parent_hash, events[0].block_hashes[1]);
  EXPECT_EQ(events[1].token_ids, Tokens(500, 2 * kBs));
  EXPECT_EQ(cache_->EvictCached(2), 2);  // kA's last two blocks, the last first
  std::vector<KvEvent> removed;
  ASSERT_TRUE(cache_->events()->ReadFrom(3, 100, &removed));
  ASSERT_THAT(removed, SizeIs(1));
  EXPECT_EQ(removed[0].type, KvEventType::kBlockRemoved);
  EXPECT_EQ(removed[0].block_hashes,
            (std::vector<BlockHash>{events[0].block_hashes[3], events[0].block_hashes[2]}));
}

}  // namespace
}  // namespace kvpool
