// The CUDA model's elementwise and normalization kernels (model_kernels.h). Each mirrors its host
// counterpart in model/model.cc operation for operation, so the two steps agree to rounding.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_kernels.cuh"
#include "model/cuda/model_kernels.h"

namespace kvpool::model::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void EmbedKernel(const float* embed, const int32_t* tokens, int32_t hidden, float* x) {
  const int64_t t = blockIdx.x;
  const float* src = embed + static_cast<int64_t>(tokens[t]) * hidden;
  float* dst = x + t * hidden;
  for (int32_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

__global__ void RmsNormKernel(const float* x, const int32_t* rows, int32_t dim, const float* weight,
                              float eps, float* y) {
  const int64_t r = blockIdx.x;
  const float* xr = x + static_cast<int64_t>(rows != nullptr ? rows[r] : r) * dim;
  float ss = 0;
  for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  ss = kernels::cuda::BlockSum<kThreads>(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  float* yr = y + r * dim;
  for (int32_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * weight[i];
}

__global__ void RopeSplitKernel(const float* qkv, const int32_t* positions, const float* inv_freq,
                                int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                                int32_t rotary, float* q, float* k, float* v) {
  const int64_t t = blockIdx.x;
  const int32_t half = rotary / 2;
  const int32_t qd = num_heads * head_dim, kvd = num_kv_heads * head_dim;
  const float* row = qkv + t * (qd + 2 * kvd);
  const double pos = positions[t];
  // Element e of head `head` (queries, then keys) goes to q or k.
  const auto out = [&](int32_t head, int32_t e) -> float& {
    return head < num_heads ? q[t * qd + head * head_dim + e]
                            : k[t * kvd + static_cast<int64_t>(head - num_heads) * head_dim + e];
  };
  for (int32_t idx = threadIdx.x; idx < (num_heads + num_kv_heads) * half; idx += blockDim.x) {
    const int32_t head = idx / half, i = idx % half;
    // Angles in double: positions reach the tens of thousands.
    double s, c;
    sincos(pos * static_cast<double>(inv_freq[i]), &s, &c);
    const float cs = static_cast<float>(c), sn = static_cast<float>(s);
    const float a = row[head * head_dim + i], b = row[head * head_dim + i + half];
    out(head, i) = a * cs - b * sn;
    out(head, i + half) = b * cs + a * sn;
  }
  // Partial rotary: the values past `rotary` pass through.
  const int32_t pass = head_dim - rotary;
  for (int32_t idx = threadIdx.x; idx < (num_heads + num_kv_heads) * pass; idx += blockDim.x) {
    const int32_t head = idx / pass, e = rotary + idx % pass;
    out(head, e) = row[head * head_dim + e];
  }
  for (int32_t i = threadIdx.x; i < kvd; i += blockDim.x) {
    v[t * kvd + i] = row[qd + kvd + i];
  }
}

__global__ void SiluMulKernel(const float* gate_up, int64_t total, int32_t intermediate,
                              float* act) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / intermediate, i = e % intermediate;
    const float g = gate_up[t * 2 * intermediate + i];
    const float u = gate_up[t * 2 * intermediate + intermediate + i];
    act[e] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void ReluSquaredKernel(const float* up, int64_t total, float* act) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float r = fmaxf(up[e], 0.0f);
    act[e] = r * r;
  }
}

}  // namespace

cudaError_t LaunchEmbed(const float* embed, const int32_t* tokens, int32_t num_tokens,
                        int32_t hidden, float* x, cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  EmbedKernel<<<num_tokens, kThreads, 0, stream>>>(embed, tokens, hidden, x);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const float* x, const int32_t* rows, int32_t num_rows, int32_t dim,
                          const float* weight, float eps, float* y, cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  RmsNormKernel<<<num_rows, kThreads, 0, stream>>>(x, rows, dim, weight, eps, y);
  return cudaGetLastError();
}

cudaError_t LaunchRopeSplit(const float* qkv, const int32_t* positions, const float* inv_freq,
                            int32_t num_tokens, int32_t num_heads, int32_t num_kv_heads,
                            int32_t head_dim, int32_t rotary, float* q, float* k, float* v,
                            cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  RopeSplitKernel<<<num_tokens, kThreads / 2, 0, stream>>>(qkv, positions, inv_freq, num_heads,
                                                           num_kv_heads, head_dim, rotary, q, k, v);
  return cudaGetLastError();
}

cudaError_t LaunchSiluMul(const float* gate_up, int32_t num_tokens, int32_t intermediate,
                          float* act, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(num_tokens) * intermediate;
  if (total <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);
  SiluMulKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(gate_up, total,
                                                                        intermediate, act);
  return cudaGetLastError();
}

cudaError_t LaunchReluSquared(const float* up, int64_t total, float* act, cudaStream_t stream) {
  if (total <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);
  ReluSquaredKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(up, total, act);
  return cudaGetLastError();
}

}  // namespace kvpool::model::cuda
