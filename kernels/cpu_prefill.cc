// CPU prefill attention: the new tokens of each sequence against its paged K/V, causal, in
// tiles (internal/prefill_tile.h). A task is (sequence, KV head, slice of that head's query
// heads, tile of query tokens); its rows are every (token, head) pair of the tile, so each K/V
// element a task gathers serves all of them. Tasks are numbered like a grid, latest tiles first
// (they see the most keys), and taken dynamically by the thread pool; each worker has its own
// slice of the caller's workspace.

#include <algorithm>
#include <cstdint>

#include "fmt/format.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "kernels/internal/prefill_tile.h"
#include "kernels/validate.h"

namespace kvpool::kernels::cpu {
namespace {

using internal::kPrefillRows;

constexpr int64_t kAlign = 64;

int64_t WorkerBytes(int32_t head_dim) {
  return (internal::PrefillScratchFloats(head_dim) * 4 + kAlign - 1) / kAlign * kAlign;
}

internal::PrefillTaskFn TaskFn(DType k_dtype, DType v_dtype) {
  switch (KernelIsa()) {
    case Isa::kAvx512:
      return internal::PrefillTaskAvx512(k_dtype, v_dtype);
    case Isa::kAvx2:
      return internal::PrefillTaskAvx2(k_dtype, v_dtype);
    case Isa::kPortable:
      return internal::PrefillTaskPortable(k_dtype, v_dtype);
  }
  return nullptr;
}

// What the host can check of every sequence before anything runs: ordered q_starts, lengths in
// range, every block the sequence reaches inside the pool.
absl::Status CheckSequences(const KvPoolView& pool, const PrefillArgs& a) {
  const LayerLayout layer = pool.layout.Layer(a.layer);
  if (a.q_starts[0] < 0) {
    return absl::InvalidArgumentError("PagedAttentionPrefill: q_starts[0] is negative");
  }
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = static_cast<int64_t>(a.q_starts[s + 1]) - a.q_starts[s];
    const int32_t len = a.seq_lens[s];
    if (q_len < 0 || q_len > a.max_q_len) {
      return absl::InvalidArgumentError(
          fmt::format("PagedAttentionPrefill: sequence {} has {} queries (max_q_len {})", s, q_len,
                      a.max_q_len));
    }
    if (len < std::max<int64_t>(q_len, 1) || len > a.max_seq_len) {
      return absl::InvalidArgumentError(
          fmt::format("PagedAttentionPrefill: sequence {} length {} outside [max({}, 1), {}]", s,
                      len, q_len, a.max_seq_len));
    }
    const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.table_stride;
    if (absl::Status bad = CheckVisibleBlocks("PagedAttentionPrefill", s, table, layer, a.window,
                                              len - q_len, len);
        !bad.ok()) {
      return bad;
    }
  }
  return absl::OkStatus();
}

// The task grid: (tile, sequence, KV head, head slice), tiles of `tokens` query tokens and
// `heads` query heads.
struct Grid {
  int32_t heads;   // query heads per task
  int32_t slices;  // head slices per KV head
  int32_t tokens;  // query tokens per tile
  int32_t tiles;   // tiles of the longest sequence
  int64_t size(int32_t num_seqs, int32_t kv_heads) const {
    return static_cast<int64_t>(tiles) * num_seqs * kv_heads * slices;
  }
};

Grid MakeGrid(int32_t group, int32_t max_q_len) {
  Grid g;
  g.heads = std::min(group, kPrefillRows);
  g.slices = (group + g.heads - 1) / g.heads;
  g.tokens = kPrefillRows / g.heads;
  g.tiles = (max_q_len + g.tokens - 1) / g.tokens;
  return g;
}

}  // namespace

int64_t PrefillWorkspaceBytes(const PoolLayout& layout, int threads) {
  return kAlign + static_cast<int64_t>(std::max(threads, 1)) * WorkerBytes(layout.head_dim);
}

absl::Status PagedAttentionPrefill(const KvPoolView& pool, const PrefillArgs& a,
                                   ThreadPool* threads) {
  const int workers = threads != nullptr ? threads->threads() : 1;
  const PoolLayout& l = pool.layout;
  if (absl::Status s = ValidatePrefill(pool, a, PrefillWorkspaceBytes(l, workers)); !s.ok()) {
    return s;
  }
  if (a.num_seqs == 0) return absl::OkStatus();
  if (l.head_dim > kMaxAttentionHeadDim) {
    return absl::InvalidArgumentError(
        fmt::format("PagedAttentionPrefill: head_dim {} > {}", l.head_dim, kMaxAttentionHeadDim));
  }
  if (absl::Status s = CheckSequences(pool, a); !s.ok()) return s;

  const int32_t group = a.num_q_heads / l.num_kv_heads;
  const Grid grid = MakeGrid(group, a.max_q_len);
  const int64_t q_stride = static_cast<int64_t>(a.num_q_heads) * l.head_dim;
  const KvLayerView view = pool.Layer(a.layer);
  const internal::PrefillTaskFn run = TaskFn(view.l.k_dtype, view.l.v_dtype);
  auto* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(a.workspace) + kAlign - 1) /
                                       kAlign * kAlign);
  const int64_t per_tile = static_cast<int64_t>(a.num_seqs) * l.num_kv_heads * grid.slices;
  auto body = [&](int worker, int64_t begin, int64_t end) {
    float* scratch = reinterpret_cast<float*>(base + worker * WorkerBytes(l.head_dim));
    for (int64_t i = begin; i < end; ++i) {
      // Latest tiles first: they see the most keys.
      const int32_t tile = grid.tiles - 1 - static_cast<int32_t>(i / per_tile);
      int64_t rest = i % per_tile;
      const int32_t slice = static_cast<int32_t>(rest % grid.slices);
      rest /= grid.slices;
      const int32_t kv_head = static_cast<int32_t>(rest % l.num_kv_heads);
      const int32_t s = static_cast<int32_t>(rest / l.num_kv_heads);
      const int32_t q_len = a.q_starts[s + 1] - a.q_starts[s];
      const int32_t first = tile * grid.tokens;
      if (first >= q_len) continue;
      const int32_t head0 = kv_head * group + slice * grid.heads;
      const int64_t row = static_cast<int64_t>(a.q_starts[s]) + first;
      const int64_t offset = row * q_stride + static_cast<int64_t>(head0) * l.head_dim;
      run({.view = &view,
           .table = a.block_tables + static_cast<int64_t>(s) * a.table_stride,
           .kv_head = kv_head,
           .heads = std::min(grid.heads, (kv_head + 1) * group - head0),
           .tokens = std::min(grid.tokens, q_len - first),
           .first_pos = static_cast<int64_t>(a.seq_lens[s]) - q_len + first,
           .q = a.q + offset,
           .out = a.out + offset,
           .q_stride = q_stride,
           .scale = a.scale,
           .window = a.window,
           .scratch = scratch});
    }
  };
  const int64_t n = grid.size(a.num_seqs, l.num_kv_heads);
  if (threads == nullptr) {
    body(0, 0, n);
  } else {
    threads->ParallelForWorker(n, 1, body);
  }
  return absl::OkStatus();
}

}  // namespace kvpool::kernels::cpu
