// Model steps through the Engine (its StepExecutor, the runner's hook, driven directly here):
// planning, chunked prefill, and the bugs a step used to have with sessions, cancellation,
// eviction and failed device work.

#include <sys/mman.h>

#include <cstring>

#include "daemon/engine/engine.h"
#include "daemon/engine/internal/step_executor_of.h"
#include "daemon/engine/step_timeline.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/local_engine.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using testing::HookModel;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

class StepTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(64); }
  void Make(int32_t num_blocks, kernels::FillPolicy fill = kernels::FillPolicy::kNone) {
    engine_.reset();
    EngineOptions options = SmallPool(num_blocks);
    options.fill_policy = fill;
    model_ = std::make_unique<HookModel>(testing::TinyModel(options.pools[0].layout));
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    alice_ = *engine_->OpenSession(Spec("t", "alice"));
    bob_ = *engine_->OpenSession(Spec("t", "bob"));
    other_ = *engine_->OpenSession(Spec("other-tenant", "carol"));
  }

  static std::unique_ptr<ComputeCall> Prefill(std::shared_ptr<const Session> s,
                                              std::vector<int32_t> tokens,
                                              SequenceId seq = SequenceId(0),
                                              std::shared_ptr<const CallContext> context = {}) {
    return std::make_unique<ComputeCall>(
        std::move(s),
        ComputeRequest{
            .kind = ComputeRequest::Kind::kPrefill, .sequence = seq, .tokens = std::move(tokens)},
        std::move(context), [](ComputeCall&) {});
  }
  static std::unique_ptr<ComputeCall> Decode(std::shared_ptr<const Session> s, SequenceId seq,
                                             int32_t token) {
    return std::make_unique<ComputeCall>(
        std::move(s),
        ComputeRequest{.kind = ComputeRequest::Kind::kDecode, .decode = {{seq, token}}}, nullptr,
        [](ComputeCall&) {});
  }
  void Run(std::vector<ComputeCall*> calls) { StepExecutorOf(*engine_).RunStep(/*pool=*/0, calls); }
  void ExpectInvariants() {
    const absl::Status s = engine_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
  }

  FailingDevice device_;
  std::unique_ptr<HookModel> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_, bob_, other_;
};

// The first token the in-process engine predicts after `prompt`.
int32_t AloneFirstToken(const std::vector<int32_t>& prompt) {
  auto engine = *model::LocalEngine::Create(model::SyntheticWeights(*model::NamedConfig("tiny"), 1),
                                            {.pool_bytes = int64_t{4} << 20, .threads = 1});
  return engine->Prefill(SequenceId(0), prompt)->result.next_token;
}

// Each call gets its own top_k, and one no step can serve fails that call alone: before, the
// step ran the widest top_k of its calls and a bad one failed them all (issue 12).
TEST_F(StepTest, EachCallHasItsOwnTopK) {
  const int32_t vocab = engine_->model_info().vocab_size;
  auto call = [](std::shared_ptr<const Session> s, std::vector<int32_t> prompt, int32_t top_k) {
    return std::make_unique<ComputeCall>(
        std::move(s),
        ComputeRequest{
            .kind = ComputeRequest::Kind::kPrefill, .tokens = std::move(prompt), .top_k = top_k},
        nullptr, [](ComputeCall&) {});
  };
  auto bad = call(alice_, Prompt(10, 1), vocab + 1);
  auto three = call(bob_, Prompt(12, 2), 3);
  auto none = call(other_, Prompt(14, 3), 0);
  Run({bad.get(), three.get(), none.get()});
  EXPECT_EQ(bad->result().status.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(three->result().status.ok()) << three->result().status;
  ASSERT_TRUE(none->result().status.ok()) << none->result().status;
  EXPECT_EQ(three->result().results[0].top.size(), 3u);
  EXPECT_TRUE(none->result().results[0].top.empty());
  EXPECT_EQ(three->result().step_sequences, 2);
  ExpectInvariants();
}

TEST_F(StepTest, OneStepServesSeveralSessionsAsEachAlone) {
  const std::vector<int32_t> a = Prompt(20, 1), b = Prompt(30, 2);
  auto pa = Prefill(alice_, a), pb = Prefill(bob_, b);
  Run({pa.get(), pb.get()});
  ASSERT_TRUE(pa->result().status.ok()) << pa->result().status;
  ASSERT_TRUE(pb->result().status.ok()) << pb->result().status;
  EXPECT_EQ(pa->result().step_sequences, 2);
  auto da = Decode(alice_, pa->result().sequences[0], pa->result().results[0].next_token);
  auto db = Decode(bob_, pb->result().sequences[0], pb->result().results[0].next_token);
  Run({da.get(), db.get()});
  ASSERT_TRUE(da->result().status.ok()) << da->result().status;
  EXPECT_EQ(da->result().lengths, std::vector<int64_t>{21});
  EXPECT_EQ(db->result().lengths, std::vector<int64_t>{31});

  auto local = *model::LocalEngine::Create(model::SyntheticWeights(*model::NamedConfig("tiny"), 1),
                                           {.pool_bytes = int64_t{4} << 20, .threads = 1});
  for (const auto& [prompt, first, second] :
       {std::tuple{a, pa->result().results[0].next_token, da->result().results[0].next_token},
        std::tuple{b, pb->result().results[0].next_token, db->result().results[0].next_token}}) {
    auto p = local->Prefill(SequenceId(0), prompt);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->result.next_token, first);
    const model::DecodeInput in{p->sequence, first};
    EXPECT_EQ((*local->Decode(std::span(&in, 1)))[0].next_token, second);
  }
  const EngineStats s = engine_->Stats();
  EXPECT_EQ(s.model.steps, 2u);
  EXPECT_EQ(s.model.step_sequences, 4u);
  EXPECT_EQ(s.model.prefill_computed, 50u);
  EXPECT_EQ(s.model.decode_tokens, 2u);
  ExpectInvariants();
}

TEST_F(StepTest, ABadCallFailsAloneAndChangesNothing) {
  auto p = Prefill(alice_, Prompt(10, 3));
  Run({p.get()});
  ASSERT_TRUE(p->result().status.ok());
  const SequenceId seq = p->result().sequences[0];
  const EngineStats before = engine_->Stats();
  auto good = Decode(alice_, seq, p->result().results[0].next_token);
  auto foreign = Decode(bob_, seq, 1);                    // alice's sequence
  auto outside = Prefill(bob_, {1, 2, 9000});             // not in the vocabulary
  auto too_long = Prefill(bob_, Prompt(64 * 16 + 1, 4));  // more than the pool
  Run({good.get(), foreign.get(), outside.get(), too_long.get()});
  EXPECT_TRUE(good->result().status.ok()) << good->result().status;
  EXPECT_EQ(good->result().step_sequences, 1);
  EXPECT_EQ(foreign->result().status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(outside->result().status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(too_long->result().status.code(), absl::StatusCode::kResourceExhausted);
  const EngineStats after = engine_->Stats();
  EXPECT_EQ(after.cache.sequences, before.cache.sequences);
  EXPECT_EQ(after.cache.pool.free, before.cache.pool.free);  // 11 tokens still fit one block
  ExpectInvariants();
}

TEST_F(StepTest, ASequenceIsInOneStepOnlyOnce) {
  auto p = Prefill(alice_, Prompt(10, 5));
  Run({p.get()});
  const SequenceId seq = p->result().sequences[0];
  auto first = Decode(alice_, seq, 1), second = Decode(alice_, seq, 2);
  Run({first.get(), second.get()});
  EXPECT_TRUE(first->result().status.ok());
  EXPECT_EQ(second->result().status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(first->result().lengths, std::vector<int64_t>{11});
}

TEST_F(StepTest, DrainingRefusesNewSequencesButFinishesOldOnes) {
  auto p = Prefill(alice_, Prompt(10, 6));
  Run({p.get()});
  engine_->Drain();
  auto fresh = Prefill(bob_, Prompt(5, 7));
  auto more = Decode(alice_, p->result().sequences[0], p->result().results[0].next_token);
  Run({fresh.get(), more.get()});
  EXPECT_EQ(fresh->result().status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(more->result().status.ok()) << more->result().status;
  auto extend = Prefill(alice_, Prompt(3, 8), p->result().sequences[0]);
  Run({extend.get()});
  EXPECT_TRUE(extend->result().status.ok()) << extend->result().status;  // a next turn
}

// Issue 10: a call that waited in the queue while its session ended used to be carried out
// anyway, leaving a sequence nobody could free.
TEST_F(StepTest, APrefillOfAnEndedSessionIsRefusedAndLeavesNothing) {
  engine_->EndSession(alice_->id, SessionEnd::kConnectionLost);
  auto p = Prefill(alice_, Prompt(20, 1));
  Run({p.get()});
  EXPECT_EQ(p->result().status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats().cache.sequences, 0);
  ExpectInvariants();
}

// Issue 10: a prefill whose caller gave up while its step ran created a sequence the caller never
// learned of.
TEST_F(StepTest, APrefillWhoseCallerGaveUpDuringItsStepLeavesNothing) {
  auto p =
      Prefill(alice_, Prompt(40, 2), SequenceId(0), std::make_shared<testing::GivesUpAfter>(1));
  Run({p.get()});
  EXPECT_EQ(p->result().status.code(), absl::StatusCode::kCancelled);
  const EngineStats s = engine_->Stats();
  EXPECT_EQ(s.cache.sequences, 0);
  EXPECT_EQ(s.calls.released_on_give_up, 1u);
  EXPECT_EQ(s.cache.pool.active, 0);  // nothing is held, nothing was published
  ExpectInvariants();
}

// Issue 10: a rewind's copy-on-write and a later call's eviction in the same step. A prefills two
// committed blocks, every other block is taken, A rewinds into its second block; then one step
// decodes A (copying that block, which goes back to the cache) and prefills another tenant's
// prompt (which needs a block: it used to evict A's copy source, get it back from the LIFO free
// list and zero it before the copy ran).
TEST_F(StepTest, ARewindCopyIsNotClobberedByAnEvictionInTheSameStep) {
  const kernels::PoolLayout layout = engine_->layout();
  absl::StatusOr<PoolGrant> grant = engine_->Grant(alice_);
  ASSERT_TRUE(grant.ok());
  auto* arena = static_cast<uint8_t*>(
      mmap(nullptr, layout.arena_bytes(), PROT_READ, MAP_SHARED, grant->arena->fd.get(), 0));
  ASSERT_NE(arena, MAP_FAILED);
  auto p = Prefill(alice_, Prompt(32, 2));
  Run({p.get()});
  ASSERT_TRUE(p->result().status.ok()) << p->result().status;
  const SequenceId a = p->result().sequences[0];
  const auto old_block = [&] {
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    return engine_->ListSequences(std::nullopt, alice_->id, &owners, &pools).blocks[1].value();
  }();
  const int64_t bytes = layout.block_bytes();
  const std::vector<uint8_t> original(arena + old_block * bytes, arena + (old_block + 1) * bytes);
  const AllocateRequest hog{.num_tokens = (engine_->Stats().cache.pool.free - 1) * 16};
  ASSERT_TRUE(engine_->Allocate(*bob_, std::span(&hog, 1), CallContext::Uncancellable()).ok());
  ASSERT_TRUE(engine_->Truncate(*alice_, a, 20, CallContext::Uncancellable()).ok());

  auto decode = Decode(alice_, a, p->result().results[0].next_token);
  auto other = Prefill(other_, Prompt(10, 3));
  Run({decode.get(), other.get()});
  ASSERT_TRUE(decode->result().status.ok()) << decode->result().status;
  std::vector<SessionId> owners;
  std::vector<int32_t> pools;
  const int32_t copy =
      engine_->ListSequences(std::nullopt, alice_->id, &owners, &pools).blocks[1].value();
  ASSERT_NE(copy, old_block);
  // Tokens 16..19 of the copy are the original's in every layer's K and V.
  const int64_t chunk = layout.chunk_bytes(), row = chunk / layout.block_size;
  for (int l = 0; l < 2 * layout.num_layers; ++l) {
    EXPECT_EQ(0, std::memcmp(arena + copy * bytes + l * chunk, original.data() + l * chunk,
                             static_cast<size_t>(4 * row)))
        << "chunk " << l;
  }
  munmap(arena, static_cast<size_t>(layout.arena_bytes()));
  ExpectInvariants();
}

// The client frees a sequence while its decode step runs (outside the engine's lock): the blocks
// the step reads and writes retire, and go back to the free list only once the step is done.
TEST_F(StepTest, BlocksOfAStepStayOutOfTheFreeListWhenTheirSequenceIsFreedMidStep) {
  auto p = Prefill(alice_, Prompt(40, 3));
  Run({p.get()});
  ASSERT_TRUE(p->result().status.ok());
  const SequenceId id = p->result().sequences[0];
  const int32_t free_before = engine_->Stats().cache.pool.free;
  int32_t retiring_during = -1, free_during = -1;
  model_->during_step = [&] {
    ASSERT_TRUE(
        engine_->Free(*alice_, std::span(&id, 1), OnFree::kDiscard, CallContext::Uncancellable())
            .ok());
    const EngineStats s = engine_->Stats();
    retiring_during = s.cache.pool.retiring;
    free_during = s.cache.pool.free;
  };
  auto d = Decode(alice_, id, p->result().results[0].next_token);
  Run({d.get()});
  model_->during_step = nullptr;
  EXPECT_EQ(d->result().status.code(), absl::StatusCode::kNotFound);  // freed under it
  // 41 tokens in three blocks: the two full ones are cached (published by the prefill), the
  // third retires: none of them can be handed out again while the step runs.
  EXPECT_EQ(retiring_during, 1);
  EXPECT_EQ(free_during, free_before);
  EXPECT_EQ(engine_->Stats().cache.pool.retiring, 0);  // the step is done: reclaimed
  ExpectInvariants();
}

// Issue 10: a step whose device work could not be queued kept the bookkeeping.
TEST_F(StepTest, AFailedEnqueueInAStepIsUndone) {
  Make(64, kernels::FillPolicy::kZero);
  auto p = Prefill(alice_, Prompt(20, 4));
  Run({p.get()});
  ASSERT_TRUE(p->result().status.ok());
  const EngineStats before = engine_->Stats();
  device_.fail = true;
  auto fresh = Prefill(bob_, Prompt(30, 5));
  auto next = Prefill(alice_, Prompt(40, 6), p->result().sequences[0]);  // grows 2 blocks
  Run({fresh.get(), next.get()});
  EXPECT_EQ(fresh->result().status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(next->result().status.code(), absl::StatusCode::kInternal);
  const EngineStats after = engine_->Stats();
  EXPECT_EQ(after.cache.sequences, before.cache.sequences);
  EXPECT_EQ(after.cache.pool.free + after.cache.pool.retiring, before.cache.pool.free);
  EXPECT_EQ(after.cache.pool.active, before.cache.pool.active);
  EXPECT_EQ(after.calls.device_failures, 2u);
  ExpectInvariants();
}

TEST_F(StepTest, ChunkedPrefillGivesTheWholePrefillsToken) {
  const std::vector<int32_t> prompt = Prompt(100, 9);
  auto p = Prefill(alice_, prompt);
  int steps = 0;
  do {
    p->chunk = 30;
    Run({p.get()});
    ++steps;
    ASSERT_TRUE(p->result().status.ok()) << p->result().status;
    if (p->unfinished()) {
      // Between chunks: the sequence holds its blocks, nothing is published or answered.
      EXPECT_TRUE(p->result().results.empty());
      EXPECT_EQ(engine_->Stats().model.prefill_computed, 0u);
    }
  } while (p->unfinished() && steps < 10);
  EXPECT_EQ(steps, 4);  // 30 + 30 + 30 + 10
  ASSERT_EQ(p->result().results.size(), 1u);
  EXPECT_EQ(p->result().results[0].next_token, AloneFirstToken(prompt));
  EXPECT_EQ(p->result().lengths, std::vector<int64_t>{100});
  const EngineStats s = engine_->Stats();
  EXPECT_EQ(s.model.prefill_chunks, 3u);
  EXPECT_EQ(s.model.prefill_calls, 1u);
  EXPECT_EQ(s.model.prefill_computed, 100u);
  ExpectInvariants();
}

TEST_F(StepTest, DecodesShareStepsWithAChunkedPrefill) {
  auto pb = Prefill(bob_, Prompt(20, 10));
  Run({pb.get()});
  ASSERT_TRUE(pb->result().status.ok());
  auto pa = Prefill(alice_, Prompt(70, 11));
  int32_t token = pb->result().results[0].next_token;
  int decodes = 0;
  do {
    pa->chunk = 32;
    auto db = Decode(bob_, pb->result().sequences[0], token);
    Run({pa.get(), db.get()});
    ASSERT_TRUE(db->result().status.ok()) << db->result().status;
    EXPECT_EQ(db->result().step_sequences, 2);
    token = db->result().results[0].next_token;
    ++decodes;
  } while (pa->unfinished() && decodes < 10);
  ASSERT_TRUE(pa->result().status.ok()) << pa->result().status;
  EXPECT_EQ(decodes, 3);  // 32 + 32 + 6
  EXPECT_EQ(pa->result().results[0].next_token, AloneFirstToken(Prompt(70, 11)));
  // alice cannot decode her sequence while its prefill is under way (it is in every step).
  auto pc = Prefill(alice_, Prompt(40, 12));
  pc->chunk = 16;
  Run({pc.get()});
  ASSERT_TRUE(pc->unfinished());
  auto early = Decode(alice_, pc->progress()->item().sequence, 1);
  Run({pc.get(), early.get()});
  EXPECT_EQ(early->result().status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(pc->result().status.ok());
  ExpectInvariants();
}

TEST_F(StepTest, AChunkedPrefillWhoseSequenceWasFreedStopsAndLeaksNothing) {
  const int64_t free_before = engine_->Stats().cache.pool.free;
  auto p = Prefill(alice_, Prompt(200, 13));
  p->chunk = 64;
  Run({p.get()});
  ASSERT_TRUE(p->unfinished());
  // The client frees the sequence between chunks: its blocks must not be written again.
  const SequenceId id = p->progress()->item().sequence;
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&id, 1), OnFree::kDiscard, CallContext::Uncancellable())
          .ok());
  Run({p.get()});
  EXPECT_FALSE(p->unfinished());
  EXPECT_EQ(p->result().status.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(engine_->Stats().cache.pool.free, free_before);
  ExpectInvariants();

  // Abandoned between chunks (shutdown, cancellation): the sequence goes back too.
  auto q = Prefill(bob_, Prompt(200, 14));
  q->chunk = 64;
  Run({q.get()});
  ASSERT_TRUE(q->unfinished());
  EXPECT_EQ(engine_->Stats().cache.sequences, 1);
  StepExecutorOf(*engine_).Abandon(*q, absl::UnavailableError("shutting down"));
  EXPECT_EQ(engine_->Stats().cache.sequences, 0);
  EXPECT_EQ(engine_->Stats().cache.pool.free, free_before);
  ExpectInvariants();
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
