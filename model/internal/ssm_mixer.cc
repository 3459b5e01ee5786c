#include "model/internal/ssm_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvpool::model::internal {
namespace {

float Silu(float v) { return v / (1.0f + std::exp(-v)); }

}  // namespace

void SsmConv(const SsmConfig& m, const float* in, int64_t in_stride, int64_t rows, const float* w,
             const float* bias, float* carry, float* out) {
  const int64_t dim = m.conv_dim();
  const int64_t held = m.conv_width - 1;  // inputs carried from earlier steps
  // Input j of the window of row r: a carried one while r + j < held, else a row of `in`.
  const auto input = [&](int64_t pos, int64_t ch) {
    return pos < held ? carry[pos * dim + ch] : in[(pos - held) * in_stride + ch];
  };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t ch = 0; ch < dim; ++ch) {
      const float* wc = w + ch * m.conv_width;
      float acc = bias[ch];
      for (int32_t j = 0; j < m.conv_width; ++j) acc += wc[j] * input(r + j, ch);
      out[r * dim + ch] = Silu(acc);
    }
  }
  // The last `held` inputs of carry + rows, oldest first.
  const int64_t keep = std::max<int64_t>(held - rows, 0);  // carried inputs still in the window
  if (keep > 0) std::memmove(carry, carry + (held - keep) * dim, keep * dim * sizeof(float));
  for (int64_t p = keep; p < held; ++p) {
    const int64_t r = rows - (held - p);
    std::memcpy(carry + p * dim, in + r * in_stride, dim * sizeof(float));
  }
}

float SsmSoftplus(float v, float bias) {
  const float x = v + bias;
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

void SsmGatedNorm(const SsmConfig& m, const float* y, const float* z, int64_t z_stride,
                  int64_t rows, const float* weight, float eps, float* out) {
  const int64_t inner = m.inner();
  const int64_t group = inner / m.num_groups;
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * inner;
    const float* zr = z + r * z_stride;
    float* o = out + r * inner;
    for (int64_t i = 0; i < inner; ++i) o[i] = yr[i] * Silu(zr[i]);
    for (int64_t g0 = 0; g0 < inner; g0 += group) {
      float ss = 0;
      for (int64_t i = g0; i < g0 + group; ++i) ss += o[i] * o[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(group) + eps);
      for (int64_t i = g0; i < g0 + group; ++i) o[i] = o[i] * inv * weight[i];
    }
  }
}

}  // namespace kvpool::model::internal
