// The CUDA model's state-space kernels (ssm_kernels.h). The arithmetic of every thread is
// model/internal/ssm_math.h (shared with the host model) and ssm_chunk.h; what is here is how
// the work is laid over the grid and where each thread reads and writes.

#include <algorithm>

#include "kernels/cuda/cuda_kernels.cuh"
#include "model/cuda/ssm_kernels.h"

namespace kvpool::model::cuda {
namespace {

using internal::SsmDims;

constexpr int kThreads = 256;

// Grid-stride over `total` elements.
__global__ void AddBiasKernel(float* y, int64_t total, int64_t dim, int64_t stride,
                              const float* bias) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[(e / dim) * stride + e % dim] += bias[e % dim];
  }
}

// blockIdx.y: the sequence; thread: a channel.
__global__ void SsmConvKernel(SsmDims m, const int32_t* starts, const float* in, int64_t in_stride,
                              const float* w, const float* bias, float* const* carries,
                              float* out) {
  const int64_t ch = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (ch >= m.conv_dim) return;
  const int32_t s = blockIdx.y;
  const int64_t first = starts[s];
  internal::SsmConvChannel(m, in + first * in_stride, in_stride, starts[s + 1] - first, w, bias,
                           carries[s], out + first * m.conv_dim, ch);
}

__global__ void SsmSplitKernel(SsmDims m, int64_t total, const float* xbc, const float* proj,
                               const float* dt_bias, float* x, float* b, float* c, float* dt) {
  const int64_t row = m.conv_dim + m.num_heads;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    internal::SsmSplitAt(m, xbc, proj, dt_bias, e / row, e % row, x, b, c, dt);
  }
}

// blockIdx.x: the sequence, blockIdx.y: the head; thread p: column p of the head's state, read
// once into registers, run through the sequence's tokens and written back.
__global__ void SsmScanKernel(SsmDims m, const int32_t* starts, const float* x, const float* dt,
                              const float* a_neg, const float* b, const float* c, const float* d,
                              float* const* states, float* y) {
  extern __shared__ float bc_s[];  // [2][d_state]: the token's B and C rows
  const int32_t s = blockIdx.x, h = blockIdx.y, p = threadIdx.x;
  const int32_t dim = m.head_dim, ds = m.d_state;
  const int32_t g = h / (m.num_heads / m.num_groups);
  float* state = states[s] + static_cast<int64_t>(h) * ds * dim;
  float col[kMaxSsmDState];
  if (p < dim) {
    for (int32_t n = 0; n < ds; ++n) col[n] = state[static_cast<int64_t>(n) * dim + p];
  }
  const float skip = d[h];
  for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
    __syncthreads();  // every thread is done with the previous token's rows
    for (int32_t n = p; n < ds; n += blockDim.x) {
      bc_s[n] = b[(t * m.num_groups + g) * ds + n];
      bc_s[ds + n] = c[(t * m.num_groups + g) * ds + n];
    }
    __syncthreads();
    if (p >= dim) continue;
    const float step = dt[t * m.num_heads + h];
    const int64_t at = (t * m.num_heads + h) * dim + p;
    y[at] = internal::SsmScanToken(col, ds, internal::SsmDecay(step, a_neg[h]), step, x[at], bc_s,
                                   bc_s + ds, skip);
  }
  if (p < dim) {
    for (int32_t n = 0; n < ds; ++n) state[static_cast<int64_t>(n) * dim + p] = col[n];
  }
}

// Chunked scan, pass 1: blockIdx.x the chunk, blockIdx.y the head; thread p a state column.
__global__ void SsmChunkLocalKernel(SsmDims m, const int32_t* chunk_rows, const float* x,
                                    const float* dt, const float* a_neg, const float* b,
                                    float* chunks, float* decays) {
  const int32_t h = blockIdx.y, p = threadIdx.x;
  const int64_t k = blockIdx.x;
  if (p >= m.head_dim) return;
  float col[kMaxSsmDState];
  internal::SsmChunkLocal(m, k, chunk_rows[k], chunk_rows[k + 1], h, p, x, dt, a_neg[h], b, col,
                          chunks, decays);
}

// Pass 2: blockIdx.x the sequence, blockIdx.y the head.
__global__ void SsmChunkCarryKernel(SsmDims m, const int32_t* seq_chunks, const float* decays,
                                    float* chunks, float* const* states) {
  const int32_t s = blockIdx.x, h = blockIdx.y, p = threadIdx.x;
  if (p >= m.head_dim) return;
  internal::SsmChunkCarry(m, seq_chunks[s], seq_chunks[s + 1], h, p, decays, chunks, states[s]);
}

// Pass 3: as pass 1.
__global__ void SsmChunkOutputsKernel(SsmDims m, const int32_t* chunk_rows, const float* x,
                                      const float* dt, const float* a_neg, const float* b,
                                      const float* c, const float* d, const float* chunks,
                                      float* y) {
  const int32_t h = blockIdx.y, p = threadIdx.x;
  const int64_t k = blockIdx.x;
  if (p >= m.head_dim) return;
  float col[kMaxSsmDState];
  internal::SsmChunkOutputs(m, k, chunk_rows[k], chunk_rows[k + 1], h, p, x, dt, a_neg[h], b, c, d,
                            chunks, col, y);
}

// blockIdx.x: the row, blockIdx.y: the norm group. The gated values go to `out` first, then are
// scaled in place by the thread that wrote them.
__global__ void SsmGatedNormKernel(SsmDims m, const float* y, const float* z, int64_t z_stride,
                                   const float* weight, float eps, float* out) {
  const int64_t r = blockIdx.x;
  const int64_t g0 = blockIdx.y * m.norm_group;
  const float* yr = y + r * m.inner;
  const float* zr = z + r * z_stride;
  float* o = out + r * m.inner;
  float ss = 0;
  for (int64_t i = g0 + threadIdx.x; i < g0 + m.norm_group; i += blockDim.x) {
    const float v = internal::SsmGate(yr[i], zr[i]);
    o[i] = v;
    ss += v * v;
  }
  if (weight == nullptr) return;  // gated, not normalized (the same for every thread)
  const float inv =
      internal::SsmNormScale(kernels::cuda::BlockSum<kThreads>(ss), m.norm_group, eps);
  for (int64_t i = g0 + threadIdx.x; i < g0 + m.norm_group; i += blockDim.x) {
    o[i] = o[i] * inv * weight[i];
  }
}

unsigned GridFor(int64_t total) {
  return static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
}

}  // namespace

cudaError_t LaunchAddBias(float* y, int32_t rows, int64_t dim, int64_t stride, const float* bias,
                          cudaStream_t stream) {
  const int64_t total = int64_t{rows} * dim;
  if (total <= 0) return cudaSuccess;
  AddBiasKernel<<<GridFor(total), kThreads, 0, stream>>>(y, total, dim, stride, bias);
  return cudaGetLastError();
}

cudaError_t LaunchSsmConv(const SsmDims& m, int32_t num_seqs, const int32_t* starts,
                          const float* in, int64_t in_stride, const float* w, const float* bias,
                          float* const* carries, float* out, cudaStream_t stream) {
  if (num_seqs <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((m.conv_dim + kThreads - 1) / kThreads),
                  static_cast<unsigned>(num_seqs));
  SsmConvKernel<<<grid, kThreads, 0, stream>>>(m, starts, in, in_stride, w, bias, carries, out);
  return cudaGetLastError();
}

cudaError_t LaunchSsmSplit(const SsmDims& m, int32_t num_tokens, const float* xbc,
                           const float* proj, const float* dt_bias, float* x, float* b, float* c,
                           float* dt, cudaStream_t stream) {
  const int64_t total = int64_t{num_tokens} * (m.conv_dim + m.num_heads);
  if (total <= 0) return cudaSuccess;
  SsmSplitKernel<<<GridFor(total), kThreads, 0, stream>>>(m, total, xbc, proj, dt_bias, x, b, c,
                                                          dt);
  return cudaGetLastError();
}

cudaError_t LaunchSsmScan(const SsmDims& m, int32_t num_seqs, const int32_t* starts, const float* x,
                          const float* dt, const float* a_neg, const float* b, const float* c,
                          const float* d, float* const* states, float* y, cudaStream_t stream) {
  if (num_seqs <= 0) return cudaSuccess;
  // Threads cover head_dim, and at least a warp so the B/C staging loop has one.
  const int threads = m.head_dim < 32 ? 32 : (m.head_dim + 31) / 32 * 32;
  const size_t shared = 2 * static_cast<size_t>(m.d_state) * sizeof(float);
  SsmScanKernel<<<dim3(static_cast<unsigned>(num_seqs), static_cast<unsigned>(m.num_heads)),
                  threads, shared, stream>>>(m, starts, x, dt, a_neg, b, c, d, states, y);
  return cudaGetLastError();
}

cudaError_t LaunchSsmChunkedScan(const SsmDims& m, int32_t num_seqs, const int32_t* seq_chunks,
                                 int32_t num_chunks, const int32_t* chunk_rows, const float* x,
                                 const float* dt, const float* a_neg, const float* b,
                                 const float* c, const float* d, float* const* states,
                                 float* chunks, float* decays, float* y, cudaStream_t stream) {
  if (num_seqs <= 0 || num_chunks <= 0) return cudaSuccess;
  const int threads = m.head_dim < 32 ? 32 : (m.head_dim + 31) / 32 * 32;
  const dim3 per_chunk(static_cast<unsigned>(num_chunks), static_cast<unsigned>(m.num_heads));
  SsmChunkLocalKernel<<<per_chunk, threads, 0, stream>>>(m, chunk_rows, x, dt, a_neg, b, chunks,
                                                         decays);
  SsmChunkCarryKernel<<<dim3(static_cast<unsigned>(num_seqs), static_cast<unsigned>(m.num_heads)),
                        threads, 0, stream>>>(m, seq_chunks, decays, chunks, states);
  SsmChunkOutputsKernel<<<per_chunk, threads, 0, stream>>>(m, chunk_rows, x, dt, a_neg, b, c, d,
                                                           chunks, y);
  return cudaGetLastError();
}

cudaError_t LaunchSsmGatedNorm(const SsmDims& m, int32_t rows, const float* y, const float* z,
                               int64_t z_stride, const float* weight, float eps, float* out,
                               cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(m.inner / m.norm_group));
  SsmGatedNormKernel<<<grid, kThreads, 0, stream>>>(m, y, z, z_stride, weight, eps, out);
  return cudaGetLastError();
}

}  // namespace kvpool::model::cuda
