// KvCacheManager's bounds on what one client can make it hold (issue 12): sequences per session
// (zero-token ones included), quotas summed over a group of namespaces, namespace slots recycled
// when idle (and the blocks of a recycled slot scrubbed), cache events bounded in bytes.

#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/kv_cache_manager_test_peer.h"

namespace kvpool {
namespace {

using ::testing::HasSubstr;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kA(100);
constexpr NamespaceId kB(200);
constexpr NamespaceId kC(300);
constexpr NamespaceId kD(400);
constexpr uint64_t kGroup = 0xA11CE;

class KvCacheLimitsTest : public ::testing::Test {
 protected:
  void Make(KvCacheOptions options) {
    options.block_size = 16;
    if (options.num_blocks == 0) options.num_blocks = 32;
    options.max_blocks_per_seq = 16;
    options.clock = &clock_;
    auto cache = KvCacheManager::Create(options);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  absl::StatusOr<SequenceId> Alloc(SessionId session, NamespaceId ns, int64_t tokens,
                                   DevicePlan* plan = nullptr) {
    DevicePlan ignored;
    absl::StatusOr<AllocateResult> r =
        cache_->Allocate(session, {.ns = ns, .num_tokens = tokens}, plan ? plan : &ignored);
    if (!r.ok()) return r.status();
    return r->sequence;
  }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    EXPECT_TRUE(status.ok()) << status;
  }

  ManualClock clock_;
  std::unique_ptr<KvCacheManager> cache_;
};

TEST_F(KvCacheLimitsTest, CreateRejectsBadLimits) {
  for (KvCacheOptions bad :
       {KvCacheOptions{.max_sequences_per_session = -1}, KvCacheOptions{.event_capacity_bytes = 0},
        KvCacheOptions{.max_namespaces = 0}}) {
    bad.num_blocks = 4;
    bad.max_blocks_per_seq = 4;
    EXPECT_EQ(KvCacheManager::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// Zero-token sequences hold no block and no quota: only this bound stops a session making
// millions of them with one call.
TEST_F(KvCacheLimitsTest, SequencesPerSessionCountZeroTokenOnes) {
  Make({.max_sequences_per_session = 3});
  const std::vector<AllocateRequest> two(2, AllocateRequest{.ns = kA, .num_tokens = 0});
  std::vector<AllocateResult> results;
  DevicePlan plan;
  ASSERT_TRUE(cache_->AllocateBatch(kAlice, two, &results, &plan).ok());
  const std::string before = cache_->DebugString();
  const absl::Status refused = cache_->AllocateBatch(kAlice, two, &results, &plan);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("session 1 holds 2 sequences: at most 3"));
  EXPECT_EQ(cache_->DebugString(), before);  // the whole batch refused, nothing created
  EXPECT_EQ(results.size(), 2u);
  const absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, results[0].sequence, &plan);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::string full = cache_->DebugString();
  EXPECT_EQ(cache_->Fork(kAlice, results[0].sequence, &plan).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Alloc(kAlice, kA, 16).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache_->DebugString(), full);
  EXPECT_EQ(cache_->stats().exhausted, 3u);
  EXPECT_EQ(cache_->session_sequences(kAlice), 3);
  EXPECT_TRUE(Alloc(kBob, kA, 0).ok());  // a session of its own
  ASSERT_TRUE(cache_->Free(kAlice, *child).ok());
  EXPECT_TRUE(Alloc(kAlice, kA, 0).ok());
  ExpectInvariants();
}

// A tenant's namespaces (one per model) share one quota: a new model is not a fresh quota.
TEST_F(KvCacheLimitsTest, AQuotaGroupBoundsTheSumOverItsNamespaces) {
  Make({});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kA, 4, kGroup).ok());
  ASSERT_TRUE(cache_->SetNamespaceQuota(kB, 4, kGroup).ok());
  ASSERT_TRUE(cache_->SetNamespaceQuota(kC, 2).ok());  // alone
  ASSERT_TRUE(Alloc(kAlice, kA, 48).ok());             // 3 of 4
  const std::string before = cache_->DebugString();
  const absl::StatusOr<SequenceId> refused = Alloc(kBob, kB, 32);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(refused.status())->resource, Resource::kNamespaceQuota);
  EXPECT_EQ(GetShortfall(refused.status())->blocks, 1);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("quota group 0xa11ce"));
  // One batch touching both namespaces is summed: 1 + 1 more is one too many.
  const std::vector<AllocateRequest> both = {{.ns = kA, .num_tokens = 16},
                                             {.ns = kB, .num_tokens = 16}};
  std::vector<AllocateResult> results;
  DevicePlan plan;
  const absl::Status batch = cache_->AllocateBatch(kBob, both, &results, &plan);
  EXPECT_EQ(batch.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(batch)->blocks, 1);
  EXPECT_EQ(cache_->DebugString(), before);
  ASSERT_TRUE(Alloc(kBob, kB, 16).ok());    // the 4th
  EXPECT_FALSE(Alloc(kAlice, kA, 1).ok());  // full, whichever namespace asks
  EXPECT_TRUE(Alloc(kAlice, kC, 32).ok());  // C has its own
  EXPECT_FALSE(Alloc(kAlice, kC, 1).ok());
  EXPECT_TRUE(Alloc(kAlice, kD, 64).ok());  // D has none
  ExpectInvariants();
  // Lifting B's quota takes it out of the group; A still counts against the group's 4.
  ASSERT_TRUE(cache_->SetNamespaceQuota(kB, kUnlimited, kGroup).ok());
  EXPECT_TRUE(Alloc(kBob, kB, 16).ok());
  EXPECT_TRUE(Alloc(kAlice, kA, 16).ok());  // A holds 3 of 4 now
  EXPECT_FALSE(Alloc(kAlice, kA, 1).ok());
  // A new bound set through any member is the group's.
  ASSERT_TRUE(cache_->SetNamespaceQuota(kA, 8, kGroup).ok());
  EXPECT_TRUE(Alloc(kAlice, kA, 16).ok());
  ExpectInvariants();
}

TEST_F(KvCacheLimitsTest, GrowAndForkCountAgainstTheGroup) {
  Make({});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kA, 3, kGroup).ok());
  ASSERT_TRUE(cache_->SetNamespaceQuota(kB, 3, kGroup).ok());
  const SequenceId a = *Alloc(kAlice, kA, 24);  // 2 blocks
  const SequenceId b = *Alloc(kAlice, kB, 0);
  DevicePlan plan;
  EXPECT_EQ(cache_->Grow(kAlice, b, 32, &plan).code(), absl::StatusCode::kResourceExhausted);
  // A fork copies the partial last block: one more physical block, the third.
  ASSERT_TRUE(cache_->Fork(kAlice, a, &plan).ok());
  EXPECT_EQ(cache_->Fork(kAlice, a, &plan).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache_->Grow(kAlice, b, 1, &plan).code(), absl::StatusCode::kResourceExhausted);
  ExpectInvariants();
}

// Forks hold references without taking blocks, so only a bound on references bounds what forks
// (and shared prefixes) make the manager keep: every fork copies the parent's table and tokens.
// A reference group bounds its sessions' references together (issue 27: a uid's sessions).
TEST_F(KvCacheLimitsTest, AReferenceGroupBoundsItsSessionsTogether) {
  Make({});
  constexpr uint64_t kUid = 7;
  ASSERT_TRUE(cache_->SetRefGroupQuota(kUid, 6).ok());
  ASSERT_TRUE(cache_->SetSessionQuota(kAlice, kUnlimited, kUid).ok());
  ASSERT_TRUE(cache_->SetSessionQuota(kBob, kUnlimited, kUid).ok());
  EXPECT_FALSE(cache_->SetSessionQuota(kBob, kUnlimited, kUid + 1).ok());  // one group each
  const SequenceId a = *Alloc(kAlice, kA, 32);                             // 2 references
  DevicePlan plan;
  ASSERT_TRUE(cache_->Fork(kAlice, a, &plan).ok());  // 4
  ExpectInvariants();
  const SequenceId b = *Alloc(kBob, kA, 16);           // 5: Bob's count with Alice's
  ASSERT_TRUE(cache_->Grow(kBob, b, 32, &plan).ok());  // 6
  const absl::Status refused = cache_->Fork(kAlice, a, &plan).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  ASSERT_TRUE(GetShortfall(refused).has_value());
  EXPECT_EQ(GetShortfall(refused)->blocks, 2);
  EXPECT_EQ(cache_->Grow(kBob, b, 33, &plan).code(), absl::StatusCode::kResourceExhausted);
  ExpectInvariants();
  // Freeing gives the references back to the group; another group is not limited by it.
  ASSERT_TRUE(cache_->Free(kBob, b).ok());
  EXPECT_TRUE(cache_->Fork(kAlice, a, &plan).ok());
  ASSERT_TRUE(cache_->SetSessionQuota(SessionId(99), kUnlimited, kUid + 1).ok());
  EXPECT_TRUE(Alloc(SessionId(99), kA, 16 * 16).ok());
  ExpectInvariants();
  // The group goes with its last session.
  cache_->FreeSession(kAlice);
  cache_->FreeSession(kBob);
  ExpectInvariants();
  ASSERT_TRUE(cache_->SetSessionQuota(kAlice, kUnlimited, kUid).ok());
  EXPECT_TRUE(Alloc(kAlice, kA, 16 * 16).ok());  // the old group's quota is gone with it
  ExpectInvariants();
}

// The slot table holds 2 namespaces. A zero-token sequence holds no block, but its namespace is
// in use: its slot is not recycled under it.
TEST_F(KvCacheLimitsTest, IdleNamespacesAreRecycledButNotOnesWithSequences) {
  Make({.max_namespaces = 2});
  const SequenceId empty = *Alloc(kAlice, kA, 0);
  ASSERT_TRUE(cache_->Free(kAlice, *Alloc(kAlice, kB, 40)).ok());
  const absl::StatusOr<SequenceId> c = Alloc(kAlice, kC, 16);  // recycles B only
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(cache_->stats().pool.namespaces_recycled, 1u);
  EXPECT_TRUE(cache_->pool().FindNamespace(kA).has_value());
  EXPECT_FALSE(cache_->pool().FindNamespace(kB).has_value());
  ExpectInvariants();
  const std::string before = cache_->DebugString();
  const absl::StatusOr<SequenceId> d = Alloc(kBob, kD, 16);  // A and C are both in use
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("namespace table is full"));
  EXPECT_EQ(cache_->DebugString(), before);
  ASSERT_TRUE(cache_->Free(kAlice, empty).ok());
  EXPECT_TRUE(Alloc(kBob, kD, 16).ok());  // A was recycled
  EXPECT_FALSE(cache_->pool().FindNamespace(kA).has_value());
  ExpectInvariants();
}

// A full table whose namespaces all hold something: a call for a new one sweeps the table once
// for idle slots (O(slots), under the engine's lock) and is refused. Until a block or a sequence
// is freed no slot can have gone idle, so the same call again is refused without another sweep:
// a client asking over and over must not make each refusal sweep again.
TEST_F(KvCacheLimitsTest, AFullTableIsSweptAgainOnlyOnceSomethingIsFreed) {
  Make({.max_namespaces = 2});
  const SequenceId in_a = *Alloc(kAlice, kA, 0);
  std::vector<SequenceId> in_b;
  for (int i = 0; i < 64; ++i) in_b.push_back(*Alloc(kAlice, kB, 0));
  const auto sweeps = [&] { return cache_->pool().idle_sweeps(); };
  const uint64_t start = sweeps();
  EXPECT_EQ(Alloc(kBob, kC, 16).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(sweeps() - start, 1u);
  for (int i = 0; i < 10; ++i) {
    const absl::Status refused = Alloc(kBob, kC, 16).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(refused.message()), HasSubstr("namespace table is full"));
  }
  EXPECT_EQ(sweeps() - start, 1u);
  // A freed sequence might have left its namespace idle: one sweep more (B still holds some).
  ASSERT_TRUE(cache_->Free(kAlice, in_b.back()).ok());
  EXPECT_EQ(Alloc(kBob, kC, 16).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(sweeps() - start, 2u);
  // A's last sequence gone, its slot is found.
  ASSERT_TRUE(cache_->Free(kAlice, in_a).ok());
  EXPECT_TRUE(Alloc(kBob, kC, 16).ok());
  ExpectInvariants();
}

// Recycling a namespace slot costs the same however large the pool and however many sequences
// others hold. A client that frees its sequence and asks for a new namespace, round after round,
// with the table full, made each call walk every block twice (to find the idle slots, then to
// re-tag the recycled slot's blocks for the scrub) and every sequence once, under the engine's
// lock. Each round still recycles a slot, and the blocks it left are scrubbed for the next
// namespace.
TEST_F(KvCacheLimitsTest, RecyclingASlotWalksNoBlockAndNoSequence) {
  constexpr int kBystanders = 256;
  Make({.num_blocks = kBystanders * 16 + 4, .max_namespaces = 2});
  for (int i = 0; i < kBystanders; ++i) ASSERT_TRUE(Alloc(kAlice, kA, 16 * 16).ok());
  const auto visited = [&] { return KvCacheManagerTestPeer::Visited(*cache_); };
  const uint64_t visited_before = visited();
  const uint64_t swept_before = cache_->pool().blocks_swept();
  const uint64_t recycled_before = cache_->pool().stats().namespaces_recycled;
  SequenceId mine = *Alloc(kBob, NamespaceId(1000), 16);
  for (int round = 1; round <= 50; ++round) {
    ASSERT_TRUE(cache_->Free(kBob, mine).ok());
    DevicePlan plan;
    const absl::StatusOr<SequenceId> next = Alloc(kBob, NamespaceId(1000 + round), 16, &plan);
    ASSERT_TRUE(next.ok()) << next.status();
    ASSERT_EQ(plan.fills.size(), 1u);
    EXPECT_TRUE(plan.fills[0].scrub) << "round " << round;  // the last namespace's block
    mine = *next;
  }
  EXPECT_EQ(cache_->pool().stats().namespaces_recycled - recycled_before, 50u);
  EXPECT_EQ(visited() - visited_before, 0u);
  EXPECT_EQ(cache_->pool().blocks_swept() - swept_before, 0u);
  ExpectInvariants();
}

// What a refused call's sweep found bounds what the next one finds only for the slots the call did
// not keep for itself: a batch naming idle A beside new C keeps A's slot (A is in use by the
// batch), and is refused; C alone then finds A idle and takes its slot.
TEST_F(KvCacheLimitsTest, ASlotARefusedBatchKeptIsFoundByTheNextCall) {
  Make({.max_namespaces = 2});
  ASSERT_TRUE(cache_->Free(kAlice, *Alloc(kAlice, kA, 0)).ok());  // A registered, idle
  const SequenceId in_b = *Alloc(kAlice, kB, 0);
  std::vector<AllocateResult> results;
  DevicePlan plan;
  const std::vector<AllocateRequest> both = {{.ns = kA, .num_tokens = 16},
                                             {.ns = kC, .num_tokens = 16}};
  EXPECT_EQ(cache_->AllocateBatch(kBob, both, &results, &plan).code(),
            absl::StatusCode::kResourceExhausted);
  const absl::StatusOr<SequenceId> c = Alloc(kBob, kC, 16);
  EXPECT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(cache_->pool().FindNamespace(kA).has_value());
  ASSERT_TRUE(cache_->Free(kAlice, in_b).ok());
  ExpectInvariants();
}

// Cached blocks keep their namespace's slot; once evicted the namespace is idle.
TEST_F(KvCacheLimitsTest, CachedBlocksKeepTheirNamespace) {
  Make({.num_blocks = 4, .max_namespaces = 1});
  std::vector<int32_t> prompt(32, 5);
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> a =
      cache_->Allocate(kAlice, {.ns = kA, .num_tokens = 32, .prompt = prompt}, &plan);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(cache_->Commit(kAlice, a->sequence, 32, {}).ok());
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence).ok());
  ASSERT_EQ(cache_->pool().num_cached(), 2);
  EXPECT_EQ(Alloc(kBob, kB, 16).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache_->EvictCached(4), 2);
  EXPECT_TRUE(Alloc(kBob, kB, 16).ok());
  ExpectInvariants();
}

// The stale-KV hole through the manager: A's blocks go back to the free list still tagged with
// A's slot; B gets that slot and the same blocks. They must come with a scrub.
TEST_F(KvCacheLimitsTest, BlocksOfARecycledNamespaceAreScrubbedForItsSuccessor) {
  Make({.num_blocks = 2, .max_namespaces = 1});
  ASSERT_TRUE(cache_->Free(kAlice, *Alloc(kAlice, kA, 32)).ok());
  DevicePlan plan;
  const absl::StatusOr<SequenceId> b = Alloc(kBob, kB, 32, &plan);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(plan.fills.size(), 2u);
  EXPECT_TRUE(plan.fills[0].scrub);
  EXPECT_TRUE(plan.fills[1].scrub);
  EXPECT_EQ(cache_->Find(*b)->slot, NamespaceSlot(1));  // A's slot, reused
  ExpectInvariants();
}

// Quotas are kept by namespace, not slot: a namespace that was recycled comes back bounded.
TEST_F(KvCacheLimitsTest, AQuotaOutlivesItsNamespaceSlot) {
  Make({.max_namespaces = 1});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kA, 1).ok());
  EXPECT_FALSE(cache_->pool().FindNamespace(kA).has_value());  // a quota takes no slot
  ASSERT_TRUE(cache_->Free(kAlice, *Alloc(kAlice, kA, 16)).ok());
  ASSERT_TRUE(cache_->Free(kBob, *Alloc(kBob, kB, 16)).ok());  // A's slot recycled
  ASSERT_TRUE(Alloc(kAlice, kA, 16).ok());                     // and B's in turn
  EXPECT_EQ(Alloc(kAlice, kA, 16).status().code(), absl::StatusCode::kResourceExhausted);
  ExpectInvariants();
}

// Seeded: six namespaces come and go through a three-slot table with prefix caching, forks and
// evictions. A simulated arena records which namespace wrote each block; whatever the recycling,
// no hand-out may show a namespace another one's bytes (DESIGN.md §4.6). The table is refused
// exactly when every slot is in use (a live sequence, or a block not FREE), refusals change
// nothing, and the invariants hold after every step.
TEST_F(KvCacheLimitsTest, RandomRecyclingNeverLeaksAnotherNamespacesBytes) {
  constexpr int32_t kBlocks = 24;
  constexpr int32_t kSlots = 3;
  Make({.num_blocks = kBlocks, .max_namespaces = kSlots});
  std::mt19937 rng(12);
  std::vector<uint64_t> written(kBlocks, 0);  // namespace whose bytes the block holds; 0: zeros
  std::vector<SequenceId> live;
  auto execute = [&](const DevicePlan& plan) {
    for (const BlockCopy& c : plan.copies) written[c.dst.value()] = written[c.src.value()];
    for (const BlockFill& f : plan.fills) {
      if (f.scrub) written[f.block.value()] = 0;
      const uint64_t owner = cache_->pool().owner(f.block).value();
      ASSERT_TRUE(written[f.block.value()] == 0 || written[f.block.value()] == owner)
          << "block " << f.block.value() << " handed to namespace " << owner
          << " still holds namespace " << written[f.block.value()] << "'s KV";
    }
  };
  auto in_use = [&] {
    absl::flat_hash_set<uint64_t> used;
    for (SequenceId id : live) used.insert(cache_->Find(id)->ns.value());
    for (int32_t b = 0; b < kBlocks; ++b) {
      if (cache_->pool().state(BlockId(b)) != BlockState::kFree) {
        used.insert(cache_->pool().owner(BlockId(b)).value());
      }
    }
    return used;
  };
  uint64_t recycled_refusals = 0;
  for (int step = 0; step < 10'000; ++step) {
    const uint32_t op = rng() % 10;
    if (op < 4 || live.empty()) {
      const NamespaceId ns(1 + rng() % 6);
      const SessionId session(1 + rng() % 3);
      const int64_t tokens = rng() % 49;
      std::vector<int32_t> prompt(static_cast<size_t>(rng() % (tokens + 1)));
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i % 5);
      const bool table_full = !cache_->pool().FindNamespace(ns).has_value() &&
                              static_cast<int32_t>(in_use().size()) >= kSlots;
      const std::string before = cache_->DebugString();
      DevicePlan plan;
      const absl::StatusOr<AllocateResult> r =
          cache_->Allocate(session, {.ns = ns, .num_tokens = tokens, .prompt = prompt}, &plan);
      const bool refused_for_table =
          !r.ok() && absl::StrContains(r.status().message(), "namespace table is full");
      ASSERT_EQ(refused_for_table, table_full) << step << ": " << r.status();
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
        ASSERT_EQ(cache_->DebugString(), before) << step;
        recycled_refusals += refused_for_table;
      } else {
        execute(plan);
        for (BlockId b : cache_->Find(r->sequence)->table) written[b.value()] = ns.value();
        live.push_back(r->sequence);
      }
    } else if (op < 8) {
      const size_t k = rng() % live.size();
      const Sequence* seq = cache_->Find(live[k]);
      const OnFree how = rng() % 2 ? OnFree::kCommit : OnFree::kDiscard;
      ASSERT_TRUE(cache_->Free(seq->session, live[k], how).ok());
      live.erase(live.begin() + static_cast<ptrdiff_t>(k));
    } else if (op < 9) {
      const Sequence* seq = cache_->Find(live[rng() % live.size()]);
      DevicePlan plan;
      const absl::StatusOr<SequenceId> child = cache_->Fork(seq->session, seq->id, &plan);
      if (child.ok()) {
        execute(plan);
        live.push_back(*child);
      }
    } else {
      cache_->EvictCached(1 + rng() % 4);
    }
    const absl::Status ok = cache_->CheckInvariants();
    ASSERT_TRUE(ok.ok()) << step << ": " << ok;
  }
  // The run exercised what it is about.
  EXPECT_GT(cache_->stats().pool.namespaces_recycled, 300u);  // 488 with this seed
  EXPECT_GT(cache_->stats().pool.scrubs, 1000u);              // 2917
  EXPECT_GT(recycled_refusals, 500u);                         // 1864
}

TEST_F(KvCacheLimitsTest, TheEventByteBudgetReachesTheLog) {
  Make({.event_capacity_bytes = 4096});
  ASSERT_NE(cache_->events(), nullptr);
  EXPECT_EQ(cache_->events()->max_bytes(), 4096u);
  std::vector<int32_t> prompt(16 * 16);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i);
  for (int round = 0; round < 8; ++round) {
    prompt[0] = round;  // a new chain each time
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> a =
        cache_->Allocate(kAlice, {.ns = kA, .num_tokens = 256, .prompt = prompt}, &plan);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
    EXPECT_LE(cache_->events()->bytes(), 4096u);
  }
  EXPECT_GT(cache_->events()->dropped(), 0u);
  std::vector<KvEvent> out;
  EXPECT_FALSE(cache_->events()->ReadFrom(1, 100, &out));
  ExpectInvariants();
}

}  // namespace
}  // namespace kvpool
