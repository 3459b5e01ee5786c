// What each session holds (KvCacheManager::HoldingsOf, HeldIn;
// kvpool/kv_cache_manager_holdings.cc): its sequences and pins by id and by namespace, kept through
// every call that makes or ends one (allocate, fork, free, a session's end, pins made, unpinned or
// expired), and what FreeSession and ListPins(session) cost because of it. CheckInvariants recounts
// the holdings after every step.

#include <algorithm>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "tests/kvpool/kv_cache_manager_test_peer.h"
#include "tests/kvpool/tokens.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using InNamespace = SessionHoldings::InNamespace;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kNs(100);
constexpr NamespaceId kOther(200);
constexpr int32_t kBs = 16;
constexpr int64_t kSecond = 1'000'000'000;

using test_tokens::Tokens;

class KvCacheManagerHoldingsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cache = KvCacheManager::Create({.block_size = kBs,
                                         .num_blocks = 64,
                                         .max_blocks_per_seq = 16,
                                         .clock = &clock_,
                                         .max_pin_ttl_ns = 600 * kSecond});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }
  void TearDown() override { EXPECT_TRUE(cache_->CheckInvariants().ok()); }

  SequenceId Alloc(SessionId s, NamespaceId ns, const std::vector<int32_t>& prompt = {},
                   int64_t tokens = 0) {
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> r = cache_->Allocate(
        s,
        {.ns = ns,
         .num_tokens = std::max<int64_t>(tokens, static_cast<int64_t>(prompt.size())),
         .prompt = prompt},
        &plan);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->sequence : SequenceId(0);
  }
  // A pin of `s` over a prefix of `ns` it publishes first.
  PinId PinOwn(SessionId s, NamespaceId ns, int32_t start, int64_t ttl_ns = 60 * kSecond) {
    const std::vector<int32_t> prompt = Tokens(start, kBs);
    EXPECT_TRUE(cache_->Free(s, Alloc(s, ns, prompt), OnFree::kCommit).ok());
    const absl::StatusOr<PinId> pin = cache_->PinPrefix(s, ns, prompt, ttl_ns, 0);
    EXPECT_TRUE(pin.ok()) << pin.status();
    return pin.ok() ? *pin : PinId(0);
  }
  // Its sequences and pins, by id.
  std::vector<SequenceId> SequencesOf(SessionId s) const {
    const SessionHoldings* held = cache_->HoldingsOf(s);
    std::vector<SequenceId> out;
    if (held) out.assign(held->sequences.begin(), held->sequences.end());
    std::sort(out.begin(), out.end());
    return out;
  }
  std::vector<PinId> PinsOf(SessionId s) const {
    const SessionHoldings* held = cache_->HoldingsOf(s);
    std::vector<PinId> out;
    if (held) out.assign(held->pins.begin(), held->pins.end());
    std::sort(out.begin(), out.end());
    return out;
  }

  ManualClock clock_{1};
  std::unique_ptr<KvCacheManager> cache_;
};

TEST_F(KvCacheManagerHoldingsTest, ASessionThatHoldsNothingHasNoHoldings) {
  EXPECT_EQ(cache_->HoldingsOf(kAlice), nullptr);
  EXPECT_EQ(cache_->HeldIn(kAlice, kNs), InNamespace{});
  const SequenceId id = Alloc(kAlice, kNs);
  ASSERT_TRUE(cache_->Free(kAlice, id).ok());
  EXPECT_EQ(cache_->HoldingsOf(kAlice), nullptr);
  // Its emptied entry stays for its next sequence (nothing to allocate again), until its end.
  EXPECT_EQ(KvCacheManagerTestPeer::SessionsBooked(*cache_), 1u);
  EXPECT_EQ(cache_->FreeSession(kAlice), 0);
  EXPECT_EQ(KvCacheManagerTestPeer::SessionsBooked(*cache_), 0u);
}

TEST_F(KvCacheManagerHoldingsTest, SequencesAreFiledByIdAndNamespace) {
  const SequenceId a = Alloc(kAlice, kNs);
  const SequenceId b = Alloc(kAlice, kOther);
  const SequenceId c = Alloc(kAlice, kNs);
  const SequenceId theirs = Alloc(kBob, kNs);
  EXPECT_THAT(SequencesOf(kAlice), ElementsAre(a, b, c));
  EXPECT_THAT(SequencesOf(kBob), ElementsAre(theirs));
  EXPECT_EQ(cache_->HeldIn(kAlice, kNs), (InNamespace{.sequences = 2}));
  EXPECT_EQ(cache_->HeldIn(kAlice, kOther), (InNamespace{.sequences = 1}));
  EXPECT_EQ(cache_->HeldIn(kBob, kOther), InNamespace{});

  ASSERT_TRUE(cache_->Free(kAlice, b).ok());
  EXPECT_THAT(SequencesOf(kAlice), ElementsAre(a, c));
  EXPECT_FALSE(cache_->HoldingsOf(kAlice)->namespaces.contains(kOther));
  EXPECT_EQ(cache_->HeldIn(kAlice, kOther), InNamespace{});
}

TEST_F(KvCacheManagerHoldingsTest, AForkIsFiledWithItsParentsSessionAndNamespace) {
  const SequenceId parent = Alloc(kAlice, kOther, Tokens(0, 24));
  DevicePlan plan;
  const absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, parent, &plan);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_THAT(SequencesOf(kAlice), ElementsAre(parent, *child));
  EXPECT_EQ(cache_->HeldIn(kAlice, kOther), (InNamespace{.sequences = 2}));
  // A fork refused (another session's sequence) files nothing.
  EXPECT_TRUE(absl::IsPermissionDenied(cache_->Fork(kBob, parent, &plan).status()));
  EXPECT_EQ(cache_->HoldingsOf(kBob), nullptr);
  ASSERT_TRUE(cache_->Free(kAlice, parent).ok());
  EXPECT_THAT(SequencesOf(kAlice), ElementsAre(*child));
}

TEST_F(KvCacheManagerHoldingsTest, PinsAreFiledUntilUnpinnedOrExpired) {
  const PinId kept = PinOwn(kAlice, kNs, 0);
  const PinId unpinned = PinOwn(kAlice, kOther, 100);
  const PinId expiring = PinOwn(kAlice, kNs, 200, 5 * kSecond);
  EXPECT_THAT(PinsOf(kAlice), ElementsAre(kept, unpinned, expiring));
  EXPECT_EQ(cache_->HeldIn(kAlice, kNs), (InNamespace{.pins = 2}));
  EXPECT_EQ(cache_->HeldIn(kAlice, kOther), (InNamespace{.pins = 1}));

  ASSERT_TRUE(cache_->Unpin(kAlice, unpinned).ok());
  EXPECT_EQ(cache_->HeldIn(kAlice, kOther), InNamespace{});

  clock_.Advance(5 * kSecond);
  // Its time is up: ListPins leaves it out, but it is held until a call expires it.
  EXPECT_EQ(cache_->ListPins(kAlice).size(), 1u);
  EXPECT_EQ(cache_->HeldIn(kAlice, kNs), (InNamespace{.pins = 2}));
  EXPECT_EQ(cache_->ExpirePins(), 1);
  EXPECT_THAT(PinsOf(kAlice), ElementsAre(kept));
  EXPECT_EQ(cache_->HeldIn(kAlice, kNs), (InNamespace{.pins = 1}));

  const SequenceId seq = Alloc(kAlice, kNs);
  EXPECT_EQ(cache_->HeldIn(kAlice, kNs), (InNamespace{.sequences = 1, .pins = 1}));
  ASSERT_TRUE(cache_->Free(kAlice, seq).ok());
  ASSERT_TRUE(cache_->Unpin(kAlice, kept).ok());
  EXPECT_EQ(cache_->HoldingsOf(kAlice), nullptr);
}

TEST_F(KvCacheManagerHoldingsTest, FreeingASessionEmptiesItsHoldingsAndWalksOnlyThem) {
  for (int i = 0; i < 20; ++i) Alloc(kBob, kNs);
  const PinId bobs = PinOwn(kBob, kNs, 500);
  Alloc(kAlice, kNs);
  Alloc(kAlice, kOther);
  PinOwn(kAlice, kNs, 0);
  PinOwn(kAlice, kOther, 100, 5 * kSecond);
  clock_.Advance(5 * kSecond);  // one of its pins is due: the first Free expires it

  const uint64_t before = KvCacheManagerTestPeer::Visited(*cache_);
  EXPECT_EQ(cache_->FreeSession(kAlice), 2);
  EXPECT_EQ(KvCacheManagerTestPeer::Visited(*cache_) - before, 3u) << "2 sequences and 1 pin";
  EXPECT_EQ(cache_->HoldingsOf(kAlice), nullptr);
  EXPECT_EQ(SequencesOf(kBob).size(), 20u);
  EXPECT_THAT(PinsOf(kBob), ElementsAre(bobs));
  EXPECT_EQ(cache_->stats().pins, 1);
}

TEST_F(KvCacheManagerHoldingsTest, FindPinFindsAPinUntilItEnds) {
  const PinId pin = PinOwn(kAlice, kOther, 0, 5 * kSecond);
  const uint64_t before = KvCacheManagerTestPeer::Visited(*cache_);
  const PinInfo* found = cache_->FindPin(pin);
  ASSERT_NE(found, nullptr);
  EXPECT_EQ(*found, cache_->ListPins(kAlice).at(0));
  EXPECT_EQ(KvCacheManagerTestPeer::Visited(*cache_) - before, 1u) << "ListPins' walk only";
  clock_.Advance(5 * kSecond);
  EXPECT_NE(cache_->FindPin(pin), nullptr) << "its time is up, but no call has expired it";
  cache_->ExpirePins();
  EXPECT_EQ(cache_->FindPin(pin), nullptr);
  EXPECT_EQ(cache_->FindPin(PinId(12345)), nullptr);
}

TEST_F(KvCacheManagerHoldingsTest, ListingASessionsPinsWalksOnlyItsPins) {
  for (int i = 0; i < 6; ++i) PinOwn(kBob, kNs, 1000 + 100 * i);
  const PinId first = PinOwn(kAlice, kNs, 0);
  const PinId second = PinOwn(kAlice, kOther, 100);
  const uint64_t before = KvCacheManagerTestPeer::Visited(*cache_);
  const std::vector<PinInfo> listed = cache_->ListPins(kAlice);
  EXPECT_EQ(KvCacheManagerTestPeer::Visited(*cache_) - before, 2u);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].id, first);
  EXPECT_EQ(listed[1].id, second);
  EXPECT_EQ(listed[1].ns, kOther);
  EXPECT_THAT(cache_->ListPins(SessionId(3)), IsEmpty());
  EXPECT_EQ(cache_->ListPins().size(), 8u);
}

}  // namespace
}  // namespace kvpool
