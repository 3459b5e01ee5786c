// The decode task (decode_tile.h) for an 8-bit K or V with AVX-512 VNNI, VBMI and BF16
// (cpu_isa.h: KernelAvx512Vnni). The 16- and 32-bit sides run decode_tile.inc's AVX-512 chunks
// as kernels_avx512.cc does (same Ops); the driver (chunks, online softmax, prefetches) is that
// file's too. Only the 8-bit chunks differ: they multiply bytes instead of widened floats, so the
// arithmetic per byte read is a quarter to a half of the f32 path's, which left the 8-bit decode
// no faster than bf16 although it reads half the bytes.
//
// Scores, int8 K: the query is rounded once per step and head to int8 codes of one step
// (decode_tile.h: RoundedQuery). vpdpbusd multiplies unsigned by signed bytes, so the K codes are
// offset to unsigned (k ^ 0x80 = k + 128) and each head's 128 · Σ q codes is subtracted after
// (llama.cpp's q8 dot products do the same). 64 codes per instruction, exact in int32.
// Scores, fp8 K: two vpermi2b lookups (128-entry tables, the code's sign added after) give each
// code's bf16 bits, exact for every e4m3 value subnormals included (the NaN codes are NaN), and
// vdpbf16ps multiplies them with the query rounded to bf16: 32 products per instruction.
// Both: 32 (token, head) dot products at a time, two tokens' half head slices to a vector,
// reduced to two vectors in 42 shuffles and adds, then multiplied by the query step and softmax
// scale and by each token's block scale.
//
// Values: the probabilities of a chunk, times their tokens' block scales (p'), are paired by
// token (two tokens' V codes interleaved per lane):
//   int8 V: p' of each head quantized to 16-bit fixed point against the head's largest |p'| in
//     the chunk (step max |p'| / 32767, an absolute error of at most max |p'| / 65534 per token)
//     and multiplied by the sign-extended codes with vpdpwssd, exact in int32;
//   fp8 V: the codes looked up as bf16 as above and p' rounded to bf16 (a relative error of
//     2^-9, 32 times finer than the format's own 2^-4) for vdpbf16ps.
// A NaN p' (a NaN block scale) makes its head's chunk NaN, as f32 arithmetic would.
//
// Where the two tokens of a lane pair sit in the vectors, the head dimensions come out in lane
// order (4 x 4 blocks of 128-bit lanes transposed); each chunk puts them back as it adds to the
// task's accumulator, so the task's state is the same as the f32 path's.
//
// Prefetches: with a quarter of the arithmetic per byte the chunk loop waits on memory more, and
// without software prefetches it ran four times slower. The next chunk's K rows are fetched into
// L2 while this chunk's keys are scored, its V rows while this chunk's values are summed (each a
// line beside the arithmetic on the same slice of this chunk's rows), so the memory is busy in
// both phases instead of during the scores only (decode_tile.inc prefetches this chunk's V there).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/internal/decode_tile.h"
#include "kernels/internal/immintrin.h"

namespace kvpool::kernels::cpu::internal {
namespace {

// GCC's target pragma, or clang's equivalent (it ignores GCC's).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,"        \
                                                   "avx512vnni,avx512vbmi,avx512bf16,avx2,fma," \
                                                   "f16c"))),                                   \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target( \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx512bf16,avx2,fma,f16c")
#endif

#include "kernels/internal/avx_common.inc"
// The Ops the tiles are written against (they use avx_common.inc).
#include "kernels/internal/avx512_ops.inc"
#include "kernels/internal/decode_tile.inc"

constexpr int kBytes = 64;  // 8-bit codes per vector

// head_dim in whole vectors of codes (the last one masked on loads, zero in the query).
constexpr int CodeBlocks(int dim) { return (dim + kBytes - 1) / kBytes; }

// The load mask of code block b of a head of `dim` codes.
inline __mmask64 BlockMask(int dim, int b) {
  const int rest = dim - b * kBytes;
  return rest >= kBytes ? ~__mmask64{0} : (__mmask64{1} << rest) - 1;
}

// The scores read K in half vectors, two tokens' 32 codes to a vector: head_dim in those halves,
// and the load mask of half h.
constexpr int kHalf = kBytes / 2;
constexpr int CodeHalves(int dim) { return (dim + kHalf - 1) / kHalf; }
inline __mmask32 HalfMask(int dim, int h) {
  const int rest = dim - h * kHalf;
  return rest >= kHalf ? ~__mmask32{0} : (__mmask32{1} << rest) - 1;
}

// The lanes of tokens [first, first + 16) that are among a chunk's n.
inline __mmask16 ChunkMask(int n, int first) {
  const int count = std::clamp(n - first, 0, 16);
  return static_cast<__mmask16>((1u << count) - 1);
}

#include "kernels/internal/vnni_ops.inc"

// ---- the prepared query -----------------------------------------------------------------------
//
// Each half of head_dim (CodeHalves) twice over, as the scores pair two tokens' halves in a
// vector (Dots):
// int8 K: [q_heads][CodeHalves][2][32] codes (zero past head_dim), [q_heads] f32 factors (step *
//   softmax scale), [q_heads] int32 offsets (128 * the head's code sum);
// fp8 K:  [q_heads][CodeHalves][2][32] bf16: half h's values in the order Fp8Lookup's bytes
//   unpack to (unpacklo then unpackhi of 16-byte lanes: dimensions 32h + 16(L % 2) + r, then
//   32h + 16(L % 2) + 8 + r, for lane L and r < 8).

struct Int8Query {
  const int8_t* codes;
  const float* factor;
  const int32_t* offset;
  int stride;  // bytes per head

  Int8Query(const char* p, const DecodeShape& shape)
      : codes(reinterpret_cast<const int8_t*>(p)),
        factor(reinterpret_cast<const float*>(p + int64_t{shape.q_heads()} * Stride(shape))),
        offset(reinterpret_cast<const int32_t*>(factor + shape.q_heads())),
        stride(Stride(shape)) {}
  static int Stride(const DecodeShape& shape) { return CodeHalves(shape.dim) * kBytes; }
  static int64_t Bytes(const DecodeShape& shape) {
    return int64_t{shape.q_heads()} * (Stride(shape) + 8);
  }
};

int64_t Fp8QueryBytes(const DecodeShape& shape) {
  return int64_t{shape.q_heads()} * CodeHalves(shape.dim) * kBytes * 2;
}

int64_t PreparedBytes(const DecodeShape& shape, DType k_dtype) {
  switch (k_dtype) {
    case DType::kInt8:
      return Int8Query::Bytes(shape);
    case DType::kFp8E4M3:
      return Fp8QueryBytes(shape);
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return 0;
  }
  return 0;
}

void PrepareInt8(const DecodeShape& shape, const float* q, float scale, char* out) {
  const int dim = shape.dim;
  const int stride = Int8Query::Stride(shape);
  const int q_heads = shape.q_heads();
  auto* codes = reinterpret_cast<int8_t*>(out);
  char* factors = out + int64_t{q_heads} * stride;
  char* offsets = factors + 4 * q_heads;
  for (int h = 0; h < q_heads; ++h) {
    const float* x = q + int64_t{h} * dim;
    const float step = Int8QueryStep(x, dim);
    int32_t sum = 0;
    for (int half = 0; half < CodeHalves(dim); ++half) {
      for (int e = 0; e < kHalf; ++e) {
        const int d = half * kHalf + e;
        const int8_t c = d < dim ? FloatToInt8(x[d] / step) : 0;
        codes[int64_t{h} * stride + half * kBytes + e] = c;
        codes[int64_t{h} * stride + half * kBytes + kHalf + e] = c;
        sum += c;
      }
    }
    const float factor = step * scale;
    const int32_t offset = 128 * sum;
    std::memcpy(factors + 4 * h, &factor, 4);
    std::memcpy(offsets + 4 * h, &offset, 4);
  }
}

void PrepareFp8(const DecodeShape& shape, const float* q, char* out) {
  const int dim = shape.dim;
  const int halves = CodeHalves(dim);
  for (int h = 0; h < shape.q_heads(); ++h) {
    for (int half = 0; half < halves; ++half) {
      for (int unpack = 0; unpack < 2; ++unpack) {
        for (int e = 0; e < 32; ++e) {
          const int d = half * kHalf + 16 * (e / 8 % 2) + 8 * unpack + e % 8;
          const uint16_t bits = d < dim ? FloatToBF16(q[int64_t{h} * dim + d]) : 0;
          std::memcpy(out + ((int64_t{h} * halves + half) * 64 + unpack * 32 + e) * 2, &bits, 2);
        }
      }
    }
  }
}

void Prepare(const DecodeShape& shape, DType k_dtype, const float* q, float scale, char* out) {
  if (k_dtype == DType::kInt8) PrepareInt8(shape, q, scale, out);
  if (k_dtype == DType::kFp8E4M3) PrepareFp8(shape, q, out);
}

// ---- scores -----------------------------------------------------------------------------------

// Two tokens' K codes of one half of a head slice (rows + offset), in one vector: the first's
// in the low 256 bits. Codes past head_dim are zero.
inline __m512i PairedHalves(const char* a, const char* b, int64_t offset, __mmask32 mask) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(mask, a + offset)),
                            _mm256_maskz_loadu_epi8(mask, b + offset), 1);
}

// 32 raw dot products of kHeads query heads (from q0) with kT = 32 / kHeads tokens' K head
// slices (rows[t] + offset), [head][token] in out[0] then out[1], times the head's factor
// (int8: step and softmax scale) or the softmax scale (fp8). Two tokens share a vector, half a
// head slice each (t and t + 4 of every 8), so each accumulator holds two dot products in its
// two 256-bit halves and 16 accumulators reduce to 32 sums in 42 instructions.
template <DType kK, int kHeads>
inline void Dots(const DecodeShape& shape, const DecodeTask& task, int q0, const char* const* rows,
                 int64_t offset, __m512* out) {
  constexpr int kPairs = 16 / kHeads;
  const int dim = shape.dim;
  const int halves = CodeHalves(dim);
  if constexpr (kK == DType::kInt8) {
    const Int8Query query(task.prepared_q, shape);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i acc[16];
    for (__m512i& a : acc) a = _mm512_setzero_si512();
    for (int h = 0; h < halves; ++h) {
      const __mmask32 mask = HalfMask(dim, h);
      for (int p = 0; p < kPairs; ++p) {
        const int t = p / 4 * 8 + p % 4;
        const __m512i k =
            _mm512_xor_si512(PairedHalves(rows[t], rows[t + 4], offset + h * kHalf, mask), flip);
        for (int j = 0; j < kHeads; ++j) {
          const int8_t* qc = query.codes + int64_t{q0 + j} * query.stride + h * kBytes;
          acc[j * kPairs + p] = Dpbusd(acc[j * kPairs + p], k, _mm512_loadu_si512(qc));
        }
      }
    }
    __m512i sums[2];
    Reduce32(acc, sums);
    constexpr int kTokenBits = kHeads == 4 ? 3 : kHeads == 2 ? 4 : 5;  // log2(32 / kHeads)
    for (int v = 0; v < 2; ++v) {
      // Lane l's head: (16 v + l) / kT.
      const __m512i head = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_set1_epi32(16 * v),
                           _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)),
          kTokenBits);
      const __m512i offsets = _mm512_permutexvar_epi32(
          head, _mm512_maskz_loadu_epi32((1u << kHeads) - 1, query.offset + q0));
      const __m512 factors =
          _mm512_permutexvar_ps(head, _mm512_maskz_loadu_ps((1u << kHeads) - 1, query.factor + q0));
      out[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[v], offsets)), factors);
    }
  } else {
    static_assert(kK == DType::kFp8E4M3);
    const Fp8Lookup lookup;
    const char* query = task.prepared_q;
    __m512 acc[16];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    for (int h = 0; h < halves; ++h) {
      const __mmask32 mask = HalfMask(dim, h);
      for (int p = 0; p < kPairs; ++p) {
        const int t = p / 4 * 8 + p % 4;
        __m512i high, low;
        lookup.Bytes(PairedHalves(rows[t], rows[t + 4], offset + h * kHalf, mask), &high, &low);
        const __m512i w0 = _mm512_unpacklo_epi8(low, high), w1 = _mm512_unpackhi_epi8(low, high);
        for (int j = 0; j < kHeads; ++j) {
          const char* qh = query + (int64_t{q0 + j} * halves + h) * 128;
          acc[j * kPairs + p] = Dpbf16(acc[j * kPairs + p], w0, _mm512_loadu_si512(qh));
          acc[j * kPairs + p] = Dpbf16(acc[j * kPairs + p], w1, _mm512_loadu_si512(qh + 64));
        }
      }
    }
    Reduce32(acc, out);
    for (int v = 0; v < 2; ++v) out[v] = _mm512_mul_ps(out[v], _mm512_set1_ps(task.scale));
  }
}

// Scores of every query head against the chunk's 8-bit keys, kT tokens at a time, each K row
// read whole and in order, the next chunk's K rows prefetched meanwhile (a head's slice of them
// beside each head's scores, as ScoreChunk spreads its prefetches).
template <DType kK, int kHeads>
void ScoreChunk8(const DecodeShape& shape, const DecodeTask& task, const ChunkRows& c,
                 int64_t v_head_bytes, float (*s)[kDecodeChunk]) {
  constexpr int kT = 32 / kHeads;
  const int dim = shape.dim;
  const int group = shape.group;
  for (int i = 0; i < c.n; i += kT) {
    const int valid = std::min(kT, c.n - i);
    const char* rows[kT];
    for (int t = 0; t < kT; ++t) rows[t] = c.k[i + std::min(t, valid - 1)];
    for (int h = 0; h < shape.kv_heads; ++h) {
      for (int r = i; r < std::min(i + valid, c.n_next); ++r) {
        for (int64_t b = int64_t{h} * dim; b < int64_t{h + 1} * dim; b += 64) {
          Ops::PrefetchL2(c.next_k[r] + b);
        }
      }
      for (int g0 = 0; g0 < group; g0 += kHeads) {
        const int q0 = h * group + g0;
        __m512 dots[2];
        Dots<kK, kHeads>(shape, task, q0, rows, int64_t{h} * dim, dots);
        alignas(64) float out[32];
        _mm512_store_ps(out, dots[0]);
        _mm512_store_ps(out + 16, dots[1]);
        for (int j = 0; j < kHeads; ++j) std::copy_n(out + j * kT, kT, &s[q0 + j][i]);
      }
    }
  }
  // Each token's block scale, per KV head, over the whole chunk at once.
  const __mmask16 lo_mask = ChunkMask(c.n, 0), hi_mask = ChunkMask(c.n, 16);
  for (int h = 0; h < shape.kv_heads; ++h) {
    alignas(64) float block_scale[kDecodeChunk] = {};
    for (int i = 0; i < c.n; ++i) block_scale[i] = c.ks[i][h];
    const __m512 lo = _mm512_load_ps(block_scale), hi = _mm512_load_ps(block_scale + 16);
    for (int q = h * group; q < (h + 1) * group; ++q) {
      _mm512_mask_store_ps(s[q], lo_mask, _mm512_mul_ps(_mm512_maskz_load_ps(lo_mask, s[q]), lo));
      _mm512_mask_store_ps(s[q] + 16, hi_mask,
                           _mm512_mul_ps(_mm512_maskz_load_ps(hi_mask, s[q] + 16), hi));
    }
  }
}

// ---- values -----------------------------------------------------------------------------------

// Head q's probabilities (s[0..n)) times their tokens' V scales, two tokens to an int32 lane:
// int8 V as signed 16-bit fixed point of step *step (NaN when any is NaN), fp8 V as bf16.
template <DType kV>
void PairProbabilities(const float* s, const float* v_scale, int n, int32_t* pairs, float* step) {
  static_assert(kDecodeChunk == 32);
  const __mmask16 lo_mask = ChunkMask(n, 0), hi_mask = ChunkMask(n, 16);
  const __m512 p0 =
      _mm512_mul_ps(_mm512_maskz_loadu_ps(lo_mask, s), _mm512_maskz_loadu_ps(lo_mask, v_scale));
  const __m512 p1 = _mm512_mul_ps(_mm512_maskz_loadu_ps(hi_mask, s + 16),
                                  _mm512_maskz_loadu_ps(hi_mask, v_scale + 16));
  if constexpr (kV == DType::kInt8) {
    const bool nan =
        (_mm512_cmp_ps_mask(p0, p0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(p1, p1, _CMP_UNORD_Q)) != 0;
    // The largest magnitude: a negative V scale (WriteKv writes none) makes a negative p'.
    const float max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(p0), _mm512_abs_ps(p1)));
    const __m512 inv = _mm512_set1_ps(max > 0.0f && !nan ? 32767.0f / max : 0.0f);
    const __m256i c0 = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p0, inv)));
    const __m256i c1 = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p1, inv)));
    _mm512_storeu_si512(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1));
    *step = nan ? std::numeric_limits<float>::quiet_NaN() : max / 32767.0f;
  } else {
    static_assert(kV == DType::kFp8E4M3);
    _mm512_storeu_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    *step = 1.0f;
  }
}

// Tokens a and b's V codes paired per lane, as four vectors e[k] whose 128-bit lane L holds
// dimensions 16L + 4k ... 16L + 4k + 3 (LanesToDims): int8 as int16 pairs, fp8 as bf16 pairs.
template <DType kV>
inline void PairCodes(__m512i a, __m512i b, const Fp8Lookup& lookup, __m512i* e) {
  const __m512i c[2] = {_mm512_unpacklo_epi8(a, b), _mm512_unpackhi_epi8(a, b)};
  for (int k = 0; k < 2; ++k) {
    if constexpr (kV == DType::kInt8) {
      // Each byte doubled into a word, then shifted down: the byte sign-extended.
      e[2 * k] = _mm512_srai_epi16(_mm512_unpacklo_epi8(c[k], c[k]), 8);
      e[2 * k + 1] = _mm512_srai_epi16(_mm512_unpackhi_epi8(c[k], c[k]), 8);
    } else {
      __m512i high, low;
      lookup.Bytes(c[k], &high, &low);
      e[2 * k] = _mm512_unpacklo_epi8(low, high);
      e[2 * k + 1] = _mm512_unpackhi_epi8(low, high);
    }
  }
}

// The block's head slice of rows i and i + 1 (the last row twice at an odd end), paired; with
// `prefetch`, the same of the next chunk's rows is fetched into L2 meanwhile (a line each: over
// a chunk's blocks and heads, all of them).
template <DType kV>
inline void PairedRows(const ChunkRows& c, int i, int64_t offset, __mmask64 mask, bool prefetch,
                       const Fp8Lookup& lookup, __m512i* e) {
  if (prefetch) {
    if (i < c.n_next) Ops::PrefetchL2(c.next_v[i] + offset);
    if (i + 1 < c.n_next) Ops::PrefetchL2(c.next_v[i + 1] + offset);
  }
  const char* a = c.v[i] + offset;
  const char* b = c.v[std::min(i + 1, c.n - 1)] + offset;
  PairCodes<kV>(_mm512_maskz_loadu_epi8(mask, a), _mm512_maskz_loadu_epi8(mask, b), lookup, e);
}

// out[0 .. 16 * vectors) += step * (the paired-lane sums `lanes`, in dimension order).
inline void AddLanes(__m512* lanes, float step, int vectors, float* out) {
  __m512 dims[4];
  LanesToDims(lanes, dims);
  const __m512 m = _mm512_set1_ps(step);
  for (int k = 0; k < vectors; ++k) {
    _mm512_storeu_ps(out + 16 * k, _mm512_fmadd_ps(dims[k], m, _mm512_loadu_ps(out + 16 * k)));
  }
}

// acc[q0 + j][code block b's dimensions] += Σ_tokens p'[j] · V[token] (head slice `offset` of
// every row), kHeads heads at a time.
template <DType kV, int kHeads>
inline void ValueBlock(const DecodeShape& shape, const DecodeTask& task, const ChunkRows& c,
                       const int32_t (*pairs)[kDecodeChunk / 2], const float* steps, int q0,
                       int64_t offset, int b, bool prefetch, const Fp8Lookup& lookup) {
  const int dim = shape.dim;
  const __mmask64 mask = BlockMask(dim, b);
  const int vectors = std::min(4, (dim - b * kBytes) / 16);
  offset += b * kBytes;
  __m512 lanes[kHeads][4];
  if constexpr (kV == DType::kInt8) {
    __m512i acc[kHeads][4];
    for (int j = 0; j < kHeads; ++j) {
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_setzero_si512();
    }
    for (int i = 0; i < c.n; i += 2) {
      __m512i e[4];
      PairedRows<kV>(c, i, offset, mask, prefetch, lookup, e);
      for (int j = 0; j < kHeads; ++j) {
        const __m512i w = _mm512_set1_epi32(pairs[q0 + j][i / 2]);
        for (int k = 0; k < 4; ++k) acc[j][k] = Dpwssd(acc[j][k], e[k], w);
      }
    }
    for (int j = 0; j < kHeads; ++j) {
      for (int k = 0; k < 4; ++k) lanes[j][k] = _mm512_cvtepi32_ps(acc[j][k]);
    }
  } else {
    // Not in `lanes` itself: its address is taken below, and GCC then stored every accumulator
    // to the stack on every iteration.
    __m512 acc[kHeads][4];
    for (int j = 0; j < kHeads; ++j) {
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_setzero_ps();
    }
    for (int i = 0; i < c.n; i += 2) {
      __m512i e[4];
      PairedRows<kV>(c, i, offset, mask, prefetch, lookup, e);
      for (int j = 0; j < kHeads; ++j) {
        const __m512i w = _mm512_set1_epi32(pairs[q0 + j][i / 2]);
        for (int k = 0; k < 4; ++k) acc[j][k] = Dpbf16(acc[j][k], e[k], w);
      }
    }
    for (int j = 0; j < kHeads; ++j) {
      for (int k = 0; k < 4; ++k) lanes[j][k] = acc[j][k];
    }
  }
  for (int j = 0; j < kHeads; ++j) {
    AddLanes(lanes[j], steps[q0 + j], vectors, task.acc + int64_t{q0 + j} * dim + b * kBytes);
  }
}

// acc += the chunk's probabilities (in s) times its 8-bit V rows, per KV head and head group,
// per 64 dimensions.
template <DType kV, int kHeads>
void ValueChunk8(const DecodeShape& shape, const DecodeTask& task, const ChunkRows& c,
                 float (*s)[kDecodeChunk]) {
  const int dim = shape.dim;
  const int group = shape.group;
  const Fp8Lookup lookup;
  alignas(64) int32_t pairs[kMaxDecodeQHeads][kDecodeChunk / 2];
  float steps[kMaxDecodeQHeads];
  for (int h = 0; h < shape.kv_heads; ++h) {
    alignas(64) float v_scale[kDecodeChunk] = {};
    for (int i = 0; i < c.n; ++i) v_scale[i] = c.vs[i][h];
    for (int q = h * group; q < (h + 1) * group; ++q) {
      PairProbabilities<kV>(s[q], v_scale, c.n, pairs[q], &steps[q]);
    }
  }
  for (int h = 0; h < shape.kv_heads; ++h) {
    for (int g0 = 0; g0 < group; g0 += kHeads) {
      for (int b = 0; b < CodeBlocks(dim); ++b) {
        ValueBlock<kV, kHeads>(shape, task, c, pairs, steps, h * group + g0, int64_t{h} * dim, b,
                               g0 == 0, lookup);
      }
    }
  }
}

// ---- the task ---------------------------------------------------------------------------------

template <DType kType, int kHeads>
struct Score8Of {
  static constexpr ScoreFn kFn = &ScoreChunk8<kType, kHeads>;
};
template <DType kType, int kHeads>
struct Value8Of {
  static constexpr ValueFn kFn = &ValueChunk8<kType, kHeads>;
};

// The 8-bit chunk function of `dtype` for the widest head-group width (4, 2 or 1) dividing the
// group. REQUIRES: an 8-bit dtype.
template <template <DType, int> class Fn>
auto Chunk8Fn(DType dtype, int group) {
  auto grouped = [group](auto type) {
    constexpr DType kType = decltype(type)::value;
    if (group % 4 == 0) return Fn<kType, 4>::kFn;
    if (group % 2 == 0) return Fn<kType, 2>::kFn;
    return Fn<kType, 1>::kFn;
  };
  return dtype == DType::kInt8 ? grouped(std::integral_constant<DType, DType::kInt8>())
                               : grouped(std::integral_constant<DType, DType::kFp8E4M3>());
}

template <typename Rows>
void DecodeVnni(const DecodeShape& shape, const DecodeTask& task, const Rows& rows, DType k_dtype,
                DType v_dtype) {
  const ScoreFn score = DTypeHasScales(k_dtype) ? Chunk8Fn<Score8Of>(k_dtype, shape.group)
                                                : ChunkFn<ScoreOf>(k_dtype, shape.group);
  const ValueFn value = DTypeHasScales(v_dtype) ? Chunk8Fn<Value8Of>(v_dtype, shape.group)
                                                : ChunkFn<ValueOf>(v_dtype, shape.group);
  DecodeAttend(shape, task, rows, score, value,
               static_cast<int64_t>(shape.dim) * DTypeSize(v_dtype));
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace

DecodeFns DecodeAvx512Vnni() {
  return {&DecodeVnni<PagedRows>, &DecodeVnni<DenseRows>, &PreparedBytes, &Prepare};
}

}  // namespace kvpool::kernels::cpu::internal
