// CPU kernels other than decode attention (cpu_attention.cc): KV scatter, block copy and fill,
// and the double-precision reference attention.

#include "kernels/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fmt/format.h"
#include "kernels/validate.h"

namespace kvpool::kernels::cpu {
namespace {

absl::Status BlockOutOfRange(std::string_view kernel, int64_t block, int32_t num_blocks) {
  return absl::InvalidArgumentError(
      fmt::format("{}: block {} outside [0, {})", kernel, block, num_blocks));
}

}  // namespace

absl::Status WriteKv(const KvPoolView& pool, const WriteKvArgs& a) {
  if (absl::Status s = ValidateWriteKv(pool, a); !s.ok()) return s;
  const PoolLayout& l = pool.layout;
  const int64_t capacity = static_cast<int64_t>(l.num_blocks) * l.block_size;
  for (int32_t i = 0; i < a.num_tokens; ++i) {  // check every slot before writing any
    if (a.slots[i] >= capacity)
      return BlockOutOfRange("WriteKv", a.slots[i] / l.block_size, l.num_blocks);
  }
  const int64_t row = l.row_bytes();
  const char* k = static_cast<const char*>(a.k);
  const char* v = static_cast<const char*>(a.v);
  for (int32_t i = 0; i < a.num_tokens; ++i) {
    const int64_t slot = a.slots[i];
    if (slot < 0) continue;  // padding
    const int32_t block = static_cast<int32_t>(slot / l.block_size);
    const int64_t offset = (slot % l.block_size) * row;
    std::memcpy(pool.k(block, a.layer) + offset, k + i * row, static_cast<size_t>(row));
    std::memcpy(pool.v(block, a.layer) + offset, v + i * row, static_cast<size_t>(row));
  }
  return absl::OkStatus();
}

absl::Status CopyBlocks(const KvPoolView& pool, const CopyBlocksArgs& a) {
  if (absl::Status s = ValidateCopyBlocks(pool, a); !s.ok()) return s;
  const int32_t n = pool.layout.num_blocks;
  for (int32_t i = 0; i < 2 * a.num_pairs; ++i) {
    if (a.pairs[i] < 0 || a.pairs[i] >= n) return BlockOutOfRange("CopyBlocks", a.pairs[i], n);
  }
  const int64_t bytes = pool.layout.block_bytes();
  for (int32_t i = 0; i < a.num_pairs; ++i) {
    const int32_t src = a.pairs[2 * i];
    const int32_t dst = a.pairs[2 * i + 1];
    if (src != dst) std::memcpy(pool.k(dst, 0), pool.k(src, 0), static_cast<size_t>(bytes));
  }
  return absl::OkStatus();
}

absl::Status FillBlocks(const KvPoolView& pool, const FillBlocksArgs& a) {
  if (absl::Status s = ValidateFillBlocks(pool, a); !s.ok()) return s;
  const int32_t n = pool.layout.num_blocks;
  for (int32_t i = 0; i < a.num_blocks; ++i) {
    if (a.blocks[i] < 0 || a.blocks[i] >= n) return BlockOutOfRange("FillBlocks", a.blocks[i], n);
  }
  const int64_t bytes = pool.layout.block_bytes();
  // The poison pattern of the dtype, repeated over a 4-byte word.
  uint32_t word = 0;
  if (a.pattern == FillPattern::kPoison) {
    switch (pool.layout.dtype) {
      case DType::kF32:
        word = kPoisonF32;
        break;
      case DType::kF16:
        word = static_cast<uint32_t>(kPoisonF16) * 0x10001u;
        break;
      case DType::kBF16:
        word = static_cast<uint32_t>(kPoisonBF16) * 0x10001u;
        break;
    }
  }
  for (int32_t i = 0; i < a.num_blocks; ++i) {
    char* base = pool.k(a.blocks[i], 0);
    if (word == 0) {
      std::memset(base, 0, static_cast<size_t>(bytes));
    } else {
      uint32_t* words = reinterpret_cast<uint32_t*>(base);
      std::fill(words, words + bytes / 4, word);
    }
  }
  return absl::OkStatus();
}

void ReferenceAttentionDecode(const DenseDecodeArgs& a) {
  const int32_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t dsize = DTypeSize(a.dtype);
  const int64_t row = static_cast<int64_t>(a.num_kv_heads) * a.head_dim * dsize;
  std::vector<double> scores;
  std::vector<double> acc(static_cast<size_t>(a.head_dim));
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const char* k = static_cast<const char*>(a.k[s]);
    const char* v = static_cast<const char*>(a.v[s]);
    const int32_t len = a.seq_lens[s];
    for (int32_t h = 0; h < a.num_q_heads; ++h) {
      const int64_t head = static_cast<int64_t>(h / group) * a.head_dim * dsize;
      const float* q = a.q + (static_cast<int64_t>(s) * a.num_q_heads + h) * a.head_dim;
      scores.assign(static_cast<size_t>(len), 0);
      double max = -INFINITY;
      for (int32_t t = 0; t < len; ++t) {
        double dot = 0;
        for (int32_t d = 0; d < a.head_dim; ++d) {
          dot += static_cast<double>(q[d]) * LoadAsFloat(k + t * row + head + d * dsize, a.dtype);
        }
        scores[t] = dot * a.scale;
        max = std::max(max, scores[t]);
      }
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int32_t t = 0; t < len; ++t) {
        for (int32_t d = 0; d < a.head_dim; ++d) {
          acc[d] += scores[t] * LoadAsFloat(v + t * row + head + d * dsize, a.dtype);
        }
      }
      float* out = a.out + (static_cast<int64_t>(s) * a.num_q_heads + h) * a.head_dim;
      for (int32_t d = 0; d < a.head_dim; ++d) out[d] = static_cast<float>(acc[d] / sum);
    }
  }
}

}  // namespace kvpool::kernels::cpu
