// PagedAttentionDecode on CUDA: split-K ("flash-decoding"). Pass 1 computes, for each
// (sequence, group of query heads of one KV head, token partition), the partition's softmax max,
// sum and unnormalized f32 output; pass 2 rescales and adds the partitions. With one partition
// pass 1 writes the normalized output itself.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace kvpool::kernels::cuda {
namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kCombineThreads = 128;
constexpr int32_t kMaxPartition = 512;
constexpr int32_t kMinPartition = 64;
constexpr int32_t kMaxHeadsPerCta = 8;

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct DecodeParams {
  KvLayerView view;  // the layer's chunks and dtypes
  int32_t num_q_heads;
  int32_t group;  // query heads per KV head
  float scale;
  const float* q;  // [num_seqs][num_q_heads][head_dim]
  float* out;      // [num_seqs][num_q_heads][head_dim]
  const int32_t* block_tables;
  int32_t table_stride;
  const int32_t* seq_lens;
  int32_t max_seq_len;
  AttentionWindow window;
  int32_t partition;
  int32_t num_splits;
  int32_t head_chunks;
  int32_t lanes;  // lanes per token: the smallest power of two >= head_dim / 8
  float* ws_acc;  // [num_seqs][num_q_heads][num_splits][head_dim]
  float* ws_max;  // [num_seqs][num_q_heads][num_splits]
  float* ws_sum;  // [num_seqs][num_q_heads][num_splits]
};

// The keys a sequence's query sees, numbered 0, 1, ...: its sinks [0, sink_end), then its window
// [start, seq_len). Splits partition these, so no split reads a block before the window.
struct VisibleKeys {
  int sink_end, start, count;
  __device__ VisibleKeys(const AttentionWindow& w, int32_t seq_len) {
    sink_end = static_cast<int>(w.SinkEnd(seq_len - 1));
    start = static_cast<int>(w.Start(seq_len - 1));
    count = sink_end + seq_len - start;
  }
  __device__ int Position(int i) const { return i < sink_end ? i : i - sink_end + start; }
};

__device__ __forceinline__ bool BadLength(int32_t seq_len, const DecodeParams& p) {
  return seq_len < 1 || seq_len > p.max_seq_len ||
         static_cast<int64_t>(seq_len) > static_cast<int64_t>(p.table_stride) * p.view.l.block_size;
}

// A partition that read a block id outside the pool: its heads come out NaN (directly, or through
// a NaN sum that the combine pass propagates).
__device__ void PoisonPartition(const DecodeParams& p, int64_t q_row, int heads, int split) {
  const int head_dim = p.view.l.head_dim;
  for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
    if (p.num_splits == 1) {
      p.out[q_row * head_dim + i] = NAN;
      continue;
    }
    const int64_t row = (q_row + i / head_dim) * p.num_splits + split;
    p.ws_acc[row * head_dim + i % head_dim] = NAN;
    if (i % head_dim == 0) {
      p.ws_max[row] = 0.f;
      p.ws_sum[row] = NAN;
    }
  }
}

// Rounds the CTA's query heads (q_s, [kHeads][head_dim]) for an int8 K the way the CPU's VNNI
// path does (decode_tile.h: RoundedQuery): per head, codes FloatToInt8(x / step) into `codes`
// ([kHeads][head_dim]) and step * scale into factor[h]; NaN for a head holding a NaN or an
// infinity. One warp per head. Padding heads (zero) get zero codes and factors.
__device__ void QuantizeQuery(const float* q_s, int heads, int head_dim, float scale, int8_t* codes,
                              float* factor) {
  const int lane = threadIdx.x & 31;
  for (int h = threadIdx.x >> 5; h < heads; h += kDecodeWarps) {
    const float* x = q_s + h * head_dim;
    float absmax = 0.f;
    bool finite = true;
    for (int d = lane; d < head_dim; d += 32) {
      finite = finite && isfinite(x[d]);
      absmax = fmaxf(absmax, fabsf(x[d]));
    }
    absmax = WarpMax(absmax);
    const float step = __all_sync(0xffffffffu, finite) ? absmax / 127.0f : NAN;
    for (int d = lane; d < head_dim; d += 32) codes[h * head_dim + d] = FloatToInt8(x[d] / step);
    if (lane == 0) factor[h] = step * scale;
  }
}

// Grid: (sequence, KV head * head_chunks, split). Dynamic shared memory:
// q [kHeads][head_dim], acc [kHeads][head_dim], scores [kHeads][partition], all f32. K and V
// are read in their own dtypes (LoadKv8); an 8-bit side's block scale multiplies the token's
// score (K) or probability (V). An int8 K is scored with dp4a against the query rounded to int8
// codes per head (QuantizeQuery; the codes sit in the acc area until pass 1c): exact integer
// dot products, four multiply-adds an instruction, as the CPU's VNNI path computes them.
template <int kHeads>
__global__ void __launch_bounds__(kDecodeThreads) DecodePartitionKernel(DecodeParams p) {
  extern __shared__ float smem[];
  __shared__ float max_s[kHeads];
  __shared__ float sum_s[kHeads];
  __shared__ float q_factor_s[kHeads];  // int8 K: the query step times the softmax scale
  __shared__ int bad_block_s;

  const LayerLayout& layout = p.view.l;
  const int head_dim = layout.head_dim;
  const int block_size = layout.block_size;
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int first_q = kv_head * p.group + (blockIdx.y % p.head_chunks) * kHeads;
  const int heads = min(kHeads, (kv_head + 1) * p.group - first_q);  // the rest are padding
  const int split = blockIdx.z;
  const int64_t q_row = static_cast<int64_t>(seq) * p.num_q_heads + first_q;

  const int32_t seq_len = p.seq_lens[seq];
  if (BadLength(seq_len, p)) {
    // With several splits the combine pass reports the bad length.
    if (p.num_splits == 1) {
      for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
        p.out[q_row * head_dim + i] = NAN;
      }
    }
    return;
  }
  const VisibleKeys keys(p.window, seq_len);
  const int start = split * p.partition;
  const int n = min(p.partition, keys.count - start);
  if (n <= 0) return;  // past this sequence's end; the combine pass reads only used splits

  float* q_s = smem;
  float* acc_s = q_s + kHeads * head_dim;
  float* score_s = acc_s + kHeads * head_dim;
  for (int i = threadIdx.x; i < kHeads * head_dim; i += blockDim.x) {
    q_s[i] = i / head_dim < heads ? p.q[q_row * head_dim + i] : 0.f;
  }
  if (threadIdx.x == 0) bad_block_s = 0;
  __syncthreads();
  const bool int8_k = layout.k_dtype == DType::kInt8;
  auto* q_codes_s = reinterpret_cast<int8_t*>(acc_s);
  if (int8_k) {
    QuantizeQuery(q_s, kHeads, head_dim, p.scale, q_codes_s, q_factor_s);
    __syncthreads();
  }

  // A group of `lanes` lanes handles one token, each lane one 8-element slice of the head, so a
  // group reads a K/V row in one coalesced sweep.
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int lanes = p.lanes;
  const int slice = lane & (lanes - 1);
  const int tokens_per_warp = 32 / lanes;
  const int token_group = warp * tokens_per_warp + lane / lanes;
  const int token_groups = kDecodeWarps * tokens_per_warp;
  const bool has_slice = slice * 8 < head_dim;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.table_stride;
  // Byte offsets of this lane's slice within a K and a V row.
  const int64_t k_slice =
      (static_cast<int64_t>(kv_head) * head_dim + slice * 8) * DTypeSize(layout.k_dtype);
  const int64_t v_slice =
      (static_cast<int64_t>(kv_head) * head_dim + slice * 8) * DTypeSize(layout.v_dtype);

  float q_r[kHeads][8];
  int2 q_codes_r[kHeads];  // int8 K: this lane's 8 query codes per head, 4 to a word
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q_r[h][j] = has_slice ? q_s[h * head_dim + slice * 8 + j] : 0.f;
    q_codes_r[h] = int8_k && has_slice
                       ? *reinterpret_cast<const int2*>(q_codes_s + h * head_dim + slice * 8)
                       : make_int2(0, 0);
  }

  // Pass 1a: scores. Every lane runs every iteration: the group reduction shuffles.
  for (int base = 0; base < n; base += token_groups) {
    const int i = base + token_group;
    float dot[kHeads] = {};
    bool valid = i < n;
    float k_scale = 1.f;
    if (valid) {
      const int t = keys.Position(start + i);
      const int32_t block = table[t / block_size];
      if (block < 0 || block >= layout.num_blocks) {
        bad_block_s = 1;
        valid = false;
      } else if (has_slice) {
        k_scale = KvScale(p.view.k_scales(block), kv_head, layout.k_dtype);
        const char* k = p.view.k(block) + (t % block_size) * layout.k_row_bytes + k_slice;
        if (int8_k) {
          // A lane's part is at most 8 * 127 * 127 and a row's sum below 2^24: exact as floats.
          const int2 codes = __ldg(reinterpret_cast<const int2*>(k));
#pragma unroll
          for (int h = 0; h < kHeads; ++h) {
            dot[h] = static_cast<float>(
                __dp4a(codes.y, q_codes_r[h].y, __dp4a(codes.x, q_codes_r[h].x, 0)));
          }
        } else {
          float kf[8];
          LoadKv8(k, layout.k_dtype, kf);
#pragma unroll
          for (int h = 0; h < kHeads; ++h) {
#pragma unroll
            for (int j = 0; j < 8; ++j) dot[h] = fmaf(q_r[h][j], kf[j], dot[h]);
          }
        }
      }
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], offset);
    }
    if (valid && slice == 0) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float factor = int8_k ? q_factor_s[h] : p.scale;
        if (h < heads) score_s[h * p.partition + i] = dot[h] * (factor * k_scale);
      }
    }
  }
  __syncthreads();
  if (bad_block_s) {
    PoisonPartition(p, q_row, heads, split);
    return;
  }

  // Pass 1b: the partition's softmax, one warp per head; scores become exp(score - max).
  for (int h = warp; h < heads; h += kDecodeWarps) {
    float* s = score_s + h * p.partition;
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, s[i]);
    m = WarpMax(m);
    float sum = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = expf(s[i] - m);
      s[i] = e;
      sum += e;
    }
    sum = WarpSum(sum);
    if (lane == 0) {
      max_s[h] = m;
      sum_s[h] = sum;
    }
  }
  __syncthreads();

  // Pass 1c: probability-weighted V, same token mapping as the scores.
  float acc[kHeads][8] = {};
  for (int base = 0; base < n; base += token_groups) {
    const int i = base + token_group;
    if (i >= n || !has_slice) continue;
    const int t = keys.Position(start + i);
    const int32_t block = table[t / block_size];
    const float v_scale = KvScale(p.view.v_scales(block), kv_head, layout.v_dtype);
    float vf[8];
    LoadKv8(p.view.v(block) + (t % block_size) * layout.v_row_bytes + v_slice, layout.v_dtype, vf);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float w = h < heads ? score_s[h * p.partition + i] * v_scale : 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(w, vf[j], acc[h][j]);
    }
  }
  // Add the warp's token groups (lanes with equal `slice`), then the warps in a fixed order so
  // results are deterministic.
  for (int offset = lanes; offset < 32; offset *= 2) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] += __shfl_xor_sync(0xffffffffu, acc[h][j], offset);
    }
  }
  for (int w = 0; w < kDecodeWarps; ++w) {
    if (warp == w && lane < lanes && has_slice) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        if (h >= heads) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float* dst = acc_s + h * head_dim + slice * 8 + j;
          *dst = (w == 0 ? 0.f : *dst) + acc[h][j];
        }
      }
    }
    __syncthreads();
  }

  for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim;
    if (p.num_splits == 1) {
      p.out[q_row * head_dim + i] = acc_s[i] / sum_s[h];
      continue;
    }
    const int64_t row = (q_row + h) * p.num_splits + split;
    p.ws_acc[row * head_dim + i % head_dim] = acc_s[i];
    if (i % head_dim == 0) {
      p.ws_max[row] = max_s[h];
      p.ws_sum[row] = sum_s[h];
    }
  }
}

// Grid: (sequence, query head). out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the
// splits that hold tokens of the sequence.
__global__ void __launch_bounds__(kCombineThreads) DecodeCombineKernel(DecodeParams p) {
  const int head_dim = p.view.l.head_dim;
  const int64_t q_row = static_cast<int64_t>(blockIdx.x) * p.num_q_heads + blockIdx.y;
  float* out = p.out + q_row * head_dim;
  const int32_t seq_len = p.seq_lens[blockIdx.x];
  if (BadLength(seq_len, p)) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) out[d] = NAN;
    return;
  }
  const int used = (VisibleKeys(p.window, seq_len).count + p.partition - 1) / p.partition;
  const float* m = p.ws_max + q_row * p.num_splits;
  const float* l = p.ws_sum + q_row * p.num_splits;
  const float* acc = p.ws_acc + q_row * p.num_splits * head_dim;
  float global_max = -INFINITY;
  for (int s = 0; s < used; ++s) global_max = fmaxf(global_max, m[s]);
  float denominator = 0.f;
  for (int s = 0; s < used; ++s) denominator += expf(m[s] - global_max) * l[s];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float numerator = 0.f;
    for (int s = 0; s < used; ++s) {
      numerator += expf(m[s] - global_max) * acc[static_cast<int64_t>(s) * head_dim + d];
    }
    out[d] = numerator / denominator;
  }
}

template <int kHeads>
cudaError_t Launch(const DecodeParams& p, int32_t num_seqs, cudaStream_t stream) {
  const LayerLayout& layout = p.view.l;
  const dim3 grid(num_seqs, layout.num_kv_heads * p.head_chunks, p.num_splits);
  const size_t smem = sizeof(float) * (2 * kHeads * layout.head_dim + kHeads * p.partition);
  DecodePartitionKernel<kHeads><<<grid, kDecodeThreads, smem, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (p.num_splits == 1) return cudaSuccess;
  DecodeCombineKernel<<<dim3(num_seqs, p.num_q_heads), kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

DecodePlan PlanDecode(const PoolLayout& layout, int32_t num_seqs, int32_t num_q_heads,
                      int32_t max_seq_len, int32_t num_sms) {
  DecodePlan plan;
  const int32_t group = num_q_heads / layout.num_kv_heads;
  plan.heads_per_cta = 1;
  while (plan.heads_per_cta < group && plan.heads_per_cta < kMaxHeadsPerCta) {
    plan.heads_per_cta *= 2;
  }
  plan.head_chunks = static_cast<int32_t>(CeilDiv(group, plan.heads_per_cta));
  const int64_t ctas_per_split =
      static_cast<int64_t>(num_seqs) * layout.num_kv_heads * plan.head_chunks;
  int32_t partition = kMaxPartition;
  while (partition > kMinPartition &&
         ctas_per_split * CeilDiv(max_seq_len, partition) < 2 * static_cast<int64_t>(num_sms)) {
    partition /= 2;
  }
  plan.partition_tokens = partition;
  plan.num_splits = static_cast<int32_t>(CeilDiv(max_seq_len, partition));
  if (plan.num_splits > 1) {
    plan.workspace_bytes = static_cast<int64_t>(sizeof(float)) * num_seqs * num_q_heads *
                           plan.num_splits * (layout.head_dim + 2);
  }
  return plan;
}

cudaError_t LaunchPagedAttentionDecode(const KvPoolView& pool, const DecodeArgs& args,
                                       const DecodePlan& plan, cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  DecodeParams p{};
  p.view = pool.Layer(args.layer);
  p.num_q_heads = args.num_q_heads;
  p.group = args.num_q_heads / pool.layout.num_kv_heads;
  p.scale = args.scale;
  p.q = args.q;
  p.out = args.out;
  p.block_tables = args.block_tables;
  p.table_stride = args.table_stride;
  p.seq_lens = args.seq_lens;
  p.max_seq_len = args.max_seq_len;
  p.window = args.window;
  p.partition = plan.partition_tokens;
  p.num_splits = plan.num_splits;
  p.head_chunks = plan.head_chunks;
  p.lanes = 1;
  while (p.lanes * 8 < pool.layout.head_dim) p.lanes *= 2;
  if (plan.num_splits > 1) {
    const int64_t rows = static_cast<int64_t>(args.num_seqs) * args.num_q_heads * plan.num_splits;
    p.ws_acc = static_cast<float*>(args.workspace);
    p.ws_max = p.ws_acc + rows * pool.layout.head_dim;
    p.ws_sum = p.ws_max + rows;
  }
  switch (plan.heads_per_cta) {
    case 1:
      return Launch<1>(p, args.num_seqs, stream);
    case 2:
      return Launch<2>(p, args.num_seqs, stream);
    case 4:
      return Launch<4>(p, args.num_seqs, stream);
    default:
      return Launch<kMaxHeadsPerCta>(p, args.num_seqs, stream);
  }
}

}  // namespace kvpool::kernels::cuda
