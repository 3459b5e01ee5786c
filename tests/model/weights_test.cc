#include "model/weights.h"

#include <stdlib.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/internal/safetensors.h"

namespace kvpool::model {
namespace {

using internal::Bf16ToF32;
using internal::F16ToF32;
using internal::F32ToBf16;
using internal::F32ToF16;
using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Small enough that every test runs in milliseconds, with GQA (4 query / 2 KV heads).
ModelConfig TestConfig(bool tied = true) {
  return ModelConfig{.vocab_size = 64,
                     .hidden_size = 32,
                     .intermediate_size = 48,
                     .num_layers = 2,
                     .num_heads = 4,
                     .num_kv_heads = 2,
                     .head_dim = 8,
                     .rms_norm_eps = 1e-5f,
                     .rope_theta = 10000.0f,
                     .tie_word_embeddings = tied,
                     .max_position = 128};
}

// Every tensor with its transformers name, spelled out here independently of weights.cc.
std::vector<std::pair<std::string, const std::vector<float>*>> NamedTensors(const ModelWeights& w) {
  std::vector<std::pair<std::string, const std::vector<float>*>> out = {
      {"model.embed_tokens.weight", &w.embed}, {"model.norm.weight", &w.final_norm}};
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    out.insert(out.end(), {{p + "input_layernorm.weight", &l.attn_norm},
                           {p + "self_attn.q_proj.weight", &l.wq},
                           {p + "self_attn.k_proj.weight", &l.wk},
                           {p + "self_attn.v_proj.weight", &l.wv},
                           {p + "self_attn.o_proj.weight", &l.wo},
                           {p + "post_attention_layernorm.weight", &l.mlp_norm},
                           {p + "mlp.gate_proj.weight", &l.w_gate},
                           {p + "mlp.up_proj.weight", &l.w_up},
                           {p + "mlp.down_proj.weight", &l.w_down}});
  }
  if (!w.lm_head.empty()) out.emplace_back("lm_head.weight", &w.lm_head);
  return out;
}

std::vector<int64_t> ShapeOf(const ModelConfig& c, const std::string& name) {
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  if (name.find("norm") != std::string::npos) return {h};
  if (name.find("embed") != std::string::npos || name == "lm_head.weight") {
    return {c.vocab_size, h};
  }
  if (name.find("q_proj") != std::string::npos) return {q, h};
  if (name.find("k_proj") != std::string::npos || name.find("v_proj") != std::string::npos) {
    return {kv, h};
  }
  if (name.find("o_proj") != std::string::npos) return {h, q};
  if (name.find("down_proj") != std::string::npos) return {h, c.intermediate_size};
  return {c.intermediate_size, h};  // gate_proj, up_proj
}

// One tensor of a hand-made safetensors file.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string F32Bytes(const std::vector<float>& values) {
  std::string bytes(values.size() * sizeof(float), '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::string U16Bytes(const std::vector<uint16_t>& values) {
  std::string bytes;
  for (uint16_t v : values) {
    bytes.push_back(static_cast<char>(v & 0xFF));
    bytes.push_back(static_cast<char>(v >> 8));
  }
  return bytes;
}

std::vector<RawTensor> RawTensorsOf(const ModelWeights& w) {
  std::vector<RawTensor> out;
  for (const auto& [name, data] : NamedTensors(w)) {
    out.push_back({name, "F32", ShapeOf(w.config, name), F32Bytes(*data)});
  }
  return out;
}

RawTensor& Find(std::vector<RawTensor>& tensors, const std::string& name) {
  for (RawTensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors.front();
}

// 8-byte little-endian header length, header, data.
std::string FileBytes(const std::string& header, const std::string& data) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xFF));
  return out + header + data;
}

// Lays the tensors out back to back in the order given, header JSON written by hand.
std::string SafetensorsBytes(const std::vector<RawTensor>& tensors) {
  std::vector<std::string> entries;
  std::string data;
  for (const RawTensor& t : tensors) {
    entries.push_back(absl::StrCat("\"", t.name, "\":{\"dtype\":\"", t.dtype, "\",\"shape\":[",
                                   absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", data.size(),
                                   ",", data.size() + t.bytes.size(), "]}"));
    data += t.bytes;
  }
  return FileBytes(
      absl::StrCat("{\"__metadata__\":{\"format\":\"pt\"},", absl::StrJoin(entries, ","), "}"),
      data);
}

std::string ConfigText(const ModelConfig& c) {
  return absl::StrCat(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",)",
                      R"("vocab_size": )", c.vocab_size, R"(, "hidden_size": )", c.hidden_size,
                      R"(, "intermediate_size": )", c.intermediate_size,
                      R"(, "num_hidden_layers": )", c.num_layers, R"(, "num_attention_heads": )",
                      c.num_heads, R"(, "num_key_value_heads": )", c.num_kv_heads,
                      R"(, "head_dim": )", c.head_dim, R"(, "rms_norm_eps": )", c.rms_norm_eps,
                      R"(, "rope_theta": )", c.rope_theta, R"(, "tie_word_embeddings": )",
                      c.tie_word_embeddings ? "true" : "false", R"(, "max_position_embeddings": )",
                      c.max_position, "}");
}

void ExpectSameWeights(const ModelWeights& a, const ModelWeights& b) {
  EXPECT_EQ(a.config, b.config);
  const auto ta = NamedTensors(a), tb = NamedTensors(b);
  ASSERT_EQ(ta.size(), tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    EXPECT_EQ(ta[i].first, tb[i].first);
    EXPECT_TRUE(*ta[i].second == *tb[i].second) << ta[i].first << " differs";
  }
}

struct Stats {
  double mean = 0, stddev = 0, within_one_sigma = 0, max_abs = 0;
};

Stats StatsOf(const std::vector<float>& v) {
  Stats s;
  for (float x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  for (float x : v) s.stddev += (x - s.mean) * (x - s.mean);
  s.stddev = std::sqrt(s.stddev / static_cast<double>(v.size()));
  for (float x : v) {
    s.within_one_sigma += std::abs(x - s.mean) < s.stddev ? 1 : 0;
    s.max_abs = std::max(s.max_abs, static_cast<double>(std::abs(x)));
  }
  s.within_one_sigma /= static_cast<double>(v.size());
  return s;
}

class WeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "weights_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << pattern;
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  void WriteFile(const std::string& name, const std::string& bytes) const {
    std::ofstream out(Path(name), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << Path(name);
  }

  // config.json for `config` plus one model.safetensors holding `tensors`.
  void WriteCheckpoint(const ModelConfig& config, const std::vector<RawTensor>& tensors) const {
    WriteFile("config.json", ConfigText(config));
    WriteFile("model.safetensors", SafetensorsBytes(tensors));
  }

  // Loads dir_ and expects INVALID_ARGUMENT whose message holds every one of `parts`.
  void ExpectInvalid(const std::vector<std::string>& parts) const {
    const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
    ASSERT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << loaded.status();
    for (const std::string& part : parts) {
      EXPECT_THAT(loaded.status().message(), HasSubstr(part));
    }
  }

  std::string dir_;
};

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

// ---- Hand-made checkpoints ------------------------------------------------------------------

TEST_F(WeightsTest, LoadsTensorsSplitAcrossTwoFiles) {
  const ModelWeights original = SyntheticWeights(TestConfig(false), 9);
  std::vector<RawTensor> tensors = RawTensorsOf(original);
  const std::vector<RawTensor> first(tensors.begin(), tensors.begin() + 7);
  const std::vector<RawTensor> second(tensors.begin() + 7, tensors.end());
  WriteFile("config.json", ConfigText(original.config));
  WriteFile("model-00001-of-00002.safetensors", SafetensorsBytes(first));
  WriteFile("model-00002-of-00002.safetensors", SafetensorsBytes(second));
  WriteFile("model.safetensors.index.json", "{}");  // not a *.safetensors file: ignored
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameWeights(original, *loaded);
}

TEST_F(WeightsTest, LoadsF16AndBf16TensorsBitExactly) {
  const ModelWeights original = SyntheticWeights(TestConfig(), 2);
  std::vector<RawTensor> tensors = RawTensorsOf(original);
  std::vector<uint16_t> f16(32, 0), bf16(32, 0);
  const std::vector<uint16_t> f16_head = {0x3C00, 0xC100, 0x7BFF, 0x0001, 0x7C00, 0x7E00};
  const std::vector<uint16_t> bf16_head = {0x3F80, 0xC020, 0x0001, 0xFF80, 0x7FC0};
  std::copy(f16_head.begin(), f16_head.end(), f16.begin());
  std::copy(bf16_head.begin(), bf16_head.end(), bf16.begin());
  Find(tensors, "model.norm.weight") = {"model.norm.weight", "F16", {32}, U16Bytes(f16)};
  Find(tensors, "model.layers.0.input_layernorm.weight") = {
      "model.layers.0.input_layernorm.weight", "BF16", {32}, U16Bytes(bf16)};
  WriteCheckpoint(original.config, tensors);
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::vector<float>& norm = loaded->final_norm;
  EXPECT_EQ(norm[0], 1.0f);
  EXPECT_EQ(norm[1], -2.5f);
  EXPECT_EQ(norm[2], 65504.0f);
  EXPECT_EQ(norm[3], 0x1p-24f);
  EXPECT_EQ(norm[4], kInf);
  EXPECT_TRUE(std::isnan(norm[5]));
  const std::vector<float>& attn = loaded->layers[0].attn_norm;
  EXPECT_EQ(attn[0], 1.0f);
  EXPECT_EQ(attn[1], -2.5f);
  EXPECT_EQ(attn[2], 0x1p-133f);
  EXPECT_EQ(attn[3], -kInf);
  EXPECT_TRUE(std::isnan(attn[4]));
  EXPECT_EQ(loaded->layers[1].wq, original.layers[1].wq);
}

TEST_F(WeightsTest, TiedCheckpointIgnoresLmHeadTensor) {
  const ModelWeights untied = SyntheticWeights(TestConfig(false), 1);
  WriteCheckpoint(TestConfig(true), RawTensorsOf(untied));
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->lm_head.empty());
  EXPECT_EQ(loaded->embed, untied.embed);
}

TEST_F(WeightsTest, DefaultsHeadDimAndKvHeadsFromConfig) {
  ModelConfig config = TestConfig();
  config.num_kv_heads = config.num_heads;
  std::string text = ConfigText(config);
  for (const char* key : {R"(, "head_dim": 8)", R"(, "num_key_value_heads": 4)"}) {
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << key;
    text.erase(at, std::strlen(key));
  }
  WriteFile("config.json", text);
  WriteFile("model.safetensors", SafetensorsBytes(RawTensorsOf(SyntheticWeights(config, 1))));
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->config, config);
}

TEST_F(WeightsTest, ReadCheckpointConfigReadsOnlyConfigJson) {
  EXPECT_EQ(ReadCheckpointConfig(dir_).status().code(), absl::StatusCode::kNotFound);
  WriteFile("config.json", ConfigText(TestConfig(false)));
  const absl::StatusOr<ModelConfig> config = ReadCheckpointConfig(dir_);  // no tensors needed
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config, TestConfig(false));
}

TEST_F(WeightsTest, MissingDirectoryConfigOrTensorsIsNotFound) {
  EXPECT_EQ(LoadCheckpoint(Path("absent")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadCheckpoint(dir_).status().code(), absl::StatusCode::kNotFound);  // empty
  WriteFile("model.safetensors", SafetensorsBytes(RawTensorsOf(SyntheticWeights(TestConfig(), 1))));
  const absl::Status no_config = LoadCheckpoint(dir_).status();
  EXPECT_EQ(no_config.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_config.message(), HasSubstr("config.json"));
  std::filesystem::remove(Path("model.safetensors"));
  WriteFile("config.json", ConfigText(TestConfig()));
  const absl::Status no_tensors = LoadCheckpoint(dir_).status();
  EXPECT_EQ(no_tensors.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_tensors.message(), HasSubstr("safetensors"));
}

TEST_F(WeightsTest, RejectsMalformedConfigJson) {
  const std::string tensors = SafetensorsBytes(RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  WriteFile("model.safetensors", tensors);
  WriteFile("config.json", "{\"vocab_size\": 64,");
  ExpectInvalid({"config.json"});
  std::string text = ConfigText(TestConfig());
  text.replace(text.find("\"hidden_size\""), 13, "\"hidden_sizes\"");
  WriteFile("config.json", text);
  ExpectInvalid({"config.json", "hidden_size"});
  WriteFile("config.json", ConfigText(TestConfig()).replace(1, 0, "\"rope_scaling\": {}, "));
  ExpectInvalid({"rope_scaling"});
  ModelConfig bad = TestConfig();
  bad.num_kv_heads = 3;
  WriteFile("config.json", ConfigText(bad));
  ExpectInvalid({"config.json", "num_kv_heads"});
  WriteFile("config.json", R"({"vocab_size": "64"})");
  ExpectInvalid({"vocab_size"});
  text = ConfigText(TestConfig());
  const std::string theta = R"("rope_theta": 10000)";
  ASSERT_NE(text.find(theta), std::string::npos);
  WriteFile("config.json", text.replace(text.find(theta), theta.size(), R"("rope_theta": 1e300)"));
  ExpectInvalid({"rope_theta", "out of range"});
}

TEST_F(WeightsTest, RejectsWrongShape) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  Find(tensors, "model.layers.1.mlp.up_proj.weight").shape = {32, 48};  // transposed
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({"model.layers.1.mlp.up_proj.weight", "[32, 48]", "[48, 32]"});
}

TEST_F(WeightsTest, RejectsUnsupportedDtype) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  RawTensor& norm = Find(tensors, "model.norm.weight");
  norm.dtype = "I64";
  norm.bytes = std::string(32 * 8, '\0');
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({"model.norm.weight", "I64", "model.safetensors"});
}

TEST_F(WeightsTest, RejectsUnknownDtype) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  Find(tensors, "model.norm.weight").dtype = "F12";
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({"model.norm.weight", "F12"});
}

TEST_F(WeightsTest, RejectsTruncatedFile) {
  WriteCheckpoint(TestConfig(), RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  const std::string path = Path("model.safetensors");
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 5);
  ExpectInvalid({"model.safetensors", "truncated"});
  std::filesystem::resize_file(path, 5);  // not even the header length
  ExpectInvalid({"model.safetensors"});
  std::filesystem::resize_file(path, 0);
  ExpectInvalid({"model.safetensors"});
}

TEST_F(WeightsTest, RejectsHeaderLongerThanFile) {
  WriteFile("config.json", ConfigText(TestConfig()));
  std::string bytes = FileBytes("{}", "");
  bytes[0] = 100;  // claims a 100-byte header in a 10-byte file
  WriteFile("model.safetensors", bytes);
  ExpectInvalid({"model.safetensors", "header length 100"});
  bytes[0] = 0;
  bytes[7] = static_cast<char>(0x80);  // 2^63
  WriteFile("model.safetensors", bytes);
  ExpectInvalid({"model.safetensors", "header length"});
}

TEST_F(WeightsTest, RejectsOffsetsOutOfBounds) {
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("model.safetensors", FileBytes(R"({"model.norm.weight":{"dtype":"F32","shape":[32],)"
                                           R"("data_offsets":[64,192]}})",
                                           std::string(128, '\0')));
  ExpectInvalid({"model.norm.weight", "[64, 192]"});
}

TEST_F(WeightsTest, RejectsOffsetsThatDisagreeWithShape) {
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("model.safetensors", FileBytes(R"({"model.norm.weight":{"dtype":"F32","shape":[32],)"
                                           R"("data_offsets":[0,64]}})",
                                           std::string(128, '\0')));
  ExpectInvalid({"model.norm.weight", "64 bytes"});
}

TEST_F(WeightsTest, RejectsOverlappingTensors) {
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("model.safetensors",
            FileBytes(R"({"a":{"dtype":"F32","shape":[16],"data_offsets":[0,64]},)"
                      R"("b":{"dtype":"F16","shape":[16],"data_offsets":[32,64]}})",
                      std::string(64, '\0')));
  ExpectInvalid({"overlap"});
}

TEST_F(WeightsTest, RejectsBadHeaderJson) {
  WriteFile("config.json", ConfigText(TestConfig()));
  for (const std::string header :
       {"{\"model.norm.weight\": {", "[1, 2]", "{\"x\": {\"dtype\": \"F32\"}}",
        "{\"x\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 0]}}",
        "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}"}) {
    SCOPED_TRACE(header);
    WriteFile("model.safetensors", FileBytes(header, std::string(16, '\0')));
    ExpectInvalid({"model.safetensors"});
  }
}

TEST_F(WeightsTest, RejectsMissingTensor) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  tensors.erase(tensors.begin() + 5);
  const std::string missing = NamedTensors(SyntheticWeights(TestConfig(), 1))[5].first;
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({missing});
}

TEST_F(WeightsTest, RejectsUntiedCheckpointWithoutLmHead) {
  WriteCheckpoint(TestConfig(false), RawTensorsOf(SyntheticWeights(TestConfig(true), 1)));
  ExpectInvalid({"lm_head.weight"});
}

TEST_F(WeightsTest, RejectsTensorInTwoFiles) {
  const std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("a.safetensors", SafetensorsBytes(tensors));
  WriteFile("b.safetensors", SafetensorsBytes({tensors[3]}));
  ExpectInvalid({tensors[3].name, "a.safetensors", "b.safetensors"});
}

TEST_F(WeightsTest, IgnoresDanglingSafetensorsLink) {
  WriteCheckpoint(TestConfig(), RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  std::filesystem::create_symlink(Path("absent"), Path("broken.safetensors"));
  EXPECT_TRUE(LoadCheckpoint(dir_).ok());
}

// Seeded random corruption of a valid file: every outcome is a load or INVALID_ARGUMENT, never a
// crash or an out-of-bounds read (run under ASan to see the latter).
TEST_F(WeightsTest, CorruptedFilesNeverCrash) {
  WriteFile("config.json", ConfigText(TestConfig()));
  const std::string valid = SafetensorsBytes(RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  const size_t header_end = 8 + 1024;  // the header and a little data: where corruption bites
  std::mt19937 rng(12345);
  int loaded = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = valid;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      bytes[rng() % std::min(header_end, bytes.size())] = static_cast<char>(rng() & 0xFF);
    }
    if (trial % 10 == 0) bytes.resize(rng() % bytes.size());
    WriteFile("model.safetensors", bytes);
    const absl::StatusOr<ModelWeights> result = LoadCheckpoint(dir_);
    if (result.ok()) {
      ++loaded;
    } else {
      ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
    }
  }
  EXPECT_LT(loaded, 300);
}

}  // namespace
}  // namespace kvpool::model
