// SyntheticWeights (weights.h): deterministic weights from integer arithmetic only.

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvpool/util/check.h"
#include "model/weights.h"

namespace kvpool::model {
namespace {

// splitmix64's output function: a bijection on 64 bits with good avalanche. Used in counter mode
// (value i of a stream is Mix64(key + i * golden)), so the result depends on nothing but integer
// arithmetic: identical on every machine and compiler.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
uint64_t Mix64(uint64_t z) {
  z += kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Fills `n` approximately normal(0, stddev) values. Each is the centred sum of four 16-bit
// uniforms (Irwin-Hall), exact in integers; the one float multiply that scales it is correctly
// rounded everywhere, unlike std::normal_distribution or libm-dependent transforms.
std::vector<float> NormalLike(uint64_t seed, uint64_t stream, double stddev, int64_t n) {
  // Variance of one uniform on {0..65535} is (65536^2 - 1) / 12; four of them sum to 4x that.
  const double sum_stddev = std::sqrt((65536.0 * 65536.0 - 1.0) / 3.0);
  const auto scale = static_cast<float>(stddev / sum_stddev);
  const uint64_t key = Mix64(Mix64(seed) ^ (stream * 0xD1B54A32D192ED03ull));
  std::vector<float> out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); ++i) {
    const uint64_t r = Mix64(key + i * kGolden);
    const auto sum = static_cast<int32_t>((r & 0xFFFF) + ((r >> 16) & 0xFFFF) +
                                          ((r >> 32) & 0xFFFF) + (r >> 48));
    out[i] = static_cast<float>(sum - 131070) * scale;  // 131070 = 4 * 65535 / 2
  }
  return out;
}

// A state-space layer's mixer (streams base + 7 ... base + 14 of the layer's 16). As Mamba-2
// initializes it, in spirit: dt = softplus(dt_raw + dt_bias) around 0.05 (dt_bias near -3),
// A = exp(A_log) around 1.6 (each token keeps about 92 % of the state), D = 1, norm weights 1;
// projections of std 1/sqrt(in), the output one scaled like every residual branch. Only integer
// arithmetic and float additions: identical on every machine.
void SyntheticSsm(const ModelConfig& config, uint64_t seed, uint64_t base, double residual_scale,
                  LayerWeights* layer) {
  const SsmConfig& m = config.ssm;
  const int64_t hidden = config.hidden_size;
  const auto shifted = [](std::vector<float> v, float by) {
    for (float& f : v) f += by;
    return v;
  };
  layer->ssm_in = NormalLike(seed, base + 7, 1.0 / std::sqrt(static_cast<double>(hidden)),
                             m.in_proj_dim() * hidden);
  layer->ssm_conv = NormalLike(seed, base + 8, 1.0 / std::sqrt(static_cast<double>(m.conv_width)),
                               m.conv_dim() * m.conv_width);
  if (m.conv_bias) layer->ssm_conv_bias = NormalLike(seed, base + 9, 0.02, m.conv_dim());
  if (m.proj_bias) {  // streams base + 13 and 14: the other tensors' values do not change
    layer->ssm_in_bias = NormalLike(seed, base + 13, 0.1, m.in_proj_dim());
    layer->ssm_out_bias = NormalLike(seed, base + 14, 0.02, hidden);
  }
  layer->ssm_dt_bias = shifted(NormalLike(seed, base + 10, 0.5, m.num_heads), -3.0f);
  layer->ssm_a_log = shifted(NormalLike(seed, base + 11, 0.25, m.num_heads), 0.5f);
  layer->ssm_d.assign(static_cast<size_t>(m.num_heads), 1.0f);
  if (m.gated_norm) layer->ssm_norm.assign(static_cast<size_t>(m.inner()), 1.0f);
  layer->ssm_out =
      NormalLike(seed, base + 12, residual_scale / std::sqrt(static_cast<double>(m.inner())),
                 hidden * m.inner());
}

}  // namespace

ModelWeights SyntheticWeights(const ModelConfig& config, uint64_t seed) {
  KVPOOL_CHECK_OK(ValidateConfig(config));
  // Scales keep a forward pass well conditioned at any depth and greedy decoding varied:
  // - every linear map has std 1/sqrt(in_features), so it maps the unit-RMS output of RMSNorm to
  //   O(1) values;
  // - the residual branches (o_proj, down_proj) are further scaled by 1/sqrt(layers), so the
  //   residual stream stays O(1) (about 0.9 RMS) however deep the model;
  // - q_proj is 3x larger, giving attention logits of std ~3. With std-1 logits attention is
  //   nearly uniform, every position sees the same context average, and greedy decoding of the
  //   tied "tiny" model settles into one repeated token within a few steps; at 3 it stays varied
  //   (over 100 distinct tokens in 116 greedy steps of a plain forward pass, "tiny", seeds 1-3);
  // - embedding and LM head rows have std 1/sqrt(hidden), so logits have std ~1. Embeddings of
  //   std 1 would make a tied LM head score the current token far above the rest: greedy would
  //   echo its input.
  ModelWeights w;
  w.config = config;
  const int64_t hidden = config.hidden_size;
  const int64_t q_width = int64_t{config.num_heads} * config.head_dim;
  const int64_t kv_width = int64_t{config.num_kv_heads} * config.head_dim;
  const int64_t inter = config.intermediate_size;
  const int64_t vocab = config.vocab_size;
  const double residual_scale = 1.0 / std::sqrt(static_cast<double>(config.num_layers));
  constexpr double kQueryScale = 3.0;
  const auto in_scale = [](int64_t in) { return 1.0 / std::sqrt(static_cast<double>(in)); };

  // Stream ids fix which values each tensor gets, independent of generation order.
  w.embed = NormalLike(seed, 1, in_scale(hidden), vocab * hidden);
  if (!config.tie_word_embeddings) {
    w.lm_head = NormalLike(seed, 2, in_scale(hidden), vocab * hidden);
  }
  w.final_norm.assign(static_cast<size_t>(hidden), 1.0f);
  w.layers.resize(static_cast<size_t>(config.num_layers));
  for (size_t i = 0; i < w.layers.size(); ++i) {
    LayerWeights& layer = w.layers[i];
    const uint64_t base = 16 + 16 * i;
    const auto l = static_cast<int32_t>(i);
    if (config.kind(l) != LayerKind::kMlp)
      layer.attn_norm.assign(static_cast<size_t>(hidden), 1.0f);
    if (config.has_state(l)) SyntheticSsm(config, seed, base, residual_scale, &layer);
    if (config.is_attention(l)) {
      layer.wq = NormalLike(seed, base + 0, in_scale(hidden) * kQueryScale, q_width * hidden);
      layer.wk = NormalLike(seed, base + 1, in_scale(hidden), kv_width * hidden);
      layer.wv = NormalLike(seed, base + 2, in_scale(hidden), kv_width * hidden);
      layer.wo = NormalLike(seed, base + 3, in_scale(q_width) * residual_scale, hidden * q_width);
    }
    if (!config.has_mlp(l)) continue;
    layer.mlp_norm.assign(static_cast<size_t>(hidden), 1.0f);
    if (config.gated_mlp()) {
      layer.w_gate = NormalLike(seed, base + 4, in_scale(hidden), inter * hidden);
    }
    layer.w_up = NormalLike(seed, base + 5, in_scale(hidden), inter * hidden);
    layer.w_down = NormalLike(seed, base + 6, in_scale(inter) * residual_scale, hidden * inter);
  }
  return w;
}

}  // namespace kvpool::model
