// Sliding-window layers (issue 28): reuse from the prefix cache against recomputing; the window
// really changes what a long sequence computes; and the configuration's presets, checks and
// checkpoint round trip. (The paged model with window layers against the dense reference is
// backend_model_test's PagedVsDenseTest, on every backend.)

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/check.h"
#include "model/local_engine.h"
#include "model/model.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using ::testing::HasSubstr;

const StepOptions kLogits{.keep_logits = true};

// A second turn that reuses the first from the prefix cache computes what a cache-less engine
// computes from scratch, past the window's edge.
TEST(WindowModelTest, ReuseFromTheCacheEqualsRecomputing) {
  const ModelWeights w = SyntheticWeights(WindowedTestConfig(12, 2), 17);
  const std::vector<int32_t> prompt = RandomTokens(50, 256, 5), more = RandomTokens(9, 256, 6);
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), more.begin(), more.end());
  for (kernels::DType dtype : {kernels::DType::kF32, kernels::DType::kBF16}) {
    auto on = MakeTestEngine(w, 16, dtype, /*prefix_cache=*/true);
    auto off = MakeTestEngine(w, 16, dtype, /*prefix_cache=*/false);
    for (LocalEngine* e : {on.get(), off.get()}) {
      auto first = e->Prefill(SequenceId(0), prompt, kLogits);
      ASSERT_TRUE(first.ok()) << first.status();
      ASSERT_TRUE(e->Free(first->sequence, /*commit=*/true).ok());
    }
    auto a = on->Prefill(SequenceId(0), history, kLogits);
    auto b = off->Prefill(SequenceId(0), history, kLogits);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_GE(a->reused, 48);
    EXPECT_EQ(b->reused, 0);
    EXPECT_EQ(a->result.next_token, b->result.next_token);
    EXPECT_LE(RelError(a->result.logits, b->result.logits), HostTolerance(dtype));
    int32_t ta = a->result.next_token, tb = b->result.next_token;
    for (int step = 0; step < 6; ++step) {
      const DecodeInput ia{a->sequence, ta}, ib{b->sequence, tb};
      auto da = on->Decode(std::span(&ia, 1), kLogits);
      auto db = off->Decode(std::span(&ib, 1), kLogits);
      ASSERT_TRUE(da.ok() && db.ok());
      EXPECT_LE(RelError((*da)[0].logits, (*db)[0].logits), HostTolerance(dtype))
          << "step " << step;
      ta = (*da)[0].next_token;
      tb = (*db)[0].next_token;
      EXPECT_EQ(ta, tb) << "step " << step;
    }
    EXPECT_TRUE(on->cache().CheckInvariants().ok());
  }
}

// The window is not decoration: past it, the same weights compute other logits than with every
// layer full, and within it the same ones.
TEST(WindowModelTest, TheWindowChangesOnlyWhatLiesPastIt) {
  ModelConfig full = WindowedTestConfig(8, 0);
  full.layer_kinds.clear();
  full.sliding_window = 0;
  const ModelWeights w_full = SyntheticWeights(full, 3),
                     w_window = SyntheticWeights(WindowedTestConfig(8, 0), 3);
  auto a = MakeTestEngine(w_full, 16, kernels::DType::kF32, false);
  auto b = MakeTestEngine(w_window, 16, kernels::DType::kF32, false);
  const std::vector<int32_t> short_prompt = RandomTokens(8, 256, 2);
  const std::vector<int32_t> long_prompt = RandomTokens(40, 256, 2);
  auto fa = a->Prefill(SequenceId(0), short_prompt, kLogits);
  auto fb = b->Prefill(SequenceId(0), short_prompt, kLogits);
  ASSERT_TRUE(fa.ok() && fb.ok());
  EXPECT_EQ(fa->result.logits, fb->result.logits);
  auto la = a->Prefill(SequenceId(0), long_prompt, kLogits);
  auto lb = b->Prefill(SequenceId(0), long_prompt, kLogits);
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_GT(RelError(la->result.logits, lb->result.logits), 1e-2);
}

TEST(WindowConfigTest, TinySwaAlternatesSlidingAndFullLayers) {
  absl::StatusOr<ModelConfig> c = NamedConfig("tiny-swa");
  ASSERT_TRUE(c.ok()) << c.status();
  const ModelConfig tiny = *NamedConfig("tiny");
  EXPECT_EQ(c->num_layers, tiny.num_layers);
  EXPECT_EQ(c->num_kv_heads, tiny.num_kv_heads);
  EXPECT_EQ(c->sliding_window, 256);
  for (int32_t l = 0; l < c->num_layers; ++l) {
    EXPECT_EQ(c->kind(l), l % 2 == 0 ? LayerKind::kSlidingAttention : LayerKind::kFullAttention);
  }
  EXPECT_TRUE(ValidateConfig(*c).ok());
}

TEST(WindowConfigTest, RefusesInconsistentWindows) {
  ModelConfig c = WindowedTestConfig(8, 0);
  c.sliding_window = 0;
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("sliding_window"));
  c = WindowedTestConfig(8, -1);
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("sink_tokens"));
  c = WindowedTestConfig(8, 0);
  c.layer_kinds.push_back(LayerKind::kFullAttention);
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("layer_kinds"));
}

class WindowCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvpool_window_ckpt_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Saves `w`, then replaces config.json's text with `edit(text)` when given, and reads it back.
  absl::StatusOr<ModelConfig> RoundTrip(const ModelWeights& w,
                                        std::function<std::string(std::string)> edit = nullptr) {
    KVPOOL_CHECK_OK(SaveCheckpoint(w, dir_.string(), "f32"));
    if (edit) {
      const std::filesystem::path path = dir_ / "config.json";
      std::ifstream in(path);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      in.close();
      std::ofstream(path, std::ios::trunc) << edit(text);
    }
    return ReadCheckpointConfig(dir_.string());
  }

  std::filesystem::path dir_;
};

TEST_F(WindowCheckpointTest, LayerTypesAndTheWindowSurviveASaveAndALoad) {
  const ModelWeights w = SyntheticWeights(WindowedTestConfig(20, 3), 5);
  absl::StatusOr<ModelConfig> back = RoundTrip(w);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, w.config);
}

TEST_F(WindowCheckpointTest, ReadsTheHuggingFaceSpellings) {
  ModelConfig plain = SmallTestConfig();
  const ModelWeights w = SyntheticWeights(plain, 5);
  auto with = [](std::string extra) {
    return [extra](std::string text) { return "{" + extra + "," + text.substr(1); };
  };
  // Mistral: one window for every layer.
  absl::StatusOr<ModelConfig> mistral = RoundTrip(w, with("\"sliding_window\": 16"));
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_EQ(mistral->sliding_window, 16);
  EXPECT_EQ(mistral->kind(0), LayerKind::kSlidingAttention);
  EXPECT_EQ(mistral->kind(1), LayerKind::kSlidingAttention);
  // Qwen2: a window it does not use.
  absl::StatusOr<ModelConfig> qwen =
      RoundTrip(w, with("\"sliding_window\": 16, \"use_sliding_window\": false"));
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(*qwen, plain);
  // Unknown layer types, and a list of the wrong length, are refused.
  EXPECT_THAT(RoundTrip(w, with("\"sliding_window\": 16, \"layer_types\": [\"full_attention\", "
                                "\"linear_attention\"]"))
                  .status()
                  .message(),
              HasSubstr("linear_attention"));
  EXPECT_THAT(RoundTrip(w, with("\"sliding_window\": 16, \"layer_types\": [\"full_attention\"]"))
                  .status()
                  .message(),
              HasSubstr("layer_kinds"));
  EXPECT_THAT(RoundTrip(w, with("\"layer_types\": [\"full_attention\", \"sliding_attention\"]"))
                  .status()
                  .message(),
              HasSubstr("sliding_window"));
}

}  // namespace
}  // namespace kvpool::model
