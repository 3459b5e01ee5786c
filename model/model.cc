#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <numeric>

#include "fmt/format.h"
#include "kernels/cpu_kernels.h"
#include "kernels/dtype.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/status_macros.h"
#include "model/internal/gemm.h"
#include "model/internal/logits.h"
#include "model/internal/ordered_matmul.h"
#include "model/internal/skinny_matmul.h"
#include "model/internal/ssm_mixer.h"
#include "model/internal/step_layout.h"

namespace kvpool::model {

// Buffers reused from step to step. They grow to the largest step's size and are given back
// (Trim) once steps have stayed small for a while: one oversized step does not pin its memory.
struct Model::Scratch {
  std::vector<float> x;                 // [tokens][hidden] the residual stream
  std::vector<float> xn;                // [tokens][hidden] normalized
  std::vector<float> qkv;               // [tokens][q + 2 kv]
  std::vector<float> q;                 // [tokens][heads][head_dim] rotated queries
  std::vector<float> attn;              // [tokens][heads][head_dim] attention output
  std::vector<float> k;                 // [tokens][kv_heads][head_dim], what WriteKv stores
  std::vector<float> v;                 // same
  std::vector<float> gate_up;           // [tokens][2 * intermediate]
  std::vector<float> act;               // [tokens][intermediate]
  std::vector<float> cos;               // [tokens][head_dim / 2]
  std::vector<float> sin;               // same
  std::vector<float> last;              // [items][hidden]
  std::vector<float> logits;            // [items][vocab]
  internal::StepLayout step;            // rows, tables and lengths of the step (decode items first)
  std::vector<char> prefill_workspace;  // kernels::cpu::PrefillWorkspaceBytes
  std::vector<float> gemm;              // internal::GemmScratchFloats
  // State-space layers.
  std::vector<float> ssm_proj;       // [tokens][in_proj_dim]: z, x, B, C, dt
  std::vector<float> ssm_xbc;        // [tokens][conv_dim] after the conv
  std::vector<float> ssm_x;          // [tokens][ssm heads][head_dim]
  std::vector<float> ssm_b;          // [tokens][groups][d_state]
  std::vector<float> ssm_c;          // same
  std::vector<float> ssm_dt;         // [tokens][ssm heads]
  std::vector<float> ssm_y;          // [tokens][inner]
  std::vector<int32_t> seq_starts;   // [sequences + 1]: each sequence's rows, in row order
  std::vector<float*> seq_states;    // [sequences]: its state (every layer's)
  std::vector<float*> layer_states;  // [sequences]: one layer's scan state

  // Steps in a row that needed under a quarter of the tokens (or items) the buffers hold.
  static constexpr int kTrimAfterSmallSteps = 8;
  int64_t peak_tokens = 0;
  int64_t peak_items = 0;
  int small_steps = 0;

  int64_t Bytes() const {
    auto bytes = [](const auto& v) { return static_cast<int64_t>(v.capacity() * sizeof(v[0])); };
    return bytes(x) + bytes(xn) + bytes(qkv) + bytes(q) + bytes(attn) + bytes(k) + bytes(v) +
           bytes(gate_up) + bytes(act) + bytes(cos) + bytes(sin) + bytes(last) + bytes(logits) +
           bytes(gemm) + bytes(ssm_proj) + bytes(ssm_xbc) + bytes(ssm_x) + bytes(ssm_b) +
           bytes(ssm_c) + bytes(ssm_dt) + bytes(ssm_y);
  }

  // After a step of `tokens` tokens and `items` items.
  void Trim(int64_t tokens, int64_t items) {
    peak_tokens = std::max(peak_tokens, tokens);
    peak_items = std::max(peak_items, items);
    const bool small = tokens * 4 < peak_tokens || items * 4 < peak_items;
    small_steps = small ? small_steps + 1 : 0;
    if (small_steps < kTrimAfterSmallSteps) return;
    // The next step allocates what it needs (once).
    for (std::vector<float>* f : {&x,        &xn,      &qkv,   &q,     &attn,  &k,      &v,
                                  &gate_up,  &act,     &cos,   &sin,   &last,  &logits, &gemm,
                                  &ssm_proj, &ssm_xbc, &ssm_x, &ssm_b, &ssm_c, &ssm_dt, &ssm_y}) {
      std::vector<float>().swap(*f);
    }
    peak_tokens = tokens;
    peak_items = items;
    small_steps = 0;
  }
};

namespace {

template <typename T>
void Reserve(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

void RmsNorm(const float* x, int64_t rows, int32_t dim, const std::vector<float>& weight, float eps,
             float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    float ss = 0;
    for (int32_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int32_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * weight[static_cast<size_t>(i)];
  }
}

// Rotates the first `rotary` values of one head in place (the Hugging Face "rotate_half"
// convention: element i pairs with element i + rotary / 2); the rest stay as they are.
void Rope(float* head, int32_t rotary, const float* cos, const float* sin) {
  const int32_t half = rotary / 2;
  for (int32_t i = 0; i < half; ++i) {
    const float a = head[i];
    const float b = head[i + half];
    head[i] = a * cos[i] - b * sin[i];
    head[i + half] = b * cos[i] + a * sin[i];
  }
}

}  // namespace

// Decode-sized products read each weight once (internal/skinny_matmul.h; with state-space layers
// internal/ordered_matmul.h, which sums as Gemm does), larger ones go through internal/gemm.h.
void Model::Linear(const float* x, int64_t rows, const internal::HugeVector& w, int32_t out,
                   int32_t in, float* y, bool accumulate) {
  if (rows <= internal::kMaxSkinnyRows && !rows_independent_) {
    internal::SkinnyMatMul(x, static_cast<int32_t>(rows), w.data(), out, in, y, accumulate,
                           &threads_);
    return;
  }
  if (rows <= internal::kMaxSkinnyRows && internal::OrderedMatMulAvailable()) {
    if (const auto packed = packed_.find(w.data()); packed != packed_.end()) {
      internal::OrderedMatMul(x, static_cast<int32_t>(rows), packed->second.data(), out, in, y,
                              accumulate, &threads_);
      return;
    }
  }
  std::vector<float>& scratch = scratch_->gemm;
  Reserve(scratch,
          static_cast<size_t>(internal::GemmScratchFloats(static_cast<int32_t>(rows), in)));
  internal::Gemm(x, static_cast<int32_t>(rows), w.data(), out, in, y, accumulate, scratch.data(),
                 &threads_);
}

absl::StatusOr<std::unique_ptr<Model>> Model::Create(ModelWeights weights,
                                                     const kernels::PoolLayout& layout,
                                                     const Options& options) {
  KVPOOL_RETURN_IF_ERROR(CheckModel(weights, layout));
  // A model the kernels cannot run is refused here, not at its first step.
  KVPOOL_RETURN_IF_ERROR(
      kernels::cpu::CheckAttentionShape(weights.config.num_heads, weights.config.head_dim));
  return std::unique_ptr<Model>(new Model(std::move(weights), layout, options));
}

Model::Model(ModelWeights weights, const kernels::PoolLayout& layout, const Options& options)
    : config_(weights.config),
      layout_(layout),
      weights_(std::move(weights)),
      threads_(options.threads),
      scratch_(std::make_unique<Scratch>()) {
  rows_independent_ = config_.num_state_layers() > 0;
  const auto stack = [](std::initializer_list<std::vector<float>*> parts) {
    size_t n = 0;
    for (const std::vector<float>* p : parts) n += p->size();
    internal::HugeVector out;
    out.reserve(n);
    for (std::vector<float>* p : parts) {
      out.insert(out.end(), p->begin(), p->end());
      std::vector<float>().swap(*p);  // the copy is what the step reads
    }
    return out;
  };
  for (LayerWeights& L : weights_.layers) {
    wqkv_.push_back(stack({&L.wq, &L.wk, &L.wv}));
    w_gate_up_.push_back(stack({&L.w_gate, &L.w_up}));
    wo_.push_back(stack({&L.wo}));
    w_down_.push_back(stack({&L.w_down}));
    ssm_in_.push_back(stack({&L.ssm_in}));
    ssm_out_.push_back(stack({&L.ssm_out}));
    std::vector<float>& a = ssm_a_neg_.emplace_back();
    for (float a_log : L.ssm_a_log) a.push_back(-std::exp(a_log));
  }
  head_ = stack({config_.tie_word_embeddings ? &weights_.embed : &weights_.lm_head});
  if (rows_independent_ && internal::OrderedMatMulAvailable()) PackForDecode();
  scratch_->prefill_workspace.resize(
      static_cast<size_t>(kernels::cpu::PrefillWorkspaceBytes(layout_, threads_.threads())));
  const int32_t rotary = config_.rotary();
  for (int32_t i = 0; i < rotary / 2; ++i) {
    inv_freq_.push_back(static_cast<float>(
        1.0 / std::pow(static_cast<double>(config_.rope_theta), 2.0 * i / rotary)));
  }
}

Model::~Model() = default;

void Model::PackForDecode() {
  const ModelConfig& c = config_;
  const int32_t h = c.hidden_size, im = c.intermediate_size;
  const int32_t qd = c.num_heads * c.head_dim, qkvd = qd + 2 * c.num_kv_heads * c.head_dim;
  const auto pack = [&](const internal::HugeVector& w, int32_t out, int32_t in) {
    if (!w.empty()) packed_.emplace(w.data(), internal::PackOrdered(w.data(), out, in));
  };
  for (size_t l = 0; l < wqkv_.size(); ++l) {
    pack(wqkv_[l], qkvd, h);
    pack(w_gate_up_[l], c.mlp_in_rows(), h);
    pack(wo_[l], h, qd);
    pack(w_down_[l], h, im);
    pack(ssm_in_[l], static_cast<int32_t>(c.ssm.in_proj_dim()), h);
    pack(ssm_out_[l], h, static_cast<int32_t>(c.ssm.inner()));
  }
  pack(head_, c.vocab_size, h);
}

int64_t Model::weight_bytes() const {
  int64_t n = static_cast<int64_t>(weights_.final_norm.size() + head_.size());
  for (size_t l = 0; l < weights_.layers.size(); ++l) {
    const LayerWeights& L = weights_.layers[l];
    n += static_cast<int64_t>(
        wqkv_[l].size() + w_gate_up_[l].size() + wo_[l].size() + w_down_[l].size() +
        L.attn_norm.size() + L.mlp_norm.size() + ssm_in_[l].size() + ssm_out_[l].size() +
        L.ssm_conv.size() + L.ssm_conv_bias.size() + L.ssm_dt_bias.size() + L.ssm_a_log.size() +
        L.ssm_in_bias.size() + L.ssm_out_bias.size() + L.ssm_d.size() + L.ssm_norm.size());
  }
  return n * static_cast<int64_t>(sizeof(float));
}

absl::Status Model::RunStep(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                            const StepOptions& options, std::vector<ItemResult>* results) {
  return RunPhase(pool, items, {}, options, results);
}

absl::Status Model::CopyStates(std::span<const StateCopy> copies) {
  for (const StateCopy& copy : copies) {
    std::memcpy(copy.to.data(), copy.from.data(), copy.from.size_bytes());
  }
  return absl::OkStatus();
}

absl::Status Model::RunPhase(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                             std::span<const uint8_t> in_prefill, const StepOptions& options,
                             std::vector<ItemResult>* results) {
  const ModelConfig& c = config_;
  const int32_t h = c.hidden_size, half = c.rotary() / 2;
  Scratch& s = *scratch_;

  // Lay the step's tokens out (decode items first) with their embeddings and RoPE angles.
  internal::PlanStepLayout(items, in_prefill, layout_.block_size,
                           /*window_group=*/layout_.num_window_layers > 0, &s.step);
  const int64_t n = s.step.num_tokens;
  const size_t nt = static_cast<size_t>(n);
  Reserve(s.x, nt * static_cast<size_t>(h));
  Reserve(s.xn, nt * static_cast<size_t>(h));
  Reserve(s.cos, nt * static_cast<size_t>(half));
  Reserve(s.sin, nt * static_cast<size_t>(half));
  const float* embed = config_.tie_word_embeddings ? head_.data() : weights_.embed.data();
  for (size_t t = 0; t < nt; ++t) {
    std::memcpy(&s.x[t * static_cast<size_t>(h)],
                &embed[static_cast<size_t>(s.step.tokens[t]) * static_cast<size_t>(h)],
                static_cast<size_t>(h) * sizeof(float));
    for (int32_t i = 0; i < half; ++i) {
      // Angles in double: positions reach the tens of thousands.
      const double angle =
          static_cast<double>(s.step.positions[t]) * inv_freq_[static_cast<size_t>(i)];
      s.cos[t * static_cast<size_t>(half) + static_cast<size_t>(i)] =
          static_cast<float>(std::cos(angle));
      s.sin[t * static_cast<size_t>(half) + static_cast<size_t>(i)] =
          static_cast<float>(std::sin(angle));
    }
  }

  if (c.num_state_layers() > 0) PlanStates(items);
  for (int32_t layer = 0; layer < c.num_layers; ++layer) Layer(layer, pool, n);

  // The prediction after each item's last token.
  const size_t ni = items.size();
  Reserve(s.last, ni * static_cast<size_t>(h));
  Reserve(s.logits, ni * static_cast<size_t>(c.vocab_size));
  for (size_t i = 0; i < ni; ++i) {
    RmsNorm(&s.x[static_cast<size_t>(s.step.last_rows[i]) * static_cast<size_t>(h)], 1, h,
            weights_.final_norm, c.rms_norm_eps, &s.last[i * static_cast<size_t>(h)]);
  }
  Linear(s.last.data(), static_cast<int64_t>(ni), head_, c.vocab_size, h, s.logits.data());

  results->clear();
  results->resize(ni);
  for (size_t i = 0; i < ni; ++i) {
    internal::FillResult(&s.logits[i * static_cast<size_t>(c.vocab_size)], c.vocab_size, options,
                         items[i], &(*results)[i]);
  }
  s.Trim(n, static_cast<int64_t>(ni));
  return absl::OkStatus();
}

int64_t Model::scratch_bytes() const { return scratch_->Bytes(); }

// Decode items through the decode kernel, prefill items through the tiled prefill kernel.
void Model::Attention(int32_t layer, const kernels::KvPoolView& pool) {
  const ModelConfig& c = config_;
  const int32_t kv_layer = PoolLayer(layer);  // its K/V's place in the pool
  Scratch& s = *scratch_;
  const internal::StepLayout& L = s.step;
  // A window layer of a pool with a window group reads its region through the window tables.
  const int32_t* tables =
      layout_.is_window_layer(kv_layer) ? L.window_tables.data() : L.tables.data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  const int64_t qd = int64_t{c.num_heads} * c.head_dim;
  if (L.num_decode > 0) {
    KVPOOL_CHECK_OK(kernels::cpu::PagedAttentionDecode(pool,
                                                       {.layer = kv_layer,
                                                        .num_seqs = L.num_decode,
                                                        .num_q_heads = c.num_heads,
                                                        .scale = scale,
                                                        .q = s.q.data(),
                                                        .out = s.attn.data(),
                                                        .block_tables = tables,
                                                        .table_stride = L.stride,
                                                        .seq_lens = L.lens.data(),
                                                        .max_seq_len = L.max_len,
                                                        .window = c.window(layer)},
                                                       &threads_));
  }
  if (L.num_prefill > 0) {
    const int64_t first = static_cast<int64_t>(L.num_decode);
    KVPOOL_CHECK_OK(kernels::cpu::PagedAttentionPrefill(
        pool,
        {.layer = kv_layer,
         .num_seqs = L.num_prefill,
         .num_q_heads = c.num_heads,
         .scale = scale,
         .q = s.q.data() + first * qd,
         .out = s.attn.data() + first * qd,
         .q_starts = L.q_starts.data(),
         .block_tables = tables + first * L.stride,
         .table_stride = L.stride,
         .seq_lens = L.lens.data() + first,
         .max_seq_len = L.max_len,
         .max_q_len = L.max_q_len,
         .window = c.window(layer),
         .workspace = s.prefill_workspace.data(),
         .workspace_bytes = static_cast<int64_t>(s.prefill_workspace.size())},
        &threads_));
  }
}

void Model::Layer(int32_t layer, const kernels::KvPoolView& pool, int64_t n) {
  const ModelConfig& c = config_;
  const LayerWeights& L = weights_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int32_t h = c.hidden_size, im = c.intermediate_size;
  const size_t nt = static_cast<size_t>(n);

  if (c.kind(layer) == LayerKind::kParallelHybrid) {
    // One norm; attention and the mixer both read it and both add into the residual stream.
    RmsNorm(s.x.data(), n, h, L.attn_norm, c.rms_norm_eps, s.xn.data());
    SelfAttention(layer, pool, n, /*normed=*/true);
    StateSpace(layer, n, /*normed=*/true);
  } else if (c.kind(layer) == LayerKind::kStateSpace) {
    StateSpace(layer, n, /*normed=*/false);
  } else if (c.is_attention(layer)) {
    SelfAttention(layer, pool, n, /*normed=*/false);
  }
  if (!c.has_mlp(layer)) return;

  // MLP: SwiGLU over gate and up, or squared ReLU over up alone (in place).
  const int32_t rows = c.mlp_in_rows();
  RmsNorm(s.x.data(), n, h, L.mlp_norm, c.rms_norm_eps, s.xn.data());
  Reserve(s.gate_up, nt * static_cast<size_t>(rows));
  Linear(s.xn.data(), n, w_gate_up_[static_cast<size_t>(layer)], rows, h, s.gate_up.data());
  float* act = s.gate_up.data();
  if (c.gated_mlp()) {
    Reserve(s.act, nt * static_cast<size_t>(im));
    for (size_t t = 0; t < nt; ++t) {
      const float* g = &s.gate_up[t * 2 * static_cast<size_t>(im)];
      const float* u = g + im;
      float* a = &s.act[t * static_cast<size_t>(im)];
      for (int32_t i = 0; i < im; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
    act = s.act.data();
  } else {
    for (size_t e = 0; e < nt * static_cast<size_t>(im); ++e) {
      const float r = std::max(act[e], 0.0f);
      act[e] = r * r;
    }
  }
  Linear(act, n, w_down_[static_cast<size_t>(layer)], h, im, s.x.data(), /*accumulate=*/true);
}

void Model::SelfAttention(int32_t layer, const kernels::KvPoolView& pool, int64_t n, bool normed) {
  const ModelConfig& c = config_;
  const LayerWeights& L = weights_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int32_t h = c.hidden_size, hd = c.head_dim, rotary = c.rotary(), half = rotary / 2;
  const int32_t qd = c.num_heads * hd, kvd = c.num_kv_heads * hd, qkvd = qd + 2 * kvd;
  const size_t nt = static_cast<size_t>(n);
  const size_t kv_row = static_cast<size_t>(kvd);
  if (!normed) RmsNorm(s.x.data(), n, h, L.attn_norm, c.rms_norm_eps, s.xn.data());
  Reserve(s.qkv, nt * static_cast<size_t>(qkvd));
  Linear(s.xn.data(), n, wqkv_[static_cast<size_t>(layer)], qkvd, h, s.qkv.data());
  Reserve(s.q, nt * static_cast<size_t>(qd));
  Reserve(s.attn, nt * static_cast<size_t>(qd));
  Reserve(s.k, nt * kv_row);
  Reserve(s.v, nt * kv_row);
  for (size_t t = 0; t < nt; ++t) {
    float* qkv = &s.qkv[t * static_cast<size_t>(qkvd)];
    const float* cs = s.cos.data() + t * static_cast<size_t>(half);
    const float* sn = s.sin.data() + t * static_cast<size_t>(half);
    for (int32_t head = 0; rotary > 0 && head < c.num_heads + c.num_kv_heads; ++head) {
      Rope(qkv + head * hd, rotary, cs, sn);  // queries, then keys (none without RoPE)
    }
    std::memcpy(&s.q[t * static_cast<size_t>(qd)], qkv, static_cast<size_t>(qd) * sizeof(float));
    std::memcpy(&s.k[t * kv_row], qkv + qd, kv_row * sizeof(float));
    std::memcpy(&s.v[t * kv_row], qkv + qd + kvd, kv_row * sizeof(float));
  }
  // Every new token's K/V goes in (converted to the layer's dtypes, quantized for 8-bit ones)
  // before any query reads: a prefill token attends to the tokens before it in the same step.
  const int32_t kv_layer = PoolLayer(layer);
  const std::vector<int64_t>& slots =
      layout_.is_window_layer(kv_layer) ? s.step.window_slots : s.step.slots;
  KVPOOL_CHECK_OK(kernels::cpu::WriteKv(pool, {.layer = kv_layer,
                                               .num_tokens = static_cast<int32_t>(n),
                                               .k = s.k.data(),
                                               .v = s.v.data(),
                                               .slots = slots.data()}));
  Attention(layer, pool);
  Linear(s.attn.data(), n, wo_[static_cast<size_t>(layer)], h, qd, s.x.data(),
         /*accumulate=*/true);
}

// Rows are grouped by item (StepLayout: decode items first, then prefill items); the scan wants
// each sequence's rows in order, with its state.
void Model::PlanStates(std::span<const StepItem> items) {
  Scratch& s = *scratch_;
  std::vector<std::pair<int32_t, size_t>> first;  // (first row, item)
  first.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const auto rows = static_cast<int32_t>(items[i].tokens.size());
    first.emplace_back(s.step.last_rows[i] - rows + 1, i);
  }
  std::sort(first.begin(), first.end());
  s.seq_starts.clear();
  s.seq_states.clear();
  for (const auto& [row, i] : first) {
    s.seq_starts.push_back(row);
    s.seq_states.push_back(items[i].state.data());
  }
  s.seq_starts.push_back(static_cast<int32_t>(s.step.num_tokens));
}

void Model::StateSpace(int32_t layer, int64_t n, bool normed) {
  const ModelConfig& c = config_;
  const SsmConfig& m = c.ssm;
  const internal::SsmDims dims = internal::SsmDimsOf(m);
  const LayerWeights& L = weights_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int32_t h = c.hidden_size;
  const auto inner = static_cast<int32_t>(m.inner()), proj = static_cast<int32_t>(m.in_proj_dim());
  const int64_t conv_dim = m.conv_dim(), bc = dims.bc;
  const size_t nt = static_cast<size_t>(n);
  // This layer's state within each sequence's: the layers before it that have one come first.
  int64_t offset = 0;
  for (int32_t l = 0; l < layer; ++l) offset += c.has_state(l) ? m.state_floats() : 0;

  if (!normed) RmsNorm(s.x.data(), n, h, L.attn_norm, c.rms_norm_eps, s.xn.data());
  Reserve(s.ssm_proj, nt * static_cast<size_t>(proj));
  Linear(s.xn.data(), n, ssm_in_[static_cast<size_t>(layer)], proj, h, s.ssm_proj.data());
  if (m.proj_bias) internal::AddBias(s.ssm_proj.data(), n, proj, proj, L.ssm_in_bias.data());
  // Per sequence: the conv over x, B and C with the inputs it carries.
  Reserve(s.ssm_xbc, nt * static_cast<size_t>(conv_dim));
  const size_t seqs = s.seq_states.size();
  const float* conv_bias = m.conv_bias ? L.ssm_conv_bias.data() : nullptr;
  for (size_t q = 0; q < seqs; ++q) {
    const int64_t r0 = s.seq_starts[q], r1 = s.seq_starts[q + 1];
    internal::SsmConv(dims, &s.ssm_proj[static_cast<size_t>(r0 * proj + inner)], proj, r1 - r0,
                      L.ssm_conv.data(), conv_bias, s.seq_states[q] + offset,
                      &s.ssm_xbc[static_cast<size_t>(r0 * conv_dim)]);
  }
  // The scan's operands, each contiguous per token.
  Reserve(s.ssm_x, nt * static_cast<size_t>(inner));
  Reserve(s.ssm_b, nt * static_cast<size_t>(bc));
  Reserve(s.ssm_c, nt * static_cast<size_t>(bc));
  Reserve(s.ssm_dt, nt * static_cast<size_t>(m.num_heads));
  Reserve(s.ssm_y, nt * static_cast<size_t>(inner));
  internal::SsmSplit(dims, s.ssm_xbc.data(), s.ssm_proj.data(), L.ssm_dt_bias.data(), n,
                     s.ssm_x.data(), s.ssm_b.data(), s.ssm_c.data(), s.ssm_dt.data());
  s.layer_states.resize(seqs);
  for (size_t q = 0; q < seqs; ++q) {
    s.layer_states[q] = s.seq_states[q] + offset + m.conv_state_floats();
  }
  KVPOOL_CHECK_OK(kernels::cpu::SsmScan({.num_seqs = static_cast<int32_t>(seqs),
                                         .num_heads = m.num_heads,
                                         .head_dim = m.head_dim,
                                         .d_state = m.d_state,
                                         .num_groups = m.num_groups,
                                         .starts = s.seq_starts.data(),
                                         .x = s.ssm_x.data(),
                                         .dt = s.ssm_dt.data(),
                                         .a_log_neg = ssm_a_neg_[static_cast<size_t>(layer)].data(),
                                         .b = s.ssm_b.data(),
                                         .c = s.ssm_c.data(),
                                         .d = L.ssm_d.data(),
                                         .states = s.layer_states.data(),
                                         .y = s.ssm_y.data()},
                                        &threads_));
  // Gate, norm (into ssm_x, free now) and the output projection into the residual stream.
  internal::SsmGatedNorm(dims, s.ssm_y.data(), s.ssm_proj.data(), proj, n,
                         m.gated_norm ? L.ssm_norm.data() : nullptr, c.rms_norm_eps,
                         s.ssm_x.data());
  Linear(s.ssm_x.data(), n, ssm_out_[static_cast<size_t>(layer)], h, inner, s.x.data(),
         /*accumulate=*/true);
  if (m.proj_bias) internal::AddBias(s.x.data(), n, h, h, L.ssm_out_bias.data());
}

}  // namespace kvpool::model
