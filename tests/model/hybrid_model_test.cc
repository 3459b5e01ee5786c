// State-space layers (issue 28, docs/hybrid-groups.md §6 step 1): the host model with Mamba-2
// layers against the dense reference; a sequence computed in chunks, or as a prefill and then
// decodes, equals one computed at once, bit for bit in f32 (state and logits); sequences of one
// step are independent; LocalEngine's per-sequence state slots (fork, free, truncate); the
// tiny-hybrid preset and the configuration's checks.

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kvpool/util/check.h"
#include "model/local_engine.h"
#include "model/model.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using ::testing::HasSubstr;

const StepOptions kLogits{.keep_logits = true};

// SmallTestConfig's width with the given layers; two SSM groups so B and C are shared by pairs
// of heads, and a conv of width 4 as Mamba-2's.
ModelConfig HybridConfig(std::vector<LayerKind> kinds) {
  ModelConfig c = SmallTestConfig();
  c.num_layers = static_cast<int32_t>(kinds.size());
  c.layer_kinds = std::move(kinds);
  c.ssm = {.num_heads = 4, .head_dim = 16, .d_state = 8, .num_groups = 2, .conv_width = 4};
  return c;
}
const LayerKind kS = LayerKind::kStateSpace, kF = LayerKind::kFullAttention,
                kP = LayerKind::kParallelHybrid;

// Falcon-H1's build of the same width: attention and the mixer side by side in every layer, the
// mixer without its gated norm (as Falcon-H1-0.5B).
ModelConfig FalconH1StyleConfig() {
  ModelConfig c = HybridConfig({kP, kP});
  c.ssm.gated_norm = false;
  return c;
}

// Gemm's vector path sums each output in the order of k whatever the rows; OpenBLAS (the
// fallback without AVX2) promises nothing of the kind.
bool ExactResume() { return kernels::cpu::KernelIsa() != kernels::cpu::Isa::kPortable; }

std::vector<float> Copy(std::span<const float> s) { return {s.begin(), s.end()}; }

TEST(HybridModelTest, PrefillAndDecodeMatchTheDenseReference) {
  for (const ModelConfig& c : {HybridConfig({kS, kF, kS}), FalconH1StyleConfig()}) {
    const ModelWeights w = SyntheticWeights(c, 7);
    for (kernels::DType dtype : {kernels::DType::kF32, kernels::DType::kBF16}) {
      SCOPED_TRACE(c.kind(0) == kP ? "parallel hybrid layers" : "state-space and attention");
      DenseReference ref(w, dtype);
      ExpectEngineFollowsReference(w, ref, dtype, 37, 1, 12, 2e-3);
    }
  }
}

// The sequence's state and last logits after its tokens went in as `chunks` (sizes; the first
// a new sequence's prefill, the rest later turns of it, or decodes when 1 and `decode`).
struct Outcome {
  std::vector<float> state, logits;
};
Outcome InChunks(const ModelWeights& w, const std::vector<int32_t>& tokens,
                 const std::vector<size_t>& chunks, bool decode) {
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, /*prefix_cache=*/false);
  SequenceId seq(0);
  Outcome run;
  size_t at = 0;
  for (size_t n : chunks) {
    const std::span<const int32_t> part = std::span(tokens).subspan(at, n);
    at += n;
    if (decode && n == 1 && seq != SequenceId(0)) {
      const DecodeInput in{seq, part[0]};
      auto out = engine->Decode(std::span(&in, 1), kLogits);
      KVPOOL_CHECK_OK(out.status());
      run.logits = (*out)[0].logits;
    } else {
      auto out = engine->Prefill(seq, part, kLogits);
      KVPOOL_CHECK_OK(out.status());
      seq = out->sequence;
      run.logits = out->result.logits;
    }
  }
  run.state = Copy(engine->state(seq));
  return run;
}

std::vector<size_t> Split(size_t total, size_t chunk) {
  std::vector<size_t> out;
  for (size_t at = 0; at < total; at += chunk) out.push_back(std::min(chunk, total - at));
  return out;
}

// Prefill in chunks of 1, 3, 16, 17 (skinny and wide products alike) and prefill then decodes:
// the state and the logits equal the one-shot prefill's bit for bit. Attention layers keep that
// for chunks of several tokens (the prefill kernel sums each query's keys in one order however
// the queries are split), but a one-token step goes through the decode kernel, which sums in
// another order: there the first layer's state (before any attention) is still equal bit for
// bit, and the rest is held to the host tolerance.
TEST(HybridModelTest, ChunksAndDecodesEqualOnePrefillBitForBit) {
  if (!ExactResume()) GTEST_SKIP() << "no AVX2: products go through OpenBLAS";
  const std::vector<int32_t> tokens = RandomTokens(41, 256, 9);
  for (const ModelConfig& config :
       {HybridConfig({kS, kS}), HybridConfig({kS, kF, kS}), FalconH1StyleConfig()}) {
    const bool attention = config.num_kv_layers() > 0;
    const ModelWeights w = SyntheticWeights(config, 3);
    const Outcome once = InChunks(w, tokens, {tokens.size()}, false);
    const auto layer0 = static_cast<ptrdiff_t>(w.config.ssm.state_floats());
    struct Case {
      std::string name;
      std::vector<size_t> sizes;
      bool decodes;  // some step has one token
    };
    std::vector<Case> cases;
    for (size_t chunk : {1u, 3u, 16u, 17u}) {
      cases.push_back(
          {"chunks of " + std::to_string(chunk), Split(tokens.size(), chunk), chunk == 1});
    }
    for (size_t k : {1u, 20u, 33u}) {
      std::vector<size_t> sizes = {k};
      sizes.insert(sizes.end(), tokens.size() - k, 1);
      cases.push_back({"prefill " + std::to_string(k) + " then decodes", sizes, true});
    }
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name + (attention ? ", with attention" : "") +
                   (config.kind(0) == kP ? ", parallel hybrid" : ""));
      const Outcome run = InChunks(w, tokens, c.sizes, c.decodes);
      ASSERT_EQ(run.state.size(), once.state.size());
      if (!attention || !c.decodes) {
        EXPECT_EQ(run.state, once.state);
        EXPECT_EQ(run.logits, once.logits);
      } else {
        EXPECT_TRUE(std::equal(once.state.begin(), once.state.begin() + layer0, run.state.begin()));
        EXPECT_LE(RelError(run.state, once.state), 1e-4);
        EXPECT_LE(RelError(run.logits, once.logits), HostTolerance(kernels::DType::kF32));
      }
    }
  }
}

// Two sequences decoded in one step compute what each computes alone, and a sequence's state
// changes only with its own tokens.
TEST(HybridModelTest, SequencesOfOneStepAreIndependent) {
  if (!ExactResume()) GTEST_SKIP() << "no AVX2: products go through OpenBLAS";
  const ModelWeights w = SyntheticWeights(HybridConfig({kS, kS}), 5);
  auto together = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  auto apart = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  std::vector<DecodeInput> both;
  std::vector<SequenceId> alone;
  for (uint32_t i = 0; i < 2; ++i) {
    const std::vector<int32_t> prompt = RandomTokens(10 + 13 * i, 256, 20 + i);
    auto a = together->Prefill(SequenceId(0), prompt);
    auto b = apart->Prefill(SequenceId(0), prompt);
    ASSERT_TRUE(a.ok() && b.ok());
    both.push_back({a->sequence, a->result.next_token});
    alone.push_back(b->sequence);
  }
  for (int step = 0; step < 5; ++step) {
    auto joint = together->Decode(both, kLogits);
    ASSERT_TRUE(joint.ok()) << joint.status();
    for (size_t i = 0; i < 2; ++i) {
      const DecodeInput in{alone[i], both[i].token};
      auto single = apart->Decode(std::span(&in, 1), kLogits);
      ASSERT_TRUE(single.ok());
      EXPECT_EQ((*joint)[i].logits, (*single)[0].logits) << "seq " << i << " step " << step;
      EXPECT_EQ(Copy(together->state(both[i].sequence)), Copy(apart->state(alone[i])));
      both[i].token = (*joint)[i].next_token;
    }
  }
}

// Model::Step refuses a missing, mis-sized or shared state before touching any.
TEST(HybridModelTest, StepRefusesBadStatesAndChangesNothing) {
  const ModelWeights w = SyntheticWeights(HybridConfig({kS, kF}), 2);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  StepModel& model = engine->model();
  const int64_t floats = model.state_bytes() / 4;
  EXPECT_EQ(floats, w.config.ssm.state_floats());
  std::vector<float> one(static_cast<size_t>(floats), 0.5f), shared = one;
  const std::vector<int32_t> tokens = {1, 2, 3}, table = {0};
  std::vector<ItemResult> results;
  StepItem a{.tokens = tokens, .block_table = table, .state = one};
  StepItem b{.tokens = tokens, .block_table = table, .state = one};
  const std::vector<float> before = one;
  EXPECT_THAT(model.Step(engine->pool(), std::vector{a, b}, {}, &results).message(),
              HasSubstr("share a state"));
  a.state = std::span(one).first(one.size() - 1);
  EXPECT_THAT(model.Step(engine->pool(), std::vector{a}, {}, &results).message(),
              HasSubstr("state of"));
  a.state = {};
  EXPECT_EQ(model.Step(engine->pool(), std::vector{a}, {}, &results).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(one, before);
  a.state = shared;
  EXPECT_TRUE(model.Step(engine->pool(), std::vector{a}, {}, &results).ok());
  EXPECT_NE(shared, before);
}

// A model without state-space layers neither needs nor touches a state.
TEST(HybridModelTest, AModelWithoutStateLayersIgnoresStates) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 4);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  EXPECT_EQ(engine->model().state_bytes(), 0);
  std::vector<float> garbage(7, 3.0f);
  const std::vector<int32_t> tokens = {5, 6, 7, 8}, table = {1};
  std::vector<ItemResult> with, without;
  StepItem item{.tokens = tokens, .block_table = table};
  ASSERT_TRUE(engine->model().Step(engine->pool(), std::vector{item}, kLogits, &without).ok());
  item.state = garbage;
  ASSERT_TRUE(engine->model().Step(engine->pool(), std::vector{item}, kLogits, &with).ok());
  EXPECT_EQ(with[0].logits, without[0].logits);
  EXPECT_EQ(garbage, std::vector<float>(7, 3.0f));
}

TEST(HybridEngineTest, ForkCopiesTheStateAndFreeDropsIt) {
  const ModelWeights w = SyntheticWeights(HybridConfig({kS, kF, kS}), 8);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  auto parent = engine->Prefill(SequenceId(0), RandomTokens(21, 256, 4));
  ASSERT_TRUE(parent.ok());
  absl::StatusOr<SequenceId> child = engine->Fork(parent->sequence);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(Copy(engine->state(*child)), Copy(engine->state(parent->sequence)));
  // The child's decode moves its own state only; the parent then decodes as if never forked.
  const std::vector<float> parent_state = Copy(engine->state(parent->sequence));
  const DecodeInput c{*child, 77};
  ASSERT_TRUE(engine->Decode(std::span(&c, 1)).ok());
  EXPECT_NE(Copy(engine->state(*child)), parent_state);
  EXPECT_EQ(Copy(engine->state(parent->sequence)), parent_state);
  ASSERT_TRUE(engine->Free(*child, false).ok());
  EXPECT_TRUE(engine->state(*child).empty());
  EXPECT_TRUE(engine->cache().CheckInvariants().ok());
}

TEST(HybridEngineTest, TruncateNeverBelowTheKnownTokens) {
  const ModelWeights w = SyntheticWeights(HybridConfig({kS, kF}), 8);
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  auto seq = engine->Prefill(SequenceId(0), RandomTokens(20, 256, 4));
  ASSERT_TRUE(seq.ok());
  const std::vector<float> state = Copy(engine->state(seq->sequence));
  const absl::Status refused = engine->Truncate(seq->sequence, 16);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("no checkpoint"));
  EXPECT_EQ(engine->cache().Find(seq->sequence)->num_tokens, 20);
  EXPECT_EQ(Copy(engine->state(seq->sequence)), state);
  EXPECT_TRUE(engine->Truncate(seq->sequence, 20).ok());
  // Without state-space layers a rewind is the pool's business as before.
  auto plain =
      MakeTestEngine(SyntheticWeights(SmallTestConfig(), 1), 16, kernels::DType::kF32, false);
  auto p = plain->Prefill(SequenceId(0), RandomTokens(20, 256, 4));
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(plain->Truncate(p->sequence, 16).ok());
}

// Nemotron-H's build of the same width: one mixer or MLP per layer, squared-ReLU MLP layers,
// attention without RoPE.
ModelConfig NemotronHStyleConfig() {
  ModelConfig c = HybridConfig({kS, LayerKind::kMlp, kF, LayerKind::kMlp, kS});
  c.mlp_after_mixer = false;
  c.mlp_activation = MlpActivation::kReluSquared;
  c.rope = false;
  return c;
}

// Parity (issue 28): a prompt that resumes from a state checkpoint in the tree computes, bit
// for bit, what an engine without a prefix cache computes for the same tokens in the same steps:
// the checkpoint holds exactly the state after its position and the shared blocks exactly the
// K/V. One engine serves a conversation; a reference engine replays each turn's steps. For
// Bamba's layers (a mixer and an MLP per layer) and Nemotron-H's (one or the other).
enum class Layers { kBamba, kNemotronH, kFalconH1 };
class HybridResumeTest : public ::testing::TestWithParam<Layers> {
 protected:
  void SetUp() override {
    const ModelWeights w =
        SyntheticWeights(GetParam() == Layers::kNemotronH  ? NemotronHStyleConfig()
                         : GetParam() == Layers::kFalconH1 ? FalconH1StyleConfig()
                                                           : HybridConfig({kS, kF, kS}),
                         1);
    const LocalEngine::Options cached{.dtype = kernels::DType::kF32,
                                      .pool_bytes = int64_t{8} << 20,
                                      .prefix_cache = true,
                                      .state_slots = 4,
                                      .checkpoint_slots = 6};
    LocalEngine::Options plain = cached;
    plain.prefix_cache = false;
    auto a = LocalEngine::Create(w, cached);
    auto b = LocalEngine::Create(w, plain);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    engine_ = std::move(*a);
    reference_ = std::move(*b);
  }

  // Decodes `n` tokens after `first` on `e`, returning the tokens fed (first included).
  static std::vector<int32_t> DecodeN(LocalEngine& e, SequenceId seq, int32_t first, int n) {
    std::vector<int32_t> fed;
    int32_t next = first;
    for (int i = 0; i < n; ++i) {
      fed.push_back(next);
      const DecodeInput in{seq, next};
      auto r = e.Decode(std::span(&in, 1), {.keep_logits = true});
      KVPOOL_CHECK_OK(r.status());
      next = (*r)[0].next_token;
    }
    fed.push_back(next);
    return fed;
  }

  // The cached engine's prefill `got` and the reference's last step (`want`, of sequence `ref`)
  // agree bit for bit: logits and state, then three decodes each, then the states again.
  void ExpectSameFromHere(const LocalEngine::PrefillResult& got, const ItemResult& want,
                          SequenceId ref) {
    EXPECT_EQ(got.result.logits, want.logits);
    EXPECT_EQ(engine_->state(got.sequence), reference_->state(ref));
    EXPECT_EQ(DecodeN(*engine_, got.sequence, got.result.next_token, 3),
              DecodeN(*reference_, ref, want.next_token, 3));
    EXPECT_EQ(engine_->state(got.sequence), reference_->state(ref));
  }

  // `prompt` on the cached engine must resume `expect_reused` tokens; the reference computes the
  // same tokens as a prefill of the resumed prefix, then of the rest. Both then decode a few
  // tokens: every prediction (logits included) and the state after each step equal bitwise.
  void ExpectParity(const std::vector<int32_t>& prompt, int64_t expect_reused) {
    auto got = engine_->Prefill(SequenceId(0), prompt, {.keep_logits = true});
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->reused, expect_reused);
    const std::span<const int32_t> all(prompt);
    SequenceId ref(0);
    absl::StatusOr<LocalEngine::PrefillResult> want;
    if (expect_reused > 0) {
      want = reference_->Prefill(SequenceId(0), all.first(static_cast<size_t>(expect_reused)));
      ASSERT_TRUE(want.ok()) << want.status();
      ref = want->sequence;
    }
    want = reference_->Prefill(ref, all.subspan(static_cast<size_t>(expect_reused)),
                               {.keep_logits = true});
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameFromHere(*got, want->result, want->sequence);
    ASSERT_TRUE(engine_->Free(got->sequence, /*commit=*/true).ok());
    ASSERT_TRUE(reference_->Free(want->sequence, /*commit=*/false).ok());
    EXPECT_TRUE(engine_->cache().CheckInvariants().ok()) << engine_->cache().CheckInvariants();
  }

  std::unique_ptr<LocalEngine> engine_;
  std::unique_ptr<LocalEngine> reference_;
};

TEST_P(HybridResumeTest, AConversationsNextTurnResumesFromTheLastOnesEnd) {
  // Turn 1 on both engines: a prompt and four decoded tokens. The cached engine's sequence is
  // freed with commit: its state becomes the checkpoint after its 40 + 4 known tokens.
  const std::vector<int32_t> prompt = RandomTokens(40, 256, 6);
  auto first = engine_->Prefill(SequenceId(0), prompt);
  auto ref = reference_->Prefill(SequenceId(0), prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<int32_t> fed = DecodeN(*engine_, first->sequence, first->result.next_token, 4);
  ASSERT_EQ(DecodeN(*reference_, ref->sequence, ref->result.next_token, 4), fed);
  ASSERT_TRUE(engine_->Free(first->sequence, /*commit=*/true).ok());
  // Turn 2: everything so far (the last generated token, never fed, included) and more. The
  // cached engine resumes after the 44 tokens; the reference's sequence goes on.
  std::vector<int32_t> turn2 = prompt;
  turn2.insert(turn2.end(), fed.begin(), fed.end());
  const std::vector<int32_t> more = RandomTokens(20, 256, 7);
  turn2.insert(turn2.end(), more.begin(), more.end());
  auto got = engine_->Prefill(SequenceId(0), turn2, {.keep_logits = true});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->reused, 44);
  auto want =
      reference_->Prefill(ref->sequence, std::span(turn2).subspan(44), {.keep_logits = true});
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectSameFromHere(*got, want->result, ref->sequence);
  EXPECT_EQ(engine_->cache().stats().checkpoints.resumed, 1u);
  EXPECT_TRUE(engine_->cache().CheckInvariants().ok()) << engine_->cache().CheckInvariants();
}

TEST_P(HybridResumeTest, APromptThatLeavesTheCacheResumesFromTheCheckpointBefore) {
  const std::vector<int32_t> doc = RandomTokens(100, 256, 8);
  ExpectParity(doc, 0);  // checkpoints at 64 (interval) and 96 (the prefill's last boundary)
  // Shares 90 tokens: 96 is past them, 64 is the deepest it reaches.
  std::vector<int32_t> other(doc.begin(), doc.begin() + 90);
  const std::vector<int32_t> tail = RandomTokens(25, 256, 9);
  other.insert(other.end(), tail.begin(), tail.end());
  ExpectParity(other, 64);
  // The whole document again: resumes from 96 (only the last 4 tokens are computed).
  ExpectParity(doc, 96);
  // Cut for want of a checkpoint: 90 - 64, then 99 - 96 (the partial block past 96 has one at 103).
  EXPECT_EQ(engine_->cache().stats().missed_no_checkpoint, (90u - 64u) + (99u - 96u));
}

TEST_P(HybridResumeTest, ARewindGoesBackToACheckpointAndOnFromThere) {
  const std::vector<int32_t> doc = RandomTokens(100, 256, 14);
  auto got = engine_->Prefill(SequenceId(0), doc);  // checkpoints at 64 and 96
  ASSERT_TRUE(got.ok()) << got.status();
  DecodeN(*engine_, got->sequence, got->result.next_token, 3);
  const std::vector<float> before = engine_->state(got->sequence);
  // No checkpoint at 80: refused, naming the one it could go back to; nothing changed.
  const absl::Status refused = engine_->Truncate(got->sequence, 80);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("nearest checkpoint on its path is at 64"));
  EXPECT_EQ(engine_->state(got->sequence), before);
  // At 96: the state is the checkpoint's, as if the 7 tokens after it had never been seen.
  ASSERT_TRUE(engine_->Truncate(got->sequence, 96).ok());
  auto ref = reference_->Prefill(SequenceId(0), std::span(doc).first(96));
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(engine_->state(got->sequence), reference_->state(ref->sequence));
  const std::vector<int32_t> more = RandomTokens(21, 256, 15);
  auto a = engine_->Prefill(got->sequence, more, {.keep_logits = true});
  auto b = reference_->Prefill(ref->sequence, more, {.keep_logits = true});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->result.logits, b->result.logits);
  EXPECT_EQ(DecodeN(*engine_, got->sequence, a->result.next_token, 3),
            DecodeN(*reference_, ref->sequence, b->result.next_token, 3));
  EXPECT_EQ(engine_->state(got->sequence), reference_->state(ref->sequence));
  // And back to nothing: the state of no tokens.
  ASSERT_TRUE(engine_->Truncate(got->sequence, 0).ok());
  const std::vector<float> zeros = engine_->state(got->sequence);
  EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](float v) { return v == 0.0f; }));
  EXPECT_TRUE(engine_->cache().CheckInvariants().ok()) << engine_->cache().CheckInvariants();
}

TEST_P(HybridResumeTest, ABranchPointIsCheckpointedForThePromptsAfterIt) {
  const std::vector<int32_t> system = RandomTokens(40, 256, 10);
  auto with = [&](uint64_t seed) {
    std::vector<int32_t> p = system;
    const std::vector<int32_t> q = RandomTokens(30, 256, seed);
    p.insert(p.end(), q.begin(), q.end());
    return p;
  };
  ExpectParity(with(11), 0);
  ExpectParity(with(12), 0);   // leaves at 40: a checkpoint at the last shared block, 32
  ExpectParity(with(13), 32);  // resumes there
}

// A decode keeps a rolling checkpoint at the last block boundary it reached (32, then 48 here),
// put into the tree when the sequence ends: a prompt that leaves the answer inside its last block
// (52 of its 60 tokens: an edit of the answer's end) resumes at 48, not at the prefill's last
// boundary (16); a lower tier, which keys checkpoints by full blocks, relies on the same one.
// The reference replays the same steps (a prefill of 20, decodes to 48, a prefill of the rest):
// a decode sums attention in another order than a prefill, so only the same steps are equal bit
// for bit.
TEST_P(HybridResumeTest, AnAnswersLastBlockBoundaryIsKeptForPromptsThatLeaveItInside) {
  const std::vector<int32_t> prompt = RandomTokens(20, 256, 21);
  auto first = engine_->Prefill(SequenceId(0), prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::vector<int32_t> fed = DecodeN(*engine_, first->sequence, first->result.next_token, 40);
  EXPECT_EQ(engine_->cache().stats().checkpoints.rolled, 1u);  // from 32 to 48
  EXPECT_TRUE(engine_->cache().CheckInvariants().ok()) << engine_->cache().CheckInvariants();
  ASSERT_TRUE(engine_->Free(first->sequence, /*commit=*/true).ok());
  std::vector<int32_t> edited = prompt;
  edited.insert(edited.end(), fed.begin(), fed.begin() + 32);  // 52 tokens of the 60
  const std::vector<int32_t> tail = RandomTokens(10, 256, 22);
  edited.insert(edited.end(), tail.begin(), tail.end());
  auto got = engine_->Prefill(SequenceId(0), edited, {.keep_logits = true});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->reused, 48);
  auto ref = reference_->Prefill(SequenceId(0), prompt);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<int32_t> ref_fed =
      DecodeN(*reference_, ref->sequence, ref->result.next_token, 28);
  ASSERT_TRUE(std::equal(ref_fed.begin(), ref_fed.end() - 1, fed.begin()));
  auto want =
      reference_->Prefill(ref->sequence, std::span(edited).subspan(48), {.keep_logits = true});
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectSameFromHere(*got, want->result, ref->sequence);
  EXPECT_TRUE(engine_->cache().CheckInvariants().ok()) << engine_->cache().CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(Layers, HybridResumeTest,
                         ::testing::Values(Layers::kBamba, Layers::kNemotronH, Layers::kFalconH1),
                         [](const ::testing::TestParamInfo<Layers>& info) {
                           switch (info.param) {
                             case Layers::kNemotronH:
                               return "NemotronH";
                             case Layers::kFalconH1:
                               return "FalconH1";
                             case Layers::kBamba:
                               break;
                           }
                           return "Bamba";
                         });

TEST(HybridConfigTest, TinyHybridIsMostlyStateSpaceWithTinysAttention) {
  absl::StatusOr<ModelConfig> c = NamedConfig("tiny-hybrid");
  ASSERT_TRUE(c.ok()) << c.status();
  const ModelConfig tiny = *NamedConfig("tiny");
  EXPECT_EQ(c->num_layers, tiny.num_layers);
  EXPECT_EQ(c->num_kv_heads, tiny.num_kv_heads);
  EXPECT_EQ(c->head_dim, tiny.head_dim);
  EXPECT_EQ(c->layer_kinds, (std::vector<LayerKind>{kS, kS, kF, kS}));
  EXPECT_TRUE(ValidateConfig(*c).ok());
  // Three layers of [3][1024 + 2 * 128] conv inputs and [16][128][64] state, f32.
  EXPECT_EQ(c->state_bytes(), 3 * (3 * (1024 + 256) + 16 * 128 * 64) * 4);
  EXPECT_EQ(tiny.state_bytes(), 0);
}

TEST(HybridConfigTest, RefusesIncompleteOrStrayStateSpaceShapes) {
  const auto message = [](const ModelConfig& c) {
    const absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  ModelConfig c = HybridConfig({kS, kF});
  ASSERT_TRUE(ValidateConfig(c).ok());
  c.ssm.d_state = 0;
  EXPECT_THAT(message(c), HasSubstr("ssm.d_state"));
  c = HybridConfig({kS, kF});
  c.ssm.conv_width = -1;
  EXPECT_THAT(message(c), HasSubstr("ssm.conv_width"));
  c = HybridConfig({kS, kF});
  c.ssm.num_groups = 3;
  EXPECT_THAT(message(c), HasSubstr("ssm.num_groups"));
  c = HybridConfig({kF, kF});
  EXPECT_THAT(message(c), HasSubstr("no layer is a state-space layer"));
}

class HybridCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvpool_hybrid_ckpt_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // config.json's text through `edit`.
  void EditConfig(const std::function<std::string(std::string)>& edit) {
    const std::filesystem::path path = dir_ / "config.json";
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    in.close();
    std::ofstream(path, std::ios::trunc) << edit(text);
  }

  std::filesystem::path dir_;
};

// Every state-space tensor is written under its Bamba name and read back as it was, and the
// loaded model computes what the original does.
TEST_F(HybridCheckpointTest, StateSpaceLayersSurviveASaveAndALoad) {
  const ModelWeights w = SyntheticWeights(HybridConfig({kS, kF, kS}), 12);
  ASSERT_TRUE(SaveCheckpoint(w, dir_.string(), "f32").ok());
  absl::StatusOr<ModelWeights> back = LoadCheckpoint(dir_.string());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->config, w.config);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights &a = w.layers[l], &b = back->layers[l];
    EXPECT_EQ(a.ssm_in, b.ssm_in) << l;
    EXPECT_EQ(a.ssm_conv, b.ssm_conv) << l;
    EXPECT_EQ(a.ssm_conv_bias, b.ssm_conv_bias) << l;
    EXPECT_EQ(a.ssm_dt_bias, b.ssm_dt_bias) << l;
    EXPECT_EQ(a.ssm_a_log, b.ssm_a_log) << l;
    EXPECT_EQ(a.ssm_d, b.ssm_d) << l;
    EXPECT_EQ(a.ssm_norm, b.ssm_norm) << l;
    EXPECT_EQ(a.ssm_out, b.ssm_out) << l;
    EXPECT_EQ(a.wq, b.wq) << l;
    EXPECT_EQ(a.w_down, b.w_down) << l;
  }
  const std::vector<int32_t> prompt = RandomTokens(19, 256, 3);
  auto original = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  auto loaded = MakeTestEngine(*back, 16, kernels::DType::kF32, false);
  auto x = original->Prefill(SequenceId(0), prompt, kLogits);
  auto y = loaded->Prefill(SequenceId(0), prompt, kLogits);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(x->result.logits, y->result.logits);
}

// Bamba's own spelling: layers_block_type, and mamba_d_head "auto" (mamba_expand * hidden /
// heads); a config missing a field is refused, naming it.
TEST_F(HybridCheckpointTest, ReadsBambasSpellingAndRefusesWhatIsMissing) {
  ModelConfig c = HybridConfig({kS, kF});
  c.ssm.head_dim = 64;  // 2 * 128 / 4, what "auto" gives
  ASSERT_TRUE(SaveCheckpoint(SyntheticWeights(c, 1), dir_.string(), "bf16").ok());
  EditConfig([](std::string text) {
    text = std::regex_replace(text, std::regex(R"("layer_types": \[[^\]]*\],)"),
                              R"("layers_block_type": ["mamba", "attention"],)");
    return std::regex_replace(text, std::regex(R"("mamba_d_head": 64)"),
                              R"("mamba_d_head": "auto")");
  });
  absl::StatusOr<ModelConfig> read = ReadCheckpointConfig(dir_.string());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, c);
  EXPECT_TRUE(LoadCheckpoint(dir_.string()).ok());
  const auto proj_bias = [](const char* from, const char* to) {
    return [from, to](std::string text) {
      return std::regex_replace(text, std::regex(std::string("\"mamba_proj_bias\": ") + from),
                                std::string("\"mamba_proj_bias\": ") + to);
    };
  };
  // Projection biases are read as real checkpoints declare them: here the file has none.
  EditConfig(proj_bias("false", "true"));
  ASSERT_TRUE(ReadCheckpointConfig(dir_.string()).ok());
  EXPECT_TRUE(ReadCheckpointConfig(dir_.string())->ssm.proj_bias);
  EXPECT_THAT(LoadCheckpoint(dir_.string()).status().message(),
              HasSubstr("model.layers.0.mamba.in_proj.bias"));
  EditConfig(proj_bias("true", "false"));
  ASSERT_TRUE(ReadCheckpointConfig(dir_.string()).ok());
  EditConfig([](std::string text) {
    return std::regex_replace(text, std::regex(R"("mamba_d_state": \d+,)"), "");
  });
  EXPECT_THAT(ReadCheckpointConfig(dir_.string()).status().message(),
              HasSubstr("missing mamba_d_state"));
}

}  // namespace
}  // namespace kvpool::model
