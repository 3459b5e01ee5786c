// WriteKv, CopyBlocks and FillBlocks on CUDA over the block-major layout: WriteKv converts f32
// rows to each side's dtype (quantizing 8-bit sides against their block scales, as the CPU's
// cpu_write_kv.cc), the block movers use 16-byte accesses whenever the pointers allow (chunks
// and blocks are multiples of 16 bytes).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace kvpool::kernels::cuda {
namespace {

constexpr int kCopyThreads = 256;
// Each CTA of a block copy or fill moves about this many 16-byte vectors before the grid grows
// another CTA per block (capped so a batch of many blocks does not explode the grid).
constexpr int64_t kVectorsPerCta = kCopyThreads * 8;
constexpr int64_t kMaxCtasPerBlock = 64;

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Copies `bytes` from `src` to `dst` with the CTA's threads (`stride` threads starting at
// `first`).
__device__ __forceinline__ void CopyBytes(char* dst, const char* src, int64_t bytes, bool aligned,
                                          int64_t first, int64_t stride) {
  if (aligned) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (int64_t i = first; i < bytes / 16; i += stride) d[i] = s[i];
  } else {
    for (int64_t i = first; i < bytes; i += stride) dst[i] = src[i];
  }
}

// One f32 value stored as `dtype` at `p` (16- and 32-bit dtypes; round to nearest even).
__device__ __forceinline__ void StoreWide(float x, DType dtype, char* p) {
  switch (dtype) {
    case DType::kF32:
      *reinterpret_cast<float*>(p) = x;
      return;
    case DType::kF16:
      *reinterpret_cast<__half*>(p) = __float2half_rn(x);
      return;
    case DType::kBF16:
      *reinterpret_cast<uint16_t*>(p) = FloatToBF16(x);
      return;
    case DType::kFp8E4M3:
    case DType::kInt8:
      return;  // scaled: StoreCode
  }
}

// An 8-bit code of `x` (already divided by the scale), as the CPU's conversions (dtype.h).
__device__ __forceinline__ char StoreCode(float x, DType dtype) {
  return dtype == DType::kFp8E4M3 ? static_cast<char>(FloatToFp8E4M3(x))
                                  : static_cast<char>(FloatToInt8(x));
}

__device__ __forceinline__ float CodeValue(char c, DType dtype) {
  return dtype == DType::kFp8E4M3 ? Fp8E4M3ToFloat(static_cast<uint8_t>(c))
                                  : static_cast<float>(static_cast<int8_t>(c));
}

// One side (K or V) of a run of tokens in one block (cpu_write_kv.cc has the same rules, and
// cpu_kernels.h states them): 16/32-bit rows converted by the whole CTA; 8-bit heads one warp
// each: absmax, the head's new scale, the block's other codes re-encoded when it grew, then the
// run's codes.
struct Side {
  DType dtype;
  char* chunk;
  float* scales;
  int64_t row_bytes;
  const float* src;
};

__device__ void WriteRunSide(const LayerLayout& l, const int64_t* slots, int32_t begin, int32_t end,
                             bool restarts, const Side& s) {
  const int dim = l.head_dim;
  const int64_t row_values = static_cast<int64_t>(l.num_kv_heads) * dim;
  if (!DTypeHasScales(s.dtype)) {
    const int size = DTypeSize(s.dtype);
    for (int32_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      char* dst = s.chunk + (slots[i] % l.block_size) * s.row_bytes;
      for (int64_t e = threadIdx.x; e < row_values; e += blockDim.x) {
        StoreWide(s.src[i * row_values + e], s.dtype, dst + e * size);
      }
    }
    return;
  }
  const int lane = threadIdx.x & 31;
  for (int h = threadIdx.x >> 5; h < l.num_kv_heads; h += blockDim.x >> 5) {
    float absmax = 0.f;
    int bad = 0;
    for (int32_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      for (int d = lane; d < dim; d += 32) {
        const float x = s.src[i * row_values + h * dim + d];
        bad |= !isfinite(x);
        absmax = fmaxf(absmax, fabsf(x));
      }
    }
    absmax = WarpMax(absmax);
    bad = __any_sync(0xffffffffu, bad);
    const float need = bad ? NAN : ScaleFor(s.dtype, absmax);
    const float old = s.scales[h];
    const float scale = restarts || isnan(need) ? need : isnan(old) ? old : fmaxf(old, need);
    if (!restarts && isfinite(old) && isfinite(scale) && scale != old) {
      const float ratio = old / scale;
      for (int64_t e = lane; e < static_cast<int64_t>(l.block_size) * dim; e += 32) {
        char* c = s.chunk + (e / dim) * s.row_bytes + h * dim + e % dim;
        *c = StoreCode(CodeValue(*c, s.dtype) * ratio, s.dtype);
      }
    }
    __syncwarp();
    if (lane == 0) s.scales[h] = scale;
    const float inv = scale > 0.f && isfinite(scale) ? 1.f / scale : 0.f;
    for (int32_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      char* dst = s.chunk + (slots[i] % l.block_size) * s.row_bytes + h * dim;
      for (int d = lane; d < dim; d += 32) {
        dst[d] = StoreCode(s.src[i * row_values + h * dim + d] * inv, s.dtype);
      }
    }
  }
}

// Grid: one CTA per token; the first token of each run of tokens in one block (padding aside)
// writes the run, the others return.
__global__ void WriteKvKernel(KvLayerView view, const float* k, const float* v,
                              const int64_t* slots, int32_t num_tokens) {
  const LayerLayout& l = view.l;
  const int32_t token = blockIdx.x;
  const int64_t slot = slots[token];
  if (slot < 0) return;  // padding
  const int64_t block = slot / l.block_size;
  if (block >= l.num_blocks) return;  // outside the pool: skipped (see cuda_kernels.h)
  int32_t prev = token - 1;
  while (prev >= 0 && slots[prev] < 0) --prev;
  if (prev >= 0 && slots[prev] / l.block_size == block) return;  // not the run's first token
  int32_t end = token + 1;
  bool restarts = slot % l.block_size == 0;
  while (end < num_tokens && (slots[end] < 0 || slots[end] / l.block_size == block)) {
    restarts |= slots[end] >= 0 && slots[end] % l.block_size == 0;
    ++end;
  }
  WriteRunSide(l, slots, token, end, restarts,
               {l.k_dtype, view.k(block), view.k_scales(block), l.k_row_bytes, k});
  WriteRunSide(l, slots, token, end, restarts,
               {l.v_dtype, view.v(block), view.v_scales(block), l.v_row_bytes, v});
}

// Grid: (pair, CTAs per block).
__global__ void CopyBlocksKernel(char* base, int64_t block_bytes, int32_t num_blocks,
                                 const int32_t* pairs, bool aligned) {
  const int32_t src = pairs[2 * static_cast<int64_t>(blockIdx.x)];
  const int32_t dst = pairs[2 * static_cast<int64_t>(blockIdx.x) + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks || src == dst) return;
  CopyBytes(base + dst * block_bytes, base + src * block_bytes, block_bytes, aligned,
            static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x,
            static_cast<int64_t>(gridDim.y) * blockDim.x);
}

// Grid: (block, CTAs per block). Zeroes whole blocks (16-byte stores when aligned).
__global__ void ZeroBlocksKernel(char* base, int64_t block_bytes, int32_t num_blocks,
                                 const int32_t* blocks, bool aligned) {
  const int32_t block = blocks[blockIdx.x];
  if (block < 0 || block >= num_blocks) return;
  char* dst = base + block * block_bytes;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  if (aligned) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = first; i < block_bytes / 16; i += stride) d[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = first; i < block_bytes; i += stride) dst[i] = 0;
  }
}

// The layout's chunk dtypes in block order (2 * layer + side), for the poison kernel.
struct ChunkDTypes {
  DType dtypes[2 * kMaxLayers];
  int32_t block_size;
  int32_t num_kv_heads;
  int32_t head_dim;
};

// Grid: (block, chunk). Each chunk gets its dtype's poison pattern (dtype.h): NaN values, or
// 0x7F codes and NaN scales.
__global__ void PoisonBlocksKernel(char* base, int64_t block_bytes, int32_t num_blocks,
                                   const int32_t* blocks, ChunkDTypes c) {
  const int32_t block = blocks[blockIdx.x];
  if (block < 0 || block >= num_blocks) return;
  int64_t offset = 0;
  for (uint32_t i = 0; i < blockIdx.y; ++i) {
    offset += ChunkBytes(c.dtypes[i], c.block_size, c.num_kv_heads, c.head_dim);
  }
  const DType dtype = c.dtypes[blockIdx.y];
  char* chunk = base + block * block_bytes + offset;
  const int64_t data =
      static_cast<int64_t>(c.block_size) * c.num_kv_heads * c.head_dim * DTypeSize(dtype);
  const int64_t bytes = ChunkBytes(dtype, c.block_size, c.num_kv_heads, c.head_dim);
  uint32_t word = kPoisonF32;  // f32 values, and the scales and padding of an 8-bit chunk
  if (dtype == DType::kF16) word = kPoisonF16 * 0x10001u;
  if (dtype == DType::kBF16) word = kPoisonBF16 * 0x10001u;
  for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) {
    const bool code = i < data && DTypeHasScales(dtype);
    chunk[i] = static_cast<char>(code ? kPoison8 : (word >> (8 * (i % 4))) & 0xFFu);
  }
}

int CtasPerBlock(int64_t block_bytes) {
  return static_cast<int>(std::clamp<int64_t>(
      (block_bytes / 16 + kVectorsPerCta - 1) / kVectorsPerCta, 1, kMaxCtasPerBlock));
}

}  // namespace

cudaError_t LaunchWriteKv(const KvPoolView& pool, const WriteKvArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  // A row is at most a few KiB: one CTA of 128 threads (a warp per 8-bit head) writes a run.
  WriteKvKernel<<<args.num_tokens, 128, 0, stream>>>(pool.Layer(args.layer), args.k, args.v,
                                                     args.slots, args.num_tokens);
  return cudaGetLastError();
}

cudaError_t LaunchCopyBlocks(const KvPoolView& pool, const CopyBlocksArgs& args,
                             cudaStream_t stream) {
  if (args.num_pairs == 0) return cudaSuccess;
  const int64_t block_bytes = pool.layout.block_bytes();
  const dim3 grid(args.num_pairs, CtasPerBlock(block_bytes));
  CopyBlocksKernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<char*>(pool.base), block_bytes,
                                                      pool.layout.num_blocks, args.pairs,
                                                      Aligned16(pool.base));
  return cudaGetLastError();
}

cudaError_t LaunchFillBlocks(const KvPoolView& pool, const FillBlocksArgs& args,
                             cudaStream_t stream) {
  if (args.num_blocks == 0) return cudaSuccess;
  const PoolLayout& layout = pool.layout;
  const int64_t block_bytes = layout.block_bytes();
  if (args.pattern == FillPattern::kZero) {
    const dim3 grid(args.num_blocks, CtasPerBlock(block_bytes));
    ZeroBlocksKernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<char*>(pool.base), block_bytes,
                                                        layout.num_blocks, args.blocks,
                                                        Aligned16(pool.base));
    return cudaGetLastError();
  }
  ChunkDTypes chunks{};
  chunks.block_size = layout.block_size;
  chunks.num_kv_heads = layout.num_kv_heads;
  chunks.head_dim = layout.head_dim;
  // The main blocks' layers (a window group's are in their own blocks: WindowLayout).
  for (int32_t l = 0; l < layout.num_full_layers(); ++l) {
    chunks.dtypes[2 * l] = layout.k_dtype(l);
    chunks.dtypes[2 * l + 1] = layout.v_dtype(l);
  }
  const dim3 grid(args.num_blocks, 2 * layout.num_full_layers());
  PoisonBlocksKernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<char*>(pool.base), block_bytes,
                                                        layout.num_blocks, args.blocks, chunks);
  return cudaGetLastError();
}

}  // namespace kvpool::kernels::cuda
