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
// released checkpoints) or `model.` (as newer transformers saves them); other models use
// Llama's names.
enum class Names { kLlama, kBamba, kNemotronH };

struct ParsedConfig {
  ModelConfig config;
  Names names = Names::kLlama;
};

// The model types whose config.json ParseConfig reads as ModelConfig.mlp_after_mixer false.
inline bool IsNemotronHConfig(const ModelConfig& c) { return !c.mlp_after_mixer; }

// The text of `path`'s config.json. Errors: INVALID_ARGUMENT naming `path` and the field.
absl::StatusOr<ParsedConfig> ParseConfig(const std::string& text, const std::string& path);

// A config.json for `c` that ParseConfig reads back as `c`: Nemotron-H's when `c` has no
// mlp_after_mixer, else Llama's. REQUIRES: ConfigExpressible(c).ok().
std::string ConfigJson(const ModelConfig& c, std::string_view torch_dtype);
// Whether a config.json can say `c`: Llama's and Bamba's layers are SwiGLU with RoPE,
// Nemotron-H's squared ReLU without RoPE or sliding windows. Errors: INVALID_ARGUMENT naming
// the field.
absl::Status ConfigExpressible(const ModelConfig& c);

}  // namespace kvpool::model::internal
