#pragma once

// The inner part of the CPU decode kernel (cpu_attention.cc): one task, a range of one
// sequence's tokens against all its query heads (one query token), walked in chunks of
// kDecodeChunk whole K/V rows ([num_kv_heads][head_dim], contiguous in both the paged and the
// dense layout) in order, which the hardware prefetcher and the TLB follow; each K/V element is
// read once for all the query heads of its group. Per chunk: scores (two tokens x up to four
// heads of a group at a time: eight independent FMA chains), an online softmax with a vector exp,
// then the values. While a chunk's K is scored, its V rows and the next chunk's K rows are
// prefetched into L2. The task leaves a partial softmax state (max, sum, weighted values) that
// the caller merges across the tasks of a sequence.
//
// One implementation (decode_tile.inc), compiled per instruction set beside the prefill tile
// (kernels_{portable,avx2,avx512}.cc) against the same Ops. A chunk's scores are one function
// templated on the K dtype and the head-group width, its values one templated on the V dtype,
// so any K dtype pairs with any V dtype. An 8-bit side's codes are widened unscaled; the scale of
// a token's block and head multiplies its score (K) or its probability (V), once per token and
// head instead of once per value. With AVX-512 VNNI, VBMI and BF16, the 8-bit sides' chunks
// multiply bytes instead (decode_vnni.cc, around the same driver).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/dtype.h"
#include "kernels/pool_layout.h"

namespace kvpool::kernels::cpu::internal {

// Rows per online-softmax step. While a chunk's K is scored, its V and the next chunk's K are
// prefetched into L2: three chunks in flight, 192 KiB at a Llama-3-8B-like layer (2 KiB rows).
// 64-row chunks (384 KiB) overflowed the 512 KiB L2 of the machine this was first tuned on; with
// 2 MiB of L2 (and the prefetches spread over the scores) 32 beats 16.
inline constexpr int kDecodeChunk = 32;
inline constexpr int kMaxDecodeQHeads = 128;  // query heads per sequence

// The shape every task shares.
struct DecodeShape {
  int kv_heads;
  int group;  // query heads per KV head
  int dim;
  int q_heads() const { return kv_heads * group; }
};

// One (sequence, token range) task and where its partial state goes.
struct DecodeTask {
  const float* q;  // [q_heads][dim]
  // The sequence's query as DecodeFns::prepare left it for the K dtype, or null when the set
  // prepares none for that dtype (then the task reads q).
  const char* prepared_q;
  float scale;
  int64_t begin, end;
  float* m;    // [q_heads] running max (-inf before the first chunk)
  float* l;    // [q_heads] running sum of exp (0 before)
  float* acc;  // [q_heads][dim] running weighted values, not yet divided by l (0 before)
};

// Row pointers of a paged sequence: token t lives in block table[t / block_size]. Also each
// row's block scales ([num_kv_heads] f32 after the codes of an 8-bit side; not read otherwise).
struct PagedRows {
  const KvLayerView* view;
  const int32_t* table;

  // One division per call, not two per row (a chunk's rows walk the blocks in order).
  void Get(int64_t t0, int n, const char** k, const char** v, const float** ks,
           const float** vs) const {
    const LayerLayout& l = view->l;
    const int32_t bs = l.block_size;
    int64_t index = t0 / bs;
    int32_t slot = static_cast<int32_t>(t0 - index * bs);
    for (int i = 0; i < n; ++i, ++slot) {
      if (slot == bs) {
        slot = 0;
        ++index;
      }
      const int32_t block = table[index];
      k[i] = view->k(block) + slot * l.k_row_bytes;
      v[i] = view->v(block) + slot * l.v_row_bytes;
      ks[i] = view->k_scales(block);
      vs[i] = view->v_scales(block);
    }
  }
};

// Row pointers of a contiguous sequence (16- and 32-bit dtypes: no scales).
struct DenseRows {
  const char* k;
  const char* v;
  int64_t row;

  void Get(int64_t t0, int n, const char** kp, const char** vp, const float** ks,
           const float** vs) const {
    for (int i = 0; i < n; ++i) {
      kp[i] = k + (t0 + i) * row;
      vp[i] = v + (t0 + i) * row;
      ks[i] = vs[i] = nullptr;
    }
  }
};

// One instruction set's decode task for each row source, K stored as `k_dtype` and V as
// `v_dtype`; and, for the sets that score some K dtype against a converted query (the 8-bit ones
// with AVX-512 VNNI), how that query is made: once per sequence and step, before its tasks run.
struct DecodeFns {
  void (*paged)(const DecodeShape& shape, const DecodeTask& task, const PagedRows& rows,
                DType k_dtype, DType v_dtype);
  void (*dense)(const DecodeShape& shape, const DecodeTask& task, const DenseRows& rows,
                DType k_dtype, DType v_dtype);
  // Bytes of one sequence's prepared query for K stored as `k_dtype`: 0 when the tasks read the
  // f32 query (and `prepare` is not called). Null: 0 for every dtype.
  int64_t (*prepared_bytes)(const DecodeShape& shape, DType k_dtype);
  // Writes prepared_bytes(shape, k_dtype) bytes at `out` (any alignment) from the query q
  // ([q_heads][dim]) and the softmax scale.
  void (*prepare)(const DecodeShape& shape, DType k_dtype, const float* q, float scale, char* out);
};

// How the AVX-512 VNNI set (decode_vnni.cc) rounds the query it scores an 8-bit K with, once per
// step and head: against int8 K to int8 codes, FloatToInt8(x / step) with one step per head,
// Int8QueryStep = max |x| / 127 (vpdpbusd multiplies bytes); against fp8 K each value to bf16
// (vdpbf16ps multiplies bf16 pairs). A head holding a NaN or an infinity has a NaN step, so its
// scores are NaN as its f32 ones would be. RoundedQuery writes the values the scores are then
// exact for (the tests' references use it); the other sets and dtypes score the f32 query.
inline float Int8QueryStep(const float* x, int dim) {
  float absmax = 0;
  for (int d = 0; d < dim; ++d) {
    if (!std::isfinite(x[d])) return std::numeric_limits<float>::quiet_NaN();
    absmax = std::max(absmax, std::abs(x[d]));
  }
  return absmax / 127.0f;
}

inline void RoundedQuery(DType k_dtype, const float* x, int dim, float* out) {
  if (k_dtype == DType::kInt8) {
    const float step = Int8QueryStep(x, dim);
    for (int d = 0; d < dim; ++d) out[d] = static_cast<float>(FloatToInt8(x[d] / step)) * step;
  } else if (k_dtype == DType::kFp8E4M3) {
    for (int d = 0; d < dim; ++d) out[d] = BF16ToFloat(FloatToBF16(x[d]));
  } else {
    std::copy(x, x + dim, out);
  }
}

// REQUIRES: the processor supports the set; AVX-512: head_dim a multiple of 16; AVX-512 VNNI:
// also KernelAvx512Vnni() (cpu_isa.h).
DecodeFns DecodePortable();
DecodeFns DecodeAvx2();
DecodeFns DecodeAvx512();
DecodeFns DecodeAvx512Vnni();

}  // namespace kvpool::kernels::cpu::internal
