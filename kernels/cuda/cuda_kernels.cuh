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
      const auto* b = reinterpret_cast<const int8_t*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = static_cast<float>(b[j]);
      return;
    }
    case DType::kFp8E4M3: {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
      const auto* b = reinterpret_cast<const int8_t*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const auto bits = static_cast<unsigned short>((static_cast<int>(b[j]) << 7) & 0xBF80);
        x[j] = __half2float(__ushort_as_half(bits));
      }
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

}  // namespace kvpool::kernels::cuda
