// TenantWriteBudget: shares by weight, the window the bytes count for, reservations, and a
// random run against a reference that keeps every write with its time.

#include "tier/internal/tenant_write_budget.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

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

TEST(TenantWriteBudgetTest, SharesSplitTheTotalByWeightAmongTheTenantsInUse) {
  TenantWriteBudget budget(1200, kWindow, 4);
  // Alone, a tenant may use all of it.
  ASSERT_TRUE(budget.SetWeight(kA, 1).ok());
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA)), 1200);
  // A second tenant's session opens at weight 2: A keeps a third.
  ASSERT_TRUE(budget.SetWeight(kB, 2).ok());
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA)), 400);
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kB)), 800);
  EXPECT_TRUE(Write(budget, kA, 400, 0));
  EXPECT_FALSE(Write(budget, kA, 1, 0));
  EXPECT_EQ(budget.Refused(kA), 1u);
  EXPECT_TRUE(Write(budget, kB, 800, 0));
  EXPECT_FALSE(Write(budget, kB, 1, 0));
  // Untagged writes are the default share's; it counts (weight 1) once it writes.
  EXPECT_EQ(budget.BudgetOf(0), 1200 / 4);
  EXPECT_TRUE(Write(budget, 0, 300, 0));
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA)), 300);
  // A is over its new budget now: it writes nothing until its bytes age out.
  EXPECT_FALSE(Write(budget, kA, 1, kSecond));
  EXPECT_EQ(budget.LiveBytes(kA, kSecond), 400);
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

TEST(TenantWriteBudgetTest, BytesCountForTheWholeWindowAndAtMostOneBucketMore) {
  TenantWriteBudget budget(100, kWindow, 4);
  ASSERT_TRUE(budget.SetWeight(kA, 1).ok());
  const int64_t t0 = 3 * kSecond + kSecond / 2;  // mid-bucket
  ASSERT_TRUE(Write(budget, kA, 100, t0));
  // Redis may hold them until t0 + the window: they count until then...
  EXPECT_EQ(budget.LiveBytes(kA, t0 + kWindow - 1), 100);
  EXPECT_FALSE(Write(budget, kA, 1, t0 + kWindow - 1));
  EXPECT_EQ(budget.LiveBytes(kA, t0 + kWindow), 100);
  // ...and no longer than the end of their bucket plus the window.
  EXPECT_EQ(budget.LiveBytes(kA, 4 * kSecond + kWindow), 0);
  EXPECT_TRUE(Write(budget, kA, 100, 4 * kSecond + kWindow));
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

TEST(TenantWriteBudgetTest, ReservedBytesCountUntilSettledAndUnwrittenOnesComeBack) {
  TenantWriteBudget budget(100, kWindow, 4);
  ASSERT_TRUE(budget.SetWeight(kA, 1).ok());
  const int32_t first = budget.Reserve(kA, 60, 0);
  ASSERT_GE(first, 0);
  EXPECT_LT(budget.Reserve(kA, 41, 0), 0);  // queued, not yet written: still counted
  EXPECT_EQ(budget.Refused(kA), 1u);
  budget.Settle(first, 60, false, kSecond);  // the key was there already: nothing stored
  EXPECT_EQ(budget.LiveBytes(kA, kSecond), 0);
  EXPECT_TRUE(Write(budget, kA, 100, kSecond));
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
  // Default share in use at weight 1: 3 + 1 + 1.
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kA)), 600);
  EXPECT_EQ(budget.BudgetOf(0), 200);
  // Changing a weight in use changes the divisor.
  ASSERT_TRUE(budget.SetWeight(kA, 8).ok());
  EXPECT_EQ(budget.BudgetOf(budget.ShareOf(kB)), 100);
  ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
}

// Random writes, settles and weights against a reference that keeps every written byte with its
// bucket: live bytes always match, each write is refused exactly when it would pass its share's
// budget, and one window (plus a bucket) after the shares in use last changed, their live bytes
// add up to at most the total.
TEST(TenantWriteBudgetTest, RandomRunMatchesAReference) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    constexpr int64_t kTotal = 10'000;
    TenantWriteBudget budget(kTotal, kWindow, 3);
    for (uint64_t t = 1; t <= 3; ++t) ASSERT_EQ(budget.ShareOf(t), static_cast<int32_t>(t));
    const std::vector<uint64_t> tenants = {0, 1, 2, 3, 4};  // 4 goes to the default share
    struct Written {
      int32_t share;
      int64_t epoch;
      int64_t bytes;
    };
    std::vector<Written> written;
    struct Pending {
      int32_t share;
      int64_t bytes;
    };
    std::vector<Pending> pending;
    int64_t now = 0;
    const int64_t bucket = kWindow / TenantWriteBudget::kBuckets;
    auto live = [&](int32_t share) {
      int64_t sum = 0;
      for (const Written& w : written) {
        if (w.share == share && w.epoch >= now / bucket - TenantWriteBudget::kBuckets) {
          sum += w.bytes;
        }
      }
      for (const Pending& p : pending) {
        if (p.share == share) sum += p.bytes;
      }
      return sum;
    };
    bool weights_set = false;
    std::vector<bool> in_use(4, false);
    int64_t changed = 0;  // when the shares in use or their weights last changed
    for (int step = 0; step < 4000; ++step) {
      now += std::uniform_int_distribution<int64_t>(0, kSecond / 2)(rng);
      const uint64_t tenant = tenants[rng() % tenants.size()];
      const int op = static_cast<int>(rng() % 10);
      if (op == 0 && !weights_set && step > 100) {
        // Once, mid-run: every tenant's share exists by now.
        for (uint64_t t = 1; t <= 3; ++t) {
          ASSERT_TRUE(budget.SetWeight(t, static_cast<int32_t>(t)).ok());
        }
        weights_set = true;
        changed = now;
      } else if (op < 6) {
        const int64_t bytes = std::uniform_int_distribution<int64_t>(1, 700)(rng);
        const int32_t share = budget.ShareOf(tenant);
        const bool fits = live(share) + bytes <= budget.BudgetOf(share);
        const int32_t got = budget.Reserve(tenant, bytes, now);
        ASSERT_EQ(got >= 0, fits);
        if (got >= 0) {
          pending.push_back({got, bytes});
          if (!in_use[static_cast<size_t>(got)]) changed = now;
          in_use[static_cast<size_t>(got)] = true;
        }
      } else if (!pending.empty()) {
        const size_t i = rng() % pending.size();
        const bool stored = rng() % 4 != 0;
        budget.Settle(pending[i].share, pending[i].bytes, stored, now);
        if (stored) written.push_back({pending[i].share, now / bucket, pending[i].bytes});
        pending.erase(pending.begin() + static_cast<ptrdiff_t>(i));
      }
      int64_t sum = 0;
      for (uint64_t t : {uint64_t{1}, uint64_t{2}, uint64_t{3}}) {
        const int32_t share = budget.FindShare(t);
        if (share < 0) continue;
        ASSERT_EQ(budget.LiveBytes(t, now), live(share));
        sum += live(share);
      }
      sum += live(0);
      // Within one window of a change, bytes written under the old shares may exceed the new.
      if (now >= changed + kWindow + bucket) {
        ASSERT_LE(sum, kTotal);
      }
      ASSERT_TRUE(budget.CheckInvariants().ok()) << budget.CheckInvariants();
    }
    EXPECT_EQ(budget.num_shares(), 4);  // tenant 4 found no share of its own
  }
}

}  // namespace
}  // namespace kvpool::tier::internal
