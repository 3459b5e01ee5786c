#pragma once

// Host launchers of the CUDA KV kernels (the counterparts of kernels/cpu_kernels.h). Plain C++:
// cuda_device.cc includes this without nvcc.
//
// Each launcher enqueues on `stream` and returns the launch error (cudaSuccess once enqueued); it
// never allocates and never synchronizes. Host-side checks (validate.h) have run before; what
// lives in device memory is checked by the kernels, which cannot return an error:
//   - WriteKv skips a slot whose block is >= num_blocks, as it skips padding (slot < 0);
//   - CopyBlocks / FillBlocks skip a pair or block with an id outside [0, num_blocks);
//   - PagedAttentionDecode writes NaN for every head of a sequence whose length is outside
//     [1, min(max_seq_len, table_stride * block_size)] or whose table names a block outside
//     [0, num_blocks), so the failure is visible instead of a read outside the arena;
//   - PagedAttentionPrefill likewise writes NaN for the query rows of a sequence whose length is
//     outside [max(q_len, 1), min(max_seq_len, table_stride * block_size)], whose q_len exceeds
//     max_q_len, or whose table names a block outside the pool (a negative q_len: nothing).
// REQUIRES (all): pool.layout valid (ValidateLayout). The byte movers use 16-byte accesses when
// every pointer allows and byte accesses otherwise; decode and prefill require a 16-byte aligned
// pool.base. Attention reads every K/V dtype pair (the dtype is a uniform branch in the loads);
// an 8-bit side's block scales multiply scores (K) and probabilities (V).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_args.h"
#include "kernels/pool_layout.h"

namespace kvpool::kernels::cuda {

// The decode kernel keeps one 8-element slice of a head per lane and at most one warp per token.
inline constexpr int32_t kMaxDecodeHeadDim = 256;
// Grid limit of the split dimension (gridDim.z) and of the KV-head dimension (gridDim.y).
inline constexpr int64_t kMaxGridYZ = 65535;

// How PagedAttentionDecode divides the work (flash-decoding split-K): each CTA handles one
// sequence, `heads_per_cta` query heads of one KV head (so K/V are read once per group) and
// `partition_tokens` consecutive tokens; a second kernel combines the splits.
struct DecodePlan {
  int32_t partition_tokens = 0;  // tokens per split: a power of two in [64, 512]
  int32_t num_splits = 0;        // ceil(max_seq_len / partition_tokens)
  int32_t heads_per_cta = 0;     // 1, 2, 4 or 8
  int32_t head_chunks = 0;       // CTAs per KV head: ceil(group / heads_per_cta)
  int64_t workspace_bytes = 0;   // 0 when num_splits == 1 (the kernel writes `out` directly)
};

// Smaller partitions when the batch alone would not fill the device (two waves of `num_sms`).
// REQUIRES: valid layout, num_q_heads a positive multiple of num_kv_heads, max_seq_len >= 1,
// num_seqs >= 0, num_sms >= 1.
DecodePlan PlanDecode(const PoolLayout& layout, int32_t num_seqs, int32_t num_q_heads,
                      int32_t max_seq_len, int32_t num_sms);

// How PagedAttentionPrefill divides the work: each CTA takes kPrefillCtaRows query rows, `tokens`
// consecutive query tokens times `heads` query heads of one KV head, against chunks of
// kPrefillCtaKeys keys. No workspace.
inline constexpr int32_t kPrefillCtaRows = 32;
inline constexpr int32_t kPrefillCtaKeys = 32;
struct PrefillPlan {
  int32_t heads = 0;   // query heads per CTA: min(group, kPrefillCtaRows)
  int32_t slices = 0;  // CTAs per KV head and tile: ceil(group / heads)
  int32_t tokens = 0;  // query tokens per CTA: kPrefillCtaRows / heads
  int32_t tiles = 0;   // ceil(max_q_len / tokens): gridDim.x
};

// REQUIRES: valid layout, num_q_heads a positive multiple of num_kv_heads, max_q_len >= 0.
PrefillPlan PlanPrefill(const PoolLayout& layout, int32_t num_q_heads, int32_t max_q_len);

// Converts f32 rows to the layer's K and V dtypes, quantizing 8-bit sides against their block
// scales by the rules of cpu::WriteKv (cpu_kernels.h). One CTA per token; the first token of
// each run of tokens in one block writes the run (a warp per 8-bit head).
// REQUIRES (8-bit sides): the tokens a call writes into one block are consecutive in the call
// (padding aside), as every step's are: two runs of one block would race on its scales. The
// CPU kernel has no such requirement.
cudaError_t LaunchWriteKv(const KvPoolView& pool, const WriteKvArgs& args, cudaStream_t stream);

// REQUIRES: no pair's dst is another pair's src (pairs run concurrently).
cudaError_t LaunchCopyBlocks(const KvPoolView& pool, const CopyBlocksArgs& args,
                             cudaStream_t stream);

cudaError_t LaunchFillBlocks(const KvPoolView& pool, const FillBlocksArgs& args,
                             cudaStream_t stream);

// Computes in f32 from what the pool holds, except that an int8 K is scored with dp4a against
// the query rounded per head to int8 codes, as the CPU's VNNI path rounds it (decode_tile.h:
// RoundedQuery), so the two backends agree.
// REQUIRES: plan == PlanDecode(pool.layout, args.num_seqs, args.num_q_heads, args.max_seq_len,
// ...), plan.num_splits <= kMaxGridYZ, head_dim <= kMaxDecodeHeadDim, and
// args.workspace_bytes >= plan.workspace_bytes with a 4-byte aligned workspace.
cudaError_t LaunchPagedAttentionDecode(const KvPoolView& pool, const DecodeArgs& args,
                                       const DecodePlan& plan, cudaStream_t stream);

// REQUIRES: plan == PlanPrefill(pool.layout, args.num_q_heads, args.max_q_len), head_dim <=
// kMaxDecodeHeadDim, num_seqs and num_kv_heads * plan.slices <= kMaxGridYZ, a 16-byte aligned
// pool.base. Sets the kernel's shared-memory limit when a head_dim above 128 needs more than
// 48 KiB.
cudaError_t LaunchPagedAttentionPrefill(const KvPoolView& pool, const PrefillArgs& args,
                                        const PrefillPlan& plan, cudaStream_t stream);

}  // namespace kvpool::kernels::cuda
