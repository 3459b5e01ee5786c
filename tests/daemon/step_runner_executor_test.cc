// StepRunner over a fake StepExecutor (issue 29): the runner needs only the interface, so its
// queueing is tested here without an engine, a model or a pool. Pools take turns; a prefill with
// tokens left runs its next chunk ahead of newer calls; a queued call whose caller gave up, whose
// session ended, or that is queued at Stop() is abandoned through the executor with the reason
// and never reaches a step; every call completes exactly once.

#include <atomic>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/engine/step_executor.h"
#include "daemon/engine/step_runner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/clock.h"

namespace kvpool::daemon {
namespace {

using ::testing::ElementsAre;

// Records each step (its pool, and per call the session and the tokens it "computed") and each
// abandoned call. A prefill computes its chunk of the prompt; a decode, one token.
class FakeExecutor final : public StepExecutor {
 public:
  struct Seen {
    int32_t pool = 0;
    std::vector<uint64_t> sessions;
    std::vector<int64_t> tokens;
  };

  void RunStep(int32_t pool, std::span<ComputeCall* const> calls) override {
    const int running = ++running_;
    int most = most_running_.load();
    while (running > most && !most_running_.compare_exchange_weak(most, running)) {
    }
    if (gate_ != nullptr && !entered_.HasBeenNotified()) {
      entered_.Notify();  // the first step holds here until the test opens the gate
      gate_->WaitForNotification();
    }
    --running_;
    Seen seen{.pool = pool};
    for (ComputeCall* call : calls) {
      int64_t n = 1;
      if (call->request().prefill()) {
        if (call->progress() == nullptr) call->StartProgress({.tokens = call->request().tokens});
        n = std::min(call->chunk, call->progress()->left());
        call->progress()->Advance(n);
      }
      seen.sessions.push_back(call->session().id.value());
      seen.tokens.push_back(n);
    }
    absl::MutexLock lock(&mu_);
    steps_.push_back(std::move(seen));
  }
  void Abandon(ComputeCall& call, const absl::Status& why) override {
    call.result().status = why;
    absl::MutexLock lock(&mu_);
    abandoned_.push_back(call.session().id.value());
  }

  std::vector<Seen> steps() const {
    absl::MutexLock lock(&mu_);
    return steps_;
  }
  std::vector<uint64_t> abandoned() const {
    absl::MutexLock lock(&mu_);
    return abandoned_;
  }
  // Holds the first step inside RunStep until `gate` is notified; entered() says it got there.
  void HoldFirstStep(absl::Notification* gate) { gate_ = gate; }
  absl::Notification& entered() { return entered_; }
  // The most steps RunStep ever ran at once.
  int most_running() const { return most_running_.load(); }

 private:
  mutable absl::Mutex mu_;
  absl::Notification* gate_ = nullptr;  // set before any step
  absl::Notification entered_;
  std::atomic<int> running_{0};
  std::atomic<int> most_running_{0};
  std::vector<Seen> steps_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> abandoned_ ABSL_GUARDED_BY(mu_);
};

std::shared_ptr<const Session> SessionOf(uint64_t id, int32_t pool) {
  auto s = std::make_shared<Session>();
  s->id = SessionId(id);
  s->pool = pool;
  return s;
}

// A call's completion: how often, and the status.
struct Completion {
  absl::Notification done;
  absl::Status status;
  std::atomic<int> times{0};
};

class StepRunnerExecutorTest : public ::testing::Test {
 protected:
  void Start(int32_t pools, int64_t max_step_tokens = 1 << 20) {
    runner_ = std::make_unique<StepRunner>(&executor_, pools, &clock_, /*gather_window_ns=*/0,
                                           SchedulerOptions{.max_step_tokens = max_step_tokens});
  }
  Completion* Submit(std::shared_ptr<const Session> s, ComputeRequest r,
                     std::shared_ptr<const CallContext> context = nullptr) {
    Completion* c = NewCompletion();
    runner_->Submit(Call(c, std::move(s), std::move(r), std::move(context)));
    return c;
  }
  Completion* NewCompletion() {
    completions_.push_back(std::make_unique<Completion>());
    return completions_.back().get();
  }
  static std::unique_ptr<ComputeCall> Call(Completion* c, std::shared_ptr<const Session> s,
                                           ComputeRequest r,
                                           std::shared_ptr<const CallContext> context = nullptr) {
    return std::make_unique<ComputeCall>(std::move(s), std::move(r), std::move(context),
                                         [c](ComputeCall& call) {
                                           c->status = call.result().status;
                                           ++c->times;
                                           c->done.Notify();
                                         });
  }
  static ComputeRequest Prefill(size_t tokens) {
    return {.kind = ComputeRequest::Kind::kPrefill, .tokens = std::vector<int32_t>(tokens, 1)};
  }
  static ComputeRequest Decode() {
    return {.kind = ComputeRequest::Kind::kDecode, .decode = {{SequenceId(1), 0}}};
  }

  ManualClock clock_;
  FakeExecutor executor_;
  std::vector<std::unique_ptr<Completion>> completions_;
  std::unique_ptr<StepRunner> runner_;  // first to go: joins the loop before the rest
};

// Issue 31 (decode31): an idle runner's step runs on SubmitOrRun's caller, the lock released
// while it runs. The gap is held open here: while that step is inside the executor, a call
// submitted to the loop must wait for it (stepping_), never run beside it.
TEST_F(StepRunnerExecutorTest, AStepRunOnTheCallersThreadExcludesTheLoopsUntilItEnds) {
  absl::Notification gate;
  executor_.HoldFirstStep(&gate);
  Start(1);
  Completion* inline_call = NewCompletion();
  std::thread caller([&] { runner_->SubmitOrRun(Call(inline_call, SessionOf(1, 0), Decode())); });
  executor_.entered().WaitForNotification();  // the caller's step is in the executor
  Completion* queued = Submit(SessionOf(2, 0), Decode());
  EXPECT_FALSE(queued->done.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  gate.Notify();
  caller.join();
  queued->done.WaitForNotification();
  EXPECT_TRUE(inline_call->done.HasBeenNotified());
  EXPECT_EQ(executor_.most_running(), 1);
  const std::vector<FakeExecutor::Seen> steps = executor_.steps();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_THAT(steps[0].sessions, ElementsAre(1u));
  EXPECT_THAT(steps[1].sessions, ElementsAre(2u));
  EXPECT_EQ(inline_call->times.load(), 1);
  EXPECT_EQ(queued->times.load(), 1);
}

TEST_F(StepRunnerExecutorTest, EveryCallRunsAndCompletesOnce) {
  Start(2);
  Completion* a = Submit(SessionOf(1, 0), Decode());
  Completion* b = Submit(SessionOf(2, 1), Decode());
  a->done.WaitForNotification();
  b->done.WaitForNotification();
  runner_->Stop();
  EXPECT_TRUE(a->status.ok() && b->status.ok());
  EXPECT_EQ(a->times, 1);
  EXPECT_EQ(b->times, 1);
  int64_t runs = 0;
  for (const FakeExecutor::Seen& s : executor_.steps()) {
    for (size_t i = 0; i < s.sessions.size(); ++i) {
      // A step's calls are its pool's sessions only (block ids index one pool's arena).
      EXPECT_EQ(s.pool, static_cast<int32_t>(s.sessions[i] - 1));
      ++runs;
    }
  }
  EXPECT_EQ(runs, 2);
  EXPECT_TRUE(executor_.abandoned().empty());
}

TEST_F(StepRunnerExecutorTest, APrefillRunsInChunksUntilItsPromptIsDone) {
  Start(1, /*max_step_tokens=*/16);
  Completion* c = Submit(SessionOf(1, 0), Prefill(40));
  c->done.WaitForNotification();
  runner_->Stop();
  std::vector<int64_t> chunks;
  for (const FakeExecutor::Seen& s : executor_.steps()) chunks.push_back(s.tokens.at(0));
  EXPECT_THAT(chunks, ElementsAre(16, 16, 8));
  EXPECT_EQ(c->times, 1);  // completed once, after its last chunk
}

TEST_F(StepRunnerExecutorTest, ACallerWhoGaveUpWhileQueuedIsAbandonedNotRun) {
  Start(1);
  auto gone = std::make_shared<ManualCallContext>(&clock_);
  gone->Cancel();
  Completion* c = Submit(SessionOf(7, 0), Decode(), gone);
  Completion* other = Submit(SessionOf(8, 0), Decode());
  c->done.WaitForNotification();
  other->done.WaitForNotification();
  runner_->Stop();
  EXPECT_TRUE(absl::IsCancelled(c->status)) << c->status;
  EXPECT_THAT(executor_.abandoned(), ElementsAre(7));
  for (const FakeExecutor::Seen& s : executor_.steps()) {
    EXPECT_THAT(s.sessions, ::testing::Not(::testing::Contains(7)));
  }
}

TEST_F(StepRunnerExecutorTest, QueuedCallsOfAnEndedSessionAndAtStopAreAbandoned) {
  Start(1);
  runner_->Stop();  // nothing runs from here on
  Completion* late = Submit(SessionOf(3, 0), Decode());
  ASSERT_TRUE(late->done.HasBeenNotified());  // completed at once, on this thread
  EXPECT_TRUE(absl::IsUnavailable(late->status)) << late->status;
  EXPECT_EQ(late->times, 1);
  EXPECT_THAT(executor_.abandoned(), ElementsAre(3));
  EXPECT_TRUE(executor_.steps().empty());
}

}  // namespace
}  // namespace kvpool::daemon
