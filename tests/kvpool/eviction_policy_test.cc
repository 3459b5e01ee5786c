// Eviction policies on their own: spec parsing, the ghost history, LRU and the admission filter,
// and a seeded randomized test of every policy against a reference: after every step the policy's
// books balance (CheckInvariants) and Visit() yields exactly the candidates, in Rank order (the
// order PrefixCache::PlanEviction relies on when it merges in freed parents).

#include "kvpool/eviction_policy.h"

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/admission_filter.h"
#include "kvpool/internal/fifo_history.h"
#include "kvpool/lru_eviction_policy.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kSecond = 1'000'000'000;

BlockHash Hash(uint64_t n) { return BlockHash{n, n * 7 + 1}; }

NodeFacts Facts(uint64_t hash, int priority, uint64_t seq, int64_t released_ns = 0) {
  return NodeFacts{.fingerprint = hash == 0 ? 0 : BlockFingerprint(Hash(hash)),
                   .depth = 1,
                   .priority = priority,
                   .released_ns = released_ns,
                   .release_seq = seq};
}

std::vector<NodeIndex> Order(const EvictionPolicy& policy, int64_t now_ns = 0) {
  std::vector<NodeIndex> out;
  policy.Visit(now_ns, [&](NodeIndex node, const EvictionRank&) {
    out.push_back(node);
    return true;
  });
  return out;
}

TEST(EvictionSpecTest, ParsesPoliciesAndModifiers) {
  for (const char* spec : {"lru", "lru+admit", "lru+notail", "lru+admit+notail", "reuse",
                           "reuse+admit", "reuse+notail", "reuse+admit+notail"}) {
    const absl::StatusOr<EvictionOptions> options = ParseEvictionSpec(spec);
    ASSERT_TRUE(options.ok()) << spec << ": " << options.status();
    EXPECT_EQ(EvictionSpecName(*options), spec);
  }
  const absl::StatusOr<EvictionOptions> lru = ParseEvictionSpec("lru");
  EXPECT_TRUE(lru->retain_partial_tails);  // plain "lru" is the order kvpool always had
  EXPECT_FALSE(lru->admission);
  EXPECT_EQ(EvictionSpecName(*ParseEvictionSpec("default")), kDefaultEvictionSpec);
  EXPECT_EQ(EvictionSpecName(*ParseEvictionSpec("lru+notail+admit")), "lru+admit+notail");
}

TEST(EvictionSpecTest, RejectsUnknownOrRepeatedParts) {
  for (const char* spec : {"", "lfu", "lru+", "lru+admit+admit", "lru+fast", "+admit", "LRU"}) {
    const absl::StatusOr<EvictionOptions> options = ParseEvictionSpec(spec);
    EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument) << spec;
  }
  EXPECT_THAT(std::string(ParseEvictionSpec("lfu").status().message()), HasSubstr("'lfu'"));
  EXPECT_EQ(MakeEvictionPolicy("nope").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MakeEvictionPolicy("reuse+admit").ok());
}

TEST(EvictionSpecTest, MakeRejectsBadSizes) {
  EXPECT_EQ(MakeEvictionPolicy(EvictionOptions{}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeEvictionPolicy(EvictionOptions{.history_blocks = -1}, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeEvictionPolicy(
                EvictionOptions{.kind = EvictionPolicyKind::kReuse, .reuse_horizon_ns = 0}, 8)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FifoHistoryTest, ForgetsTheOldestPutOnceFull) {
  internal::FifoHistory<int> history(3);
  EXPECT_FALSE(history.Put(1, 10));
  EXPECT_FALSE(history.Put(2, 20));
  EXPECT_FALSE(history.Put(3, 30));
  const auto forgotten = history.Put(4, 40);
  ASSERT_TRUE(forgotten);
  EXPECT_EQ(forgotten->first, 1u);
  EXPECT_EQ(forgotten->second, 10);
  EXPECT_EQ(history.Find(1), nullptr);
  EXPECT_EQ(*history.Find(4), 40);
  EXPECT_EQ(history.size(), 3u);
}

TEST(FifoHistoryTest, RePutMovesAKeyToTheNewestPlace) {
  internal::FifoHistory<int> history(3);
  history.Put(1, 10);
  history.Put(2, 20);
  history.Put(1, 11);  // 1 is now the newest; its first slot is stale
  history.Put(3, 30);  // reuses the stale slot: nothing forgotten
  EXPECT_EQ(history.size(), 3u);
  const auto forgotten = history.Put(4, 40);  // 2 is the oldest now
  ASSERT_TRUE(forgotten);
  EXPECT_EQ(forgotten->first, 2u);
  EXPECT_EQ(*history.Find(1), 11);
}

TEST(FifoHistoryTest, ErasedKeysLeaveStaleSlotsBehind) {
  internal::FifoHistory<int> history(2);
  history.Put(1, 10);
  EXPECT_TRUE(history.Erase(1));
  EXPECT_FALSE(history.Erase(1));
  history.Put(2, 20);
  EXPECT_FALSE(history.Put(3, 30));  // overwrites 1's stale slot: nothing to forget
  EXPECT_EQ(history.size(), 2u);
}

// Touch is Find, then Put, in one probe fewer: the same answers and the same history after every
// step of a random mix of touches, puts and erases over few keys (the ring wraps onto the key
// being touched, live or stale, often).
TEST(FifoHistoryTest, TouchIsFindThenPut) {
  std::mt19937 rng(7);
  for (const size_t capacity : {1, 2, 3, 8}) {
    internal::FifoHistory<int> touched(capacity);
    internal::FifoHistory<int> reference(capacity);
    for (int step = 0; step < 4000; ++step) {
      const uint64_t key = 1 + rng() % 6;
      const int value = step;
      switch (rng() % 4) {
        case 0:
          ASSERT_EQ(touched.Erase(key), reference.Erase(key)) << step;
          break;
        case 1:
          touched.Put(key, value);
          reference.Put(key, value);
          break;
        default: {
          const bool seen = reference.Find(key) != nullptr;
          reference.Put(key, value);
          ASSERT_EQ(touched.Touch(key, value), seen) << "step " << step << " key " << key;
        }
      }
      ASSERT_EQ(touched.size(), reference.size()) << step;
      for (uint64_t k = 1; k <= 6; ++k) {
        const int* a = touched.Find(k);
        const int* b = reference.Find(k);
        ASSERT_EQ(a == nullptr, b == nullptr) << "step " << step << " key " << k;
        if (a != nullptr) {
          ASSERT_EQ(*a, *b);
        }
      }
    }
  }
}

TEST(LruEvictionPolicyTest, OrdersByClassThenRelease) {
  LruEvictionPolicy lru;
  lru.Reserve(8);
  lru.Add(0, Facts(1, /*priority=*/1, /*seq=*/1));
  lru.Add(1, Facts(2, 0, 5));
  lru.Add(2, Facts(3, 0, 3));
  lru.Add(3, Facts(4, 2, 2));
  EXPECT_THAT(Order(lru), ElementsAre(2, 1, 0, 3));
  lru.Remove(2, Facts(3, 0, 3));
  EXPECT_THAT(Order(lru), ElementsAre(1, 0, 3));
  EXPECT_EQ(lru.size(), 3);
  EXPECT_FALSE(lru.Contains(2));
  EXPECT_EQ(lru.Rank(1, Facts(2, 0, 5), 0), (EvictionRank{.priority = 0, .order = 5}));
  EXPECT_TRUE(lru.CheckInvariants().ok());
}

TEST(LruEvictionPolicyTest, VisitStopsWhenAsked) {
  LruEvictionPolicy lru;
  lru.Reserve(4);
  for (NodeIndex n = 0; n < 4; ++n) lru.Add(n, Facts(n + 1, 0, static_cast<uint64_t>(n + 1)));
  int visited = 0;
  lru.Visit(0, [&](NodeIndex, const EvictionRank&) { return ++visited < 2; });
  EXPECT_EQ(visited, 2);
}

class AdmissionFilterTest : public ::testing::Test {
 protected:
  AdmissionFilterTest() : filter_(std::make_unique<LruEvictionPolicy>(), /*history_blocks=*/3) {
    filter_.Reserve(16);
  }
  AdmissionFilter filter_;
};

TEST_F(AdmissionFilterTest, UnseenBlocksGoFirstSeenOnesFollowTheInnerOrder) {
  filter_.OnInsert(0, Facts(1, 0, 0), 0);  // never seen: probation
  filter_.OnErase(0, Facts(1, 0, 0), 0);
  filter_.OnInsert(1, Facts(1, 0, 0), 0);  // the same content again: admitted
  filter_.OnInsert(2, Facts(2, 0, 0), 0);  // unseen
  EXPECT_TRUE(filter_.admitted(1));
  EXPECT_FALSE(filter_.admitted(2));
  filter_.Add(1, Facts(1, 0, 1));
  filter_.Add(2, Facts(2, 0, 2));
  EXPECT_THAT(Order(filter_), ElementsAre(2, 1));  // the younger unseen block goes first
  EXPECT_EQ(filter_.Rank(2, Facts(2, 0, 2), 0).score, -1);
  EXPECT_TRUE(filter_.CheckInvariants().ok());
}

TEST_F(AdmissionFilterTest, AHitAdmits) {
  filter_.OnInsert(0, Facts(5, 0, 0), 0);
  EXPECT_FALSE(filter_.admitted(0));
  filter_.OnHit(0, Facts(5, 0, 0), 0);
  EXPECT_TRUE(filter_.admitted(0));
}

TEST_F(AdmissionFilterTest, PriorityClassComesBeforeAdmission) {
  filter_.OnInsert(0, Facts(7, 1, 0), 0);  // unseen, class 1
  filter_.OnInsert(1, Facts(8, 0, 0), 0);
  filter_.OnHit(1, Facts(8, 0, 0), 0);  // admitted, class 0
  filter_.Add(0, Facts(7, 1, 1));
  filter_.Add(1, Facts(8, 0, 2));
  EXPECT_THAT(Order(filter_), ElementsAre(1, 0));
}

TEST_F(AdmissionFilterTest, ForgetsContentBeyondItsHistory) {
  for (uint64_t h = 1; h <= 4; ++h) {  // four accesses: the first is forgotten
    filter_.OnInsert(static_cast<NodeIndex>(h), Facts(h, 0, 0), 0);
  }
  filter_.OnInsert(9, Facts(1, 0, 0), 0);
  EXPECT_FALSE(filter_.admitted(9));
  filter_.OnInsert(10, Facts(4, 0, 0), 0);
  EXPECT_TRUE(filter_.admitted(10));
}

TEST_F(AdmissionFilterTest, PartialNodesAreAdmittedOnlyByAHit) {
  filter_.OnInsert(0, Facts(0, 0, 0), 0);  // hash zero: a partial node
  filter_.OnInsert(1, Facts(0, 0, 0), 0);
  EXPECT_FALSE(filter_.admitted(1));
  filter_.OnHit(1, Facts(0, 0, 0), 0);
  EXPECT_TRUE(filter_.admitted(1));
}

// Drives a policy the way the cache does, at random: inserts, releases (Add), leaves that come
// back with their old release, hits, erasures and locks (Remove), over a few nodes. Keeps the
// reference: every live node's facts and which ones are candidates. A `twin`, when given, gets
// the same Add and Remove calls and no access event.
class RandomPolicyDriver {
 public:
  static constexpr NodeIndex kNodes = 48;

  RandomPolicyDriver(EvictionPolicy* policy, EvictionPolicy* twin) : policy_(policy), twin_(twin) {
    policy_->Reserve(kNodes);
    if (twin_ != nullptr) twin_->Reserve(kNodes);
  }

  void Step() {
    now_ += static_cast<int64_t>(rng_() % (3 * kSecond));
    const NodeIndex node = static_cast<NodeIndex>(rng_() % kNodes);
    const bool alive = live_.contains(node);
    const bool held = alive && candidate_[node];
    const uint64_t dice = rng_() % 100;
    if (!alive) {  // insert: a small set of hashes so that content comes back
      live_[node] = Facts(rng_() % 4 == 0 ? 0 : 1 + rng_() % 40, static_cast<int>(rng_() % 2), 0);
      candidate_[node] = false;
      touched_[node] = true;
      policy_->OnInsert(node, live_[node], now_);
    } else if (!held && dice < 50) {  // released: a candidate (the cache stamps the facts)
      live_[node].released_ns = now_;
      live_[node].release_seq = ++seq_;
      Add(node);
      touched_[node] = false;
    } else if (!held && dice < 60 && live_[node].release_seq != 0 && !touched_[node]) {
      // A leaf again with its old release (a parent whose last child was evicted): it may
      // belong anywhere in the order, not just at the back. (Only if nothing used it since:
      // a use locks a node, and its next release stamps it anew.)
      Add(node);
    } else if (!held && dice < 75) {
      ++live_[node].hits;
      policy_->OnHit(node, live_[node], now_);
      touched_[node] = true;
    } else if (!held) {
      policy_->OnErase(node, live_[node], now_);
      live_.erase(node);
      candidate_.erase(node);
    } else {  // locked again
      policy_->Remove(node, live_[node]);
      if (twin_ != nullptr) twin_->Remove(node, live_[node]);
      candidate_[node] = false;
    }
  }

  int64_t now() const { return now_; }
  const NodeFacts& facts(NodeIndex node) const { return live_.at(node); }
  const std::map<NodeIndex, bool>& candidate() const { return candidate_; }

 private:
  void Add(NodeIndex node) {
    policy_->Add(node, live_[node]);
    if (twin_ != nullptr) twin_->Add(node, live_[node]);
    candidate_[node] = true;
  }

  EvictionPolicy* const policy_;
  EvictionPolicy* const twin_;
  std::mt19937_64 rng_{4242};
  std::map<NodeIndex, NodeFacts> live_;
  std::map<NodeIndex, bool> candidate_;
  std::map<NodeIndex, bool> touched_;  // used since its last release
  int64_t now_ = 0;
  uint64_t seq_ = 0;
};

std::vector<std::pair<NodeIndex, EvictionRank>> Visited(const EvictionPolicy& policy,
                                                        int64_t now_ns) {
  std::vector<std::pair<NodeIndex, EvictionRank>> out;
  policy.Visit(now_ns, [&](NodeIndex n, const EvictionRank& rank) {
    out.emplace_back(n, rank);
    return true;
  });
  return out;
}

class PolicyRandomTest : public ::testing::TestWithParam<const char*> {
 protected:
  std::unique_ptr<EvictionPolicy> Make() {
    const absl::StatusOr<EvictionOptions> options = ParseEvictionSpec(GetParam());
    EXPECT_TRUE(options.ok());
    absl::StatusOr<std::unique_ptr<EvictionPolicy>> made = MakeEvictionPolicy(*options, 16);
    EXPECT_TRUE(made.ok());
    return std::move(*made);
  }
};

// A policy's candidates and order against the reference, for every spec.
TEST_P(PolicyRandomTest, VisitYieldsExactlyTheCandidatesInRankOrder) {
  const std::unique_ptr<EvictionPolicy> made = Make();
  EvictionPolicy& policy = *made;
  RandomPolicyDriver driver(&policy, nullptr);
  int64_t visited_total = 0;
  for (int step = 0; step < 20'000; ++step) {
    driver.Step();
    ASSERT_TRUE(policy.CheckInvariants().ok())
        << "step " << step << ": " << policy.CheckInvariants();
    std::vector<NodeIndex> want;
    for (const auto& [n, is] : driver.candidate()) {
      if (is) want.push_back(n);
      ASSERT_EQ(policy.Contains(n), is) << "step " << step << " node " << n;
    }
    ASSERT_EQ(policy.size(), static_cast<int64_t>(want.size()));
    std::vector<NodeIndex> got;
    EvictionRank previous{.priority = -1};
    for (const auto& [n, rank] : Visited(policy, driver.now())) {
      EXPECT_EQ(rank, policy.Rank(n, driver.facts(n), driver.now())) << "step " << step;
      EXPECT_LE(previous, rank) << "step " << step << ": out of order at node " << n;
      previous = rank;
      got.push_back(n);
    }
    std::sort(got.begin(), got.end());
    ASSERT_EQ(got, want) << "step " << step;
    visited_total += static_cast<int64_t>(got.size());
  }
  EXPECT_GT(visited_total, 20'000);  // the candidate set was seldom empty
}

// What a policy says of itself lets the cache skip work; it must be true. ranks_by_release():
// every rank is {priority, 0, release_seq}. !hears_accesses(): a twin fed no access event visits
// the same candidates in the same order.
TEST_P(PolicyRandomTest, WhatThePolicySaysOfItselfHolds) {
  const std::unique_ptr<EvictionPolicy> made = Make();
  EvictionPolicy& policy = *made;
  const std::unique_ptr<EvictionPolicy> twin = policy.hears_accesses() ? nullptr : Make();
  RandomPolicyDriver driver(&policy, twin.get());
  for (int step = 0; step < 20'000; ++step) {
    driver.Step();
    const std::vector<std::pair<NodeIndex, EvictionRank>> visited = Visited(policy, driver.now());
    if (policy.ranks_by_release()) {
      for (const auto& [n, rank] : visited) {
        const NodeFacts& facts = driver.facts(n);
        ASSERT_EQ(rank, (EvictionRank{.priority = facts.priority, .order = facts.release_seq}))
            << "step " << step;
      }
    }
    if (twin != nullptr) {
      ASSERT_EQ(Visited(*twin, driver.now()), visited) << "step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, PolicyRandomTest,
                         ::testing::Values("lru", "lru+admit", "reuse", "reuse+admit"));

}  // namespace
}  // namespace kvpool
