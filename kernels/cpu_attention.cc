// CPU decode attention: one query token per sequence against its K/V, grouped-query.
//
// A task is (sequence, range of tokens) over every KV head (internal/decode_tile.h: whole K/V
// rows in order, chunks with an online softmax). Long sequences are split into several ranges
// (flash-decoding) so every core has work even at batch 1; each range leaves a partial softmax
// state (max, sum, weighted values) that a final pass merges. The paged and dense variants differ
// only in how a chunk's row pointers are found.
//
// The task runs on the widest instruction set the processor has (kernels/cpu_isa.h): AVX-512
// where head_dim is a multiple of 16 (with VNNI, VBMI and BF16 for an 8-bit side where the
// processor has them: decode_vnni.cc), else AVX2 + FMA + F16C, else portable C++.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fmt/format.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "kernels/internal/decode_tile.h"
#include "kernels/validate.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::kernels::cpu {
namespace {

using internal::DecodeShape;
using internal::DecodeTask;
using internal::DenseRows;
using internal::kDecodeChunk;
using internal::kMaxDecodeQHeads;
using internal::PagedRows;

constexpr int64_t kMinSplit = 256;  // tokens per task at least (splitting has a merge cost)

internal::DecodeFns DecodeFnsFor(int dim) {
  switch (KernelIsa()) {
    case Isa::kAvx512:
      if (dim % 16 != 0) return internal::DecodeAvx2();
      return KernelAvx512Vnni() ? internal::DecodeAvx512Vnni() : internal::DecodeAvx512();
    case Isa::kAvx2:
      return internal::DecodeAvx2();
    case Isa::kPortable:
      return internal::DecodePortable();
  }
  return internal::DecodePortable();
}

// K and V dtypes of a decode.
struct KvDTypes {
  DType k, v;
};

void Attend(const internal::DecodeFns& fns, const DecodeShape& shape, const DecodeTask& task,
            const PagedRows& rows, KvDTypes dtypes) {
  fns.paged(shape, task, rows, dtypes.k, dtypes.v);
}

void Attend(const internal::DecodeFns& fns, const DecodeShape& shape, const DecodeTask& task,
            const DenseRows& rows, KvDTypes dtypes) {
  fns.dense(shape, task, rows, dtypes.k, dtypes.v);
}

absl::Status CheckShape(int32_t num_q_heads, int32_t head_dim) {
  return CheckAttentionShape(num_q_heads, head_dim);
}

// Merges each sequence's partial states (per range r: m[q_heads], l[q_heads], acc[q_heads][dim],
// `stride` floats apart; sequence s owns ranges [first_range[s], first_range[s + 1])) into its
// rows of `out`: out = sum_r acc_r * e^(m_r - M) / sum_r l_r * e^(m_r - M).
void MergePartials(int32_t num_seqs, int q_heads, int dim, const int32_t* first_range,
                   const float* partials, int64_t stride, float* out) {
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
        const float* m = partials + r * stride;
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

// Splits the keys each sequence's query sees (its window and sinks: at most two spans) into token
// ranges, runs them over the pool, and merges each sequence's partial states into `out`.
// `rows_of(s)` gives sequence s's row source.
template <typename RowsOf>
void RunDecode(const DecodeShape& shape, int32_t num_seqs, const int32_t* lens, const float* q,
               float* out, float scale, ThreadPool* threads, const RowsOf& rows_of, KvDTypes dtypes,
               AttentionWindow window = {}) {
  const int q_heads = shape.q_heads();
  const int dim = shape.dim;
  const internal::DecodeFns fns = DecodeFnsFor(dim);
  auto spans_of = [&](int32_t s) {
    const int64_t pos = lens[s] - 1;
    return std::array<std::pair<int64_t, int64_t>, 2>{
        {{0, window.SinkEnd(pos)}, {window.Start(pos), lens[s]}}};
  };
  // Enough ranges to keep every thread busy twice over, none shorter than kMinSplit tokens.
  int64_t total = 0;
  for (int32_t s = 0; s < num_seqs; ++s) {
    for (auto [begin, end] : spans_of(s)) total += std::max<int64_t>(end - begin, 0);
  }
  const int64_t want = 2 * (threads != nullptr ? threads->threads() : 1);
  const int64_t split =
      std::max<int64_t>(kMinSplit, (total / want + kDecodeChunk - 1) / kDecodeChunk * kDecodeChunk);
  struct Range {
    int32_t seq;
    int64_t begin, end;
  };
  std::vector<Range> ranges;
  std::vector<int32_t> first_range(static_cast<size_t>(num_seqs) + 1);
  for (int32_t s = 0; s < num_seqs; ++s) {
    first_range[s] = static_cast<int32_t>(ranges.size());
    for (auto [begin, end] : spans_of(s)) {
      for (int64_t b = begin; b < end; b += split)
        ranges.push_back({s, b, std::min<int64_t>(end, b + split)});
    }
  }
  first_range[num_seqs] = static_cast<int32_t>(ranges.size());
  // Partial state per range: m[q_heads], l[q_heads], acc[q_heads][dim].
  const int64_t stride = static_cast<int64_t>(q_heads) * (dim + 2);
  // Reused across calls (no allocation in steady state). Workers must use the caller's copy,
  // hence the reference: inside the lambda the thread_local name would be their own.
  thread_local std::vector<float> scratch;
  std::vector<float>& partials = scratch;
  partials.assign(static_cast<size_t>(stride) * ranges.size(), 0.0f);
  // The query each sequence's tasks score K with, where the set converts it first (once per
  // sequence and step, not once per task).
  const int64_t prepared_bytes =
      fns.prepared_bytes != nullptr ? fns.prepared_bytes(shape, dtypes.k) : 0;
  thread_local std::vector<char> prepared_scratch;
  std::vector<char>& prepared = prepared_scratch;
  prepared.resize(static_cast<size_t>(prepared_bytes) * num_seqs);
  for (int32_t s = 0; s < num_seqs && prepared_bytes > 0; ++s) {
    fns.prepare(shape, dtypes.k, q + static_cast<int64_t>(s) * q_heads * dim, scale,
                prepared.data() + s * prepared_bytes);
  }
  auto run = [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const Range& range = ranges[r];
      float* m = partials.data() + r * stride;
      float* l = m + q_heads;
      std::fill(m, m + q_heads, -std::numeric_limits<float>::infinity());
      const DecodeTask task{
          q + static_cast<int64_t>(range.seq) * q_heads * dim,
          prepared_bytes > 0 ? prepared.data() + range.seq * prepared_bytes : nullptr,
          scale,
          range.begin,
          range.end,
          m,
          l,
          l + q_heads};
      Attend(fns, shape, task, rows_of(range.seq), dtypes);
    }
  };
  if (threads == nullptr) {
    run(0, static_cast<int64_t>(ranges.size()));
  } else {
    threads->ParallelFor(static_cast<int64_t>(ranges.size()), 1, run);
  }
  MergePartials(num_seqs, q_heads, dim, first_range.data(), partials.data(), stride, out);
}

}  // namespace

absl::Status CheckAttentionShape(int32_t num_q_heads, int32_t head_dim) {
  if (num_q_heads > kMaxDecodeQHeads || head_dim > kMaxAttentionHeadDim) {
    return absl::InvalidArgumentError(
        fmt::format("the CPU attention kernels serve up to {} query heads and head_dim {} (got {} "
                    "and {})",
                    kMaxDecodeQHeads, kMaxAttentionHeadDim, num_q_heads, head_dim));
  }
  return absl::OkStatus();
}

bool UsingAvx2() { return KernelIsa() >= Isa::kAvx2; }

absl::Status PagedAttentionDecode(const KvPoolView& pool, const DecodeArgs& a,
                                  ThreadPool* threads) {
  if (absl::Status s = ValidateDecode(pool, a); !s.ok()) return s;
  const PoolLayout& l = pool.layout;
  if (absl::Status s = CheckShape(a.num_q_heads, l.head_dim); !s.ok()) return s;
  // Every length and every block the sequences reach must be valid before anything runs.
  const LayerLayout layer = l.Layer(a.layer);
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t len = a.seq_lens[s];
    if (len < 1 || len > a.max_seq_len) {
      return absl::InvalidArgumentError(fmt::format(
          "PagedAttentionDecode: sequence {} length {} outside [1, {}]", s, len, a.max_seq_len));
    }
    const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.table_stride;
    KVPOOL_RETURN_IF_ERROR(
        CheckVisibleBlocks("PagedAttentionDecode", s, table, layer, a.window, len - 1, len));
  }
  const DecodeShape shape{l.num_kv_heads, a.num_q_heads / l.num_kv_heads, l.head_dim};
  const KvLayerView view = pool.Layer(a.layer);
  RunDecode(
      shape, a.num_seqs, a.seq_lens, a.q, a.out, a.scale, threads,
      [&](int32_t s) {
        return PagedRows{&view, a.block_tables + static_cast<int64_t>(s) * a.table_stride};
      },
      {view.l.k_dtype, view.l.v_dtype}, a.window);
  return absl::OkStatus();
}

absl::Status DenseAttentionDecode(const DenseDecodeArgs& a, ThreadPool* threads) {
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || a.head_dim % 8 != 0 ||
      a.head_dim <= 0) {
    return absl::InvalidArgumentError("DenseAttentionDecode: bad head shape");
  }
  if (absl::Status s = CheckShape(a.num_q_heads, a.head_dim); !s.ok()) return s;
  if (DTypeHasScales(a.dtype)) {
    return absl::InvalidArgumentError(fmt::format(
        "DenseAttentionDecode: {} needs the scales of a paged block", DTypeName(a.dtype)));
  }
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    if (a.seq_lens[s] < 1)
      return absl::InvalidArgumentError("DenseAttentionDecode: empty sequence");
  }
  const DecodeShape shape{a.num_kv_heads, a.num_q_heads / a.num_kv_heads, a.head_dim};
  const int64_t row = static_cast<int64_t>(a.num_kv_heads) * a.head_dim * DTypeSize(a.dtype);
  RunDecode(
      shape, a.num_seqs, a.seq_lens, a.q, a.out, a.scale, threads,
      [&](int32_t s) {
        return DenseRows{static_cast<const char*>(a.k[s]), static_cast<const char*>(a.v[s]), row};
      },
      {a.dtype, a.dtype});
  return absl::OkStatus();
}

}  // namespace kvpool::kernels::cpu
