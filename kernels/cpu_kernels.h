#pragma once

// The CPU implementations of the KV kernels. They are the product on the CPU backend: vectorized
// with AVX-512 or AVX2/FMA/F16C when the processor has them (checked at run time; the default build
// does not assume them) and spread over a ThreadPool across sequences and KV heads. Every CUDA
// kernel is tested against its counterpart here.

#include "absl/status/status.h"
#include "kernels/kernel_args.h"
#include "kernels/pool_layout.h"
#include "kernels/thread_pool.h"

namespace kvpool::kernels::cpu {

// The attention kernels' largest head_dim.
inline constexpr int32_t kMaxAttentionHeadDim = 512;

// Whether the attention kernels serve a model of `num_q_heads` query heads of `head_dim`: a
// model beyond them is refused when it loads, not at its first step. Errors: INVALID_ARGUMENT.
absl::Status CheckAttentionShape(int32_t num_q_heads, int32_t head_dim);

// All take host pointers. `threads` may be null (run on the caller). Errors: INVALID_ARGUMENT
// for bad arguments, including out-of-range block ids or slots (nothing is written then).
//
// WriteKv converts each f32 row to its layer's K and V dtype. An 8-bit side (fp8 e4m3, int8)
// keeps one f32 scale per (block, KV head) in the block (pool_layout.h); the tokens of a call
// that fall in one block, consecutive in the call (a run), are written together:
//   - a run that writes slot 0 starts the block afresh: each head's scale becomes ScaleFor(the
//     run's absmax) (dtype.h), and slots the run does not write are undefined afterwards (the
//     block's earlier contents belonged to a previous owner);
//   - any other run keeps the block's other slots: a head's scale becomes max(old, the run's
//     need), and when it grows the head's codes in every slot are re-encoded under it, so every
//     earlier value keeps its meaning within one rounding of the new scale;
//   - a NaN or infinite value makes its head's scale NaN (the head reads as NaN) until a run
//     starts the block afresh; so does a poisoned block's NaN scale (FillBlocks).
// Runs of one block that are not consecutive in the call are correct too, only more rounding.
absl::Status WriteKv(const KvPoolView& pool, const WriteKvArgs& args);
absl::Status CopyBlocks(const KvPoolView& pool, const CopyBlocksArgs& args);
absl::Status FillBlocks(const KvPoolView& pool, const FillBlocksArgs& args);
//
// PagedAttentionDecode computes in f32 from what the pool holds, except for an 8-bit side on
// AVX-512 with VNNI, VBMI and BF16 (cpu_isa.h: KernelAvx512Vnni; internal/decode_vnni.cc), which
// multiplies bytes: an int8 K is scored against the query rounded once per step and head to int8
// codes (internal/decode_tile.h: RoundedQuery; the CUDA kernel scores an int8 K against the
// same codes), an fp8 K against the query rounded to bf16; an int8 V is weighed by the
// probabilities (times the block scales) in 16-bit fixed point per head and 32-token chunk, an
// fp8 V by them rounded to bf16. Against f32 arithmetic over the same query that adds a
// normalized error of about 2e-5 (int8 V) and 6e-4 (fp8 V), tenfold and more below each format's
// own (tests/kernels/kv_dtype_test.cc).
absl::Status PagedAttentionDecode(const KvPoolView& pool, const DecodeArgs& args,
                                  ThreadPool* threads);

// Prefill attention (kernel_args.h: PrefillArgs) in tiles of query tokens against chunks of
// paged K/V with an online softmax (cpu_prefill.cc), in f32 whatever the dtypes. Results equal
// PagedAttentionDecode's with one pseudo-sequence per query within float rounding (within the
// VNNI path's roundings above for an 8-bit side). args.workspace must hold
// PrefillWorkspaceBytes(pool.layout, threads ? threads->threads() : 1) bytes (any alignment): a
// slice per worker. Errors: INVALID_ARGUMENT as above, also for a small workspace or a head_dim
// above kMaxAttentionHeadDim (nothing is written then).
absl::Status PagedAttentionPrefill(const KvPoolView& pool, const PrefillArgs& args,
                                   ThreadPool* threads);
int64_t PrefillWorkspaceBytes(const PoolLayout& layout, int threads);

// The state-space recurrence (kernel_args.h: SsmScanArgs), in f32: each (sequence, head) is one
// task whose tokens run in order; heads of a group share b and c. Errors: INVALID_ARGUMENT for
// bad sizes, null pointers or unordered starts (nothing is written then).
absl::Status SsmScan(const SsmScanArgs& args, ThreadPool* threads);
// The same in double precision, one token at a time: the reference SsmScan is held to.
void SsmScanReference(const SsmScanArgs& args);

// Decode against contiguous K/V: sequence i's keys are k[i] = [seq_lens[i]][num_kv_heads][head_dim]
// (values likewise). The same vectorized code as the paged kernel, so paged/dense measures the
// cost of paging alone. f32, f16 and bf16 only (the 8-bit formats need a paged block's scales).
struct DenseDecodeArgs {
  int32_t num_seqs = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kBF16;
  float scale = 0;
  const float* q = nullptr;           // [num_seqs][num_q_heads][head_dim]
  float* out = nullptr;               // [num_seqs][num_q_heads][head_dim]
  const void* const* k = nullptr;     // [num_seqs] pointers
  const void* const* v = nullptr;     // [num_seqs] pointers
  const int32_t* seq_lens = nullptr;  // [num_seqs]
};
absl::Status DenseAttentionDecode(const DenseDecodeArgs& args, ThreadPool* threads);

// The textbook algorithm in double precision, one head at a time (each KV head's rows widened
// once for its query heads): the reference the tests hold both fast kernels (and the CUDA one)
// to. REQUIRES: a 16- or 32-bit dtype.
void ReferenceAttentionDecode(const DenseDecodeArgs& args);

// True when the vectorized AVX2/FMA/F16C path is in use on this processor.
bool UsingAvx2();

}  // namespace kvpool::kernels::cpu
