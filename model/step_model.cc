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
    // A layer holds its kind's tensors and none of the other kinds'.
    const auto layer = static_cast<int32_t>(l);
    const bool ssm = c.has_state(layer);
    const bool attention = c.is_attention(layer);
    const bool mlp = c.has_mlp(layer);
    KVPOOL_RETURN_IF_ERROR(
        CheckSize(L.attn_norm, c.kind(layer) == LayerKind::kMlp ? 0 : h, p + "attn_norm"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.mlp_norm, mlp ? h : 0, p + "mlp_norm"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wq, attention ? q * h : 0, p + "wq"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wk, attention ? kv * h : 0, p + "wk"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wv, attention ? kv * h : 0, p + "wv"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.wo, attention ? h * q : 0, p + "wo"));
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
    KVPOOL_RETURN_IF_ERROR(
        CheckSize(L.ssm_norm, ssm && m.gated_norm ? m.inner() : 0, p + "ssm_norm"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.ssm_out, ssm ? h * m.inner() : 0, p + "ssm_out"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.w_gate, mlp && c.gated_mlp() ? im * h : 0, p + "w_gate"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.w_up, mlp ? im * h : 0, p + "w_up"));
    KVPOOL_RETURN_IF_ERROR(CheckSize(L.w_down, mlp ? h * im : 0, p + "w_down"));
  }
  return absl::OkStatus();
}

// An item's checkpoints: offsets strictly ascending within [1, tokens], each of `floats`.
absl::Status CheckCheckpoints(const StepItem& item, size_t i, int64_t floats) {
  int64_t last = 0;
  const auto tokens = static_cast<int64_t>(item.tokens.size());
  for (size_t k = 0; k < item.checkpoints.size(); ++k) {
    const StateCheckpoint& cp = item.checkpoints[k];
    if (cp.offset <= last || cp.offset > tokens) {
      return absl::InvalidArgumentError(fmt::format(
          "step: item {} checkpoint {} at offset {}: offsets must rise strictly within [1, {}]", i,
          k, cp.offset, tokens));
    }
    last = cp.offset;
    if (static_cast<int64_t>(cp.state.size()) != floats) {
      return absl::InvalidArgumentError(
          fmt::format("step: item {} checkpoint {} has {} floats; the state has {}", i, k,
                      cp.state.size(), floats));
    }
  }
  return absl::OkStatus();
}

// With state-space layers: every item brings a state of the model's size, its checkpoints are
// well placed and sized, and no two of all these spans overlap (each step updates its items'
// states in place and writes the checkpoints). Without: no checkpoints.
absl::Status CheckStates(const ModelConfig& config, std::span<const StepItem> items) {
  const int64_t floats = config.state_bytes() / static_cast<int64_t>(sizeof(float));
  if (floats == 0) {
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].checkpoints.empty()) {
        return absl::InvalidArgumentError(fmt::format(
            "step: item {} asks for state checkpoints; the model has no state-space layers", i));
      }
    }
    return absl::OkStatus();
  }
  struct Span {
    uintptr_t at;
    size_t item;
    int64_t checkpoint;  // -1: the item's state
  };
  std::vector<Span> spans;
  for (size_t i = 0; i < items.size(); ++i) {
    if (static_cast<int64_t>(items[i].state.size()) != floats) {
      return absl::InvalidArgumentError(
          fmt::format("step: item {} has a state of {} floats; the model's state-space layers "
                      "need {}",
                      i, items[i].state.size(), floats));
    }
    KVPOOL_RETURN_IF_ERROR(CheckCheckpoints(items[i], i, floats));
    spans.push_back({reinterpret_cast<uintptr_t>(items[i].state.data()), i, -1});
    for (size_t k = 0; k < items[i].checkpoints.size(); ++k) {
      spans.push_back({reinterpret_cast<uintptr_t>(items[i].checkpoints[k].state.data()), i,
                       static_cast<int64_t>(k)});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.at < b.at; });
  const auto name = [](const Span& s) {
    return s.checkpoint < 0 ? fmt::format("item {}'s state", s.item)
                            : fmt::format("item {}'s checkpoint {}", s.item, s.checkpoint);
  };
  for (size_t k = 1; k < spans.size(); ++k) {
    if (spans[k].at < spans[k - 1].at + static_cast<uintptr_t>(floats) * sizeof(float)) {
      if (spans[k].checkpoint < 0 && spans[k - 1].checkpoint < 0) {
        return absl::InvalidArgumentError(
            fmt::format("step: items {} and {} share a state", spans[k - 1].item, spans[k].item));
      }
      return absl::InvalidArgumentError(
          fmt::format("step: {} overlaps {}", name(spans[k - 1]), name(spans[k])));
    }
  }
  return absl::OkStatus();
}

// With a window group: the item's window table covers its blocks, and every block the step
// writes or reads in the sliding layers (the first new token's window, which reaches back
// furthest, through the last new token; and the sinks) is a window block. Released entries
// before the window are not looked at.
absl::Status CheckWindowTable(const ModelConfig& config, const kernels::PoolLayout& l,
                              const StepItem& it, size_t i) {
  const int64_t bs = l.block_size;
  const int64_t end = it.start + static_cast<int64_t>(it.tokens.size());
  const int64_t blocks = (end + bs - 1) / bs;
  if (static_cast<int64_t>(it.window_table.size()) < blocks) {
    return absl::InvalidArgumentError(fmt::format(
        "step: item {} needs {} window blocks for {} tokens but its window table has {}", i, blocks,
        end, it.window_table.size()));
  }
  const kernels::AttentionWindow w{.window = config.sliding_window, .sinks = config.sink_tokens};
  const int64_t spans[2][2] = {{0, w.SinkEnd(it.start)}, {w.Start(it.start), end}};
  for (const auto& span : spans) {
    if (span[0] >= span[1]) continue;
    for (int64_t b = span[0] / bs; b < (span[1] + bs - 1) / bs; ++b) {
      const int32_t id = it.window_table[static_cast<size_t>(b)];
      if (id < 0 || id >= l.num_window_blocks) {
        return absl::InvalidArgumentError(fmt::format(
            "step: item {} window table entry {} is block {} (the window group has {}), and the "
            "step reads or writes tokens [{}, {}) of it",
            i, b, id, l.num_window_blocks, std::max(span[0], b * bs),
            std::min(span[1], (b + 1) * bs)));
      }
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
    if (l.num_window_layers > 0) KVPOOL_RETURN_IF_ERROR(CheckWindowTable(config, l, it, i));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StepModel::Step(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                             const StepOptions& options, std::vector<ItemResult>* results) {
  KVPOOL_RETURN_IF_ERROR(CheckStep(config(), layout(), pool, items, options));
  const bool checkpoints = std::any_of(items.begin(), items.end(),
                                       [](const StepItem& it) { return !it.checkpoints.empty(); });
  if (!checkpoints) return RunStep(pool, items, options, results);
  KVPOOL_RETURN_IF_ERROR(CopyStates({}));  // can this model copy states at all?
  return StepInPhases(pool, items, options, results);
}

// Phase j runs the j-th piece of every item that still has one, in the items' order: pieces end
// at the item's checkpoint offsets and at its last token. A piece that is not its item's last
// has no history and no sampling (its result is dropped); after the phase, each item whose piece
// ended at a checkpoint has its state copied there.
absl::Status StepModel::StepInPhases(const kernels::KvPoolView& pool,
                                     std::span<const StepItem> items, const StepOptions& options,
                                     std::vector<ItemResult>* results) {
  std::vector<size_t> done(items.size(), 0);  // tokens of each item already run
  std::vector<size_t> next(items.size(), 0);  // its first checkpoint not yet taken
  std::vector<StepItem> pieces;
  std::vector<uint8_t> in_prefill;
  std::vector<size_t> of;  // the item of each piece
  std::vector<StateCopy> copies;
  std::vector<ItemResult> phase;
  std::vector<ItemResult> out(items.size());
  while (true) {
    pieces.clear();
    in_prefill.clear();
    of.clear();
    for (size_t i = 0; i < items.size(); ++i) {
      const StepItem& it = items[i];
      const size_t a = done[i];
      if (a == it.tokens.size()) continue;
      const size_t b = next[i] < it.checkpoints.size()
                           ? static_cast<size_t>(it.checkpoints[next[i]].offset)
                           : it.tokens.size();
      const bool last = b == it.tokens.size();
      pieces.push_back({.tokens = it.tokens.subspan(a, b - a),
                        .start = it.start + static_cast<int64_t>(a),
                        .block_table = it.block_table,
                        .sampling = last ? it.sampling : nullptr,
                        .history = last ? it.history : std::span<const int32_t>(),
                        .state = it.state,
                        .window_table = it.window_table});
      in_prefill.push_back(it.tokens.size() > 1 ? 1 : 0);
      of.push_back(i);
      done[i] = b;
    }
    if (pieces.empty()) break;
    KVPOOL_RETURN_IF_ERROR(RunPhase(pool, pieces, in_prefill, options, &phase));
    copies.clear();
    for (size_t p = 0; p < pieces.size(); ++p) {
      const size_t i = of[p];
      const StepItem& it = items[i];
      if (next[i] < it.checkpoints.size() &&
          static_cast<size_t>(it.checkpoints[next[i]].offset) == done[i]) {
        copies.push_back({.from = it.state, .to = it.checkpoints[next[i]++].state});
      }
      if (done[i] == it.tokens.size()) out[i] = std::move(phase[p]);
    }
    if (!copies.empty()) KVPOOL_RETURN_IF_ERROR(CopyStates(copies));
  }
  *results = std::move(out);
  return absl::OkStatus();
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
  // A window group holds the sliding layers, all of them and nothing else (they are the pool's
  // last layers: ModelConfig::kv_layer(layer, true)).
  if (layout.num_window_layers > 0 && layout.num_window_layers != c.num_sliding_layers()) {
    return absl::InvalidArgumentError(fmt::format(
        "the pool's window group holds {} layers but the model has {} sliding-window layers",
        layout.num_window_layers, c.num_sliding_layers()));
  }
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
