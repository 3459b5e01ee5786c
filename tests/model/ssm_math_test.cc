// The CUDA model's state-space arithmetic without a GPU (model/internal/ssm_math.h). The CUDA
// kernels (model/cuda/ssm_kernels.cu) call the shared functions per thread; this test calls the
// same functions over the same index space the kernels' grids cover (a thread per (sequence,
// channel) for the conv, per element for the split, per (sequence, head, column) for the scan,
// per (row, norm group) for the gated norm), on the caller's state slots in StepItem::state's
// layout, inside a plain forward pass, and holds the logits and the states to the dense
// reference, which shares nothing with ssm_math.h. So wrong shared math fails here.
//
// The chunked scan for long prefills (internal/ssm_chunk.h) likewise, against the reference
// scan.
//
// Not tested here (needs a GPU): the launch geometry (grid and block sizes, the scan's shared
// memory staging and barriers, the norm's block reduction, which sums in another order than
// the sequential sum here), the device pointer tables and the copies of the states to and from
// the device (cuda_model_ssm.cc), and cuBLAS.

#include "model/internal/ssm_math.h"

#include <cmath>
#include <random>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "model/internal/ssm_chunk.h"
#include "model/internal/ssm_mixer.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using internal::SsmDims;

const LayerKind kS = LayerKind::kStateSpace;

// y[r][o] = sum_i x[r][i] * w[o][i] (+ y), in float.
void MatMul(const std::vector<float>& x, int64_t rows, const std::vector<float>& w, int64_t out,
            int64_t in, std::vector<float>* y, bool accumulate) {
  if (!accumulate) y->assign(static_cast<size_t>(rows * out), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      float acc = 0;
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w[o * in + i];
      (*y)[r * out + o] += acc;
    }
  }
}

std::vector<float> RmsNorm(const std::vector<float>& x, int64_t rows, int64_t dim,
                           const std::vector<float>& weight, float eps) {
  std::vector<float> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    float ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += x[r * dim + i] * x[r * dim + i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = x[r * dim + i] * inv * weight[i];
  }
  return y;
}

// One state-space mixer over the step's rows (sequence s: rows [starts[s], starts[s + 1]),
// state states[s] + offset), in the CUDA kernels' decomposition; adds out_proj to x.
void Mixer(const ModelWeights& w, const LayerWeights& L, const std::vector<int32_t>& starts,
           const std::vector<float*>& states, int64_t offset, std::vector<float>* x) {
  const ModelConfig& c = w.config;
  const SsmDims m = internal::SsmDimsOf(c.ssm);
  const int64_t n = starts.back(), h = c.hidden_size, seqs = starts.size() - 1;
  std::vector<float> proj;
  MatMul(RmsNorm(*x, n, h, L.attn_norm, c.rms_norm_eps), n, L.ssm_in, m.in_proj_dim, h, &proj,
         false);
  for (int64_t e = 0; e < n * m.in_proj_dim; ++e) {  // LaunchAddBias
    if (!L.ssm_in_bias.empty()) proj[e] += L.ssm_in_bias[e % m.in_proj_dim];
  }
  std::vector<float> xbc(static_cast<size_t>(n * m.conv_dim));
  for (int64_t s = 0; s < seqs; ++s) {  // LaunchSsmConv: blockIdx.y, then a thread per channel
    for (int64_t ch = 0; ch < m.conv_dim; ++ch) {
      internal::SsmConvChannel(m, &proj[starts[s] * m.in_proj_dim + m.inner], m.in_proj_dim,
                               starts[s + 1] - starts[s], L.ssm_conv.data(),
                               L.ssm_conv_bias.empty() ? nullptr : L.ssm_conv_bias.data(),
                               states[s] + offset, &xbc[starts[s] * m.conv_dim], ch);
    }
  }
  std::vector<float> xs(n * m.inner), b(n * m.bc), cc(n * m.bc), dt(n * m.num_heads);
  const int64_t row = m.conv_dim + m.num_heads;
  for (int64_t e = 0; e < n * row; ++e) {  // LaunchSsmSplit: grid-stride over elements
    internal::SsmSplitAt(m, xbc.data(), proj.data(), L.ssm_dt_bias.data(), e / row, e % row,
                         xs.data(), b.data(), cc.data(), dt.data());
  }
  std::vector<float> y(n * m.inner);
  for (int64_t s = 0; s < seqs; ++s) {  // LaunchSsmScan: (sequence, head) CTAs, a column each
    float* state = states[s] + offset + (m.conv_width - 1) * m.conv_dim;
    for (int32_t hd = 0; hd < m.num_heads; ++hd) {
      const int32_t g = hd / (m.num_heads / m.num_groups);
      const float a_neg = -std::exp(L.ssm_a_log[hd]);
      for (int32_t p = 0; p < m.head_dim; ++p) {
        std::vector<float> col(m.d_state);
        for (int32_t k = 0; k < m.d_state; ++k)
          col[k] = state[(hd * m.d_state + k) * m.head_dim + p];
        for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
          const float step = dt[t * m.num_heads + hd];
          const int64_t at = (t * m.num_heads + hd) * m.head_dim + p;
          y[at] = internal::SsmScanToken(col.data(), m.d_state, internal::SsmDecay(step, a_neg),
                                         step, xs[at], &b[(t * m.num_groups + g) * m.d_state],
                                         &cc[(t * m.num_groups + g) * m.d_state], L.ssm_d[hd]);
        }
        for (int32_t k = 0; k < m.d_state; ++k)
          state[(hd * m.d_state + k) * m.head_dim + p] = col[k];
      }
    }
  }
  std::vector<float> normed(n * m.inner);
  for (int64_t r = 0; r < n; ++r) {  // LaunchSsmGatedNorm: (row, group) CTAs
    for (int64_t g0 = 0; g0 < m.inner; g0 += m.norm_group) {
      float ss = 0;
      for (int64_t i = g0; i < g0 + m.norm_group; ++i) {
        normed[r * m.inner + i] =
            internal::SsmGate(y[r * m.inner + i], proj[r * m.in_proj_dim + i]);
        ss += normed[r * m.inner + i] * normed[r * m.inner + i];
      }
      if (!c.ssm.gated_norm) continue;  // the kernel given no weight: gated only
      const float inv = internal::SsmNormScale(ss, m.norm_group, c.rms_norm_eps);
      for (int64_t i = g0; i < g0 + m.norm_group; ++i)
        normed[r * m.inner + i] *= inv * L.ssm_norm[i];
    }
  }
  MatMul(normed, n, L.ssm_out, h, m.inner, x, true);
  for (int64_t e = 0; e < n * h; ++e) {
    if (!L.ssm_out_bias.empty()) (*x)[e] += L.ssm_out_bias[e % h];
  }
}

// A step of a model whose layers are all state-space: each sequence's tokens, its state updated
// in place; the logits after each one's last token.
std::vector<std::vector<float>> Step(const ModelWeights& w,
                                     const std::vector<std::vector<int32_t>>& tokens,
                                     const std::vector<float*>& states) {
  const ModelConfig& c = w.config;
  const int64_t h = c.hidden_size, im = c.intermediate_size;
  std::vector<int32_t> starts = {0};
  std::vector<float> x;
  for (const auto& seq : tokens) {
    for (int32_t t : seq) x.insert(x.end(), &w.embed[t * h], &w.embed[(t + 1) * h]);
    starts.push_back(starts.back() + static_cast<int32_t>(seq.size()));
  }
  const int64_t n = starts.back();
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    Mixer(w, L, starts, states, static_cast<int64_t>(l) * c.ssm.state_floats(), &x);
    std::vector<float> gate, up;
    const std::vector<float> xm = RmsNorm(x, n, h, L.mlp_norm, c.rms_norm_eps);
    MatMul(xm, n, L.w_gate, im, h, &gate, false);
    MatMul(xm, n, L.w_up, im, h, &up, false);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
    MatMul(gate, n, L.w_down, h, im, &x, true);
  }
  std::vector<std::vector<float>> logits;
  for (size_t s = 0; s < tokens.size(); ++s) {
    const int64_t r = starts[s + 1] - 1;
    std::vector<float> last(x.begin() + r * h, x.begin() + (r + 1) * h), out;
    MatMul(RmsNorm(last, 1, h, w.final_norm, c.rms_norm_eps), 1, w.lm_head, c.vocab_size, h, &out,
           false);
    logits.push_back(out);
  }
  return logits;
}

ModelConfig Config(bool conv_bias, bool proj_bias, bool norm_per_group, bool gated_norm = true) {
  ModelConfig c = SmallTestConfig();
  c.layer_kinds = {kS, kS};
  c.ssm = {.num_heads = 4,
           .head_dim = 16,
           .d_state = 8,
           .num_groups = 2,
           .conv_width = 4,
           .conv_bias = conv_bias,
           .proj_bias = proj_bias,
           .norm_per_group = norm_per_group,
           .gated_norm = gated_norm};
  return c;
}

// Two sequences in one step each time: a prefill of 7 and one of 2 (shorter than the conv's
// window, so its carry keeps zeros from before the start), then a chunk of 3 and a decode, then
// two decodes; against a dense reference per sequence after every step.
TEST(SsmMathTest, TheKernelsDecompositionMatchesTheDenseReference) {
  for (const ModelConfig& c : {Config(true, false, true), Config(false, true, false),
                               Config(true, false, true, /*gated_norm=*/false)}) {
    const ModelWeights w = SyntheticWeights(c, 17);
    std::vector<std::vector<float>> slots(2, std::vector<float>(c.state_bytes() / 4, 0.0f));
    const std::vector<float*> states = {slots[0].data(), slots[1].data()};
    std::vector<DenseReference> refs(2, DenseReference(w, kernels::DType::kF32));
    const std::vector<int32_t> a = RandomTokens(12, 256, 1), b = RandomTokens(5, 256, 2);
    const std::vector<std::vector<std::vector<int32_t>>> steps = {
        {{a.begin(), a.begin() + 7}, {b.begin(), b.begin() + 2}},
        {{a.begin() + 7, a.begin() + 10}, {b[2]}},
        {{a[10]}, {b[3]}},
        {{a[11]}, {b[4]}}};
    for (size_t k = 0; k < steps.size(); ++k) {
      const auto logits = Step(w, steps[k], states);
      for (size_t s = 0; s < 2; ++s) {
        const std::vector<float> want = refs[s].Extend(steps[k][s]);
        EXPECT_LE(RelError(logits[s], want), HostTolerance(kernels::DType::kF32))
            << "step " << k << " sequence " << s;
        EXPECT_LE(RelError(slots[s], refs[s].State()), 2e-4) << "step " << k << " sequence " << s;
      }
    }
  }
}

// The pieces on their own, where a slip would be hidden by a forward pass's tolerance: the
// carry after a chunk shorter than the window is the last inputs, zeros before the start.
TEST(SsmMathTest, TheCarryHoldsTheLastInputsOldestFirst) {
  const SsmDims m{.num_heads = 1,
                  .head_dim = 1,
                  .d_state = 1,
                  .num_groups = 1,
                  .conv_width = 4,
                  .inner = 1,
                  .bc = 1,
                  .conv_dim = 3,
                  .in_proj_dim = 5,
                  .norm_group = 1};
  std::vector<float> carry(9, 0.0f), out(2 * 3);
  const std::vector<float> w(12, 1.0f);
  const std::vector<float> in = {1, 2, 3, 4, 5, 6};  // two rows of three channels
  for (int64_t ch = 0; ch < 3; ++ch) {
    internal::SsmConvChannel(m, in.data(), 3, 2, w.data(), nullptr, carry.data(), out.data(), ch);
  }
  EXPECT_EQ(carry, (std::vector<float>{0, 0, 0, 1, 2, 3, 4, 5, 6}));
  EXPECT_FLOAT_EQ(out[3], internal::SsmSilu(1 + 4));  // row 1, channel 0: inputs 0, 0, 1, 4
  for (int64_t ch = 0; ch < 3; ++ch) {                // one more row: the oldest input leaves
    internal::SsmConvChannel(m, in.data(), 3, 1, w.data(), nullptr, carry.data(), out.data(), ch);
  }
  EXPECT_EQ(carry, (std::vector<float>{1, 2, 3, 4, 5, 6, 1, 2, 3}));
  EXPECT_FLOAT_EQ(out[0], internal::SsmSilu(0 + 1 + 4 + 1));
}

// Every sequence of `starts` in ceil(rows / chunk) chunks of at most `chunk` rows, none empty.
void ExpectPlanSplitsEverySequence(const internal::SsmChunkPlan& plan,
                                   const std::vector<int32_t>& starts, int32_t chunk) {
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    EXPECT_EQ(plan.seq_chunks[s + 1] - plan.seq_chunks[s],
              (starts[s + 1] - starts[s] + chunk - 1) / chunk);
    EXPECT_EQ(plan.chunk_rows[plan.seq_chunks[s]], starts[s]);
  }
  for (size_t k = 0; k + 1 < plan.chunk_rows.size(); ++k) {
    EXPECT_GT(plan.chunk_rows[k + 1], plan.chunk_rows[k]);
    EXPECT_LE(plan.chunk_rows[k + 1] - plan.chunk_rows[k], chunk);
  }
}

// The chunked scan's three passes (internal/ssm_chunk.h) in the kernels' decomposition (a thread
// per (chunk, head, column), then per (sequence, head, column), then per (chunk, head, column)),
// for sequences of 1 to 300 rows in one step, chunks of 1 to 128 rows: the outputs and the states
// against the double-precision reference scan (kernels::cpu::SsmScanReference).
TEST(SsmMathTest, TheChunkedScanMatchesTheReferenceScan) {
  const SsmDims m = internal::SsmDimsOf(
      {.num_heads = 4, .head_dim = 16, .d_state = 8, .num_groups = 2, .conv_width = 4});
  std::vector<int32_t> starts = {0};
  for (int32_t rows : {1, 5, 64, 130, 300}) starts.push_back(starts.back() + rows);
  const int64_t n = starts.back(), seqs = static_cast<int64_t>(starts.size()) - 1;
  const int64_t state_floats = m.num_heads * m.d_state * m.head_dim;
  std::mt19937 rng(3);
  const auto uniform = [&rng](float lo, float hi, int64_t count) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(count));
    for (float& f : v) f = dist(rng);
    return v;
  };
  const std::vector<float> x = uniform(-1, 1, n * m.inner),
                           dt = uniform(0.01f, 0.2f, n * m.num_heads), b = uniform(-1, 1, n * m.bc),
                           c = uniform(-1, 1, n * m.bc), a_neg = uniform(-2, -0.5f, m.num_heads),
                           d = uniform(0.5f, 1.5f, m.num_heads),
                           initial = uniform(-0.5f, 0.5f, seqs * state_floats);
  std::vector<float> want_states = initial, want_y(n * m.inner);
  std::vector<float*> want_ptrs;
  for (int64_t s = 0; s < seqs; ++s) want_ptrs.push_back(&want_states[s * state_floats]);
  kernels::cpu::SsmScanReference({.num_seqs = static_cast<int32_t>(seqs),
                                  .num_heads = m.num_heads,
                                  .head_dim = m.head_dim,
                                  .d_state = m.d_state,
                                  .num_groups = m.num_groups,
                                  .starts = starts.data(),
                                  .x = x.data(),
                                  .dt = dt.data(),
                                  .a_log_neg = a_neg.data(),
                                  .b = b.data(),
                                  .c = c.data(),
                                  .d = d.data(),
                                  .states = want_ptrs.data(),
                                  .y = want_y.data()});
  for (int32_t chunk : {1, 7, 64, 128}) {
    SCOPED_TRACE(chunk);
    const internal::SsmChunkPlan plan = internal::PlanSsmChunks(starts, chunk);
    const int64_t chunks = static_cast<int64_t>(plan.chunk_rows.size()) - 1;
    ExpectPlanSplitsEverySequence(plan, starts, chunk);
    std::vector<float> states = initial, y(n * m.inner), col(m.d_state);
    std::vector<float> local(chunks * state_floats), decays(chunks * m.num_heads);
    for (int64_t k = 0; k < chunks; ++k) {  // pass 1
      for (int32_t h = 0; h < m.num_heads; ++h) {
        for (int32_t p = 0; p < m.head_dim; ++p) {
          internal::SsmChunkLocal(m, k, plan.chunk_rows[k], plan.chunk_rows[k + 1], h, p, x.data(),
                                  dt.data(), a_neg[h], b.data(), col.data(), local.data(),
                                  decays.data());
        }
      }
    }
    for (int64_t s = 0; s < seqs; ++s) {  // pass 2
      for (int32_t h = 0; h < m.num_heads; ++h) {
        for (int32_t p = 0; p < m.head_dim; ++p) {
          internal::SsmChunkCarry(m, plan.seq_chunks[s], plan.seq_chunks[s + 1], h, p,
                                  decays.data(), local.data(), &states[s * state_floats]);
        }
      }
    }
    for (int64_t k = 0; k < chunks; ++k) {  // pass 3
      for (int32_t h = 0; h < m.num_heads; ++h) {
        for (int32_t p = 0; p < m.head_dim; ++p) {
          internal::SsmChunkOutputs(m, k, plan.chunk_rows[k], plan.chunk_rows[k + 1], h, p,
                                    x.data(), dt.data(), a_neg[h], b.data(), c.data(), d.data(),
                                    local.data(), col.data(), y.data());
        }
      }
    }
    EXPECT_LE(RelError(y, want_y), 1e-4);
    EXPECT_LE(RelError(states, want_states), 1e-4);
  }
}

}  // namespace
}  // namespace kvpool::model
