#pragma once

// Arguments of the KV kernels: plain structs of device pointers and sizes (FlashInfer style), the
// same for the CPU and CUDA implementations. Kernels never allocate; callers pass workspace. Raw
// int32 block ids appear here only, at the kernel boundary.

#include <cstdint>

#include "kernels/dtype.h"  // KVPOOL_HOST_DEVICE

namespace kvpool::kernels {

// Sliding-window attention (Mistral, Gemma 2/3, gpt-oss): with `window` W > 0 a query at position
// p sees the keys at positions (p - W, p], W of them with its own, plus the first `sinks`
// positions (attention sinks, StreamingLLM), which every query sees. W = 0 is full attention.
// A kernel reads no key outside what some query of the call sees, so the blocks wholly before a
// window (sinks aside) may be released (their table entries < 0).
struct AttentionWindow {
  int32_t window = 0;  // W; 0: every earlier position
  int32_t sinks = 0;   // S >= 0; meaningful with W > 0 only

  // The first key position of the window of a query at `pos`.
  KVPOOL_HOST_DEVICE constexpr int64_t Start(int64_t pos) const {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  }
  // The sink positions a query at `pos` sees apart from its window: [0, SinkEnd(pos)).
  KVPOOL_HOST_DEVICE constexpr int64_t SinkEnd(int64_t pos) const {
    const int64_t s = window > 0 ? sinks : 0;
    const int64_t start = Start(pos);
    return s < start ? s : start;
  }
  // The keys some query at a position in [first, last] sees are [0, SinkEnd(first)) and
  // [Start(first), last] (the window's start only grows with the position).
  // Whether a query at `pos` sees the key at `key` (key <= pos).
  KVPOOL_HOST_DEVICE constexpr bool Sees(int64_t pos, int64_t key) const {
    return key <= pos && (key >= Start(pos) || key < SinkEnd(pos));
  }
};

// Scatter new tokens' K and V into their blocks, converted to the layer's K and V dtypes (round
// to nearest even; an 8-bit side is quantized against its block's per-head scales, see WriteKv).
struct WriteKvArgs {
  int32_t layer = 0;
  int32_t num_tokens = 0;
  const float* k = nullptr;        // [num_tokens][num_kv_heads][head_dim], f32
  const float* v = nullptr;        // same
  const int64_t* slots = nullptr;  // [num_tokens]: block * block_size + offset; < 0: padding
};

// One query token per sequence against its paged K/V (grouped-query attention).
struct DecodeArgs {
  int32_t layer = 0;
  int32_t num_seqs = 0;
  int32_t num_q_heads = 0;                // a multiple of the pool's num_kv_heads
  float scale = 0;                        // softmax scale, usually 1/sqrt(head_dim)
  const float* q = nullptr;               // [num_seqs][num_q_heads][head_dim]
  float* out = nullptr;                   // [num_seqs][num_q_heads][head_dim]
  const int32_t* block_tables = nullptr;  // [num_seqs][table_stride]
  int32_t table_stride = 0;               // >= blocks of the longest sequence
  const int32_t* seq_lens = nullptr;      // [num_seqs]; each in [1, table_stride * block_size]
  int32_t max_seq_len = 0;                // >= every seq_lens[i] (sizes split-K work)
  AttentionWindow window;                 // the query at seq_lens[i] - 1 sees its window only
  void* workspace = nullptr;              // DecodeWorkspaceBytes() bytes (may be 0)
  int64_t workspace_bytes = 0;
};

// Several new query tokens per sequence (a prefill chunk) against the sequence's paged K/V,
// causal: sequence s has q_len(s) = q_starts[s + 1] - q_starts[s] new tokens, the last q_len(s)
// of its seq_lens[s] tokens (their K/V already written), and its query i, at position
// seq_lens[s] - q_len(s) + i, attends to positions [0, seq_lens[s] - q_len(s) + i]. The result
// equals PagedAttentionDecode with one pseudo-sequence of that length per query; the K/V of the
// pool are read once per query tile instead of once per query.
struct PrefillArgs {
  int32_t layer = 0;
  int32_t num_seqs = 0;
  int32_t num_q_heads = 0;                // a multiple of the pool's num_kv_heads
  float scale = 0;                        // softmax scale, usually 1/sqrt(head_dim)
  const float* q = nullptr;               // [q_starts[num_seqs]][num_q_heads][head_dim]
  float* out = nullptr;                   // [q_starts[num_seqs]][num_q_heads][head_dim]
  const int32_t* q_starts = nullptr;      // [num_seqs + 1]: sequence s's rows of q and out
  const int32_t* block_tables = nullptr;  // [num_seqs][table_stride]
  int32_t table_stride = 0;               // >= blocks of the longest sequence
  const int32_t* seq_lens = nullptr;      // [num_seqs]; q_len(s) <= seq_lens[s] <= max_seq_len
  int32_t max_seq_len = 0;                // >= every seq_lens[i]
  int32_t max_q_len = 0;                  // >= every q_len(s) (sizes the CUDA grid)
  AttentionWindow window;                 // each query sees its own window only
  void* workspace = nullptr;              // PrefillWorkspaceBytes() bytes (may be 0)
  int64_t workspace_bytes = 0;
};

// A state-space layer's recurrence over new tokens (Mamba-2's SSD family, the "gated linear
// recurrence" of issue 28): per sequence one state [num_heads][d_state][head_dim] that carries the
// sequence's whole history. For each new token t of a sequence, in order, and head h of group
// g = h / (num_heads / num_groups):
//   a     = exp(dt[t][h] * a_log_neg[h])                       (a_log_neg < 0: a in (0, 1))
//   S[n][p] = a * S[n][p] + (dt[t][h] * b[t][g][n]) * x[t][h][p]
//   y[t][h][p] = sum_n c[t][g][n] * S[n][p] + d[h] * x[t][h][p]
// A prefill chunk and a decode token run the same per-token arithmetic, so scanning tokens
// [0, n) at once equals scanning [0, k) and then [k, n) from the state left at k, bit for bit:
// a checkpoint of the state is an exact resume point.
struct SsmScanArgs {
  int32_t num_seqs = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  int32_t d_state = 0;
  int32_t num_groups = 0;            // divides num_heads
  const int32_t* starts = nullptr;   // [num_seqs + 1]: sequence s's token rows
  const float* x = nullptr;          // [tokens][num_heads][head_dim]
  const float* dt = nullptr;         // [tokens][num_heads], > 0 (after softplus)
  const float* a_log_neg = nullptr;  // [num_heads], < 0 (Mamba-2's A = -exp(A_log))
  const float* b = nullptr;          // [tokens][num_groups][d_state]
  const float* c = nullptr;          // [tokens][num_groups][d_state]
  const float* d = nullptr;          // [num_heads] skip weights; null: none
  float* const* states = nullptr;    // [num_seqs]: each [num_heads][d_state][head_dim], updated
  float* y = nullptr;                // [tokens][num_heads][head_dim]
};

// Copy whole blocks (copy-on-write, tier moves).
struct CopyBlocksArgs {
  int32_t num_pairs = 0;
  const int32_t* pairs = nullptr;  // [num_pairs][2]: (src, dst)
};

enum class FillPattern : uint8_t { kZero, kPoison };

struct FillBlocksArgs {
  int32_t num_blocks = 0;
  const int32_t* blocks = nullptr;  // [num_blocks]
  FillPattern pattern = FillPattern::kZero;
};

}  // namespace kvpool::kernels
