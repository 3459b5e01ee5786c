#pragma once

// The per-token pieces of a state-space (Mamba-2) layer around the scan (kernels::SsmScanArgs),
// on the host: the depthwise causal convolution with its carried inputs, the split into the
// scan's operands (softplus of dt) and the gated RMSNorm, each element computed by ssm_math.h
// (which the CUDA model's kernels share). Each output row depends on its own token (and, for the
// convolution, on the conv_width - 1 inputs before it, from the step or from the carried state)
// through the same arithmetic in the same order however the sequence's tokens are split into
// steps, so a sequence computed in chunks equals one computed at once, bit for bit.

#include <cstdint>

#include "model/internal/ssm_math.h"
#include "model/weights.h"

namespace kvpool::model::internal {

SsmDims SsmDimsOf(const SsmConfig& m);

// One sequence's `rows` new tokens: in[r * in_stride + ch] is channel ch (of conv_dim) of its
// r-th token's x, B and C before the convolution; `carry` ([conv_width - 1][conv_dim], oldest
// first) holds the inputs of the tokens before the first (zeros before the sequence's start).
// out[r][ch] = silu(bias[ch] + sum_j w[ch][j] * input(r - (conv_width - 1) + j)), then `carry`
// becomes the last conv_width - 1 inputs. w: [conv_dim][conv_width]; bias: null for none.
void SsmConv(const SsmDims& m, const float* in, int64_t in_stride, int64_t rows, const float* w,
             const float* bias, float* carry, float* out);

// Tokens [0, rows)'s scan operands (SsmSplitAt) from the conv output and the projection.
void SsmSplit(const SsmDims& m, const float* xbc, const float* proj, const float* dt_bias,
              int64_t rows, float* x, float* b, float* c, float* dt);

// out[r][i] = RMSNorm over i's norm group (m.norm_group values) of y[r][i] * silu(z[r][i]),
// times weight[i] (mamba_ssm's RMSNormGated, norm_before_gate=False); with no weight
// (nullptr: a mixer without the norm, Falcon-H1's mamba_rms_norm false) y[r][i] * silu(z[r][i])
// alone. z rows are z_stride apart.
void SsmGatedNorm(const SsmDims& m, const float* y, const float* z, int64_t z_stride, int64_t rows,
                  const float* weight, float eps, float* out);

// y[r][i] += bias[i] for r in [0, rows), i in [0, dim); y rows are stride apart.
void AddBias(float* y, int64_t rows, int64_t dim, int64_t stride, const float* bias);

}  // namespace kvpool::model::internal
