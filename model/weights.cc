#include "model/weights.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <system_error>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/util/check.h"
#include "kvpool/util/status_macros.h"
#include "model/internal/safetensors.h"
#include "nlohmann/json.hpp"

namespace kvpool::model {
namespace {

using nlohmann::json;

// Every tensor of a checkpoint with its transformers name and [out][in] shape, bound to the
// vector that holds it. `Weights` is ModelWeights (loading) or const ModelWeights (saving);
// weights.layers must already hold config.num_layers entries. Each layer has at least
// kTensorsPerLayer (an attention layer that many, a state-space layer more).
constexpr int64_t kTensorsPerLayer = 9;
template <typename Weights>
auto TensorSlots(Weights& weights) {
  using Vector =
      std::conditional_t<std::is_const_v<Weights>, const std::vector<float>, std::vector<float>>;
  struct Slot {
    std::string name;
    std::vector<int64_t> shape;
    Vector* data;
  };
  const ModelConfig& c = weights.config;
  const int64_t hidden = c.hidden_size;
  const int64_t q_width = int64_t{c.num_heads} * c.head_dim;
  const int64_t kv_width = int64_t{c.num_kv_heads} * c.head_dim;
  const int64_t inter = c.intermediate_size;
  std::vector<Slot> slots;
  slots.push_back({"model.embed_tokens.weight", {c.vocab_size, hidden}, &weights.embed});
  const SsmConfig& m = c.ssm;
  for (size_t i = 0; i < weights.layers.size(); ++i) {
    auto& layer = weights.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    slots.push_back({p + "input_layernorm.weight", {hidden}, &layer.attn_norm});
    if (c.kind(static_cast<int32_t>(i)) == LayerKind::kStateSpace) {
      // Bamba's (and Granite 4.0 hybrid's) names for the Mamba-2 mixer.
      slots.push_back({p + "mamba.in_proj.weight", {m.in_proj_dim(), hidden}, &layer.ssm_in});
      slots.push_back(
          {p + "mamba.conv1d.weight", {m.conv_dim(), 1, m.conv_width}, &layer.ssm_conv});
      slots.push_back({p + "mamba.conv1d.bias", {m.conv_dim()}, &layer.ssm_conv_bias});
      slots.push_back({p + "mamba.dt_bias", {m.num_heads}, &layer.ssm_dt_bias});
      slots.push_back({p + "mamba.A_log", {m.num_heads}, &layer.ssm_a_log});
      slots.push_back({p + "mamba.D", {m.num_heads}, &layer.ssm_d});
      slots.push_back({p + "mamba.norm.weight", {m.inner()}, &layer.ssm_norm});
      slots.push_back({p + "mamba.out_proj.weight", {hidden, m.inner()}, &layer.ssm_out});
    } else {
      slots.push_back({p + "self_attn.q_proj.weight", {q_width, hidden}, &layer.wq});
      slots.push_back({p + "self_attn.k_proj.weight", {kv_width, hidden}, &layer.wk});
      slots.push_back({p + "self_attn.v_proj.weight", {kv_width, hidden}, &layer.wv});
      slots.push_back({p + "self_attn.o_proj.weight", {hidden, q_width}, &layer.wo});
    }
    slots.push_back({p + "post_attention_layernorm.weight", {hidden}, &layer.mlp_norm});
    slots.push_back({p + "mlp.gate_proj.weight", {inter, hidden}, &layer.w_gate});
    slots.push_back({p + "mlp.up_proj.weight", {inter, hidden}, &layer.w_up});
    slots.push_back({p + "mlp.down_proj.weight", {hidden, inter}, &layer.w_down});
  }
  slots.push_back({"model.norm.weight", {hidden}, &weights.final_norm});
  if (!c.tie_word_embeddings) {
    slots.push_back({"lm_head.weight", {c.vocab_size, hidden}, &weights.lm_head});
  }
  return slots;
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// ---- config.json ----------------------------------------------------------------------------

// Reads config[key] as an int32 into *out. Absent or null keeps *out, unless `required`.
absl::Status GetInt(const json& config, const std::string& path, const char* key, bool required,
                    int32_t* out) {
  if (!config.contains(key) || config[key].is_null()) {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(path, ": missing ", key));
  }
  const json& value = config[key];
  int64_t v = 0;
  if (value.is_number_unsigned()) {
    v = static_cast<int64_t>(std::min<uint64_t>(value.get<uint64_t>(), uint64_t{1} << 62));
  } else if (value.is_number_integer()) {
    v = value.get<int64_t>();
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " is not an integer"));
  }
  if (v < INT32_MIN || v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " = ", v, " is out of range"));
  }
  *out = static_cast<int32_t>(v);
  return absl::OkStatus();
}

absl::Status GetFloat(const json& config, const std::string& path, const char* key, float* out) {
  if (!config.contains(key) || config[key].is_null()) return absl::OkStatus();
  if (!config[key].is_number()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " is not a number"));
  }
  const double value = config[key].get<double>();
  // Narrowing a double past the float range is undefined behaviour, not inf.
  if (!(std::abs(value) <= std::numeric_limits<float>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", key, " = ", value, " is out of range"));
  }
  *out = static_cast<float>(value);
  return absl::OkStatus();
}

absl::Status GetBool(const json& config, const std::string& path, const char* key, bool* out) {
  if (!config.contains(key) || config[key].is_null()) return absl::OkStatus();
  if (!config[key].is_boolean()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " is not a boolean"));
  }
  *out = config[key].get<bool>();
  return absl::OkStatus();
}

// Sliding windows as transformers writes them: `layer_types` names each layer's attention
// (Gemma 3, gpt-oss, Qwen3); without it a `sliding_window` applies to every layer (Mistral),
// unless `use_sliding_window` is false (Qwen2 writes a window it does not use).
absl::Status ParseLayerKinds(const json& config, const std::string& path, ModelConfig* c) {
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "sliding_window", false, &c->sliding_window));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "kvpool_sink_tokens", false, &c->sink_tokens));
  bool use_window = true;
  KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "use_sliding_window", &use_window));
  if (config.contains("layer_types") && !config["layer_types"].is_null()) {
    const json& types = config["layer_types"];
    if (!types.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": layer_types is not a list"));
    }
    for (const json& t : types) {
      if (t == "full_attention" || t == "attention") {
        c->layer_kinds.push_back(LayerKind::kFullAttention);
      } else if (t == "sliding_attention") {
        c->layer_kinds.push_back(LayerKind::kSlidingAttention);
      } else if (t == "mamba") {
        c->layer_kinds.push_back(LayerKind::kStateSpace);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": layer_types entry ", t.dump(),
                         " unsupported (full_attention, attention, sliding_attention or mamba)"));
      }
    }
  } else if (config.contains("layers_block_type") && !config["layers_block_type"].is_null()) {
    // Bamba: "mamba" or "attention" per layer.
    const json& types = config["layers_block_type"];
    if (!types.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": layers_block_type is not a list"));
    }
    for (const json& t : types) {
      if (t != "mamba" && t != "attention") {
        return absl::InvalidArgumentError(absl::StrCat(path, ": layers_block_type entry ", t.dump(),
                                                       " unsupported (mamba or attention)"));
      }
      c->layer_kinds.push_back(t == "mamba" ? LayerKind::kStateSpace : LayerKind::kFullAttention);
    }
  } else if (c->sliding_window > 0 && use_window) {
    c->layer_kinds.assign(static_cast<size_t>(std::max(c->num_layers, 0)),
                          LayerKind::kSlidingAttention);
  }
  if (std::find(c->layer_kinds.begin(), c->layer_kinds.end(), LayerKind::kSlidingAttention) ==
      c->layer_kinds.end()) {
    c->sliding_window = 0;  // a window no layer uses (Qwen2's) changes nothing
    c->sink_tokens = 0;
  }
  return absl::OkStatus();
}

// The state-space layers' shape as Bamba writes it (mamba_*), read only when some layer is one.
// mamba_d_head "auto" (or absent) is mamba_expand (default 2) * hidden_size / mamba_n_heads.
absl::Status ParseSsm(const json& config, const std::string& path, ModelConfig* c) {
  if (c->num_state_layers() == 0) return absl::OkStatus();
  SsmConfig& m = c->ssm;
  m.num_groups = 1;
  m.conv_width = 4;
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_n_heads", true, &m.num_heads));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_d_state", true, &m.d_state));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_n_groups", false, &m.num_groups));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_d_conv", false, &m.conv_width));
  if (config.contains("mamba_d_head") && config["mamba_d_head"] != "auto") {
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_d_head", true, &m.head_dim));
  } else {
    int32_t expand = 2;
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_expand", false, &expand));
    if (m.num_heads > 0)
      m.head_dim = static_cast<int32_t>(int64_t{expand} * c->hidden_size / m.num_heads);
  }
  // Variants this mixer does not compute: biases on the projections, a conv without one.
  if (config.contains("mamba_proj_bias") && config["mamba_proj_bias"] == true) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": mamba_proj_bias unsupported"));
  }
  if (config.contains("mamba_conv_bias") && config["mamba_conv_bias"] == false) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": mamba_conv_bias false unsupported (the conv has a bias)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseConfig(const std::string& text, const std::string& path) {
  const json config = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a well-formed JSON object"));
  }
  // Defaults are LlamaConfig's, except max_position_embeddings (ours: kvpoold's tiny model).
  ModelConfig c{.rms_norm_eps = 1e-6f, .rope_theta = 10000.0f, .max_position = 4096};
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "vocab_size", true, &c.vocab_size));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "hidden_size", true, &c.hidden_size));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "intermediate_size", true, &c.intermediate_size));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "num_hidden_layers", true, &c.num_layers));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "num_attention_heads", true, &c.num_heads));
  c.num_kv_heads = c.num_heads;
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "num_key_value_heads", false, &c.num_kv_heads));
  if (c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "head_dim", false, &c.head_dim));
  KVPOOL_RETURN_IF_ERROR(GetFloat(config, path, "rms_norm_eps", &c.rms_norm_eps));
  KVPOOL_RETURN_IF_ERROR(GetFloat(config, path, "rope_theta", &c.rope_theta));
  KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "tie_word_embeddings", &c.tie_word_embeddings));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "max_position_embeddings", false, &c.max_position));

  // Variants this model does not implement would load and then compute something else; refuse.
  if (config.contains("hidden_act") && config["hidden_act"] != "silu") {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": hidden_act ", config["hidden_act"].dump(), " unsupported (silu only)"));
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (config.contains(key) && config[key] != false && !config[key].is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " unsupported"));
    }
  }
  if (config.contains("rope_scaling") && !config["rope_scaling"].is_null()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": rope_scaling unsupported"));
  }
  KVPOOL_RETURN_IF_ERROR(ParseLayerKinds(config, path, &c));
  KVPOOL_RETURN_IF_ERROR(ParseSsm(config, path, &c));
  if (absl::Status status = ValidateConfig(c); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", status.message()));
  }
  return c;
}

// The decimal a person would write for `value` (1e-05, not 9.99999974737875e-06), as a double
// that still reads back as exactly `value` once narrowed to float.
double ShortestDecimal(float value) {
  char buffer[64];
  const auto printed = std::to_chars(buffer, buffer + sizeof(buffer), value);
  double parsed = 0.0;
  std::from_chars(buffer, printed.ptr, parsed);
  return parsed;
}

std::string ConfigJson(const ModelConfig& c, std::string_view torch_dtype) {
  json config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"torch_dtype", std::string(torch_dtype)},
      {"hidden_act", "silu"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"rms_norm_eps", ShortestDecimal(c.rms_norm_eps)},
      {"rope_theta", ShortestDecimal(c.rope_theta)},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"max_position_embeddings", c.max_position},
  };
  if (!c.layer_kinds.empty()) {
    json types = json::array();
    for (LayerKind kind : c.layer_kinds) {
      switch (kind) {
        case LayerKind::kFullAttention:
          types.push_back("full_attention");
          break;
        case LayerKind::kSlidingAttention:
          types.push_back("sliding_attention");
          break;
        case LayerKind::kStateSpace:
          types.push_back("mamba");
          break;
      }
    }
    config["layer_types"] = types;
    config["sliding_window"] = c.sliding_window;
    if (c.sink_tokens > 0) config["kvpool_sink_tokens"] = c.sink_tokens;
  }
  if (c.num_state_layers() > 0) {
    config["mamba_n_heads"] = c.ssm.num_heads;
    config["mamba_d_head"] = c.ssm.head_dim;
    config["mamba_d_state"] = c.ssm.d_state;
    config["mamba_n_groups"] = c.ssm.num_groups;
    config["mamba_d_conv"] = c.ssm.conv_width;
    config["mamba_conv_bias"] = true;
    config["mamba_proj_bias"] = false;
  }
  return config.dump(2) + "\n";
}

absl::Status PositiveField(std::string_view field, int32_t value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("ModelConfig.", std::string(field), " must be positive (got ", value, ")"));
}

absl::Status PositiveFiniteField(std::string_view field, float value) {
  if (value > 0.0f && std::isfinite(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("ModelConfig.", std::string(field),
                                                 " must be positive and finite (got ", value, ")"));
}

absl::Status ValidateSsm(const ModelConfig& c);

absl::Status ValidateLayerKinds(const ModelConfig& c) {
  if (!c.layer_kinds.empty() && c.layer_kinds.size() != static_cast<size_t>(c.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("ModelConfig.layer_kinds has ",
                                                   c.layer_kinds.size(), " entries for ",
                                                   c.num_layers, " layers"));
  }
  const bool slides = std::find(c.layer_kinds.begin(), c.layer_kinds.end(),
                                LayerKind::kSlidingAttention) != c.layer_kinds.end();
  if (slides && c.sliding_window <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ModelConfig.sliding_window must be positive with a sliding layer (got ",
                     c.sliding_window, ")"));
  }
  if (c.sliding_window < 0 || c.sink_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ModelConfig.sliding_window (", c.sliding_window,
                                                   ") and sink_tokens (", c.sink_tokens,
                                                   ") must be >= 0"));
  }
  return ValidateSsm(c);
}

// A state-space layer needs every ssm field; a model without one must leave them unset (a shape
// nothing uses would still be saved, compared and sized as if it did).
absl::Status ValidateSsm(const ModelConfig& c) {
  const SsmConfig& m = c.ssm;
  if (c.num_state_layers() == 0) {
    if (m == SsmConfig{}) return absl::OkStatus();
    return absl::InvalidArgumentError("ModelConfig.ssm is set but no layer is a state-space layer");
  }
  KVPOOL_RETURN_IF_ERROR(PositiveField("ssm.num_heads", m.num_heads));
  KVPOOL_RETURN_IF_ERROR(PositiveField("ssm.head_dim", m.head_dim));
  KVPOOL_RETURN_IF_ERROR(PositiveField("ssm.d_state", m.d_state));
  KVPOOL_RETURN_IF_ERROR(PositiveField("ssm.num_groups", m.num_groups));
  KVPOOL_RETURN_IF_ERROR(PositiveField("ssm.conv_width", m.conv_width));
  if (m.num_heads % m.num_groups != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ModelConfig.ssm.num_groups (", m.num_groups,
                                                   ") must divide ssm.num_heads (", m.num_heads,
                                                   ")"));
  }
  // Every buffer of a step is indexed in int32 rows of these widths.
  if (m.in_proj_dim() > INT32_MAX / 4 || m.state_floats() > INT32_MAX / 4) {
    return absl::InvalidArgumentError("ModelConfig.ssm is too large");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateConfig(const ModelConfig& c) {
  KVPOOL_RETURN_IF_ERROR(PositiveField("vocab_size", c.vocab_size));
  KVPOOL_RETURN_IF_ERROR(PositiveField("hidden_size", c.hidden_size));
  KVPOOL_RETURN_IF_ERROR(PositiveField("intermediate_size", c.intermediate_size));
  KVPOOL_RETURN_IF_ERROR(PositiveField("num_layers", c.num_layers));
  KVPOOL_RETURN_IF_ERROR(PositiveField("num_heads", c.num_heads));
  KVPOOL_RETURN_IF_ERROR(PositiveField("num_kv_heads", c.num_kv_heads));
  KVPOOL_RETURN_IF_ERROR(PositiveField("head_dim", c.head_dim));
  KVPOOL_RETURN_IF_ERROR(PositiveField("max_position", c.max_position));
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ModelConfig.num_kv_heads (", c.num_kv_heads,
                                                   ") must divide num_heads (", c.num_heads, ")"));
  }
  // RoPE rotates pairs of dimensions; kernels vectorize head_dim in groups of 8.
  if (c.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ModelConfig.head_dim must be a multiple of 8 (got ", c.head_dim, ")"));
  }
  KVPOOL_RETURN_IF_ERROR(PositiveFiniteField("rms_norm_eps", c.rms_norm_eps));
  KVPOOL_RETURN_IF_ERROR(PositiveFiniteField("rope_theta", c.rope_theta));
  return ValidateLayerKinds(c);
}

absl::StatusOr<ModelConfig> NamedConfig(std::string_view name) {
  if (name == "tiny-hybrid") {
    ModelConfig c = *NamedConfig("tiny");
    c.layer_kinds = {LayerKind::kStateSpace, LayerKind::kStateSpace, LayerKind::kFullAttention,
                     LayerKind::kStateSpace};
    c.ssm = {.num_heads = 16, .head_dim = 64, .d_state = 128, .num_groups = 1, .conv_width = 4};
    return c;
  }
  if (name == "tiny-swa") {
    ModelConfig c = *NamedConfig("tiny");
    for (int32_t l = 0; l < c.num_layers; ++l) {
      c.layer_kinds.push_back(l % 2 == 0 ? LayerKind::kSlidingAttention
                                         : LayerKind::kFullAttention);
    }
    c.sliding_window = 256;
    return c;
  }
  if (name == "tiny") {
    return ModelConfig{.vocab_size = 8192,
                       .hidden_size = 512,
                       .intermediate_size = 1408,
                       .num_layers = 4,
                       .num_heads = 8,
                       .num_kv_heads = 4,
                       .head_dim = 64,
                       .rms_norm_eps = 1e-5f,
                       .rope_theta = 10000.0f,
                       .tie_word_embeddings = true,
                       .max_position = 4096};
  }
  if (name == "small") {
    return ModelConfig{.vocab_size = 32000,
                       .hidden_size = 1024,
                       .intermediate_size = 2816,
                       .num_layers = 8,
                       .num_heads = 16,
                       .num_kv_heads = 4,
                       .head_dim = 64,
                       .rms_norm_eps = 1e-5f,
                       .rope_theta = 10000.0f,
                       .tie_word_embeddings = false,
                       .max_position = 8192};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model size '", std::string(name),
                   "'; known sizes: tiny, small, tiny-swa, tiny-hybrid"));
}

absl::StatusOr<ModelConfig> ReadCheckpointConfig(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  KVPOOL_ASSIGN_OR_RETURN(const std::string text, internal::ReadWholeFile(path));
  return ParseConfig(text, path);
}

absl::StatusOr<ModelWeights> LoadCheckpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  KVPOOL_ASSIGN_OR_RETURN(const ModelConfig config, ReadCheckpointConfig(dir));

  std::error_code ec;
  std::vector<std::string> paths;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const fs::path& path = it->path();
    std::error_code entry_ec;  // a dangling link or a vanished file is skipped, not fatal
    if (path.extension() == ".safetensors" && it->is_regular_file(entry_ec)) {
      paths.push_back(path.string());
    }
  }
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  }
  if (paths.empty()) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " has no *.safetensors"));
  }
  std::sort(paths.begin(), paths.end());

  // Index every tensor of every file; a name in two files is ambiguous, so it is an error.
  std::vector<std::unique_ptr<internal::SafetensorsFile>> files;
  std::map<std::string, std::pair<const internal::SafetensorsFile*, const internal::TensorEntry*>>
      index;
  for (const std::string& path : paths) {
    KVPOOL_ASSIGN_OR_RETURN(files.emplace_back(), internal::SafetensorsFile::Open(path));
    const internal::SafetensorsFile* file = files.back().get();
    for (const auto& [name, entry] : file->tensors()) {
      const auto [at, inserted] = index.try_emplace(name, file, &entry);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " appears in both ",
                                                       at->second.first->path(), " and ", path));
      }
    }
  }

  // The weights and their slots are sized by config.json: a layer count the files cannot hold
  // (num_hidden_layers 2000000000 would ask for hundreds of GB) is refused before that.
  if (int64_t{config.num_layers} * kTensorsPerLayer > static_cast<int64_t>(index.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, ": config.json says ", config.num_layers, " layers of ", kTensorsPerLayer,
        " tensors each, but the *.safetensors files hold only ", index.size(), " tensors"));
  }
  ModelWeights weights;
  weights.config = config;
  weights.layers.resize(static_cast<size_t>(config.num_layers));
  for (const auto& slot : TensorSlots(weights)) {
    const auto found = index.find(slot.name);
    if (found == index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, ": tensor ", slot.name, " is in no *.safetensors file"));
    }
    const auto& [file, entry] = found->second;
    if (entry->shape != slot.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(file->path(), ": tensor ", slot.name, " has shape ", ShapeText(entry->shape),
                       "; config.json implies ", ShapeText(slot.shape)));
    }
    KVPOOL_RETURN_IF_ERROR(file->ReadAsF32(slot.name, *entry, slot.data));
  }
  return weights;
}

absl::Status SaveCheckpoint(const ModelWeights& weights, const std::string& dir,
                            std::string_view dtype) {
  namespace fs = std::filesystem;
  struct DtypeNames {
    std::string_view flag, safetensors, torch;
  };
  static constexpr DtypeNames kDtypes[] = {
      {"f32", "F32", "float32"}, {"f16", "F16", "float16"}, {"bf16", "BF16", "bfloat16"}};
  const auto names = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                                  [&](const DtypeNames& d) { return d.flag == dtype; });
  if (names == std::end(kDtypes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint dtype '", std::string(dtype), "' is not f32, f16 or bf16"));
  }

  // A mis-sized vector would write a file whose header lies about its data.
  KVPOOL_RETURN_IF_ERROR(ValidateConfig(weights.config));
  if (weights.layers.size() != static_cast<size_t>(weights.config.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("weights have ", weights.layers.size(),
                                                   " layers; config says ",
                                                   weights.config.num_layers));
  }
  std::vector<internal::TensorToWrite> tensors;
  for (const auto& slot : TensorSlots(weights)) {
    if (static_cast<int64_t>(slot.data->size()) != NumElements(slot.shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", slot.name, " holds ", slot.data->size(), " values; shape ",
                       ShapeText(slot.shape), " needs ", NumElements(slot.shape)));
    }
    tensors.push_back({slot.name, slot.shape, slot.data->data()});
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
  }
  KVPOOL_RETURN_IF_ERROR(internal::WriteWholeFile((fs::path(dir) / "config.json").string(),
                                                  ConfigJson(weights.config, names->torch)));
  return internal::WriteSafetensors((fs::path(dir) / "model.safetensors").string(), tensors,
                                    names->safetensors, {{"format", "pt"}});
}

}  // namespace kvpool::model
