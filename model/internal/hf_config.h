#pragma once

// config.json as transformers writes it, to and from ModelConfig (weights.h: LoadCheckpoint
// lists the fields read). Internal to weights.cc.

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "model/weights.h"

namespace kvpool::model::internal {

// Bamba's checkpoints (BambaForCausalLM) name the MLP and its norm feed_forward.* and
// pre_ff_layernorm, and the final norm final_layernorm; Nemotron-H's (NemotronHForCausalLM)
// name each layer's one norm `norm` and its mixer or MLP `mixer`, under `backbone.` (NVIDIA's
// released checkpoints) or `model.` (as newer transformers saves them); Falcon-H1's
// (FalconH1ForCausalLM) name each layer's mixers self_attn and mamba, its MLP feed_forward, as
// Bamba does; other models use Llama's names.
enum class Names { kLlama, kBamba, kNemotronH, kFalconH1 };

// Falcon-H1's muP multipliers (FalconH1Config), where transformers applies them: the embeddings
// and the logits; the attention's input, keys and output; the mixer's input, its in_proj
// outputs per part (z, x, B, C, dt: ssm_multipliers) and output; the MLP's gate before the
// SiLU and its down projection's output. All 1 for every other model.
struct Multipliers {
  double embedding = 1.0;
  double lm_head = 1.0;
  double attention_in = 1.0;
  double attention_out = 1.0;
  double key = 1.0;
  double ssm_in = 1.0;
  double ssm_out = 1.0;
  double ssm[5] = {1.0, 1.0, 1.0, 1.0, 1.0};  // z, x, B, C, dt
  double mlp_gate = 1.0;
  double mlp_down = 1.0;
};

struct ParsedConfig {
  ModelConfig config;
  Names names = Names::kLlama;
  Multipliers multipliers;
};

// The model types whose config.json ParseConfig reads as ModelConfig.mlp_after_mixer false.
inline bool IsNemotronHConfig(const ModelConfig& c) { return !c.mlp_after_mixer; }
// Falcon-H1's: parallel hybrid layers.
inline bool IsFalconH1Config(const ModelConfig& c) {
  return !c.layer_kinds.empty() && c.layer_kinds.front() == LayerKind::kParallelHybrid;
}

// The text of `path`'s config.json. Errors: INVALID_ARGUMENT naming `path` and the field.
absl::StatusOr<ParsedConfig> ParseConfig(const std::string& text, const std::string& path);

// A config.json for `c` that ParseConfig reads back as `c`: Nemotron-H's when `c` has no
// mlp_after_mixer, Falcon-H1's (every multiplier 1) for parallel hybrid layers, else Llama's.
// REQUIRES: ConfigExpressible(c).ok().
std::string ConfigJson(const ModelConfig& c, std::string_view torch_dtype);
// Whether a config.json can say `c`: Llama's and Bamba's layers are SwiGLU with RoPE,
// Nemotron-H's squared ReLU without RoPE or sliding windows, Falcon-H1's all parallel hybrids
// (SwiGLU, RoPE over the whole head, the gated norm per group). Errors: INVALID_ARGUMENT naming
// the field.
absl::Status ConfigExpressible(const ModelConfig& c);

}  // namespace kvpool::model::internal
