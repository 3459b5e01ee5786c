// CUDA state-space scan (kernel_args.h: SsmScanArgs), the counterpart of cpu::SsmScan. One CTA
// per (sequence, head); thread p owns column p of the head's state ([d_state][head_dim]), reads
// it once into registers (kMaxSsmState values), runs the sequence's tokens in order and writes it
// back. Each token's b and c rows (shared by the threads) are staged in shared memory.

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace kvpool::kernels::cuda {
namespace {

__global__ void SsmScanKernel(SsmScanArgs a) {
  __shared__ float b_s[kMaxSsmState];
  __shared__ float c_s[kMaxSsmState];
  const int32_t s = blockIdx.x, h = blockIdx.y, p = threadIdx.x;
  const int32_t dim = a.head_dim, ds = a.d_state;
  const int32_t g = h / (a.num_heads / a.num_groups);
  float* state = a.states[s] + static_cast<int64_t>(h) * ds * dim;
  float col[kMaxSsmState];
  if (p < dim) {
#pragma unroll 8
    for (int32_t n = 0; n < ds; ++n) col[n] = state[static_cast<int64_t>(n) * dim + p];
  }
  const float skip = a.d != nullptr ? a.d[h] : 0.f;
  for (int64_t t = a.starts[s]; t < a.starts[s + 1]; ++t) {
    __syncthreads();  // the previous token's b and c are read
    for (int32_t n = p; n < ds; n += blockDim.x) {
      b_s[n] = a.b[(t * a.num_groups + g) * ds + n];
      c_s[n] = a.c[(t * a.num_groups + g) * ds + n];
    }
    __syncthreads();
    if (p >= dim) continue;
    const float dt = a.dt[t * a.num_heads + h];
    const float decay = expf(dt * a.a_log_neg[h]);
    const float x = a.x[(t * a.num_heads + h) * dim + p];
    float y = skip * x;
#pragma unroll 8
    for (int32_t n = 0; n < ds; ++n) {
      col[n] = fmaf(decay, col[n], (dt * b_s[n]) * x);
      y = fmaf(c_s[n], col[n], y);
    }
    a.y[(t * a.num_heads + h) * dim + p] = y;
  }
  if (p < dim) {
#pragma unroll 8
    for (int32_t n = 0; n < ds; ++n) state[static_cast<int64_t>(n) * dim + p] = col[n];
  }
}

}  // namespace

cudaError_t LaunchSsmScan(const SsmScanArgs& args, cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  // Threads cover head_dim, and at least 32 so the b/c staging loop has a warp.
  const int threads = args.head_dim < 32 ? 32 : (args.head_dim + 31) / 32 * 32;
  SsmScanKernel<<<dim3(args.num_seqs, args.num_heads), threads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace kvpool::kernels::cuda
