// DaemonPool::RunStep, StepRunner and StepTimeline: model steps over the daemon's pool,
// chunked prefill included.

#include <atomic>
#include <random>
#include <string>

#include "absl/synchronization/notification.h"
#include "daemon/config.h"
#include "daemon/pool.h"
#include "daemon/step_runner.h"
#include "daemon/step_timeline.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_device.h"
#include "model/local_engine.h"
#include "model/model.h"

namespace kvpool::daemon {
namespace {

std::vector<int32_t> Prompt(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % 8192);
  return out;
}

class RunStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::DaemonConfig config = DefaultConfig();
    config.set_pool_bytes(int64_t{64} << 16);  // 64 blocks of 64 KiB
    pool_ = std::move(*DaemonPool::Create(config, &device_, 7));
    model_ = std::move(*model::Model::Create(
        model::SyntheticWeights(*model::NamedConfig("tiny"), 1), pool_->layout(), {.threads = 1}));
    alice_ = MakeSession(1);
    bob_ = MakeSession(2);
  }

  std::shared_ptr<const Session> MakeSession(uint64_t id) {
    auto s = std::make_shared<Session>(Session{.id = SessionId(id), .tenant = "t", .model = "m"});
    s->ns = pool_->NamespaceOf("t", "m");
    return s;
  }
  static ComputeCall Prefill(std::shared_ptr<const Session> s, std::vector<int32_t> tokens,
                             SequenceId seq = SequenceId(0)) {
    ComputeCall c;
    c.session = std::move(s);
    c.prefill = true;
    c.sequence = seq;
    c.tokens = std::move(tokens);
    return c;
  }
  static ComputeCall Decode(std::shared_ptr<const Session> s, SequenceId seq, int32_t token) {
    ComputeCall c;
    c.session = std::move(s);
    c.decode = {{seq, token}};
    return c;
  }
  void Run(std::vector<ComputeCall*> calls) { pool_->RunStep(model_.get(), calls); }
  v1::GetStatsResponse Stats() {
    v1::GetStatsResponse s;
    pool_->Stats(&s);
    return s;
  }

  kernels::CpuDevice device_{1};
  std::unique_ptr<DaemonPool> pool_;
  std::unique_ptr<model::Model> model_;
  std::shared_ptr<const Session> alice_, bob_;
};

TEST_F(RunStepTest, OneStepServesSeveralSessionsAsEachAlone) {
  const std::vector<int32_t> a = Prompt(20, 1), b = Prompt(30, 2);
  ComputeCall pa = Prefill(alice_, a), pb = Prefill(bob_, b);
  Run({&pa, &pb});
  ASSERT_TRUE(pa.status.ok()) << pa.status;
  ASSERT_TRUE(pb.status.ok()) << pb.status;
  EXPECT_EQ(pa.step_sequences, 2);
  ComputeCall da = Decode(alice_, pa.items[0].sequence, pa.results[0].next_token);
  ComputeCall db = Decode(bob_, pb.items[0].sequence, pb.results[0].next_token);
  Run({&da, &db});
  ASSERT_TRUE(da.status.ok()) << da.status;
  ASSERT_TRUE(db.status.ok()) << db.status;
  EXPECT_EQ(da.lengths, std::vector<int64_t>{21});
  EXPECT_EQ(db.lengths, std::vector<int64_t>{31});

  // The same model alone, in process.
  auto engine = *model::LocalEngine::Create(model::SyntheticWeights(*model::NamedConfig("tiny"), 1),
                                            {.pool_bytes = int64_t{4} << 20, .threads = 1});
  for (const auto& [prompt, first, second] :
       {std::tuple{a, pa.results[0].next_token, da.results[0].next_token},
        std::tuple{b, pb.results[0].next_token, db.results[0].next_token}}) {
    auto p = engine->Prefill(SequenceId(0), prompt);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->result.next_token, first);
    const model::DecodeInput in{p->sequence, first};
    EXPECT_EQ((*engine->Decode(std::span(&in, 1)))[0].next_token, second);
  }
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.model_steps(), 2u);
  EXPECT_EQ(s.model_step_sequences(), 4u);
  EXPECT_EQ(s.prefill_tokens_computed(), 50u);
  EXPECT_EQ(s.decode_tokens(), 2u);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(RunStepTest, ABadCallFailsAloneAndChangesNothing) {
  ComputeCall p = Prefill(alice_, Prompt(10, 3));
  Run({&p});
  ASSERT_TRUE(p.status.ok());
  const SequenceId seq = p.items[0].sequence;
  const v1::GetStatsResponse before = Stats();
  ComputeCall good = Decode(alice_, seq, p.results[0].next_token);
  ComputeCall foreign = Decode(bob_, seq, 1);                    // alice's sequence
  ComputeCall outside = Prefill(bob_, {1, 2, 9000});             // not in the vocabulary
  ComputeCall too_long = Prefill(bob_, Prompt(64 * 16 + 1, 4));  // more than the pool
  Run({&good, &foreign, &outside, &too_long});
  EXPECT_TRUE(good.status.ok()) << good.status;
  EXPECT_EQ(good.step_sequences, 1);
  EXPECT_EQ(foreign.status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(outside.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(too_long.status.code(), absl::StatusCode::kResourceExhausted);
  const v1::GetStatsResponse after = Stats();
  EXPECT_EQ(after.sequences(), before.sequences());
  EXPECT_EQ(after.free_blocks(), before.free_blocks());  // 11 tokens still fit one block
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(RunStepTest, ASequenceIsInOneStepOnlyOnce) {
  ComputeCall p = Prefill(alice_, Prompt(10, 5));
  Run({&p});
  const SequenceId seq = p.items[0].sequence;
  ComputeCall first = Decode(alice_, seq, 1), second = Decode(alice_, seq, 2);
  Run({&first, &second});
  EXPECT_TRUE(first.status.ok());
  EXPECT_EQ(second.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(first.lengths, std::vector<int64_t>{11});
}

TEST_F(RunStepTest, DrainingRefusesNewSequencesButFinishesOldOnes) {
  ComputeCall p = Prefill(alice_, Prompt(10, 6));
  Run({&p});
  pool_->Drain();
  ComputeCall fresh = Prefill(bob_, Prompt(5, 7));
  ComputeCall more = Decode(alice_, p.items[0].sequence, p.results[0].next_token);
  ComputeCall extend = Prefill(alice_, Prompt(3, 8), p.items[0].sequence);
  Run({&fresh, &more});
  EXPECT_EQ(fresh.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(more.status.ok()) << more.status;
  more.decode.clear();
  Run({&extend});
  EXPECT_TRUE(extend.status.ok()) << extend.status;  // a next turn of a live sequence
}

// The first token the in-process engine predicts after `prompt`.
int32_t AloneFirstToken(const std::vector<int32_t>& prompt) {
  auto engine = *model::LocalEngine::Create(model::SyntheticWeights(*model::NamedConfig("tiny"), 1),
                                            {.pool_bytes = int64_t{4} << 20, .threads = 1});
  return engine->Prefill(SequenceId(0), prompt)->result.next_token;
}

TEST_F(RunStepTest, ChunkedPrefillGivesTheWholePrefillsToken) {
  const std::vector<int32_t> prompt = Prompt(100, 9);
  ComputeCall p = Prefill(alice_, prompt);
  p.chunk = 30;
  int steps = 0;
  do {
    Run({&p});
    ++steps;
    ASSERT_TRUE(p.status.ok()) << p.status;
    if (!p.finished) {
      // Between chunks: the sequence holds every prompt block, nothing is published or answered.
      EXPECT_TRUE(p.planned);
      EXPECT_TRUE(p.results.empty());
      EXPECT_EQ(Stats().prefill_tokens_computed(), 0u);
    }
  } while (!p.finished && steps < 10);
  EXPECT_EQ(steps, 4);  // 30 + 30 + 30 + 10
  EXPECT_FALSE(p.planned);
  ASSERT_EQ(p.results.size(), 1u);
  EXPECT_EQ(p.results[0].next_token, AloneFirstToken(prompt));
  EXPECT_EQ(p.lengths, std::vector<int64_t>{100});
  const v1::GetStatsResponse s = Stats();
  EXPECT_EQ(s.prefill_chunks(), 3u);
  EXPECT_EQ(s.prefill_calls(), 1u);
  EXPECT_EQ(s.prefill_tokens_computed(), 100u);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(RunStepTest, DecodesShareStepsWithAChunkedPrefill) {
  ComputeCall pb = Prefill(bob_, Prompt(20, 10));
  Run({&pb});
  ASSERT_TRUE(pb.status.ok());
  ComputeCall pa = Prefill(alice_, Prompt(70, 11));
  pa.chunk = 32;
  int32_t token = pb.results[0].next_token;
  int decodes = 0;
  do {
    ComputeCall db = Decode(bob_, pb.items[0].sequence, token);
    Run({&pa, &db});
    ASSERT_TRUE(db.status.ok()) << db.status;
    EXPECT_EQ(db.step_sequences, 2);
    token = db.results[0].next_token;
    ++decodes;
  } while (!pa.finished && decodes < 10);
  ASSERT_TRUE(pa.status.ok()) << pa.status;
  EXPECT_EQ(decodes, 3);  // 32 + 32 + 6
  EXPECT_EQ(pa.results[0].next_token, AloneFirstToken(Prompt(70, 11)));
  // alice cannot decode her sequence while its prefill is under way (it is in every step).
  ComputeCall pc = Prefill(alice_, Prompt(40, 12));
  pc.chunk = 16;
  Run({&pc});
  ASSERT_FALSE(pc.finished);
  ComputeCall early = Decode(alice_, pc.items[0].sequence, 1);
  Run({&pc, &early});
  EXPECT_EQ(early.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(pc.status.ok());
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(RunStepTest, ChunkedPrefillOfAFreedSequenceStopsAndLeaksNothing) {
  const int64_t free_before = Stats().free_blocks();
  ComputeCall p = Prefill(alice_, Prompt(200, 13));
  p.chunk = 64;
  Run({&p});
  ASSERT_FALSE(p.finished);
  // The client frees the sequence between chunks: its blocks must not be written again.
  v1::FreeRequest free;
  free.add_sequence_ids(p.items[0].sequence.value());
  ASSERT_TRUE(pool_->Free(*alice_, free).ok());
  Run({&p});
  EXPECT_TRUE(p.finished);
  EXPECT_EQ(p.status.code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(p.planned);
  EXPECT_EQ(Stats().free_blocks(), free_before);
  EXPECT_TRUE(pool_->CheckInvariants().ok());

  // Abandoned at shutdown between chunks: the sequence goes back too.
  ComputeCall q = Prefill(bob_, Prompt(200, 14));
  q.chunk = 64;
  Run({&q});
  ASSERT_FALSE(q.finished);
  EXPECT_EQ(Stats().sequences(), 1u);
  pool_->Abandon(&q);
  EXPECT_EQ(Stats().sequences(), 0u);
  EXPECT_EQ(Stats().free_blocks(), free_before);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(RunStepTest, RunnerServesDecodesBetweenTheChunksOfALongPrompt) {
  ComputeCall pb = Prefill(bob_, Prompt(20, 15));
  Run({&pb});
  ASSERT_TRUE(pb.status.ok());
  StepRunner runner(pool_.get(), model_.get(),
                    {.gather_window = absl::Milliseconds(1), .max_step_tokens = 48});
  absl::Mutex mu;
  std::vector<std::string> order;  // which call finished when
  absl::Notification prefilled;
  int32_t first = -1;
  auto prefill = std::make_unique<ComputeCall>(Prefill(alice_, Prompt(600, 16)));
  prefill->done = [&](ComputeCall& c) {
    EXPECT_TRUE(c.status.ok()) << c.status;
    first = c.results.empty() ? -1 : c.results[0].next_token;
    absl::MutexLock lock(&mu);
    order.push_back("prefill");
    prefilled.Notify();
  };
  runner.Submit(std::move(prefill));
  // bob decodes meanwhile, one call after another.
  int32_t token = pb.results[0].next_token;
  for (int i = 0; i < 3; ++i) {
    absl::Notification decoded;
    auto d = std::make_unique<ComputeCall>(Decode(bob_, pb.items[0].sequence, token));
    d->done = [&](ComputeCall& c) {
      EXPECT_TRUE(c.status.ok()) << c.status;
      token = c.results[0].next_token;
      absl::MutexLock lock(&mu);
      order.push_back("decode");
      decoded.Notify();
    };
    runner.Submit(std::move(d));
    decoded.WaitForNotification();
  }
  prefilled.WaitForNotification();
  runner.Stop();
  // 600 prompt tokens at most 48 a step (47 when bob's decode is in it) take 13 steps or more;
  // bob's three decodes, each taking one step or two, finished inside them, not after.
  EXPECT_EQ(order.back(), "prefill");
  EXPECT_EQ(first, AloneFirstToken(Prompt(600, 16)));
  EXPECT_GE(Stats().prefill_chunks(), 12u);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(RunStepTest, ADecodeWiderThanAStepIsNotKeptOutByChunks) {
  // Five sequences of bob's, decoded in one call: wider than a step of four tokens.
  std::vector<model::DecodeInput> inputs;
  for (uint32_t i = 0; i < 5; ++i) {
    ComputeCall p = Prefill(bob_, Prompt(8, 20 + i));
    Run({&p});
    ASSERT_TRUE(p.status.ok()) << p.status;
    inputs.push_back({p.items[0].sequence, p.results[0].next_token});
  }
  StepRunner runner(pool_.get(), model_.get(),
                    {.gather_window = absl::Milliseconds(1), .max_step_tokens = 4});
  absl::Notification prefilled, decoded;
  std::atomic<bool> decoded_first{false};
  auto prefill = std::make_unique<ComputeCall>(Prefill(alice_, Prompt(256, 30)));
  prefill->done = [&](ComputeCall& c) {
    EXPECT_TRUE(c.status.ok()) << c.status;
    prefilled.Notify();
  };
  runner.Submit(std::move(prefill));
  // The decode arrives while the prompt is under way (its later chunks are always in a step).
  while (Stats().prefill_chunks() == 0) absl::SleepFor(absl::Milliseconds(1));
  auto decode = std::make_unique<ComputeCall>();
  decode->session = bob_;
  decode->decode = inputs;
  decode->done = [&](ComputeCall& c) {
    EXPECT_TRUE(c.status.ok()) << c.status;
    decoded_first = !prefilled.HasBeenNotified();
    decoded.Notify();
  };
  runner.Submit(std::move(decode));
  decoded.WaitForNotification();
  prefilled.WaitForNotification();
  runner.Stop();
  // 256 prompt tokens take 64 steps of four: the decode went in one of them.
  EXPECT_TRUE(decoded_first);
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

TEST_F(RunStepTest, ALongPromptDoesNotStartStepsWithoutTheDecodersThatAreDue) {
  ComputeCall pb = Prefill(bob_, Prompt(10, 40));
  Run({&pb});
  ASSERT_TRUE(pb.status.ok());
  StepRunner runner(pool_.get(), model_.get(),
                    {.gather_window = absl::Milliseconds(500), .max_step_tokens = 16});
  absl::Notification prefilled;
  auto prefill = std::make_unique<ComputeCall>(Prefill(alice_, Prompt(600, 41)));
  prefill->done = [&](ComputeCall& c) {
    EXPECT_TRUE(c.status.ok()) << c.status;
    prefilled.Notify();
  };
  runner.Submit(std::move(prefill));
  int32_t token = pb.results[0].next_token;
  for (int i = 0; i < 3; ++i) {
    // bob thinks for a while between decodes; the prompt's chunks wait for him (he was in the
    // last step), so his decode runs in the very next step: one step from submit to answer.
    absl::SleepFor(absl::Milliseconds(50));
    const uint64_t before = Stats().model_steps();
    absl::Notification decoded;
    auto d = std::make_unique<ComputeCall>(Decode(bob_, pb.items[0].sequence, token));
    d->done = [&](ComputeCall& c) {
      EXPECT_TRUE(c.status.ok()) << c.status;
      EXPECT_EQ(c.step_sequences, 2);
      token = c.results[0].next_token;
      decoded.Notify();
    };
    runner.Submit(std::move(d));
    decoded.WaitForNotification();
    if (i > 0) {  // the first time, bob was not in the step before
      EXPECT_EQ(Stats().model_steps() - before, 1u) << "decode " << i;
    }
  }
  prefilled.WaitForNotification();
  runner.Stop();
  EXPECT_TRUE(pool_->CheckInvariants().ok());
}

// A fake device timeline: fences up to `passed` have passed.
class FakeDevice final : public FenceObserver {
 public:
  bool HasPassed(Fence f) const override { return f.value <= passed; }
  uint64_t passed = 0;
};

TEST(StepTimelineTest, StepFencesPassWhenTheStepCompletesOthersAskTheDevice) {
  FakeDevice device;
  StepTimeline steps(&device);
  const Fence a = steps.Issue(), b = steps.Issue();
  EXPECT_EQ(a.timeline, StepTimeline::kTimeline);
  EXPECT_EQ(b.value, a.value + 1);
  EXPECT_FALSE(steps.HasPassed(a));
  steps.Complete(a);
  EXPECT_TRUE(steps.HasPassed(a));
  EXPECT_FALSE(steps.HasPassed(b));
  steps.Complete(b);
  EXPECT_TRUE(steps.HasPassed(b));
  EXPECT_TRUE(steps.HasPassed(Fence{StepTimeline::kTimeline, 0}));
  EXPECT_FALSE(steps.HasPassed(Fence{0, 3}));
  device.passed = 3;
  EXPECT_TRUE(steps.HasPassed(Fence{0, 3}));
  EXPECT_TRUE(steps.HasPassed(Fence{1, 2}));
}

}  // namespace
}  // namespace kvpool::daemon
