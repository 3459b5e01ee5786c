#pragma once

// The inner part of the CPU prefill kernel (cpu_prefill.cc): one task, a tile of query tokens of
// one sequence times the query heads of one KV head, against that sequence's paged K/V in chunks
// of kPrefillKeys keys, FlashAttention-style:
//
//   for each chunk of keys [c0, c0 + kPrefillKeys) that some query of the tile sees (up to the
//   tile's last position; with a sliding window, the sinks and from the first query's window
//   start on, so the blocks before a window are never read):
//     gather the chunk's K and V rows (this KV head) from their blocks, widened to f32, K
//     transposed to [dim][keys];
//     S = Q · Kᵀ                      register-tiled: kRows query rows x two vectors of keys;
//     causal and window masks (only in chunks that reach past a row's position or below its
//     window), online softmax with a
//     vectorized exp: m' = max(m, max S), P = exp(S - m'), l = l·e^(m - m') + ΣP;
//     O = O·e^(m - m') + P · V        register-tiled: kRows rows x two vectors of head_dim;
//   out = O / l.
//
// The rows of a tile are (token, head) pairs, token-major, so positions never decrease along
// the rows: the keys a row block sees end at its last row's limit.
//
// One implementation (prefill_tile.inc), instantiated per instruction set and K and V dtype:
// kernels_portable.cc, kernels_avx2.cc and kernels_avx512.cc. The gather is the only place that
// reads the pool: it widens the chunk's K and V (each side in its own dtype, each set's Ops
// WidenRow and WidenTranspose8x8) and multiplies an 8-bit side by its blocks' scales, so the
// tile's arithmetic is f32 whatever the pool holds.

#include <cstdint>

#include "kernels/cpu_isa.h"
#include "kernels/dtype.h"
#include "kernels/kernel_args.h"
#include "kernels/pool_layout.h"

namespace kvpool::kernels::cpu::internal {

inline constexpr int kPrefillKeys = 64;   // keys per chunk
inline constexpr int kPrefillRows = 64;   // query rows (tokens x heads) per task, at most
inline constexpr int kPrefillRowPad = 8;  // a task's rows are padded to a multiple of this

// head_dim as the tile stores it: zero padded to a multiple of 32 (two AVX-512 vectors).
constexpr int32_t PrefillPaddedDim(int32_t head_dim) { return (head_dim + 31) / 32 * 32; }

// f32 scratch of one task: Q and O [rows][dp], Kᵀ [dp][keys], V [keys][dp], S [rows][keys].
constexpr int64_t PrefillScratchFloats(int32_t head_dim) {
  const int64_t dp = PrefillPaddedDim(head_dim);
  return 2 * kPrefillRows * dp + 2 * kPrefillKeys * dp + int64_t{kPrefillRows} * kPrefillKeys;
}

struct PrefillTask {
  const KvLayerView* view;  // the layer's chunks
  const int32_t* table;     // the sequence's block table
  int32_t kv_head;
  int32_t heads;      // query heads in the task (of the KV head's group)
  int32_t tokens;     // query tokens; tokens * heads <= kPrefillRows
  int64_t first_pos;  // position of the first query token
  const float* q;     // the first token's first head; a token's heads are head_dim apart
  float* out;         // same layout as q
  int64_t q_stride;   // floats from one token's row to the next
  float scale;
  AttentionWindow window;  // which keys each query sees (kernel_args.h)
  float* scratch;          // PrefillScratchFloats(head_dim) floats, 64-byte aligned
};

using PrefillTaskFn = void (*)(const PrefillTask& task);

// The task function of each instruction set for K stored as `k_dtype` and V as `v_dtype`.
// REQUIRES: the processor supports the set (KernelIsa()).
PrefillTaskFn PrefillTaskPortable(DType k_dtype, DType v_dtype);
PrefillTaskFn PrefillTaskAvx2(DType k_dtype, DType v_dtype);
PrefillTaskFn PrefillTaskAvx512(DType k_dtype, DType v_dtype);

}  // namespace kvpool::kernels::cpu::internal
