#pragma once

// Device-only helpers shared by the CUDA kernels (nvcc only).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/dtype.h"

namespace kvpool::kernels::cuda {

// The CUDA storage type of each DType.
template <DType kDType>
struct KvType;
template <>
struct KvType<DType::kF32> {
  using type = float;
};
template <>
struct KvType<DType::kF16> {
  using type = __half;
};
template <>
struct KvType<DType::kBF16> {
  using type = __nv_bfloat16;
};

// Loads 8 consecutive elements and widens them to f32. Read-only path: the pool is not written
// while a decode reads it (writes of the same layer are ordered before it on the stream).
// REQUIRES: `p` 16-byte aligned (true for every 8-element slice of a K/V row: head_dim is a
// multiple of 8 and the arena is 16-byte aligned).
__device__ __forceinline__ void Load8(const float* p, float (&x)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
  x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

__device__ __forceinline__ void Load8(const __half* p, float (&x)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void Load8(const __nv_bfloat16* p, float (&x)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// 4 int8 codes (the bytes of w, lowest first) as floats, exact: each code offset to unsigned
// (c + 128) and placed under the exponent of 2^23 by one byte permute, then 2^23 + 128
// subtracted. Two integer-pipe instructions per value instead of a conversion (I2F runs at a
// quarter of the FMA rate).
__device__ __forceinline__ void Int8x4ToFloat(uint32_t w, float* x) {
  const uint32_t u = w ^ 0x80808080u;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    x[j] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650 + j)) - 8388736.0f;
}

// 4 fp8 e4m3 codes (the bytes of w, lowest first) as their values / 256 (dtype.h's
// WidenedUnit), exact, subnormals included: two codes at a time moved into the high bytes of a
// half2 by a byte permute, then the sign kept at bit 15 and the other seven bits shifted to bits
// 13..7 of each half (one shift and one logic op for two values), then widened as a pair.
__device__ __forceinline__ void Fp8x4ToFloat(uint32_t w, float* x) {
  const uint32_t pairs[2] = {__byte_perm(w, 0, 0x1404), __byte_perm(w, 0, 0x3424)};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t bits = ((pairs[k] >> 1) & 0x3F803F80u) | (pairs[k] & 0x80008000u);
    __half2 h;
    memcpy(&h, &bits, sizeof(h));
    const float2 f = __half22float2(h);
    x[2 * k] = f.x;
    x[2 * k + 1] = f.y;
  }
}

// 8 consecutive elements of a K/V row stored as `dtype`, widened to f32; 8-bit codes unscaled
// (fp8 e4m3 through f16, its value / 256: dtype.h's WidenedUnit). `dtype` is uniform across the
// grid, so the switch is a uniform branch: one kernel serves every K and V dtype pair instead of
// a template instance per pair. REQUIRES: `p` aligned to 8 elements (16-byte aligned chunks,
// head_dim a multiple of 8).
__device__ __forceinline__ void LoadKv8(const char* p, DType dtype, float (&x)[8]) {
  switch (dtype) {
    case DType::kF32:
      Load8(reinterpret_cast<const float*>(p), x);
      return;
    case DType::kF16:
      Load8(reinterpret_cast<const __half*>(p), x);
      return;
    case DType::kBF16:
      Load8(reinterpret_cast<const __nv_bfloat16*>(p), x);
      return;
    case DType::kInt8: {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
      Int8x4ToFloat(raw.x, x);
      Int8x4ToFloat(raw.y, x + 4);
      return;
    }
    case DType::kFp8E4M3: {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
      Fp8x4ToFloat(raw.x, x);
      Fp8x4ToFloat(raw.y, x + 4);
      return;
    }
  }
}

// The factor an 8-bit side's codes are multiplied by (its block's head scale, times
// WidenedUnit); 1 for the other dtypes.
__device__ __forceinline__ float KvScale(const float* scales, int head, DType dtype) {
  return DTypeHasScales(dtype) ? scales[head] * WidenedUnit(dtype) : 1.0f;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of `v` over the block, every thread gets it. REQUIRES: blockDim.x == kThreads (a
// multiple of 32). A second call in one kernel must follow a __syncthreads() after the first's
// result was read (the partial sums live in one shared array).
template <int kThreads>
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float partial[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpSum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  return total;
}

}  // namespace kvpool::kernels::cuda
