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
#include "model/internal/hf_config.h"
#include "model/internal/safetensors.h"

namespace kvpool::model {
namespace {

using internal::ConfigJson;
using internal::Names;
using internal::ParseConfig;
using internal::ParsedConfig;

// Every tensor of a checkpoint with its transformers name and [out][in] shape, bound to the
// vector that holds it. `Weights` is ModelWeights (loading) or const ModelWeights (saving);
// weights.layers must already hold config.num_layers entries. Each layer has at least
// kTensorsPerLayer (Nemotron-H's MLP layer that many, every other layer more). `prefix` is
// where Nemotron-H's tensors are ("backbone." or "model.").
constexpr int64_t kTensorsPerLayer = 3;
template <typename Weights>
auto TensorSlots(Weights& weights, Names names, std::string_view prefix = "backbone.") {
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
  const SsmConfig& m = c.ssm;
  const bool bamba = names == Names::kBamba;
  const bool nemotron = names == Names::kNemotronH;
  const bool falcon = names == Names::kFalconH1;
  const std::string top = nemotron ? std::string(prefix) : "model.";
  std::vector<Slot> slots;
  slots.push_back({top + (nemotron ? "embeddings.weight" : "embed_tokens.weight"),
                   {c.vocab_size, hidden},
                   &weights.embed});
  for (size_t i = 0; i < weights.layers.size(); ++i) {
    auto& layer = weights.layers[i];
    const auto l = static_cast<int32_t>(i);
    const std::string p = absl::StrCat(top, "layers.", i, ".");
    // Nemotron-H: one norm and one `mixer` per layer, whatever it is.
    const std::string mixer = nemotron ? p + "mixer." : p;
    if (c.kind(l) != LayerKind::kMlp) {
      slots.push_back(
          {p + (nemotron ? "norm.weight" : "input_layernorm.weight"), {hidden}, &layer.attn_norm});
    }
    if (c.has_state(l)) {
      // Bamba's (and Granite 4.0 hybrid's, Falcon-H1's) names for the Mamba-2 mixer, under mamba.
      const std::string s = nemotron ? mixer : p + "mamba.";
      slots.push_back({s + "in_proj.weight", {m.in_proj_dim(), hidden}, &layer.ssm_in});
      if (m.proj_bias) {
        slots.push_back({s + "in_proj.bias", {m.in_proj_dim()}, &layer.ssm_in_bias});
        slots.push_back({s + "out_proj.bias", {hidden}, &layer.ssm_out_bias});
      }
      slots.push_back({s + "conv1d.weight", {m.conv_dim(), 1, m.conv_width}, &layer.ssm_conv});
      if (m.conv_bias) {
        slots.push_back({s + "conv1d.bias", {m.conv_dim()}, &layer.ssm_conv_bias});
      }
      slots.push_back({s + "dt_bias", {m.num_heads}, &layer.ssm_dt_bias});
      slots.push_back({s + "A_log", {m.num_heads}, &layer.ssm_a_log});
      slots.push_back({s + "D", {m.num_heads}, &layer.ssm_d});
      if (m.gated_norm) slots.push_back({s + "norm.weight", {m.inner()}, &layer.ssm_norm});
      slots.push_back({s + "out_proj.weight", {hidden, m.inner()}, &layer.ssm_out});
    }
    if (c.is_attention(l)) {  // a parallel hybrid has both
      const std::string a = nemotron ? mixer : p + "self_attn.";
      slots.push_back({a + "q_proj.weight", {q_width, hidden}, &layer.wq});
      slots.push_back({a + "k_proj.weight", {kv_width, hidden}, &layer.wk});
      slots.push_back({a + "v_proj.weight", {kv_width, hidden}, &layer.wv});
      slots.push_back({a + "o_proj.weight", {hidden, q_width}, &layer.wo});
    }
    if (!c.has_mlp(l)) continue;
    std::string norm = p + "post_attention_layernorm.weight", mlp = p + "mlp.";
    if (bamba || falcon) norm = p + "pre_ff_layernorm.weight", mlp = p + "feed_forward.";
    if (nemotron) norm = p + "norm.weight", mlp = mixer;
    slots.push_back({norm, {hidden}, &layer.mlp_norm});
    if (c.gated_mlp()) slots.push_back({mlp + "gate_proj.weight", {inter, hidden}, &layer.w_gate});
    slots.push_back({mlp + "up_proj.weight", {inter, hidden}, &layer.w_up});
    slots.push_back({mlp + "down_proj.weight", {hidden, inter}, &layer.w_down});
  }
  std::string final_norm = "model.norm.weight";
  if (bamba || falcon) final_norm = "model.final_layernorm.weight";
  if (nemotron) final_norm = top + "norm_f.weight";
  slots.push_back({final_norm, {hidden}, &weights.final_norm});
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

void Scale(std::vector<float>& v, double by) {
  if (by == 1.0) return;
  for (float& x : v) x = static_cast<float>(x * by);
}

// Falcon-H1's muP multipliers folded into the weights they scale (each is linear in its
// weight), so the model computes exactly what transformers' FalconH1 does, to rounding:
// attention q/k/v see the input times attention_in, k is then times key, o's output times
// attention_out; in_proj sees the input times ssm_in and each of its outputs (bias included) is
// times its part's ssm_multipliers entry; out_proj's output is times ssm_out; the MLP's gate
// (before the SiLU) times mlp_multipliers[0], its down projection's output times [1]; the
// embeddings times embedding, the logits times lm_head. A tied head whose two multipliers
// differ is untied (the head is the unscaled embedding matrix).
void FoldMultipliers(const internal::Multipliers& f, ModelWeights* w) {
  ModelConfig& c = w->config;
  const SsmConfig& m = c.ssm;
  for (size_t i = 0; i < w->layers.size(); ++i) {
    LayerWeights& L = w->layers[i];
    const auto l = static_cast<int32_t>(i);
    if (c.is_attention(l)) {
      Scale(L.wq, f.attention_in);
      Scale(L.wk, f.attention_in * f.key);
      Scale(L.wv, f.attention_in);
      Scale(L.wo, f.attention_out);
    }
    if (c.has_state(l)) {
      const int64_t inner = m.inner(), bc = int64_t{m.num_groups} * m.d_state;
      const int64_t ends[5] = {inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc,
                               m.in_proj_dim()};
      int64_t row = 0;
      for (int part = 0; part < 5; ++part) {
        for (; row < ends[part]; ++row) {
          float* r = L.ssm_in.data() + row * c.hidden_size;
          for (int32_t k = 0; k < c.hidden_size; ++k) {
            r[k] = static_cast<float>(r[k] * (f.ssm_in * f.ssm[part]));
          }
          if (!L.ssm_in_bias.empty()) {
            float& b = L.ssm_in_bias[static_cast<size_t>(row)];
            b = static_cast<float>(b * f.ssm[part]);
          }
        }
      }
      Scale(L.ssm_out, f.ssm_out);
      Scale(L.ssm_out_bias, f.ssm_out);
    }
    if (c.has_mlp(l)) {
      Scale(L.w_gate, f.mlp_gate);
      Scale(L.w_down, f.mlp_down);
    }
  }
  if (c.tie_word_embeddings && f.embedding != f.lm_head) {
    w->lm_head = w->embed;
    c.tie_word_embeddings = false;
  }
  Scale(w->embed, f.embedding);
  if (!c.tie_word_embeddings) Scale(w->lm_head, f.lm_head);
}

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
  const bool mlp_layers =
      std::find(c.layer_kinds.begin(), c.layer_kinds.end(), LayerKind::kMlp) != c.layer_kinds.end();
  if (mlp_layers && c.mlp_after_mixer) {
    return absl::InvalidArgumentError(
        "ModelConfig.layer_kinds has an MLP layer, but mlp_after_mixer puts an MLP in every layer");
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
  if (c.rotary_dim < 0 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ModelConfig.rotary_dim must be even and in [0, head_dim] (got ", c.rotary_dim, ")"));
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

namespace {

// `dir`/config.json, with the tensor names its model type uses.
absl::StatusOr<ParsedConfig> ReadConfig(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  KVPOOL_ASSIGN_OR_RETURN(const std::string text, internal::ReadWholeFile(path));
  return ParseConfig(text, path);
}

}  // namespace

absl::StatusOr<ModelConfig> ReadCheckpointConfig(const std::string& dir) {
  KVPOOL_ASSIGN_OR_RETURN(ParsedConfig parsed, ReadConfig(dir));
  return std::move(parsed.config);
}

absl::StatusOr<ModelWeights> LoadCheckpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  KVPOOL_ASSIGN_OR_RETURN(const ParsedConfig parsed, ReadConfig(dir));
  const ModelConfig& config = parsed.config;

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
  // NVIDIA's Nemotron-H checkpoints keep the model under backbone., newer transformers under
  // model.: whichever holds the embeddings.
  const std::string_view prefix =
      index.contains("backbone.embeddings.weight") || !index.contains("model.embeddings.weight")
          ? "backbone."
          : "model.";
  for (const auto& slot : TensorSlots(weights, parsed.names, prefix)) {
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
  if (parsed.names == Names::kFalconH1) FoldMultipliers(parsed.multipliers, &weights);
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
  KVPOOL_RETURN_IF_ERROR(internal::ConfigExpressible(weights.config));
  std::vector<internal::TensorToWrite> tensors;
  Names names_written = Names::kLlama;
  if (internal::IsNemotronHConfig(weights.config)) names_written = Names::kNemotronH;
  if (internal::IsFalconH1Config(weights.config)) names_written = Names::kFalconH1;
  for (const auto& slot : TensorSlots(weights, names_written)) {
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
