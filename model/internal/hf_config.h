#pragma once

// config.json as transformers writes it, to and from ModelConfig (weights.h: LoadCheckpoint
// lists the fields read). Internal to weights.cc.

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "model/weights.h"

namespace kvpool::model::internal {

// Bamba's checkpoints (BambaForCausalLM) name the MLP and its norm feed_forward.* and
// pre_ff_layernorm, and the final norm final_layernorm; other models use Llama's names.
enum class Names { kLlama, kBamba };

struct ParsedConfig {
  ModelConfig config;
  Names names = Names::kLlama;
};

// The text of `path`'s config.json. Errors: INVALID_ARGUMENT naming `path` and the field.
absl::StatusOr<ParsedConfig> ParseConfig(const std::string& text, const std::string& path);

// A config.json (Llama names) for `c` that ParseConfig reads back as `c`.
std::string ConfigJson(const ModelConfig& c, std::string_view torch_dtype);

}  // namespace kvpool::model::internal
