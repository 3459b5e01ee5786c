#pragma once

// A Llama-architecture decoder's configuration and weights, held in f32 on the host.
//
// Weights come from a Hugging Face checkpoint directory (config.json + *.safetensors in f32, f16
// or bf16) or are generated deterministically from a seed and a named size ("tiny" is kvpoold's
// embedded default). Matrices keep the Hugging Face layout of nn.Linear:
// [out_features][in_features], row-major, so y = x · Wᵀ.

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kernel_args.h"

namespace kvpool::model {

// How a layer's attention sees earlier tokens (a layer group's life cycle, docs/hybrid-groups.md).
enum class LayerKind : uint8_t {
  kFullAttention,     // every earlier position
  kSlidingAttention,  // the last `sliding_window` positions (its own included) and the sinks
  // A Mamba-2 mixer instead of attention: no K/V in the pool; the sequence's whole history is one
  // fixed-size state (SsmConfig) the caller keeps per sequence (StepItem::state).
  kStateSpace,
  // An MLP alone, no mixer (Nemotron-H's "-" layers; only in a model without mlp_after_mixer):
  // no K/V, no state.
  kMlp,
  // Full attention and a Mamba-2 mixer side by side (Falcon-H1's parallel hybrid layers): both
  // read the same normalized input and both outputs are added to the residual stream. K/V in the
  // pool and a state per sequence.
  kParallelHybrid,
};

// The MLP's activation: SwiGLU (Llama, Bamba: down(silu(gate(x)) * up(x))) or squared ReLU
// (Nemotron-H: down(relu(up(x))^2), no gate projection).
enum class MlpActivation : uint8_t { kSwiGlu, kReluSquared };

// The state-space layers' shape (Mamba-2 / Bamba). Per layer and token the input projection gives
// z (gate, inner), x (inner), B and C (groups x d_state each) and dt (heads), inner = num_heads *
// head_dim; x, B and C go through a depthwise causal conv of width conv_width and SiLU; the scan
// (kernels::SsmScanArgs) gives y; out = out_proj(RMSNorm_per_group(y * silu(z))).
struct SsmConfig {
  int32_t num_heads = 0;   // > 0; a multiple of num_groups
  int32_t head_dim = 0;    // > 0
  int32_t d_state = 0;     // > 0
  int32_t num_groups = 0;  // > 0; B and C are shared by num_heads / num_groups heads
  int32_t conv_width = 0;  // > 0 (Mamba-2: 4); 1 is no convolution over earlier tokens
  // Variants real checkpoints have (Bamba's mamba_conv_bias / mamba_proj_bias): a bias on the
  // conv, biases on in_proj and out_proj. The gated RMSNorm runs over each group's
  // inner / num_groups values (mamba_ssm's Mamba2; vLLM and SGLang for every Mamba-2 hybrid) or
  // over all of inner at once (transformers' BambaRMSNormGated); the same when num_groups is 1.
  bool conv_bias = true;
  bool proj_bias = false;
  bool norm_per_group = true;
  // False: no norm, out = out_proj(y * silu(z)) (Falcon-H1's mamba_rms_norm false; no norm
  // weight).
  bool gated_norm = true;

  int64_t inner() const { return int64_t{num_heads} * head_dim; }
  // Channels of the convolution: x, B and C.
  int64_t conv_dim() const { return inner() + 2 * int64_t{num_groups} * d_state; }
  // Outputs of the input projection: z, x, B, C, dt.
  int64_t in_proj_dim() const { return inner() + conv_dim() + num_heads; }
  // One layer's per-sequence state, in floats: the conv's last conv_width - 1 inputs
  // [conv_width - 1][conv_dim], then the scan's [num_heads][d_state][head_dim].
  int64_t conv_state_floats() const { return int64_t{conv_width - 1} * conv_dim(); }
  int64_t state_floats() const {
    return conv_state_floats() + int64_t{num_heads} * d_state * head_dim;
  }

  friend bool operator==(const SsmConfig&, const SsmConfig&) = default;
};

struct ModelConfig {
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;        // the residual width (usually num_heads * head_dim)
  int32_t intermediate_size = 0;  // SwiGLU width
  int32_t num_layers = 0;
  int32_t num_heads = 0;     // query heads
  int32_t num_kv_heads = 0;  // key/value heads (grouped-query attention); divides num_heads
  int32_t head_dim = 0;
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  bool tie_word_embeddings = false;  // the LM head is the embedding matrix
  int32_t max_position = 4096;       // longest sequence RoPE is meant for
  // RoPE rotates the first rotary_dim values of each head (rotate_half within them) and leaves
  // the rest as they are (partial rotary: Bamba rotates half of each head); 0 is head_dim.
  int32_t rotary_dim = 0;
  // Per layer, in order; empty: every layer full attention. Sliding layers (Mistral, Gemma 2/3,
  // gpt-oss) see `sliding_window` positions, plus the first `sink_tokens` (StreamingLLM's attention
  // sinks; 0 in the Hugging Face models, which have no such tokens).
  std::vector<LayerKind> layer_kinds;
  int32_t sliding_window = 0;  // > 0 when some layer slides
  int32_t sink_tokens = 0;
  SsmConfig ssm;  // set (every field positive) exactly when some layer is kStateSpace
  // How a layer is built. True (Llama, Bamba): each layer is a mixer (attention or state-space)
  // and then an MLP, each with its norm and residual. False (Nemotron-H): each layer is one
  // block, norm, then its mixer or (kMlp) its MLP, then the residual; no layer has both.
  bool mlp_after_mixer = true;
  MlpActivation mlp_activation = MlpActivation::kSwiGlu;
  bool rope = true;  // false: attention without position rotation (Nemotron-H)

  // The values of each head RoPE rotates (even, <= head_dim; 0 without RoPE).
  int32_t rotary() const {
    if (!rope) return 0;
    return rotary_dim == 0 ? head_dim : rotary_dim;
  }
  bool gated_mlp() const { return mlp_activation == MlpActivation::kSwiGlu; }
  // Rows of the MLP's input projection: gate over up, or up alone.
  int32_t mlp_in_rows() const { return gated_mlp() ? 2 * intermediate_size : intermediate_size; }

  LayerKind kind(int32_t layer) const {
    return layer_kinds.empty() ? LayerKind::kFullAttention
                               : layer_kinds[static_cast<size_t>(layer)];
  }
  // The window layer `layer`'s attention kernels are given (none for full attention).
  kernels::AttentionWindow window(int32_t layer) const {
    if (kind(layer) != LayerKind::kSlidingAttention) return {};
    return {.window = sliding_window, .sinks = sink_tokens};
  }

  static bool IsAttention(LayerKind k) {
    return k == LayerKind::kFullAttention || k == LayerKind::kSlidingAttention ||
           k == LayerKind::kParallelHybrid;
  }
  bool is_attention(int32_t layer) const { return IsAttention(kind(layer)); }
  // Whether a layer of kind `k` runs a Mamba-2 mixer (and so has a state per sequence).
  static bool HasState(LayerKind k) {
    return k == LayerKind::kStateSpace || k == LayerKind::kParallelHybrid;
  }
  bool has_state(int32_t layer) const { return HasState(kind(layer)); }
  // Whether layer `layer` runs an MLP: every layer but a mixer of a model without
  // mlp_after_mixer.
  bool has_mlp(int32_t layer) const { return mlp_after_mixer || kind(layer) == LayerKind::kMlp; }
  int32_t num_state_layers() const {
    int32_t n = 0;
    for (LayerKind k : layer_kinds) n += HasState(k) ? 1 : 0;
    return n;
  }
  // The layers with K/V in the pool: every attention layer, parallel hybrids included
  // (state-space and MLP layers have none).
  int32_t num_kv_layers() const {
    if (layer_kinds.empty()) return num_layers;
    int32_t n = 0;
    for (LayerKind k : layer_kinds) n += IsAttention(k) ? 1 : 0;
    return n;
  }
  // The pool's num_layers for this model (docs/hybrid-groups.md §2: the attention group holds
  // the attention layers only): num_kv_layers(), or 1 for a model without attention (a layout
  // has at least one layer; its blocks then go unused).
  int32_t pool_layers() const { return std::max(num_kv_layers(), 1); }
  int32_t num_sliding_layers() const {
    int32_t n = 0;
    for (LayerKind k : layer_kinds) n += k == LayerKind::kSlidingAttention ? 1 : 0;
    return n;
  }
  // Where attention layer `layer`'s K/V is in the pool: its index among the attention layers.
  // REQUIRES: kind(layer) is an attention kind.
  int32_t kv_layer(int32_t layer) const {
    int32_t n = 0;
    for (int32_t l = 0; l < layer && static_cast<size_t>(l) < layer_kinds.size(); ++l) {
      n += IsAttention(layer_kinds[static_cast<size_t>(l)]) ? 1 : 0;
    }
    return layer_kinds.empty() ? layer : n;
  }
  // Where attention layer `layer`'s K/V is in a pool with a window group
  // (PoolLayout::num_window_layers == num_sliding_layers(), docs/hybrid-groups.md §2) when
  // `window_group`: the full-attention layers first in model order, then the sliding layers in
  // model order (the pool's last layers, its window region's). Without one: kv_layer(layer).
  // REQUIRES: kind(layer) is an attention kind.
  int32_t kv_layer(int32_t layer, bool window_group) const {
    if (!window_group) return kv_layer(layer);
    const bool sliding = kind(layer) == LayerKind::kSlidingAttention;
    int32_t n = sliding ? num_kv_layers() - num_sliding_layers() : 0;
    for (int32_t l = 0; l < layer; ++l) {
      n += is_attention(l) && (kind(l) == LayerKind::kSlidingAttention) == sliding ? 1 : 0;
    }
    return n;
  }
  // Bytes of one sequence's state (StepItem::state): every mixer's (state-space and parallel
  // hybrid layers), in layer order, f32. 0 for a model without one.
  int64_t state_bytes() const {
    return int64_t{num_state_layers()} * ssm.state_floats() * int64_t{sizeof(float)};
  }

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// Checks every size is positive, num_heads is a multiple of num_kv_heads, head_dim is even and a
// multiple of 8, layer_kinds is empty or one per layer, a model with a sliding layer has a
// positive window (sinks >= 0), a model with a state-space layer a complete `ssm` (every
// field positive, num_groups dividing num_heads) while one without has none, and MLP layers
// only in a model without mlp_after_mixer.
// Errors: INVALID_ARGUMENT naming the field.
absl::Status ValidateConfig(const ModelConfig& config);

// The named sizes: "tiny" (kvpoold's default: 4 layers, 8 query / 4 KV heads of 64, vocab 8192),
// "small", and "tiny-swa" (tiny with sliding layers of window 256 alternating with full ones,
// sliding first, as gpt-oss and Gemma 2 alternate), and "tiny-hybrid" (tiny's width and
// attention geometry, layers state-space, state-space, full attention, state-space; 16 SSM heads
// of 64, d_state 64, one group, conv width 4: Mamba-2's proportions at tiny's size).
// Errors: INVALID_ARGUMENT for an unknown name (listing the known ones).
absl::StatusOr<ModelConfig> NamedConfig(std::string_view name);

// An attention layer has wq..wo and no ssm_*; a state-space layer the reverse; a parallel
// hybrid both; an MLP layer neither. A layer with a mixer has attn_norm (a parallel hybrid's
// one norm before both); a layer with an MLP (ModelConfig::has_mlp) has mlp_norm, w_up, w_down
// and, with SwiGLU, w_gate; ssm_norm only with ssm.gated_norm; the rest are empty.
struct LayerWeights {
  std::vector<float> attn_norm;      // [hidden] (before attention or the state-space mixer)
  std::vector<float> wq;             // [num_heads * head_dim][hidden]
  std::vector<float> wk;             // [num_kv_heads * head_dim][hidden]
  std::vector<float> wv;             // [num_kv_heads * head_dim][hidden]
  std::vector<float> wo;             // [hidden][num_heads * head_dim]
  std::vector<float> ssm_in;         // [in_proj_dim][hidden]: z, x, B, C, dt
  std::vector<float> ssm_in_bias;    // [in_proj_dim] with ssm.proj_bias, else empty
  std::vector<float> ssm_conv;       // [conv_dim][conv_width] (depthwise; last tap = this token)
  std::vector<float> ssm_conv_bias;  // [conv_dim] with ssm.conv_bias, else empty
  std::vector<float> ssm_dt_bias;    // [ssm heads], added before the softplus
  std::vector<float> ssm_a_log;      // [ssm heads]: A = -exp(A_log)
  std::vector<float> ssm_d;          // [ssm heads] skip
  std::vector<float> ssm_norm;       // [inner] gated RMSNorm weight (with ssm.gated_norm)
  std::vector<float> ssm_out;        // [hidden][inner]
  std::vector<float> ssm_out_bias;   // [hidden] with ssm.proj_bias, else empty
  std::vector<float> mlp_norm;       // [hidden]
  std::vector<float> w_gate;         // [intermediate][hidden]
  std::vector<float> w_up;           // [intermediate][hidden]
  std::vector<float> w_down;         // [hidden][intermediate]
};

struct ModelWeights {
  ModelConfig config;
  std::vector<float> embed;  // [vocab][hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab][hidden]; empty when tie_word_embeddings
};

// Deterministic weights for `config` from `seed`: normal(0, 0.02)-like values scaled so that a
// forward pass stays well conditioned (norm weights 1). Same seed, same weights, on any machine.
// REQUIRES: ValidateConfig(config).ok().
ModelWeights SyntheticWeights(const ModelConfig& config, uint64_t seed);

// Loads a Hugging Face Llama, Bamba or Nemotron-H checkpoint: `dir`/config.json (LlamaConfig
// fields: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads, head_dim (optional: hidden_size / num_attention_heads), rms_norm_eps,
// rope_theta, tie_word_embeddings, max_position_embeddings, partial_rotary_factor; sliding
// windows: `layer_types` of "full_attention" / "sliding_attention" with `sliding_window`, or
// `sliding_window` alone for every layer unless `use_sliding_window` is false, as Mistral and
// Qwen2 write them; and kvpool's own `kvpool_sink_tokens`; state-space layers: "mamba" in
// `layer_types` (Granite 4.0 hybrid's spelling, "attention" there is full attention), Bamba's
// `layers_block_type` of "mamba" / "attention", or Bamba's `attn_layer_indices` (the full
// attention layers; every other layer of a Bamba model is a Mamba layer), with Bamba's
// mamba_n_heads, mamba_d_head (or "auto": mamba_expand * hidden_size / mamba_n_heads),
// mamba_d_state, mamba_n_groups (default 1), mamba_d_conv (default 4), mamba_conv_bias (default
// true), mamba_proj_bias (default false); mamba_chunk_size is read by nothing (the scan is per
// token) and time_step_limit must be the default (0, inf), Python's Infinity accepted) and every
// *.safetensors file in `dir`, with tensors named as transformers names them
// (model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
// model.layers.N.mlp.{gate,up,down}_proj.weight, model.layers.N.{input,post_attention}_
// layernorm.weight, model.norm.weight, lm_head.weight; a state-space layer's mixer under Bamba's
// names, model.layers.N.mamba.{in_proj.weight, in_proj.bias, conv1d.weight, conv1d.bias, dt_bias,
// A_log, D, norm.weight, out_proj.weight, out_proj.bias}, the biases as the config declares).
// A Bamba checkpoint (model_type "bamba" or BambaForCausalLM) is read in Bamba's own layout:
// model.layers.N.feed_forward.{gate,up,down}_proj.weight, model.layers.N.pre_ff_layernorm.weight
// and model.final_layernorm.weight, RoPE over attn_rotary_emb values of each head (default half,
// as BambaConfig sets partial_rotary_factor 0.5), and rms_norm_eps 1e-5 by default. The gated
// norm runs per group unless kvpool's own `kvpool_ssm_norm_per_group` is false. A Nemotron-H
// checkpoint (model_type "nemotron_h" or NemotronHForCausalLM) is read in its own layout:
// `hybrid_override_pattern` (M Mamba-2, * attention, - MLP; E is refused), NemotronHConfig's
// mamba_num_heads, mamba_head_dim, ssm_state_size, n_groups, conv_kernel, use_conv_bias, use_bias,
// layer_norm_epsilon, head_dim or attention_head_dim, mlp_hidden_act relu2; tensors
// {backbone,model}.embeddings.weight, .layers.N.norm.weight, .layers.N.mixer.* (Bamba's Mamba
// names without mamba., q/k/v/o_proj, up/down_proj), .norm_f.weight; each layer one block, the
// MLPs squared ReLU, attention without RoPE (ModelConfig::mlp_after_mixer, mlp_activation,
// rope). A Falcon-H1 checkpoint (model_type "falcon_h1" or FalconH1ForCausalLM) is read in its
// own layout: every layer a parallel hybrid (LayerKind::kParallelHybrid) of attention and a
// Mamba-2 mixer on one input_layernorm, then pre_ff_layernorm and a SwiGLU feed_forward;
// FalconH1Config's mamba_d_ssm (default 1024; null: mamba_expand * hidden_size), mamba_n_heads,
// mamba_d_head ("auto": mamba_d_ssm / mamba_n_heads), mamba_n_groups, mamba_d_state,
// mamba_d_conv, mamba_conv_bias, mamba_proj_bias (in_proj) and projectors_bias (out_proj; the
// two must agree), mamba_rms_norm (default false: no gated norm) with mamba_norm_before_gate
// false (true, the class default, is refused); tensors model.layers.N.{self_attn,mamba,
// feed_forward}.*, model.final_layernorm.weight. Its muP multipliers (embedding_multiplier,
// lm_head_multiplier, key_multiplier, attention_in/out_multiplier, ssm_in/out_multiplier,
// ssm_multipliers over z, x, B, C and dt, mlp_multipliers over gate and down) are folded into
// the weights they scale, as transformers' FalconH1 applies them (a tied head the embedding
// multiplier must not scale is untied). Jamba and Zamba2 configs are refused. f32, f16 and
// bf16 tensors are converted to f32.
// Errors: NOT_FOUND (no config.json or no safetensors), INVALID_ARGUMENT naming the file and
// field or tensor (bad header, unsupported dtype or variant, wrong shape, missing tensor).
absl::StatusOr<ModelWeights> LoadCheckpoint(const std::string& dir);

// Reads only `dir`/config.json (cheap: for sizing a pool before loading the weights).
// Errors: as LoadCheckpoint for config.json.
absl::StatusOr<ModelConfig> ReadCheckpointConfig(const std::string& dir);

// Writes `weights` as a checkpoint directory LoadCheckpoint reads back (config.json and one
// model.safetensors, tensors stored in `dtype`: "f32", "f16" or "bf16"): in Nemotron-H's layout
// for a model without mlp_after_mixer, in Falcon-H1's (every multiplier 1) for one of parallel
// hybrid layers, else Llama's. For tests and tools.
// Errors: INVALID_ARGUMENT (dtype, or a config neither layout can say: SwiGLU without RoPE, say),
// INTERNAL (I/O).
absl::Status SaveCheckpoint(const ModelWeights& weights, const std::string& dir,
                            std::string_view dtype);

}  // namespace kvpool::model
