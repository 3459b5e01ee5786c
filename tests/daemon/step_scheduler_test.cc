// StepScheduler: which queued calls form each step, driven step by step without threads or a
// pool. A prefill's progress is simulated the way Step advances it.

#include "daemon/engine/step_scheduler.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool::daemon {
namespace {

std::shared_ptr<const Session> MakeSession(uint64_t id) {
  auto s = std::make_shared<Session>();
  s->id = SessionId(id);
  return s;
}

std::unique_ptr<ComputeCall> Decode(std::shared_ptr<const Session> s, int width) {
  ComputeRequest r{.kind = ComputeRequest::Kind::kDecode};
  for (int i = 0; i < width; ++i) r.decode.push_back({SequenceId(100 * s->id.value() + i), 1});
  return std::make_unique<ComputeCall>(std::move(s), std::move(r), nullptr, [](ComputeCall&) {});
}

std::unique_ptr<ComputeCall> Prefill(std::shared_ptr<const Session> s, int tokens) {
  return std::make_unique<ComputeCall>(
      std::move(s),
      ComputeRequest{.kind = ComputeRequest::Kind::kPrefill,
                     .tokens = std::vector<int32_t>(static_cast<size_t>(tokens), 1)},
      nullptr, [](ComputeCall&) {});
}

// What a step does to a prefill it computed: plans it the first time, advances it by its chunk.
void Compute(ComputeCall& call) {
  if (!call.request().prefill()) return;
  if (call.progress() == nullptr) {
    call.StartProgress(
        model::PlannedItem{.sequence = SequenceId(7), .tokens = call.request().tokens});
  }
  call.progress()->Advance(std::min(call.chunk, call.progress()->left()));
}

TEST(StepSchedulerTest, DecodesFirstPrefillsTakeWhatIsLeft) {
  StepScheduler s({.max_step_tokens = 16});
  auto alice = MakeSession(1), bob = MakeSession(2);
  s.Push(Prefill(alice, 100));
  s.Push(Decode(bob, 6));
  std::vector<std::unique_ptr<ComputeCall>> step = s.TakeStep();
  ASSERT_EQ(step.size(), 2u);
  const ComputeCall& prefill = step[0]->request().prefill() ? *step[0] : *step[1];
  EXPECT_EQ(prefill.chunk, 10);  // 16 - 6
  EXPECT_TRUE(s.empty());
}

TEST(StepSchedulerTest, AWideDecodeIsNotKeptOutByChunksUnderWay) {
  StepScheduler s({.max_step_tokens = 4});
  auto alice = MakeSession(1), bob = MakeSession(2);
  auto prefill = Prefill(alice, 256);
  Compute(*prefill);  // under way
  s.PushFront(std::move(prefill));
  s.Push(Decode(bob, 5));  // wider than a step
  std::vector<std::unique_ptr<ComputeCall>> step = s.TakeStep();
  ASSERT_EQ(step.size(), 2u);               // the decode goes at once, beside the chunk
  EXPECT_NE(step[0]->progress(), nullptr);  // prefills under way first
  EXPECT_EQ(step[0]->chunk, 1);             // at least one token each
}

// Issue 10: decodes alone could fill every step and keep a queued prefill out until its deadline.
// Documented bound: a P-token prompt queued behind nothing completes within
// prefill_max_wait_steps + ceil(P / prefill_share) steps.
TEST(StepSchedulerTest, AQueuedPrefillCompletesWithinTheBoundWhateverTheDecodeLoad) {
  const SchedulerOptions options{.max_step_tokens = 8, .prefill_max_wait_steps = 3};
  StepScheduler s(options);
  EXPECT_EQ(s.prefill_share(), 2);  // a quarter of the step
  auto alice = MakeSession(1), bob = MakeSession(2), carol = MakeSession(3);
  s.Push(Decode(bob, 4));
  s.Push(Decode(carol, 4));  // together they fill every step
  s.Push(Prefill(alice, 20));
  const int bound = options.prefill_max_wait_steps + (20 + 2 - 1) / 2;
  int steps = 0;
  bool prefilled = false;
  while (!prefilled && steps < 100) {
    ++steps;
    std::vector<std::unique_ptr<ComputeCall>> step = s.TakeStep();
    int64_t tokens = 0;
    for (auto& call : step) {
      Compute(*call);
      tokens += call->request().prefill() ? call->chunk : call->step_tokens();
    }
    EXPECT_LE(tokens, 10) << "step " << steps;  // decodes keep at most max - share
    for (auto& call : step) {
      if (call->request().prefill()) {
        if (call->progress()->done()) {
          prefilled = true;
        } else {
          s.PushFront(std::move(call));
        }
      } else {
        s.Push(Decode(MakeSession(call->session().id.value()), 4));  // they decode again
      }
    }
  }
  EXPECT_TRUE(prefilled);
  EXPECT_LE(steps, bound);
}

TEST(StepSchedulerTest, WithoutDecodeLoadAPrefillNeedsNoAging) {
  StepScheduler s({.max_step_tokens = 64});
  s.Push(Prefill(MakeSession(1), 20));
  std::vector<std::unique_ptr<ComputeCall>> step = s.TakeStep();
  ASSERT_EQ(step.size(), 1u);
  EXPECT_EQ(step[0]->chunk, 64);
}

TEST(StepSchedulerTest, GatheredWhenThePreviousStepsSessionsQueuedAgain) {
  StepScheduler s({.max_step_tokens = 512});
  auto alice = MakeSession(1), bob = MakeSession(2);
  s.Push(Decode(alice, 1));
  s.Push(Decode(bob, 1));
  EXPECT_TRUE(s.Gathered());  // nobody expected yet
  ASSERT_EQ(s.TakeStep().size(), 2u);
  s.Push(Decode(alice, 1));
  EXPECT_FALSE(s.Gathered());  // bob was in the last step and has not queued again
  s.Push(Prefill(bob, 600));   // a long prompt of his own counts as him
  EXPECT_TRUE(s.Gathered());
}

TEST(StepSchedulerTest, DecodesThatFillAStepNeedNoGathering) {
  StepScheduler s({.max_step_tokens = 4});
  auto alice = MakeSession(1), bob = MakeSession(2);
  s.Push(Decode(alice, 1));
  s.Push(Decode(bob, 1));
  s.TakeStep();
  s.Push(Decode(alice, 4));
  EXPECT_TRUE(s.Gathered());
}

TEST(StepSchedulerTest, WithoutBatchingEveryCallIsAStepInArrivalOrder) {
  StepScheduler s({.batching = false, .max_step_tokens = 512});
  auto alice = MakeSession(1), bob = MakeSession(2);
  s.Push(Prefill(alice, 10));
  s.Push(Decode(bob, 1));
  std::vector<std::unique_ptr<ComputeCall>> first = s.TakeStep(), second = s.TakeStep();
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_TRUE(first[0]->request().prefill());
  EXPECT_FALSE(second[0]->request().prefill());
}

TEST(StepSchedulerTest, RemoveIfTakesOutExactlyTheSelectedCalls) {
  StepScheduler s({.max_step_tokens = 512});
  auto alice = MakeSession(1), bob = MakeSession(2);
  s.Push(Decode(alice, 1));
  s.Push(Decode(bob, 1));
  s.Push(Prefill(alice, 3));
  auto gone = s.RemoveIf([](const ComputeCall& c) { return c.session().id == SessionId(1); });
  EXPECT_EQ(gone.size(), 2u);
  EXPECT_EQ(s.size(), 1u);
  EXPECT_EQ(s.TakeStep()[0]->session().id, SessionId(2));
}

}  // namespace
}  // namespace kvpool::daemon
