// ClientLimits: everything one client can make the engine hold or wait on is bounded, and a call
// over a bound fails with RESOURCE_EXHAUSTED (or OUT_OF_RANGE / INVALID_ARGUMENT for what no
// step can serve), changes nothing, and is counted (issue 12).

#include "absl/synchronization/notification.h"
#include "daemon/engine/engine.h"
#include "fmt/format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using ::testing::HasSubstr;
using testing::HookModel;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

class LimitsTest : public ::testing::Test {
 protected:
  void Make(ClientLimits limits) {
    EngineOptions options = SmallPool(64);
    options.limits = limits;
    model_ = std::make_unique<HookModel>(testing::TinyModel(options.pools[0].layout));
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    alice_ = *engine_->OpenSession(Spec("t", "alice"));
  }

  // Submits and returns the call's status once it completes.
  absl::Status Run(std::shared_ptr<const Session> s, ComputeRequest request) {
    absl::Notification done;
    absl::Status status;
    engine_->Submit(std::make_unique<ComputeCall>(std::move(s), std::move(request), nullptr,
                                                  [&](ComputeCall& c) {
                                                    status = c.result().status;
                                                    done.Notify();
                                                  }));
    done.WaitForNotification();
    return status;
  }
  uint64_t OverLimit() const { return engine_->Stats().calls.over_limit; }
  void ExpectInvariants() {
    const absl::Status s = engine_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
  }

  FailingDevice device_;
  std::unique_ptr<HookModel> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_;
};

TEST_F(LimitsTest, SessionsPerUid) {
  Make({.sessions_per_uid = 2});  // alice (uid 0) holds one already
  SessionSpec mine = Spec("t", "second");
  ASSERT_TRUE(engine_->OpenSession(mine).ok());
  absl::StatusOr<std::shared_ptr<const Session>> third = engine_->OpenSession(mine);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("limits.sessions_per_uid"));
  SessionSpec other = Spec("t", "other uid");
  other.uid = 1000;
  EXPECT_TRUE(engine_->OpenSession(other).ok());
  engine_->EndSession(alice_->id, SessionEnd::kDetached);
  EXPECT_TRUE(engine_->OpenSession(mine).ok());  // a slot again
}

TEST_F(LimitsTest, BatchItems) {
  Make({.batch_items = 3});
  std::vector<AllocateRequest> four(4, AllocateRequest{.num_tokens = 16});
  const auto before = engine_->Stats().cache.pool.free;
  EXPECT_EQ(engine_->Allocate(*alice_, four, CallContext::Uncancellable()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->Stats().cache.pool.free, before);
  absl::StatusOr<Tables> three =
      engine_->Allocate(*alice_, std::span(four).first(3), CallContext::Uncancellable());
  ASSERT_TRUE(three.ok()) << three.status();
  std::vector<GrowRequest> grows;
  std::vector<SequenceId> ids;
  for (const TableSlice& s : three->slices) {
    grows.push_back({s.sequence, 40});
    ids.push_back(s.sequence);
  }
  grows.push_back(grows[0]);
  ids.push_back(ids[0]);
  EXPECT_EQ(engine_->Grow(*alice_, grows, CallContext::Uncancellable()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->Free(*alice_, ids, OnFree::kDiscard, CallContext::Uncancellable()).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(OverLimit(), 3u);
  EXPECT_EQ(engine_->Stats().cache.sequences, 3);
  ExpectInvariants();
}

// Zero-token sequences cost no block and no quota: only this limit bounds them.
TEST_F(LimitsTest, SequencesPerSessionCountZeroTokenOnes) {
  Make({.sequences_per_session = 3});
  std::vector<AllocateRequest> two(2, AllocateRequest{.num_tokens = 0});
  absl::StatusOr<Tables> first = engine_->Allocate(*alice_, two, CallContext::Uncancellable());
  ASSERT_TRUE(first.ok()) << first.status();
  // Two more would make four: the whole batch is refused, nothing created.
  const absl::Status refused =
      engine_->Allocate(*alice_, two, CallContext::Uncancellable()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("limits.sequences_per_session"));
  EXPECT_EQ(engine_->Stats().cache.sequences, 2);
  const SequenceId parent = first->slices[0].sequence;
  ASSERT_TRUE(engine_->Fork(*alice_, parent, CallContext::Uncancellable()).ok());
  EXPECT_EQ(engine_->Fork(*alice_, parent, CallContext::Uncancellable()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(OverLimit(), 2u);
  // Another session has its own count; a freed sequence makes room again.
  std::shared_ptr<const Session> bob = *engine_->OpenSession(Spec("t", "bob"));
  EXPECT_TRUE(engine_->Allocate(*bob, two, CallContext::Uncancellable()).ok());
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&parent, 1), OnFree::kDiscard, CallContext::Uncancellable())
          .ok());
  EXPECT_TRUE(
      engine_->Allocate(*alice_, std::span(two).first(1), CallContext::Uncancellable()).ok());
  ExpectInvariants();
}

// Tenants named t1, t2, ... each come and go: their namespace slots are reused, so the table
// (65,534 slots) never fills.
TEST_F(LimitsTest, IdleNamespaceSlotsAreRecycled) {
  Make({});
  const AllocateRequest empty{.num_tokens = 0};
  const AllocateRequest one_block{.num_tokens = 16};
  for (int i = 0; i < 66'000; ++i) {
    SessionSpec spec = Spec(fmt::format("t{}", i));
    spec.uid = 1000;
    absl::StatusOr<std::shared_ptr<const Session>> s = engine_->OpenSession(spec);
    ASSERT_TRUE(s.ok()) << i << ": " << s.status();
    const AllocateRequest& request = i % 2 == 0 ? empty : one_block;
    const absl::Status allocated =
        engine_->Allocate(**s, std::span(&request, 1), CallContext::Uncancellable()).status();
    ASSERT_TRUE(allocated.ok()) << i << ": " << allocated;
    engine_->EndSession((*s)->id, SessionEnd::kDetached);
  }
  ExpectInvariants();
}

TEST_F(LimitsTest, DecodeWidth) {
  Make({.decode_width = 2});
  ComputeRequest wide{.kind = ComputeRequest::Kind::kDecode,
                      .decode = {{SequenceId(1), 1}, {SequenceId(2), 1}, {SequenceId(3), 1}}};
  const absl::Status s = Run(alice_, wide);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("limits.decode_width"));
  EXPECT_EQ(OverLimit(), 1u);
}

TEST_F(LimitsTest, QueuedCallsPerSession) {
  Make({.queued_calls_per_session = 3});
  // The first call's step blocks until released: the others wait behind it.
  absl::Notification in_step, release;
  model_->during_step = [&] {
    if (!in_step.HasBeenNotified()) in_step.Notify();
    release.WaitForNotification();
  };
  std::atomic<int> finished{0};
  auto submit = [&](std::shared_ptr<const Session> s) {
    engine_->Submit(std::make_unique<ComputeCall>(
        std::move(s),
        ComputeRequest{.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(8, 1)}, nullptr,
        [&](ComputeCall&) { finished.fetch_add(1); }));
  };
  submit(alice_);
  in_step.WaitForNotification();
  submit(alice_);
  submit(alice_);
  // A fourth while three are alive: refused at once, with nothing queued.
  const absl::Status fourth =
      Run(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(8, 2)});
  EXPECT_EQ(fourth.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(fourth.message()), HasSubstr("limits.queued_calls_per_session"));
  // Another session's calls are its own.
  std::shared_ptr<const Session> bob = *engine_->OpenSession(Spec("t", "bob"));
  submit(bob);
  release.Notify();
  while (finished.load() < 4) absl::SleepFor(absl::Milliseconds(1));
  // A call counts until it is destroyed, which is after its callback returns.
  for (int i = 0; i < 5000 && alice_->compute_calls.load() != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(alice_->compute_calls.load(), 0);
  EXPECT_TRUE(Run(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(8, 3)}).ok());
  EXPECT_EQ(OverLimit(), 1u);
  ExpectInvariants();
}

// A call stops counting against queued_calls_per_session once it is answered, not when it is
// destroyed: its callback may queue the next one (a Generate stream submits its next decode from
// there), and a step destroys its finished calls only after all of them were answered. Before,
// with a limit of 1, that next call was refused while nothing else was queued or running.
TEST_F(LimitsTest, AnAnsweredCallNoLongerCounts) {
  Make({.queued_calls_per_session = 1});
  absl::Notification done;
  absl::Status next;
  engine_->Submit(std::make_unique<ComputeCall>(
      alice_, ComputeRequest{.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(8, 1)},
      nullptr, [&](ComputeCall& first) {
        EXPECT_TRUE(first.result().status.ok()) << first.result().status;
        engine_->Submit(std::make_unique<ComputeCall>(
            alice_, ComputeRequest{.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(8, 2)},
            nullptr, [&](ComputeCall& second) {
              next = second.result().status;
              done.Notify();
            }));
      }));
  done.WaitForNotification();
  EXPECT_TRUE(next.ok()) << next;
  EXPECT_EQ(OverLimit(), 0u);
  ExpectInvariants();
}

TEST_F(LimitsTest, WhatNoStepCanServeIsRefusedBeforeItQueues) {
  Make({});
  const int32_t vocab = engine_->model_info().vocab_size;
  EXPECT_EQ(
      Run(alice_,
          {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(8, 1), .top_k = vocab + 1})
          .code(),
      absl::StatusCode::kInvalidArgument);
  const absl::Status long_prompt = Run(
      alice_, {.kind = ComputeRequest::Kind::kPrefill,
               .tokens = Prompt(static_cast<size_t>(engine_->model_info().max_position) + 4, 2)});
  EXPECT_EQ(long_prompt.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(long_prompt.message()), HasSubstr("context"));
  EXPECT_EQ(engine_->Stats().cache.sequences, 0);
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

// Issue 27: a fork copied its parent's token list and table for free (it takes no block), so the
// default limits let one uid's sessions keep tens of GB of token lists. The references a uid's
// sessions hold are bounded together now (compute-only sessions' included: they may still fork,
// which branching a conversation needs, within the same bound).
TEST(TokenListLimitTest, ForksOfAUidsSessionsAreBoundedTogether) {
  FailingDevice device;
  EngineOptions options = SmallPool(64);
  options.limits.block_refs_per_uid = 64;
  std::unique_ptr<Engine> engine = std::move(*Engine::Create(options, &device, nullptr));
  SessionSpec kv = Spec("t", "kv");
  kv.uid = 1000;
  SessionSpec second = Spec("t", "second");
  second.uid = 1000;
  std::shared_ptr<const Session> a = *engine->OpenSession(kv);
  std::shared_ptr<const Session> b = *engine->OpenSession(second);
  const std::vector<int32_t> prompt = Prompt(256, 1);
  const AllocateRequest sixteen{.num_tokens = 256, .prompt = prompt};
  absl::StatusOr<Tables> made =
      engine->Allocate(*a, std::span(&sixteen, 1), CallContext::Uncancellable());
  ASSERT_TRUE(made.ok()) << made.status();
  const SequenceId parent = made->slices[0].sequence;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(engine->Fork(*a, parent, CallContext::Uncancellable()).ok()) << i;  // 64 refs
  }
  const absl::Status refused = engine->Fork(*a, parent, CallContext::Uncancellable()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  // Another session of the same uid shares the bound: its match of the cached prefix would be
  // sixteen more references.
  ASSERT_TRUE(engine->Free(*a, std::span(&parent, 1), OnFree::kCommit, CallContext::Uncancellable())
                  .ok());  // 48 refs left, the prefix cached
  const AllocateRequest again{.num_tokens = 256, .prompt = prompt};
  ASSERT_TRUE(engine->Allocate(*b, std::span(&again, 1), CallContext::Uncancellable()).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(
      engine->Allocate(*b, std::span(&again, 1), CallContext::Uncancellable()).status()));
  // Another uid is not limited by it.
  SessionSpec other = Spec("t", "other");
  other.uid = 1001;
  std::shared_ptr<const Session> c = *engine->OpenSession(other);
  absl::StatusOr<Tables> theirs =
      engine->Allocate(*c, std::span(&sixteen, 1), CallContext::Uncancellable());
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_TRUE(engine->Fork(*c, theirs->slices[0].sequence, CallContext::Uncancellable()).ok());
  EXPECT_TRUE(engine->CheckInvariants().ok());
  // Ending the sessions gives everything back.
  engine->EndSession(a->id, SessionEnd::kDetached);
  engine->EndSession(b->id, SessionEnd::kDetached);
  engine->EndSession(c->id, SessionEnd::kDetached);
  EXPECT_TRUE(engine->CheckInvariants().ok());
  EXPECT_EQ(engine->Stats().cache.sequences, 0);
}

// Issue 28: a pool with a state group gives every live sequence a slot, even one that holds no
// block, so without a bound one uid's sessions could take every slot with empty sequences and
// starve the others. limits.state_slots_per_uid bounds a uid's share.
TEST(StateSlotLimitTest, AUidsSessionsShareABoundedNumberOfStateSlots) {
  FailingDevice device;
  EngineOptions options = SmallPool(64);
  options.pools[0].layout.num_state_slots = 8;
  options.pools[0].layout.state_slot_bytes = 64;
  options.limits.state_slots_per_uid = 3;
  std::unique_ptr<Engine> engine = std::move(*Engine::Create(options, &device, nullptr));
  SessionSpec first = Spec("t", "first"), second = Spec("t", "second"), other = Spec("t", "other");
  first.uid = second.uid = 1000;
  other.uid = 1001;
  std::shared_ptr<const Session> a = *engine->OpenSession(first);
  std::shared_ptr<const Session> b = *engine->OpenSession(second);
  std::shared_ptr<const Session> c = *engine->OpenSession(other);
  const AllocateRequest empty{.num_tokens = 0};
  std::vector<SequenceId> held;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Tables> made =
        engine->Allocate(*(i < 2 ? a : b), std::span(&empty, 1), CallContext::Uncancellable());
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_NE(made->slices[0].state_slot, kInvalidBlock);
    held.push_back(made->slices[0].sequence);
  }
  const absl::Status refused =
      engine->Allocate(*a, std::span(&empty, 1), CallContext::Uncancellable()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("state slots"));
  EXPECT_TRUE(
      absl::IsResourceExhausted(engine->Fork(*b, held[2], CallContext::Uncancellable()).status()));
  // Another uid keeps the rest of the slots.
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(engine->Allocate(*c, std::span(&empty, 1), CallContext::Uncancellable()).ok());
  }
  // A freed sequence gives its slot back to its uid.
  ASSERT_TRUE(
      engine->Free(*a, std::span(&held[0], 1), OnFree::kDiscard, CallContext::Uncancellable())
          .ok());
  EXPECT_TRUE(engine->Fork(*b, held[2], CallContext::Uncancellable()).ok());
  EXPECT_TRUE(engine->CheckInvariants().ok());
  EXPECT_EQ(engine->Stats().cache.states.active, 6);
}

// Issue 28: a tenant's quota_blocks is that many main blocks' bytes, and its sequences' state
// slots are charged theirs: here a slot is three blocks' worth, so a quota of 4 blocks holds one
// sequence of one block. Counting blocks only, it held as many empty sequences as there were slots.
TEST(StateSlotLimitTest, ATenantsQuotaChargesItsStateSlotsTheirBytes) {
  FailingDevice device;
  EngineOptions options = SmallPool(64);
  kernels::PoolLayout& layout = options.pools[0].layout;
  layout.num_state_slots = 8;
  layout.state_slot_bytes = 3 * layout.block_bytes();
  options.open_quota_blocks["tight"] = 4;
  std::unique_ptr<Engine> engine = std::move(*Engine::Create(options, &device, nullptr));
  std::shared_ptr<const Session> s = *engine->OpenSession(Spec("tight"));
  const AllocateRequest one_block{.num_tokens = 16};
  ASSERT_TRUE(engine->Allocate(*s, std::span(&one_block, 1), CallContext::Uncancellable()).ok());
  const AllocateRequest empty{.num_tokens = 0};
  const absl::Status refused =
      engine->Allocate(*s, std::span(&empty, 1), CallContext::Uncancellable()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("bytes in use"));
  EXPECT_EQ(engine->Stats().cache.sequences, 1);
  // What kvpoolctl sessions shows of it: the block and the slot, of 4 blocks' bytes.
  const std::vector<SessionListing> listed = engine->ListSessions();
  ASSERT_EQ(listed.size(), 1u);
  ASSERT_TRUE(listed[0].quota.has_value());
  EXPECT_TRUE(listed[0].quota->bytes);
  EXPECT_EQ(listed[0].quota->used, layout.block_bytes() + layout.state_slot_bytes);
  EXPECT_EQ(listed[0].quota->bound, 4 * layout.block_bytes());
  // Another tenant is not charged for it.
  std::shared_ptr<const Session> other = *engine->OpenSession(Spec("roomy"));
  EXPECT_TRUE(engine->Allocate(*other, std::span(&empty, 1), CallContext::Uncancellable()).ok());
  EXPECT_FALSE(engine->ListSessions()[1].quota.has_value());  // "roomy" has none
  EXPECT_TRUE(engine->CheckInvariants().ok());
}

}  // namespace
}  // namespace kvpool::daemon
