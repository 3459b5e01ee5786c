#pragma once

// A Llama-architecture decoder's configuration and weights, held in f32 on the host.
//
// Weights come from a Hugging Face checkpoint directory (config.json + *.safetensors in f32, f16
// or bf16) or are generated deterministically from a seed and a named size ("tiny" is kvpoold's
// embedded default). Matrices keep the Hugging Face layout of nn.Linear:
// [out_features][in_features], row-major, so y = x · Wᵀ.

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
  // Per layer, in order; empty: every layer full attention. Sliding layers (Mistral, Gemma 2/3,
  // gpt-oss) see `sliding_window` positions, plus the first `sink_tokens` (StreamingLLM's attention
  // sinks; 0 in the Hugging Face models, which have no such tokens).
  std::vector<LayerKind> layer_kinds;
  int32_t sliding_window = 0;  // > 0 when some layer slides
  int32_t sink_tokens = 0;

  LayerKind kind(int32_t layer) const {
    return layer_kinds.empty() ? LayerKind::kFullAttention
                               : layer_kinds[static_cast<size_t>(layer)];
  }
  // The window layer `layer`'s attention kernels are given (none for full attention).
  kernels::AttentionWindow window(int32_t layer) const {
    if (kind(layer) != LayerKind::kSlidingAttention) return {};
    return {.window = sliding_window, .sinks = sink_tokens};
  }

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// Checks every size is positive, num_heads is a multiple of num_kv_heads, head_dim is even and a
// multiple of 8, layer_kinds is empty or one per layer, and a model with a sliding layer has a
// positive window (sinks >= 0). Errors: INVALID_ARGUMENT naming the field.
absl::Status ValidateConfig(const ModelConfig& config);

// The named sizes: "tiny" (kvpoold's default: 4 layers, 8 query / 4 KV heads of 64, vocab 8192),
// "small", and "tiny-swa" (tiny with sliding layers of window 256 alternating with full ones,
// sliding first, as gpt-oss and Gemma 2 alternate). Errors: INVALID_ARGUMENT for an unknown name
// (listing the known ones).
absl::StatusOr<ModelConfig> NamedConfig(std::string_view name);

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> wq;         // [num_heads * head_dim][hidden]
  std::vector<float> wk;         // [num_kv_heads * head_dim][hidden]
  std::vector<float> wv;         // [num_kv_heads * head_dim][hidden]
  std::vector<float> wo;         // [hidden][num_heads * head_dim]
  std::vector<float> mlp_norm;   // [hidden]
  std::vector<float> w_gate;     // [intermediate][hidden]
  std::vector<float> w_up;       // [intermediate][hidden]
  std::vector<float> w_down;     // [hidden][intermediate]
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

// Loads a Hugging Face Llama checkpoint: `dir`/config.json (LlamaConfig fields: vocab_size,
// hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
// head_dim (optional: hidden_size / num_attention_heads), rms_norm_eps, rope_theta,
// tie_word_embeddings, max_position_embeddings; sliding windows: `layer_types` of
// "full_attention" / "sliding_attention" with `sliding_window`, or `sliding_window` alone for
// every layer unless `use_sliding_window` is false, as Mistral and Qwen2 write them; and
// kvpool's own `kvpool_sink_tokens`) and every *.safetensors file in `dir`, with
// tensors named as transformers names them (model.embed_tokens.weight,
// model.layers.N.self_attn.{q,k,v,o}_proj.weight, model.layers.N.mlp.{gate,up,down}_proj.weight,
// model.layers.N.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight).
// f32, f16 and bf16 tensors are converted to f32.
// Errors: NOT_FOUND (no config.json or no safetensors), INVALID_ARGUMENT naming the file and
// tensor (bad header, unsupported dtype, wrong shape, missing tensor).
absl::StatusOr<ModelWeights> LoadCheckpoint(const std::string& dir);

// Reads only `dir`/config.json (cheap: for sizing a pool before loading the weights).
// Errors: as LoadCheckpoint for config.json.
absl::StatusOr<ModelConfig> ReadCheckpointConfig(const std::string& dir);

// Writes `weights` as a checkpoint directory LoadCheckpoint reads back (config.json and one
// model.safetensors, tensors stored in `dtype`: "f32", "f16" or "bf16"). For tests and tools.
// Errors: INVALID_ARGUMENT (dtype), INTERNAL (I/O).
absl::Status SaveCheckpoint(const ModelWeights& weights, const std::string& dir,
                            std::string_view dtype);

}  // namespace kvpool::model
