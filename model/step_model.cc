#include "model/step_model.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fmt/format.h"
#include "kernels/backend.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/status_macros.h"
#include "model/model.h"

namespace kvpool::model {
namespace {

absl::Status CheckSize(const std::vector<float>& v, int64_t want, std::string_view name) {
  if (static_cast<int64_t>(v.size()) != want) {
    return absl::InvalidArgumentError(
        fmt::format("weights: {} has {} values, the config needs {}", name, v.size(), want));
  }
  return absl::OkStatus();
}

absl::Status CheckWeights(const ModelWeights& w) {
  const ModelConfig& c = w.config;
  const int64_t h = c.hidden_size, q = int64_t{c.num_heads} * c.head_dim,
                kv = int64_t{c.num_kv_heads} * c.head_dim, im = c.intermediate_size;
  KVPOOL_RETURN_IF_ERROR(CheckSize(w.embed, int64_t{c.vocab_size} * h, "embed"));
  KVPOOL_RETURN_IF_ERROR(CheckSize(w.final_norm, h, "final_norm"));
  KVPOOL_RETURN_IF_ERROR(
      CheckSize(w.lm_head, c.tie_word_embeddings ? 0 : int64_t{c.vocab_size} * h, "lm_head"));
  if (static_cast<int32_t>(w.layers.size()) != c.num_layers) {
    return absl::InvalidArgumentError(
        fmt::format("weights: {} layers, the config says {}", w.layers.size(), c.num_layers));
  }
  const SsmConfig& m = c.ssm;
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("layers.{}.", l);
    // A layer holds its kind's tensors and none of the other kind's.
    const bool ssm = c.kind(static_cast<int32_t>(l)) == LayerKind::kStateSpace;
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.attn_norm, h, p + "attn_norm"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.mlp_norm, h, p + "mlp_norm"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wq, ssm ? 0 : q * h, p + "wq"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wk, ssm ? 0 : kv * h, p + "wk"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wv, ssm ? 0 : kv * h, p + "wv"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wo, ssm ? 0 : h * q, p + "wo"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.ssm_in, ssm ? m.in_proj_dim() * h : 0, p + "ssm_in"));
    KVPOOL_RETURN_IF_ERROR(
        CheckSize(L.ssm_conv, ssm ? m.conv_dim() * m.conv_width : 0, p + "ssm_conv"));
    KVPOOL_RETURN_IF_ERROR(
        CheckSize(L.ssm_conv_bias, ssm && m.conv_bias ? m.conv_dim() : 0, p + "ssm_conv_bias"));
    KVPOOL_RETURN_IF_ERROR(
        CheckSize(L.ssm_in_bias, ssm && m.proj_bias ? m.in_proj_dim() : 0, p + "ssm_in_bias"));
    KVPOOL_RETURN_IF_ERROR(
        CheckSize(L.ssm_out_bias, ssm && m.proj_bias ? h : 0, p + "ssm_out_bias"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.ssm_dt_bias, ssm ? m.num_heads : 0, p + "ssm_dt_bias"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.ssm_a_log, ssm ? m.num_heads : 0, p + "ssm_a_log"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.ssm_d, ssm ? m.num_heads : 0, p + "ssm_d"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.ssm_norm, ssm ? m.inner() : 0, p + "ssm_norm"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.ssm_out, ssm ? h * m.inner() : 0, p + "ssm_out"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.w_gate, im * h, p + "w_gate"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.w_up, im * h, p + "w_up"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.w_down, h * im, p + "w_down"));
  }
  return absl::OkStatus();
}

// With state-space layers: every item brings a state of the model's size, and no two overlap
// (each step updates its items' states in place).
absl::Status CheckStates(const ModelConfig& config, std::span<const StepItem> items) {
  const int64_t floats = config.state_bytes() / static_cast<int64_t>(sizeof(float));
  if (floats == 0) return absl::OkStatus();
  std::vector<std::pair<uintptr_t, size_t>> spans;  // (address of the state, item)
  for (size_t i = 0; i < items.size(); ++i) {
    if (static_cast<int64_t>(items[i].state.size()) != floats) {
      return absl::InvalidArgumentError(
          fmt::format("step: item {} has a state of {} floats; the model's state-space layers "
                      "need {}",
                      i, items[i].state.size(), floats));
    }
    spans.emplace_back(reinterpret_cast<uintptr_t>(items[i].state.data()), i);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    if (spans[k].first < spans[k - 1].first + static_cast<uintptr_t>(floats) * sizeof(float)) {
      return absl::InvalidArgumentError(
          fmt::format("step: items {} and {} share a state", spans[k - 1].second, spans[k].second));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckStep(const ModelConfig& config, const kernels::PoolLayout& layout,
                       const kernels::KvPoolView& pool, std::span<const StepItem> items,
                       const StepOptions& options) {
  const kernels::PoolLayout& l = pool.layout;
  kernels::PoolLayout sized = layout;
  sized.num_blocks = l.num_blocks;
  if (!(l == sized)) {
    return absl::InvalidArgumentError(
        fmt::format("step: pool {} is not the model's {}", l.ToString(), layout.ToString()));
  }
  if (items.empty()) return absl::InvalidArgumentError("step: no items");
  if (options.top_k < 0 || options.top_k > config.vocab_size) {
    return absl::InvalidArgumentError(
        fmt::format("step: top_k {} outside [0, {}]", options.top_k, config.vocab_size));
  }
  KVPOOL_RETURN_IF_ERROR(CheckStates(config, items));
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    if (it.tokens.empty()) {
      return absl::InvalidArgumentError(fmt::format("step: item {} has no tokens", i));
    }
    if (it.start < 0) {
      return absl::InvalidArgumentError(fmt::format("step: item {} starts at {}", i, it.start));
    }
    if (it.sampling != nullptr) {
      if (absl::Status bad = CheckSampling(*it.sampling, config.vocab_size); !bad.ok()) {
        return absl::InvalidArgumentError(fmt::format("step: item {}: {}", i, bad.message()));
      }
    }
    for (int32_t t : it.tokens) {
      if (t < 0 || t >= config.vocab_size) {
        return absl::InvalidArgumentError(fmt::format(
            "step: item {} has token {} outside the vocabulary [0, {})", i, t, config.vocab_size));
      }
    }
    const int64_t end = it.start + static_cast<int64_t>(it.tokens.size());
    if (end > INT32_MAX)
      return absl::InvalidArgumentError(fmt::format("step: item {} too long", i));
    const int64_t blocks = (end + l.block_size - 1) / l.block_size;
    if (static_cast<int64_t>(it.block_table.size()) < blocks) {
      return absl::InvalidArgumentError(
          fmt::format("step: item {} needs {} blocks for {} tokens but its table has {}", i, blocks,
                      end, it.block_table.size()));
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id = it.block_table[static_cast<size_t>(b)];
      if (id < 0 || id >= l.num_blocks) {
        return absl::InvalidArgumentError(fmt::format(
            "step: item {} table entry {} is block {} (pool has {})", i, b, id, l.num_blocks));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StepModel::Step(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                             const StepOptions& options, std::vector<ItemResult>* results) {
  KVPOOL_RETURN_IF_ERROR(CheckStep(config(), layout(), pool, items, options));
  return RunStep(pool, items, options, results);
}

absl::Status CheckModel(const ModelWeights& weights, const kernels::PoolLayout& layout) {
  const ModelConfig& c = weights.config;
  KVPOOL_RETURN_IF_ERROR(ValidateConfig(c));
  KVPOOL_RETURN_IF_ERROR(CheckWeights(weights));
  auto mismatch = [&](std::string_view field, int64_t pool, int64_t model) {
    return absl::InvalidArgumentError(
        fmt::format("the pool's {} is {} but the model needs {}", field, pool, model));
  };
  // (State-space layers keep no K/V: the pool holds the attention layers only.)
  if (layout.num_layers != c.pool_layers()) {
    return mismatch("num_layers", layout.num_layers, c.pool_layers());
  }
  if (layout.num_kv_heads != c.num_kv_heads) {
    return mismatch("num_kv_heads", layout.num_kv_heads, c.num_kv_heads);
  }
  if (layout.head_dim != c.head_dim) return mismatch("head_dim", layout.head_dim, c.head_dim);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StepModel>> CreateStepModel(ModelWeights weights,
                                                           const kernels::PoolLayout& layout,
                                                           kernels::Device* device, int threads) {
  if (device->host_visible()) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                            Model::Create(std::move(weights), layout, {.threads = threads}));
    return std::unique_ptr<StepModel>(std::move(model));
  }
  KVPOOL_RETURN_IF_ERROR(CheckModel(weights, layout));
  KVPOOL_ASSIGN_OR_RETURN(const kernels::BackendReg* backend, kernels::BackendOf(*device));
  if (backend->create_model == nullptr) {
    return absl::UnavailableError(
        fmt::format("the {} backend has no model for {}", backend->name, device->name()));
  }
  kernels::BackendError error;
  StepModel* model = backend->create_model(device, &weights, &layout, &error);
  if (model == nullptr) {
    const auto code =
        error.code == 0 ? absl::StatusCode::kInternal : static_cast<absl::StatusCode>(error.code);
    return absl::Status(code, fmt::format("model on {}: {}", device->name(), error.message));
  }
  return std::unique_ptr<StepModel>(model);
}

}  // namespace kvpool::model
