// TenantWriteBudget: shares by weight, the window the bytes count for, reservations, and a
// random run against a reference that keeps every write with its time. RedisEntryCost: what the
// budget counts per key (redis_budget_test checks it against a real server).

#include "tier/internal/tenant_write_budget.h"

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tier/internal/redis_memory.h"

namespace kvpool::tier::internal {
namespace {

constexpr int64_t kSecond = 1'000'000'000;
constexpr int64_t kWindow = 16 * kSecond;  // one bucket per second
constexpr uint64_t kA = 0xa;
constexpr uint64_t kB = 0xb;

// Reserves and settles (written) `bytes` for `tenant` at `now`; whether it fit.
bool Write(TenantWriteBudget& budget, uint64_t tenant, int64_t bytes, int64_t now) {
  const int32_t share = budget.Reserve(tenant, bytes, now);
  if (share < 0) return false;
  budget.Settle(share, bytes, true, now);
  return true;
}

int64_t Held(TenantWriteBudget& budget, uint64_t tenant, int64_t now) {
  return budget.HeldBytes(budget.ShareOf(tenant), now);
}

TEST(TenantWriteBudgetTest, AloneATenantMayUseAllOfItThenItsShareOnceAnotherWrites) {
  TenantWriteBudget budget(1200, kWindow, 4);
  ASSERT_TRUE(budget.SetWeight(kA, 1).ok());
  ASSERT_TRUE(budget.SetWeight(kB, 2).ok());
  // B has not written: A alone may use all of it.
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA), 0), 1200);
  EXPECT_TRUE(Write(budget, kA, 1000, 0));
  // B wants room: its share is 800, but only 200 are left in all (the total is never passed).
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kB), 0), 800);
  EXPECT_TRUE(Write(budget, kB, 200, 0));
  EXPECT_FALSE(Write(budget, kB, 1, 0));
  EXPECT_EQ(budget.Refused(budget.ShareOf(kB)), 1u);
  // A is past its share now (400): it writes nothing more.
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA), 0), 400);
  EXPECT_FALSE(Write(budget, kA, 1, kSecond));
  // A window later their writes have aged out; both still want room: each gets its share.
  const int64_t later = kSecond + kWindow;
  EXPECT_EQ(budget.TotalHeld(later), 0);
  EXPECT_TRUE(Write(budget, kB, 800, later));
  EXPECT_FALSE(Write(budget, kB, 1, later));
  EXPECT_TRUE(Write(budget, kA, 400, later));
  EXPECT_EQ(budget.TotalHeld(later), 1200);
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

TEST(TenantWriteBudgetTest, ARefusedWriteShrinksTheOthersSharesAtOnce) {
  TenantWriteBudget budget(1000, kWindow, 4);
  EXPECT_TRUE(Write(budget, kA, 1000, 0));  // A alone: all of it
  // A's bytes are about to age out; B asks first and is refused (nothing is free)...
  EXPECT_FALSE(Write(budget, kB, 100, kWindow));
  // ...but it is active now: A's share is half, so what ages out of A's goes to B, not back to A.
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA), kWindow), 500);
  const int64_t later = kWindow + kSecond;  // A's bytes gone
  EXPECT_EQ(budget.TotalHeld(later), 0);
  EXPECT_FALSE(Write(budget, kA, 600, later));
  EXPECT_TRUE(Write(budget, kB, 500, later));
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

TEST(TenantWriteBudgetTest, ATenantGoneQuietStopsCountingAWindowAfterItsLastWrite) {
  TenantWriteBudget budget(1000, kWindow, 4);
  ASSERT_TRUE(budget.SetWeight(kA, 1).ok());
  ASSERT_TRUE(budget.SetWeight(kB, 1).ok());
  EXPECT_TRUE(Write(budget, kA, 100, 0));
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kB), kSecond), 500);
  // A's bytes and its last ask are a window (and a bucket) old: nothing is set aside for it.
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kB), kWindow + kSecond), 1000);
  EXPECT_EQ(Held(budget, kA, kWindow + kSecond), 0);
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

TEST(TenantWriteBudgetTest, BytesCountForTheWholeWindowAndAtMostOneBucketMore) {
  TenantWriteBudget budget(100, kWindow, 4);
  const int64_t t0 = 3 * kSecond + kSecond / 2;  // mid-bucket
  ASSERT_TRUE(Write(budget, kA, 100, t0));
  // Redis may hold them until t0 + the window: they count until then...
  EXPECT_EQ(Held(budget, kA, t0 + kWindow - 1), 100);
  EXPECT_FALSE(Write(budget, kA, 1, t0 + kWindow - 1));
  EXPECT_EQ(Held(budget, kA, t0 + kWindow), 100);
  // ...and no longer than the end of their bucket plus the window.
  EXPECT_EQ(Held(budget, kA, 4 * kSecond + kWindow), 0);
  EXPECT_TRUE(Write(budget, kA, 100, 4 * kSecond + kWindow));
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

TEST(TenantWriteBudgetTest, ReservedBytesCountUntilSettledAndUnwrittenOnesComeBack) {
  TenantWriteBudget budget(100, kWindow, 4);
  const int32_t first = budget.Reserve(kA, 60, 0);
  ASSERT_GE(first, 0);
  EXPECT_LT(budget.Reserve(kA, 41, 0), 0);  // queued, not yet written: still counted
  EXPECT_LT(budget.Reserve(kB, 41, 0), 0);  // and in the total
  EXPECT_EQ(budget.Refused(first), 1u);
  budget.Settle(first, 60, false, kSecond);  // the key was there already: nothing stored
  EXPECT_EQ(Held(budget, kA, kSecond), 0);
  EXPECT_TRUE(Write(budget, kB, 50, kSecond));
  EXPECT_TRUE(Write(budget, kA, 50, kSecond));
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

TEST(TenantWriteBudgetTest, SharesAreBoundedAndWeightsChecked) {
  TenantWriteBudget budget(1000, kWindow, 2);
  EXPECT_TRUE(absl::IsInvalidArgument(budget.SetWeight(0, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(budget.SetWeight(kA, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(budget.SetWeight(kA, TenantWriteBudget::kMaxWeight + 1)));
  EXPECT_EQ(budget.num_shares(), 1);  // refusals made no share
  ASSERT_TRUE(budget.SetWeight(kA, 3).ok());
  ASSERT_TRUE(budget.SetWeight(kB, 1).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(budget.SetWeight(0xc, 1)));
  // A run of made-up tenants writes into the default share and grows nothing.
  for (uint64_t t = 100; t < 200; ++t) (void)Write(budget, t, 1, 0);
  EXPECT_EQ(budget.num_shares(), 3);
  EXPECT_EQ(budget.ShareOf(0xc), 0);
  EXPECT_EQ(budget.FindShare(0xd), -1);
  // Active: A once it writes, the default share (it wrote); B has not asked: 3 + 1.
  EXPECT_TRUE(Write(budget, kA, 1, 0));
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA), 0), 750);
  EXPECT_EQ(budget.BudgetOf(0, 0), 250);
  // B counts once it asks; a weight changes the divisor.
  (void)Write(budget, kB, 1, 0);
  ASSERT_TRUE(budget.SetWeight(kA, 8).ok());
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kB), 0), 100);
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

// The budget's rules spelled out over a list of every write and its time: four shares (the
// default and tenants 1..3), kTotal bytes, one window of kBuckets buckets.
struct Reference {
  static constexpr int64_t kTotal = 10'000;
  static constexpr int64_t kBuckets = TenantWriteBudget::kBuckets;
  static constexpr int64_t kBucket = kWindow / kBuckets;
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min() / 2;
  struct Written {
    int32_t share;
    int64_t epoch;
    int64_t bytes;
  };
  struct Pending {
    int32_t share;
    int64_t bytes;
  };
  std::vector<Written> written;
  std::vector<Pending> pending;
  std::vector<int64_t> weight = std::vector<int64_t>(4, 1);
  std::vector<int64_t> asked = std::vector<int64_t>(4, kNever);  // epoch of the last ask
  int64_t now = 0;

  int64_t Oldest() const { return now / kBucket - kBuckets; }
  int64_t Held(int32_t share) const {
    int64_t sum = 0;
    for (const Written& w : written) {
      if (w.share == share && w.epoch >= Oldest()) sum += w.bytes;
    }
    for (const Pending& p : pending) {
      if (p.share == share) sum += p.bytes;
    }
    return sum;
  }
  int64_t Total() const {
    int64_t sum = 0;
    for (int32_t s = 0; s < 4; ++s) sum += Held(s);
    return sum;
  }
  int64_t BudgetOf(int32_t share) const {
    int64_t weights = 0;
    for (int32_t s = 0; s < 4; ++s) {
      if (s == share || asked[s] >= Oldest() || Held(s) > 0) weights += weight[s];
    }
    return kTotal * weight[share] / weights;
  }
  bool Fits(int32_t share, int64_t bytes) const {
    return Held(share) + bytes <= BudgetOf(share) && Total() + bytes <= kTotal;
  }
};

// Random writes, settles and weights against the Reference, with tenants coming and going: held
// bytes and budgets always match, each write is refused exactly when it would pass its share's
// budget or the total, and the shares never hold more than the total.
TEST(TenantWriteBudgetTest, RandomRunMatchesAReference) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    TenantWriteBudget budget(Reference::kTotal, kWindow, 3);
    for (uint64_t t = 1; t <= 3; ++t) ASSERT_EQ(budget.ShareOf(t), static_cast<int32_t>(t));
    const std::vector<uint64_t> tenants = {0, 1, 2, 3, 4};  // 4 goes to the default share
    Reference ref;
    for (int step = 0; step < 6000; ++step) {
      ref.now += std::uniform_int_distribution<int64_t>(0, kSecond / 2)(rng);
      if (step % 1000 == 999) ref.now += kWindow;  // everyone quiet a while
      const uint64_t tenant = tenants[rng() % (step % 2000 < 1000 ? 5 : 3)];  // 3, 4 come and go
      const int op = static_cast<int>(rng() % 12);
      if (op == 0) {
        const auto t = static_cast<uint64_t>(1 + rng() % 3);
        const auto w = static_cast<int32_t>(1 + rng() % 5);
        ASSERT_TRUE(budget.SetWeight(t, w).ok());
        ref.weight[t] = w;
      } else if (op < 7) {
        const int64_t bytes = std::uniform_int_distribution<int64_t>(1, 900)(rng);
        const int32_t share = budget.ShareOf(tenant);
        const bool fits = ref.Fits(share, bytes);
        const int32_t got = budget.Reserve(tenant, bytes, ref.now);
        ASSERT_EQ(got >= 0, fits) << "step " << step;
        ref.asked[share] = ref.now / Reference::kBucket;
        if (got >= 0) ref.pending.push_back({got, bytes});
      } else if (!ref.pending.empty()) {
        const size_t i = rng() % ref.pending.size();
        const Reference::Pending p = ref.pending[i];
        const bool stored = rng() % 4 != 0;
        budget.Settle(p.share, p.bytes, stored, ref.now);
        if (stored) ref.written.push_back({p.share, ref.now / Reference::kBucket, p.bytes});
        ref.pending.erase(ref.pending.begin() + static_cast<ptrdiff_t>(i));
      }
      for (int32_t s = 0; s < 4; ++s) {
        ASSERT_EQ(budget.HeldBytes(s, ref.now), ref.Held(s)) << "step " << step << " share " << s;
        ASSERT_EQ(budget.BudgetOf(s, ref.now), ref.BudgetOf(s)) << "step " << step;
      }
      ASSERT_LE(ref.Total(), Reference::kTotal);
      ASSERT_EQ(budget.TotalHeld(ref.now), ref.Total());
      ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
    }
    EXPECT_EQ(budget.num_shares(), 4);  // tenant 4 found no share of its own
  }
}

// jemalloc's size classes (its documentation's table): four per doubling past 128 bytes.
TEST(RedisEntryCostTest, SizeClassesAreJemallocs) {
  const std::pair<int64_t, int64_t> cases[] = {{1, 8},
                                               {8, 8},
                                               {9, 16},
                                               {17, 32},
                                               {100, 112},
                                               {128, 128},
                                               {129, 160},
                                               {161, 192},
                                               {256, 256},
                                               {257, 320},
                                               {1000, 1024},
                                               {1025, 1280},
                                               {4096, 4096},
                                               {4192, 5120},
                                               {5121, 6144},
                                               {65536, 65536},
                                               {65632, 81920},
                                               {81921, 98304},
                                               {1 << 20, 1 << 20},
                                               {(1 << 20) + 1, (1 << 20) + (1 << 18)}};
  for (const auto& [bytes, size_class] : cases) {
    EXPECT_EQ(JemallocSizeClass(bytes), size_class) << bytes;
  }
  for (int64_t bytes = 1; bytes < (1 << 17); bytes += 7) {
    const int64_t c = JemallocSizeClass(bytes);
    ASSERT_GE(c, bytes);
    ASSERT_LE(c, bytes + bytes / 4 + 8) << bytes;  // never more than a quarter over (and 8 B)
  }
}

TEST(RedisEntryCostTest, AKeyCostsItsRoundedStringsAndItsEntries) {
  // A 4 KiB block's value (96-byte header, 5-byte SDS header, NUL) and a 44-byte key.
  EXPECT_EQ(ModeledEntryBytes(44, 4192), 5120 + 48 + kRedisPerKeyBytes);
  EXPECT_GT(ModeledEntryBytes(44, 4192), 44 + 4192 + 1000);  // what counting bytes sent misses
  RedisEntryCost cost;
  EXPECT_TRUE(cost.Unmeasured(4192));
  EXPECT_EQ(cost.Of(44, 4192), ModeledEntryBytes(44, 4192));
  // A server that says less than the model: the model (its upper bound for Redis 7) holds.
  cost.Measured(4192, 5120 + 48 + 16 + 24);
  EXPECT_FALSE(cost.Unmeasured(4192));
  EXPECT_EQ(cost.Of(44, 4192), ModeledEntryBytes(44, 4192));
  // One that says more (another allocator, other objects): what it says, and what MEMORY USAGE
  // leaves out.
  cost.Measured(608, 2000);
  EXPECT_EQ(cost.Of(44, 608), 2000 + kRedisUnreportedPerKeyBytes);
  // One that will not say: the model, and the length is not asked again.
  cost.Measured(1000, -1);
  EXPECT_FALSE(cost.Unmeasured(1000));
  EXPECT_EQ(cost.Of(44, 1000), ModeledEntryBytes(44, 1000));
  // A first answer stays.
  cost.Measured(608, 100);
  EXPECT_EQ(cost.Of(44, 608), 2000 + kRedisUnreportedPerKeyBytes);
  // Lengths past kMaxMeasured are not measured (a bounded map).
  for (int64_t len = 0; len < static_cast<int64_t>(RedisEntryCost::kMaxMeasured); ++len) {
    cost.Measured(10'000 + len, 1);
  }
  EXPECT_FALSE(cost.Unmeasured(123'456));
}

}  // namespace
}  // namespace kvpool::tier::internal
