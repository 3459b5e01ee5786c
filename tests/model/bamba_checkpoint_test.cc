// Real Mamba-2 hybrid checkpoints (issue 28): a Bamba checkpoint in exactly the layout
// transformers' BambaForCausalLM writes (config.json with BambaConfig's fields, tensors under
// Bamba's names: mamba.*, feed_forward.*, pre_ff_layernorm, final_layernorm) loads, and the
// model computes what the dense reference computes from the same weights, Bamba's partial RoPE
// included. The variants real checkpoints have (conv bias absent, projection biases present,
// the gated norm per group or over all of inner, partial rotary) run against the dense
// reference; what the model cannot run is refused with INVALID_ARGUMENT naming the field.

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
  const SsmConfig& m = c.ssm;
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
    add(p + "mamba.in_proj.weight", {m.in_proj_dim(), h}, L.ssm_in);
    add(p + "mamba.conv1d.weight", {m.conv_dim(), 1, m.conv_width}, L.ssm_conv);
    if (m.conv_bias) add(p + "mamba.conv1d.bias", {m.conv_dim()}, L.ssm_conv_bias);
    if (m.proj_bias) {
      add(p + "mamba.in_proj.bias", {m.in_proj_dim()}, L.ssm_in_bias);
      add(p + "mamba.out_proj.bias", {h}, L.ssm_out_bias);
    }
    add(p + "mamba.dt_bias", {m.num_heads}, L.ssm_dt_bias);
    add(p + "mamba.A_log", {m.num_heads}, L.ssm_a_log);
    add(p + "mamba.D", {m.num_heads}, L.ssm_d);
    add(p + "mamba.norm.weight", {m.inner()}, L.ssm_norm);
    add(p + "mamba.out_proj.weight", {h, m.inner()}, L.ssm_out);
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
  auto engine = MakeTestEngine(w, 16, kernels::DType::kF32, /*prefix_cache=*/false);
  DenseReference ref(w, kernels::DType::kF32);
  const std::vector<int32_t> prompt = RandomTokens(29, w.config.vocab_size, 5);
  auto first = engine->Prefill(SequenceId(0), prompt, {.keep_logits = true});
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<float> want = ref.Extend(prompt);
  EXPECT_LE(RelError(first->result.logits, want), HostTolerance(kernels::DType::kF32));
  int32_t token = Argmax(want);
  for (int step = 0; step < 6; ++step) {
    const DecodeInput in{first->sequence, token};
    auto out = engine->Decode(std::span(&in, 1), {.keep_logits = true});
    ASSERT_TRUE(out.ok()) << out.status();
    want = ref.Extend(std::span(&token, 1));
    EXPECT_LE(RelError((*out)[0].logits, want), HostTolerance(kernels::DType::kF32)) << step;
    token = Argmax(want);
  }
  EXPECT_LE(RelError(engine->state(first->sequence), ref.State()), 2e-3);
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
  text.replace(text.find(R"("model_type": "bamba")"), 21, R"("model_type": "nemotron_h")");
  WriteBamba(w, text);
  ExpectInvalid({"model_type", "nemotron_h"});
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

}  // namespace
}  // namespace kvpool::model
