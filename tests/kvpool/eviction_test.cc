// Eviction through the KvCacheManager: the leaf-only rule whatever order a policy asks for,
// first-out partial tails, the admission filter and policy injection.

#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/lru_eviction_policy.h"
#include "tests/kvpool/tokens.h"

namespace kvpool {
namespace {

constexpr SessionId kAlice(1);
constexpr NamespaceId kNs(100);
constexpr int32_t kBs = 16;

using test_tokens::Tokens;

// The worst order a policy could ask for: most recently released first, which puts every
// parent (released just after its children) ahead of them. Records what it was offered.
class NewestFirstPolicy final : public EvictionPolicy {
 public:
  explicit NewestFirstPolicy(std::vector<NodeIndex>* offered) : offered_(offered) {}
  void Reserve(NodeIndex capacity) override { lru_.Reserve(capacity); }
  void OnInsert(NodeIndex, const NodeFacts&, int64_t) override {}
  void OnHit(NodeIndex, const NodeFacts&, int64_t) override {}
  void OnErase(NodeIndex, const NodeFacts&, int64_t) override {}
  void Add(NodeIndex node, const NodeFacts& facts) override {
    lru_.Add(node, Reversed(facts));
    offered_->push_back(node);
  }
  void Remove(NodeIndex node, const NodeFacts& facts) override {
    lru_.Remove(node, Reversed(facts));
  }
  bool Contains(NodeIndex node) const override { return lru_.Contains(node); }
  int64_t size() const override { return lru_.size(); }
  EvictionRank Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const override {
    return lru_.Rank(node, Reversed(facts), now_ns);
  }
  void Visit(int64_t now_ns,
             absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const override {
    lru_.Visit(now_ns, visit);
  }
  absl::Status CheckInvariants() const override { return lru_.CheckInvariants(); }
  std::string DebugString() const override { return "newest-first"; }

 private:
  static NodeFacts Reversed(NodeFacts facts) {
    facts.release_seq = (uint64_t{1} << 40) - facts.release_seq;
    return facts;
  }

  LruEvictionPolicy lru_;
  std::vector<NodeIndex>* offered_;
};

class EvictionTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks, std::string spec,
            std::function<std::unique_ptr<EvictionPolicy>()> factory = nullptr) {
    auto cache = KvCacheManager::Create({.block_size = kBs,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 64,
                                         .clock = &clock_,
                                         .eviction_policy = std::move(spec),
                                         .eviction_policy_factory = std::move(factory)});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  SequenceId Alloc(const std::vector<int32_t>& prompt, bool retain_tail = false) {
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> r =
        cache_->Allocate(kAlice,
                         {.ns = kNs,
                          .num_tokens = static_cast<int64_t>(prompt.size()),
                          .prompt = prompt,
                          .retain_tail = retain_tail},
                         &plan);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->sequence : SequenceId(0);
  }

  void Serve(const std::vector<int32_t>& prompt, bool retain_tail = false) {
    clock_.Advance(1'000'000);
    const SequenceId id = Alloc(prompt, retain_tail);
    ASSERT_TRUE(cache_->Free(kAlice, id, OnFree::kCommit).ok());
    ExpectInvariants();
  }

  int64_t Cached(const std::vector<int32_t>& prompt) const {
    return cache_->MatchPrefix(kNs, prompt);
  }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
  }

  ManualClock clock_;
  std::unique_ptr<KvCacheManager> cache_;
};

TEST_F(EvictionTest, AParentFirstPolicyStillLosesLeavesFirst) {
  std::vector<NodeIndex> offered;
  Make(7, "lru", [&] { return std::make_unique<NewestFirstPolicy>(&offered); });
  Serve(Tokens(0, 4 * kBs));      // chain a0..a3
  Serve(Tokens(500, 3 * kBs));    // chain b0..b2, released last: its root ranks first
  EXPECT_EQ(offered.size(), 2u);  // only the two leaves were ever candidates
  // One block needed: the policy's favourite is b's newest leaf... which is b2 (b0 and b1 are
  // not leaves).
  SequenceId one = Alloc(Tokens(9000, kBs));
  EXPECT_EQ(Cached(Tokens(500, 3 * kBs)), 2 * kBs);
  EXPECT_EQ(Cached(Tokens(0, 4 * kBs)), 4 * kBs);
  ExpectInvariants();
  // Four more: b1 and b0 (each a leaf once its child is planned) rank ahead of a3, then a3.
  SequenceId four = Alloc(Tokens(7000, 4 * kBs));
  EXPECT_EQ(Cached(Tokens(500, 3 * kBs)), 0);
  EXPECT_EQ(Cached(Tokens(0, 4 * kBs)), 2 * kBs);
  ExpectInvariants();
  (void)one;
  (void)four;
}

TEST_F(EvictionTest, UnretainedPartialTailsGoFirst) {
  Make(5, "lru+notail");
  Serve(Tokens(0, 2 * kBs));        // full blocks only, released first
  Serve(Tokens(100, 2 * kBs + 5));  // two full blocks and a 5-token tail, released last
  EXPECT_EQ(Cached(Tokens(100, 2 * kBs + 5)), 2 * kBs + 5);
  Alloc(Tokens(9000, kBs));  // one block: the younger tail, not the older full leaf
  EXPECT_EQ(Cached(Tokens(100, 2 * kBs + 5)), 2 * kBs);
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), 2 * kBs);
  EXPECT_EQ(cache_->stats().cache.tails_evicted, 1u);
  ExpectInvariants();
}

TEST_F(EvictionTest, ARequestCanAskToRetainItsTail) {
  Make(5, "lru+notail");
  Serve(Tokens(0, 2 * kBs));
  Serve(Tokens(100, 2 * kBs + 5), /*retain_tail=*/true);
  Alloc(Tokens(9000, kBs));  // plain LRU order now: the older full leaf goes
  EXPECT_EQ(Cached(Tokens(100, 2 * kBs + 5)), 2 * kBs + 5);
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), kBs);
  EXPECT_EQ(cache_->stats().cache.tails_evicted, 0u);
}

TEST_F(EvictionTest, PlainLruKeepsTailsInReleaseOrder) {
  Make(5, "lru");
  Serve(Tokens(0, 2 * kBs));
  Serve(Tokens(100, 2 * kBs + 5));
  Alloc(Tokens(9000, kBs));
  EXPECT_EQ(Cached(Tokens(100, 2 * kBs + 5)), 2 * kBs + 5);
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), kBs);
}

TEST_F(EvictionTest, AdmissionEvictsContentSeenOnceBeforeContentSeenAgain) {
  Make(6, "lru+admit");
  Serve(Tokens(0, 2 * kBs));    // seen once: probation
  Serve(Tokens(100, 2 * kBs));  // served twice: the second time hits, so admitted
  Serve(Tokens(100, 2 * kBs));
  Serve(Tokens(200, 2 * kBs));  // seen once, and the youngest
  Alloc(Tokens(9000, 4 * kBs));
  EXPECT_EQ(Cached(Tokens(100, 2 * kBs)), 2 * kBs);  // the oldest, but admitted
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), 0);
  EXPECT_EQ(Cached(Tokens(200, 2 * kBs)), 0);
  ExpectInvariants();
}

TEST_F(EvictionTest, ContentComingBackAfterEvictionIsAdmitted) {
  Make(4, "lru+admit");
  Serve(Tokens(0, 2 * kBs));
  Alloc(Tokens(9000, 4 * kBs));  // evicts it
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), 0);
  ASSERT_TRUE(cache_->FreeSession(kAlice) == 1);
  Serve(Tokens(0, 2 * kBs));  // back: the ghost set remembers it
  Serve(Tokens(300, 2 * kBs));
  Alloc(Tokens(600, 2 * kBs));  // two blocks: the unseen chain, though younger
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), 2 * kBs);
  EXPECT_EQ(Cached(Tokens(300, 2 * kBs)), 0);
}

TEST_F(EvictionTest, EveryPolicyKeepsTheBooksUnderChurn) {
  for (const char* spec : {"lru", "lru+admit+notail", "reuse", "reuse+admit+notail"}) {
    SCOPED_TRACE(spec);
    Make(24, spec);
    for (int i = 0; i < 300; ++i) {
      // One hot opening comes back every fourth request; the others churn the cache.
      const int32_t topic = i % 4 == 0 ? 0 : 1 + (i * 7) % 11;
      Serve(Tokens(topic * 1000, kBs * (1 + i % 4) + i % 3));
      if (HasFatalFailure()) return;
    }
    EXPECT_GT(cache_->stats().evictions, 100u);
    EXPECT_GT(cache_->stats().hit_tokens, 0u);
  }
}

// LRU that does not say it ranks by release order: the cache plans with Rank() and its heap of
// freed parents for every victim, never with the release-order shortcuts.
class PlainRankLru final : public EvictionPolicy {
 public:
  void Reserve(NodeIndex capacity) override { lru_.Reserve(capacity); }
  void OnInsert(NodeIndex, const NodeFacts&, int64_t) override {}
  void OnHit(NodeIndex, const NodeFacts&, int64_t) override {}
  void OnErase(NodeIndex, const NodeFacts&, int64_t) override {}
  void Add(NodeIndex node, const NodeFacts& facts) override { lru_.Add(node, facts); }
  void Remove(NodeIndex node, const NodeFacts& facts) override { lru_.Remove(node, facts); }
  bool Contains(NodeIndex node) const override { return lru_.Contains(node); }
  int64_t size() const override { return lru_.size(); }
  EvictionRank Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const override {
    return lru_.Rank(node, facts, now_ns);
  }
  void Visit(int64_t now_ns,
             absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const override {
    lru_.Visit(now_ns, visit);
  }
  absl::Status CheckInvariants() const override { return lru_.CheckInvariants(); }
  std::string DebugString() const override { return "plain-rank lru"; }
  bool uses_fingerprints() const override { return false; }

 private:
  LruEvictionPolicy lru_;
};

// Plain LRU takes release-order shortcuts when it plans (a chain released at once is evicted
// without ranking each parent). Driven side by side with the same LRU planned the long way,
// under concurrent sequences, shared prefixes, partial tails, every priority class and frees in
// any order, it must evict exactly the same blocks in the same order (with first-out tails too),
// as must plain LRU recording nothing per evicted block (Evict's lean path for chains).
class EvictionShortcutTest : public ::testing::TestWithParam<const char*> {
 protected:
  // A manager's state text without the event log's position (which only advances with events).
  static std::string WithoutEventPosition(std::string state) {
    const size_t at = state.find("next_event=");
    if (at != std::string::npos) state.erase(at, state.find_first_of(" \n", at) - at);
    return state;
  }
};

TEST_P(EvictionShortcutTest, PlansWhatTheFullRankOrderPlans) {
  ManualClock clock;
  auto make = [&](std::function<std::unique_ptr<EvictionPolicy>()> factory, bool events) {
    auto m = KvCacheManager::Create({.block_size = kBs,
                                     .num_blocks = 48,
                                     .max_blocks_per_seq = 16,
                                     .clock = &clock,
                                     .eviction_policy = GetParam(),
                                     .eviction_policy_factory = std::move(factory),
                                     .cache_events = events,
                                     .evicted_memory = events ? size_t{65536} : 0});
    EXPECT_TRUE(m.ok()) << m.status();
    return std::move(*m);
  };
  std::unique_ptr<KvCacheManager> fast = make(nullptr, /*events=*/true);
  // With nothing recorded per evicted block, Evict() also takes its lean path for a chain.
  std::unique_ptr<KvCacheManager> lean = make(nullptr, /*events=*/false);
  std::unique_ptr<KvCacheManager> full =
      make([] { return std::make_unique<PlainRankLru>(); }, /*events=*/true);
  std::mt19937 rng(16);
  std::vector<SequenceId> live;
  uint64_t evictions_seen = 0;
  for (int step = 0; step < 3000; ++step) {
    clock.Advance(1000);
    if (live.size() < 4 && rng() % 3 != 0) {
      // A few openings shared by many prompts, then a private part of any length.
      std::vector<int32_t> prompt =
          Tokens(static_cast<int32_t>(rng() % 4) * 1000, static_cast<int32_t>(rng() % (3 * kBs)));
      const std::vector<int32_t> rest =
          Tokens(100'000 + step * 100, static_cast<int32_t>(1 + rng() % (5 * kBs)));
      prompt.insert(prompt.end(), rest.begin(), rest.end());
      const AllocateRequest request{.ns = kNs,
                                    .num_tokens = static_cast<int64_t>(prompt.size()),
                                    .prompt = prompt,
                                    .priority = static_cast<int>(rng() % 3 == 0 ? rng() % 4 : 0)};
      DevicePlan plan_fast, plan_full;
      const absl::StatusOr<AllocateResult> a = fast->Allocate(kAlice, request, &plan_fast);
      const absl::StatusOr<AllocateResult> b = full->Allocate(kAlice, request, &plan_full);
      DevicePlan plan_lean;
      const absl::StatusOr<AllocateResult> c = lean->Allocate(kAlice, request, &plan_lean);
      ASSERT_EQ(a.status().code(), b.status().code()) << "step " << step;
      ASSERT_EQ(a.status().code(), c.status().code()) << "step " << step;
      if (a.ok()) {
        ASSERT_EQ(a->sequence, b->sequence);
        ASSERT_EQ(a->matched_tokens, b->matched_tokens) << "step " << step;
        live.push_back(a->sequence);
      }
    } else if (!live.empty()) {
      const size_t i = rng() % live.size();
      const OnFree how = rng() % 4 == 0 ? OnFree::kDiscard : OnFree::kCommit;
      ASSERT_TRUE(fast->Free(kAlice, live[i], how).ok());
      ASSERT_TRUE(full->Free(kAlice, live[i], how).ok());
      ASSERT_TRUE(lean->Free(kAlice, live[i], how).ok());
      live.erase(live.begin() + static_cast<ptrdiff_t>(i));
    }
    const std::string state = fast->DebugString();
    ASSERT_EQ(state, full->DebugString()) << "step " << step;
    ASSERT_EQ(WithoutEventPosition(state), WithoutEventPosition(lean->DebugString()))
        << "step " << step;
    if (step % 50 == 0) {
      const absl::Status checked = lean->CheckInvariants();
      ASSERT_TRUE(checked.ok()) << "step " << step << ": " << checked;
    }
    evictions_seen = fast->stats().evictions;
  }
  ASSERT_TRUE(fast->CheckInvariants().ok());
  ASSERT_TRUE(full->CheckInvariants().ok());
  ASSERT_TRUE(lean->CheckInvariants().ok());
  EXPECT_GT(evictions_seen, 1000u);  // the shortcut had plenty to plan
}

INSTANTIATE_TEST_SUITE_P(Specs, EvictionShortcutTest, ::testing::Values("lru", "lru+notail"));

TEST_F(EvictionTest, BadPoliciesAreRefusedAtCreation) {
  EXPECT_EQ(
      KvCacheManager::Create(
          {.block_size = kBs, .num_blocks = 8, .max_blocks_per_seq = 8, .eviction_policy = "lfu"})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvCacheManager::Create({.block_size = kBs,
                                    .num_blocks = 8,
                                    .max_blocks_per_seq = 8,
                                    .eviction_policy_factory = [] { return nullptr; }})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
