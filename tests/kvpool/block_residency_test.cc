// BlockResidency: vLLM's sampled residency histograms, measured in the pool by the injected
// clock, and the pool's fence-wait histogram.

#include "kvpool/block_residency.h"

#include <array>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"

namespace kvpool {
namespace {

constexpr SessionId kAlice(1);
constexpr NamespaceId kTenant(100);
constexpr int64_t kMs = 1'000'000;

// The bucket of `h` that `seconds` falls in holds exactly `n` observations.
void ExpectBucket(const Histogram& h, double seconds, uint64_t n) {
  const auto it = std::lower_bound(h.bounds().begin(), h.bounds().end(), seconds);
  EXPECT_EQ(h.counts()[static_cast<size_t>(it - h.bounds().begin())], n) << seconds << " s";
}

std::vector<BlockId> Ids(int32_t first, int32_t n) {
  std::vector<BlockId> out;
  for (int32_t b = first; b < first + n; ++b) out.push_back(BlockId(b));
  return out;
}

TEST(BlockResidencyTest, SamplesTheConfiguredShareOfHandOuts) {
  constexpr int32_t kBlocks = 64;
  std::vector<uint32_t> generations(kBlocks, 1);
  for (const double rate : {0.01, 0.25}) {
    BlockResidency r(kBlocks, rate, /*seed=*/7);
    constexpr int64_t kHandOuts = 200'000;
    for (int64_t k = 0; k < kHandOuts / 8; ++k) {
      r.OnHandOut(Ids(static_cast<int32_t>(k % 8) * 8, 8), generations.data(), 1, 0);
    }
    // Binomial(kHandOuts, rate): within 5 standard deviations.
    const double mean = kHandOuts * rate;
    const double sd = std::sqrt(kHandOuts * rate * (1 - rate));
    EXPECT_NEAR(static_cast<double>(r.stats().sampled), mean, 5 * sd) << rate;
  }
  BlockResidency none(kBlocks, 0, 7);
  for (int k = 0; k < 1000; ++k) none.OnHandOut(Ids(0, 64), generations.data(), 1, 0);
  EXPECT_EQ(none.stats().sampled, 0u);
  BlockResidency all(kBlocks, 1, 7);
  all.OnHandOut(Ids(0, 64), generations.data(), 1, 0);
  EXPECT_EQ(all.stats().sampled, 64u);
  EXPECT_EQ(all.followed(), 64u);
}

TEST(BlockResidencyTest, TheSameSeedPicksTheSameBlocks) {
  std::vector<uint32_t> generations(16, 1);
  BlockResidency a(16, 0.3, 42), b(16, 0.3, 42), c(16, 0.3, 43);
  std::vector<uint64_t> sa, sb, sc;
  for (int k = 0; k < 200; ++k) {
    a.OnHandOut(Ids(k % 2 * 8, 8), generations.data(), 1, 0);
    b.OnHandOut(Ids(k % 2 * 8, 8), generations.data(), 1, 0);
    c.OnHandOut(Ids(k % 2 * 8, 8), generations.data(), 1, 0);
    sa.push_back(a.stats().sampled);
    sb.push_back(b.stats().sampled);
    sc.push_back(c.stats().sampled);
  }
  EXPECT_EQ(sa, sb);
  EXPECT_NE(sa, sc);
}

TEST(BlockResidencyTest, ObservesLifetimeIdleAndReuseGapsAtEviction) {
  std::vector<uint32_t> generations(4, 1);
  BlockResidency r(4, 1, 1);
  r.OnHandOut(Ids(0, 1), generations.data(), 1, 0);
  // Six accesses: only the last four are remembered (three gaps of 10 ms), as vLLM's deque.
  for (int64_t t : {100, 200, 300, 310, 320, 330}) r.OnAccess(BlockId(0), 1, t * kMs);
  r.OnEvict(BlockId(0), 1, 2330 * kMs);
  EXPECT_EQ(r.stats().lifetime.count(), 1u);
  EXPECT_DOUBLE_EQ(r.stats().lifetime.sum(), 2.33);
  EXPECT_DOUBLE_EQ(r.stats().idle_before_evict.sum(), 2.0);
  EXPECT_EQ(r.stats().reuse_gap.count(), 3u);
  ExpectBucket(r.stats().reuse_gap, 0.01, 3);
  EXPECT_EQ(r.followed(), 0u);
  // Evicted again (not followed any more): nothing more observed.
  r.OnEvict(BlockId(0), 1, 3000 * kMs);
  EXPECT_EQ(r.stats().lifetime.count(), 1u);
}

TEST(BlockResidencyTest, AStaleSampleIsForgottenNotObserved) {
  std::vector<uint32_t> generations(4, 1);
  BlockResidency r(4, 1, 1);
  r.OnHandOut(Ids(0, 1), generations.data(), 1, 0);
  // The block went back uncached and was handed out again (generation 2) to someone unpicked.
  r.OnEvict(BlockId(0), 2, 5 * kMs);
  EXPECT_EQ(r.stats().lifetime.count(), 0u);
  EXPECT_EQ(r.followed(), 0u);
}

class ResidencyInPoolTest : public ::testing::Test {
 protected:
  void Make(double sample) {
    auto cache = KvCacheManager::Create({.block_size = 16,
                                         .num_blocks = 16,
                                         .max_blocks_per_seq = 8,
                                         .residency_sample = sample,
                                         .clock = &clock_});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    for (int32_t i = 0; i < 32; ++i) prompt_.push_back(1000 + i);
  }
  // A sequence over the prompt (two full blocks), freed into the cache.
  void Use() {
    DevicePlan plan;
    absl::StatusOr<AllocateResult> r =
        cache_->Allocate(kAlice, {.ns = kTenant, .num_tokens = 32, .prompt = prompt_}, &plan);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(cache_->Free(kAlice, r->sequence, OnFree::kCommit).ok());
  }
  const BlockResidencyStats& Residency() {
    stats_ = cache_->stats();
    return stats_.pool.residency;
  }

  ManualClock clock_{5 * kMs};
  std::unique_ptr<KvCacheManager> cache_;
  std::vector<int32_t> prompt_;
  KvCacheStats stats_;
};

// The manager's prefix hits are accesses and its evictions end the samples, timed by its Clock.
TEST_F(ResidencyInPoolTest, PrefixHitsAndEvictionsAreTimedByTheInjectedClock) {
  Make(1.0);
  Use();  // born at 5 ms, cached
  clock_.Advance(100 * kMs);
  Use();  // hit at 105 ms
  clock_.Advance(400 * kMs);
  Use();  // hit at 505 ms
  clock_.Advance(3000 * kMs);
  EXPECT_EQ(Residency().lifetime.count(), 0u);  // nothing evicted yet
  ASSERT_EQ(cache_->EvictCached(16), 2);        // at 3505 ms
  const BlockResidencyStats& r = Residency();
  EXPECT_EQ(r.sampled, 2u);
  EXPECT_EQ(r.lifetime.count(), 2u);
  EXPECT_DOUBLE_EQ(r.lifetime.sum(), 2 * 3.5);
  EXPECT_DOUBLE_EQ(r.idle_before_evict.sum(), 2 * 3.0);
  EXPECT_EQ(r.reuse_gap.count(), 2u);  // one gap (105 -> 505 ms) per block
  EXPECT_DOUBLE_EQ(r.reuse_gap.sum(), 2 * 0.4);
  ExpectBucket(r.lifetime, 3.5, 2);
}

TEST_F(ResidencyInPoolTest, OffByDefaultAndRejectedOutOfRange) {
  Make(0);
  Use();
  ASSERT_EQ(cache_->EvictCached(16), 2);
  EXPECT_EQ(Residency().sampled, 0u);
  EXPECT_EQ(Residency().lifetime.count(), 0u);
  for (const double bad : {-0.1, 1.5, std::nan("")}) {
    EXPECT_EQ(
        KvCacheManager::Create({.num_blocks = 4, .max_blocks_per_seq = 4, .residency_sample = bad})
            .status()
            .code(),
        absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

// Blocks released while device work is in flight RETIRE; the reclaim that finds their fences
// passed observes how long they waited.
class Fences final : public FenceObserver {
 public:
  bool HasPassed(Fence fence) const override { return done_ >= fence.value; }
  uint64_t done_ = 0;
};

TEST(FenceWaitTest, ReclaimObservesTheTimeSpentRetiring) {
  Fences fences;
  auto pool = BlockPool::Create({.num_blocks = 4, .fences = &fences});
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  const NamespaceSlot slot = *p.RegisterNamespace(NamespaceId(1));
  std::vector<BlockId> blocks;
  ASSERT_TRUE(p.Allocate(2, slot, TraceContext{.time_ns = 0}, &blocks, nullptr).ok());
  ASSERT_TRUE(p.MarkInFlight(blocks[0], Fence{0, 1}, TraceContext{}).ok());
  ASSERT_TRUE(p.Release(blocks[0], TraceContext{.time_ns = 10 * kMs}).ok());  // retires
  ASSERT_TRUE(p.Release(blocks[1], TraceContext{.time_ns = 10 * kMs}).ok());  // free at once
  EXPECT_EQ(p.ReclaimRetired(TraceContext{.time_ns = 20 * kMs}), 0);
  EXPECT_EQ(p.stats().fence_wait.count(), 0u);
  fences.done_ = 1;
  EXPECT_EQ(p.ReclaimRetired(TraceContext{.time_ns = 13 * kMs + 10 * kMs}), 1);
  const BlockPoolStats s = p.stats();
  EXPECT_EQ(s.fence_wait.count(), 1u);
  EXPECT_NEAR(s.fence_wait.sum(), 0.013, 1e-12);
  ExpectBucket(s.fence_wait, 0.013, 1);
}

}  // namespace
}  // namespace kvpool
