// The model on the GPU (model/cuda/cuda_model.h) against the dense reference and the host model:
// paged prefill and decode for block sizes 1, 16 and 64 in f32 and bf16, batched decode, prefix
// reuse with a partial block, a fork, and bad input. Every test runs through LocalEngine with the
// CUDA backend, loaded the way kvpoold loads it, and skips when there is no GPU.

#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/local_engine.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using ::testing::HasSubstr;

// cuBLAS sums in another order than the host; f32 stays within float rounding of the reference.
double Tolerance(kernels::DType dtype) { return dtype == kernels::DType::kF32 ? 5e-4 : 2e-2; }

const StepOptions kLogits{.keep_logits = true};

// A LocalEngine on the GPU, or null (the test skips) when there is none.
std::unique_ptr<LocalEngine> GpuEngine(const ModelWeights& w, int32_t block_size,
                                       kernels::DType dtype, bool prefix_cache = true) {
  auto engine = LocalEngine::Create(w, {.block_size = block_size,
                                        .dtype = dtype,
                                        .pool_bytes = int64_t{16} << 20,
                                        .prefix_cache = prefix_cache,
                                        .backend = kernels::BackendKind::kCuda});
  if (engine.status().code() == absl::StatusCode::kUnavailable) return nullptr;
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

#define GPU_ENGINE_OR_SKIP(var, ...)                                      \
  auto var = GpuEngine(__VA_ARGS__);                                      \
  if (var == nullptr) {                                                   \
    GTEST_SKIP() << "no CUDA device: " << kernels::DescribeCudaBackend(); \
  }

class CudaModelTest : public ::testing::TestWithParam<std::tuple<int32_t, kernels::DType>> {};

TEST_P(CudaModelTest, PrefillAndDecodeMatchReference) {
  const auto [block_size, dtype] = GetParam();
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 7);
  GPU_ENGINE_OR_SKIP(engine, w, block_size, dtype);
  EXPECT_THAT(engine->model().where(), HasSubstr("cuda"));
  DenseReference ref(w, dtype);
  const std::vector<int32_t> prompt = RandomTokens(37, 256, 1);
  auto first = engine->Prefill(SequenceId(0), prompt, kLogits);
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<float> want = ref.Extend(prompt);
  EXPECT_LE(RelError(first->result.logits, want), Tolerance(dtype));
  int32_t token = Argmax(want);
  for (int step = 0; step < 12; ++step) {
    const DecodeInput in{first->sequence, token};
    auto out = engine->Decode(std::span(&in, 1), kLogits);
    ASSERT_TRUE(out.ok()) << out.status();
    want = ref.Extend(std::span(&token, 1));
    EXPECT_LE(RelError((*out)[0].logits, want), Tolerance(dtype)) << "step " << step;
    token = Argmax(want);
    if (dtype == kernels::DType::kF32) {
      EXPECT_EQ((*out)[0].next_token, token) << "step " << step;
    }
  }
  EXPECT_TRUE(engine->cache().CheckInvariants().ok());
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, CudaModelTest,
                         ::testing::Combine(::testing::Values(1, 16, 64),
                                            ::testing::Values(kernels::DType::kF32,
                                                              kernels::DType::kBF16)));

TEST(CudaModelTest, BatchedDecodeMatchesTheHostModel) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 11);
  GPU_ENGINE_OR_SKIP(gpu, w, 16, kernels::DType::kF32);
  auto host = LocalEngine::Create(w, {.block_size = 16,
                                      .dtype = kernels::DType::kF32,
                                      .pool_bytes = int64_t{16} << 20,
                                      .threads = 2});
  ASSERT_TRUE(host.ok()) << host.status();
  std::vector<DecodeInput> on_gpu, on_host;
  for (size_t len : {5u, 20u, 33u, 64u}) {
    const std::vector<int32_t> prompt = RandomTokens(len, 256, static_cast<uint32_t>(len));
    auto g = gpu->Prefill(SequenceId(0), prompt, kLogits);
    auto h = (*host)->Prefill(SequenceId(0), prompt, kLogits);
    ASSERT_TRUE(g.ok() && h.ok()) << g.status() << " " << h.status();
    EXPECT_LE(RelError(g->result.logits, h->result.logits), 5e-4);
    EXPECT_EQ(g->result.next_token, h->result.next_token);
    on_gpu.push_back({g->sequence, h->result.next_token});
    on_host.push_back({h->sequence, h->result.next_token});
  }
  for (int step = 0; step < 8; ++step) {
    auto g = gpu->Decode(on_gpu, {.top_k = 4, .keep_logits = true});
    auto h = (*host)->Decode(on_host, {.top_k = 4, .keep_logits = true});
    ASSERT_TRUE(g.ok() && h.ok()) << g.status() << " " << h.status();
    for (size_t i = 0; i < on_gpu.size(); ++i) {
      EXPECT_LE(RelError((*g)[i].logits, (*h)[i].logits), 5e-4) << "seq " << i << " step " << step;
      EXPECT_EQ((*g)[i].next_token, (*h)[i].next_token) << "seq " << i << " step " << step;
      ASSERT_EQ((*g)[i].top.size(), 4u);
      EXPECT_EQ((*g)[i].top[0].token, (*h)[i].top[0].token);
      EXPECT_NEAR((*g)[i].top[0].logprob, (*h)[i].top[0].logprob, 1e-3);
      on_gpu[i].token = on_host[i].token = (*h)[i].next_token;
    }
  }
}

// 8-bit and mixed KV layouts: the GPU model against the host model over the same layout (the
// CUDA WriteKv quantizes as the CPU's does; products computed in another order can still move a
// value across a rounding boundary, hence bf16's tolerance).
TEST(CudaModelTest, EightBitAndMixedLayoutsMatchTheHostModel) {
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
    auto gpu = engine(kernels::BackendKind::kCuda);
    if (gpu.status().code() == absl::StatusCode::kUnavailable) {
      GTEST_SKIP() << "no CUDA device: " << kernels::DescribeCudaBackend();
    }
    auto host = engine(kernels::BackendKind::kCpu);
    ASSERT_TRUE(gpu.ok() && host.ok()) << gpu.status() << " " << host.status();
    const std::vector<int32_t> prompt = RandomTokens(45, 256, 3);
    auto g = (*gpu)->Prefill(SequenceId(0), prompt, kLogits);
    auto h = (*host)->Prefill(SequenceId(0), prompt, kLogits);
    ASSERT_TRUE(g.ok() && h.ok()) << g.status() << " " << h.status();
    EXPECT_LE(RelError(g->result.logits, h->result.logits), 2e-2);
    DecodeInput on_gpu{g->sequence, h->result.next_token}, on_host{h->sequence, on_gpu.token};
    for (int step = 0; step < 6; ++step) {
      auto gd = (*gpu)->Decode(std::span(&on_gpu, 1), kLogits);
      auto hd = (*host)->Decode(std::span(&on_host, 1), kLogits);
      ASSERT_TRUE(gd.ok() && hd.ok()) << gd.status() << " " << hd.status();
      EXPECT_LE(RelError((*gd)[0].logits, (*hd)[0].logits), 2e-2) << "step " << step;
      on_gpu.token = on_host.token = (*hd)[0].next_token;
    }
  }
}

TEST(CudaModelTest, ReusedPartialBlockAndForkMatchReference) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 17);
  GPU_ENGINE_OR_SKIP(engine, w, 16, kernels::DType::kF32);
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
  // A fork copies the shared partial block (CopyBlocks on the GPU) before either side writes.
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

TEST(CudaModelTest, BadInputIsRefusedBeforeTheDevice) {
  const ModelWeights w = SyntheticWeights(SmallTestConfig(), 23);
  GPU_ENGINE_OR_SKIP(engine, w, 16, kernels::DType::kBF16);
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

}  // namespace
}  // namespace kvpool::model
