#pragma once

// What the CPU kernel tests and the CUDA parity tests share: random K/V in any dtype, the
// normalized error they hold kernels to, and a paged prefill problem with its reference.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/dtype.h"
#include "kernels/kernel_args.h"
#include "kernels/pool_layout.h"

namespace kvpool::kernels::test_util {

// `count` standard-normal values stored in `dtype`, as raw bytes.
inline std::vector<char> RandomValues(int64_t count, DType dtype, std::mt19937* rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<char> out(static_cast<size_t>(count * DTypeSize(dtype)));
  for (int64_t i = 0; i < count; ++i) {
    const float f = dist(*rng);
    switch (dtype) {
      case DType::kF32:
        std::memcpy(out.data() + i * 4, &f, 4);
        break;
      case DType::kF16: {
        const uint16_t h = FloatToF16(f);
        std::memcpy(out.data() + i * 2, &h, 2);
        break;
      }
      case DType::kBF16: {
        const uint16_t h = FloatToBF16(f);
        std::memcpy(out.data() + i * 2, &h, 2);
        break;
      }
    }
  }
  return out;
}

// max |a - b| / max |b|, and whether any value is NaN.
inline double NormalizedError(const std::vector<float>& a, const std::vector<float>& b, bool* nan) {
  double diff = 0, scale = 0;
  *nan = false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) *nan = true;
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

// A prefill over a paged pool in host memory: sequence s holds shapes[s].first reused tokens and
// shapes[s].second new ones (all written, in shuffled blocks of layer num_layers - 1; every other
// byte of the arena is NaN), and the new tokens' queries.
struct PrefillProblem {
  PrefillProblem(PoolLayout shape, int32_t q_heads,
                 const std::vector<std::pair<int32_t, int32_t>>& shapes, uint32_t seed)
      : layout(shape), num_q_heads(q_heads) {
    std::mt19937 rng(seed);
    const int32_t bs = layout.block_size;
    const auto num_seqs = static_cast<int32_t>(shapes.size());
    q_starts.push_back(0);
    for (const auto& [reused, fresh] : shapes) {
      seq_lens.push_back(reused + fresh);
      q_starts.push_back(q_starts.back() + fresh);
      stride = std::max(stride, (reused + fresh + bs - 1) / bs);
      max_q_len = std::max(max_q_len, fresh);
      max_seq_len = std::max(max_seq_len, reused + fresh);
      layout.num_blocks += (reused + fresh + bs - 1) / bs;
    }
    layout.num_blocks += 3;
    arena.assign(static_cast<size_t>(layout.arena_bytes()), 0);
    for (size_t i = 0; i + 4 <= arena.size(); i += 4) std::memcpy(&arena[i], &kPoisonF32, 4);
    if (layout.dtype != DType::kF32) {
      const uint16_t poison = layout.dtype == DType::kF16 ? kPoisonF16 : kPoisonBF16;
      for (size_t i = 0; i + 2 <= arena.size(); i += 2) std::memcpy(&arena[i], &poison, 2);
    }
    std::vector<int32_t> ids(static_cast<size_t>(layout.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.assign(static_cast<size_t>(num_seqs) * stride, 0);
    const int64_t row = layout.row_bytes();
    const int64_t row_values = static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim;
    const int32_t layer = layout.num_layers - 1;
    size_t next = 0;
    for (int32_t s = 0; s < num_seqs; ++s) {
      const int32_t len = seq_lens[static_cast<size_t>(s)];
      dense_k.push_back(RandomValues(len * row_values, layout.dtype, &rng));
      dense_v.push_back(RandomValues(len * row_values, layout.dtype, &rng));
      int32_t* table = &tables[static_cast<size_t>(s) * stride];
      for (int32_t t = 0; t < len; ++t) {
        if (t % bs == 0) table[t / bs] = ids[next++];
        const int64_t offset = (t % bs) * row;
        std::memcpy(pool().k(table[t / bs], layer) + offset, dense_k.back().data() + t * row,
                    static_cast<size_t>(row));
        std::memcpy(pool().v(table[t / bs], layer) + offset, dense_v.back().data() + t * row,
                    static_cast<size_t>(row));
      }
    }
    q.resize(static_cast<size_t>(q_starts.back()) * num_q_heads * layout.head_dim);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (float& x : q) x = dist(rng);
  }

  KvPoolView pool() { return {arena.data(), layout}; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(layout.head_dim)); }

  // The arguments over this host memory, writing `out` (no workspace).
  PrefillArgs Args(float* out) const {
    return {.layer = layout.num_layers - 1,
            .num_seqs = static_cast<int32_t>(seq_lens.size()),
            .num_q_heads = num_q_heads,
            .scale = scale(),
            .q = q.data(),
            .out = out,
            .q_starts = q_starts.data(),
            .block_tables = tables.data(),
            .table_stride = stride,
            .seq_lens = seq_lens.data(),
            .max_seq_len = max_seq_len,
            .max_q_len = max_q_len};
  }

  // The double-precision reference: query i of sequence s as a sequence of its own over the
  // first seq_lens[s] - q_len(s) + i + 1 tokens of s's contiguous K/V.
  std::vector<float> Reference() const {
    std::vector<const void*> k, v;
    std::vector<int32_t> lens;
    for (size_t s = 0; s < seq_lens.size(); ++s) {
      const int32_t q_len = q_starts[s + 1] - q_starts[s];
      for (int32_t i = 0; i < q_len; ++i) {
        k.push_back(dense_k[s].data());
        v.push_back(dense_v[s].data());
        lens.push_back(seq_lens[s] - q_len + i + 1);
      }
    }
    std::vector<float> out(q.size(), -1);
    cpu::ReferenceAttentionDecode({.num_seqs = static_cast<int32_t>(lens.size()),
                                   .num_q_heads = num_q_heads,
                                   .num_kv_heads = layout.num_kv_heads,
                                   .head_dim = layout.head_dim,
                                   .dtype = layout.dtype,
                                   .scale = scale(),
                                   .q = q.data(),
                                   .out = out.data(),
                                   .k = k.data(),
                                   .v = v.data(),
                                   .seq_lens = lens.data()});
    return out;
  }

  PoolLayout layout;
  int32_t num_q_heads;
  std::vector<char> arena;
  std::vector<int32_t> tables;  // [num_seqs][stride]
  int32_t stride = 0;
  std::vector<int32_t> q_starts, seq_lens;
  int32_t max_q_len = 0, max_seq_len = 0;
  std::vector<std::vector<char>> dense_k, dense_v;  // per sequence [len][kv_heads][head_dim]
  std::vector<float> q;                             // [total queries][num_q_heads][head_dim]
};

}  // namespace kvpool::kernels::test_util
