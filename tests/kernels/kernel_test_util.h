#pragma once

// What the CPU kernel tests and the CUDA parity tests share: random K/V in any dtype, the
// normalized error they hold kernels to (and each KV format to), reading back what a paged pool
// holds, and a paged prefill problem with its references.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "kernels/dtype.h"
#include "kernels/kernel_args.h"
#include "kernels/pool_layout.h"
#include "kvpool/util/check.h"

namespace kvpool::kernels::test_util {

// A CPU kernel test over a case table whose cases name an instruction set (`Case::isa`): each
// case runs with the kernels limited to it, and is skipped where the processor lacks it.
template <typename Case>
class IsaTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (this->GetParam().isa > cpu::DetectedIsa()) {
      GTEST_SKIP() << "this processor lacks " << cpu::IsaName(this->GetParam().isa);
    }
    cpu::LimitKernelIsaForTesting(this->GetParam().isa);
  }
  void TearDown() override { cpu::LimitKernelIsaForTesting(cpu::Isa::kAvx512); }
};

// One standard-normal value (Box-Muller from two 24-bit uniforms). Not
// std::normal_distribution: libstdc++'s generate_canonical, under it, calls logl on every draw,
// which clang does not fold, and in the sanitizer tree that was 43 % of decode_parity_test.
inline float StandardNormal(std::mt19937* rng) {
  const float u1 = (static_cast<float>((*rng)() >> 8) + 1.0f) * 0x1p-24f;  // (0, 1]
  const float u2 = static_cast<float>((*rng)() >> 8) * 0x1p-24f;           // [0, 1)
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.28318530718f * u2);
}

// `count` standard-normal values stored in `dtype` (16- or 32-bit), as raw bytes.
inline std::vector<char> RandomValues(int64_t count, DType dtype, std::mt19937* rng) {
  std::vector<char> out(static_cast<size_t>(count * DTypeSize(dtype)));
  for (int64_t i = 0; i < count; ++i) {
    const float f = StandardNormal(rng);
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
      case DType::kFp8E4M3:
      case DType::kInt8:
        out[static_cast<size_t>(i)] = 0;  // scaled formats have no unscaled values
        break;
    }
  }
  return out;
}

// `count` standard-normal f32 values.
inline std::vector<float> RandomFloats(int64_t count, std::mt19937* rng) {
  std::vector<float> out(static_cast<size_t>(count));
  for (float& x : out) x = StandardNormal(rng);
  return out;
}

// Raw values of a 16- or 32-bit dtype widened to f32.
inline std::vector<float> Widen(const std::vector<char>& bytes, DType dtype) {
  std::vector<float> out(bytes.size() / static_cast<size_t>(DTypeSize(dtype)));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = LoadAsFloat(bytes.data() + i * static_cast<size_t>(DTypeSize(dtype)), dtype);
  }
  return out;
}

// What the pool holds of tokens [0, len) of a sequence's `layer` K (or V), read back through
// the documented block layout (pool_layout.h) and dequantized: [len][num_kv_heads][head_dim].
inline std::vector<float> StoredRows(const KvPoolView& pool, const int32_t* table, int32_t layer,
                                     KvSide side, int32_t len) {
  const PoolLayout& l = pool.layout;
  const DType dtype = l.kv_dtype(layer, side);
  const int64_t size = DTypeSize(dtype);
  const int64_t row = l.row_bytes(layer, side);
  std::vector<float> out;
  for (int32_t t = 0; t < len; ++t) {
    const int32_t block = table[t / l.block_size];
    const char* chunk = side == KvSide::kK ? pool.k(block, layer) : pool.v(block, layer);
    const char* scales = chunk + l.block_size * row;  // after the codes (8-bit only)
    for (int32_t h = 0; h < l.num_kv_heads; ++h) {
      float scale = 1.0f;
      if (DTypeHasScales(dtype)) std::memcpy(&scale, scales + 4 * h, 4);
      for (int32_t d = 0; d < l.head_dim; ++d) {
        const char* p = chunk + (t % l.block_size) * row + (h * l.head_dim + d) * size;
        out.push_back(LoadAsFloat(p, dtype) * scale);
      }
    }
  }
  return out;
}

// The normalized error each KV dtype is held to against attention over the f32 values it was
// written from (standard-normal K/V, head_dim 64 and 128, contexts up to 513): the format's
// rounding of K and V carried through the softmax. bf16 keeps 8 significant bits, f16 11, fp8
// e4m3 4 (a value's relative error up to 1/16), int8 a step of absmax/127 per block and head.
// The worst errors measured over tests/kernels/kv_dtype_test.cc's cases (decode and prefill,
// every block size and instruction set) were f16 3.7e-4, bf16 3.0e-3, fp8 4.5e-2, int8 9.8e-3;
// the bounds are about twice those.
inline double FormatTolerance(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 2e-5;
    case DType::kF16:
      return 1e-3;
    case DType::kBF16:
      return 6e-3;
    case DType::kFp8E4M3:
      return 8e-2;
    case DType::kInt8:
      return 2e-2;
  }
  return 0;
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
// shapes[s].second new ones (all written through WriteKv from f32 values, in shuffled blocks of
// layer num_layers - 1; every other chunk of the arena is poisoned), and the new tokens' queries.
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
    std::vector<int32_t> ids(static_cast<size_t>(layout.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    KVPOOL_CHECK_OK(cpu::FillBlocks(
        pool(),
        {.num_blocks = layout.num_blocks, .blocks = ids.data(), .pattern = FillPattern::kPoison}));
    std::shuffle(ids.begin(), ids.end(), rng);
    tables.assign(static_cast<size_t>(num_seqs) * stride, 0);
    const int64_t row_values = static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim;
    const int32_t layer = layout.num_layers - 1;
    size_t next = 0;
    for (int32_t s = 0; s < num_seqs; ++s) {
      const int32_t len = seq_lens[static_cast<size_t>(s)];
      original_k.push_back(RandomFloats(len * row_values, &rng));
      original_v.push_back(RandomFloats(len * row_values, &rng));
      int32_t* table = &tables[static_cast<size_t>(s) * stride];
      std::vector<int64_t> slots;
      for (int32_t t = 0; t < len; ++t) {
        if (t % bs == 0) table[t / bs] = ids[next++];
        slots.push_back(int64_t{table[t / bs]} * bs + t % bs);
      }
      KVPOOL_CHECK_OK(cpu::WriteKv(pool(), {.layer = layer,
                                            .num_tokens = len,
                                            .k = original_k.back().data(),
                                            .v = original_v.back().data(),
                                            .slots = slots.data()}));
      dense_k.push_back(StoredRows(pool(), table, layer, KvSide::kK, len));
      dense_v.push_back(StoredRows(pool(), table, layer, KvSide::kV, len));
    }
    q.resize(static_cast<size_t>(q_starts.back()) * num_q_heads * layout.head_dim);
    for (float& x : q) x = StandardNormal(&rng);
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

  // The double-precision reference over what the pool holds: query i of sequence s as a
  // sequence of its own over the first seq_lens[s] - q_len(s) + i + 1 tokens of s.
  std::vector<float> Reference() const { return ReferenceOver(dense_k, dense_v, q); }
  // The same for another query (e.g. the query as a kernel rounds it), same layout as q.
  std::vector<float> Reference(const std::vector<float>& query) const {
    return ReferenceOver(dense_k, dense_v, query);
  }
  // The same over the f32 values the pool was written from (the format's own error included).
  std::vector<float> ReferenceToOriginal() const {
    return ReferenceOver(original_k, original_v, q);
  }

  std::vector<float> ReferenceOver(const std::vector<std::vector<float>>& keys,
                                   const std::vector<std::vector<float>>& values,
                                   const std::vector<float>& query) const {
    std::vector<const void*> k, v;
    std::vector<int32_t> lens;
    for (size_t s = 0; s < seq_lens.size(); ++s) {
      const int32_t q_len = q_starts[s + 1] - q_starts[s];
      for (int32_t i = 0; i < q_len; ++i) {
        k.push_back(keys[s].data());
        v.push_back(values[s].data());
        lens.push_back(seq_lens[s] - q_len + i + 1);
      }
    }
    std::vector<float> out(q.size(), -1);
    cpu::ReferenceAttentionDecode({.num_seqs = static_cast<int32_t>(lens.size()),
                                   .num_q_heads = num_q_heads,
                                   .num_kv_heads = layout.num_kv_heads,
                                   .head_dim = layout.head_dim,
                                   .dtype = DType::kF32,
                                   .scale = scale(),
                                   .q = query.data(),
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
  // Per sequence [len][kv_heads][head_dim]: what WriteKv was given, and what the pool holds.
  std::vector<std::vector<float>> original_k, original_v, dense_k, dense_v;
  std::vector<float> q;  // [total queries][num_q_heads][head_dim]
};

}  // namespace kvpool::kernels::test_util
