#include "model/internal/ssm_mixer.h"

namespace kvpool::model::internal {

SsmDims SsmDimsOf(const SsmConfig& m) {
  return {.num_heads = m.num_heads,
          .head_dim = m.head_dim,
          .d_state = m.d_state,
          .num_groups = m.num_groups,
          .conv_width = m.conv_width,
          .inner = m.inner(),
          .bc = int64_t{m.num_groups} * m.d_state,
          .conv_dim = m.conv_dim(),
          .in_proj_dim = m.in_proj_dim(),
          .norm_group = m.norm_per_group ? m.inner() / m.num_groups : m.inner()};
}

void SsmConv(const SsmDims& m, const float* in, int64_t in_stride, int64_t rows, const float* w,
             const float* bias, float* carry, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t ch = 0; ch < m.conv_dim; ++ch) {
      out[r * m.conv_dim + ch] = SsmConvAt(m, in, in_stride, carry, w, bias, r, ch);
    }
  }
  for (int64_t ch = 0; ch < m.conv_dim; ++ch) SsmCarryShift(m, in, in_stride, rows, carry, ch);
}

void SsmSplit(const SsmDims& m, const float* xbc, const float* proj, const float* dt_bias,
              int64_t rows, float* x, float* b, float* c, float* dt) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t e = 0; e < m.conv_dim + m.num_heads; ++e) {
      SsmSplitAt(m, xbc, proj, dt_bias, t, e, x, b, c, dt);
    }
  }
}

void SsmGatedNorm(const SsmDims& m, const float* y, const float* z, int64_t z_stride, int64_t rows,
                  const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * m.inner;
    const float* zr = z + r * z_stride;
    float* o = out + r * m.inner;
    for (int64_t i = 0; i < m.inner; ++i) o[i] = SsmGate(yr[i], zr[i]);
    if (weight == nullptr) continue;  // gated, not normalized
    for (int64_t g0 = 0; g0 < m.inner; g0 += m.norm_group) {
      float ss = 0;
      for (int64_t i = g0; i < g0 + m.norm_group; ++i) ss += o[i] * o[i];
      const float inv = SsmNormScale(ss, m.norm_group, eps);
      for (int64_t i = g0; i < g0 + m.norm_group; ++i) o[i] = o[i] * inv * weight[i];
    }
  }
}

void AddBias(float* y, int64_t rows, int64_t dim, int64_t stride, const float* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i) y[r * stride + i] += bias[i];
  }
}

}  // namespace kvpool::model::internal
