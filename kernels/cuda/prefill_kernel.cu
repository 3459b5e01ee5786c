// PagedAttentionPrefill on CUDA: the CPU kernel's structure (kernels/cpu_prefill.cc) on a GPU.
// A CTA takes one tile of a sequence's query rows (kPrefillCtaRows (token, head) pairs of one KV
// head, token-major) and walks that sequence's K/V in chunks of kPrefillCtaKeys keys up to the
// tile's last position: the chunk's K and V rows are gathered from their blocks into shared
// memory as f32, then each row's scores (masked past its position), an online softmax update
// and O = O·e^(m - m') + P·V. Four threads share a row: each scores every fourth key of the
// chunk and owns every fourth element of the row's output, kept in registers.
//
// CUDA cores and f32 arithmetic, like the decode kernel: the parity bound is the decode tests'.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace kvpool::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = kPrefillCtaRows;  // 32: four threads per row
constexpr int kKeys = kPrefillCtaKeys;  // 32
constexpr int kLanesPerRow = kThreads / kRows;
static_assert(kLanesPerRow == 4, "the shuffles below combine four lanes per row");

struct PrefillParams {
  KvLayerView view;  // the layer's chunks and dtypes
  int32_t num_q_heads;
  int32_t group;  // query heads per KV head
  float scale;
  const float* q;
  float* out;
  const int32_t* q_starts;
  const int32_t* block_tables;
  int32_t table_stride;
  const int32_t* seq_lens;
  int32_t max_seq_len;
  int32_t max_q_len;
  AttentionWindow window;
  PrefillPlan plan;
};

// Writes NaN to every output element of the CTA's rows.
__device__ void PoisonRows(const PrefillParams& p, int64_t first_row, int head0, int heads,
                           int tokens) {
  const int dim = p.view.l.head_dim;
  for (int i = threadIdx.x; i < tokens * heads * dim; i += blockDim.x) {
    const int r = i / dim;
    const int64_t row = first_row + r / heads;
    p.out[(row * p.num_q_heads + head0 + r % heads) * dim + i % dim] = NAN;
  }
}

__device__ __forceinline__ float RowMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float RowSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Grid: (tile, sequence, KV head * head slices). Dynamic shared memory: q [kRows][dim + 1],
// k and v [kKeys][dim + 1], p [kRows][kKeys + 1], all f32 (rows padded against bank conflicts).
// kSlots: output elements per thread, >= ceil(head_dim / 4). K and V are gathered in their own
// dtypes (LoadKv8), an 8-bit side times its block's head scale.
template <int kSlots>
__global__ void __launch_bounds__(kThreads) PrefillKernel(PrefillParams p) {
  extern __shared__ float smem[];
  __shared__ int bad_block_s;
  const LayerLayout& layout = p.view.l;
  const int dim = layout.head_dim;
  const int ld = dim + 1;
  float* q_s = smem;
  float* k_s = q_s + kRows * ld;
  float* v_s = k_s + kKeys * ld;
  float* p_s = v_s + kKeys * ld;

  const int seq = blockIdx.y;
  const int kv_head = blockIdx.z / p.plan.slices;
  const int head0 = kv_head * p.group + (blockIdx.z % p.plan.slices) * p.plan.heads;
  const int heads = min(p.plan.heads, (kv_head + 1) * p.group - head0);
  const int32_t q0 = p.q_starts[seq];
  const int32_t q_len = p.q_starts[seq + 1] - q0;
  const int first = blockIdx.x * p.plan.tokens;
  if (first >= q_len) return;  // past this sequence's queries (or a negative q_len)
  const int tokens = min(p.plan.tokens, q_len - first);
  const int64_t first_row = static_cast<int64_t>(q0) + first;
  const int32_t seq_len = p.seq_lens[seq];
  if (q_len > p.max_q_len || seq_len < max(q_len, 1) || seq_len > p.max_seq_len ||
      static_cast<int64_t>(seq_len) > static_cast<int64_t>(p.table_stride) * layout.block_size) {
    PoisonRows(p, first_row, head0, heads, tokens);
    return;
  }
  const int rows = tokens * heads;
  const int64_t first_pos = static_cast<int64_t>(seq_len) - q_len + first;
  const int64_t last_pos = first_pos + tokens - 1;

  for (int i = threadIdx.x; i < kRows * dim; i += blockDim.x) {
    const int r = i / dim, d = i % dim;
    q_s[r * ld + d] =
        r < rows
            ? p.q[((first_row + r / heads) * p.num_q_heads + head0 + r % heads) * dim + d] * p.scale
            : 0.f;
  }
  if (threadIdx.x == 0) bad_block_s = 0;

  const int r = threadIdx.x / kLanesPerRow;
  const int sub = threadIdx.x % kLanesPerRow;
  const int64_t pos = first_pos + min(r / heads, tokens - 1);  // padding rows: the last token's
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.table_stride;
  const int slices = dim / 8;
  float m = -INFINITY, l = 0.f;
  float acc[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) acc[j] = 0.f;

  // The keys some query of the tile sees: the sinks, then from the first query's window start
  // (without a window: [0, last_pos]), so no block before a window is read.
  const int64_t span_begin[2] = {0, p.window.Start(first_pos)};
  const int64_t span_end[2] = {p.window.SinkEnd(first_pos), last_pos + 1};
  for (int span = 0; span < 2; ++span) {
    for (int64_t c0 = span_begin[span]; c0 < span_end[span]; c0 += kKeys) {
      const int nk = static_cast<int>(min(static_cast<int64_t>(kKeys), span_end[span] - c0));
      __syncthreads();  // the previous chunk's readers are done (and q_s is loaded)
      for (int i = threadIdx.x; i < nk * slices; i += blockDim.x) {
        const int c = i / slices, d = (i % slices) * 8;
        const int64_t t = c0 + c;
        const int32_t block = table[t / layout.block_size];
        if (block < 0 || block >= layout.num_blocks) {
          bad_block_s = 1;
          continue;
        }
        const int64_t slot = t % layout.block_size;
        const int64_t element = static_cast<int64_t>(kv_head) * dim + d;
        float x[8];
        LoadKv8(p.view.k(block) + slot * layout.k_row_bytes + element * DTypeSize(layout.k_dtype),
                layout.k_dtype, x);
        const float ks = KvScale(p.view.k_scales(block), kv_head, layout.k_dtype);
#pragma unroll
        for (int j = 0; j < 8; ++j) k_s[c * ld + d + j] = x[j] * ks;
        LoadKv8(p.view.v(block) + slot * layout.v_row_bytes + element * DTypeSize(layout.v_dtype),
                layout.v_dtype, x);
        const float vs = KvScale(p.view.v_scales(block), kv_head, layout.v_dtype);
#pragma unroll
        for (int j = 0; j < 8; ++j) v_s[c * ld + d + j] = x[j] * vs;
      }
      __syncthreads();
      if (bad_block_s) {
        PoisonRows(p, first_row, head0, heads, tokens);
        return;
      }

      // Scores of keys sub, sub + 4, ...; a key past the row's position or outside its window and
      // sinks is masked.
      float s[kKeys / kLanesPerRow];
      float chunk_max = -INFINITY;
#pragma unroll
      for (int i = 0; i < kKeys / kLanesPerRow; ++i) {
        const int c = sub + kLanesPerRow * i;
        s[i] = -INFINITY;
        if (c < nk && p.window.Sees(pos, c0 + c)) {
          float dot = 0.f;
          for (int d = 0; d < dim; ++d) dot = fmaf(q_s[r * ld + d], k_s[c * ld + d], dot);
          s[i] = dot;
        }
        chunk_max = fmaxf(chunk_max, s[i]);
      }
      // A row that has seen no key yet keeps m = -inf (a window may start past this chunk): its
      // factor is 1 and its probabilities 0 until then.
      const float m_new = fmaxf(m, RowMax(chunk_max));
      const float alpha = m_new == -INFINITY ? 1.f : expf(m - m_new);  // 0 on the first keys
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kKeys / kLanesPerRow; ++i) {
        const float e = s[i] == -INFINITY ? 0.f : expf(s[i] - m_new);
        p_s[r * (kKeys + 1) + sub + kLanesPerRow * i] = e;
        sum += e;
      }
      l = l * alpha + RowSum(sum);
      m = m_new;
      __syncwarp();  // a row's four threads are in one warp

#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int d = sub + kLanesPerRow * j;
        if (d >= dim) continue;
        float a = acc[j] * alpha;
        for (int c = 0; c < nk; ++c) a = fmaf(p_s[r * (kKeys + 1) + c], v_s[c * ld + d], a);
        acc[j] = a;
      }
    }
  }

  if (r >= rows) return;
  float* out = p.out + ((first_row + r / heads) * p.num_q_heads + head0 + r % heads) * dim;
  const float inv = 1.f / l;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int d = sub + kLanesPerRow * j;
    if (d < dim) out[d] = acc[j] * inv;
  }
}

template <int kSlots>
cudaError_t Launch(const PrefillParams& p, int32_t num_seqs, cudaStream_t stream) {
  const LayerLayout& layout = p.view.l;
  const int ld = layout.head_dim + 1;
  const size_t smem = sizeof(float) * ((kRows + 2 * kKeys) * ld + kRows * (kKeys + 1));
  auto* kernel = &PrefillKernel<kSlots>;
  if (smem > 48 * 1024) {
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
        err != cudaSuccess) {
      return err;
    }
  }
  const dim3 grid(p.plan.tiles, num_seqs, layout.num_kv_heads * p.plan.slices);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

PrefillPlan PlanPrefill(const PoolLayout& layout, int32_t num_q_heads, int32_t max_q_len) {
  PrefillPlan plan;
  const int32_t group = num_q_heads / layout.num_kv_heads;
  plan.heads = group < kRows ? group : kRows;
  plan.slices = (group + plan.heads - 1) / plan.heads;
  plan.tokens = kRows / plan.heads;
  plan.tiles = (max_q_len + plan.tokens - 1) / plan.tokens;
  return plan;
}

cudaError_t LaunchPagedAttentionPrefill(const KvPoolView& pool, const PrefillArgs& args,
                                        const PrefillPlan& plan, cudaStream_t stream) {
  if (args.num_seqs == 0 || plan.tiles == 0) return cudaSuccess;
  PrefillParams p{};
  p.view = pool.Layer(args.layer);
  p.num_q_heads = args.num_q_heads;
  p.group = args.num_q_heads / pool.layout.num_kv_heads;
  p.scale = args.scale;
  p.q = args.q;
  p.out = args.out;
  p.q_starts = args.q_starts;
  p.block_tables = args.block_tables;
  p.table_stride = args.table_stride;
  p.seq_lens = args.seq_lens;
  p.max_seq_len = args.max_seq_len;
  p.max_q_len = args.max_q_len;
  p.window = args.window;
  p.plan = plan;
  const int dim = pool.layout.head_dim;
  if (dim <= 64) return Launch<16>(p, args.num_seqs, stream);
  if (dim <= 128) return Launch<32>(p, args.num_seqs, stream);
  return Launch<kMaxDecodeHeadDim / kLanesPerRow>(p, args.num_seqs, stream);
}

}  // namespace kvpool::kernels::cuda
