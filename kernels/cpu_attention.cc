// CPU decode attention: one query token per sequence against its K/V, grouped-query.
//
// A task is (sequence, range of tokens) over every KV head: it walks whole token rows
// ([num_kv_heads][head_dim], contiguous in both the paged and the dense layout) in order, which
// the hardware prefetcher and the TLB follow, and each K/V element is read once for all the query
// heads of its group. Long sequences are split into several ranges (flash-decoding) so every core
// has work even at batch 1; each range leaves a partial softmax state (max, sum, weighted values)
// that a final pass merges. Within a range, tokens go in chunks of kChunk rows with an online
// softmax. The paged and dense variants differ only in how a chunk's row pointers are found.
//
// The vectorized path (AVX2 + FMA + F16C) is compiled with a function-level target attribute and
// chosen at run time, so the default build runs on any x86-64.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fmt/format.h"
#include "kernels/cpu_kernels.h"
#include "kernels/cpu_isa.h"
#include "kernels/validate.h"

#define KVPOOL_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvpool::kernels::cpu {
namespace {

// Rows per online-softmax step. While a chunk's K is scored, its V and the next chunk's K are
// prefetched into L2: three chunks in flight. At 64 rows of a Llama-3-8B-like layer (2 KiB per
// row) that is 384 KiB and overflowed this machine's 512 KiB L2 (V loads then missed); at 16 it
// is 96 KiB, and decode at 4k-16k contexts is ~20% faster (kernels_bench). 8 is slower again.
constexpr int kChunk = 16;
constexpr int kMaxQHeads = 128;     // query heads per sequence
constexpr int64_t kMinSplit = 256;  // tokens per task at least (splitting has a merge cost)

// The shape every task shares.
struct Shape {
  int kv_heads;
  int group;  // query heads per KV head
  int dim;
  int q_heads() const { return kv_heads * group; }
};

// One (sequence, token range) task and where its partial state goes.
struct Task {
  const float* q;  // [q_heads][dim]
  float scale;
  int64_t begin, end;
  float* m;    // [q_heads] running max
  float* l;    // [q_heads] running sum of exp
  float* acc;  // [q_heads][dim] running weighted values (not yet divided by l)
};

// Row pointers of a paged sequence: token t lives in block table[t / block_size].
struct PagedRows {
  const KvPoolView* pool;
  const int32_t* table;
  int32_t layer;

  void Get(int64_t t0, int n, const char** k, const char** v) const {
    const int32_t bs = pool->layout.block_size;
    const int64_t row = pool->layout.row_bytes();
    for (int i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      const int32_t block = table[t / bs];
      const int64_t offset = (t % bs) * row;
      k[i] = pool->k(block, layer) + offset;
      v[i] = pool->v(block, layer) + offset;
    }
  }
};

// Row pointers of a contiguous sequence.
struct DenseRows {
  const char* k;
  const char* v;
  int64_t row;

  void Get(int64_t t0, int n, const char** kp, const char** vp) const {
    for (int i = 0; i < n; ++i) {
      kp[i] = k + (t0 + i) * row;
      vp[i] = v + (t0 + i) * row;
    }
  }
};

// ---- Portable path -------------------------------------------------------------------------

template <typename Rows>
void AttendPortable(const Shape& shape, const Task& task, const Rows& rows, DType dtype) {
  const int dim = shape.dim;
  const int64_t dsize = DTypeSize(dtype);
  const int64_t head_bytes = dim * dsize;
  float s[kChunk];
  const char* kp[kChunk];
  const char* vp[kChunk];
  for (int64_t t0 = task.begin; t0 < task.end; t0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, task.end - t0));
    rows.Get(t0, n, kp, vp);
    for (int h = 0; h < shape.q_heads(); ++h) {
      const int64_t head = (h / shape.group) * head_bytes;
      const float* q = task.q + h * dim;
      float chunk_max = task.m[h];
      for (int i = 0; i < n; ++i) {
        float dot = 0;
        for (int d = 0; d < dim; ++d) dot += q[d] * LoadAsFloat(kp[i] + head + d * dsize, dtype);
        s[i] = dot * task.scale;
        chunk_max = std::max(chunk_max, s[i]);
      }
      const float alpha = std::exp(task.m[h] - chunk_max);  // 0 on the first chunk
      float sum = 0;
      for (int i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - chunk_max));
      task.l[h] = task.l[h] * alpha + sum;
      task.m[h] = chunk_max;
      float* a = task.acc + h * dim;
      for (int d = 0; d < dim; ++d) a[d] *= alpha;
      for (int i = 0; i < n; ++i) {
        for (int d = 0; d < dim; ++d) a[d] += s[i] * LoadAsFloat(vp[i] + head + d * dsize, dtype);
      }
    }
  }
}

// ---- AVX2 path -----------------------------------------------------------------------------

template <DType kType>
KVPOOL_AVX2 inline __m256 Load8(const char* p) {
  if constexpr (kType == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (kType == DType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

KVPOOL_AVX2 inline float HorizontalSum(__m256 v) {
  const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// exp(x) for 8 lanes (Cephes polynomial; relative error ~1e-7 on [-87, 88]).
KVPOOL_AVX2 inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2 =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// Lane j of the result is the sum of v[j]'s lanes (eight horizontal sums in seven shuffles).
KVPOOL_AVX2 inline __m256 Reduce8(const __m256 v[8]) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]);
  const __m256 s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]);
  const __m256 s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);  // per 128-bit lane: v0 v1 v2 v3 partials
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Scores of kHeads query heads (rows of q, `dim` apart) against two tokens' head slices at once:
// eight independent FMA chains hide the FMA latency that one chain per head would expose.
// out[j] is head j's score for k0, out[4 + j] for k1.
template <DType kType, int kHeads>
KVPOOL_AVX2 inline __m256 Scores2(const float* q, int dim, const char* k0, const char* k1) {
  constexpr int64_t kSize = DTypeSize(kType);
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int d = 0; d < dim; d += 8) {
    const __m256 x0 = Load8<kType>(k0 + d * kSize);
    const __m256 x1 = Load8<kType>(k1 + d * kSize);
    for (int j = 0; j < kHeads; ++j) {
      const __m256 qv = _mm256_loadu_ps(q + j * dim + d);
      acc[j] = _mm256_fmadd_ps(qv, x0, acc[j]);
      acc[4 + j] = _mm256_fmadd_ps(qv, x1, acc[4 + j]);
    }
  }
  return Reduce8(acc);
}

// acc[j][0..width) += sum_i p[j][i] * v_i[0..width) for kHeads heads, width 16 or 8 (two or one
// register per head, so eight or four independent chains).
template <DType kType, int kHeads, int kWidth>
KVPOOL_AVX2 inline void AccumulateValues(const float* p, int n, const char* const* vp,
                                         int64_t offset, float* acc, int dim) {
  constexpr int64_t kSize = DTypeSize(kType);
  __m256 lo[kHeads], hi[kHeads];
  for (int j = 0; j < kHeads; ++j) {
    lo[j] = _mm256_loadu_ps(acc + j * dim);
    hi[j] = kWidth == 16 ? _mm256_loadu_ps(acc + j * dim + 8) : _mm256_setzero_ps();
  }
  for (int i = 0; i < n; ++i) {
    const char* v = vp[i] + offset;
    const __m256 v0 = Load8<kType>(v);
    const __m256 v1 = kWidth == 16 ? Load8<kType>(v + 8 * kSize) : v0;
    for (int j = 0; j < kHeads; ++j) {
      const __m256 w = _mm256_broadcast_ss(p + j * kChunk + i);
      lo[j] = _mm256_fmadd_ps(w, v0, lo[j]);
      if (kWidth == 16) hi[j] = _mm256_fmadd_ps(w, v1, hi[j]);
    }
  }
  for (int j = 0; j < kHeads; ++j) {
    _mm256_storeu_ps(acc + j * dim, lo[j]);
    if (kWidth == 16) _mm256_storeu_ps(acc + j * dim + 8, hi[j]);
  }
}

// One group of up to four query heads sharing a KV head: scores for a chunk, then (after the
// softmax) values.
template <DType kType, int kHeads>
struct HeadGroup {
  // Scores of tokens i and i+1 (k0, k1: their head slices; k1 == k0 for a lone last token).
  KVPOOL_AVX2 static void ScoresPair(const float* q, int dim, const char* k0, const char* k1,
                                     float scale, float* s, int i, bool pair) {
    alignas(32) float out[8];
    _mm256_store_ps(out,
                    _mm256_mul_ps(Scores2<kType, kHeads>(q, dim, k0, k1), _mm256_set1_ps(scale)));
    for (int j = 0; j < kHeads; ++j) {
      s[j * kChunk + i] = out[j];
      if (pair) s[j * kChunk + i + 1] = out[4 + j];
    }
  }
  KVPOOL_AVX2 static void Values(const float* s, int dim, int n, const char* const* vp,
                                 int64_t offset, float* acc) {
    constexpr int64_t kSize = DTypeSize(kType);
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
      AccumulateValues<kType, kHeads, 16>(s, n, vp, offset + d * kSize, acc + d, dim);
    }
    if (d < dim) AccumulateValues<kType, kHeads, 8>(s, n, vp, offset + d * kSize, acc + d, dim);
  }
};

// kHeads query heads are processed together (group % kHeads == 0), fixed at compile time so the
// whole loop nest inlines (a lambda inside would not inherit this function's target).
template <DType kType, int kHeads, typename Rows>
KVPOOL_AVX2 void AttendAvx2(const Shape& shape, const Task& task, const Rows& rows) {
  using Group = HeadGroup<kType, kHeads>;
  constexpr int64_t kSize = DTypeSize(kType);
  const int dim = shape.dim;
  const int group = shape.group;
  const int q_heads = shape.q_heads();
  const int64_t head_bytes = dim * kSize;
  const int64_t row_bytes = head_bytes * shape.kv_heads;
  alignas(32) float s[kMaxQHeads][kChunk];
  const char* kp[kChunk];
  const char* vp[kChunk];
  const char* next_kp[kChunk];
  const char* next_vp[kChunk];
  int n_next = static_cast<int>(std::min<int64_t>(kChunk, task.end - task.begin));
  rows.Get(task.begin, n_next, next_kp, next_vp);
  for (int64_t t0 = task.begin; t0 < task.end; t0 += kChunk) {
    const int n = n_next;
    std::copy(next_kp, next_kp + n, kp);
    std::copy(next_vp, next_vp + n, vp);
    n_next = static_cast<int>(std::clamp<int64_t>(task.end - t0 - kChunk, 0, kChunk));
    if (n_next > 0) rows.Get(t0 + kChunk, n_next, next_kp, next_vp);
    // Scores, token by token: each K row is read whole and in order (the hardware prefetcher
    // follows that; it does not follow one head's slices, a row apart), while this chunk's V
    // rows and the next chunk's K rows are fetched for the passes that need them next.
    for (int i = 0; i < n; i += 2) {
      const bool pair = i + 1 < n;
      for (int r = i; r < i + (pair ? 2 : 1); ++r) {
        for (int64_t b = 0; b < row_bytes; b += 64) {
          _mm_prefetch(vp[r] + b, _MM_HINT_T1);
          if (r < n_next) _mm_prefetch(next_kp[r] + b, _MM_HINT_T1);
        }
      }
      for (int h = 0; h < shape.kv_heads; ++h) {
        const char* k0 = kp[i] + h * head_bytes;
        const char* k1 = pair ? kp[i + 1] + h * head_bytes : k0;
        for (int g0 = 0; g0 < group; g0 += kHeads) {
          const int q0 = h * group + g0;
          Group::ScoresPair(task.q + q0 * dim, dim, k0, k1, task.scale, &s[q0][0], i, pair);
        }
      }
    }
    // Online softmax: rescale what was accumulated by exp(old max - new max).
    for (int q = 0; q < q_heads; ++q) {
      float chunk_max = task.m[q];
      for (int i = 0; i < n; ++i) chunk_max = std::max(chunk_max, s[q][i]);
      const float alpha = std::exp(task.m[q] - chunk_max);
      const __m256 max8 = _mm256_set1_ps(chunk_max);
      __m256 sum8 = _mm256_setzero_ps();
      int i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 p = Exp8(_mm256_sub_ps(_mm256_load_ps(&s[q][i]), max8));
        _mm256_store_ps(&s[q][i], p);
        sum8 = _mm256_add_ps(sum8, p);
      }
      float sum = HorizontalSum(sum8);
      for (; i < n; ++i) sum += (s[q][i] = std::exp(s[q][i] - chunk_max));
      task.l[q] = task.l[q] * alpha + sum;
      task.m[q] = chunk_max;
      if (alpha != 1.0f) {
        const __m256 a8 = _mm256_set1_ps(alpha);
        float* a = task.acc + q * dim;
        for (int d = 0; d < dim; d += 8) {
          _mm256_storeu_ps(a + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), a8));
        }
      }
    }
    // Values: the chunk's V rows (in L2 by now) streamed once per head group.
    for (int h = 0; h < shape.kv_heads; ++h) {
      for (int g0 = 0; g0 < group; g0 += kHeads) {
        const int q0 = h * group + g0;
        Group::Values(&s[q0][0], dim, n, vp, h * head_bytes, task.acc + q0 * dim);
      }
    }
  }
}

// The widest head-group width (4, 2 or 1) that divides the group.
template <DType kType, typename Rows>
void AttendAvx2Grouped(const Shape& shape, const Task& task, const Rows& rows) {
  if (shape.group % 4 == 0) return AttendAvx2<kType, 4>(shape, task, rows);
  if (shape.group % 2 == 0) return AttendAvx2<kType, 2>(shape, task, rows);
  return AttendAvx2<kType, 1>(shape, task, rows);
}

template <typename Rows>
void Attend(const Shape& shape, const Task& task, const Rows& rows, DType dtype) {
  if (KernelIsa() < Isa::kAvx2) return AttendPortable(shape, task, rows, dtype);
  switch (dtype) {
    case DType::kF32:
      return AttendAvx2Grouped<DType::kF32>(shape, task, rows);
    case DType::kF16:
      return AttendAvx2Grouped<DType::kF16>(shape, task, rows);
    case DType::kBF16:
      return AttendAvx2Grouped<DType::kBF16>(shape, task, rows);
  }
}

absl::Status CheckShape(int32_t num_q_heads, int32_t head_dim) {
  if (num_q_heads > kMaxQHeads || head_dim > kMaxAttentionHeadDim) {
    return absl::InvalidArgumentError(
        fmt::format("decode supports up to {} query heads and head_dim {} (got {} and {})",
                    kMaxQHeads, kMaxAttentionHeadDim, num_q_heads, head_dim));
  }
  return absl::OkStatus();
}

// Splits every sequence into token ranges, runs them over the pool, and merges each sequence's
// partial states into `out`. `rows_of(s)` gives sequence s's row source.
template <typename RowsOf>
void RunDecode(const Shape& shape, int32_t num_seqs, const int32_t* lens, const float* q,
               float* out, float scale, ThreadPool* threads, const RowsOf& rows_of, DType dtype) {
  const int q_heads = shape.q_heads();
  const int dim = shape.dim;
  // Enough ranges to keep every thread busy twice over, none shorter than kMinSplit tokens.
  int64_t total = 0;
  for (int32_t s = 0; s < num_seqs; ++s) total += lens[s];
  const int64_t want = 2 * (threads != nullptr ? threads->threads() : 1);
  const int64_t split = std::max<int64_t>(kMinSplit, (total / want + kChunk - 1) / kChunk * kChunk);
  struct Range {
    int32_t seq;
    int64_t begin, end;
  };
  std::vector<Range> ranges;
  std::vector<int32_t> first_range(static_cast<size_t>(num_seqs) + 1);
  for (int32_t s = 0; s < num_seqs; ++s) {
    first_range[s] = static_cast<int32_t>(ranges.size());
    for (int64_t b = 0; b < lens[s]; b += split)
      ranges.push_back({s, b, std::min<int64_t>(lens[s], b + split)});
  }
  first_range[num_seqs] = static_cast<int32_t>(ranges.size());
  // Partial state per range: m[q_heads], l[q_heads], acc[q_heads][dim].
  const int64_t stride = static_cast<int64_t>(q_heads) * (dim + 2);
  // Reused across calls (no allocation in steady state). Workers must use the caller's copy,
  // hence the reference: inside the lambda the thread_local name would be their own.
  thread_local std::vector<float> scratch;
  std::vector<float>& partials = scratch;
  partials.assign(static_cast<size_t>(stride) * ranges.size(), 0.0f);
  auto run = [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const Range& range = ranges[r];
      float* m = partials.data() + r * stride;
      float* l = m + q_heads;
      std::fill(m, m + q_heads, -std::numeric_limits<float>::infinity());
      const Task task{q + static_cast<int64_t>(range.seq) * q_heads * dim,
                      scale,
                      range.begin,
                      range.end,
                      m,
                      l,
                      l + q_heads};
      Attend(shape, task, rows_of(range.seq), dtype);
    }
  };
  if (threads == nullptr) {
    run(0, static_cast<int64_t>(ranges.size()));
  } else {
    threads->ParallelFor(static_cast<int64_t>(ranges.size()), 1, run);
  }
  // Merge: out = sum_r acc_r * e^(m_r - M) / sum_r l_r * e^(m_r - M).
  for (int32_t s = 0; s < num_seqs; ++s) {
    for (int h = 0; h < q_heads; ++h) {
      float max = -std::numeric_limits<float>::infinity();
      for (int32_t r = first_range[s]; r < first_range[s + 1]; ++r) {
        max = std::max(max, partials[r * stride + h]);
      }
      float* o = out + (static_cast<int64_t>(s) * q_heads + h) * dim;
      std::fill(o, o + dim, 0.0f);
      float denom = 0;
      for (int32_t r = first_range[s]; r < first_range[s + 1]; ++r) {
        const float* m = partials.data() + r * stride;
        const float w = std::exp(m[h] - max);
        denom += m[q_heads + h] * w;
        const float* acc = m + 2 * q_heads + h * dim;
        for (int d = 0; d < dim; ++d) o[d] += acc[d] * w;
      }
      const float inv = 1.0f / denom;
      for (int d = 0; d < dim; ++d) o[d] *= inv;
    }
  }
}

}  // namespace

bool UsingAvx2() { return KernelIsa() >= Isa::kAvx2; }

absl::Status PagedAttentionDecode(const KvPoolView& pool, const DecodeArgs& a,
                                  ThreadPool* threads) {
  if (absl::Status s = ValidateDecode(pool, a); !s.ok()) return s;
  const PoolLayout& l = pool.layout;
  if (absl::Status s = CheckShape(a.num_q_heads, l.head_dim); !s.ok()) return s;
  // Every length and every block the sequences reach must be valid before anything runs.
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t len = a.seq_lens[s];
    if (len < 1 || len > a.max_seq_len) {
      return absl::InvalidArgumentError(fmt::format(
          "PagedAttentionDecode: sequence {} length {} outside [1, {}]", s, len, a.max_seq_len));
    }
    const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.table_stride;
    for (int32_t b = 0; b < (len + l.block_size - 1) / l.block_size; ++b) {
      if (table[b] < 0 || table[b] >= l.num_blocks) {
        return absl::InvalidArgumentError(
            fmt::format("PagedAttentionDecode: sequence {} block {} is {} (pool has {})", s, b,
                        table[b], l.num_blocks));
      }
    }
  }
  const Shape shape{l.num_kv_heads, a.num_q_heads / l.num_kv_heads, l.head_dim};
  RunDecode(
      shape, a.num_seqs, a.seq_lens, a.q, a.out, a.scale, threads,
      [&](int32_t s) {
        return PagedRows{&pool, a.block_tables + static_cast<int64_t>(s) * a.table_stride, a.layer};
      },
      l.dtype);
  return absl::OkStatus();
}

absl::Status DenseAttentionDecode(const DenseDecodeArgs& a, ThreadPool* threads) {
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || a.head_dim % 8 != 0 ||
      a.head_dim <= 0) {
    return absl::InvalidArgumentError("DenseAttentionDecode: bad head shape");
  }
  if (absl::Status s = CheckShape(a.num_q_heads, a.head_dim); !s.ok()) return s;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    if (a.seq_lens[s] < 1)
      return absl::InvalidArgumentError("DenseAttentionDecode: empty sequence");
  }
  const Shape shape{a.num_kv_heads, a.num_q_heads / a.num_kv_heads, a.head_dim};
  const int64_t row = static_cast<int64_t>(a.num_kv_heads) * a.head_dim * DTypeSize(a.dtype);
  RunDecode(
      shape, a.num_seqs, a.seq_lens, a.q, a.out, a.scale, threads,
      [&](int32_t s) {
        return DenseRows{static_cast<const char*>(a.k[s]), static_cast<const char*>(a.v[s]), row};
      },
      a.dtype);
  return absl::OkStatus();
}

}  // namespace kvpool::kernels::cpu
