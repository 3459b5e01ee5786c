// Real Mamba-2 hybrid checkpoints (issue 28): a Bamba checkpoint in exactly the layout
// transformers' BambaForCausalLM writes (config.json with BambaConfig's fields, tensors under
// Bamba's names: mamba.*, feed_forward.*, pre_ff_layernorm, final_layernorm) loads, and the
// model computes what the dense reference computes from the same weights, Bamba's partial RoPE
// included. The variants real checkpoints have (conv bias absent, projection biases present,
// the gated norm per group or over all of inner, partial rotary) run against the dense
// reference; what the model cannot run is refused with INVALID_ARGUMENT naming the field.
// Nemotron-H's checkpoints (NemotronHForCausalLM: one norm and one mixer or MLP per layer,
// squared-ReLU MLP layers, attention without RoPE, tensors under backbone.) the same way.

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
using ::testing::HasSubstr;

const LayerKind kS = LayerKind::kStateSpace, kF = LayerKind::kFullAttention;

// Field for field the shape of ibm-fms/Bamba-9B's config.json (BambaConfig's attributes, as
// transformers serializes them), at tiny sizes: 4 layers with attention at index 2 (Bamba-9B:
// 32 layers, [9, 18, 27]), 4 query / 2 KV heads of 16 with RoPE on the first 8 of each
// (attn_rotary_emb: half the head, as Bamba-9B's 64 of 128), 4 Mamba heads of 32 (mamba_expand
// 2 * hidden 64 / 4), d_state 16, one group, conv width 4. `extra` goes in before the last field.
std::string BambaConfigJson(const std::string& extra = "") {
  return absl::StrCat(R"({
  "architectures": ["BambaForCausalLM"],
  "attention_dropout": 0.0,
  "attn_layer_indices": [2],
  "attn_rotary_emb": 8,
  "bos_token_id": 0,
  "eos_token_id": 0,
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 96,
  "mamba_chunk_size": 256,
  "mamba_conv_bias": true,
  "mamba_d_conv": 4,
  "mamba_d_head": 32,
  "mamba_d_state": 16,
  "mamba_expand": 2,
  "mamba_n_groups": 1,
  "mamba_n_heads": 4,
  "mamba_proj_bias": false,
  "max_position_embeddings": 4096,
  "model_type": "bamba",
  "num_attention_heads": 4,
  "num_hidden_layers": 4,
  "num_key_value_heads": 2,
  "num_logits_to_keep": 1,
  "pad_token_id": 0,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "float32",
  "transformers_version": "4.48.0",
  "use_cache": true,
)",
                      extra, R"(
  "vocab_size": 256
})");
}

// What BambaConfigJson describes, spelled out independently of the loader.
ModelConfig BambaTestConfig() {
  return {.vocab_size = 256,
          .hidden_size = 64,
          .intermediate_size = 96,
          .num_layers = 4,
          .num_heads = 4,
          .num_kv_heads = 2,
          .head_dim = 16,
          .rms_norm_eps = 1e-5f,
          .rope_theta = 10000.0f,
          .tie_word_embeddings = false,
          .max_position = 4096,
          .rotary_dim = 8,
          .layer_kinds = {kS, kS, kF, kS},
          .ssm = {.num_heads = 4,
                  .head_dim = 32,
                  .d_state = 16,
                  .num_groups = 1,
                  .conv_width = 4,
                  .conv_bias = true,
                  .proj_bias = false}};
}

// Every tensor of `w` under the name BambaForCausalLM's state dict gives it.
std::vector<RawTensor> BambaTensors(const ModelWeights& w) {
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
  add("lm_head.weight", {c.vocab_size, h}, w.lm_head);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& L = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {h}, L.attn_norm);
    add(p + "pre_ff_layernorm.weight", {h}, L.mlp_norm);
    add(p + "feed_forward.gate_proj.weight", {im, h}, L.w_gate);
    add(p + "feed_forward.up_proj.weight", {im, h}, L.w_up);
    add(p + "feed_forward.down_proj.weight", {h, im}, L.w_down);
    if (c.kind(static_cast<int32_t>(i)) == kF) {
      add(p + "self_attn.q_proj.weight", {q, h}, L.wq);
      add(p + "self_attn.k_proj.weight", {kv, h}, L.wk);
      add(p + "self_attn.v_proj.weight", {kv, h}, L.wv);
      add(p + "self_attn.o_proj.weight", {h, q}, L.wo);
      continue;
    }
    test_util::AppendMambaTensors(p + "mamba.", L, c, &out);
  }
  return out;
}

// Equal configs and bit-identical tensors, the state-space ones included.
void ExpectSame(const ModelWeights& a, const ModelWeights& b) {
  test_util::ExpectSameWeights(a, b);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerWeights &x = a.layers[l], &y = b.layers[l];
    for (const auto& [p, q] : {std::pair(&x.ssm_in, &y.ssm_in),
                               {&x.ssm_in_bias, &y.ssm_in_bias},
                               {&x.ssm_conv, &y.ssm_conv},
                               {&x.ssm_conv_bias, &y.ssm_conv_bias},
                               {&x.ssm_dt_bias, &y.ssm_dt_bias},
                               {&x.ssm_a_log, &y.ssm_a_log},
                               {&x.ssm_d, &y.ssm_d},
                               {&x.ssm_norm, &y.ssm_norm},
                               {&x.ssm_out, &y.ssm_out},
                               {&x.ssm_out_bias, &y.ssm_out_bias},
                               {&x.mlp_norm, &y.mlp_norm},
                               {&x.w_gate, &y.w_gate},
                               {&x.w_down, &y.w_down}}) {
      EXPECT_EQ(*p, *q) << "layer " << l;
    }
  }
}

// Prefill then decodes against the dense reference, f32 K/V.
void ExpectMatchesReference(const ModelWeights& w) {
  DenseReference ref(w, kernels::DType::kF32);
  ExpectEngineFollowsReference(w, ref, kernels::DType::kF32, 29, 5, 6, 2e-3);
}

class BambaCheckpointTest : public test_util::WeightsTest {
 protected:
  void WriteBamba(const ModelWeights& w, const std::string& config_json) {
    WriteFile("config.json", config_json);
    WriteFile("model.safetensors", test_util::SafetensorsBytes(BambaTensors(w)));
  }
};

TEST_F(BambaCheckpointTest, LoadsBambasLayoutAndComputesWhatTheReferenceDoes) {
  const ModelWeights w = SyntheticWeights(BambaTestConfig(), 21);
  WriteBamba(w, BambaConfigJson());
  absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->config, w.config);
  ExpectSame(*loaded, w);
  ExpectMatchesReference(*loaded);
}

// Without attn_rotary_emb Bamba's config class still rotates half of each head; without
// attn_layer_indices every layer is a Mamba layer; Python's Infinity (BambaConfig's
// time_step_limit default) is read as no limit.
TEST_F(BambaCheckpointTest, ReadsBambasDefaultsAndPythonsInfinity) {
  std::string text = BambaConfigJson(R"("time_step_limit": [0.0, Infinity],)");
  text.replace(text.find(R"("attn_rotary_emb": 8,)"), 21, "");
  WriteFile("config.json", text);
  absl::StatusOr<ModelConfig> read = ReadCheckpointConfig(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->rotary_dim, 8);
  text.replace(text.find(R"("attn_layer_indices": [2],)"), 26, "");
  WriteFile("config.json", text);
  read = ReadCheckpointConfig(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->layer_kinds, (std::vector<LayerKind>{kS, kS, kS, kS}));
}

// Two groups: the gated norm per group (as mamba_ssm trained Bamba and vLLM serves it), or over
// all of inner (transformers' BambaRMSNormGated) with kvpool's own key; both against the
// reference, and they differ (so the test tells them apart).
TEST_F(BambaCheckpointTest, NormPerGroupOrOverAllOfInner) {
  ModelConfig c = BambaTestConfig();
  c.ssm.num_groups = 2;
  const ModelWeights grouped = SyntheticWeights(c, 4);
  std::string text = BambaConfigJson();
  text.replace(text.find(R"("mamba_n_groups": 1)"), 19, R"("mamba_n_groups": 2)");
  WriteBamba(grouped, text);
  absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->config.ssm.norm_per_group);
  ExpectMatchesReference(*loaded);
  text = BambaConfigJson(R"("kvpool_ssm_norm_per_group": false,)");
  text.replace(text.find(R"("mamba_n_groups": 1)"), 19, R"("mamba_n_groups": 2)");
  WriteBamba(grouped, text);
  absl::StatusOr<ModelWeights> whole = LoadCheckpoint(dir_);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_FALSE(whole->config.ssm.norm_per_group);
  ExpectMatchesReference(*whole);
  auto a = MakeTestEngine(*whole, 16, kernels::DType::kF32, false);
  auto b = MakeTestEngine(grouped, 16, kernels::DType::kF32, false);
  const std::vector<int32_t> prompt = RandomTokens(9, 256, 2);
  auto x = a->Prefill(SequenceId(0), prompt, {.keep_logits = true});
  auto y = b->Prefill(SequenceId(0), prompt, {.keep_logits = true});
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_GT(RelError(x->result.logits, y->result.logits), 1e-3);
}

// Each bias variant real checkpoints have, loaded from Bamba's layout and run against the
// reference; and saved by SaveCheckpoint and read back unchanged.
TEST_F(BambaCheckpointTest, EveryBiasVariantLoadsAndMatchesTheReference) {
  struct Variant {
    bool conv_bias, proj_bias;
  };
  for (const Variant v : {Variant{false, false}, Variant{true, true}, Variant{false, true}}) {
    SCOPED_TRACE(absl::StrCat("conv_bias ", v.conv_bias, " proj_bias ", v.proj_bias));
    ModelConfig c = BambaTestConfig();
    c.ssm.conv_bias = v.conv_bias;
    c.ssm.proj_bias = v.proj_bias;
    const ModelWeights w = SyntheticWeights(c, 8);
    std::string text = BambaConfigJson();
    text.replace(text.find(R"("mamba_conv_bias": true)"), 23,
                 absl::StrCat(R"("mamba_conv_bias": )", v.conv_bias ? "true" : "false"));
    text.replace(text.find(R"("mamba_proj_bias": false)"), 24,
                 absl::StrCat(R"("mamba_proj_bias": )", v.proj_bias ? "true" : "false"));
    WriteBamba(w, text);
    absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->config, c);
    ExpectSame(*loaded, w);
    ExpectMatchesReference(*loaded);
    ASSERT_TRUE(SaveCheckpoint(w, Path("saved"), "f32").ok());
    absl::StatusOr<ModelWeights> back = LoadCheckpoint(Path("saved"));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->config, c);
    ExpectSame(*back, w);
  }
}

TEST_F(BambaCheckpointTest, RefusesWhatItCannotRunNamingTheField) {
  const ModelWeights w = SyntheticWeights(BambaTestConfig(), 3);
  WriteBamba(w, BambaConfigJson(R"("time_step_limit": [0.001, 0.1],)"));
  ExpectInvalid({"config.json", "time_step_limit"});
  std::string text = BambaConfigJson(R"("partial_rotary_factor": 1.5,)");
  text.replace(text.find(R"("attn_rotary_emb": 8,)"), 21, "");
  WriteBamba(w, text);
  ExpectInvalid({"partial_rotary_factor"});
  // A factor too small for one pair of a head (16 values) would otherwise read as rotary_dim 0,
  // which means all of the head.
  text = BambaConfigJson(R"("partial_rotary_factor": 0.05,)");
  text.replace(text.find(R"("attn_rotary_emb": 8,)"), 21, "");
  WriteBamba(w, text);
  ExpectInvalid({"partial_rotary_factor", "rotates no value"});
  text = BambaConfigJson();
  text.replace(text.find(R"("attn_rotary_emb": 8)"), 20, R"("attn_rotary_emb": 7)");
  WriteBamba(w, text);
  ExpectInvalid({"rotary_dim"});
  text = BambaConfigJson();
  text.replace(text.find(R"("attn_layer_indices": [2])"), 25, R"("attn_layer_indices": [4])");
  WriteBamba(w, text);
  ExpectInvalid({"attn_layer_indices", "[0, 4)"});
  text = BambaConfigJson();
  text.replace(text.find(R"("model_type": "bamba")"), 21, R"("model_type": "jamba")");
  WriteBamba(w, text);
  ExpectInvalid({"model_type", "jamba"});
  // A tensor of Bamba's layout missing: named.
  std::vector<RawTensor> tensors = BambaTensors(w);
  std::erase_if(tensors, [](const RawTensor& t) {
    return t.name == "model.layers.1.feed_forward.up_proj.weight";
  });
  WriteFile("config.json", BambaConfigJson());
  WriteFile("model.safetensors", test_util::SafetensorsBytes(tensors));
  ExpectInvalid({"model.layers.1.feed_forward.up_proj.weight"});
}

// Partial rotary outside Bamba: transformers' partial_rotary_factor, against the reference, and
// through a save and a load.
TEST_F(BambaCheckpointTest, PartialRotaryMatchesTheReference) {
  ModelConfig c = SmallTestConfig();
  c.rotary_dim = 16;  // of 32
  const ModelWeights w = SyntheticWeights(c, 6);
  ExpectMatchesReference(w);
  ASSERT_TRUE(SaveCheckpoint(w, dir_, "f32").ok());
  absl::StatusOr<ModelConfig> read = ReadCheckpointConfig(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->rotary_dim, 16);
  c.rotary_dim = 0;  // the same weights rotated over all of each head compute something else
  ModelWeights full = w;
  full.config = c;
  auto a = MakeTestEngine(w, 16, kernels::DType::kF32, false);
  auto b = MakeTestEngine(full, 16, kernels::DType::kF32, false);
  const std::vector<int32_t> prompt = RandomTokens(12, 256, 4);
  auto x = a->Prefill(SequenceId(0), prompt, {.keep_logits = true});
  auto y = b->Prefill(SequenceId(0), prompt, {.keep_logits = true});
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_GT(RelError(x->result.logits, y->result.logits), 1e-3);
}

const LayerKind kM = LayerKind::kMlp;

// NemotronHConfig's fields, as Nemotron-H-8B's config.json has them, at tiny sizes: 6 layers
// "M-M*-M" (Nemotron-H-8B: 52, "M-M-M-M*-..."), hidden 64, 4 query / 2 KV heads of 16 (named
// attention_head_dim, as the released configs do), squared-ReLU MLPs of 96, 4 Mamba heads of 32,
// d_state 16, 2 groups (Nemotron-H-8B: 8), conv width 4. `extra` goes in before the last field.
std::string NemotronHConfigJson(const std::string& extra = "") {
  return absl::StrCat(R"({
  "architectures": ["NemotronHForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attention_head_dim": 16,
  "bos_token_id": 1,
  "chunk_size": 128,
  "conv_kernel": 4,
  "eos_token_id": 2,
  "expand": 2,
  "hidden_dropout": 0.0,
  "hidden_size": 64,
  "hybrid_override_pattern": "M-M*-M",
  "initializer_range": 0.02,
  "intermediate_size": 96,
  "layer_norm_epsilon": 1e-05,
  "mamba_head_dim": 32,
  "mamba_hidden_act": "silu",
  "mamba_num_heads": 4,
  "max_position_embeddings": 8192,
  "mlp_bias": false,
  "mlp_hidden_act": "relu2",
  "model_type": "nemotron_h",
  "n_groups": 2,
  "num_attention_heads": 4,
  "num_hidden_layers": 6,
  "num_key_value_heads": 2,
  "num_logits_to_keep": 1,
  "pad_token_id": 0,
  "rescale_prenorm_residual": true,
  "residual_in_fp32": false,
  "sliding_window": null,
  "ssm_state_size": 16,
  "tie_word_embeddings": false,
  "time_step_floor": 0.0001,
  "time_step_limit": [0.0, Infinity],
  "time_step_max": 0.1,
  "time_step_min": 0.001,
  "torch_dtype": "bfloat16",
  "use_bias": false,
  "use_cache": true,
  "use_conv_bias": true,
  "use_mamba_kernels": true,
)",
                      extra, R"(
  "vocab_size": 256
})");
}

// What NemotronHConfigJson describes, spelled out independently of the loader.
ModelConfig NemotronHTestConfig() {
  return {.vocab_size = 256,
          .hidden_size = 64,
          .intermediate_size = 96,
          .num_layers = 6,
          .num_heads = 4,
          .num_kv_heads = 2,
          .head_dim = 16,
          .rms_norm_eps = 1e-5f,
          .rope_theta = 10000.0f,
          .tie_word_embeddings = false,
          .max_position = 8192,
          .layer_kinds = {kS, kM, kS, kF, kM, kS},
          .ssm = {.num_heads = 4,
                  .head_dim = 32,
                  .d_state = 16,
                  .num_groups = 2,
                  .conv_width = 4,
                  .conv_bias = true,
                  .proj_bias = false},
          .mlp_after_mixer = false,
          .mlp_activation = MlpActivation::kReluSquared,
          .rope = false};
}

// Every tensor of `w` under the name NemotronHForCausalLM's state dict gives it, under `top`
// ("backbone.": NVIDIA's checkpoints; "model.": newer transformers').
std::vector<RawTensor> NemotronHTensors(const ModelWeights& w, const std::string& top) {
  const ModelConfig& c = w.config;
  const SsmConfig& m = c.ssm;
  const int64_t h = c.hidden_size, im = c.intermediate_size, q = c.num_heads * c.head_dim,
                kv = c.num_kv_heads * c.head_dim;
  std::vector<RawTensor> out;
  const auto add = [&out](std::string name, std::vector<int64_t> shape,
                          const std::vector<float>& v) {
    out.push_back({std::move(name), "F32", std::move(shape), F32Bytes(v)});
  };
  add(top + "embeddings.weight", {c.vocab_size, h}, w.embed);
  add(top + "norm_f.weight", {h}, w.final_norm);
  add("lm_head.weight", {c.vocab_size, h}, w.lm_head);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& L = w.layers[i];
    const std::string p = absl::StrCat(top, "layers.", i, ".mixer.");
    const LayerKind kind = c.kind(static_cast<int32_t>(i));
    add(absl::StrCat(top, "layers.", i, ".norm.weight"), {h},
        kind == kM ? L.mlp_norm : L.attn_norm);
    if (kind == kM) {
      add(p + "up_proj.weight", {im, h}, L.w_up);
      add(p + "down_proj.weight", {h, im}, L.w_down);
    } else if (kind == kF) {
      add(p + "q_proj.weight", {q, h}, L.wq);
      add(p + "k_proj.weight", {kv, h}, L.wk);
      add(p + "v_proj.weight", {kv, h}, L.wv);
      add(p + "o_proj.weight", {h, q}, L.wo);
    } else {
      add(p + "in_proj.weight", {m.in_proj_dim(), h}, L.ssm_in);
      add(p + "conv1d.weight", {m.conv_dim(), 1, m.conv_width}, L.ssm_conv);
      add(p + "conv1d.bias", {m.conv_dim()}, L.ssm_conv_bias);
      add(p + "dt_bias", {m.num_heads}, L.ssm_dt_bias);
      add(p + "A_log", {m.num_heads}, L.ssm_a_log);
      add(p + "D", {m.num_heads}, L.ssm_d);
      add(p + "norm.weight", {m.inner()}, L.ssm_norm);
      add(p + "out_proj.weight", {h, m.inner()}, L.ssm_out);
    }
  }
  return out;
}

class NemotronHCheckpointTest : public test_util::WeightsTest {
 protected:
  void WriteNemotronH(const ModelWeights& w, const std::string& config_json,
                      const std::string& top = "backbone.") {
    WriteFile("config.json", config_json);
    WriteFile("model.safetensors", test_util::SafetensorsBytes(NemotronHTensors(w, top)));
  }
};

// Under either prefix: the config as spelled out, the tensors bit for bit, and the model
// computes what the dense reference does (prefill, decodes, the state).
TEST_F(NemotronHCheckpointTest, LoadsNemotronHsLayoutAndComputesWhatTheReferenceDoes) {
  const ModelWeights w = SyntheticWeights(NemotronHTestConfig(), 12);
  for (const std::string top : {"backbone.", "model."}) {
    SCOPED_TRACE(top);
    WriteNemotronH(w, NemotronHConfigJson(), top);
    absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->config, w.config);
    ExpectSame(*loaded, w);
    EXPECT_TRUE(loaded->layers[1].attn_norm.empty());  // an MLP layer has no mixer
    EXPECT_TRUE(loaded->layers[0].mlp_norm.empty() && loaded->layers[0].w_up.empty());
    EXPECT_TRUE(loaded->layers[1].w_gate.empty());  // squared ReLU: no gate
    ExpectMatchesReference(*loaded);
  }
  EXPECT_EQ(w.config.num_kv_layers(), 1);  // the pool holds the one attention layer's K/V
  EXPECT_EQ(w.config.kv_layer(3), 0);
}

// Squared ReLU and attention without RoPE are what the model computes, not an accident of the
// reference agreeing: the same weights with RoPE, or with SwiGLU (its gate a copy of up, so
// silu(up) * up in place of relu(up)^2), compute something else.
TEST_F(NemotronHCheckpointTest, SquaredReluAndNoRopeAreWhatItComputes) {
  const ModelWeights w = SyntheticWeights(NemotronHTestConfig(), 5);
  const std::vector<int32_t> prompt = RandomTokens(20, 256, 3);
  auto logits = [&](const ModelWeights& weights) {
    auto engine = MakeTestEngine(weights, 16, kernels::DType::kF32, false);
    auto out = engine->Prefill(SequenceId(0), prompt, {.keep_logits = true});
    KVPOOL_CHECK_OK(out.status());
    return out->result.logits;
  };
  const std::vector<float> base = logits(w);
  ModelWeights roped = w;
  roped.config.rope = true;
  EXPECT_GT(RelError(logits(roped), base), 1e-3);
  ModelWeights gated = w;
  gated.config.mlp_activation = MlpActivation::kSwiGlu;
  for (size_t l = 0; l < gated.layers.size(); ++l) {
    if (!gated.layers[l].w_up.empty()) gated.layers[l].w_gate = gated.layers[l].w_up;
  }
  EXPECT_GT(RelError(logits(gated), base), 1e-3);
}

// SaveCheckpoint writes Nemotron-H's layout for such a model and LoadCheckpoint reads it back
// unchanged; a config no config.json can say is refused by name, and so is an MLP layer in a
// model that puts an MLP after every mixer.
TEST_F(NemotronHCheckpointTest, SavesNemotronHsLayoutAndRefusesWhatNoConfigSays) {
  const ModelWeights w = SyntheticWeights(NemotronHTestConfig(), 9);
  ASSERT_TRUE(SaveCheckpoint(w, Path("saved"), "f32").ok());
  absl::StatusOr<ModelWeights> back = LoadCheckpoint(Path("saved"));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, w);
  ModelWeights odd = SyntheticWeights(SmallTestConfig(), 1);
  odd.config.rope = false;  // Llama's config.json cannot say so
  absl::Status saved = SaveCheckpoint(odd, Path("odd"), "f32");
  EXPECT_EQ(saved.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(saved.message()), HasSubstr("RoPE"));
  ModelConfig c = NemotronHTestConfig();
  c.mlp_after_mixer = true;
  const absl::Status invalid = ValidateConfig(c);
  EXPECT_EQ(invalid.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(invalid.message()), HasSubstr("MLP layer"));
}

TEST_F(NemotronHCheckpointTest, RefusesWhatItCannotRunNamingTheField) {
  const ModelWeights w = SyntheticWeights(NemotronHTestConfig(), 3);
  auto with = [](const std::string& from, const std::string& to) {
    std::string text = NemotronHConfigJson();
    text.replace(text.find(from), from.size(), to);
    return text;
  };
  WriteNemotronH(w, with(R"("M-M*-M")", R"("M-E*-M")"));
  ExpectInvalid({"hybrid_override_pattern", "'E'", "mixture of experts"});
  WriteNemotronH(w, with(R"("M-M*-M")", R"("M-M*-")"));
  ExpectInvalid({"hybrid_override_pattern", "layer"});
  WriteNemotronH(w, with(R"("M-M*-M")", R"("M-M*-MM")"));
  ExpectInvalid({"hybrid_override_pattern has 7 layers", "num_hidden_layers 6"});
  WriteNemotronH(w, with(R"("mlp_hidden_act": "relu2")", R"("mlp_hidden_act": "silu")"));
  ExpectInvalid({"mlp_hidden_act", "relu2 only"});
  WriteNemotronH(w, with(R"("mlp_bias": false)", R"("mlp_bias": true)"));
  ExpectInvalid({"mlp_bias"});
  WriteNemotronH(
      w, with(R"("time_step_limit": [0.0, Infinity])", R"("time_step_limit": [0.001, 0.1])"));
  ExpectInvalid({"time_step_limit"});
  WriteNemotronH(w, with(R"("sliding_window": null)", R"("sliding_window": 512)"));
  ExpectInvalid({"sliding_window"});
  WriteNemotronH(w, with(R"("mamba_hidden_act": "silu")", R"("mamba_hidden_act": "gelu")"));
  ExpectInvalid({"mamba_hidden_act"});
  // A tensor of Nemotron-H's layout missing: named.
  std::vector<RawTensor> tensors = NemotronHTensors(w, "backbone.");
  std::erase_if(tensors, [](const RawTensor& t) {
    return t.name == "backbone.layers.1.mixer.up_proj.weight";
  });
  WriteFile("config.json", NemotronHConfigJson());
  WriteFile("model.safetensors", test_util::SafetensorsBytes(tensors));
  ExpectInvalid({"backbone.layers.1.mixer.up_proj.weight"});
}

}  // namespace
}  // namespace kvpool::model
