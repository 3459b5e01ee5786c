#pragma once

// Host launchers of the CUDA model's elementwise and normalization kernels (the dense layers are
// cuBLAS, attention and the K/V write are kernels/cuda). Plain C++: cuda_model.cc includes this
// without nvcc. Each launcher enqueues on `stream` and returns the launch error; none allocates
// or synchronizes. Every pointer is device memory; the shapes are the caller's (checked host-side
// by StepModel::Step and CheckModel before anything is launched).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvpool::model::cuda {

// x[t][:] = embed[tokens[t]][:] for t in [0, num_tokens).
cudaError_t LaunchEmbed(const float* embed, const int32_t* tokens, int32_t num_tokens,
                        int32_t hidden, float* x, cudaStream_t stream);

// y[r][:] = RMSNorm(x[rows[r]][:]) * weight for r in [0, num_rows); rows == nullptr reads row r.
cudaError_t LaunchRmsNorm(const float* x, const int32_t* rows, int32_t num_rows, int32_t dim,
                          const float* weight, float eps, float* y, cudaStream_t stream);

// From the fused projection qkv[t] = [q heads | k heads | v heads] (f32): rotates the first
// `rotary` values of each query and key head by their token's position (rotate_half RoPE within
// them, angles in double as on the host; inv_freq: [rotary / 2]) and passes the rest through,
// writes the queries to q [t][num_heads][head_dim] and the keys and values to k, v
// [t][num_kv_heads][head_dim], all f32 (WriteKv converts them to the pool's dtypes).
cudaError_t LaunchRopeSplit(const float* qkv, const int32_t* positions, const float* inv_freq,
                            int32_t num_tokens, int32_t num_heads, int32_t num_kv_heads,
                            int32_t head_dim, int32_t rotary, float* q, float* k, float* v,
                            cudaStream_t stream);

// act[t][i] = silu(gate_up[t][i]) * gate_up[t][intermediate + i].
cudaError_t LaunchSiluMul(const float* gate_up, int32_t num_tokens, int32_t intermediate,
                          float* act, cudaStream_t stream);

// act[e] = max(up[e], 0)^2 for e < total (Nemotron-H's MLP, no gate).
cudaError_t LaunchReluSquared(const float* up, int64_t total, float* act, cudaStream_t stream);

}  // namespace kvpool::model::cuda
