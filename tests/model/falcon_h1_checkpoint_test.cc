// Falcon-H1 checkpoints (issue 28): every layer runs attention and a Mamba-2 mixer side by side
// on one norm, and muP multipliers scale the embeddings, the logits, each branch's input and
// output, the keys, the mixer's in_proj outputs per part and the MLP. A checkpoint in exactly the
// layout transformers' FalconH1ForCausalLM writes (config.json with FalconH1Config's fields at
// Falcon-H1-0.5B's multipliers; tensors under self_attn.*, mamba.*, feed_forward.*,
// pre_ff_layernorm, final_layernorm) loads, with the multipliers folded into the weights, and
// the host model computes what the dense reference computes from the unfolded weights with the
// multipliers applied where transformers applies them. The variants (the mixer's gated norm, two
// B/C groups, projection biases, a tied head) the same way; what the model cannot run is refused
// with INVALID_ARGUMENT naming the field.

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/local_engine.h"
#include "tests/model/dense_reference.h"
#include "tests/model/weights_test_util.h"

namespace kvpool::model {
namespace {

using test_util::F32Bytes;
using test_util::RawTensor;

const LayerKind kP = LayerKind::kParallelHybrid;

// Falcon-H1-0.5B's multipliers (its config.json).
ReferenceMultipliers Falcon05bMultipliers() {
  return {.embedding = 5.656854249492381,
          .lm_head = 0.0390625,
          .attention_in = 1.0,
          .key = 0.39062499999999994,
          .attention_out = 0.9375,
          .ssm_in = 1.25,
          .ssm = {0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738},
          .ssm_out = 0.23570226039551587,
          .mlp_gate = 0.8838834764831844,
          .mlp_down = 0.5859375};
}

// Field for field the shape of tiiuae/Falcon-H1-0.5B's config.json, at tiny sizes: 3 layers,
// 4 query / 2 KV heads of 32 (head_dim is not hidden_size / heads, as in Falcon-H1-0.5B), RoPE
// at theta 1e11, a mixer of 4 heads of 24 (mamba_d_ssm 96, not mamba_expand * hidden_size),
// d_state 16, one group, no gated norm. `extra` goes in before the last field.
std::string FalconH1ConfigJson(const std::string& extra = "") {
  return absl::StrCat(R"({
  "architectures": ["FalconH1ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attention_in_multiplier": 1.0,
  "attention_out_multiplier": 0.9375,
  "bos_token_id": 1,
  "embedding_multiplier": 5.656854249492381,
  "eos_token_id": 11,
  "head_dim": 32,
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 96,
  "key_multiplier": 0.39062499999999994,
  "lm_head_multiplier": 0.0390625,
  "mamba_chunk_size": 128,
  "mamba_conv_bias": true,
  "mamba_d_conv": 4,
  "mamba_d_head": 24,
  "mamba_d_ssm": 96,
  "mamba_d_state": 16,
  "mamba_expand": 2,
  "mamba_n_groups": 1,
  "mamba_n_heads": 4,
  "mamba_norm_before_gate": false,
  "mamba_proj_bias": false,
  "mamba_rms_norm": false,
  "mamba_use_mlp": true,
  "max_position_embeddings": 16384,
  "mlp_bias": false,
  "mlp_expansion_factor": 8,
  "mlp_multipliers": [0.8838834764831844, 0.5859375],
  "model_type": "falcon_h1",
  "num_attention_heads": 4,
  "num_hidden_layers": 3,
  "num_key_value_heads": 2,
  "num_logits_to_keep": 1,
  "pad_token_id": 0,
  "projectors_bias": false,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 100000000000.0,
  "ssm_in_multiplier": 1.25,
  "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
  "ssm_out_multiplier": 0.23570226039551587,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.52.0",
  "use_cache": true,
)",
                      extra, R"(
  "vocab_size": 256
})");
}

// What FalconH1ConfigJson describes, spelled out independently of the loader.
ModelConfig FalconH1TestConfig() {
  return {.vocab_size = 256,
          .hidden_size = 64,
          .intermediate_size = 96,
          .num_layers = 3,
          .num_heads = 4,
          .num_kv_heads = 2,
          .head_dim = 32,
          .rms_norm_eps = 1e-5f,
          .rope_theta = 1e11f,
          .tie_word_embeddings = false,
          .max_position = 16384,
          .layer_kinds = {kP, kP, kP},
          .ssm = {.num_heads = 4,
                  .head_dim = 24,
                  .d_state = 16,
                  .num_groups = 1,
                  .conv_width = 4,
                  .conv_bias = true,
                  .proj_bias = false,
                  .gated_norm = false}};
}

// Replaces the one occurrence of `from` in `text` by `to`.
std::string Edit(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

// Every tensor of `w` under the name FalconH1ForCausalLM's state dict gives it.
std::vector<RawTensor> FalconH1Tensors(const ModelWeights& w) {
  const ModelConfig& c = w.config;
  const int64_t h = c.hidden_size, im = c.intermediate_size, q = c.num_heads * c.head_dim,
                kv = c.num_kv_heads * c.head_dim;
  std::vector<RawTensor> out;
  const auto add = [&out](std::string name, std::vector<int64_t> shape,
                          const std::vector<float>& v) {
    out.push_back({std::move(name), "F32", std::move(shape), F32Bytes(v)});
  };
  add("model.embed_tokens.weight", {c.vocab_size, h}, w.embed);
  add("model.final_layernorm.weight", {h}, w.final_norm);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h}, w.lm_head);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& L = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {h}, L.attn_norm);
    add(p + "pre_ff_layernorm.weight", {h}, L.mlp_norm);
    add(p + "feed_forward.gate_proj.weight", {im, h}, L.w_gate);
    add(p + "feed_forward.up_proj.weight", {im, h}, L.w_up);
    add(p + "feed_forward.down_proj.weight", {h, im}, L.w_down);
    add(p + "self_attn.q_proj.weight", {q, h}, L.wq);
    add(p + "self_attn.k_proj.weight", {kv, h}, L.wk);
    add(p + "self_attn.v_proj.weight", {kv, h}, L.wv);
    add(p + "self_attn.o_proj.weight", {h, q}, L.wo);
    test_util::AppendMambaTensors(p + "mamba.", L, c, &out);
  }
  return out;
}

// Synthetic weights whose norm weights are not all 1 (a norm weight the loader dropped or
// mixed up would show).
ModelWeights TestWeights(const ModelConfig& c, uint64_t seed) {
  ModelWeights w = SyntheticWeights(c, seed);
  float f = 0.5f;
  const auto vary = [&f](std::vector<float>& v) {
    for (float& x : v) x = (f += 0.013f) > 1.5f ? (f = 0.5f) : f;
  };
  vary(w.final_norm);
  for (LayerWeights& L : w.layers) {
    vary(L.attn_norm);
    vary(L.mlp_norm);
    vary(L.ssm_norm);
  }
  return w;
}

// The loaded (folded) model through the host engine against the dense reference on the raw
// weights with `mult` applied as transformers applies them: prefill, then decodes, f32 K/V;
// the states too (the mixer's conv inputs are in_proj's outputs, multipliers included).
void ExpectMatchesTransformers(const ModelWeights& loaded, const ModelWeights& raw,
                               const ReferenceMultipliers& mult) {
  DenseReference ref(raw, kernels::DType::kF32, mult);
  ExpectEngineFollowsReference(loaded, ref, kernels::DType::kF32, 29, 5, 6, 2e-3);
}

class FalconH1CheckpointTest : public test_util::WeightsTest {
 protected:
  void WriteFalcon(const ModelWeights& w, const std::string& config_json) {
    WriteFile("config.json", config_json);
    WriteFile("model.safetensors", test_util::SafetensorsBytes(FalconH1Tensors(w)));
  }
};

TEST_F(FalconH1CheckpointTest, LoadsFalconH1sLayoutAndComputesWhatTransformersDoes) {
  const ModelWeights raw = TestWeights(FalconH1TestConfig(), 21);
  WriteFalcon(raw, FalconH1ConfigJson());
  absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->config, raw.config);
  // The multipliers are in the weights: k_proj carries attention_in x key, in_proj's x rows
  // ssm_in x ssm_multipliers[1], down_proj mlp_multipliers[1].
  const ReferenceMultipliers mult = Falcon05bMultipliers();
  EXPECT_FLOAT_EQ(loaded->layers[1].wk[7], static_cast<float>(raw.layers[1].wk[7] * mult.key));
  const size_t x_row = static_cast<size_t>(raw.config.ssm.inner()) * 64;
  EXPECT_FLOAT_EQ(loaded->layers[2].ssm_in[x_row + 3],
                  static_cast<float>(raw.layers[2].ssm_in[x_row + 3] * mult.ssm_in * mult.ssm[1]));
  EXPECT_FLOAT_EQ(loaded->layers[0].w_down[5],
                  static_cast<float>(raw.layers[0].w_down[5] * mult.mlp_down));
  EXPECT_EQ(loaded->layers[0].ssm_a_log, raw.layers[0].ssm_a_log);  // not scaled
  ExpectMatchesTransformers(*loaded, raw, mult);
  // Without the multipliers it is another model: the test tells them apart.
  auto engine = MakeTestEngine(*loaded, 16, kernels::DType::kF32, false);
  DenseReference plain(raw, kernels::DType::kF32);
  const std::vector<int32_t> prompt = RandomTokens(9, 256, 2);
  auto got = engine->Prefill(SequenceId(0), prompt, {.keep_logits = true});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(RelError(got->result.logits, plain.Extend(prompt)), 1e-2);
}

// Falcon-H1-1.5B-Deep's and 7B's variant: the mixer's gated norm (mamba_rms_norm, gate first),
// here with two B/C groups (as Falcon-H1-34B) and projection biases; and a tied head whose
// multiplier differs from the embeddings' (the loader unties it).
TEST_F(FalconH1CheckpointTest, GatedNormGroupsBiasesAndATiedHead) {
  ModelConfig c = FalconH1TestConfig();
  c.ssm.gated_norm = true;
  c.ssm.num_groups = 2;
  c.ssm.proj_bias = true;
  c.tie_word_embeddings = true;
  const ModelWeights raw = TestWeights(c, 8);
  std::string text =
      Edit(FalconH1ConfigJson(), R"("mamba_rms_norm": false)", R"("mamba_rms_norm": true)");
  text = Edit(text, R"("mamba_n_groups": 1)", R"("mamba_n_groups": 2)");
  text = Edit(text, R"("mamba_proj_bias": false)", R"("mamba_proj_bias": true)");
  text = Edit(text, R"("projectors_bias": false)", R"("projectors_bias": true)");
  text = Edit(text, R"("tie_word_embeddings": false)", R"("tie_word_embeddings": true)");
  WriteFalcon(raw, text);
  absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ModelConfig untied = c;
  untied.tie_word_embeddings = false;
  EXPECT_EQ(loaded->config, untied);
  EXPECT_EQ(loaded->lm_head.size(), raw.embed.size());
  ExpectMatchesTransformers(*loaded, raw, Falcon05bMultipliers());
  // Tied with equal multipliers: stays tied, one matrix.
  text = Edit(text, R"("lm_head_multiplier": 0.0390625)",
              R"("lm_head_multiplier": 5.656854249492381)");
  WriteFalcon(raw, text);
  loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->config.tie_word_embeddings);
  ReferenceMultipliers same = Falcon05bMultipliers();
  same.lm_head = same.embedding;
  ExpectMatchesTransformers(*loaded, raw, same);
}

// FalconH1Config's defaults: mamba_d_ssm 1024 when absent and mamba_expand * hidden_size when
// null, mamba_d_head "auto" from it, no gated norm, every multiplier 1; transformers 5's
// rope_parameters.
TEST_F(FalconH1CheckpointTest, ReadsFalconH1sDefaults) {
  const auto read = [&](const std::string& text) {
    WriteFile("config.json", text);
    return ReadCheckpointConfig(dir_);
  };
  std::string text = Edit(FalconH1ConfigJson(), R"("mamba_d_head": 24,)", "");
  text = Edit(text, R"("mamba_d_ssm": 96,)", "");
  text = Edit(text, R"("mamba_rms_norm": false,)", "");
  text = Edit(text, R"("mamba_n_heads": 4,)", R"("mamba_n_heads": 16,)");
  absl::StatusOr<ModelConfig> c = read(text);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ssm.inner(), 1024);
  EXPECT_EQ(c->ssm.head_dim, 64);
  EXPECT_FALSE(c->ssm.gated_norm);
  c = read(Edit(text, R"("mamba_expand": 2,)", R"("mamba_expand": 2, "mamba_d_ssm": null,)"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ssm.inner(), 128);  // 2 x 64
  EXPECT_EQ(c->ssm.head_dim, 8);
  c = read(Edit(FalconH1ConfigJson(), R"("rope_theta": 100000000000.0,)",
                R"("rope_parameters": {"rope_type": "default", "rope_theta": 2500000.0},)"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 2500000.0f);
}

TEST_F(FalconH1CheckpointTest, RefusesWhatItCannotRunNamingTheField) {
  const ModelWeights raw = TestWeights(FalconH1TestConfig(), 3);
  const auto expect_refused = [&](const std::string& text, std::vector<std::string> parts) {
    WriteFalcon(raw, text);
    ExpectInvalid(parts);
  };
  const std::string base = FalconH1ConfigJson();
  // Norm before the gate (FalconH1Config's default) is not what the mixer computes.
  expect_refused(Edit(Edit(base, R"("mamba_rms_norm": false)", R"("mamba_rms_norm": true)"),
                      R"("mamba_norm_before_gate": false,)", ""),
                 {"config.json", "mamba_norm_before_gate"});
  expect_refused(Edit(base, R"("projectors_bias": false)", R"("projectors_bias": true)"),
                 {"projectors_bias", "mamba_proj_bias"});
  expect_refused(Edit(base, R"("mamba_d_ssm": 96)", R"("mamba_d_ssm": 100)"),
                 {"mamba_d_ssm", "mamba_d_head"});
  expect_refused(Edit(base, R"("mlp_multipliers": [0.8838834764831844, 0.5859375])",
                      R"("mlp_multipliers": [0.88])"),
                 {"mlp_multipliers", "2 numbers"});
  expect_refused(Edit(base, R"("ssm_in_multiplier": 1.25)", R"("ssm_in_multiplier": "1.25")"),
                 {"ssm_in_multiplier"});
  expect_refused(Edit(base, R"("attention_bias": false)", R"("attention_bias": true)"),
                 {"attention_bias"});
  expect_refused(Edit(base, R"("rope_scaling": null,)",
                      R"("rope_parameters": {"rope_type": "yarn", "factor": 4.0},)"),
                 {"rope_parameters.rope_type", "yarn"});
  // A tensor of Falcon-H1's layout missing: named.
  std::vector<RawTensor> tensors = FalconH1Tensors(raw);
  std::erase_if(tensors,
                [](const RawTensor& t) { return t.name == "model.layers.2.mamba.conv1d.weight"; });
  WriteFile("config.json", base);
  WriteFile("model.safetensors", test_util::SafetensorsBytes(tensors));
  ExpectInvalid({"model.layers.2.mamba.conv1d.weight"});
}

// SaveCheckpoint writes a model of parallel hybrid layers in Falcon-H1's layout, every
// multiplier 1 (the loaded weights carry them), and it loads back unchanged and serves alike.
TEST_F(FalconH1CheckpointTest, ASavedModelLoadsBackUnchanged) {
  const ModelWeights raw = TestWeights(FalconH1TestConfig(), 11);
  WriteFalcon(raw, FalconH1ConfigJson());
  absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(SaveCheckpoint(*loaded, Path("saved"), "f32").ok());
  absl::StatusOr<ModelWeights> back = LoadCheckpoint(Path("saved"));
  ASSERT_TRUE(back.ok()) << back.status();
  test_util::ExpectSameWeights(*back, *loaded);
  for (size_t l = 0; l < back->layers.size(); ++l) {
    const LayerWeights &x = back->layers[l], &y = loaded->layers[l];
    for (const auto& [p, q] : {std::pair(&x.ssm_in, &y.ssm_in),
                               {&x.ssm_conv, &y.ssm_conv},
                               {&x.ssm_conv_bias, &y.ssm_conv_bias},
                               {&x.ssm_dt_bias, &y.ssm_dt_bias},
                               {&x.ssm_a_log, &y.ssm_a_log},
                               {&x.ssm_d, &y.ssm_d},
                               {&x.ssm_out, &y.ssm_out}}) {
      EXPECT_EQ(*p, *q) << "layer " << l;
    }
  }
  ExpectMatchesTransformers(*back, raw, Falcon05bMultipliers());
}

}  // namespace
}  // namespace kvpool::model
