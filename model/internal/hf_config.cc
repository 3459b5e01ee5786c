// config.json as transformers writes it (hf_config.h).

#include "model/internal/hf_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvpool/util/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvpool::model::internal {
namespace {

using nlohmann::json;

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

absl::Status GetDouble(const json& config, const std::string& path, const char* key, double* out) {
  if (!config.contains(key) || config[key].is_null()) return absl::OkStatus();
  const json& v = config[key];
  if (!v.is_number() || !std::isfinite(v.get<double>())) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", key, " ", v.dump(), " is not a finite number"));
  }
  *out = v.get<double>();
  return absl::OkStatus();
}

absl::Status GetFloat(const json& config, const std::string& path, const char* key, float* out) {
  double value = *out;
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, key, &value));
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

// Bamba's attn_layer_indices (what its config.json holds; layers_block_type is a property
// derived from it): the listed layers are full attention, every other one state-space, all of
// them when the list is absent or null.
absl::Status ParseAttentionIndices(const json& config, const std::string& path, ModelConfig* c) {
  c->layer_kinds.assign(static_cast<size_t>(std::max(c->num_layers, 0)), LayerKind::kStateSpace);
  if (!config.contains("attn_layer_indices") || config["attn_layer_indices"].is_null()) {
    return absl::OkStatus();
  }
  const json& indices = config["attn_layer_indices"];
  if (!indices.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": attn_layer_indices is not a list"));
  }
  for (const json& i : indices) {
    if (!i.is_number_integer() || i.get<int64_t>() < 0 || i.get<int64_t>() >= c->num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": attn_layer_indices entry ", i.dump(),
                                                     " is not a layer of [0, ", c->num_layers,
                                                     ")"));
    }
    c->layer_kinds[i.get<size_t>()] = LayerKind::kFullAttention;
  }
  return absl::OkStatus();
}

// Sliding windows as transformers writes them: `layer_types` names each layer's attention
// (Gemma 3, gpt-oss, Qwen3); without it a `sliding_window` applies to every layer (Mistral),
// unless `use_sliding_window` is false (Qwen2 writes a window it does not use).
absl::Status ParseLayerKinds(const json& config, const std::string& path, bool bamba,
                             ModelConfig* c) {
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
  } else if (bamba ||
             (config.contains("attn_layer_indices") && !config["attn_layer_indices"].is_null())) {
    KVPOOL_RETURN_IF_ERROR(ParseAttentionIndices(config, path, c));
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

absl::Status ParseNormAndDtLimit(const json& config, const std::string& path, ModelConfig* c);

// Whether mamba_d_head is a number rather than "auto" or absent (each model derives "auto" its
// own way).
bool HeadGiven(const json& config) {
  return config.contains("mamba_d_head") && config["mamba_d_head"] != "auto";
}

// The mamba_* fields Bamba and Falcon-H1 spell alike: heads, d_state, groups, conv width, the
// head width when HeadGiven, the conv and projection biases. `required`: mamba_n_heads and
// mamba_d_state must be there (Bamba's); else *m holds the defaults (FalconH1Config's).
absl::Status ReadMambaFields(const json& config, const std::string& path, bool required,
                             SsmConfig* m) {
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_n_heads", required, &m->num_heads));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_d_state", required, &m->d_state));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_n_groups", false, &m->num_groups));
  KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_d_conv", false, &m->conv_width));
  if (HeadGiven(config)) {
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_d_head", true, &m->head_dim));
  }
  KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "mamba_conv_bias", &m->conv_bias));
  return GetBool(config, path, "mamba_proj_bias", &m->proj_bias);
}

// The state-space layers' shape as Bamba writes it (mamba_*), read only when some layer is one.
// mamba_d_head "auto" (or absent) is mamba_expand (default 2) * hidden_size / mamba_n_heads.
// mamba_chunk_size only changes how a chunked scan rounds; kvpool's scans pick their own.
absl::Status ParseSsm(const json& config, const std::string& path, bool nemotron, ModelConfig* c) {
  if (c->num_state_layers() == 0) return absl::OkStatus();
  SsmConfig& m = c->ssm;
  m.num_groups = 1;
  m.conv_width = 4;
  if (nemotron) {
    // NemotronHConfig's names and defaults (Nemotron-H-8B's shape).
    m = {.num_heads = 128, .head_dim = 64, .d_state = 128, .num_groups = 8, .conv_width = 4};
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_num_heads", false, &m.num_heads));
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_head_dim", false, &m.head_dim));
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "ssm_state_size", false, &m.d_state));
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "n_groups", false, &m.num_groups));
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "conv_kernel", false, &m.conv_width));
    KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "use_conv_bias", &m.conv_bias));
    KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "use_bias", &m.proj_bias));
    if (config.contains("mamba_hidden_act") && config["mamba_hidden_act"] != "silu") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": mamba_hidden_act ",
                                                     config["mamba_hidden_act"].dump(),
                                                     " unsupported (silu only)"));
    }
    return ParseNormAndDtLimit(config, path, c);
  }
  KVPOOL_RETURN_IF_ERROR(ReadMambaFields(config, path, /*required=*/true, &m));
  if (!HeadGiven(config)) {
    int32_t expand = 2;
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_expand", false, &expand));
    if (m.num_heads > 0)
      m.head_dim = static_cast<int32_t>(int64_t{expand} * c->hidden_size / m.num_heads);
  }
  return ParseNormAndDtLimit(config, path, c);
}

// The gated norm's span and the dt clamp, spelled the same by Bamba and Nemotron-H.
absl::Status ParseNormAndDtLimit(const json& config, const std::string& path, ModelConfig* c) {
  SsmConfig& m = c->ssm;
  // The gated norm per B/C group, as mamba_ssm's Mamba2 trained Bamba and as vLLM and SGLang
  // serve it (Mixer2RMSNormGated). transformers' BambaRMSNormGated spans all of inner instead;
  // the two agree for every released Bamba (one group). kvpool's own key picks the other.
  m.norm_per_group = true;
  KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "kvpool_ssm_norm_per_group", &m.norm_per_group));
  if (m.num_groups == 1) m.norm_per_group = true;  // one group: the same norm either way
  // Bamba's dt clamp: the default (0, inf) clamps nothing; a real limit is not computed here.
  if (config.contains("time_step_limit") && !config["time_step_limit"].is_null()) {
    const json& limit = config["time_step_limit"];
    const bool none =
        limit.is_array() && limit.size() == 2 && limit[0].is_number() &&
        limit[0].get<double>() == 0.0 &&
        (!limit[1].is_number() || limit[1].get<double>() >= std::numeric_limits<float>::max());
    if (!none) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": time_step_limit ", limit.dump(),
                                                     " unsupported (dt is not clamped)"));
    }
  }
  return absl::OkStatus();
}

// RoPE over part of each head: `partial_rotary_factor` (transformers' key), or Bamba's
// `attn_rotary_emb` (the rotated width itself), else Bamba's 0.5 (its config class sets it for
// every checkpoint).
absl::Status ParseRotary(const json& config, const std::string& path, bool bamba, ModelConfig* c) {
  if (bamba && config.contains("attn_rotary_emb") && !config["attn_rotary_emb"].is_null()) {
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "attn_rotary_emb", true, &c->rotary_dim));
  } else if (config.contains("partial_rotary_factor") &&
             !config["partial_rotary_factor"].is_null()) {
    const json& f = config["partial_rotary_factor"];
    if (!f.is_number() || !(f.get<double>() > 0.0 && f.get<double>() <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": partial_rotary_factor ", f.dump(), " is not in (0, 1]"));
    }
    // transformers truncates head_dim * factor; the margin absorbs a factor written as r / d.
    c->rotary_dim = static_cast<int32_t>(std::floor(c->head_dim * f.get<double>() + 1e-6));
    if (c->rotary_dim == 0) {  // 0 would read as "all of the head"
      return absl::InvalidArgumentError(absl::StrCat(path, ": partial_rotary_factor ", f.dump(),
                                                     " rotates no value of a head of ",
                                                     c->head_dim));
    }
  } else if (bamba) {
    c->rotary_dim = c->head_dim / 2;
  }
  if (c->rotary_dim == c->head_dim) c->rotary_dim = 0;
  return absl::OkStatus();
}

// Nemotron-H's layers (NemotronHConfig): `hybrid_override_pattern` names each layer, M a
// Mamba-2 mixer, * attention (without RoPE), - an MLP (squared ReLU, no gate); each layer is one
// norm, its mixer or MLP, and the residual. E (mixture of experts) is not built here.
absl::Status ParseNemotronHLayers(const json& config, const std::string& path, ModelConfig* c) {
  c->mlp_after_mixer = false;
  c->mlp_activation = MlpActivation::kReluSquared;
  c->rope = false;
  if (!config.contains("hybrid_override_pattern") ||
      !config["hybrid_override_pattern"].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": hybrid_override_pattern is missing or not a string"));
  }
  const std::string pattern = config["hybrid_override_pattern"].get<std::string>();
  if (pattern.size() != static_cast<size_t>(std::max(c->num_layers, 0))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": hybrid_override_pattern has ",
                                                   pattern.size(), " layers, num_hidden_layers ",
                                                   c->num_layers));
  }
  for (const char ch : pattern) {
    switch (ch) {
      case 'M':
        c->layer_kinds.push_back(LayerKind::kStateSpace);
        break;
      case '*':
        c->layer_kinds.push_back(LayerKind::kFullAttention);
        break;
      case '-':
        c->layer_kinds.push_back(LayerKind::kMlp);
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": hybrid_override_pattern layer '", std::string(1, ch),
                         "' unsupported (M, * or -; E, mixture of experts, is not built)"));
    }
  }
  if (config.contains("mlp_hidden_act") && config["mlp_hidden_act"] != "relu2") {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": mlp_hidden_act ", config["mlp_hidden_act"].dump(), " unsupported (relu2 only)"));
  }
  if (config.contains("sliding_window") && !config["sliding_window"].is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": sliding_window unsupported for nemotron_h"));
  }
  // The attention heads' width: head_dim, or the older attention_head_dim (default 128).
  if (!config.contains("head_dim") || config["head_dim"].is_null()) {
    c->head_dim = 128;
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "attention_head_dim", false, &c->head_dim));
  }
  return GetFloat(config, path, "layer_norm_epsilon", &c->rms_norm_eps);
}

bool IsNemotronH(const json& config) {
  if (config.contains("model_type") && config["model_type"] == "nemotron_h") return true;
  if (!config.contains("architectures") || !config["architectures"].is_array()) return false;
  const json& a = config["architectures"];
  return std::find(a.begin(), a.end(), "NemotronHForCausalLM") != a.end();
}

bool IsBamba(const json& config) {
  if (config.contains("model_type") && config["model_type"] == "bamba") return true;
  if (!config.contains("architectures") || !config["architectures"].is_array()) return false;
  const json& a = config["architectures"];
  return std::find(a.begin(), a.end(), "BambaForCausalLM") != a.end();
}

// transformers 5 writes RoPE's settings as rope_parameters ({"rope_type": "default",
// "rope_theta": ...}); a top-level rope_theta, where both are written, is the same value.
absl::Status ParseRopeParameters(const json& config, const std::string& path, ModelConfig* c) {
  if (!config.contains("rope_parameters") || config["rope_parameters"].is_null()) {
    return absl::OkStatus();
  }
  const json& rope = config["rope_parameters"];
  if (!rope.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": rope_parameters is not an object"));
  }
  if (rope.contains("rope_type") && rope["rope_type"] != "default") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": rope_parameters.rope_type ",
                                                   rope["rope_type"].dump(),
                                                   " unsupported (default only)"));
  }
  if (config.contains("rope_theta") && !config["rope_theta"].is_null()) return absl::OkStatus();
  return GetFloat(rope, path, "rope_theta", &c->rope_theta);
}

bool IsFalconH1(const json& config) {
  if (config.contains("model_type") && config["model_type"] == "falcon_h1") return true;
  if (!config.contains("architectures") || !config["architectures"].is_array()) return false;
  const json& a = config["architectures"];
  return std::find(a.begin(), a.end(), "FalconH1ForCausalLM") != a.end();
}

// A list of `n` multipliers (null or absent: all 1).
absl::Status GetDoubles(const json& config, const std::string& path, const char* key, size_t n,
                        double* out) {
  if (!config.contains(key) || config[key].is_null()) return absl::OkStatus();
  const json& v = config[key];
  if (!v.is_array() || v.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", key, " ", v.dump(), " is not a list of ", n, " numbers"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!v[i].is_number() || !std::isfinite(v[i].get<double>())) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", key, " ", v.dump(), " is not a list of finite numbers"));
    }
    out[i] = v[i].get<double>();
  }
  return absl::OkStatus();
}

// Falcon-H1 (FalconH1Config): every layer attention and a Mamba-2 mixer in parallel, then a
// SwiGLU MLP; the mixer's gated norm optional (mamba_rms_norm) and per group; muP multipliers.
absl::Status ParseFalconH1(const json& config, const std::string& path, ModelConfig* c,
                           Multipliers* mult) {
  c->layer_kinds.assign(static_cast<size_t>(std::max(c->num_layers, 0)),
                        LayerKind::kParallelHybrid);
  if (config.contains("sliding_window") && !config["sliding_window"].is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": sliding_window unsupported for falcon_h1"));
  }
  SsmConfig& m = c->ssm;
  m = {.num_heads = 128, .head_dim = 0, .d_state = 256, .num_groups = 1, .conv_width = 4};
  // mamba_d_ssm: FalconH1Config's default is 1024 when the key is absent; null means
  // mamba_expand * hidden_size.
  int32_t d_ssm = 1024;
  if (config.contains("mamba_d_ssm") && config["mamba_d_ssm"].is_null()) {
    int32_t expand = 2;
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_expand", false, &expand));
    d_ssm = static_cast<int32_t>(
        std::clamp<int64_t>(int64_t{expand} * c->hidden_size, INT32_MIN, INT32_MAX));
  } else {
    KVPOOL_RETURN_IF_ERROR(GetInt(config, path, "mamba_d_ssm", false, &d_ssm));
  }
  KVPOOL_RETURN_IF_ERROR(ReadMambaFields(config, path, /*required=*/false, &m));
  if (!HeadGiven(config) && m.num_heads > 0) m.head_dim = d_ssm / m.num_heads;
  if (int64_t{m.head_dim} * m.num_heads != d_ssm) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": mamba_d_ssm ", d_ssm,
                                                   " is not mamba_n_heads ", m.num_heads,
                                                   " x mamba_d_head ", m.head_dim));
  }
  // transformers gives in_proj mamba_proj_bias and out_proj projectors_bias (vLLM both the
  // first); kvpool has one switch for both, so they must agree (every release: false, false).
  bool out_bias = false;
  KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "projectors_bias", &out_bias));
  if (out_bias != m.proj_bias) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": mamba_proj_bias and projectors_bias differ (unsupported: both or neither)"));
  }
  m.gated_norm = false;
  KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "mamba_rms_norm", &m.gated_norm));
  // FalconH1Config's default is true; every released checkpoint with the norm says false
  // (gate, then the norm per group, as Mamba-2 and vLLM compute it).
  bool norm_before_gate = true;
  KVPOOL_RETURN_IF_ERROR(GetBool(config, path, "mamba_norm_before_gate", &norm_before_gate));
  if (m.gated_norm && norm_before_gate) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": mamba_rms_norm with mamba_norm_before_gate true unsupported (the mixer gates, "
        "then normalizes: mamba_norm_before_gate false)"));
  }
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, "embedding_multiplier", &mult->embedding));
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, "lm_head_multiplier", &mult->lm_head));
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, "attention_in_multiplier", &mult->attention_in));
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, "attention_out_multiplier", &mult->attention_out));
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, "key_multiplier", &mult->key));
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, "ssm_in_multiplier", &mult->ssm_in));
  KVPOOL_RETURN_IF_ERROR(GetDouble(config, path, "ssm_out_multiplier", &mult->ssm_out));
  KVPOOL_RETURN_IF_ERROR(GetDoubles(config, path, "ssm_multipliers", 5, mult->ssm));
  double mlp[2] = {1.0, 1.0};
  KVPOOL_RETURN_IF_ERROR(GetDoubles(config, path, "mlp_multipliers", 2, mlp));
  mult->mlp_gate = mlp[0];
  mult->mlp_down = mlp[1];
  return absl::OkStatus();
}

// Mamba hybrids whose layers this decoder does not have: Jamba (Mamba-1 mixers, MoE), Zamba2
// (shared attention blocks). Refused by name rather than misread as Llama.
absl::Status RefuseOtherHybrids(const json& config, const std::string& path) {
  if (!config.contains("model_type") || !config["model_type"].is_string()) {
    return absl::OkStatus();
  }
  const std::string type = config["model_type"].get<std::string>();
  for (const char* other : {"jamba", "zamba2"}) {
    if (type == other) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": model_type \"", type,
          "\" unsupported (Llama-style, Bamba, Nemotron-H and Falcon-H1 hybrids only)"));
    }
  }
  return absl::OkStatus();
}

// transformers writes config.json with Python's json module, which spells an infinite float
// Infinity (BambaConfig's default time_step_limit is [0.0, Infinity]) and a NaN NaN: not JSON.
// Outside strings those words become null, which every reader here takes as "not given".
std::string PythonJsonToJson(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      out += ch;
      if (ch == '\\' && i + 1 < text.size()) {
        out += text[++i];
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    if (ch == '"') in_string = true;
    bool replaced = false;
    for (std::string_view word : {"-Infinity", "Infinity", "NaN"}) {
      if (text.compare(i, word.size(), word) == 0) {
        out += "null";
        i += word.size() - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += ch;
  }
  return out;
}

}  // namespace

absl::StatusOr<ParsedConfig> ParseConfig(const std::string& text, const std::string& path) {
  const json config = json::parse(PythonJsonToJson(text), nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a well-formed JSON object"));
  }
  KVPOOL_RETURN_IF_ERROR(RefuseOtherHybrids(config, path));
  const bool nemotron = IsNemotronH(config);
  const bool falcon = !nemotron && IsFalconH1(config);
  const bool bamba = !nemotron && !falcon && IsBamba(config);
  // Defaults are LlamaConfig's (BambaConfig's, NemotronHConfig's and FalconH1Config's
  // rms_norm_eps for those; FalconH1Config's rope_theta), except max_position_embeddings (ours:
  // kvpoold's tiny model).
  ModelConfig c{.rms_norm_eps = bamba || nemotron || falcon ? 1e-5f : 1e-6f,
                .rope_theta = falcon ? 100000.0f : 10000.0f,
                .max_position = 4096};
  Multipliers multipliers;
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
  if (!nemotron && config.contains("hidden_act") && config["hidden_act"] != "silu") {
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
  KVPOOL_RETURN_IF_ERROR(ParseRopeParameters(config, path, &c));
  if (nemotron) {
    KVPOOL_RETURN_IF_ERROR(ParseNemotronHLayers(config, path, &c));
    KVPOOL_RETURN_IF_ERROR(ParseSsm(config, path, nemotron, &c));
  } else if (falcon) {
    KVPOOL_RETURN_IF_ERROR(ParseFalconH1(config, path, &c, &multipliers));
    KVPOOL_RETURN_IF_ERROR(ParseNormAndDtLimit(config, path, &c));
  } else {
    KVPOOL_RETURN_IF_ERROR(ParseRotary(config, path, bamba, &c));
    KVPOOL_RETURN_IF_ERROR(ParseLayerKinds(config, path, bamba, &c));
    KVPOOL_RETURN_IF_ERROR(ParseSsm(config, path, nemotron, &c));
  }
  if (absl::Status status = ValidateConfig(c); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", status.message()));
  }
  Names names = Names::kLlama;
  if (bamba) names = Names::kBamba;
  if (nemotron) names = Names::kNemotronH;
  if (falcon) names = Names::kFalconH1;
  return ParsedConfig{.config = std::move(c), .names = names, .multipliers = multipliers};
}

namespace {

// The decimal a person would write for `value` (1e-05, not 9.99999974737875e-06), as a double
// that still reads back as exactly `value` once narrowed to float.
double ShortestDecimal(float value) {
  char buffer[64];
  const auto printed = std::to_chars(buffer, buffer + sizeof(buffer), value);
  double parsed = 0.0;
  std::from_chars(buffer, printed.ptr, parsed);
  return parsed;
}

}  // namespace

absl::Status ConfigExpressible(const ModelConfig& c) {
  const bool parallel = std::find(c.layer_kinds.begin(), c.layer_kinds.end(),
                                  LayerKind::kParallelHybrid) != c.layer_kinds.end();
  if (parallel) {
    const bool all = std::all_of(c.layer_kinds.begin(), c.layer_kinds.end(),
                                 [](LayerKind k) { return k == LayerKind::kParallelHybrid; });
    if (all && c.mlp_after_mixer && c.gated_mlp() && c.rope && c.rotary_dim == 0 &&
        (c.ssm.norm_per_group || c.ssm.num_groups == 1)) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        "a model of parallel hybrid layers is written as Falcon-H1's config.json, whose layers "
        "are all parallel hybrids with a SwiGLU MLP, RoPE over the whole head and the mixer's "
        "norm per group");
  }
  if (c.mlp_after_mixer) {
    if (c.gated_mlp() && c.rope) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "a model with an MLP in every layer is written as Llama's or Bamba's config.json, whose "
        "MLPs are SwiGLU and whose attention has RoPE");
  }
  if (!c.gated_mlp() && !c.rope && c.num_sliding_layers() == 0 && c.rotary_dim == 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      "a model of one mixer or MLP per layer is written as Nemotron-H's config.json, whose MLPs "
      "are squared ReLU and whose attention has neither RoPE nor a sliding window");
}

namespace {

// The fields Llama's and Nemotron-H's config.json spell alike.
json SharedFields(const ModelConfig& c, std::string_view torch_dtype) {
  return {
      {"torch_dtype", std::string(torch_dtype)},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"max_position_embeddings", c.max_position},
  };
}

// Nemotron-H's config.json (NemotronHConfig's fields) for `c`.
json NemotronHConfigJson(const ModelConfig& c, std::string_view torch_dtype) {
  std::string pattern;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    pattern += c.kind(l) == LayerKind::kStateSpace ? 'M' : c.kind(l) == LayerKind::kMlp ? '-' : '*';
  }
  json config = SharedFields(c, torch_dtype);
  config.update({
      {"architectures", {"NemotronHForCausalLM"}},
      {"model_type", "nemotron_h"},
      {"hybrid_override_pattern", pattern},
      {"mlp_hidden_act", "relu2"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"layer_norm_epsilon", ShortestDecimal(c.rms_norm_eps)},
  });
  if (c.num_state_layers() > 0) {
    config["mamba_num_heads"] = c.ssm.num_heads;
    config["mamba_head_dim"] = c.ssm.head_dim;
    config["ssm_state_size"] = c.ssm.d_state;
    config["n_groups"] = c.ssm.num_groups;
    config["conv_kernel"] = c.ssm.conv_width;
    config["use_conv_bias"] = c.ssm.conv_bias;
    config["use_bias"] = c.ssm.proj_bias;
    config["mamba_hidden_act"] = "silu";
    if (!c.ssm.norm_per_group) config["kvpool_ssm_norm_per_group"] = false;
  }
  return config;
}

// Falcon-H1's config.json (FalconH1Config's fields) for `c`, every multiplier 1.
json FalconH1ConfigJson(const ModelConfig& c, std::string_view torch_dtype) {
  json config = SharedFields(c, torch_dtype);
  config.update({
      {"architectures", {"FalconH1ForCausalLM"}},
      {"model_type", "falcon_h1"},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"rms_norm_eps", ShortestDecimal(c.rms_norm_eps)},
      {"rope_theta", ShortestDecimal(c.rope_theta)},
      {"mamba_d_ssm", c.ssm.inner()},
      {"mamba_n_heads", c.ssm.num_heads},
      {"mamba_d_head", c.ssm.head_dim},
      {"mamba_n_groups", c.ssm.num_groups},
      {"mamba_d_state", c.ssm.d_state},
      {"mamba_d_conv", c.ssm.conv_width},
      {"mamba_conv_bias", c.ssm.conv_bias},
      {"mamba_proj_bias", c.ssm.proj_bias},
      {"projectors_bias", c.ssm.proj_bias},
      {"mamba_rms_norm", c.ssm.gated_norm},
      {"mamba_norm_before_gate", false},
  });
  return config;
}

}  // namespace

std::string ConfigJson(const ModelConfig& c, std::string_view torch_dtype) {
  if (IsNemotronHConfig(c)) return NemotronHConfigJson(c, torch_dtype).dump(2) + "\n";
  if (IsFalconH1Config(c)) return FalconH1ConfigJson(c, torch_dtype).dump(2) + "\n";
  json config = SharedFields(c, torch_dtype);
  config.update({
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_act", "silu"},
      {"rms_norm_eps", ShortestDecimal(c.rms_norm_eps)},
      {"rope_theta", ShortestDecimal(c.rope_theta)},
  });
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
        case LayerKind::kMlp:  // never here: ConfigExpressible
        case LayerKind::kParallelHybrid:
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
    config["mamba_conv_bias"] = c.ssm.conv_bias;
    config["mamba_proj_bias"] = c.ssm.proj_bias;
    if (!c.ssm.norm_per_group) config["kvpool_ssm_norm_per_group"] = false;
  }
  if (c.rotary_dim != 0) {
    config["partial_rotary_factor"] = static_cast<double>(c.rotary_dim) / c.head_dim;
  }
  return config.dump(2) + "\n";
}

}  // namespace kvpool::model::internal
