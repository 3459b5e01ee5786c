// AdmissionGate (daemon/engine/admission.h): one test per rule, driven through the gate alone
// (no engine, no processes, no sockets), the documented order of its stages, and that order as
// the engine's calls answer it (AdmissionOrderTest: those failed before the gate, issue 29).

#include "daemon/engine/admission.h"

#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/engine_state.h"
#include "gtest/gtest.h"
#include "kvpool/eviction_policy.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using Code = absl::StatusCode;

constexpr int64_t kMaxTtl = 1'000'000;

AdmissionBounds Bounds() {
  return {.vocab_size = 100,
          .max_position = 64,
          .max_pin_ttl_ns = kMaxTtl,
          .limits = {.sequences_per_session = 4,
                     .batch_items = 3,
                     .queued_calls_per_session = 2,
                     .decode_width = 2}};
}

class AdmissionTest : public ::testing::Test {
 protected:
  AdmissionTest() : gate_(Bounds()) {
    session_.id = SessionId(7);
    session_.spec.tenant = "t";
    session_.spec.kv_access = true;
    session_.max_priority = 1;
  }
  // A live, permitted caller with room under every limit.
  CallerFacts Facts() const { return {.session = &session_}; }
  Code Admit(const CallAsk& ask) const { return Admit(ask, Facts()); }
  Code Admit(const CallAsk& ask, const CallerFacts& facts) const {
    return gate_.Admit(ask, facts).status.code();
  }
  Counted CountedFor(const CallAsk& ask, const CallerFacts& facts) const {
    return gate_.Admit(ask, facts).counted;
  }

  const AdmissionGate gate_;
  Session session_;
  const ComputeRequest prefill_{.kind = ComputeRequest::Kind::kPrefill, .tokens = {1, 2, 3}};
};

// --- Stage 1: arguments ---

TEST_F(AdmissionTest, ASaltOverTheBoundIsAnArgumentError) {
  EXPECT_EQ(Admit({.salt_bytes = {kMaxCacheSaltBytes}}), Code::kOk);
  const Verdict v = gate_.Admit({.salt_bytes = {0, kMaxCacheSaltBytes + 1}}, Facts());
  EXPECT_EQ(v.status.code(), Code::kInvalidArgument);
  EXPECT_EQ(v.status.message(), "item 1: a cache salt of 257 bytes: at most 256");
  EXPECT_EQ(v.counted, Counted::kNone);
}

TEST_F(AdmissionTest, APriorityOutsideTheClassesIsAnArgumentError) {
  EXPECT_EQ(Admit({.priorities = {-1}}), Code::kInvalidArgument);
  EXPECT_EQ(Admit({.priorities = {kNumPriorities}}), Code::kInvalidArgument);
  EXPECT_EQ(Admit({.priorities = {0, 1}}), Code::kOk);
}

TEST_F(AdmissionTest, APinTtlOutsideItsRangeIsAnArgumentError) {
  EXPECT_EQ(Admit({.pin_ttl_ns = 0}), Code::kInvalidArgument);
  EXPECT_EQ(Admit({.pin_ttl_ns = kMaxTtl + 1}), Code::kInvalidArgument);
  EXPECT_EQ(Admit({.pin_ttl_ns = kMaxTtl}), Code::kOk);
}

TEST_F(AdmissionTest, TopKIsBoundedByTheVocabulary) {
  ComputeRequest r = prefill_;
  r.top_k = 100;
  EXPECT_EQ(Admit({.compute = &r}), Code::kOk);
  r.top_k = 101;
  EXPECT_EQ(Admit({.compute = &r}), Code::kInvalidArgument);
  r.top_k = -1;
  EXPECT_EQ(Admit({.compute = &r}), Code::kInvalidArgument);
}

TEST_F(AdmissionTest, SamplingOutOfRangeIsAnArgumentError) {
  ComputeRequest r = prefill_;
  r.sampling = {{.temperature = 3}};
  EXPECT_EQ(Admit({.compute = &r}), Code::kInvalidArgument);
}

TEST_F(AdmissionTest, APromptLongerThanTheContextIsOutOfRange) {
  ComputeRequest r = prefill_;
  r.tokens.assign(65, 1);
  EXPECT_EQ(Admit({.compute = &r}), Code::kOutOfRange);
  r.tokens.assign(64, 1);
  EXPECT_EQ(Admit({.compute = &r}), Code::kOk);
}

// --- Stages 2 and 3: serving, identity ---

TEST_F(AdmissionTest, AStoppedEngineIsUnavailable) {
  CallerFacts f = Facts();
  f.serving = absl::InternalError("device lost");
  EXPECT_EQ(Admit({}, f), Code::kUnavailable);
}

TEST_F(AdmissionTest, AnEndedSessionIsNotFoundAndCounted) {
  CallerFacts f = Facts();
  f.live = absl::NotFoundError("session 7 has ended");
  EXPECT_EQ(Admit({}, f), Code::kNotFound);
  EXPECT_EQ(CountedFor({}, f), Counted::kSessionEnded);
}

TEST_F(AdmissionTest, ACallerThatGaveUpGetsItsOwnStatusAndIsCounted) {
  CallerFacts f = Facts();
  f.waiting = absl::DeadlineExceededError("deadline");
  EXPECT_EQ(Admit({}, f), Code::kDeadlineExceeded);
  EXPECT_EQ(CountedFor({}, f), Counted::kGaveUp);
}

// --- Stage 4: permission ---

TEST_F(AdmissionTest, ASessionWithoutATenantHoldsNothing) {
  session_.spec.tenant.clear();
  EXPECT_EQ(Admit({}), Code::kPermissionDenied);
  EXPECT_EQ(CountedFor({}, Facts()), Counted::kNotPermitted);
}

TEST_F(AdmissionTest, AComputeOnlySessionMayNotHoldBlocksToWrite) {
  session_.spec.kv_access = false;
  EXPECT_EQ(Admit({.kv_access = true}), Code::kPermissionDenied);
  EXPECT_EQ(Admit({.kv_access = false}), Code::kOk);
}

TEST_F(AdmissionTest, APriorityAboveTheCeilingIsNotPermitted) {
  EXPECT_EQ(Admit({.priorities = {1}}), Code::kOk);
  EXPECT_EQ(Admit({.priorities = {0, 2}}), Code::kPermissionDenied);
  EXPECT_EQ(CountedFor({.priorities = {2}}, Facts()), Counted::kNotPermitted);
}

// --- Stage 5: state ---

TEST_F(AdmissionTest, DrainingRefusesOnlyCallsThatMakeSequences) {
  CallerFacts f = Facts();
  f.draining = true;
  EXPECT_EQ(Admit({.creates = true}, f), Code::kUnavailable);
  EXPECT_EQ(CountedFor({.creates = true}, f), Counted::kNone);
  EXPECT_EQ(Admit({.kv_access = true}, f), Code::kOk);
}

// --- Stage 6: limits ---

TEST_F(AdmissionTest, BatchItems) {
  EXPECT_EQ(Admit({.items = 3}), Code::kOk);
  EXPECT_EQ(Admit({.items = 4}), Code::kResourceExhausted);
  EXPECT_EQ(CountedFor({.items = 4}, Facts()), Counted::kOverLimit);
}

TEST_F(AdmissionTest, SequencesPerSession) {
  CallerFacts f = Facts();
  f.held_sequences = 3;
  EXPECT_EQ(Admit({.sequences = 1}, f), Code::kOk);
  EXPECT_EQ(Admit({.sequences = 2}, f), Code::kResourceExhausted);
  EXPECT_EQ(Admit({.sequences = 0}, f), Code::kOk);  // a call that makes none is not bounded
}

TEST_F(AdmissionTest, DecodeWidth) {
  ComputeRequest r{.kind = ComputeRequest::Kind::kDecode,
                   .decode = {{SequenceId(1), 1}, {SequenceId(2), 1}}};
  EXPECT_EQ(Admit({.compute = &r}), Code::kOk);
  r.decode.push_back({SequenceId(3), 1});
  EXPECT_EQ(Admit({.compute = &r}), Code::kResourceExhausted);
}

TEST_F(AdmissionTest, QueuedCallsCountOnlyOnTheWayIn) {
  CallerFacts f = Facts();
  f.queued_calls = 3;  // this call included
  EXPECT_EQ(Admit({.compute = &prefill_, .queues = true}, f), Code::kResourceExhausted);
  EXPECT_EQ(Admit({.compute = &prefill_, .queues = false}, f), Code::kOk);  // as a step plans it
}

// --- The order: a call wrong in several ways gets the earliest stage's code ---

TEST_F(AdmissionTest, ArgumentsComeBeforeIdentityPermissionStateAndLimits) {
  CallerFacts f = Facts();
  f.live = absl::NotFoundError("ended");
  f.draining = true;
  f.held_sequences = 100;
  session_.spec.kv_access = false;
  const CallAsk everything_wrong{.priorities = {kNumPriorities},
                                 .creates = true,
                                 .kv_access = true,
                                 .items = 100,
                                 .sequences = 1};
  EXPECT_EQ(Admit(everything_wrong, f), Code::kInvalidArgument);
  EXPECT_EQ(Admit({.pin_ttl_ns = 0, .kv_access = true}, f), Code::kInvalidArgument);
}

TEST_F(AdmissionTest, IdentityComesBeforePermissionAndLimits) {
  CallerFacts f = Facts();
  f.live = absl::NotFoundError("ended");
  f.held_sequences = 100;
  EXPECT_EQ(Admit({.priorities = {3}, .items = 100, .sequences = 1}, f), Code::kNotFound);
}

TEST_F(AdmissionTest, PermissionComesBeforeStateAndLimits) {
  CallerFacts f = Facts();
  f.draining = true;
  EXPECT_EQ(Admit({.priorities = {2}, .creates = true, .items = 100}, f), Code::kPermissionDenied);
}

TEST_F(AdmissionTest, StateComesBeforeLimits) {
  CallerFacts f = Facts();
  f.draining = true;
  EXPECT_EQ(Admit({.creates = true, .items = 100}, f), Code::kUnavailable);
}

TEST_F(AdmissionTest, CountingGoesToOneCounterPerRefusal) {
  CallCounters c;
  Count(Counted::kSessionEnded, c);
  Count(Counted::kGaveUp, c);
  Count(Counted::kNotPermitted, c);
  Count(Counted::kOverLimit, c);
  Count(Counted::kNone, c);
  EXPECT_EQ(c.session_ended + c.gave_up + c.not_permitted + c.over_limit, 4u);
  EXPECT_EQ(c.session_ended, 1u);
  EXPECT_EQ(c.over_limit, 1u);
}

// --- The same order through the engine's calls (each failed before the gate) ---

class AdmissionOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions options = testing::SmallPool(64);
    options.open_tenant.max_priority = 1;
    options.limits.decode_width = 2;
    model_ = std::make_unique<testing::HookModel>(testing::TinyModel(options.pools[0].layout));
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    alice_ = *engine_->OpenSession(testing::Spec("t", "alice"));
  }
  absl::Status Submit(ComputeRequest request) {
    absl::Notification done;
    absl::Status status;
    engine_->Submit(
        std::make_unique<ComputeCall>(alice_, std::move(request), nullptr, [&](ComputeCall& c) {
          status = c.result().status;
          done.Notify();
        }));
    done.WaitForNotification();
    return status;
  }

  testing::FailingDevice device_;
  std::unique_ptr<testing::HookModel> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_;
};

// kvpool.proto PinRequest: a ttl_ms <= 0 is INVALID_ARGUMENT. Before, a priority above the
// ceiling was checked first and the pin got PERMISSION_DENIED; an ended session got NOT_FOUND.
TEST_F(AdmissionOrderTest, APinsBadTtlIsAnArgumentErrorWhateverElseIsWrong) {
  const std::vector<int32_t> prompt = testing::Prompt(16, 1);
  EXPECT_EQ(engine_->PinPrefix(*alice_, prompt, /*ttl_ns=*/0, /*priority=*/2).status().code(),
            Code::kInvalidArgument);
  const uint64_t not_permitted = engine_->Stats().calls.not_permitted;
  engine_->EndSession(alice_->id, SessionEnd::kDetached);
  EXPECT_EQ(engine_->PinPrefix(*alice_, prompt, 0, 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(engine_->RenewPin(*alice_, PinId(1), 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(engine_->Stats().calls.not_permitted, not_permitted);  // nothing counted
}

// Before, a compute call's priority ceiling and limits were checked before its session's life:
// an ended session's over-ceiling prefill got PERMISSION_DENIED, its wide decode
// RESOURCE_EXHAUSTED.
TEST_F(AdmissionOrderTest, AnEndedSessionsComputeCallIsNotFoundBeforePermissionAndLimits) {
  engine_->EndSession(alice_->id, SessionEnd::kDetached);
  const absl::Status prefill = Submit(
      {.kind = ComputeRequest::Kind::kPrefill, .tokens = testing::Prompt(8, 1), .priority = 2});
  EXPECT_EQ(prefill.code(), Code::kNotFound) << prefill;
  const absl::Status decode =
      Submit({.kind = ComputeRequest::Kind::kDecode,
              .decode = {{SequenceId(1), 1}, {SequenceId(2), 1}, {SequenceId(3), 1}}});
  EXPECT_EQ(decode.code(), Code::kNotFound) << decode;
  EXPECT_EQ(engine_->Stats().calls.over_limit, 0u);
  EXPECT_EQ(engine_->Stats().calls.not_permitted, 0u);
  EXPECT_EQ(engine_->Stats().calls.session_ended, 2u);
}

}  // namespace
}  // namespace kvpool::daemon
