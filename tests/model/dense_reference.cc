#include "tests/model/dense_reference.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "kvpool/util/check.h"

namespace kvpool::model {
namespace {

// y[out] = W[out][in] · x[in], in double.
std::vector<double> MatVec(const std::vector<float>& w, const std::vector<double>& x, int64_t out) {
  const int64_t in = static_cast<int64_t>(x.size());
  std::vector<double> y(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) {
    double acc = 0;
    for (int64_t i = 0; i < in; ++i)
      acc += double{w[static_cast<size_t>(o * in + i)]} * x[static_cast<size_t>(i)];
    y[static_cast<size_t>(o)] = acc;
  }
  return y;
}

std::vector<double> Norm(const std::vector<double>& x, const std::vector<float>& weight,
                         double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * weight[i];
  return y;
}

// RoPE over the first `dim` values of a head (partial rotary: the rest are left alone).
void Rotate(double* head, int32_t dim, int64_t pos, double theta) {
  for (int32_t i = 0; i < dim / 2; ++i) {
    const double angle = static_cast<double>(pos) * std::pow(theta, -2.0 * i / dim);
    const double a = head[i], b = head[i + dim / 2];
    head[i] = a * std::cos(angle) - b * std::sin(angle);
    head[i + dim / 2] = b * std::cos(angle) + a * std::sin(angle);
  }
}

float RoundTo(double v, kernels::DType dtype) {
  const float f = static_cast<float>(v);
  switch (dtype) {
    case kernels::DType::kF32:
      return f;
    case kernels::DType::kF16:
      return kernels::F16ToFloat(kernels::FloatToF16(f));
    case kernels::DType::kBF16:
      return kernels::BF16ToFloat(kernels::FloatToBF16(f));
    case kernels::DType::kFp8E4M3:
    case kernels::DType::kInt8:
      return f;  // scaled per block: not modelled here (kv_dtype_quality_test measures them)
  }
  return f;
}

}  // namespace

DenseReference::DenseReference(const ModelWeights& weights, kernels::DType kv_dtype,
                               const ReferenceMultipliers& multipliers)
    : w_(&weights),
      dtype_(kv_dtype),
      mult_(multipliers),
      k_(weights.layers.size()),
      v_(weights.layers.size()),
      conv_(weights.layers.size()),
      ssm_(weights.layers.size()) {
  const SsmConfig& m = weights.config.ssm;
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    if (!weights.config.has_state(static_cast<int32_t>(l))) continue;
    conv_[l].assign(static_cast<size_t>(m.conv_state_floats()), 0.0);
    ssm_[l].assign(static_cast<size_t>(m.state_floats() - m.conv_state_floats()), 0.0);
  }
}

std::vector<float> DenseReference::State() const {
  std::vector<float> out;
  for (size_t l = 0; l < conv_.size(); ++l) {
    out.insert(out.end(), conv_[l].begin(), conv_[l].end());
    out.insert(out.end(), ssm_[l].begin(), ssm_[l].end());
  }
  return out;
}

std::vector<float> DenseReference::Extend(std::span<const int32_t> tokens) {
  std::vector<float> logits;
  for (int32_t t : tokens) logits = Forward(t);
  return logits;
}

std::vector<float> DenseReference::Forward(int32_t token) {
  const ModelConfig& c = w_->config;
  const int64_t h = c.hidden_size;
  const int64_t pos = length_++;
  std::vector<double> x(static_cast<size_t>(h));
  for (int64_t i = 0; i < h; ++i)
    x[static_cast<size_t>(i)] = w_->embed[static_cast<size_t>(token * h + i)] * mult_.embedding;
  const auto scaled = [](std::vector<double> v, double by) {
    for (double& e : v) e *= by;
    return v;
  };
  for (size_t l = 0; l < w_->layers.size(); ++l) {
    const LayerWeights& L = w_->layers[l];
    const LayerKind kind = c.kind(static_cast<int32_t>(l));
    if (kind != LayerKind::kMlp) {  // the mixer, with its norm and residual
      const std::vector<double> xn = Norm(x, L.attn_norm, c.rms_norm_eps);
      std::vector<double> o(static_cast<size_t>(h), 0.0);
      if (c.has_state(static_cast<int32_t>(l))) {
        const std::vector<double> s =
            scaled(StateMixer(l, scaled(xn, mult_.ssm_in)), mult_.ssm_out);
        for (size_t i = 0; i < o.size(); ++i) o[i] += s[i];
      }
      if (c.is_attention(static_cast<int32_t>(l))) {
        const std::vector<double> a =
            scaled(AttentionMixer(l, scaled(xn, mult_.attention_in), pos), mult_.attention_out);
        for (size_t i = 0; i < o.size(); ++i) o[i] += a[i];
      }
      for (int64_t i = 0; i < h; ++i) x[static_cast<size_t>(i)] += o[static_cast<size_t>(i)];
    }
    if (!c.mlp_after_mixer && kind != LayerKind::kMlp) continue;  // Nemotron-H: one or the other
    const std::vector<double> xm = Norm(x, L.mlp_norm, c.rms_norm_eps);
    const std::vector<double> up = MatVec(L.w_up, xm, c.intermediate_size);
    std::vector<double> act(up.size());
    if (c.mlp_activation == MlpActivation::kSwiGlu) {
      const std::vector<double> gate =
          scaled(MatVec(L.w_gate, xm, c.intermediate_size), mult_.mlp_gate);
      for (size_t i = 0; i < act.size(); ++i) {
        act[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      }
    } else {  // squared ReLU
      for (size_t i = 0; i < act.size(); ++i) act[i] = up[i] > 0 ? up[i] * up[i] : 0.0;
    }
    const std::vector<double> down = scaled(MatVec(L.w_down, act, h), mult_.mlp_down);
    for (int64_t i = 0; i < h; ++i) x[static_cast<size_t>(i)] += down[static_cast<size_t>(i)];
  }
  const std::vector<double> xf = Norm(x, w_->final_norm, c.rms_norm_eps);
  const std::vector<double> logits = scaled(
      MatVec(c.tie_word_embeddings ? w_->embed : w_->lm_head, xf, c.vocab_size), mult_.lm_head);
  return std::vector<float>(logits.begin(), logits.end());
}

std::vector<double> DenseReference::AttentionMixer(size_t l, const std::vector<double>& xn,
                                                   int64_t pos) {
  const ModelConfig& c = w_->config;
  const LayerWeights& L = w_->layers[l];
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_heads, nkv = c.num_kv_heads;
  {
    std::vector<double> q = MatVec(L.wq, xn, nh * hd);
    std::vector<double> k = MatVec(L.wk, xn, nkv * hd);
    for (double& e : k) e *= mult_.key;
    const std::vector<double> v = MatVec(L.wv, xn, nkv * hd);
    // Without RoPE (c.rope false, Nemotron-H) nothing is rotated.
    const int32_t rotary = c.rope ? (c.rotary_dim == 0 ? c.head_dim : c.rotary_dim) : 0;
    for (int64_t head = 0; head < nh; ++head)
      Rotate(&q[static_cast<size_t>(head * hd)], rotary, pos, c.rope_theta);
    for (int64_t head = 0; head < nkv; ++head)
      Rotate(&k[static_cast<size_t>(head * hd)], rotary, pos, c.rope_theta);
    for (double e : k) k_[l].push_back(RoundTo(e, dtype_));
    for (double e : v) v_[l].push_back(RoundTo(e, dtype_));
    std::vector<double> attn(static_cast<size_t>(nh * hd), 0.0);
    const kernels::AttentionWindow window = c.window(static_cast<int32_t>(l));
    const int64_t group = nh / nkv;
    for (int64_t head = 0; head < nh; ++head) {
      const int64_t kvh = head / group;
      std::vector<double> scores(static_cast<size_t>(pos + 1));
      double top = -INFINITY;
      for (int64_t p = 0; p <= pos; ++p) {
        if (!window.Sees(pos, p)) {  // outside a sliding layer's window and sinks
          scores[static_cast<size_t>(p)] = -INFINITY;
          continue;
        }
        double dot = 0;
        for (int64_t d = 0; d < hd; ++d) {
          dot += q[static_cast<size_t>(head * hd + d)] *
                 k_[l][static_cast<size_t>((p * nkv + kvh) * hd + d)];
        }
        scores[static_cast<size_t>(p)] = dot / std::sqrt(static_cast<double>(hd));
        top = std::max(top, scores[static_cast<size_t>(p)]);
      }
      double sum = 0;
      for (double& s : scores) sum += (s = std::exp(s - top));
      for (int64_t p = 0; p <= pos; ++p) {
        if (!window.Sees(pos, p)) continue;
        for (int64_t d = 0; d < hd; ++d) {
          attn[static_cast<size_t>(head * hd + d)] +=
              scores[static_cast<size_t>(p)] / sum *
              v_[l][static_cast<size_t>((p * nkv + kvh) * hd + d)];
        }
      }
    }
    return MatVec(L.wo, attn, h);
  }
}

// Mamba-2 by the book: in_proj (+ bias), causal conv (+ bias) + SiLU, softplus(dt), the
// recurrence, the gated RMSNorm, out_proj (+ bias).
std::vector<double> DenseReference::StateMixer(size_t l, const std::vector<double>& xn) {
  const ModelConfig& c = w_->config;
  const SsmConfig& m = c.ssm;
  const LayerWeights& L = w_->layers[l];
  const size_t inner = static_cast<size_t>(m.inner()), dim = static_cast<size_t>(m.conv_dim());
  const size_t held = static_cast<size_t>(m.conv_width - 1), width = held + 1;
  const size_t heads = static_cast<size_t>(m.num_heads), hd = static_cast<size_t>(m.head_dim);
  const size_t ds = static_cast<size_t>(m.d_state), bc = static_cast<size_t>(m.num_groups) * ds;
  std::vector<double> p = MatVec(L.ssm_in, xn, m.in_proj_dim());
  for (size_t i = 0; i < L.ssm_in_bias.size(); ++i) p[i] += L.ssm_in_bias[i];
  // Falcon-H1's mup_vector: z, x, B, C, dt each times their multiplier.
  for (size_t i = 0; i < p.size(); ++i) {
    const size_t part = i < inner                ? 0
                        : i < 2 * inner          ? 1
                        : i < 2 * inner + bc     ? 2
                        : i < 2 * inner + 2 * bc ? 3
                                                 : 4;
    p[i] *= mult_.ssm[part];
  }
  std::vector<double> xbc(dim);
  std::vector<double>& carry = conv_[l];
  for (size_t ch = 0; ch < dim; ++ch) {
    double acc = m.conv_bias ? double{L.ssm_conv_bias[ch]} : 0.0;
    for (size_t j = 0; j < width; ++j) {
      const double in = j < held ? carry[j * dim + ch] : p[inner + ch];
      acc += double{L.ssm_conv[ch * width + j]} * in;
    }
    xbc[ch] = acc / (1.0 + std::exp(-acc));
  }
  if (held > 0) {
    carry.erase(carry.begin(), carry.begin() + static_cast<ptrdiff_t>(dim));
    carry.insert(carry.end(), p.begin() + static_cast<ptrdiff_t>(inner),
                 p.begin() + static_cast<ptrdiff_t>(inner + dim));
  }
  std::vector<double> y(inner);
  for (size_t head = 0; head < heads; ++head) {
    const double raw = p[inner + dim + head] + L.ssm_dt_bias[head];
    const double dt = raw > 20 ? raw : std::log1p(std::exp(raw));
    const double a = std::exp(-std::exp(double{L.ssm_a_log[head]}) * dt);
    const size_t g = head / (heads / static_cast<size_t>(m.num_groups));
    const double* b = &xbc[inner + g * ds];
    const double* cc = &xbc[inner + bc + g * ds];
    double* state = &ssm_[l][head * ds * hd];
    for (size_t q = 0; q < hd; ++q) {
      const double xv = xbc[head * hd + q];
      double acc = L.ssm_d[head] * xv;
      for (size_t n = 0; n < ds; ++n) {
        double& s = state[n * hd + q];
        s = a * s + dt * b[n] * xv;
        acc += cc[n] * s;
      }
      y[head * hd + q] = acc;
    }
  }
  // Per B/C group (Mamba-2), or over all of inner (Bamba).
  const size_t group = m.norm_per_group ? inner / static_cast<size_t>(m.num_groups) : inner;
  for (size_t i = 0; i < inner; ++i) y[i] *= p[i] / (1.0 + std::exp(-p[i]));
  for (size_t g0 = 0; m.gated_norm && g0 < inner; g0 += group) {  // Falcon-H1: may have none
    double ss = 0;
    for (size_t i = g0; i < g0 + group; ++i) ss += y[i] * y[i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(group) + c.rms_norm_eps);
    for (size_t i = g0; i < g0 + group; ++i) y[i] *= inv * L.ssm_norm[i];
  }
  std::vector<double> out = MatVec(L.ssm_out, y, c.hidden_size);
  for (size_t i = 0; i < L.ssm_out_bias.size(); ++i) out[i] += L.ssm_out_bias[i];
  return out;
}

int32_t Argmax(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  }
  return best;
}

ModelConfig SmallTestConfig() {
  return {.vocab_size = 256,
          .hidden_size = 128,
          .intermediate_size = 256,
          .num_layers = 2,
          .num_heads = 4,
          .num_kv_heads = 2,
          .head_dim = 32,
          .tie_word_embeddings = false};
}

ModelConfig WindowedTestConfig(int32_t window, int32_t sinks) {
  ModelConfig c = SmallTestConfig();
  c.layer_kinds = {LayerKind::kSlidingAttention, LayerKind::kFullAttention};
  c.sliding_window = window;
  c.sink_tokens = sinks;
  return c;
}

std::vector<int32_t> RandomTokens(size_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return out;
}

double RelError(std::span<const float> got, std::span<const float> want) {
  if (got.size() != want.size()) return INFINITY;
  double err = 0, scale = 1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    err = std::max(err, std::abs(double{got[i]} - want[i]));
    scale = std::max(scale, std::abs(double{want[i]}));
  }
  return err / scale;
}

double HostTolerance(kernels::DType dtype) { return dtype == kernels::DType::kF32 ? 2e-4 : 2e-2; }

std::unique_ptr<LocalEngine> MakeTestEngine(const ModelWeights& w, int32_t block_size,
                                            kernels::DType dtype, bool prefix_cache) {
  absl::StatusOr<std::unique_ptr<LocalEngine>> engine =
      LocalEngine::Create(w, {.block_size = block_size,
                              .dtype = dtype,
                              .pool_bytes = int64_t{16} << 20,
                              .prefix_cache = prefix_cache,
                              .threads = 2});
  KVPOOL_CHECK_OK(engine.status());
  return std::move(engine).value();
}

void ExpectEngineFollowsReference(const ModelWeights& w, DenseReference& ref, kernels::DType dtype,
                                  size_t prompt_tokens, uint32_t seed, int decodes,
                                  double state_tolerance) {
  auto engine = MakeTestEngine(w, 16, dtype, /*prefix_cache=*/false);
  const std::vector<int32_t> prompt = RandomTokens(prompt_tokens, w.config.vocab_size, seed);
  auto first = engine->Prefill(SequenceId(0), prompt, {.keep_logits = true});
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<float> want = ref.Extend(prompt);
  EXPECT_LE(RelError(first->result.logits, want), HostTolerance(dtype));
  // Before the decodes have compounded the differences: ten times tighter.
  EXPECT_LE(RelError(engine->state(first->sequence), ref.State()), state_tolerance / 10);
  int32_t token = Argmax(want);
  for (int step = 0; step < decodes; ++step) {
    const DecodeInput in{first->sequence, token};
    auto out = engine->Decode(std::span(&in, 1), {.keep_logits = true});
    ASSERT_TRUE(out.ok()) << out.status();
    want = ref.Extend(std::span(&token, 1));
    EXPECT_LE(RelError((*out)[0].logits, want), HostTolerance(dtype)) << "step " << step;
    token = Argmax(want);
  }
  EXPECT_LE(RelError(engine->state(first->sequence), ref.State()), state_tolerance);
  EXPECT_TRUE(engine->cache().CheckInvariants().ok());
}

}  // namespace kvpool::model
