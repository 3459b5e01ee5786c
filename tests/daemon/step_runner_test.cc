// StepRunner: the engine's model loop on an injected clock. Its gather window and the callers'
// deadlines are on a ManualClock that only the test moves: nothing here waits on a wall-clock
// window; waits are for calls to complete.

#include "daemon/engine/step_runner.h"

#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "daemon/engine/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

constexpr int64_t kWindow = 500'000'000;  // 500 ms of manual time

class StepRunnerTest : public ::testing::Test {
 protected:
  void Make(int64_t max_step_tokens, int64_t gather_window_ns) {
    EngineOptions options = SmallPool(256, &clock_);
    options.gather_window_ns = gather_window_ns;
    options.scheduler.max_step_tokens = max_step_tokens;
    model_ = testing::TinyModel(options.pools[0].layout);
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    alice_ = *engine_->OpenSession(Spec("t", "alice"));
    bob_ = *engine_->OpenSession(Spec("t", "bob"));
  }

  // Submits a call and returns a notification of its completion (status and result in `out`).
  std::shared_ptr<absl::Notification> Submit(std::shared_ptr<const Session> s,
                                             ComputeRequest request, ComputeResult* out,
                                             std::shared_ptr<const CallContext> context = {}) {
    auto done = std::make_shared<absl::Notification>();
    engine_->Submit(std::make_unique<ComputeCall>(
        std::move(s), std::move(request), std::move(context), [done, out](ComputeCall& call) {
          *out = call.result();
          done->Notify();
        }));
    return done;
  }
  // engine_->SubmitOrRun: `done` is notified on completion, `thread` says where it ran.
  std::shared_ptr<absl::Notification> SubmitOrRun(std::shared_ptr<const Session> s,
                                                  ComputeRequest request, ComputeResult* out,
                                                  std::thread::id* thread) {
    auto done = std::make_shared<absl::Notification>();
    engine_->SubmitOrRun(std::make_unique<ComputeCall>(std::move(s), std::move(request), nullptr,
                                                       [done, out, thread](ComputeCall& call) {
                                                         *out = call.result();
                                                         *thread = std::this_thread::get_id();
                                                         done->Notify();
                                                       }));
    return done;
  }
  // A prefill to set the scene: the window (if the runner waits for someone) closes at once.
  ComputeResult Prefill(std::shared_ptr<const Session> s, std::vector<int32_t> tokens) {
    ComputeResult r;
    auto done = Submit(std::move(s),
                       {.kind = ComputeRequest::Kind::kPrefill, .tokens = std::move(tokens)}, &r);
    clock_.Advance(kWindow);
    done->WaitForNotification();
    return r;
  }

  ManualClock clock_;
  kernels::CpuDevice device_{1};
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_, bob_;
};

// Chunked prefill beside a decoding session: a long prompt does not start steps without a
// decoder of the previous step (the window never closes: the clock does not move), so each of
// bob's decodes runs in the very next step after it arrives, between the prompt's chunks.
TEST_F(StepRunnerTest, DecodesRunBetweenTheChunksOfALongPromptWithoutWaitingForIt) {
  Make(/*max_step_tokens=*/16, kWindow);
  ComputeResult pb = Prefill(bob_, Prompt(10, 40));
  ASSERT_TRUE(pb.status.ok());
  ComputeResult prefill;
  auto prefilled =
      Submit(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(600, 41)}, &prefill);
  int32_t token = pb.results[0].next_token;
  for (int i = 0; i < 3; ++i) {
    const uint64_t before = engine_->Stats().model.steps;
    ComputeResult d;
    Submit(bob_, {.kind = ComputeRequest::Kind::kDecode, .decode = {{pb.sequences[0], token}}}, &d)
        ->WaitForNotification();
    ASSERT_TRUE(d.status.ok()) << d.status;
    EXPECT_EQ(d.step_sequences, 2);
    EXPECT_EQ(engine_->Stats().model.steps - before, 1u) << "decode " << i;
    EXPECT_FALSE(prefilled->HasBeenNotified());
    token = d.results[0].next_token;
  }
  // bob stops decoding: once his window closes the prompt's chunks go on without him.
  clock_.Advance(kWindow);
  prefilled->WaitForNotification();
  ASSERT_TRUE(prefill.status.ok()) << prefill.status;
  EXPECT_GE(engine_->Stats().model.prefill_chunks, 36u);  // 600 tokens, 15 or 16 a step
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(StepRunnerTest, TheGatherWindowClosesWhenTheClockPassesIt) {
  Make(/*max_step_tokens=*/512, kWindow);
  ComputeResult pa = Prefill(alice_, Prompt(10, 1));
  ComputeResult pb = Prefill(bob_, Prompt(10, 2));
  // The previous step was bob's: alice's decode waits for him until the window closes.
  ComputeResult d;
  auto decoded = Submit(alice_,
                        {.kind = ComputeRequest::Kind::kDecode,
                         .decode = {{pa.sequences[0], pa.results[0].next_token}}},
                        &d);
  EXPECT_FALSE(decoded->HasBeenNotified());
  clock_.Advance(kWindow);
  decoded->WaitForNotification();
  EXPECT_TRUE(d.status.ok()) << d.status;
  EXPECT_EQ(d.step_sequences, 1);
}

// Issue 31: a doorbell decode went through the runner's thread and back (two thread switches of
// the round trip); with the runner idle, SubmitOrRun runs the step on the caller's thread.
TEST_F(StepRunnerTest, SubmitOrRunRunsTheStepOnTheCallingThreadWhenTheRunnerIsIdle) {
  Make(/*max_step_tokens=*/512, kWindow);
  ComputeResult pa = Prefill(alice_, Prompt(10, 1));  // the runner waits for alice next
  const uint64_t before = engine_->Stats().model.steps;
  ComputeResult d;
  std::thread::id ran_on;
  auto decoded = SubmitOrRun(alice_,
                             {.kind = ComputeRequest::Kind::kDecode,
                              .decode = {{pa.sequences[0], pa.results[0].next_token}}},
                             &d, &ran_on);
  ASSERT_TRUE(decoded->HasBeenNotified());  // complete when SubmitOrRun returned
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  ASSERT_TRUE(d.status.ok()) << d.status;
  EXPECT_EQ(d.step_sequences, 1);
  EXPECT_EQ(engine_->Stats().model.steps - before, 1u);
  // The loop still serves Submit afterwards.
  ComputeResult d2;
  Submit(alice_,
         {.kind = ComputeRequest::Kind::kDecode,
          .decode = {{pa.sequences[0], d.results[0].next_token}}},
         &d2)
      ->WaitForNotification();
  EXPECT_TRUE(d2.status.ok()) << d2.status;
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// A call that does not complete a gathered step on its own is queued: the caller does not wait
// for the others, and the step still takes everyone.
TEST_F(StepRunnerTest, SubmitOrRunQueuesACallThatLeavesTheStepGathering) {
  Make(/*max_step_tokens=*/512, kWindow);
  ComputeResult pa = Prefill(alice_, Prompt(10, 1));
  ComputeResult pb = Prefill(bob_, Prompt(10, 2));  // the runner waits for bob next
  ComputeResult da, db;
  std::thread::id a_on, b_on;
  auto a = SubmitOrRun(alice_,
                       {.kind = ComputeRequest::Kind::kDecode,
                        .decode = {{pa.sequences[0], pa.results[0].next_token}}},
                       &da, &a_on);
  EXPECT_FALSE(a->HasBeenNotified());  // queued: bob is not there yet (the clock does not move)
  auto b = SubmitOrRun(bob_,
                       {.kind = ComputeRequest::Kind::kDecode,
                        .decode = {{pb.sequences[0], pb.results[0].next_token}}},
                       &db, &b_on);
  a->WaitForNotification();
  b->WaitForNotification();
  ASSERT_TRUE(da.status.ok()) << da.status;
  ASSERT_TRUE(db.status.ok()) << db.status;
  EXPECT_EQ(da.step_sequences, 2);
  EXPECT_EQ(db.step_sequences, 2);
  EXPECT_EQ(a_on, b_on);  // one step served both
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// Issue 10: a call whose deadline passed while it waited in the queue was still carried out.
TEST_F(StepRunnerTest, ACallWhoseDeadlinePassesInTheQueueLeavesWithNothingCreated) {
  Make(/*max_step_tokens=*/512, kWindow);
  ComputeResult pb = Prefill(bob_, Prompt(10, 2));  // the runner will wait for bob next
  ComputeResult p;
  auto done = Submit(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(30, 3)}, &p,
                     std::make_shared<ManualCallContext>(&clock_, clock_.NowNanos() + 1000));
  clock_.Advance(kWindow);  // past alice's deadline, and the window closes
  done->WaitForNotification();
  EXPECT_EQ(p.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(engine_->Stats().cache.sequences, 1);  // bob's only
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// Issue 10: cancelled between prefill chunks, a prompt's sequence is released, not left behind.
TEST_F(StepRunnerTest, APrefillCancelledBetweenChunksGivesItsSequenceBack) {
  Make(/*max_step_tokens=*/32, kWindow);
  ComputeResult pb = Prefill(bob_, Prompt(10, 5));  // the runner waits for bob next
  auto context = std::make_shared<ManualCallContext>(&clock_);
  ComputeResult p;
  auto prefilled = Submit(
      alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(300, 6)}, &p, context);
  // bob's decode shares the prompt's first step; then alice gives up.
  ComputeResult d;
  Submit(bob_,
         {.kind = ComputeRequest::Kind::kDecode,
          .decode = {{pb.sequences[0], pb.results[0].next_token}}},
         &d)
      ->WaitForNotification();
  ASSERT_TRUE(d.status.ok()) << d.status;
  EXPECT_EQ(d.step_sequences, 2);
  context->Cancel();
  clock_.Advance(kWindow);  // bob is not coming back: the runner goes on, and finds out
  prefilled->WaitForNotification();
  EXPECT_EQ(p.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(engine_->Stats().cache.sequences, 1);  // bob's only
  EXPECT_EQ(engine_->Stats().model.prefill_chunks, 1u);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(StepRunnerTest, EndingASessionCompletesItsQueuedCalls) {
  Make(/*max_step_tokens=*/512, kWindow);
  ComputeResult pb = Prefill(bob_, Prompt(10, 2));  // the runner will wait for bob next
  ComputeResult p;
  auto done = Submit(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(30, 3)}, &p);
  engine_->EndSession(alice_->id, SessionEnd::kConnectionLost);
  done->WaitForNotification();
  EXPECT_EQ(p.status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats().cache.sequences, 1);
  // Counted as a call refused for its ended session, dropped from the queue or refused by its
  // step alike (before, only the second counted).
  EXPECT_EQ(engine_->Stats().calls.session_ended, 1u);
}

TEST_F(StepRunnerTest, StopFailsQueuedCallsAndLaterOnes) {
  Make(/*max_step_tokens=*/512, kWindow);
  ComputeResult pb = Prefill(bob_, Prompt(10, 2));
  ComputeResult queued, late;
  auto done =
      Submit(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(30, 3)}, &queued);
  engine_->StopCompute();
  done->WaitForNotification();
  EXPECT_EQ(queued.status.code(), absl::StatusCode::kUnavailable);
  Submit(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(3, 4)}, &late)
      ->WaitForNotification();
  EXPECT_EQ(late.status.code(), absl::StatusCode::kUnavailable);
  std::thread::id ran_on;
  ComputeResult later;
  EXPECT_TRUE(SubmitOrRun(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(3, 5)},
                          &later, &ran_on)
                  ->HasBeenNotified());
  EXPECT_EQ(later.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(engine_->Stats().cache.sequences, 1);
}

}  // namespace
}  // namespace kvpool::daemon
