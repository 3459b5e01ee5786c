// The model on every backend, one case table (as ggml's test-backend-ops): paged prefill and
// decode against the dense reference for block sizes 1, 16 and 64 in f32 and bf16, batched decode
// and 8-bit or mixed KV layouts against the host model, prefix reuse with a partial block and a
// fork, and bad input refused before the device. Every case runs through LocalEngine on the
// backend's device, made through the registry as kvpoold makes it (kernels/backend.h); a case
// whose backend did not load or has no device here (CUDA without a GPU) skips, saying why.

#include <cmath>
#include <random>
#include <string>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/local_engine.h"
#include "tests/kernels/backend_test_util.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using kernels::test_util::KindOf;
using ::testing::HasSubstr;

// f32 K/V leaves float-vs-double arithmetic (on a GPU cuBLAS also sums in another order than the
// host); bf16 K/V also leaves rounding of values the two sides computed slightly differently.
double Tolerance(const std::string& backend, kernels::DType dtype) {
  if (dtype != kernels::DType::kF32) return 2e-2;
  return backend == "cpu" ? 2e-4 : 5e-4;
}

const StepOptions kLogits{.keep_logits = true};

// A LocalEngine on `backend`, or its status (UNAVAILABLE: the backend or its device is missing).
absl::StatusOr<std::unique_ptr<LocalEngine>> EngineOn(const std::string& backend,
                                                      const ModelWeights& w, int32_t block_size,
                                                      kernels::DType dtype,
                                                      bool prefix_cache = true) {
  return LocalEngine::Create(w, {.block_size = block_size,
                                 .dtype = dtype,
                                 .pool_bytes = int64_t{16} << 20,
                                 .prefix_cache = prefix_cache,
                                 .threads = 2,
                                 .backend = KindOf(backend)});
}

// Declares `var` (std::unique_ptr<LocalEngine>) on the test's backend, or skips saying why.
#define ENGINE_OR_SKIP(var, ...)                         \
  auto var##_or = EngineOn(Backend(), __VA_ARGS__);      \
  KVPOOL_SKIP_UNAVAILABLE(Backend(), var##_or.status()); \
  ASSERT_TRUE(var##_or.ok()) << var##_or.status();       \
  std::unique_ptr<LocalEngine> var = std::move(var##_or).value()

// Full attention, or a sliding layer (window 8 without sinks, window 20 with 3) before a full one
// (issue 28): the 37-token prompt and 12 decodes run past every window.
constexpr kernels::AttentionWindow kWindows[] = {{}, {.window = 8}, {.window = 20, .sinks = 3}};

ModelConfig ConfigWith(const kernels::AttentionWindow& window) {
  ModelConfig c = SmallTestConfig();
  if (window.window > 0) {
    c.layer_kinds = {LayerKind::kSlidingAttention, LayerKind::kFullAttention};
    c.sliding_window = window.window;
    c.sink_tokens = window.sinks;
  }
  return c;
}

class PagedVsDenseTest
    : public ::testing::TestWithParam<std::tuple<std::string, int32_t, kernels::DType, int>> {
 protected:
  const std::string& Backend() const { return std::get<0>(GetParam()); }
};

TEST_P(PagedVsDenseTest, PrefillAndDecodeMatchReference) {
  const auto& [backend, block_size, dtype, window] = GetParam();
  const ModelWeights w = SyntheticWeights(ConfigWith(kWindows[window]), 7);
  ENGINE_OR_SKIP(engine, w, block_size, dtype);
  EXPECT_THAT(engine->model().where(), HasSubstr(backend));
  DenseReference ref(w, dtype);
  const double tolerance = Tolerance(backend, dtype);

  const std::vector<int32_t> prompt = RandomTokens(37, 256, 1);
  auto first = engine->Prefill(SequenceId(0), prompt, kLogits);
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<float> want = ref.Extend(prompt);
  EXPECT_LE(RelError(first->result.logits, want), tolerance);
  int32_t token = Argmax(want);
  if (dtype == kernels::DType::kF32) {
    EXPECT_EQ(first->result.next_token, token);
  }

  for (int step = 0; step < 12; ++step) {
    const DecodeInput in{first->sequence, token};
    auto out = engine->Decode(std::span(&in, 1), kLogits);
    ASSERT_TRUE(out.ok()) << out.status();
    want = ref.Extend(std::span(&token, 1));
    EXPECT_LE(RelError((*out)[0].logits, want), tolerance) << "step " << step;
    token = Argmax(want);
    if (dtype == kernels::DType::kF32) {
      EXPECT_EQ((*out)[0].next_token, token) << "step " << step;
    }
  }
  EXPECT_EQ(engine->cache().Find(first->sequence)->num_tokens, 37 + 12);
  EXPECT_TRUE(engine->cache().CheckInvariants().ok());
}

INSTANTIATE_TEST_SUITE_P(
    Backends, PagedVsDenseTest,
    ::testing::Combine(kernels::test_util::AllBackends(), ::testing::Values(1, 16, 64),
                       ::testing::Values(kernels::DType::kF32, kernels::DType::kBF16),
                       ::testing::Values(0, 1, 2)),
    [](const auto& info) {
      const kernels::AttentionWindow& window = kWindows[std::get<3>(info.param)];
      return std::get<0>(info.param) + "_block" + std::to_string(std::get<1>(info.param)) + "_" +
             std::string(kernels::DTypeName(std::get<2>(info.param))) +
             (window.window > 0 ? "_window" + std::to_string(window.window) + "_sinks" +
                                      std::to_string(window.sinks)
                                : "");
    });

class BackendModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  const std::string& Backend() const { return GetParam(); }
  double Tolerance(kernels::DType dtype) const { return model::Tolerance(Backend(), dtype); }

  // Two sequences share every step: a prefill of 300 (more than the CUDA model's kSsmChunkRows:
  // its chunked scan) and one of 2 (shorter than the conv's window), a chunk and a decode, then
  // batched decodes; each against its own dense reference, logits and state slot.
  void ExpectStateSpaceMatchesReference(const ModelWeights& w) {
    ENGINE_OR_SKIP(engine, w, 16, kernels::DType::kF32, /*prefix_cache=*/false);
    const double tolerance = Tolerance(kernels::DType::kF32);
    std::vector<DenseReference> refs(2, DenseReference(w, kernels::DType::kF32));
    const std::vector<int32_t> a = RandomTokens(300, 256, 1), b = RandomTokens(6, 256, 2);
    std::vector<SequenceId> seqs;
    for (size_t s = 0; s < 2; ++s) {
      const std::span<const int32_t> part = s == 0 ? std::span(a) : std::span(b).first(2);
      auto first = engine->Prefill(SequenceId(0), part, kLogits);
      ASSERT_TRUE(first.ok()) << first.status();
      EXPECT_LE(RelError(first->result.logits, refs[s].Extend(part)), tolerance);
      seqs.push_back(first->sequence);
    }
    auto chunk = engine->Prefill(seqs[1], std::span(b).subspan(2, 3), kLogits);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_LE(RelError(chunk->result.logits, refs[1].Extend(std::span(b).subspan(2, 3))),
              tolerance);
    std::vector<int32_t> next = {a[0], b[5]};
    for (int step = 0; step < 6; ++step) {
      const std::vector<DecodeInput> in = {{seqs[0], next[0]}, {seqs[1], next[1]}};
      auto out = engine->Decode(in, kLogits);
      ASSERT_TRUE(out.ok()) << out.status();
      for (size_t s = 0; s < 2; ++s) {
        const std::vector<float> want = refs[s].Extend(std::span(&next[s], 1));
        EXPECT_LE(RelError((*out)[s].logits, want), tolerance) << "step " << step << " seq " << s;
        next[s] = Argmax(want);
      }
    }
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_LE(RelError(engine->state(seqs[s]), refs[s].State()), 2e-3) << "seq " << s;
    }
  }
};

TEST_P(BackendModelTest, BatchedDecodeMatchesTheHostModel) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 11);
  ENGINE_OR_SKIP(dev, w, 16, kernels::DType::kF32);
  auto host = LocalEngine::Create(w, {.block_size = 16,
                                      .dtype = kernels::DType::kF32,
                                      .pool_bytes = int64_t{16} << 20,
                                      .threads = 2});
  ASSERT_TRUE(host.ok()) << host.status();
  std::vector<DecodeInput> on_dev, on_host;
  for (size_t len : {5u, 20u, 33u, 64u}) {
    const std::vector<int32_t> prompt = RandomTokens(len, 256, static_cast<uint32_t>(len));
    auto g = dev->Prefill(SequenceId(0), prompt, kLogits);
    auto h = (*host)->Prefill(SequenceId(0), prompt, kLogits);
    ASSERT_TRUE(g.ok() && h.ok()) << g.status() << " " << h.status();
    EXPECT_LE(RelError(g->result.logits, h->result.logits), Tolerance(kernels::DType::kF32));
    EXPECT_EQ(g->result.next_token, h->result.next_token);
    on_dev.push_back({g->sequence, h->result.next_token});
    on_host.push_back({h->sequence, h->result.next_token});
  }
  for (int step = 0; step < 8; ++step) {
    auto g = dev->Decode(on_dev, {.top_k = 4, .keep_logits = true});
    auto h = (*host)->Decode(on_host, {.top_k = 4, .keep_logits = true});
    ASSERT_TRUE(g.ok() && h.ok()) << g.status() << " " << h.status();
    for (size_t i = 0; i < on_dev.size(); ++i) {
      EXPECT_LE(RelError((*g)[i].logits, (*h)[i].logits), Tolerance(kernels::DType::kF32))
          << "seq " << i << " step " << step;
      EXPECT_EQ((*g)[i].next_token, (*h)[i].next_token) << "seq " << i << " step " << step;
      ASSERT_EQ((*g)[i].top.size(), 4u);
      EXPECT_EQ((*g)[i].top[0].token, (*h)[i].top[0].token);
      EXPECT_NEAR((*g)[i].top[0].logprob, (*h)[i].top[0].logprob, 1e-3);
      on_dev[i].token = on_host[i].token = (*h)[i].next_token;
    }
  }
}

// 8-bit and mixed KV layouts: the backend's model against the host model over the same layout
// (a device WriteKv quantizes as the CPU's does; products computed in another order can still
// move a value across a rounding boundary, hence bf16's tolerance).
TEST_P(BackendModelTest, EightBitAndMixedLayoutsMatchTheHostModel) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 47);
  const std::vector<std::pair<kernels::DType, std::vector<kernels::LayerDTypes>>> layouts = {
      {kernels::DType::kFp8E4M3, {}},
      {kernels::DType::kInt8, {}},
      {kernels::DType::kFp8E4M3, {{0, kernels::DType::kBF16, kernels::DType::kBF16}}},
      {kernels::DType::kBF16,
       {{0, kernels::DType::kBF16, kernels::DType::kInt8},
        {1, kernels::DType::kBF16, kernels::DType::kInt8}}}};
  for (const auto& [dtype, layers] : layouts) {
    auto engine = [&](kernels::BackendKind backend) {
      return LocalEngine::Create(w, {.block_size = 16,
                                     .dtype = dtype,
                                     .layer_dtypes = layers,
                                     .pool_bytes = int64_t{16} << 20,
                                     .threads = 2,
                                     .backend = backend});
    };
    auto dev = engine(kernels::test_util::KindOf(GetParam()));
    KVPOOL_SKIP_UNAVAILABLE(GetParam(), dev.status());
    auto host = engine(kernels::BackendKind::kCpu);
    ASSERT_TRUE(dev.ok() && host.ok()) << dev.status() << " " << host.status();
    const std::vector<int32_t> prompt = RandomTokens(45, 256, 3);
    auto g = (*dev)->Prefill(SequenceId(0), prompt, kLogits);
    auto h = (*host)->Prefill(SequenceId(0), prompt, kLogits);
    ASSERT_TRUE(g.ok() && h.ok()) << g.status() << " " << h.status();
    EXPECT_LE(RelError(g->result.logits, h->result.logits), 2e-2);
    DecodeInput on_dev{g->sequence, h->result.next_token}, on_host{h->sequence, on_dev.token};
    for (int step = 0; step < 6; ++step) {
      auto gd = (*dev)->Decode(std::span(&on_dev, 1), kLogits);
      auto hd = (*host)->Decode(std::span(&on_host, 1), kLogits);
      ASSERT_TRUE(gd.ok() && hd.ok()) << gd.status() << " " << hd.status();
      EXPECT_LE(RelError((*gd)[0].logits, (*hd)[0].logits), 2e-2) << "step " << step;
      on_dev.token = on_host.token = (*hd)[0].next_token;
    }
  }
}
TEST_P(BackendModelTest, ReusedPartialBlockAndForkMatchReference) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 17);
  ENGINE_OR_SKIP(engine, w, 16, kernels::DType::kF32);
  // 44 tokens committed: two full blocks and a partial one of 12 (a rewind endpoint).
  const std::vector<int32_t> prompt = RandomTokens(44, 256, 5);
  auto first = engine->Prefill(SequenceId(0), prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(engine->Free(first->sequence, /*commit=*/true).ok());
  std::vector<int32_t> longer = prompt;
  for (int32_t t : RandomTokens(9, 256, 6)) longer.push_back(t);
  auto second = engine->Prefill(SequenceId(0), longer, kLogits);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->reused, 44);
  DenseReference ref(w, kernels::DType::kF32);
  EXPECT_LE(RelError(second->result.logits, ref.Extend(longer)), Tolerance(kernels::DType::kF32));
  // A fork copies the shared partial block (the device's CopyBlocks) before either side writes.
  auto child = engine->Fork(second->sequence);
  ASSERT_TRUE(child.ok()) << child.status();
  DenseReference ref_child = ref;
  std::vector<DecodeInput> inputs = {{second->sequence, 3}, {*child, 200}};
  for (int step = 0; step < 6; ++step) {
    auto out = engine->Decode(inputs, kLogits);
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<float> wp = ref.Extend(std::span(&inputs[0].token, 1));
    const std::vector<float> wc = ref_child.Extend(std::span(&inputs[1].token, 1));
    EXPECT_LE(RelError((*out)[0].logits, wp), Tolerance(kernels::DType::kF32)) << "step " << step;
    EXPECT_LE(RelError((*out)[1].logits, wc), Tolerance(kernels::DType::kF32)) << "step " << step;
    inputs[0].token = Argmax(wp);
    inputs[1].token = (Argmax(wc) + 1) % 256;
  }
  EXPECT_TRUE(engine->cache().CheckInvariants().ok());
}
TEST_P(BackendModelTest, BadInputIsRefusedBeforeTheDevice) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 23);
  ENGINE_OR_SKIP(engine, w, 16, kernels::DType::kBF16);
  const std::vector<int32_t> prompt = RandomTokens(20, 256, 9);
  auto first = engine->Prefill(SequenceId(0), prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::vector<int32_t> bad = {1, 2, 256};
  auto r = engine->Prefill(SequenceId(0), bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->cache().Find(first->sequence)->num_tokens, 20);
  // The device is still healthy: the sequence decodes on.
  const DecodeInput in{first->sequence, 5};
  EXPECT_TRUE(engine->Decode(std::span(&in, 1)).ok());
  EXPECT_TRUE(engine->device().status().ok());
}

// State-space layers (issue 28) around a full-attention one, with every variant real
// checkpoints have at once: two B/C groups under a whole-inner gated norm (transformers' Bamba),
// projection biases, no conv bias, and RoPE over half of each head.
TEST_P(BackendModelTest, StateSpaceLayersMatchReference) {
  ModelConfig c = SmallTestConfig();
  c.num_layers = 3;
  c.rotary_dim = 16;
  c.layer_kinds = {LayerKind::kStateSpace, LayerKind::kFullAttention, LayerKind::kStateSpace};
  c.ssm = {.num_heads = 4,
           .head_dim = 32,
           .d_state = 16,
           .num_groups = 2,
           .conv_width = 4,
           .conv_bias = false,
           .proj_bias = true,
           .norm_per_group = false};
  ExpectStateSpaceMatchesReference(SyntheticWeights(c, 23));
}

// Nemotron-H's build: one mixer or MLP per layer, squared-ReLU MLP layers (the CUDA model's
// ReluSquared kernel), attention without RoPE, the gated norm per group.
TEST_P(BackendModelTest, NemotronHLayersMatchReference) {
  ModelConfig c = SmallTestConfig();
  c.num_layers = 5;
  c.layer_kinds = {LayerKind::kStateSpace, LayerKind::kMlp, LayerKind::kFullAttention,
                   LayerKind::kMlp, LayerKind::kStateSpace};
  c.ssm = {.num_heads = 4, .head_dim = 32, .d_state = 16, .num_groups = 2, .conv_width = 4};
  c.mlp_after_mixer = false;
  c.mlp_activation = MlpActivation::kReluSquared;
  c.rope = false;
  ExpectStateSpaceMatchesReference(SyntheticWeights(c, 29));
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendModelTest, kernels::test_util::AllBackends(),
                         kernels::test_util::BackendName());

}  // namespace
}  // namespace kvpool::model
