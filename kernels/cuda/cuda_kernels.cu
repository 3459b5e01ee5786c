// WriteKv, CopyBlocks and FillBlocks on CUDA: byte movers over the block-major layout, with
// 16-byte accesses whenever the pointers allow (rows and blocks are multiples of 16 bytes).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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

// Grid: one CTA per token.
__global__ void WriteKvKernel(KvPoolView pool, int32_t layer, const char* k, const char* v,
                              const int64_t* slots, bool aligned) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slots[token];
  if (slot < 0) return;  // padding
  const PoolLayout& layout = pool.layout;
  const int64_t block = slot / layout.block_size;
  if (block >= layout.num_blocks) return;  // outside the pool: skipped (see cuda_kernels.h)
  const int64_t row = layout.row_bytes();
  const int64_t offset = (slot % layout.block_size) * row;
  CopyBytes(pool.k(static_cast<int32_t>(block), layer) + offset, k + token * row, row, aligned,
            threadIdx.x, blockDim.x);
  CopyBytes(pool.v(static_cast<int32_t>(block), layer) + offset, v + token * row, row, aligned,
            threadIdx.x, blockDim.x);
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

// Grid: (block, CTAs per block). `word` is the pattern of 4 bytes (two 16-bit elements or one
// 32-bit element); blocks start on element boundaries, so byte j of a block is byte j % 4 of it.
__global__ void FillBlocksKernel(char* base, int64_t block_bytes, int32_t num_blocks,
                                 const int32_t* blocks, uint32_t word, bool aligned) {
  const int32_t block = blocks[blockIdx.x];
  if (block < 0 || block >= num_blocks) return;
  char* dst = base + block * block_bytes;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  if (aligned) {
    const uint4 pattern = make_uint4(word, word, word, word);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = first; i < block_bytes / 16; i += stride) d[i] = pattern;
  } else {
    for (int64_t i = first; i < block_bytes; i += stride) {
      dst[i] = static_cast<char>((word >> (8 * (i % 4))) & 0xFFu);
    }
  }
}

uint32_t FillWord(DType dtype, FillPattern pattern) {
  switch (pattern) {
    case FillPattern::kZero:
      return 0;
    case FillPattern::kPoison:
      break;
  }
  switch (dtype) {
    case DType::kF32:
      return kPoisonF32;
    case DType::kF16:
      return kPoisonF16 | (static_cast<uint32_t>(kPoisonF16) << 16);
    case DType::kBF16:
      return kPoisonBF16 | (static_cast<uint32_t>(kPoisonBF16) << 16);
  }
  return 0;
}

int CtasPerBlock(int64_t block_bytes) {
  return static_cast<int>(std::clamp<int64_t>(
      (block_bytes / 16 + kVectorsPerCta - 1) / kVectorsPerCta, 1, kMaxCtasPerBlock));
}

}  // namespace

cudaError_t LaunchWriteKv(const KvPoolView& pool, const WriteKvArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  const bool aligned = Aligned16(pool.base) && Aligned16(args.k) && Aligned16(args.v);
  // A row is at most a few KiB: one CTA of 128 threads moves it in a sweep or two.
  WriteKvKernel<<<args.num_tokens, 128, 0, stream>>>(
      pool, args.layer, static_cast<const char*>(args.k), static_cast<const char*>(args.v),
      args.slots, aligned);
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
  const int64_t block_bytes = pool.layout.block_bytes();
  const dim3 grid(args.num_blocks, CtasPerBlock(block_bytes));
  FillBlocksKernel<<<grid, kCopyThreads, 0, stream>>>(
      static_cast<char*>(pool.base), block_bytes, pool.layout.num_blocks, args.blocks,
      FillWord(pool.layout.dtype, args.pattern), Aligned16(pool.base));
  return cudaGetLastError();
}

}  // namespace kvpool::kernels::cuda
