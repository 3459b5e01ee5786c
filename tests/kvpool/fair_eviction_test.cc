// Fair eviction by tenant (docs/eviction.md, "Fair by tenant"): eviction shares, each ordered by
// its own policy instance, and plans that take the next victim from the share using the most per
// unit of weight. Through the KvCacheManager, with the plain LRU spec and the default one.

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "tests/kvpool/tokens.h"

namespace kvpool {
namespace {

constexpr int32_t kBs = 4;
constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kQuiet(11);  // a tenant with one prompt it comes back to
constexpr NamespaceId kLoud(22);   // a tenant that floods the cache with prompts used once
constexpr NamespaceId kThird(33);

using test_tokens::Tokens;

class FairEvictionTest : public ::testing::TestWithParam<const char*> {
 protected:
  void Make(int32_t num_blocks, int32_t shares) {
    auto cache = KvCacheManager::Create({.block_size = kBs,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 64,
                                         .clock = &clock_,
                                         .eviction_policy = GetParam(),
                                         .eviction_shares = shares});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  // A pool with layer groups (`groups`: their fields, block_bytes and the main pool's size),
  // the quiet and the loud tenant in shares of their own when `fair`.
  void MakeGrouped(KvCacheOptions groups, bool fair) {
    groups.block_size = kBs;
    groups.max_blocks_per_seq = 64;
    groups.clock = &clock_;
    groups.eviction_policy = GetParam();
    groups.eviction_shares = fair ? 4 : 0;
    auto cache = KvCacheManager::Create(groups);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    if (fair) {
      ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 1).ok());
      ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 2).ok());
    }
  }

  // Serves `prompt` in `ns` once: allocate (reusing what is cached), commit, free.
  void Serve(SessionId who, NamespaceId ns, const std::vector<int32_t>& prompt) {
    clock_.Advance(1'000'000);
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> r = cache_->Allocate(
        who, {.ns = ns, .num_tokens = static_cast<int64_t>(prompt.size()), .prompt = prompt},
        &plan);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(cache_->Free(who, r->sequence, OnFree::kCommit).ok());
    const absl::Status status = cache_->CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
  }

  // Serve() for a pool with a state group: the step computes the prompt past what it resumed
  // (its state advances to the end), then commit and free, which keeps the end's checkpoint.
  void ServeComputed(SessionId who, NamespaceId ns, const std::vector<int32_t>& prompt) {
    clock_.Advance(1'000'000);
    DevicePlan plan;
    const int64_t n = static_cast<int64_t>(prompt.size());
    const absl::StatusOr<AllocateResult> r =
        cache_->Allocate(who, {.ns = ns, .num_tokens = n, .prompt = prompt}, &plan);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(cache_->AdvanceState(who, r->sequence, n).ok());
    ASSERT_TRUE(cache_->Commit(who, r->sequence, n, {}).ok());
    ASSERT_TRUE(cache_->Free(who, r->sequence, OnFree::kCommit).ok());
    const absl::Status status = cache_->CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
  }

  // The quiet tenant caches its 8-block prompt, then the loud one serves `prompts` prompts of 8
  // blocks, each twice (so that an admission filter keeps them as it keeps the quiet one).
  // Returns how much of the quiet prompt is still cached.
  int64_t QuietPromptAfterAFlood(int prompts) {
    const std::vector<int32_t> quiet = Tokens(0, 8 * kBs);
    Serve(kAlice, kQuiet, quiet);
    Serve(kAlice, kQuiet, quiet);
    for (int i = 0; i < prompts; ++i) {
      Serve(kBob, kLoud, Tokens(100'000 + i * 1'000, 8 * kBs));
      Serve(kBob, kLoud, Tokens(100'000 + i * 1'000, 8 * kBs));
    }
    return cache_->MatchPrefix(kQuiet, quiet);
  }

  const ShareUse* Share(uint64_t key) {
    shares_ = cache_->EvictionShares();
    for (const ShareUse& s : shares_) {
      if (s.key == key) return &s;
    }
    return nullptr;
  }

  ManualClock clock_;
  std::unique_ptr<KvCacheManager> cache_;
  std::vector<ShareUse> shares_;
};

// Without shares, one pool-wide order: the loud tenant's prompts push the quiet one's out.
TEST_P(FairEvictionTest, WithoutSharesAFloodEvictsTheQuietTenantsPrefix) {
  Make(40, 0);
  EXPECT_EQ(QuietPromptAfterAFlood(40), 0);
  EXPECT_EQ(cache_->EvictionShares().size(), 1u);
  EXPECT_EQ(cache_->SetEvictionShare(kQuiet, 1).code(), absl::StatusCode::kResourceExhausted);
}

// With a share each, the loud tenant evicts its own blocks: the quiet one's prefix stays whole.
TEST_P(FairEvictionTest, AFloodingTenantEvictsItsOwnBlocks) {
  Make(40, 4);
  ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 1).ok());
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 2).ok());
  EXPECT_EQ(QuietPromptAfterAFlood(40), 8 * kBs);
  const ShareUse* loud = Share(2);
  ASSERT_NE(loud, nullptr);
  EXPECT_GT(loud->evicted, 0u);
  EXPECT_EQ(Share(1)->evicted, 0u);
  EXPECT_EQ(Share(1)->evictable, 8);
  EXPECT_EQ(Share(1)->bytes, 8);  // no block_bytes: a block weighs 1
}

// Both tenants flood: each ends with about its weighted part of the cache, a share of weight 3
// about three times one of weight 1 (within one prompt's blocks).
TEST_P(FairEvictionTest, WeightsSplitTheCacheBetweenBusyTenants) {
  Make(64, 4);
  ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 1, 1).ok());
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 2, 3).ok());
  for (int i = 0; i < 60; ++i) {
    Serve(kAlice, kQuiet, Tokens(i * 1'000, 4 * kBs));
    Serve(kBob, kLoud, Tokens(500'000 + i * 1'000, 4 * kBs));
  }
  const int64_t light = Share(1)->evictable;
  const int64_t heavy = Share(2)->evictable;
  EXPECT_EQ(light + heavy, 64);  // every block cached, all of it evictable
  EXPECT_NEAR(static_cast<double>(heavy), 3.0 * static_cast<double>(light), 4.0 * 3)
      << light << " and " << heavy;
  EXPECT_GT(Share(1)->evicted, 0u);
  EXPECT_GT(Share(2)->evicted, 0u);
}

// Equal weights, three tenants, one of them idle after a start: the two busy ones take turns and
// the idle one keeps what it holds while it is under their use.
TEST_P(FairEvictionTest, AnIdleTenantUnderItsPartKeepsEverything) {
  Make(48, 4);
  ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 1).ok());
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 2).ok());
  ASSERT_TRUE(cache_->SetEvictionShare(kThird, 3).ok());
  const std::vector<int32_t> idle = Tokens(0, 6 * kBs);
  Serve(kAlice, kThird, idle);
  Serve(kAlice, kThird, idle);
  for (int i = 0; i < 40; ++i) {
    Serve(kAlice, kQuiet, Tokens(10'000 + i * 100, 3 * kBs));
    Serve(kBob, kLoud, Tokens(900'000 + i * 100, 3 * kBs));
  }
  EXPECT_EQ(cache_->MatchPrefix(kThird, idle), 6 * kBs);
  EXPECT_EQ(Share(3)->evicted, 0u);
  // Within one prompt's blocks and one more (the one that served last has just added its own).
  EXPECT_NEAR(static_cast<double>(Share(1)->evictable), static_cast<double>(Share(2)->evictable),
              4.0);
}

// The share holding more gives the next block, whoever asks for it.
TEST_P(FairEvictionTest, TheShareHoldingMoreGivesFirstWhoeverAsks) {
  Make(16, 4);
  ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 1).ok());
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 2).ok());
  Serve(kAlice, kQuiet, Tokens(0, 4 * kBs));    // 4 blocks, released first
  Serve(kBob, kLoud, Tokens(50'000, 4 * kBs));  // 4 blocks
  Serve(kBob, kLoud, Tokens(60'000, 4 * kBs));  // 8 in all: the loud tenant uses more
  EXPECT_EQ(Share(1)->bytes, 4);
  EXPECT_EQ(Share(2)->bytes, 8);
  // The quiet tenant needs the last 4 free blocks and one more: the loud share gives it, though
  // the quiet tenant's own blocks are the least recently used.
  DevicePlan plan;
  ASSERT_TRUE(cache_->Allocate(kAlice, {.ns = kQuiet, .num_tokens = 4 * kBs + 1}, &plan).ok());
  EXPECT_EQ(Share(2)->evicted, 1u);
  EXPECT_EQ(Share(1)->evicted, 0u);
  EXPECT_TRUE(cache_->CheckInvariants().ok());
}

// What the manager keeps beside a tenant's blocks (window blocks here) is charged to its share
// in bytes, and the charge leaves with them.
TEST_P(FairEvictionTest, WindowBlocksKeptBesideABlockAreChargedToItsShare) {
  MakeGrouped({.num_blocks = 32,
               .window_blocks = 32,
               .window_tokens = 2 * kBs,
               .block_bytes = 100,
               .window_block_bytes = 30},
              /*fair=*/true);
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 0).ok());  // the loud tenant in the default share
  Serve(kAlice, kQuiet, Tokens(0, 6 * kBs));
  Serve(kBob, kLoud, Tokens(9'000, 3 * kBs));  // the default share's
  const int64_t windows = cache_->stats().windows.cached;
  ASSERT_GT(windows, 0);
  const ShareUse* quiet = Share(1);
  ASSERT_NE(quiet, nullptr);
  EXPECT_EQ(quiet->evictable, 6);
  EXPECT_GT(quiet->charged, 0);
  EXPECT_EQ(quiet->bytes, 6 * 100 + quiet->charged);
  EXPECT_EQ(quiet->charged + Share(0)->charged, windows * 30);
  ASSERT_TRUE(cache_->ClearCache().ok());
  for (const ShareUse& s : cache_->EvictionShares()) {
    EXPECT_EQ(s.charged, 0) << s.key;
    EXPECT_EQ(s.bytes, 0) << s.key;
  }
}

// Window blocks kept beside a tenant's blocks give way by share too: when the window group runs
// out of room, the tenant flooding it loses its own, and the quiet tenant's prompt still resumes
// whole (its main blocks are never short: the main pool is large). Without shares the quiet
// tenant's window blocks, the least recently used, go first and its prompt resumes only where
// its sink-less window was kept.
TEST_P(FairEvictionTest, WindowGroupPressureTakesTheFloodingTenantsWindowBlocks) {
  for (const bool fair : {true, false}) {
    SCOPED_TRACE(fair ? "shares" : "one order");
    MakeGrouped({.num_blocks = 512,
                 .window_blocks = 16,
                 .window_tokens = 2 * kBs,
                 .block_bytes = 100,
                 .window_block_bytes = 30},
                fair);
    const std::vector<int32_t> quiet = Tokens(0, 6 * kBs);
    Serve(kAlice, kQuiet, quiet);
    Serve(kAlice, kQuiet, quiet);
    ASSERT_EQ(cache_->MatchPrefix(kQuiet, quiet), 6 * kBs);
    const uint64_t evicted_before = cache_->stats().windows.evicted;
    for (int i = 0; i < 24; ++i) {
      const std::vector<int32_t> loud = Tokens(50'000 + i * 1'000, 3 * kBs);
      ASSERT_NO_FATAL_FAILURE(Serve(kBob, kLoud, loud));
      ASSERT_NO_FATAL_FAILURE(Serve(kBob, kLoud, loud));
    }
    EXPECT_GT(cache_->stats().windows.evicted, evicted_before);  // the window group was short
    EXPECT_EQ(cache_->stats().evictions, 0u);                    // the main pool never was
    if (fair) {
      EXPECT_EQ(cache_->MatchPrefix(kQuiet, quiet), 6 * kBs);
    } else {
      EXPECT_LT(cache_->MatchPrefix(kQuiet, quiet), 6 * kBs);
    }
  }
}

// State checkpoints likewise: when the checkpoint slots are full, the tenant flooding them loses
// its own, and the quiet tenant's prompt still resumes from its checkpoint. Without shares the
// quiet tenant's, the least recently used, goes first and its prompt resumes nothing (by tokens
// saved alone: weighed by kind, the flood's checkpoints, never resumed from, would go first
// anyway; state_checkpoint_test has that order).
TEST_P(FairEvictionTest, CheckpointSlotPressureTakesTheFloodingTenantsCheckpoints) {
  for (const bool fair : {true, false}) {
    SCOPED_TRACE(fair ? "shares" : "one order");
    MakeGrouped({.num_blocks = 512,
                 .state_slots = 6,
                 .checkpoint_slots = 4,
                 .checkpoint_interval = 0,
                 .checkpoint_eviction = KvCacheOptions::CheckpointEviction::kByTokensSaved,
                 .block_bytes = 100,
                 .state_bytes = 300},
                fair);
    const std::vector<int32_t> quiet = Tokens(0, 6 * kBs);
    ServeComputed(kAlice, kQuiet, quiet);
    // A prompt that goes on past it resumes at its end, where its checkpoint is.
    std::vector<int32_t> next = quiet;
    next.push_back(7);
    ASSERT_EQ(cache_->MatchPrefix(kQuiet, next), 6 * kBs);
    if (fair) {
      EXPECT_EQ(Share(1)->charged, 300);  // its checkpoint's bytes
    }
    for (int i = 0; i < 12; ++i) {
      ASSERT_NO_FATAL_FAILURE(ServeComputed(kBob, kLoud, Tokens(50'000 + i * 1'000, 3 * kBs)));
    }
    EXPECT_GT(cache_->stats().checkpoints.evicted, 0u);  // the slots were short
    EXPECT_EQ(cache_->stats().evictions, 0u);            // the main pool never was
    EXPECT_EQ(cache_->MatchPrefix(kQuiet, next), fair ? 6 * kBs : 0);
  }
}

TEST_P(FairEvictionTest, BadSharesAreRefusedAndChangeNothing) {
  Make(16, 1);
  const std::string before = cache_->DebugString();
  EXPECT_EQ(cache_->SetEvictionShare(NamespaceId(0), 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->SetEvictionShare(kQuiet, 1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->SetEvictionShare(kQuiet, 1, PrefixCache::kMaxShareWeight + 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->EvictionShares().size(), 1u);
  ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 7, 2).ok());
  EXPECT_EQ(cache_->SetEvictionShare(kLoud, 8).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 7).ok());  // an existing share: its weight now 1
  ASSERT_EQ(cache_->EvictionShares().size(), 2u);
  EXPECT_EQ(cache_->EvictionShares()[1].weight, 1u);
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 0).ok());  // back to the default share
  EXPECT_EQ(cache_->DebugString(), before);
  EXPECT_TRUE(cache_->CheckInvariants().ok());
}

// A namespace that changes share keeps its published blocks in the old one: a prompt whose first
// blocks are in one share and the rest in another is still evicted leaves first, and every block
// can go (ClearCache, a full EvictCached).
TEST_P(FairEvictionTest, APathAcrossTwoSharesStillEvictsLeavesFirst) {
  Make(32, 4);
  ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 1).ok());
  Serve(kAlice, kQuiet, Tokens(0, 4 * kBs));
  ASSERT_TRUE(cache_->SetEvictionShare(kQuiet, 2).ok());
  Serve(kAlice, kQuiet, Tokens(0, 8 * kBs));  // blocks 4..7 in share 2, below share 1's
  EXPECT_EQ(Share(1)->evictable, 4);
  EXPECT_EQ(Share(2)->evictable, 4);
  ASSERT_TRUE(cache_->SetEvictionShare(kLoud, 3).ok());
  for (int i = 0; i < 5; ++i) Serve(kBob, kLoud, Tokens(70'000 + i * 1'000, 4 * kBs));
  // Whatever went, the quiet prompt's cached part is still a prefix of it (leaves first).
  const int64_t left = cache_->MatchPrefix(kQuiet, Tokens(0, 8 * kBs));
  EXPECT_EQ(left % kBs, 0);
  const int64_t cached = cache_->stats().cache.nodes;
  EXPECT_EQ(cache_->EvictCached(1000), cached);
  EXPECT_EQ(cache_->stats().cache.nodes, 0);
  EXPECT_TRUE(cache_->CheckInvariants().ok());
  for (const ShareUse& s : cache_->EvictionShares()) EXPECT_EQ(s.evictable, 0) << s.key;
}

// Random prompts over three tenants with random weights, and evictions an operator asks for
// between them: after every call the invariants hold (each share's count, each policy's books).
// After every eviction the plan was fair to the block: each share that gave a block still uses at
// least what any other share holding evictable blocks uses, less one of its own blocks (per unit
// of weight). Unretained partial tails go first whatever their share, so a call that took one is
// not checked.
TEST_P(FairEvictionTest, RandomLoadEvictsFromTheShareUsingTheMost) {
  int checked = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    SCOPED_TRACE(seed);
    Make(48, 4);
    std::mt19937 rng(seed);
    const NamespaceId ns[] = {kQuiet, kLoud, kThird};
    for (int t = 0; t < 3; ++t) {
      const uint32_t weight = 1 + rng() % 3;
      ASSERT_TRUE(cache_->SetEvictionShare(ns[t], static_cast<uint64_t>(t + 1), weight).ok());
    }
    for (int step = 0; step < 300; ++step) {
      if (rng() % 5 != 0) {
        const int t = static_cast<int>(rng() % 3);
        // Mostly fresh prompts, sometimes one seen before (a hit), of 1..5 blocks plus a tail.
        const int32_t start = static_cast<int32_t>(rng() % 4 == 0 ? rng() % 8 : 100 + step) * 64;
        const int32_t tokens = static_cast<int32_t>(1 + rng() % (5 * kBs));
        ASSERT_NO_FATAL_FAILURE(Serve(t == 0 ? kAlice : kBob, ns[t], Tokens(start, tokens)));
        continue;
      }
      const std::vector<ShareUse> before = cache_->EvictionShares();
      const uint64_t tails = cache_->stats().cache.tails_evicted;
      cache_->EvictCached(static_cast<int64_t>(1 + rng() % 6));
      ASSERT_TRUE(cache_->CheckInvariants().ok()) << cache_->CheckInvariants();
      if (cache_->stats().cache.tails_evicted != tails) continue;
      const std::vector<ShareUse> after = cache_->EvictionShares();
      ASSERT_EQ(after.size(), before.size());
      for (size_t g = 0; g < after.size(); ++g) {
        if (after[g].evicted == before[g].evicted) continue;
        ++checked;
        const double use = static_cast<double>(after[g].bytes) / after[g].weight;
        for (size_t h = 0; h < after.size(); ++h) {
          if (h == g || after[h].evictable == 0) continue;
          EXPECT_GE(use + 1.0 / after[g].weight + 1e-9,
                    static_cast<double>(after[h].bytes) / after[h].weight)
              << "step " << step << ": share " << after[g].key << " gave a block while share "
              << after[h].key << " used more";
        }
      }
    }
  }
  EXPECT_GT(checked, 50);
}

INSTANTIATE_TEST_SUITE_P(Policies, FairEvictionTest,
                         ::testing::Values("lru", "default", "reuse+admit"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '+', '_');
                           return name;
                         });

}  // namespace
}  // namespace kvpool
