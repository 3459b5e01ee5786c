// Pins (retention hints) through the KvCacheManager: what a pin keeps, when it ends, what it
// counts against, and every refusal with its code and nothing changed.

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/tokens.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kNs(100);
constexpr NamespaceId kOther(200);
constexpr int32_t kBs = 16;
constexpr int64_t kSecond = 1'000'000'000;

using test_tokens::Tokens;

class PinTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks, int32_t max_pins = 8, int64_t max_pinned_blocks = 0) {
    auto cache = KvCacheManager::Create({.block_size = kBs,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 64,
                                         .clock = &clock_,
                                         .eviction_policy = "lru",
                                         .max_pins = max_pins,
                                         .max_pin_ttl_ns = 600 * kSecond,
                                         .max_pinned_blocks = max_pinned_blocks});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  SequenceId Alloc(const std::vector<int32_t>& prompt, int64_t extra = 0, NamespaceId ns = kNs) {
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> r = cache_->Allocate(
        kAlice,
        {.ns = ns, .num_tokens = static_cast<int64_t>(prompt.size()) + extra, .prompt = prompt},
        &plan);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->sequence : SequenceId(0);
  }

  void Serve(const std::vector<int32_t>& prompt, NamespaceId ns = kNs) {
    const SequenceId id = Alloc(prompt, 0, ns);
    ASSERT_TRUE(cache_->Free(kAlice, id, OnFree::kCommit).ok());
  }

  PinId Pin(const std::vector<int32_t>& tokens, int64_t ttl_ns, int priority = 0,
            SessionId session = kAlice) {
    const absl::StatusOr<PinId> pin = cache_->PinPrefix(session, kNs, tokens, ttl_ns, priority);
    EXPECT_TRUE(pin.ok()) << pin.status();
    return pin.ok() ? *pin : PinId(0);
  }

  // Calls `fn`, expects `code`, and that nothing changed.
  template <typename Fn>
  void ExpectRefused(absl::StatusCode code, Fn fn) {
    cache_->ExpirePins();  // housekeeping first, so the call itself has none to do
    const std::string before = cache_->DebugString();
    const absl::Status status = fn();
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_EQ(cache_->DebugString(), before);
    ExpectInvariants();
  }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
  }

  int64_t Cached(const std::vector<int32_t>& prompt) const {
    return cache_->MatchPrefix(kNs, prompt);
  }

  ManualClock clock_{1000 * kSecond};
  std::unique_ptr<KvCacheManager> cache_;
};

TEST_F(PinTest, APinnedPrefixSurvivesPressureUntilItExpires) {
  Make(6);
  Serve(Tokens(0, 2 * kBs));  // the oldest: LRU would evict it first
  Serve(Tokens(100, 2 * kBs));
  const PinId pin = Pin(Tokens(0, 2 * kBs), 60 * kSecond);
  ExpectInvariants();
  const SequenceId big = Alloc(Tokens(900, 4 * kBs));  // needs 4 of the 6 blocks
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), 2 * kBs);
  EXPECT_EQ(Cached(Tokens(100, 2 * kBs)), 0);
  ASSERT_TRUE(cache_->Free(kAlice, big).ok());
  // Nothing can make room while the pin lasts...
  DevicePlan plan;
  EXPECT_EQ(cache_->Allocate(kAlice, {.ns = kNs, .num_tokens = 6 * kBs}, &plan).status().code(),
            absl::StatusCode::kResourceExhausted);
  // ...and once its time is up the next call releases it first.
  clock_.Advance(60 * kSecond);
  EXPECT_THAT(cache_->ListPins(), IsEmpty());
  const absl::StatusOr<AllocateResult> all =
      cache_->Allocate(kAlice, {.ns = kNs, .num_tokens = 6 * kBs}, &plan);
  EXPECT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(cache_->stats().pins_expired, 1u);
  EXPECT_EQ(cache_->Unpin(kAlice, pin).code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(PinTest, ListPinsShowsWhatEachPinHolds) {
  Make(16);
  Serve(Tokens(0, 2 * kBs + 3));
  Serve(Tokens(500, kBs));
  const PinId a = Pin(Tokens(0, 2 * kBs + 3), 30 * kSecond, /*priority=*/2);
  clock_.Advance(kSecond);
  const PinId b = Pin(Tokens(500, kBs), 90 * kSecond, 0, kBob);
  const std::vector<PinInfo> pins = cache_->ListPins();
  ASSERT_EQ(pins.size(), 2u);
  EXPECT_EQ(pins[0], (PinInfo{.id = a,
                              .session = kAlice,
                              .ns = kNs,
                              .priority = 2,
                              .tokens = 2 * kBs + 3,
                              .blocks = 3,
                              .created_ns = 1000 * kSecond,
                              .expires_ns = 1030 * kSecond}));
  EXPECT_EQ(pins[1].id, b);
  EXPECT_EQ(pins[1].expires_ns, 1091 * kSecond);
  EXPECT_THAT(cache_->ListPins(kBob), ElementsAre(pins[1]));
  EXPECT_EQ(cache_->stats().pins, 2);
  EXPECT_EQ(cache_->stats().pinned_blocks, 4);
  // Two pins on one prefix: the blocks stay pinned until both end.
  const PinId again = Pin(Tokens(0, kBs), 10 * kSecond);
  EXPECT_EQ(cache_->stats().pinned_blocks, 4);
  ASSERT_TRUE(cache_->Unpin(kAlice, a).ok());
  EXPECT_EQ(cache_->stats().pinned_blocks, 2);
  ExpectInvariants();
  (void)again;
}

TEST_F(PinTest, APinRaisesThePriorityClassForGood) {
  Make(4);
  Serve(Tokens(0, 2 * kBs));
  const PinId pin = Pin(Tokens(0, 2 * kBs), 10 * kSecond, /*priority=*/1);
  ASSERT_TRUE(cache_->Unpin(kAlice, pin).ok());
  Serve(Tokens(100, 2 * kBs));  // class 0, younger
  Alloc(Tokens(900, 2 * kBs));
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs)), 2 * kBs);  // class 1 outlives class 0
  EXPECT_EQ(Cached(Tokens(100, 2 * kBs)), 0);
}

TEST_F(PinTest, PinSequenceKeepsWhatItPublishedAfterItEnds) {
  Make(6);
  const SequenceId agent = Alloc(Tokens(0, 2 * kBs + 4), /*extra=*/8);
  ExpectRefused(absl::StatusCode::kFailedPrecondition,
                [&] { return cache_->PinSequence(kAlice, agent, 60 * kSecond, 0).status(); });
  ASSERT_TRUE(cache_->Commit(kAlice, agent, 2 * kBs + 4).ok());
  const absl::StatusOr<PinId> pin = cache_->PinSequence(kAlice, agent, 60 * kSecond, 0);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(cache_->ListPins()[0].sequence, agent);
  EXPECT_EQ(cache_->ListPins()[0].tokens, 2 * kBs + 4);
  ASSERT_TRUE(cache_->Free(kAlice, agent).ok());  // waits for its tool call
  Alloc(Tokens(900, 3 * kBs));                    // everything else is needed
  EXPECT_EQ(Cached(Tokens(0, 2 * kBs + 4)), 2 * kBs + 4);
  ExpectInvariants();
}

TEST_F(PinTest, RenewRestartsTheClock) {
  Make(8);
  Serve(Tokens(0, kBs));
  const PinId pin = Pin(Tokens(0, kBs), 10 * kSecond);
  clock_.Advance(8 * kSecond);
  ASSERT_TRUE(cache_->RenewPin(kAlice, pin, 10 * kSecond).ok());
  clock_.Advance(8 * kSecond);
  EXPECT_EQ(cache_->ExpirePins(), 0);
  clock_.Advance(2 * kSecond);
  EXPECT_EQ(cache_->ExpirePins(), 1);
  EXPECT_EQ(cache_->RenewPin(kAlice, pin, kSecond).code(), absl::StatusCode::kNotFound);
}

TEST_F(PinTest, PinsCountAgainstTheNamespaceQuota) {
  Make(16);
  Serve(Tokens(0, 3 * kBs));  // CACHED blocks count against no quota
  Serve(Tokens(500, 2 * kBs));
  ASSERT_TRUE(cache_->SetNamespaceQuota(kNs, 4).ok());
  Pin(Tokens(0, 3 * kBs), 60 * kSecond);
  // The pin's 3 blocks count now: 2 fresh blocks would pass the quota of 4.
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> two =
      cache_->Allocate(kAlice, {.ns = kNs, .num_tokens = 2 * kBs}, &plan);
  ASSERT_EQ(two.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(two.status())->resource, Resource::kNamespaceQuota);
  EXPECT_EQ(GetShortfall(two.status())->blocks, 1);
  // Adopting the pinned blocks is no new charge: 3 shared + 1 fresh fits exactly.
  const SequenceId reuse = Alloc(Tokens(0, 3 * kBs), /*extra=*/kBs);
  EXPECT_NE(reuse, SequenceId(0));
  ExpectInvariants();
  ASSERT_TRUE(cache_->Free(kAlice, reuse).ok());
  // Pinning the second prefix would pass the quota: refused with the shortfall.
  cache_->ExpirePins();
  const std::string before = cache_->DebugString();
  const absl::StatusOr<PinId> over =
      cache_->PinPrefix(kAlice, kNs, Tokens(500, 2 * kBs), 60 * kSecond, 0);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(over.status())->resource, Resource::kNamespaceQuota);
  EXPECT_EQ(GetShortfall(over.status())->blocks, 1);
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();
}

TEST_F(PinTest, PinnedBlocksAreBoundedPoolWide) {
  Make(16, /*max_pins=*/8, /*max_pinned_blocks=*/3);
  Serve(Tokens(0, 2 * kBs));
  Serve(Tokens(500, 2 * kBs));
  Pin(Tokens(0, 2 * kBs), 60 * kSecond);
  cache_->ExpirePins();
  const std::string before = cache_->DebugString();
  const absl::StatusOr<PinId> over =
      cache_->PinPrefix(kAlice, kNs, Tokens(500, 2 * kBs), 60 * kSecond, 0);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(over.status())->resource, Resource::kPinnedBlocks);
  EXPECT_EQ(GetShortfall(over.status())->blocks, 1);
  EXPECT_EQ(cache_->DebugString(), before);
  Pin(Tokens(500, kBs), 60 * kSecond);  // one more block fits
}

TEST_F(PinTest, RefusalsHaveTheirCodesAndChangeNothing) {
  Make(16, /*max_pins=*/1);
  Serve(Tokens(0, 2 * kBs));
  Serve(Tokens(0, 2 * kBs), kOther);
  const std::vector<int32_t> cached = Tokens(0, 2 * kBs);
  using Code = absl::StatusCode;
  auto pin = [&](SessionId s, NamespaceId ns, std::vector<int32_t> t, int64_t ttl, int prio) {
    return [=, this] { return cache_->PinPrefix(s, ns, t, ttl, prio).status(); };
  };
  ExpectRefused(Code::kInvalidArgument, pin(kNoSession, kNs, cached, kSecond, 0));
  ExpectRefused(Code::kInvalidArgument, pin(kAlice, kNoNamespace, cached, kSecond, 0));
  ExpectRefused(Code::kInvalidArgument, pin(kAlice, kNs, {}, kSecond, 0));
  ExpectRefused(Code::kInvalidArgument, pin(kAlice, kNs, cached, 0, 0));
  ExpectRefused(Code::kInvalidArgument, pin(kAlice, kNs, cached, 601 * kSecond, 0));
  ExpectRefused(Code::kInvalidArgument, pin(kAlice, kNs, cached, kSecond, kNumPriorities));
  ExpectRefused(Code::kInvalidArgument, pin(kAlice, kNs, cached, kSecond, -1));
  // Not (wholly) cached: the message says how much is.
  const absl::Status partly =
      cache_->PinPrefix(kAlice, kNs, Tokens(0, 3 * kBs), kSecond, 0).status();
  EXPECT_EQ(partly.code(), Code::kNotFound);
  EXPECT_THAT(std::string(partly.message()), HasSubstr("only 32 of the 48 tokens"));
  ExpectRefused(Code::kNotFound, pin(kAlice, NamespaceId(999), cached, kSecond, 0));
  ExpectRefused(Code::kNotFound,
                [&] { return cache_->PinSequence(kAlice, SequenceId(4242), kSecond, 0).status(); });
  const SequenceId bobs = [&] {
    DevicePlan plan;
    return cache_->Allocate(kBob, {.ns = kNs, .num_tokens = 1}, &plan)->sequence;
  }();
  ExpectRefused(Code::kPermissionDenied,
                [&] { return cache_->PinSequence(kAlice, bobs, kSecond, 0).status(); });
  const PinId only = Pin(cached, 60 * kSecond);
  ExpectRefused(Code::kResourceExhausted, pin(kAlice, kOther, cached, kSecond, 0));  // max_pins
  ExpectRefused(Code::kPermissionDenied, [&] { return cache_->Unpin(kBob, only); });
  ExpectRefused(Code::kPermissionDenied, [&] { return cache_->RenewPin(kBob, only, kSecond); });
  ExpectRefused(Code::kInvalidArgument,
                [&] { return cache_->RenewPin(kAlice, only, 601 * kSecond); });
  ExpectRefused(Code::kNotFound, [&] { return cache_->Unpin(kAlice, PinId(77)); });
}

TEST_F(PinTest, ASessionsPinsEndWithIt) {
  Make(8);
  Serve(Tokens(0, kBs));
  Pin(Tokens(0, kBs), 60 * kSecond, 0, kBob);
  Pin(Tokens(0, kBs), 60 * kSecond, 0, kAlice);
  EXPECT_EQ(cache_->FreeSession(kBob), 0);
  EXPECT_EQ(cache_->ListPins().size(), 1u);
  EXPECT_EQ(cache_->ListPins()[0].session, kAlice);
  ExpectInvariants();
}

TEST_F(PinTest, ClearRefusesWhilePinsHoldBlocks) {
  Make(8);
  Serve(Tokens(0, kBs));
  const PinId pin = Pin(Tokens(0, kBs), 60 * kSecond);
  EXPECT_EQ(cache_->ClearCache().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cache_->Unpin(kAlice, pin).ok());
  EXPECT_TRUE(cache_->ClearCache().ok());
}

TEST_F(PinTest, PinsNeedThePrefixCache) {
  auto cache = KvCacheManager::Create(
      {.block_size = kBs, .num_blocks = 8, .max_blocks_per_seq = 8, .prefix_cache = false});
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ((*cache)->PinPrefix(kAlice, kNs, Tokens(0, 4), kSecond, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(KvCacheManager::Create(
                {.block_size = kBs, .num_blocks = 8, .max_blocks_per_seq = 8, .max_pins = -1})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
