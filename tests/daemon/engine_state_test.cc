// EngineState (daemon/engine/engine_state.h) driven directly, its pool's manager beside it: what a
// call costs in other sessions' sequences and pins. One client must not make the daemon walk the
// whole pool, under the engine's one lock, for a call that changes nothing (a cache salt refused
// over limits.cache_salts_per_session), or for anything it can repeat at will. The cost is
// counted as entries the manager's listings walked (KvCacheManagerTestPeer::Visited), not timed.

#include "daemon/engine/engine_state.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"
#include "tests/kvpool/kv_cache_manager_test_peer.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

constexpr int kBystanders = 8;
constexpr int kSequencesEach = 16;
constexpr int64_t kPinTtl = 60'000'000'000;

class EngineStateTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(2); }
  void Make(int32_t salts_per_session) {
    EngineOptions options = SmallPool(64, &clock_);
    options.limits.cache_salts_per_session = salts_per_session;
    absl::StatusOr<std::unique_ptr<EngineState>> state = EngineState::Create(options, &device_);
    ASSERT_TRUE(state.ok()) << state.status();
    state_ = std::move(*state);
  }
  std::shared_ptr<const Session> Open(std::string tenant) {
    absl::StatusOr<std::shared_ptr<const Session>> s = state_->Open(Spec(std::move(tenant)));
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  }
  KvCacheManager& cache() { return state_->pool(0).cache(); }
  uint64_t Visited() { return KvCacheManagerTestPeer::Visited(cache()); }
  // A zero-token sequence of `s` in `ns` (it holds the namespace, and no block).
  SequenceId Hold(const Session& s, NamespaceId ns) {
    DevicePlan plan;
    absl::StatusOr<AllocateResult> r = cache().Allocate(s.id, {.ns = ns}, &plan);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->sequence : SequenceId(0);
  }
  // Sessions of another tenant, each holding kSequencesEach sequences and one pin over a block
  // it published: the rest of the pool, which no call of another session should walk.
  void AddBystanders() {
    for (int i = 0; i < kBystanders; ++i) {
      std::shared_ptr<const Session> s = Open("bystanders");
      bystanders_.push_back(s);
      const std::vector<int32_t> prompt = Prompt(16, 100 + static_cast<uint32_t>(i));
      DevicePlan plan;
      absl::StatusOr<AllocateResult> r =
          cache().Allocate(s->id, {.ns = s->ns, .num_tokens = 16, .prompt = prompt}, &plan);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_TRUE(cache().Commit(s->id, r->sequence, 16).ok());
      ASSERT_TRUE(cache().PinSequence(s->id, r->sequence, kPinTtl, 0).ok());
      for (int k = 1; k < kSequencesEach; ++k) Hold(*s, s->ns);
    }
    ASSERT_EQ(cache().stats().sequences, kBystanders * kSequencesEach);
    ASSERT_EQ(cache().stats().pins, kBystanders);
  }

  ManualClock clock_;
  FailingDevice device_;
  std::unique_ptr<EngineState> state_;
  std::vector<std::shared_ptr<const Session>> bystanders_;
};

// Issue: a session at limits.cache_salts_per_session, holding a sequence under each salt, that
// asks for fresh salts is refused every time, but each refusal walked every sequence and pin of
// the pool to find what the session holds.
TEST_F(EngineStateTest, ARefusedNewSaltWalksNoOtherSessionsSequencesOrPins) {
  AddBystanders();
  std::shared_ptr<const Session> s = Open("flooder");
  absl::StatusOr<NamespaceId> a = state_->SaltedNamespace(*s, "a");
  absl::StatusOr<NamespaceId> b = state_->SaltedNamespace(*s, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  const SequenceId in_a = Hold(*s, *a);
  Hold(*s, *b);
  const size_t namespaces = state_->namespaces().size();

  const uint64_t before = Visited();
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(absl::IsResourceExhausted(
        state_->SaltedNamespace(*s, "fresh-" + std::to_string(i)).status()));
  }
  EXPECT_EQ(Visited() - before, 0u);

  // The limit still lets go of a salt the session holds nothing under.
  ASSERT_TRUE(cache().Free(s->id, in_a).ok());
  absl::StatusOr<NamespaceId> fresh = state_->SaltedNamespace(*s, "fresh");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(state_->namespaces().size(), namespaces) << "a left the table, fresh joined it";
  Hold(*s, *fresh);
  EXPECT_TRUE(absl::IsResourceExhausted(state_->SaltedNamespace(*s, "another").status()));
  EXPECT_TRUE(cache().CheckInvariants().ok());
}

// A salt whose only hold is a pin stays the session's while the pin lives, and goes once the
// pin's time is up, even before a call has expired it (ListPins' view of a pin).
TEST_F(EngineStateTest, APinKeepsItsSaltUntilItsTimeIsUp) {
  Make(1);
  std::shared_ptr<const Session> s = Open("pinner");
  absl::StatusOr<NamespaceId> a = state_->SaltedNamespace(*s, "a");
  ASSERT_TRUE(a.ok());
  const std::vector<int32_t> prompt = Prompt(16, 7);
  DevicePlan plan;
  absl::StatusOr<AllocateResult> r =
      cache().Allocate(s->id, {.ns = *a, .num_tokens = 16, .prompt = prompt}, &plan);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(cache().Free(s->id, r->sequence, OnFree::kCommit).ok());
  ASSERT_TRUE(cache().PinPrefix(s->id, *a, prompt, 1000, 0).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(state_->SaltedNamespace(*s, "b").status()));
  clock_.Advance(1000);
  EXPECT_EQ(cache().stats().pins, 1) << "no call has expired it yet";
  EXPECT_TRUE(state_->SaltedNamespace(*s, "b").ok());
  EXPECT_TRUE(cache().CheckInvariants().ok());
}

TEST_F(EngineStateTest, AnInvalidationWalksOnlyWhatItsSessionsHold) {
  AddBystanders();
  std::shared_ptr<const Session> s = Open("invalidated");
  absl::StatusOr<NamespaceId> salted = state_->SaltedNamespace(*s, "a");
  ASSERT_TRUE(salted.ok());
  Hold(*s, s->ns);
  const size_t namespaces = state_->namespaces().size();
  const uint64_t before = Visited();
  absl::StatusOr<EngineState::Invalidated> done = state_->Invalidate("invalidated", "");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(Visited() - before, 0u);
  EXPECT_EQ(done->sessions, 1);
  EXPECT_EQ(done->namespaces, 2);
  // The salted namespace it held nothing in is let go; its own old one, with a sequence, stays
  // beside the new one.
  EXPECT_NE(state_->OwnNamespace(*s), s->ns);
  EXPECT_EQ(state_->namespaces().size(), namespaces);
  EXPECT_TRUE(cache().CheckInvariants().ok());
}

TEST_F(EngineStateTest, EndingASessionWalksOnlyWhatItHolds) {
  AddBystanders();
  std::shared_ptr<const Session> s = Open("leaver");
  Hold(*s, s->ns);
  Hold(*s, s->ns);
  const uint64_t before = Visited();
  EXPECT_EQ(state_->End(s->id, SessionEnd::kDetached), 2);
  EXPECT_EQ(Visited() - before, 2u);
  EXPECT_EQ(cache().stats().sequences, kBystanders * kSequencesEach);
  EXPECT_TRUE(cache().CheckInvariants().ok());
}

TEST_F(EngineStateTest, ListingASessionsPinsWalksOnlyItsPins) {
  AddBystanders();
  const uint64_t before = Visited();
  const std::vector<PinInfo> pins = cache().ListPins(bystanders_[3]->id);
  ASSERT_EQ(pins.size(), 1u);
  EXPECT_EQ(pins[0].session, bystanders_[3]->id);
  EXPECT_EQ(Visited() - before, 1u);
}

}  // namespace
}  // namespace kvpool::daemon
