// Engine: sessions and control calls, without processes or sockets.

#include "daemon/engine/engine.h"

#include <sys/mman.h>

#include "daemon/engine/call_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using testing::GivesUpAfter;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

class EngineTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks, kernels::FillPolicy fill = kernels::FillPolicy::kNone) {
    EngineOptions options = SmallPool(num_blocks);
    options.fill_policy = fill;
    engine_ = std::move(*Engine::Create(options, &device_, /*model=*/nullptr));
    alice_ = *engine_->OpenSession(Spec("tenant-a", "alice"));
    bob_ = *engine_->OpenSession(Spec("tenant-a", "bob"));
  }

  SequenceId Allocate(const Session& s, int64_t tokens, std::span<const int32_t> prompt = {}) {
    const AllocateRequest request{.num_tokens = tokens, .prompt = prompt};
    absl::StatusOr<Tables> t =
        engine_->Allocate(s, std::span(&request, 1), CallContext::Uncancellable());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->slices[0].sequence : SequenceId(0);
  }
  std::vector<BlockId> Table(SequenceId id) {
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    const Tables all = engine_->ListSequences(std::nullopt, kNoSession, &owners, &pools);
    size_t first = 0;
    for (const TableSlice& s : all.slices) {
      if (s.sequence == id) {
        return {all.blocks.begin() + static_cast<ptrdiff_t>(first),
                all.blocks.begin() + static_cast<ptrdiff_t>(first + s.length)};
      }
      first += static_cast<size_t>(s.length);
    }
    return {};
  }
  void ExpectInvariants() {
    const absl::Status s = engine_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
  }

  FailingDevice device_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_, bob_;
};

TEST_F(EngineTest, GrantSharesTheArenaAndAGenerationTable) {
  Make(64);
  absl::StatusOr<PoolGrant> grant = engine_->Grant(alice_);
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(grant->layout.num_blocks, 64);
  ASSERT_TRUE(grant->arena->fd.valid());
  ASSERT_TRUE(grant->generation_table.valid());
  const auto* generations = static_cast<const uint32_t*>(mmap(
      nullptr, 64 * sizeof(uint32_t), PROT_READ, MAP_SHARED, grant->generation_table.get(), 0));
  ASSERT_NE(generations, MAP_FAILED);
  const AllocateRequest request{.num_tokens = 40};
  absl::StatusOr<Tables> t =
      engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable());
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->blocks.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {  // what the client sees equals what the daemon handed out
    EXPECT_EQ(generations[t->blocks[i].value()], t->generations[i]);
    EXPECT_EQ(t->generations[i], 1u);
  }
  munmap(const_cast<uint32_t*>(generations), 64 * sizeof(uint32_t));
  ExpectInvariants();
}

TEST_F(EngineTest, GrowReturnsOnlyTheChangedTail) {
  Make(64);
  const SequenceId id = Allocate(*alice_, 20);
  const GrowRequest grow{id, 70};
  absl::StatusOr<Tables> grown =
      engine_->Grow(*alice_, std::span(&grow, 1), CallContext::Uncancellable());
  ASSERT_TRUE(grown.ok()) << grown.status();
  ASSERT_EQ(grown->slices.size(), 1u);
  EXPECT_EQ(grown->slices[0].table_offset, 2);
  EXPECT_EQ(grown->slices[0].length, 3);  // blocks 2, 3, 4
  EXPECT_EQ(grown->blocks.size(), 3u);
  EXPECT_EQ(grown->slices[0].num_tokens, 70);
  // Another session may not grow it, and nothing changes.
  EXPECT_EQ(engine_->Grow(*bob_, std::span(&grow, 1), CallContext::Uncancellable()).status().code(),
            absl::StatusCode::kPermissionDenied);
  ExpectInvariants();
}

TEST_F(EngineTest, FreeIsAllOrNothingAndEndingASessionReleasesEverything) {
  Make(64);
  const SequenceId a = Allocate(*alice_, 16), b = Allocate(*alice_, 16);
  const std::vector<SequenceId> batch = {a, SequenceId(12345)};
  EXPECT_EQ(engine_->Free(*alice_, batch, OnFree::kDiscard, CallContext::Uncancellable()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats().cache.sequences, 2);  // neither was freed
  EXPECT_EQ(engine_->EndSession(alice_->id, SessionEnd::kConnectionLost), 2);
  EXPECT_EQ(engine_->EndSession(alice_->id, SessionEnd::kConnectionLost), 0);  // once
  EXPECT_EQ(engine_->EndSession(bob_->id, SessionEnd::kDetached), 0);
  const EngineStats s = engine_->Stats();
  EXPECT_EQ(s.cache.pool.free + s.cache.pool.cached, s.cache.pool.num_blocks);
  EXPECT_EQ(s.sessions.lost, 1u);
  EXPECT_EQ(s.sessions.detached, 1u);
  EXPECT_EQ(s.sessions.sequences_released, 2u);
  EXPECT_EQ(s.attached_sessions, 0);
  (void)b;
  ExpectInvariants();
}

TEST_F(EngineTest, StatsTellAttachedSessionsFromSessionsHoldingSequences) {
  Make(64);
  Allocate(*alice_, 16);
  const EngineStats s = engine_->Stats();
  EXPECT_EQ(s.attached_sessions, 2);  // alice and bob
  EXPECT_EQ(s.cache.sessions, 1);     // only alice holds a sequence
  EXPECT_EQ(s.sessions.opened, 2u);
}

TEST_F(EngineTest, ACallOfAnEndedSessionIsRefusedAndChangesNothing) {
  Make(64);
  const std::string token = alice_->token;
  EXPECT_EQ(engine_->Authenticate(token), alice_);
  engine_->EndSession(alice_->id, SessionEnd::kConnectionLost);
  EXPECT_EQ(engine_->Authenticate(token), nullptr);
  // A call that authenticated before the session ended still holds the Session.
  const AllocateRequest request{.num_tokens = 40};
  EXPECT_EQ(engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable())
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats().cache.sequences, 0);
  EXPECT_EQ(engine_->Stats().calls.session_ended, 1u);
  EXPECT_EQ(engine_->Grant(alice_).status().code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(EngineTest, ACallerWhoGaveUpLeavesNoSequenceBehind) {
  Make(64);
  const AllocateRequest request{.num_tokens = 40};
  // Gave up before the call: nothing is done.
  ManualCallContext cancelled;
  cancelled.Cancel();
  EXPECT_EQ(engine_->Allocate(*alice_, std::span(&request, 1), cancelled).status().code(),
            absl::StatusCode::kCancelled);
  // Gave up while the call ran (after its first check): the sequence it made is released.
  EXPECT_EQ(engine_->Allocate(*alice_, std::span(&request, 1), GivesUpAfter(1)).status().code(),
            absl::StatusCode::kCancelled);
  const SequenceId parent = Allocate(*alice_, 20);
  EXPECT_EQ(engine_->Fork(*alice_, parent, GivesUpAfter(1)).status().code(),
            absl::StatusCode::kCancelled);
  const EngineStats s = engine_->Stats();
  EXPECT_EQ(s.cache.sequences, 1);  // the parent only
  EXPECT_EQ(s.calls.released_on_give_up, 2u);
  EXPECT_EQ(s.cache.pool.active, 2);
  ExpectInvariants();
}

TEST_F(EngineTest, AFailedEnqueueIsUndoneAndThePoolIsAsBefore) {
  Make(64, kernels::FillPolicy::kZero);  // every fresh block is filled: device work
  const SequenceId kept = Allocate(*alice_, 20);
  // A copy-on-write grow: block 1 is published up to token 20, the grow writes token 18.
  ASSERT_TRUE(engine_->Commit(*alice_, kept, 20, Prompt(20, 1), CallContext::Uncancellable()).ok());
  ASSERT_TRUE(engine_->Truncate(*alice_, kept, 18, CallContext::Uncancellable()).ok());
  const std::vector<BlockId> table = Table(kept);
  const EngineStats before = engine_->Stats();

  device_.fail = true;
  const AllocateRequest request{.num_tokens = 40};
  EXPECT_EQ(engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable())
                .status()
                .code(),
            absl::StatusCode::kInternal);
  const GrowRequest grow{kept, 40};
  EXPECT_EQ(
      engine_->Grow(*alice_, std::span(&grow, 1), CallContext::Uncancellable()).status().code(),
      absl::StatusCode::kInternal);
  EXPECT_EQ(engine_->Fork(*alice_, kept, CallContext::Uncancellable()).status().code(),
            absl::StatusCode::kInternal);  // its partial last block is copied

  const EngineStats after = engine_->Stats();
  EXPECT_EQ(after.cache.sequences, before.cache.sequences);
  // (Blocks under the staging copy queued before each failure retire until it has run.)
  EXPECT_EQ(after.cache.pool.free + after.cache.pool.retiring, before.cache.pool.free);
  EXPECT_EQ(after.cache.pool.active, before.cache.pool.active);
  EXPECT_EQ(after.cache.pool.cached, before.cache.pool.cached);
  EXPECT_EQ(Table(kept), table);  // the copy's source is back, not the never-written copy
  EXPECT_EQ(after.calls.device_failures, 3u);
  ExpectInvariants();
  device_.fail = false;
  EXPECT_TRUE(
      engine_->Grow(*alice_, std::span(&grow, 1), CallContext::Uncancellable()).status().ok());
  ExpectInvariants();
}

TEST_F(EngineTest, DrainRefusesNewSequencesButNotTheirUse) {
  Make(64);
  const SequenceId id = Allocate(*alice_, 10);
  EXPECT_EQ(engine_->Drain(), 1);
  EXPECT_TRUE(engine_->draining());
  const AllocateRequest request{.num_tokens = 1};
  EXPECT_EQ(engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable())
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(engine_->Fork(*alice_, id, CallContext::Uncancellable()).status().code(),
            absl::StatusCode::kUnavailable);
  const GrowRequest grow{id, 30};
  EXPECT_TRUE(engine_->Grow(*alice_, std::span(&grow, 1), CallContext::Uncancellable()).ok());
  EXPECT_TRUE(
      engine_->Free(*alice_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
          .ok());
}

TEST_F(EngineTest, NamespacesSeparateTenantsModelsAndNeverCollide) {
  Make(64);
  auto ns = [&](std::string tenant, std::string model) {
    SessionSpec spec = Spec(std::move(tenant));
    spec.model = std::move(model);
    return (*engine_->OpenSession(spec))->ns;
  };
  EXPECT_EQ(ns("a", "m"), ns("a", "m"));
  EXPECT_NE(ns("a", "m"), ns("b", "m"));
  EXPECT_NE(ns("a", "m"), ns("a", "n"));
  EXPECT_NE(ns("ab", "c"), ns("a", "bc"));
  EXPECT_NE(ns("a:1", "b"), ns("a", "1:b"));
  EXPECT_NE(ns("a\x1f"
               "b",
               "c"),
            ns("a",
               "b\x1f"
               "c"));
}

TEST_F(EngineTest, TenantQuotaIsSetWhenItsSessionOpens) {
  EngineOptions options = SmallPool(64);
  options.open_quota_blocks["tight"] = 2;
  engine_ = std::move(*Engine::Create(options, &device_, nullptr));
  std::shared_ptr<const Session> s = *engine_->OpenSession(Spec("tight"));
  const AllocateRequest request{.num_tokens = 48};
  const absl::Status refused =
      engine_->Allocate(*s, std::span(&request, 1), CallContext::Uncancellable()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
}

// One way to give a tenant a quota (issue 29): TenantLimits::quota_blocks. open_quota_blocks is
// that field for the zero-configuration mode, with the same effect; beside configured tenants it
// is an error (before, it was silently ignored there).
TEST_F(EngineTest, OpenQuotaBlocksIsTheConfiguredQuotaUnderAnotherName) {
  const AllocateRequest three_blocks{.num_tokens = 48};
  auto refused = [&](const EngineOptions& options) {
    engine_ = std::move(*Engine::Create(options, &device_, nullptr));
    std::shared_ptr<const Session> s = *engine_->OpenSession(Spec("tight"));
    return engine_->Allocate(*s, std::span(&three_blocks, 1), CallContext::Uncancellable())
        .status()
        .code();
  };
  EngineOptions open = SmallPool(64);
  open.open_quota_blocks["tight"] = 2;
  EngineOptions configured = SmallPool(64);
  configured.tenants["tight"] = {.quota_blocks = 2};
  EXPECT_EQ(refused(open), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused(configured), absl::StatusCode::kResourceExhausted);

  EngineOptions both = configured;
  both.open_quota_blocks["tight"] = 2;
  engine_.reset();
  absl::StatusOr<std::unique_ptr<Engine>> made = Engine::Create(both, &device_, nullptr);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
  EXPECT_THAT(std::string(made.status().message()), ::testing::HasSubstr("quota_blocks"));
}

// A new model string is a new namespace, not a fresh quota: the tenant's quota bounds the sum.
TEST_F(EngineTest, TenantQuotaIsSummedOverItsModels) {
  EngineOptions options = SmallPool(64);
  options.open_quota_blocks["tight"] = 4;
  engine_ = std::move(*Engine::Create(options, &device_, nullptr));
  SessionSpec first = Spec("tight");
  first.model = "m1";
  SessionSpec second = Spec("tight");
  second.model = "m2";
  std::shared_ptr<const Session> s1 = *engine_->OpenSession(first);
  std::shared_ptr<const Session> s2 = *engine_->OpenSession(second);
  ASSERT_NE(s1->ns, s2->ns);
  const AllocateRequest three{.num_tokens = 48};
  ASSERT_TRUE(engine_->Allocate(*s1, std::span(&three, 1), CallContext::Uncancellable()).ok());
  const absl::Status refused =
      engine_->Allocate(*s2, std::span(&three, 1), CallContext::Uncancellable()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  const AllocateRequest one{.num_tokens = 16};
  EXPECT_TRUE(engine_->Allocate(*s2, std::span(&one, 1), CallContext::Uncancellable()).ok());
  EXPECT_EQ(
      engine_->Allocate(*s1, std::span(&one, 1), CallContext::Uncancellable()).status().code(),
      absl::StatusCode::kResourceExhausted);
  // Another tenant is not limited by it.
  std::shared_ptr<const Session> other = *engine_->OpenSession(Spec("roomy"));
  EXPECT_TRUE(engine_->Allocate(*other, std::span(&three, 1), CallContext::Uncancellable()).ok());
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(EngineTest, APinKeepsAPrefixOutOfEvictionUntilItEnds) {
  ManualClock clock(1'000'000'000);
  EngineOptions options = SmallPool(8, &clock);
  options.open_tenant.max_priority = 1;
  engine_ = std::move(*Engine::Create(options, &device_, nullptr));
  alice_ = *engine_->OpenSession(Spec("a", "alice"));
  bob_ = *engine_->OpenSession(Spec("a", "bob"));
  // Alice publishes a 32-token system prompt (two blocks) and goes: it is cached, evictable.
  const std::vector<int32_t> system = Prompt(32, 7);
  SequenceId id = Allocate(*alice_, 32, system);
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
          .ok());
  constexpr int64_t kSecond = 1'000'000'000;

  // A priority above the tenant's ceiling is refused, and so is a prefix not all cached.
  EXPECT_EQ(engine_->PinPrefix(*bob_, system, 10 * kSecond, 2).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_->PinPrefix(*bob_, Prompt(48, 7), 10 * kSecond, 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->PinPrefix(*bob_, system, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine_->ListPins(kNoSession).empty());

  absl::StatusOr<PinInfo> pin = engine_->PinPrefix(*bob_, system, 10 * kSecond, 1);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->session, bob_->id);
  EXPECT_EQ(pin->blocks, 2);
  EXPECT_EQ(pin->tokens, 32);
  EXPECT_EQ(pin->priority, 1);
  EXPECT_EQ(pin->expires_ns, clock.NowNanos() + 10 * kSecond);
  EXPECT_EQ(engine_->Stats().cache.pins, 1);
  EXPECT_EQ(engine_->Stats().cache.pinned_blocks, 2);

  // Eviction cannot take it: the other six blocks are all a new sequence can get.
  EXPECT_EQ(*engine_->Evict(0, 8, false), 0);
  const AllocateRequest seven{.num_tokens = 7 * 16};
  EXPECT_EQ(engine_->Allocate(*alice_, std::span(&seven, 1), CallContext::Uncancellable())
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*engine_->MatchPrefix(*alice_, system), 32);
  ExpectInvariants();

  // Only its owner renews or ends it.
  EXPECT_EQ(engine_->Unpin(*alice_, pin->id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_->RenewPin(*alice_, pin->id, kSecond).status().code(),
            absl::StatusCode::kPermissionDenied);
  clock.Advance(9 * kSecond);
  absl::StatusOr<PinInfo> renewed = engine_->RenewPin(*bob_, pin->id, 5 * kSecond);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(renewed->expires_ns, clock.NowNanos() + 5 * kSecond);
  ASSERT_EQ(engine_->ListPins(bob_->id).size(), 1u);
  EXPECT_TRUE(engine_->ListPins(alice_->id).empty());

  // Its time runs out: the next call finds the blocks evictable again.
  clock.Advance(6 * kSecond);
  EXPECT_TRUE(engine_->ListPins(kNoSession).empty());
  EXPECT_TRUE(engine_->Allocate(*alice_, std::span(&seven, 1), CallContext::Uncancellable()).ok());
  EXPECT_EQ(engine_->Stats().cache.pins, 0);
  EXPECT_EQ(engine_->Stats().cache.pins_expired, 1u);
  EXPECT_EQ(engine_->Unpin(*bob_, pin->id).code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(EngineTest, ASequencePinOutlivesTheSequenceButNotItsSession) {
  Make(16);
  const std::vector<int32_t> context = Prompt(40, 3);
  SequenceId id = Allocate(*bob_, 40, context);
  ASSERT_TRUE(engine_->Commit(*bob_, id, 40, {}, CallContext::Uncancellable()).ok());
  EXPECT_EQ(engine_->PinSequence(*alice_, id, 1'000'000'000, 0).status().code(),
            absl::StatusCode::kPermissionDenied);  // not hers
  absl::StatusOr<PinInfo> pin = engine_->PinSequence(*bob_, id, 60'000'000'000, 0);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->sequence, id);
  EXPECT_EQ(pin->blocks, 3);  // two full blocks and the published partial tail
  ASSERT_TRUE(
      engine_->Free(*bob_, std::span(&id, 1), OnFree::kDiscard, CallContext::Uncancellable()).ok());
  EXPECT_EQ(*engine_->Evict(0, 16, false), 0);  // the pin holds all three
  EXPECT_EQ(*engine_->MatchPrefix(*alice_, context), 40);
  // The session ends: so do its pins.
  engine_->EndSession(bob_->id, SessionEnd::kConnectionLost);
  EXPECT_TRUE(engine_->ListPins(kNoSession).empty());
  EXPECT_EQ(engine_->Stats().cache.pinned_blocks, 0);
  EXPECT_EQ(*engine_->Evict(0, 16, false), 3);
  ExpectInvariants();
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

// Issue 27: arguments are checked before permission. A priority outside [0, 4) is malformed
// (INVALID_ARGUMENT, as kvpool.proto documents), whatever the tenant's ceiling; one inside the
// range but above the ceiling is not permitted.
TEST(EnginePriorityTest, OutOfRangeIsAnArgumentErrorAndAboveTheCeilingIsNotPermitted) {
  testing::FailingDevice device;
  EngineOptions options = testing::SmallPool(16);
  options.open_tenant.max_priority = 1;
  std::unique_ptr<Engine> engine = std::move(*Engine::Create(options, &device, nullptr));
  std::shared_ptr<const Session> s = *engine->OpenSession(testing::Spec("t"));
  const std::vector<int32_t> prompt = testing::Prompt(16, 1);
  auto allocate = [&](int priority) {
    const AllocateRequest r{.num_tokens = 16, .prompt = prompt, .priority = priority};
    return engine->Allocate(*s, std::span(&r, 1), CallContext::Uncancellable()).status();
  };
  EXPECT_TRUE(absl::IsInvalidArgument(allocate(7))) << allocate(7);
  EXPECT_TRUE(absl::IsInvalidArgument(allocate(-1))) << allocate(-1);
  EXPECT_TRUE(absl::IsPermissionDenied(allocate(2))) << allocate(2);
  EXPECT_TRUE(allocate(1).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(engine->PinPrefix(*s, prompt, 1'000'000, 7).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(engine->PinPrefix(*s, prompt, 1'000'000, 2).status()));
  EXPECT_EQ(engine->Stats().cache.sequences, 1);
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

// Records what the engine tells it; reads the engine back from inside the call, which would
// deadlock if the engine still held its lock.
class RecordingListener final : public EventListener {
 public:
  explicit RecordingListener(const Engine* engine) : engine_(engine) {}
  void OnEvents(int32_t pool, uint64_t next_seq) override {
    absl::MutexLock lock(&mu_);
    calls_.push_back({pool, next_seq, engine_->next_event_seq(pool)});
  }
  struct Call {
    int32_t pool;
    uint64_t next_seq;
    uint64_t read_back;  // next_event_seq read inside the call
  };
  std::vector<Call> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  const Engine* const engine_;
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
};

TEST_F(EngineTest, ListenersHearOfEveryHoldThatAppendedEventsAndOfNoOther) {
  Make(8);
  RecordingListener listener(engine_.get());
  engine_->AddEventListener(&listener);
  const std::vector<int32_t> prompt = Prompt(32, 7);
  const SequenceId id = Allocate(*alice_, 32, prompt);  // no event: nothing published yet
  EXPECT_TRUE(listener.calls().empty());
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
          .ok());  // BlockStored
  std::vector<RecordingListener::Call> calls = listener.calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].pool, 0);
  EXPECT_EQ(calls[0].next_seq, 2u);
  EXPECT_EQ(calls[0].read_back, 2u);
  EXPECT_TRUE(engine_->MatchPrefix(*bob_, prompt).ok());  // a read: no event
  EXPECT_EQ(listener.calls().size(), 1u);
  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());  // BlockRemoved
  calls = listener.calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[1].next_seq, 3u);
  engine_->RemoveEventListener(&listener);
  const SequenceId again = Allocate(*alice_, 32, prompt);
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&again, 1), OnFree::kCommit, CallContext::Uncancellable())
          .ok());
  EXPECT_EQ(listener.calls().size(), 2u);  // removed: told nothing more
  EXPECT_EQ(engine_->next_event_seq(0), 4u);
}

// An invalidation moves a session to a fresh namespace and retires the old one for the sequences
// still in it; one the session holds nothing in is let go at once. Before, an idle session kept
// every namespace each invalidation retired (and every salt it had) until it ended.
TEST_F(EngineTest, AnIdleSessionKeepsNoNamespaceAnInvalidationRetired) {
  Make(64);
  const size_t before = engine_->Stats().namespaces;
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(engine_->Invalidate("tenant-a", "").ok());
  EXPECT_EQ(engine_->Stats().namespaces, before);
  // A namespace its sequence still lives in stays until the sequence ends.
  const std::vector<int32_t> prompt = Prompt(16, 1);
  const AllocateRequest request{.num_tokens = 16, .prompt = prompt};
  absl::StatusOr<Tables> made =
      engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable());
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_TRUE(engine_->Invalidate("tenant-a", "").ok());
  EXPECT_EQ(engine_->Stats().namespaces, before + 1);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

}  // namespace
}  // namespace kvpool::daemon
