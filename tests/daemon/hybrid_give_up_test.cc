// Giving back what a call took, in a pool with a state group (tiny-hybrid): a step moves a
// sequence's state in place, and no state can be moved back. Before, a decode whose caller gave
// up after its step ran left the state one token ahead of its sequence; Free with commit then
// published it as the checkpoint at the old end, and the next prompt there resumed from it (a
// wrong answer, for any session of the tenant). And every undo assumed a rewind could not fail:
// a KV client that committed past the old end while its own call was under way stopped the
// daemon (KVPOOL_CHECK_OK on the refused Truncate). docs/hybrid-groups.md §3, "Giving back".

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "daemon/engine/engine.h"
#include "daemon/engine/internal/step_executor_of.h"
#include "gtest/gtest.h"
#include "model/model.h"
#include "model/weights.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::GivesUpAfter;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

class HybridGiveUpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const model::ModelConfig config = *model::NamedConfig("tiny-hybrid");
    EngineOptions options = SmallPool(32);
    kernels::PoolLayout& layout = options.pools[0].layout;
    layout.num_layers = config.pool_layers();
    layout.num_kv_heads = config.num_kv_heads;
    layout.head_dim = config.head_dim;
    layout.dtype = kernels::DType::kF32;  // bit for bit
    layout.num_state_slots = 8;
    layout.state_slot_bytes = (config.state_bytes() + 63) / 64 * 64;
    options.model_name = "tiny-hybrid";
    options.pools[0].checkpoint_slots = 4;
    options.lock_gap_hook = [this](LockGap gap) {
      if (gap == gap_ && in_gap_ && armed_.exchange(false)) in_gap_();
    };
    model_ = std::move(
        *model::Model::Create(model::SyntheticWeights(config, 1), layout, {.threads = 1}));
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    alice_ = *engine_->OpenSession(Spec("t", "alice"));
  }

  // Runs one call in a step of its own, as the engine's runner does.
  ComputeResult Run(ComputeRequest request, std::shared_ptr<const CallContext> context = {}) {
    ComputeCall call(alice_, std::move(request), std::move(context), [](ComputeCall&) {});
    ComputeCall* calls[] = {&call};
    StepExecutorOf(*engine_).RunStep(/*pool=*/0, calls);
    return call.result();
  }
  ComputeResult Prefill(std::vector<int32_t> tokens, SequenceId sequence = SequenceId(0),
                        std::shared_ptr<const CallContext> context = {}) {
    return Run(
        {.kind = ComputeRequest::Kind::kPrefill, .sequence = sequence, .tokens = std::move(tokens)},
        std::move(context));
  }
  ComputeResult Decode(SequenceId sequence, int32_t token,
                       std::shared_ptr<const CallContext> context = {}) {
    return Run({.kind = ComputeRequest::Kind::kDecode, .decode = {{sequence, token}}},
               std::move(context));
  }
  void Free(SequenceId sequence, OnFree how) {
    ASSERT_TRUE(
        engine_->Free(*alice_, std::span(&sequence, 1), how, CallContext::Uncancellable()).ok());
  }
  // A KV client's sequence of `prompt`, which it knows (Allocate with the prompt).
  SequenceId AllocateKnowing(const std::vector<int32_t>& prompt) {
    const AllocateRequest request{.num_tokens = static_cast<int64_t>(prompt.size()),
                                  .prompt = prompt};
    absl::StatusOr<Tables> made =
        engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable());
    EXPECT_TRUE(made.ok()) << made.status();
    return made.ok() ? made->slices[0].sequence : SequenceId(0);
  }
  void EvictAll() { ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok()); }
  // `prompt` prefilled from nothing and its first generated token (`*first`) decoded: that
  // decode's answer. Nothing of it stays cached.
  ComputeResult PrefillAndDecodeAlone(const std::vector<int32_t>& prompt, int32_t* first) {
    const ComputeResult p = Prefill(prompt);
    EXPECT_TRUE(p.status.ok()) << p.status;
    if (!p.status.ok()) return p;
    *first = p.results[0].next_token;
    ComputeResult decoded = Decode(p.sequences[0], *first);
    EXPECT_TRUE(decoded.status.ok()) << decoded.status;
    Free(p.sequences[0], OnFree::kDiscard);
    EvictAll();
    return decoded;
  }
  // The sequence's full table, as ListSequences reports it.
  std::vector<BlockId> TableOf(SequenceId sequence) const {
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    const Tables t = engine_->ListSequences(0, alice_->id, &owners, &pools);
    size_t first = 0;
    for (const TableSlice& slice : t.slices) {
      const size_t n = static_cast<size_t>(slice.length);
      if (slice.sequence == sequence) {
        return {t.blocks.begin() + static_cast<ptrdiff_t>(first),
                t.blocks.begin() + static_cast<ptrdiff_t>(first + n)};
      }
      first += n;
    }
    return {};
  }
  void ExpectInvariants() const {
    const absl::Status s = engine_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
  }

  testing::FailingDevice device_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_;
  // Runs once in the next `gap_` after armed_ is set (the fixture's own calls cross gaps too).
  LockGap gap_ = LockGap::kControlWait;
  std::function<void()> in_gap_;
  std::atomic<bool> armed_{false};
};

void ExpectSameAnswer(const ComputeResult& got, const ComputeResult& want) {
  ASSERT_TRUE(got.status.ok()) << got.status;
  ASSERT_EQ(got.results.size(), 1u);
  ASSERT_EQ(want.results.size(), 1u);
  EXPECT_EQ(got.results[0].next_token, want.results[0].next_token);
  EXPECT_EQ(got.results[0].logprob, want.results[0].logprob);
}

// A decode's caller gives up after its step ran: the state is lost, not published.
TEST_F(HybridGiveUpTest, AGivenUpDecodeLeavesNoWrongCheckpoint) {
  const std::vector<int32_t> prompt = Prompt(48, 7);  // three full blocks
  // What the prompt and its first generated token give, computed from nothing.
  int32_t t = 0;
  ASSERT_NO_FATAL_FAILURE(PrefillAndDecodeAlone(prompt, &t));
  std::vector<int32_t> longer = prompt;
  longer.push_back(t);
  const ComputeResult alone = Prefill(longer);
  ASSERT_TRUE(alone.status.ok()) << alone.status;
  ASSERT_EQ(alone.reused, 0);
  Free(alone.sequences[0], OnFree::kDiscard);
  EvictAll();

  const ComputeResult p = Prefill(prompt);
  ASSERT_TRUE(p.status.ok()) << p.status;
  const SequenceId s = p.sequences[0];
  const ComputeResult gave_up = Decode(s, t, std::make_shared<GivesUpAfter>(1));
  EXPECT_EQ(gave_up.status.code(), absl::StatusCode::kCancelled);
  ExpectInvariants();

  // Its state holds 49 tokens, its sequence 48: Free with commit keeps no checkpoint from it.
  // The longer prompt resumes from an earlier one and answers as it does alone.
  Free(s, OnFree::kCommit);
  const ComputeResult again = Prefill(longer);
  EXPECT_LT(again.reused, 48);
  ExpectSameAnswer(again, alone);
  Free(again.sequences[0], OnFree::kDiscard);
  ExpectInvariants();
}

// A lost state runs no step (before, the next decode computed from it); the way back is a
// Truncate to a checkpoint, and the sequence then computes on as if nothing had happened.
TEST_F(HybridGiveUpTest, ALostStateRefusesStepsUntilATruncateToACheckpointRestoresIt) {
  const std::vector<int32_t> prompt = Prompt(48, 8);
  int32_t t = 0;
  ComputeResult want;
  ASSERT_NO_FATAL_FAILURE(want = PrefillAndDecodeAlone(prompt, &t));

  const ComputeResult p = Prefill(prompt);
  ASSERT_TRUE(p.status.ok()) << p.status;
  const SequenceId s = p.sequences[0];
  ASSERT_EQ(Decode(s, t, std::make_shared<GivesUpAfter>(1)).status.code(),
            absl::StatusCode::kCancelled);
  // Its state holds 49 tokens, its sequence 48: no step may start there.
  const ComputeResult refused = Decode(s, t);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kFailedPrecondition) << refused.status;
  EXPECT_NE(refused.status.message().find("lost"), std::string_view::npos) << refused.status;
  EXPECT_NE(refused.status.message().find("nearest on its path is at 32"), std::string_view::npos)
      << refused.status;
  // Only to a checkpoint (the message names the nearest): the prefill's last block boundary.
  const absl::Status to_40 = engine_->Truncate(*alice_, s, 40, CallContext::Uncancellable());
  EXPECT_EQ(to_40.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(to_40.message().find("nearest checkpoint on its path is at 32"), std::string_view::npos)
      << to_40;
  ASSERT_TRUE(engine_->Truncate(*alice_, s, 32, CallContext::Uncancellable()).ok());
  const ComputeResult rest = Prefill(std::vector<int32_t>(prompt.begin() + 32, prompt.end()), s);
  ASSERT_TRUE(rest.status.ok()) << rest.status;
  EXPECT_EQ(rest.results[0].next_token, t);
  ExpectSameAnswer(Decode(s, t), want);
  Free(s, OnFree::kDiscard);
  ExpectInvariants();
}

// A KV client commits a token past the old end while its own decode is under way, and the decode's
// caller gives up: the rewind is refused (no checkpoint there). Before, the daemon aborted.
TEST_F(HybridGiveUpTest, AGivenUpDecodeWhoseSequenceWasCommittedPastDoesNotStopTheDaemon) {
  const std::vector<int32_t> prompt = Prompt(48, 9);
  const ComputeResult p = Prefill(prompt);
  ASSERT_TRUE(p.status.ok()) << p.status;
  const SequenceId s = p.sequences[0];
  const int32_t t = p.results[0].next_token;
  gap_ = LockGap::kStepLaunch;  // the step is planned, the lock free
  in_gap_ = [&] {
    ASSERT_TRUE(
        engine_->Commit(*alice_, s, 49, std::span(&t, 1), CallContext::Uncancellable()).ok());
  };
  armed_ = true;
  EXPECT_EQ(Decode(s, t, std::make_shared<GivesUpAfter>(1)).status.code(),
            absl::StatusCode::kCancelled);
  EXPECT_FALSE(armed_);  // the gap opened
  ExpectInvariants();
  // The tokens stay (the client's own commit raced its call); the state is lost all the same.
  EXPECT_EQ(TableOf(s).size(), 4u);
  EXPECT_EQ(Decode(s, 1).status.code(), absl::StatusCode::kFailedPrecondition);
  Free(s, OnFree::kDiscard);
  ExpectInvariants();
}

// A decode's caller gives up while the client, in the step's gap, rewinds its sequence to the
// step's start and grows it again: the block it got back is the client's, not the step's (which
// retires behind the step's fence), so the give-up leaves it. Without UndoItem's check of the
// table, the give-up's Truncate released the client's fresh block while the client wrote it.
TEST_F(HybridGiveUpTest, AGivenUpDecodeLeavesTheBlockTheClientsOwnGrowHandedOut) {
  const ComputeResult p = Prefill(Prompt(48, 12));
  ASSERT_TRUE(p.status.ok()) << p.status;
  const SequenceId s = p.sequences[0];
  std::vector<BlockId> regrown;
  gap_ = LockGap::kStepLaunch;  // the step is planned (49 tokens, a fourth block), the lock free
  in_gap_ = [&] {
    ASSERT_TRUE(engine_->Truncate(*alice_, s, 48, CallContext::Uncancellable()).ok());
    const GrowRequest grow{.sequence = s, .num_tokens = 49};
    absl::StatusOr<Tables> again =
        engine_->Grow(*alice_, std::span(&grow, 1), CallContext::Uncancellable());
    ASSERT_TRUE(again.ok()) << again.status();
    regrown = again->blocks;
  };
  armed_ = true;
  EXPECT_EQ(Decode(s, p.results[0].next_token, std::make_shared<GivesUpAfter>(1)).status.code(),
            absl::StatusCode::kCancelled);
  EXPECT_FALSE(armed_);  // the gap opened
  ASSERT_EQ(regrown.size(), 1u);
  const std::vector<BlockId> table = TableOf(s);
  ASSERT_EQ(table.size(), 4u);
  EXPECT_EQ(table[3], regrown[0]);
  ExpectInvariants();
  Free(s, OnFree::kDiscard);
}

// The same race on a Grow: its caller gives up while the client commits past the old length.
TEST_F(HybridGiveUpTest, AGivenUpGrowWhoseSequenceWasCommittedPastDoesNotStopTheDaemon) {
  SequenceId s;
  ASSERT_NO_FATAL_FAILURE(s = AllocateKnowing(Prompt(16, 10)));
  const int32_t next = 5;
  in_gap_ = [&] {
    ASSERT_TRUE(
        engine_->Commit(*alice_, s, 17, std::span(&next, 1), CallContext::Uncancellable()).ok());
  };
  armed_ = true;
  const GrowRequest grow{.sequence = s, .num_tokens = 32};
  const absl::StatusOr<Tables> grown = engine_->Grow(*alice_, std::span(&grow, 1), GivesUpAfter(1));
  EXPECT_FALSE(armed_);  // the gap opened
  EXPECT_EQ(grown.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(TableOf(s).size(), 2u);  // the growth stays
  ExpectInvariants();
  Free(s, OnFree::kDiscard);
}

// A Grow's caller gives up while the same session rewinds and grows the sequence again: the
// blocks the second Grow handed out stay the sequence's. Before, the first Grow's give-up
// checked the length alone and released them, while the client wrote into them.
TEST_F(HybridGiveUpTest, AGivenUpGrowDoesNotTakeBackAnotherGrowsBlocks) {
  SequenceId s;
  ASSERT_NO_FATAL_FAILURE(s = AllocateKnowing(Prompt(16, 11)));
  const GrowRequest grow{.sequence = s, .num_tokens = 48};
  std::vector<BlockId> second;
  in_gap_ = [&] {
    ASSERT_TRUE(engine_->Truncate(*alice_, s, 16, CallContext::Uncancellable()).ok());
    absl::StatusOr<Tables> again =
        engine_->Grow(*alice_, std::span(&grow, 1), CallContext::Uncancellable());
    ASSERT_TRUE(again.ok()) << again.status();
    second = again->blocks;
  };
  armed_ = true;
  EXPECT_EQ(engine_->Grow(*alice_, std::span(&grow, 1), GivesUpAfter(1)).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_FALSE(armed_);
  ASSERT_EQ(second.size(), 2u);
  const std::vector<BlockId> table = TableOf(s);
  ASSERT_EQ(table.size(), 3u);
  EXPECT_EQ(table[1], second[0]);
  EXPECT_EQ(table[2], second[1]);
  ExpectInvariants();
  Free(s, OnFree::kDiscard);
}

}  // namespace
}  // namespace kvpool::daemon
