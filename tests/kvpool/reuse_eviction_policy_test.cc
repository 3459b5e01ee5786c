// The reuse model's estimates and the reuse policy's choices.

#include "kvpool/reuse_eviction_policy.h"

#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;

constexpr int64_t kSecond = 1'000'000'000;
constexpr int64_t kHorizon = 120 * kSecond;

NodeFacts Facts(uint64_t hash, uint64_t seq, int64_t released_ns) {
  return NodeFacts{.fingerprint = BlockFingerprint(BlockHash{hash, hash + 1}),
                   .depth = 1,
                   .released_ns = released_ns,
                   .release_seq = seq};
}

std::vector<NodeIndex> Order(const EvictionPolicy& policy, int64_t now_ns) {
  std::vector<NodeIndex> out;
  policy.Visit(now_ns, [&](NodeIndex node, const EvictionRank&) {
    out.push_back(node);
    return true;
  });
  return out;
}

TEST(ReuseModelTest, BucketsAreHalfOctavesOfSeconds) {
  EXPECT_EQ(ReuseModel::BucketOf(0), 0);
  EXPECT_EQ(ReuseModel::BucketOf(kSecond - 1), 0);
  EXPECT_EQ(ReuseModel::BucketOf(kSecond), 1);
  EXPECT_EQ(ReuseModel::BucketOf(kSecond * 14 / 10), 1);  // below sqrt(2) s
  EXPECT_EQ(ReuseModel::BucketOf(kSecond * 15 / 10), 2);
  EXPECT_EQ(ReuseModel::BucketOf(2 * kSecond), 3);
  EXPECT_EQ(ReuseModel::BucketOf(int64_t{1} << 62), ReuseModel::kNumAgeBuckets - 1);
  for (int b = 1; b < ReuseModel::kNumAgeBuckets; ++b) {
    EXPECT_EQ(ReuseModel::BucketOf(ReuseModel::BucketStartNs(b)), b);
    EXPECT_EQ(ReuseModel::BucketOf(ReuseModel::BucketStartNs(b) - 1), b - 1);
  }
}

TEST(ReuseModelTest, WithoutDataEveryEstimateIsZero) {
  const ReuseModel model(kHorizon);
  for (int c = 0; c < ReuseModel::kNumClasses; ++c) {
    EXPECT_EQ(model.Estimate(c, 0), 0);
    EXPECT_EQ(model.Estimate(c, 1000 * kSecond), 0);
  }
}

TEST(ReuseModelTest, EstimatesReuseWithinTheHorizonFromGapsAndForgottenBlocks) {
  ReuseModel model(kHorizon);
  // Class 1: half the blocks come back after ~10 s, half are forgotten unreused after 20 min.
  // Class 0: every block is forgotten unreused.
  for (int i = 0; i < 1024; ++i) {
    model.RecordReuse(1, 10 * kSecond, 0);
    model.RecordCensored(1, 1200 * kSecond, 0);
    model.RecordCensored(0, 1200 * kSecond, 0);
  }
  EXPECT_NEAR(model.Estimate(1, 0), 0.5, 0.01);
  EXPECT_NEAR(model.Estimate(1, 5 * kSecond), 0.5, 0.01);
  EXPECT_NEAR(model.Estimate(1, 60 * kSecond), 0.0, 0.01);  // idle past the gap: gone for good
  EXPECT_EQ(model.Estimate(0, 0), 0);
  EXPECT_EQ(model.reuses(), 1024u);
  EXPECT_EQ(model.censored(), 2048u);
}

TEST(ReuseModelTest, EstimatesNeverRiseWithAge) {
  ReuseModel model(kHorizon);
  std::mt19937_64 rng(9);
  for (int i = 0; i < 20'000; ++i) {
    const int c = static_cast<int>(rng() % ReuseModel::kNumClasses);
    const int64_t age = static_cast<int64_t>(rng() % (2000 * kSecond));
    if (rng() % 3 == 0) {
      model.RecordCensored(c, age, 0);
    } else {
      model.RecordReuse(c, age, 0);
    }
  }
  for (int c = 0; c < ReuseModel::kNumClasses; ++c) {
    double previous = 1;
    for (int b = 0; b < ReuseModel::kNumAgeBuckets; ++b) {
      const double p = model.Estimate(c, ReuseModel::BucketStartNs(b));
      EXPECT_GE(p, 0);
      EXPECT_LE(p, previous) << "class " << c << " bucket " << b;
      previous = p;
    }
  }
}

TEST(ReuseModelTest, OldEvidenceFadesByTheClock) {
  ReuseModel model(kHorizon);
  for (int i = 0; i < 1024; ++i) model.RecordReuse(2, 5 * kSecond, 0);  // at t = 0
  EXPECT_NEAR(model.Estimate(2, 0), 1.0, 1e-9);
  // Twenty minutes later (two halvings), as many blocks are forgotten unreused: the recent
  // evidence now weighs four times the old.
  const int64_t later = 2 * ReuseModel::kDecayNs;
  for (int i = 0; i < 1024; ++i) model.RecordCensored(2, 1200 * kSecond, later);
  EXPECT_NEAR(model.Estimate(2, 0), 0.2, 0.01);  // 256 / (256 + 1024)
}

class ReuseEvictionPolicyTest : public ::testing::Test {
 protected:
  ReuseEvictionPolicyTest() : policy_(kHorizon, /*history_blocks=*/64) { policy_.Reserve(32); }

  // Teaches the model that class-`cls` blocks come back within seconds (or never).
  void Teach(int cls, bool comes_back) {
    ReuseModel* model = policy_.mutable_model();
    for (int i = 0; i < 512; ++i) {  // a multiple of kRebuildEvents: the table is current
      if (comes_back) {
        model->RecordReuse(cls, 3 * kSecond, now_);
      } else {
        model->RecordCensored(cls, 1000 * kSecond, now_);
      }
    }
  }

  ReuseEvictionPolicy policy_;
  int64_t now_ = 1000 * kSecond;
};

TEST_F(ReuseEvictionPolicyTest, WithoutEvidenceItIsLru) {
  for (NodeIndex n = 0; n < 4; ++n) {
    policy_.OnInsert(n, Facts(static_cast<uint64_t>(n + 1), 0, now_), now_);
  }
  policy_.Add(2, Facts(3, 1, now_));
  policy_.Add(0, Facts(1, 2, now_ + 1));
  policy_.Add(3, Facts(4, 3, now_ + 2));
  EXPECT_THAT(Order(policy_, now_ + 10), ElementsAre(2, 0, 3));
}

TEST_F(ReuseEvictionPolicyTest, EvictsTheClassLeastLikelyToComeBackFirst) {
  Teach(0, /*comes_back=*/false);
  Teach(1, /*comes_back=*/true);
  policy_.OnInsert(0, Facts(1, 0, now_), now_);  // class 0
  policy_.OnInsert(1, Facts(2, 0, now_), now_);
  policy_.OnHit(1, Facts(2, 0, now_), now_ + kSecond);  // reused once: class 1
  EXPECT_EQ(policy_.reuse_count(1), 1u);
  policy_.Add(1, Facts(2, 1, now_ + kSecond));  // older
  policy_.Add(0, Facts(1, 2, now_ + 2 * kSecond));
  EXPECT_THAT(Order(policy_, now_ + 3 * kSecond), ElementsAre(0, 1));
  EXPECT_LT(policy_.Rank(0, Facts(1, 2, now_ + 2 * kSecond), now_ + 3 * kSecond),
            policy_.Rank(1, Facts(2, 1, now_ + kSecond), now_ + 3 * kSecond));
}

TEST_F(ReuseEvictionPolicyTest, ReuseCountOutlivesEviction) {
  policy_.OnInsert(5, Facts(77, 0, now_), now_);
  policy_.OnHit(5, Facts(77, 0, now_), now_ + kSecond);
  policy_.OnHit(5, Facts(77, 0, now_), now_ + 2 * kSecond);
  policy_.OnErase(5, Facts(77, 0, now_), now_ + 3 * kSecond);
  const uint64_t reuses = policy_.model().reuses();
  policy_.OnInsert(6, Facts(77, 0, now_), now_ + 40 * kSecond);  // the same content again
  EXPECT_EQ(policy_.reuse_count(6), 3u);
  EXPECT_EQ(policy_.model().reuses(), reuses + 1);  // its 38 s gap was recorded
}

TEST_F(ReuseEvictionPolicyTest, ForgottenBlocksAreCountedAsNotReused) {
  // The history holds 64 evicted blocks; the 65th forgets the first, unreused.
  for (NodeIndex n = 0; n < 65; ++n) {
    const NodeIndex node = n % 32;
    policy_.OnInsert(node, Facts(static_cast<uint64_t>(1000 + n), 0, now_), now_);
    policy_.OnErase(node, Facts(static_cast<uint64_t>(1000 + n), 0, now_), now_);
  }
  EXPECT_EQ(policy_.model().censored(), 1u);
  // A partial node (no hash) cannot be remembered: it is counted at once.
  policy_.OnInsert(0, NodeFacts{}, now_);
  policy_.OnErase(0, NodeFacts{}, now_ + kSecond);
  EXPECT_EQ(policy_.model().censored(), 2u);
}

}  // namespace
}  // namespace kvpool
