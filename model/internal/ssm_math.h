#pragma once

// The per-element arithmetic of a state-space (Mamba-2) layer around the scan, shared by the
// host model (ssm_mixer.cc) and the CUDA model's kernels (model/cuda/ssm_kernels.cu): one
// definition, compiled for the host and, under nvcc, for the device. Every function here is the
// work of one element, one channel or one row, written so that a kernel thread can run it as is;
// tests/model/ssm_math_test.cc runs them in the CUDA kernels' decomposition on the CPU and holds
// the result to the dense reference. What the test cannot see is the launch geometry and the
// memory movement around these calls (model/cuda/ssm_kernels.cu).
//
// Plain arithmetic in f32: expf, log1pf and sqrtf are the host's libm here and CUDA's on the
// device (within 2 ulp of each other), so host and device agree to rounding, not bit for bit.

#include <math.h>

#include <cstdint>

#include "kernels/dtype.h"  // KVPOOL_HOST_DEVICE

namespace kvpool::model::internal {

// SsmConfig (weights.h) as the kernels see it: plain fields, no member functions to call on a
// device. Made by SsmDimsOf (ssm_mixer.h).
struct SsmDims {
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  int32_t d_state = 0;
  int32_t num_groups = 0;
  int32_t conv_width = 0;
  int64_t inner = 0;        // num_heads * head_dim
  int64_t bc = 0;           // num_groups * d_state: B's (and C's) width
  int64_t conv_dim = 0;     // inner + 2 * bc
  int64_t in_proj_dim = 0;  // inner + conv_dim + num_heads: z, x, B, C, dt
  int64_t norm_group = 0;   // values one gated-RMSNorm sum covers: inner / num_groups or inner
};

KVPOOL_HOST_DEVICE inline float SsmSilu(float v) { return v / (1.0f + expf(-v)); }

// softplus(v + bias) for Mamba-2's dt: log(1 + e^x), x itself above 20 (as torch's softplus).
KVPOOL_HOST_DEVICE inline float SsmSoftplus(float v, float bias) {
  const float x = v + bias;
  return x > 20.0f ? x : log1pf(expf(x));
}

// Input p of one sequence's conv windows, channel ch: the carried inputs ([conv_width - 1]
// [conv_dim], oldest first) for p < conv_width - 1, then the step's rows (in[row * in_stride]).
KVPOOL_HOST_DEVICE inline float SsmConvInput(const SsmDims& m, const float* in, int64_t in_stride,
                                             const float* carry, int64_t p, int64_t ch) {
  const int64_t held = m.conv_width - 1;
  return p < held ? carry[p * m.conv_dim + ch] : in[(p - held) * in_stride + ch];
}

// Row r's conv output of channel ch: silu(bias[ch] + sum_j w[ch][j] * input(r + j)), the taps in
// order (w: [conv_dim][conv_width], the last tap this row's own input); bias may be null (none).
KVPOOL_HOST_DEVICE inline float SsmConvAt(const SsmDims& m, const float* in, int64_t in_stride,
                                          const float* carry, const float* w, const float* bias,
                                          int64_t r, int64_t ch) {
  const float* wc = w + ch * m.conv_width;
  float acc = bias != nullptr ? bias[ch] : 0.0f;
  for (int32_t j = 0; j < m.conv_width; ++j) {
    acc += wc[j] * SsmConvInput(m, in, in_stride, carry, r + j, ch);
  }
  return SsmSilu(acc);
}

// After a sequence's `rows` rows: channel ch of `carry` becomes the last conv_width - 1 inputs.
// In place: entry p takes input(rows + p), an entry after p or a row, so increasing p never
// reads what it already wrote. Run after every SsmConvAt of the sequence's rows.
KVPOOL_HOST_DEVICE inline void SsmCarryShift(const SsmDims& m, const float* in, int64_t in_stride,
                                             int64_t rows, float* carry, int64_t ch) {
  for (int64_t p = 0; p < m.conv_width - 1; ++p) {
    carry[p * m.conv_dim + ch] = SsmConvInput(m, in, in_stride, carry, rows + p, ch);
  }
}

// One thread's conv work: channel ch of one sequence's `rows` rows (in: its first row, out: its
// first output row, [rows][conv_dim]), every output before the carry moves on.
KVPOOL_HOST_DEVICE inline void SsmConvChannel(const SsmDims& m, const float* in, int64_t in_stride,
                                              int64_t rows, const float* w, const float* bias,
                                              float* carry, float* out, int64_t ch) {
  for (int64_t r = 0; r < rows; ++r) {
    out[r * m.conv_dim + ch] = SsmConvAt(m, in, in_stride, carry, w, bias, r, ch);
  }
  SsmCarryShift(m, in, in_stride, rows, carry, ch);
}

// Element e of token t's scan operands, taken from its conv output (xbc: [conv_dim], x then B
// then C) and its projection (proj: [in_proj_dim], dt after z and the conv inputs): e in
// [0, inner) is x, then bc of B, bc of C, and num_heads of dt (softplus of dt + dt_bias).
// x: [tokens][inner], b and c: [tokens][bc], dt: [tokens][num_heads].
KVPOOL_HOST_DEVICE inline void SsmSplitAt(const SsmDims& m, const float* xbc, const float* proj,
                                          const float* dt_bias, int64_t t, int64_t e, float* x,
                                          float* b, float* c, float* dt) {
  const float* row = xbc + t * m.conv_dim;
  if (e < m.inner) {
    x[t * m.inner + e] = row[e];
  } else if (e < m.inner + m.bc) {
    b[t * m.bc + (e - m.inner)] = row[e];
  } else if (e < m.conv_dim) {
    c[t * m.bc + (e - m.inner - m.bc)] = row[e];
  } else {
    const int64_t h = e - m.conv_dim;
    dt[t * m.num_heads + h] =
        SsmSoftplus(proj[t * m.in_proj_dim + m.inner + m.conv_dim + h], dt_bias[h]);
  }
}

// The recurrence of one head for one token, on one column p of its state [d_state][head_dim]
// (col[n] is state[n][p]): col[n] = decay * col[n] + (dt * b[n]) * x, and the output
// skip * x + sum_n c[n] * col[n], n in order (cpu::SsmScan's arithmetic). decay = SsmDecay.
KVPOOL_HOST_DEVICE inline float SsmDecay(float dt, float a_neg) { return expf(dt * a_neg); }
KVPOOL_HOST_DEVICE inline float SsmScanToken(float* col, int32_t d_state, float decay, float dt,
                                             float x, const float* b, const float* c, float skip) {
  float y = skip * x;
  for (int32_t n = 0; n < d_state; ++n) {
    col[n] = decay * col[n] + (dt * b[n]) * x;
    y += c[n] * col[n];
  }
  return y;
}

// The gated RMSNorm (mamba_ssm's RMSNormGated, norm_before_gate=False): g = y * silu(z) per
// value; then per norm group g * rsqrt(mean(g^2) + eps) * weight.
KVPOOL_HOST_DEVICE inline float SsmGate(float y, float z) { return y * SsmSilu(z); }
KVPOOL_HOST_DEVICE inline float SsmNormScale(float sum_squares, int64_t count, float eps) {
  return 1.0f / sqrtf(sum_squares / static_cast<float>(count) + eps);
}

}  // namespace kvpool::model::internal
