// The host model: batching, mixed steps, the prefix cache's reuse against recomputing, checkpoints
// and bad input (the cases every backend shares, paged against dense among them, are
// backend_model_test.cc).

#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/local_engine.h"
#include "model/step_planner.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using ::testing::HasSubstr;

const StepOptions kLogits{.keep_logits = true};

// Paged against dense on every backend: backend_model_test.cc.

TEST(ModelTest, BatchedDecodeMatchesEachSequenceAlone) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 11);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, true);
  std::vector<DenseReference> refs;
  std::vector<DecodeInput> inputs;
  for (size_t len : {5u, 20u, 33u}) {
    const std::vector<int32_t> prompt = RandomTokens(len, 256, static_cast<uint32_t>(len));
    auto r = engine->Prefill(SequenceId(0), prompt);
    ASSERT_TRUE(r.ok()) << r.status();
    refs.emplace_back(w, kernels::DType::kF32);
    inputs.push_back({r->sequence, Argmax(refs.back().Extend(prompt))});
  }
  for (int step = 0; step < 8; ++step) {
    auto out = engine->Decode(inputs, kLogits);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::vector<float> want = refs[i].Extend(std::span(&inputs[i].token, 1));
      EXPECT_LE(RelError((*out)[i].logits, want), 2e-4) << "seq " << i << " step " << step;
      inputs[i].token = Argmax(want);
      EXPECT_EQ((*out)[i].next_token, inputs[i].token);
    }
  }
}

TEST(ModelTest, OneStepMixesPrefillAndDecode) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 13);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, true);
  const std::vector<int32_t> a = RandomTokens(21, 256, 1), b = RandomTokens(30, 256, 2);
  auto first = engine->Prefill(SequenceId(0), a);
  ASSERT_TRUE(first.ok());
  DenseReference ref_a(w, kernels::DType::kF32), ref_b(w, kernels::DType::kF32);
  const int32_t next_a = Argmax(ref_a.Extend(a));

  // Plan a short prefill of `c`, a longer one of `b` and a decode of `a`, and run them as one
  // step: the decode kernel serves `a` (its row goes first), the prefill kernel `c` and `b`;
  // results come back in item order.
  const std::vector<int32_t> c = RandomTokens(5, 256, 3);
  DenseReference ref_c(w, kernels::DType::kF32);
  std::vector<PlannedItem> items(2);
  DevicePlan plan;
  ASSERT_TRUE(PlanPrefill(engine->cache(), SessionId(1), NamespaceId(1), SequenceId(0), c, 0,
                          {256, 4096}, &items[0], &plan)
                  .ok());
  ASSERT_TRUE(PlanPrefill(engine->cache(), SessionId(1), NamespaceId(1), SequenceId(0), b, 0,
                          {256, 4096}, &items[1], &plan)
                  .ok());
  std::vector<PlannedItem> decode;
  const DecodeInput in{first->sequence, next_a};
  ASSERT_TRUE(
      PlanDecode(engine->cache(), SessionId(1), std::span(&in, 1), {256, 4096}, &decode, &plan)
          .ok());
  items.push_back(decode[0]);
  ASSERT_TRUE(plan.copies.empty());
  std::vector<StepItem> step = {items[0].AsStepItem(), items[1].AsStepItem(),
                                items[2].AsStepItem()};
  std::vector<ItemResult> results;
  ASSERT_TRUE(engine->model().Step(engine->pool(), step, kLogits, &results).ok());
  EXPECT_LE(RelError(results[0].logits, ref_c.Extend(c)), 2e-4);
  EXPECT_LE(RelError(results[1].logits, ref_b.Extend(b)), 2e-4);
  EXPECT_LE(RelError(results[2].logits, ref_a.Extend(std::span(&next_a, 1))), 2e-4);
}

TEST(ModelTest, TinyConfigMatchesReference) {
  auto config = NamedConfig("tiny");
  ASSERT_TRUE(config.ok());
  const ModelWeights w = SyntheticWeights(*config, 1);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kBF16, true);
  DenseReference ref(w, kernels::DType::kBF16);
  const std::vector<int32_t> prompt = RandomTokens(24, config->vocab_size, 3);
  auto first = engine->Prefill(SequenceId(0), prompt, kLogits);
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<float> want = ref.Extend(prompt);
  EXPECT_LE(RelError(first->result.logits, want), 2e-2);
  int32_t token = Argmax(want);
  for (int step = 0; step < 3; ++step) {
    const DecodeInput in{first->sequence, token};
    auto out = engine->Decode(std::span(&in, 1), kLogits);
    ASSERT_TRUE(out.ok());
    want = ref.Extend(std::span(&token, 1));
    EXPECT_LE(RelError((*out)[0].logits, want), 2e-2);
    token = Argmax(want);
  }
}

// Runs the same two-turn conversation on an engine and returns every step's logits.
struct Conversation {
  std::vector<std::vector<float>> logits;
  std::vector<int32_t> tokens;
  int64_t reused_second_turn = 0;
};

Conversation Converse(LocalEngine& engine, const std::vector<int32_t>& prompt,
                      const std::vector<int32_t>& follow_up) {
  Conversation c;
  auto record = [&](const ItemResult& r) {
    c.logits.push_back(r.logits);
    c.tokens.push_back(r.next_token);
  };
  auto turn = [&](const std::vector<int32_t>& tokens, int decodes) -> SequenceId {
    auto first = engine.Prefill(SequenceId(0), tokens, kLogits);
    EXPECT_TRUE(first.ok()) << first.status();
    c.reused_second_turn = first->reused;
    record(first->result);
    for (int i = 0; i < decodes; ++i) {
      const DecodeInput in{first->sequence, c.tokens.back()};
      auto out = engine.Decode(std::span(&in, 1), kLogits);
      EXPECT_TRUE(out.ok()) << out.status();
      record((*out)[0]);
    }
    return first->sequence;
  };
  // Turn one: 50 prompt tokens and 10 decodes put 60 tokens in the pool; freeing with commit
  // publishes them, the last 12 as a partial block (a rewind endpoint at block size 16).
  const SequenceId first = turn(prompt, 10);
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), c.tokens.begin(), c.tokens.end() - 1);
  EXPECT_TRUE(engine.Free(first, /*commit=*/true).ok());
  // Turn two: the history, then new tokens.
  history.insert(history.end(), follow_up.begin(), follow_up.end());
  turn(history, 5);
  return c;
}

TEST(ModelTest, PrefixCacheOnAndOffGiveTheSameTokens) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 17);
  const std::vector<int32_t> prompt = RandomTokens(50, 256, 5), follow_up = RandomTokens(7, 256, 6);
  for (kernels::DType dtype : {kernels::DType::kF32, kernels::DType::kBF16}) {
    auto on = MakeTestEngine(w, 16, dtype, /*prefix_cache=*/true);
    auto off = MakeTestEngine(w, 16, dtype, /*prefix_cache=*/false);
    const Conversation a = Converse(*on, prompt, follow_up);
    const Conversation b = Converse(*off, prompt, follow_up);
    // The second turn reused every token of the first, including the partial block.
    EXPECT_EQ(a.reused_second_turn, 60);
    EXPECT_EQ(b.reused_second_turn, 0);
    EXPECT_EQ(a.tokens, b.tokens);
    ASSERT_EQ(a.logits.size(), b.logits.size());
    // Reused K/V is what recomputing writes, up to the order of float sums (a prefill of 7
    // tokens and one of 67 group the products differently).
    for (size_t i = 0; i < a.logits.size(); ++i) {
      EXPECT_LE(RelError(a.logits[i], b.logits[i]), HostTolerance(dtype)) << "step " << i;
    }
    // The partial block (12 of 16 tokens) was adopted: the new sequence writes above its
    // published tokens.
    EXPECT_EQ(on->cache().stats().hit_tokens, 60u);
    EXPECT_TRUE(on->cache().CheckInvariants().ok());
  }
}

TEST(ModelTest, RepeatedPromptRecomputesOnlyItsLastToken) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 41);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, true);
  const std::vector<int32_t> prompt = RandomTokens(48, 256, 12);  // three full blocks
  auto first = engine->Prefill(SequenceId(0), prompt, kLogits);
  ASSERT_TRUE(first.ok());
  // Prefill committed all three blocks. The second prompt shares the first two and matches 15
  // tokens of the third, which the first sequence still holds: the last token is written into
  // a copy of it.
  auto second = engine->Prefill(SequenceId(0), prompt, kLogits);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->reused, 47);
  EXPECT_EQ(engine->cache().stats().cow_copies, 1u);
  EXPECT_EQ(second->result.next_token, first->result.next_token);
  EXPECT_LE(RelError(second->result.logits, first->result.logits), 2e-4);
  ASSERT_TRUE(engine->Free(first->sequence, /*commit=*/true).ok());
  ASSERT_TRUE(engine->Free(second->sequence, /*commit=*/true).ok());
  // Now all 48 are published: everything but the last token is reused.
  auto third = engine->Prefill(SequenceId(0), prompt, kLogits);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->reused, 47);
  EXPECT_EQ(third->result.next_token, first->result.next_token);
  EXPECT_LE(RelError(third->result.logits, first->result.logits), 2e-4);
  EXPECT_TRUE(engine->cache().CheckInvariants().ok());
}

TEST(ModelTest, ForkedSequencesDecodeIndependently) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 19);
  for (bool prefix_cache : {true, false}) {
    auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, prefix_cache);
    const std::vector<int32_t> prompt = RandomTokens(37, 256, 8);  // ends inside a block
    auto parent = engine->Prefill(SequenceId(0), prompt);
    ASSERT_TRUE(parent.ok());
    auto child = engine->Fork(parent->sequence);
    ASSERT_TRUE(child.ok()) << child.status();
    DenseReference ref_parent(w, kernels::DType::kF32);
    ref_parent.Extend(prompt);
    DenseReference ref_child = ref_parent;
    // The branches take different tokens into the shared partial block's copy.
    std::vector<DecodeInput> inputs = {{parent->sequence, 3}, {*child, 200}};
    for (int step = 0; step < 6; ++step) {
      auto out = engine->Decode(inputs, kLogits);
      ASSERT_TRUE(out.ok()) << out.status();
      const std::vector<float> wp = ref_parent.Extend(std::span(&inputs[0].token, 1));
      const std::vector<float> wc = ref_child.Extend(std::span(&inputs[1].token, 1));
      EXPECT_LE(RelError((*out)[0].logits, wp), 2e-4) << "step " << step;
      EXPECT_LE(RelError((*out)[1].logits, wc), 2e-4) << "step " << step;
      inputs[0].token = Argmax(wp);
      inputs[1].token = (Argmax(wc) + 1) % 256;  // keep the branches apart
    }
    EXPECT_TRUE(engine->cache().CheckInvariants().ok());
  }
}

TEST(ModelTest, LoadedCheckpointRunsLikeTheWeightsItWasSavedFrom) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 43);
  const std::string dir = ::testing::TempDir() + "/model_test_checkpoint";
  const std::vector<int32_t> prompt = RandomTokens(30, 256, 13);
  auto run = [&](const ModelWeights& weights) {
    auto engine = MakeTestEngine(weights, 16, kernels::DType::kF32, true);
    auto first = engine->Prefill(SequenceId(0), prompt, kLogits);
    EXPECT_TRUE(first.ok()) << first.status();
    return first->result;
  };
  const ItemResult original = run(w);
  // f32 round-trips exactly: the very same logits.
  ASSERT_TRUE(SaveCheckpoint(w, dir + "-f32", "f32").ok());
  absl::StatusOr<ModelWeights> f32 = LoadCheckpoint(dir + "-f32");
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ(run(*f32).logits, original.logits);
  // bf16 weights are a slightly different model: it matches the reference of what was loaded.
  ASSERT_TRUE(SaveCheckpoint(w, dir + "-bf16", "bf16").ok());
  absl::StatusOr<ModelWeights> bf16 = LoadCheckpoint(dir + "-bf16");
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  DenseReference ref(*bf16, kernels::DType::kF32);
  EXPECT_LE(RelError(run(*bf16).logits, ref.Extend(prompt)), 2e-4);
}

TEST(ModelTest, BadTokenChangesNothing) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 23);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kBF16, true);
  const std::vector<int32_t> prompt = RandomTokens(20, 256, 9);
  auto first = engine->Prefill(SequenceId(0), prompt);
  ASSERT_TRUE(first.ok());
  const auto before = engine->cache().stats();
  const std::vector<int32_t> bad = {1, 2, 256};
  auto r = engine->Prefill(SequenceId(0), bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("vocabulary"));
  const std::vector<DecodeInput> inputs = {{first->sequence, 5}, {first->sequence, -1}};
  EXPECT_EQ(engine->Decode(inputs).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<DecodeInput> twice = {{first->sequence, 5}, {first->sequence, 6}};
  EXPECT_EQ(engine->Decode(twice).status().code(), absl::StatusCode::kInvalidArgument);
  const DecodeInput missing{SequenceId(999), 5};
  EXPECT_EQ(engine->Decode(std::span(&missing, 1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine->cache().stats().pool.free, before.pool.free);
  EXPECT_EQ(engine->cache().Find(first->sequence)->num_tokens, 20);
  EXPECT_EQ(engine->Prefill(SequenceId(0), {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ModelTest, StepRejectsShortTableBeforeWriting) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 29);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, true);
  const std::vector<int32_t> tokens = RandomTokens(20, 256, 10);
  const std::vector<int32_t> table = {0};  // 20 tokens need two blocks
  const StepItem item{tokens, 0, table};
  std::vector<ItemResult> results;
  const absl::Status s = engine->model().Step(engine->pool(), std::span(&item, 1), {}, &results);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("needs 2 blocks"));
}

TEST(ModelTest, CreateRejectsPoolOfAnotherShape) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 31);
  kernels::PoolLayout layout{.block_size = 16, .num_layers = 2, .num_kv_heads = 4, .head_dim = 32};
  auto m = Model::Create(w, layout, {});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("num_kv_heads"));
}

// A checkpoint the CPU kernels cannot run is refused when it loads; before, it loaded and then
// aborted the daemon at its first step (issue 12).
TEST(ModelTest, CreateRejectsAModelBeyondTheKernels) {
  ModelConfig c = SmallTestConfig();
  c.num_layers = 1;
  c.num_heads = 256;  // query heads per sequence: the decode kernel serves 128
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.hidden_size = 256;
  const ModelWeights w = SyntheticWeights(c, 41);
  const kernels::PoolLayout layout{
      .block_size = 16, .num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .num_blocks = 4};
  auto m = Model::Create(w, layout, {});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("query heads"));
}

// A sequence never outgrows the model's positions: the prompt, the next turn and every decode
// are checked, and a refused call changes nothing (issue 12).
TEST(ModelTest, SequencesStayWithinTheContext) {
  ModelConfig c = SmallTestConfig();
  c.max_position = 40;
  const ModelWeights w = SyntheticWeights(c, 43);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kBF16, true);
  const auto free_before = engine->cache().stats().pool.free;
  EXPECT_EQ(engine->Prefill(SequenceId(0), RandomTokens(41, 256, 1)).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(engine->cache().stats().pool.free, free_before);
  auto first = engine->Prefill(SequenceId(0), RandomTokens(30, 256, 2));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(engine->Prefill(first->sequence, RandomTokens(11, 256, 3)).status().code(),
            absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(engine->Prefill(first->sequence, RandomTokens(9, 256, 4)).ok());  // 39 tokens
  const DecodeInput in{first->sequence, 5};
  ASSERT_TRUE(engine->Decode(std::span(&in, 1)).ok());  // 40: the last position
  const absl::Status past = engine->Decode(std::span(&in, 1)).status();
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(past.message()), HasSubstr("context is 40 positions"));
  EXPECT_EQ(engine->cache().Find(first->sequence)->num_tokens, 40);
  EXPECT_TRUE(engine->cache().CheckInvariants().ok());
}

// One oversized step does not pin its scratch memory: it is given back once steps are small
// again (issue 12).
TEST(ModelTest, ScratchShrinksBackAfterAnOversizedStep) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 47);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kBF16, true);
  auto* model = dynamic_cast<Model*>(&engine->model());
  ASSERT_NE(model, nullptr);
  auto first = engine->Prefill(SequenceId(0), RandomTokens(1000, 256, 5));
  ASSERT_TRUE(first.ok()) << first.status();
  const int64_t big = model->scratch_bytes();
  DecodeInput in{first->sequence, first->result.next_token};
  for (int i = 0; i < 8; ++i) {
    auto out = engine->Decode(std::span(&in, 1));
    ASSERT_TRUE(out.ok()) << out.status();
    in.token = (*out)[0].next_token;
  }
  EXPECT_LT(model->scratch_bytes() * 20, big) << "still holding " << model->scratch_bytes();
}

TEST(ModelTest, TopKLogProbsAreSortedAndNormalized) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 37);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, true);
  auto r =
      engine->Prefill(SequenceId(0), RandomTokens(12, 256, 11), {.top_k = 5, .keep_logits = true});
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->result.top.size(), 5u);
  EXPECT_EQ(r->result.top[0].token, r->result.next_token);
  double total = 0;
  for (float l : r->result.logits)
    total += std::exp(double{l} - r->result.logits[static_cast<size_t>(r->result.next_token)]);
  EXPECT_NEAR(r->result.top[0].logprob, -std::log(total), 1e-4);
  for (size_t i = 1; i < 5; ++i) EXPECT_GE(r->result.top[i - 1].logprob, r->result.top[i].logprob);
}

}  // namespace
}  // namespace kvpool::model
