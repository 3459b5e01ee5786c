// Namespace quotas keep running totals (KvCacheManager::Quota): checking a quota costs the same
// however many namespaces share it. Each cache salt a client picks is its own namespace, so one
// caller could make its tenant's quota group tens of thousands of namespaces large, and every
// Allocate, Grow, Fork and pin of that tenant walked them all under the engine's lock. These tests
// show the walk is gone and that the totals stay exact while namespaces hold blocks, pins, window
// blocks and state slots and move between quotas, and while their pool slots are recycled.

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/kv_cache_manager_test_peer.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {
namespace {

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr int32_t kBlockSize = 16;
constexpr int64_t kBlockBytes = 100;
constexpr int64_t kWindowBytes = 50;
constexpr int64_t kStateBytes = 250;
constexpr int64_t kSecond = 1'000'000'000;
constexpr uint64_t kGroupA = 0xA;
constexpr uint64_t kGroupB = 0xB;

std::vector<int32_t> Prompt(int32_t n, int32_t seed = 0) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = 7 * i + 1 + 1000 * seed;
  return out;
}

class QuotaTotalsTest : public ::testing::Test {
 protected:
  void Make(int32_t max_namespaces, bool hybrid = true, int32_t num_blocks = 96) {
    auto cache = KvCacheManager::Create({.block_size = kBlockSize,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 16,
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .max_namespaces = max_namespaces,
                                         .max_pins = 64,
                                         .state_slots = hybrid ? 12 : 0,
                                         .window_blocks = hybrid ? 96 : 0,
                                         .window_tokens = hybrid ? 32 : 0,
                                         .block_bytes = kBlockBytes,
                                         .window_block_bytes = hybrid ? kWindowBytes : 0,
                                         .state_bytes = hybrid ? kStateBytes : 0});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  absl::StatusOr<SequenceId> Alloc(NamespaceId ns, int64_t tokens,
                                   std::span<const int32_t> prompt = {},
                                   SessionId session = kAlice) {
    DevicePlan plan;
    absl::StatusOr<AllocateResult> r =
        cache_->Allocate(session, {.ns = ns, .num_tokens = tokens, .prompt = prompt}, &plan);
    if (!r.ok()) return r.status();
    return r->sequence;
  }

  // Joins `ns` to quota `group` (0: its own) and records it, as the manager should.
  void Join(NamespaceId ns, int64_t max_blocks, uint64_t group) {
    ASSERT_TRUE(cache_->SetNamespaceQuota(ns, max_blocks, group).ok());
    Leave(ns);
    if (max_blocks != kUnlimited) {
      members_[group != 0 ? group : (uint64_t{1} << 63) | ns.value()].push_back(ns);
    }
  }
  void Leave(NamespaceId ns) {
    for (auto& [key, list] : members_) std::erase(list, ns);
    std::erase_if(members_, [](const auto& entry) { return entry.second.empty(); });
  }

  // What the quota's members hold, walked one by one through the public accessors: what
  // QuotaUsage summed before it kept totals.
  int64_t Walked(const std::vector<NamespaceId>& members) const {
    int64_t blocks = 0;
    int64_t window = 0;
    int64_t states = 0;
    for (NamespaceId ns : members) {
      if (std::optional<NamespaceSlot> slot = cache_->pool().FindNamespace(ns)) {
        blocks += cache_->pool().active_blocks(*slot);
      }
      if (cache_->cache() != nullptr) blocks += cache_->cache()->pin_held(ns);
      if (const BlockPool* w = cache_->window()) {
        if (std::optional<NamespaceSlot> slot = w->FindNamespace(ns)) {
          window += w->active_blocks(*slot);
        }
      }
      if (cache_->states() != nullptr) {
        cache_->ForEachSequence([&](const Sequence& seq) { states += seq.ns == ns ? 1 : 0; });
      }
    }
    const bool hybrid = cache_->window() != nullptr;
    return blocks * kBlockBytes + (hybrid ? window * kWindowBytes + states * kStateBytes : 0);
  }

  // Every quota's used bytes are its members' walk, and the invariants (which recount the
  // totals) hold.
  void ExpectExact() {
    const absl::Status status = cache_->CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
    for (const auto& [key, members] : members_) {
      for (NamespaceId ns : members) {
        const std::optional<KvCacheManager::QuotaUse> use = cache_->QuotaOf(ns);
        ASSERT_TRUE(use.has_value()) << "namespace " << ns;
        ASSERT_EQ(use->used, Walked(members)) << "namespace " << ns << " of quota " << key;
      }
    }
  }

  ManualClock clock_;
  testing::ManualFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
  std::map<uint64_t, std::vector<NamespaceId>> members_;  // the test's own record, by quota
};

// The bug: a quota group of 10,000 namespaces made every Allocate, Grow, Fork and QuotaOf of any
// of them visit all 10,000.
TEST_F(QuotaTotalsTest, CheckingAGroupOfManyNamespacesVisitsNone) {
  Make(kMaxNamespaceSlots, /*hybrid=*/false);
  constexpr int kMembers = 10'000;
  for (int i = 1; i <= kMembers; ++i) {
    ASSERT_TRUE(cache_->SetNamespaceQuota(NamespaceId(i), 64, kGroupA).ok());
  }
  const uint64_t before = KvCacheManagerTestPeer::Visited(*cache_);
  absl::StatusOr<SequenceId> seq = Alloc(NamespaceId(kMembers / 2), 2 * kBlockSize);
  ASSERT_TRUE(seq.ok()) << seq.status();
  DevicePlan plan;
  ASSERT_TRUE(cache_->Grow(kAlice, *seq, 3 * kBlockSize, &plan).ok());
  ASSERT_TRUE(cache_->Fork(kAlice, *seq, &plan).ok());
  EXPECT_EQ(cache_->QuotaOf(NamespaceId(7))->used, 3 * kBlockBytes);
  EXPECT_EQ(KvCacheManagerTestPeer::Visited(*cache_) - before, 0u)
      << "quota members visited by one Allocate, Grow, Fork and QuotaOf";
  // Leaving the group and joining it again cost the same (no search through the members).
  for (int i = 1; i <= kMembers; i += 2) {
    ASSERT_TRUE(cache_->SetNamespaceQuota(NamespaceId(i), kUnlimited).ok());
  }
  EXPECT_EQ(KvCacheManagerTestPeer::Visited(*cache_) - before, 0u);
  // The invariant check alone walks them, to recount the totals.
  ASSERT_TRUE(cache_->CheckInvariants().ok());
  EXPECT_EQ(KvCacheManagerTestPeer::Visited(*cache_) - before, uint64_t{kMembers / 2});
}

TEST_F(QuotaTotalsTest, TotalsFollowANamespaceThatMovesWhileHoldingBlocksAndPins) {
  Make(kMaxNamespaceSlots);
  const NamespaceId a(1), b(2), c(3);
  Join(a, 1000, kGroupA);
  Join(b, 1000, kGroupA);
  Join(c, 1000, kGroupB);
  // a: a published prefix, pinned (pin-held once CACHED), and a live sequence on top of it.
  const std::vector<int32_t> prompt = Prompt(3 * kBlockSize);
  absl::StatusOr<SequenceId> first = Alloc(a, 3 * kBlockSize, prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(cache_->Free(kAlice, *first, OnFree::kCommit).ok());
  absl::StatusOr<PinId> pin = cache_->PinPrefix(kAlice, a, prompt, 60 * kSecond, 0);
  ASSERT_TRUE(pin.ok()) << pin.status();
  ExpectExact();
  EXPECT_EQ(cache_->QuotaOf(a)->used, 3 * kBlockBytes);  // pinned, CACHED
  absl::StatusOr<SequenceId> live = Alloc(a, 5 * kBlockSize, Prompt(2 * kBlockSize));
  ASSERT_TRUE(live.ok()) << live.status();
  absl::StatusOr<SequenceId> other = Alloc(b, 2 * kBlockSize, {}, kBob);
  ASSERT_TRUE(other.ok()) << other.status();
  ExpectExact();
  const int64_t held_by_a = Walked({a});
  EXPECT_GT(held_by_a, 3 * kBlockBytes);
  EXPECT_EQ(cache_->QuotaOf(b)->used, held_by_a + Walked({b}));

  // a leaves group A for group B with everything it holds.
  Join(a, 1000, kGroupB);
  ExpectExact();
  EXPECT_EQ(cache_->QuotaOf(b)->used, Walked({b}));
  EXPECT_EQ(cache_->QuotaOf(c)->used, held_by_a);
  // Its pinned blocks turn ACTIVE under a sequence that adopts them, then CACHED again.
  absl::StatusOr<SequenceId> adopter = Alloc(a, 4 * kBlockSize, prompt);
  ASSERT_TRUE(adopter.ok()) << adopter.status();
  ExpectExact();
  ASSERT_TRUE(cache_->Free(kAlice, *adopter).ok());
  ExpectExact();
  // Its own quota, then none: the group forgets it, and a lone quota is dropped.
  Join(a, 1000, 0);
  ExpectExact();
  EXPECT_EQ(cache_->QuotaOf(c)->used, 0);
  Join(a, kUnlimited, 0);
  ExpectExact();
  EXPECT_FALSE(cache_->QuotaOf(a).has_value());
  // Back into group A; the pin ends while it is there.
  Join(a, 1000, kGroupA);
  ExpectExact();
  ASSERT_TRUE(cache_->Unpin(kAlice, *pin).ok());
  ASSERT_TRUE(cache_->Free(kAlice, *live).ok());
  ExpectExact();
  EXPECT_EQ(cache_->QuotaOf(a)->used, Walked({b}));
}

TEST_F(QuotaTotalsTest, ARecycledSlotCountsForItsNewNamespacesQuota) {
  Make(/*max_namespaces=*/2);
  const NamespaceId a(1), b(2), c(3);
  Join(a, 1000, kGroupA);
  Join(b, 1000, 0);
  Join(c, 1000, kGroupB);
  absl::StatusOr<SequenceId> sa = Alloc(a, 2 * kBlockSize);
  absl::StatusOr<SequenceId> sb = Alloc(b, kBlockSize);
  ASSERT_TRUE(sa.ok() && sb.ok());
  const std::optional<NamespaceSlot> slot_a = cache_->pool().FindNamespace(a);
  ASSERT_TRUE(slot_a.has_value());
  ExpectExact();
  // The table is full; a frees all it has, and c takes its slot.
  ASSERT_TRUE(cache_->Free(kAlice, *sa).ok());
  absl::StatusOr<SequenceId> sc = Alloc(c, 3 * kBlockSize);
  ASSERT_TRUE(sc.ok()) << sc.status();
  EXPECT_EQ(cache_->pool().FindNamespace(c), slot_a);
  EXPECT_FALSE(cache_->pool().FindNamespace(a).has_value());
  ExpectExact();
  EXPECT_EQ(cache_->QuotaOf(a)->used, 0);
  EXPECT_GE(cache_->QuotaOf(c)->used, 3 * kBlockBytes);
  // a moves to c's group while it has no slot, then comes back into b's (freed) one.
  Join(a, 1000, kGroupB);
  ASSERT_TRUE(cache_->Free(kAlice, *sb).ok());
  absl::StatusOr<SequenceId> again = Alloc(a, kBlockSize);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectExact();
  EXPECT_EQ(cache_->QuotaOf(a)->used, Walked({a, c}));
  // b gets a slot again only by recycling one: c's, once c is done.
  ASSERT_TRUE(cache_->Free(kAlice, *sc).ok());
  Join(c, kUnlimited, 0);
  absl::StatusOr<SequenceId> sb2 = Alloc(b, 2 * kBlockSize);
  ASSERT_TRUE(sb2.ok()) << sb2.status();
  ExpectExact();
}

// What the random test holds between steps.
struct RandomHeld {
  struct Published {
    NamespaceId ns;
    int32_t seed = 0;
    int32_t blocks = 0;
  };
  std::vector<SequenceId> live;
  std::vector<PinId> pins;
  std::vector<Published> published;  // prompts freed with OnFree::kCommit (maybe evicted since)
};

class QuotaTotalsRandomTest : public QuotaTotalsTest {
 protected:
  static constexpr int kNamespaces = 12;

  // One random operation: allocate, grow, fork, free, pin, unpin, or move a namespace between
  // quotas. Returns what the manager said.
  absl::Status Step(std::mt19937_64& rng, RandomHeld& held) {
    clock_.Advance(rng() % 50 == 0 ? 20 * kSecond : 1000);
    const uint64_t dice = rng() % 100;
    std::vector<SequenceId>& live = held.live;
    // Few live sequences at once, so that namespaces go idle and their slots are recycled.
    if ((dice < 30 && live.size() < 3) || live.empty()) return Allocate(rng, held);
    if (dice < 45) {
      DevicePlan plan;
      const SequenceId s = live[rng() % live.size()];
      return cache_->Grow(
          kAlice, s, cache_->Find(s)->num_tokens + 1 + static_cast<int64_t>(rng() % 30), &plan);
    }
    if (dice < 55) {
      DevicePlan plan;
      absl::StatusOr<SequenceId> s = cache_->Fork(kAlice, live[rng() % live.size()], &plan);
      if (s.ok()) live.push_back(*s);
      return s.status();
    }
    if (dice < 72 || live.size() >= 3) {
      const size_t k = rng() % live.size();
      const SequenceId s = live[k];
      live.erase(live.begin() + static_cast<ptrdiff_t>(k));
      return cache_->Free(kAlice, s, rng() % 4 == 0 ? OnFree::kCommit : OnFree::kDiscard);
    }
    if (dice < 80 && !held.published.empty()) {
      // Some of a published prompt (NOT_FOUND once evicted, or never committed).
      const RandomHeld::Published& p = held.published[rng() % held.published.size()];
      const std::vector<int32_t> prompt =
          Prompt((1 + static_cast<int32_t>(rng() % p.blocks)) * kBlockSize, p.seed);
      absl::StatusOr<PinId> pin = cache_->PinPrefix(
          kAlice, p.ns, prompt, static_cast<int64_t>(1 + rng() % 40) * kSecond, 0);
      if (pin.ok()) held.pins.push_back(*pin);
      return pin.status();
    }
    if (dice < 84 && !held.pins.empty()) {
      const size_t k = rng() % held.pins.size();
      const PinId pin = held.pins[k];
      held.pins.erase(held.pins.begin() + static_cast<ptrdiff_t>(k));
      return cache_->Unpin(kAlice, pin);  // NOT_FOUND once it has expired
    }
    // Moves: a namespace's own quota, one of three groups, or none; bounds tight enough that
    // quotas refuse calls now and then.
    const NamespaceId ns = NamespaceOf(rng());
    const uint64_t where = rng() % 5;
    const int64_t bound = static_cast<int64_t>(8 + rng() % 40);
    Join(ns, where == 4 ? kUnlimited : bound, where == 3 ? 0 : 0x100 + where);
    return absl::OkStatus();
  }

 private:
  static NamespaceId NamespaceOf(uint64_t r) { return NamespaceId(1 + r % kNamespaces); }

  absl::Status Allocate(std::mt19937_64& rng, RandomHeld& held) {
    const int32_t blocks = static_cast<int32_t>(rng() % 4);
    const int32_t seed = static_cast<int32_t>(rng() % 3);
    const std::vector<int32_t> prompt = Prompt(blocks * kBlockSize + 3, seed);
    const NamespaceId ns = NamespaceOf(rng());
    absl::StatusOr<SequenceId> s =
        Alloc(ns, static_cast<int64_t>(prompt.size() + rng() % 200), prompt);
    if (s.ok()) held.live.push_back(*s);
    if (s.ok() && blocks > 0) held.published.push_back({ns, seed, blocks});
    return s.status();
  }
};

// Seeded random operations over a dozen namespaces that move between quotas, in a table of four
// slots (so slots are recycled all the time), with pins, the prefix cache and both other groups.
// After every step the invariants recount the totals and each quota's use is its members' walk.
TEST_F(QuotaTotalsRandomTest, RandomOperationsKeepTheTotalsExact) {
  Make(/*max_namespaces=*/4, /*hybrid=*/true, /*num_blocks=*/40);
  std::mt19937_64 rng(20261207);
  RandomHeld held;
  std::map<std::string, int> outcomes;
  for (int step = 0; step < 100'000; ++step) {
    const absl::Status status = Step(rng, held);
    ++outcomes[std::string(absl::StatusCodeToString(status.code()))];
    const std::optional<Shortfall> shortfall = GetShortfall(status);
    if (shortfall.has_value() && shortfall->resource == Resource::kNamespaceQuota) {
      ++outcomes["namespace quota"];
    }
    ExpectExact();
    if (HasFatalFailure()) FAIL() << "at step " << step;
  }
  const KvCacheStats s = cache_->stats();
  // What the run claims to exercise.
  EXPECT_GT(s.pool.namespaces_recycled, 500u);
  EXPECT_GT(s.pins_made, 500u);
  EXPECT_GT(outcomes["namespace quota"], 1000);
  std::printf("recycled=%llu pins=%llu",
              static_cast<unsigned long long>(s.pool.namespaces_recycled),
              static_cast<unsigned long long>(s.pins_made));
  for (const auto& [what, n] : outcomes) std::printf(" %s=%d", what.c_str(), n);
  std::printf("\n");
}

}  // namespace
}  // namespace kvpool
