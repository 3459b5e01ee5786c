#include "tests/model/weights_test_util.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"

namespace kvpool::model::test_util {

// Small enough that every test runs in milliseconds, with GQA (4 query / 2 KV heads).
ModelConfig TestConfig(bool tied) {
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

void AppendMambaTensors(const std::string& prefix, const LayerWeights& L, const ModelConfig& c,
                        std::vector<RawTensor>* out) {
  const SsmConfig& m = c.ssm;
  const int64_t h = c.hidden_size;
  const auto add = [&](const std::string& name, std::vector<int64_t> shape,
                       const std::vector<float>& v) {
    out->push_back({prefix + name, "F32", std::move(shape), F32Bytes(v)});
  };
  add("in_proj.weight", {m.in_proj_dim(), h}, L.ssm_in);
  add("conv1d.weight", {m.conv_dim(), 1, m.conv_width}, L.ssm_conv);
  if (m.conv_bias) add("conv1d.bias", {m.conv_dim()}, L.ssm_conv_bias);
  if (m.proj_bias) {
    add("in_proj.bias", {m.in_proj_dim()}, L.ssm_in_bias);
    add("out_proj.bias", {h}, L.ssm_out_bias);
  }
  add("dt_bias", {m.num_heads}, L.ssm_dt_bias);
  add("A_log", {m.num_heads}, L.ssm_a_log);
  add("D", {m.num_heads}, L.ssm_d);
  if (m.gated_norm) add("norm.weight", {m.inner()}, L.ssm_norm);
  add("out_proj.weight", {h, m.inner()}, L.ssm_out);
}

void WeightsTest::SetUp() {
  std::string pattern = ::testing::TempDir() + "weights_test.XXXXXX";
  ASSERT_NE(mkdtemp(pattern.data()), nullptr) << pattern;
  dir_ = pattern;
}

void WeightsTest::TearDown() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

void WeightsTest::WriteFile(const std::string& name, const std::string& bytes) const {
  std::ofstream out(Path(name), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << Path(name);
}

void WeightsTest::WriteCheckpoint(const ModelConfig& config,
                                  const std::vector<RawTensor>& tensors) const {
  WriteFile("config.json", ConfigText(config));
  WriteFile("model.safetensors", SafetensorsBytes(tensors));
}

void WeightsTest::ExpectInvalid(const std::vector<std::string>& parts) const {
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << loaded.status();
  for (const std::string& part : parts) {
    EXPECT_THAT(loaded.status().message(), ::testing::HasSubstr(part));
  }
}

}  // namespace kvpool::model::test_util
