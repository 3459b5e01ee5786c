#include "model/weights.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/internal/safetensors.h"
#include "tests/model/weights_test_util.h"

namespace kvpool::model {
namespace {

using internal::Bf16ToF32;
using internal::F16ToF32;
using internal::F32ToBf16;
using internal::F32ToF16;
using test_util::ExpectSameWeights;
using test_util::kInf;
using test_util::kNaN;
using test_util::NamedTensors;
using test_util::Stats;
using test_util::StatsOf;
using test_util::TestConfig;
using test_util::WeightsTest;
using ::testing::HasSubstr;

// ---- Configs ---------------------------------------------------------------------------------

TEST_F(WeightsTest, NamedConfigTinyHasKvpooldDefaults) {
  const absl::StatusOr<ModelConfig> tiny = NamedConfig("tiny");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ(tiny->vocab_size, 8192);
  EXPECT_EQ(tiny->hidden_size, 512);
  EXPECT_EQ(tiny->intermediate_size, 1408);
  EXPECT_EQ(tiny->num_layers, 4);
  EXPECT_EQ(tiny->num_heads, 8);
  EXPECT_EQ(tiny->num_kv_heads, 4);
  EXPECT_EQ(tiny->head_dim, 64);
  EXPECT_EQ(tiny->rms_norm_eps, 1e-5f);
  EXPECT_EQ(tiny->rope_theta, 10000.0f);
  EXPECT_TRUE(tiny->tie_word_embeddings);
  EXPECT_EQ(tiny->max_position, 4096);
  EXPECT_TRUE(ValidateConfig(*tiny).ok());

  const absl::StatusOr<ModelConfig> small = NamedConfig("small");
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->vocab_size, 32000);
  EXPECT_EQ(small->num_layers, 8);
  EXPECT_FALSE(small->tie_word_embeddings);
  EXPECT_EQ(small->max_position, 8192);
  EXPECT_TRUE(ValidateConfig(*small).ok());
}

TEST_F(WeightsTest, NamedConfigUnknownNameListsKnownOnes) {
  const absl::StatusOr<ModelConfig> config = NamedConfig("huge");
  ASSERT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("huge"));
  EXPECT_THAT(config.status().message(), HasSubstr("tiny"));
  EXPECT_THAT(config.status().message(), HasSubstr("small"));
}

TEST_F(WeightsTest, ValidateConfigRejectsEachBadField) {
  const std::vector<std::pair<std::string, std::function<void(ModelConfig&)>>> cases = {
      {"vocab_size", [](ModelConfig& c) { c.vocab_size = 0; }},
      {"hidden_size", [](ModelConfig& c) { c.hidden_size = -32; }},
      {"intermediate_size", [](ModelConfig& c) { c.intermediate_size = 0; }},
      {"num_layers", [](ModelConfig& c) { c.num_layers = 0; }},
      {"num_heads", [](ModelConfig& c) { c.num_heads = 0; }},
      {"num_kv_heads", [](ModelConfig& c) { c.num_kv_heads = 0; }},
      {"num_kv_heads", [](ModelConfig& c) { c.num_kv_heads = 3; }},
      {"head_dim", [](ModelConfig& c) { c.head_dim = 0; }},
      {"head_dim", [](ModelConfig& c) { c.head_dim = 12; }},
      {"head_dim", [](ModelConfig& c) { c.head_dim = 7; }},
      {"rms_norm_eps", [](ModelConfig& c) { c.rms_norm_eps = 0.0f; }},
      {"rms_norm_eps", [](ModelConfig& c) { c.rms_norm_eps = kNaN; }},
      {"rope_theta", [](ModelConfig& c) { c.rope_theta = -1.0f; }},
      {"rope_theta", [](ModelConfig& c) { c.rope_theta = kInf; }},
      {"max_position", [](ModelConfig& c) { c.max_position = 0; }},
  };
  ASSERT_TRUE(ValidateConfig(TestConfig()).ok());
  for (const auto& [field, mutate] : cases) {
    ModelConfig config = TestConfig();
    mutate(config);
    const absl::Status status = ValidateConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(status.message(), HasSubstr(field));
  }
}

TEST_F(WeightsTest, ValidateConfigAllowsExplicitHeadDim) {
  ModelConfig config = TestConfig();
  config.head_dim = 16;  // 4 heads * 16 != hidden 32, as Llama's explicit head_dim allows
  EXPECT_TRUE(ValidateConfig(config).ok());
}

// ---- Synthetic weights ---------------------------------------------------------------------

TEST_F(WeightsTest, SyntheticWeightsAreDeterministicPerSeed) {
  const ModelWeights a = SyntheticWeights(TestConfig(false), 7);
  const ModelWeights b = SyntheticWeights(TestConfig(false), 7);
  const ModelWeights c = SyntheticWeights(TestConfig(false), 8);
  ExpectSameWeights(a, b);
  const auto ta = NamedTensors(a), tc = NamedTensors(c);
  ASSERT_EQ(ta.size(), tc.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    if (ta[i].first.find("norm") != std::string::npos) continue;  // all ones by design
    EXPECT_NE(*ta[i].second, *tc[i].second) << ta[i].first << " ignores the seed";
  }
  // Distinct tensors draw distinct streams.
  EXPECT_NE(a.layers[0].wk, a.layers[0].wv);
  EXPECT_NE(a.layers[0].wq, a.layers[1].wq);
}

// Fixed bits for a fixed seed: the generator uses integer arithmetic and one correctly rounded
// multiply, so these hold on every machine. A change here changes every synthetic model.
TEST_F(WeightsTest, SyntheticWeightsMatchGoldenValues) {
  const ModelWeights w = SyntheticWeights(TestConfig(), 1);
  const std::vector<float> embed_head(w.embed.begin(), w.embed.begin() + 4);
  const std::vector<float> down_head(w.layers[1].w_down.begin(), w.layers[1].w_down.begin() + 4);
  EXPECT_THAT(embed_head, ::testing::ElementsAre(-0x1.1bbf9ep-3f, 0x1.7db30cp-4f, 0x1.424c9ep-4f,
                                                 -0x1.85fc4ep-4f));
  EXPECT_THAT(down_head, ::testing::ElementsAre(-0x1.d5df58p-7f, 0x1.21a1cep-3f, -0x1.17f858p-5f,
                                                -0x1.98c07cp-6f));
}

TEST_F(WeightsTest, SyntheticWeightsHaveDesignedScales) {
  const ModelConfig config = *NamedConfig("tiny");
  const ModelWeights w = SyntheticWeights(config, 42);
  EXPECT_TRUE(w.lm_head.empty());  // tied
  const double layers_scale = 1.0 / std::sqrt(static_cast<double>(config.num_layers));
  const std::vector<std::pair<const std::vector<float>*, double>> expected = {
      {&w.embed, 1 / std::sqrt(512.0)},
      {&w.layers[0].wq, 3 / std::sqrt(512.0)},  // sharper attention
      {&w.layers[1].wk, 1 / std::sqrt(512.0)},
      {&w.layers[2].wv, 1 / std::sqrt(512.0)},
      {&w.layers[3].wo, 1 / std::sqrt(512.0) * layers_scale},
      {&w.layers[0].w_gate, 1 / std::sqrt(512.0)},
      {&w.layers[1].w_up, 1 / std::sqrt(512.0)},
      {&w.layers[2].w_down, 1 / std::sqrt(1408.0) * layers_scale},
  };
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& [tensor, stddev] = expected[i];
    const Stats s = StatsOf(*tensor);
    EXPECT_NEAR(s.stddev, stddev, 0.01 * stddev) << "tensor " << i;
    EXPECT_LT(std::abs(s.mean), 6 * stddev / std::sqrt(static_cast<double>(tensor->size())));
    EXPECT_NEAR(s.within_one_sigma, 0.68, 0.03) << "tensor " << i << " is not normal-like";
    EXPECT_LT(s.max_abs, 3.5 * stddev) << "tensor " << i;
  }
  for (const LayerWeights& layer : w.layers) {
    EXPECT_EQ(layer.attn_norm, std::vector<float>(512, 1.0f));
    EXPECT_EQ(layer.mlp_norm, std::vector<float>(512, 1.0f));
  }
  EXPECT_EQ(w.final_norm, std::vector<float>(512, 1.0f));

  const ModelWeights untied = SyntheticWeights(TestConfig(false), 42);
  ASSERT_EQ(untied.lm_head.size(), 64u * 32u);
  EXPECT_NEAR(StatsOf(untied.lm_head).stddev, 1 / std::sqrt(32.0), 0.1 / std::sqrt(32.0));
}

// ---- Half and bfloat16 -----------------------------------------------------------------------

TEST_F(WeightsTest, F16ConvertsSpecialValues) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3C00);
  EXPECT_EQ(F32ToF16(-2.5f), 0xC100);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7BFF);         // largest finite half
  EXPECT_EQ(F32ToF16(65519.0f), 0x7BFF);         // below the halfway point
  EXPECT_EQ(F32ToF16(65520.0f), 0x7C00);         // halfway: ties to even, which is inf
  EXPECT_EQ(F32ToF16(0x1p-14f), 0x0400);         // smallest normal
  EXPECT_EQ(F32ToF16(0x1p-24f), 0x0001);         // smallest subnormal
  EXPECT_EQ(F32ToF16(0x1p-25f), 0x0000);         // halfway to it: ties to even zero
  EXPECT_EQ(F32ToF16(0x1.8p-25f), 0x0001);       // above halfway
  EXPECT_EQ(F32ToF16(0x1.ffcp-15f), 0x0400);     // subnormal tie rounding up into the normals
  EXPECT_EQ(F32ToF16(0x1.ffap-15f), 0x03FF);     // largest subnormal, rounded down
  EXPECT_EQ(F32ToF16(1.0f + 0x1p-11f), 0x3C00);  // tie to even mantissa 0
  EXPECT_EQ(F32ToF16(1.0f + 0x3p-11f), 0x3C02);  // tie to even mantissa 2
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(kInf), 0x7C00);
  EXPECT_EQ(F32ToF16(-kInf), 0xFC00);
  EXPECT_EQ(F32ToF16(kNaN) & 0x7C00, 0x7C00);
  EXPECT_NE(F32ToF16(kNaN) & 0x03FF, 0);

  EXPECT_EQ(F16ToF32(0x3C00), 1.0f);
  EXPECT_EQ(F16ToF32(0xC100), -2.5f);
  EXPECT_EQ(F16ToF32(0x7BFF), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0001), 0x1p-24f);
  EXPECT_EQ(F16ToF32(0x83FF), -0x3FFp-24f);
  EXPECT_TRUE(std::signbit(F16ToF32(0x8000)));
  EXPECT_EQ(F16ToF32(0xFC00), -kInf);
  EXPECT_TRUE(std::isnan(F16ToF32(0x7E00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7C01)));
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {  // every non-NaN half survives a round trip
    const auto h = static_cast<uint16_t>(bits);
    if ((h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0) continue;
    ASSERT_EQ(F32ToF16(F16ToF32(h)), h) << std::hex << bits;
  }
}

TEST_F(WeightsTest, Bf16ConvertsSpecialValues) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3F80);
  EXPECT_EQ(F32ToBf16(-2.5f), 0xC020);
  EXPECT_EQ(F32ToBf16(65504.0f), 0x4780);        // 8 mantissa bits: rounds to 65536
  EXPECT_EQ(F32ToBf16(0x1p-133f), 0x0001);       // smallest bf16 subnormal
  EXPECT_EQ(F32ToBf16(1.0f + 0x1p-8f), 0x3F80);  // tie to even
  EXPECT_EQ(F32ToBf16(1.0f + 0x3p-8f), 0x3F82);  // tie to even
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds past the top: inf
  EXPECT_EQ(F32ToBf16(kInf), 0x7F80);
  EXPECT_EQ(F32ToBf16(-kInf), 0xFF80);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(kNaN))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::bit_cast<float>(0x7F800001u)))));

  EXPECT_EQ(Bf16ToF32(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToF32(0xC020), -2.5f);
  EXPECT_EQ(Bf16ToF32(0x4780), 65536.0f);
  EXPECT_EQ(Bf16ToF32(0x0001), 0x1p-133f);
  EXPECT_EQ(Bf16ToF32(0xFF80), -kInf);
}

// ---- Save and load ---------------------------------------------------------------------------

TEST_F(WeightsTest, SaveLoadRoundTripsF32Exactly) {
  const ModelWeights original = SyntheticWeights(TestConfig(), 3);
  ASSERT_TRUE(SaveCheckpoint(original, dir_, "f32").ok());
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameWeights(original, *loaded);
  EXPECT_TRUE(loaded->lm_head.empty());
}

TEST_F(WeightsTest, SaveLoadRoundTripsUntiedLmHead) {
  const ModelWeights original = SyntheticWeights(TestConfig(false), 4);
  ASSERT_TRUE(SaveCheckpoint(original, dir_, "f32").ok());
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->lm_head.size(), 64u * 32u);
  ExpectSameWeights(original, *loaded);
}

TEST_F(WeightsTest, SaveLoadRoundTripsHalfPrecisionWithinRounding) {
  struct Case {
    const char* dtype;
    std::function<float(float)> round;
    double relative;  // half an ulp, relative
    double absolute;  // half the smallest subnormal
  };
  const std::vector<Case> cases = {
      {"f16", [](float x) { return F16ToF32(F32ToF16(x)); }, 0x1p-11, 0x1p-25},
      {"bf16", [](float x) { return Bf16ToF32(F32ToBf16(x)); }, 0x1p-8, 0x1p-134},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dtype);
    ModelWeights original = SyntheticWeights(TestConfig(false), 5);
    const std::vector<float> specials = {1.0f, -2.5f, 65504.0f, 1e-7f, kInf, -kInf, kNaN};
    std::copy(specials.begin(), specials.end(), original.final_norm.begin());
    ASSERT_TRUE(SaveCheckpoint(original, dir_, c.dtype).ok());
    const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->config, original.config);
    const auto want = NamedTensors(original), got = NamedTensors(*loaded);
    ASSERT_EQ(want.size(), got.size());
    for (size_t t = 0; t < want.size(); ++t) {
      const std::vector<float>& a = *want[t].second;
      const std::vector<float>& b = *got[t].second;
      ASSERT_EQ(a.size(), b.size()) << want[t].first;
      for (size_t i = 0; i < a.size(); ++i) {
        if (std::isnan(a[i])) {
          EXPECT_TRUE(std::isnan(b[i])) << want[t].first << "[" << i << "]";
          continue;
        }
        ASSERT_EQ(b[i], c.round(a[i])) << want[t].first << "[" << i << "]";
        if (std::isfinite(a[i]) && std::abs(a[i]) < 60000.0f) {
          ASSERT_LE(std::abs(b[i] - a[i]), std::max(std::abs(a[i]) * c.relative, c.absolute))
              << want[t].first << "[" << i << "]";
        }
      }
    }
    EXPECT_EQ(loaded->final_norm[0], 1.0f);
    EXPECT_EQ(loaded->final_norm[1], -2.5f);
    EXPECT_EQ(loaded->final_norm[4], kInf);
    EXPECT_EQ(loaded->final_norm[5], -kInf);
  }
}

TEST_F(WeightsTest, SavedFilesFollowTheHuggingFaceLayout) {
  const ModelWeights saved = SyntheticWeights(TestConfig(), 6);
  ASSERT_TRUE(SaveCheckpoint(saved, Path("sub/dir"), "bf16").ok());
  std::ifstream config_file(Path("sub/dir/config.json"));
  const std::string config((std::istreambuf_iterator<char>(config_file)), {});
  EXPECT_THAT(config, HasSubstr("\"LlamaForCausalLM\""));
  EXPECT_THAT(config, HasSubstr("\"model_type\": \"llama\""));
  EXPECT_THAT(config, HasSubstr("\"torch_dtype\": \"bfloat16\""));
  EXPECT_THAT(config, HasSubstr("\"rms_norm_eps\": 1e-05"));

  std::ifstream tensors_file(Path("sub/dir/model.safetensors"), std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(tensors_file)), {});
  ASSERT_GE(bytes.size(), 8u);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(header_len % 8, 0u);
  const std::string header = bytes.substr(8, header_len);
  EXPECT_EQ(header.front(), '{');
  EXPECT_THAT(header, HasSubstr("\"model.layers.1.mlp.down_proj.weight\""));
  EXPECT_THAT(header, HasSubstr("\"dtype\":\"BF16\""));
  EXPECT_EQ(header.find("lm_head"), std::string::npos);  // tied
  int64_t params = 0;
  for (const auto& [name, data] : NamedTensors(saved)) {
    params += static_cast<int64_t>(data->size());
  }
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), 8 + static_cast<int64_t>(header_len) + 2 * params);
}

TEST_F(WeightsTest, SaveRejectsUnknownDtypeAndMisSizedTensors) {
  ModelWeights weights = SyntheticWeights(TestConfig(), 1);
  EXPECT_EQ(SaveCheckpoint(weights, dir_, "f64").code(), absl::StatusCode::kInvalidArgument);
  weights.layers[1].wk.pop_back();
  const absl::Status status = SaveCheckpoint(weights, dir_, "f32");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("model.layers.1.self_attn.k_proj.weight"));
}

TEST_F(WeightsTest, SaveReportsIoErrorsAsInternal) {
  WriteFile("plain_file", "x");
  const absl::Status status =
      SaveCheckpoint(SyntheticWeights(TestConfig(), 1), Path("plain_file/ckpt"), "f32");
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(), HasSubstr("plain_file"));
}

}  // namespace
}  // namespace kvpool::model
