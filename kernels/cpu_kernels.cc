// CPU kernels other than attention (cpu_attention.cc, cpu_prefill.cc) and the KV write
// (cpu_write_kv.cc): block copy and fill, and the double-precision reference attention.

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

// Every chunk of the main block at `block` set to its dtype's poison pattern (dtype.h), scales
// NaN (the window layers' chunks are in their own blocks: WindowLayout).
void PoisonBlock(const PoolLayout& layout, char* block) {
  int64_t offset = 0;
  for (int32_t l = 0; l < layout.num_full_layers(); ++l) {
    for (KvSide side : {KvSide::kK, KvSide::kV}) {
      const DType dtype = layout.kv_dtype(l, side);
      const int64_t chunk = layout.chunk_bytes(l, side);
      const int64_t data = layout.block_size * layout.row_bytes(l, side);
      char* p = block + offset;
      switch (dtype) {
        case DType::kF32:
          for (int64_t b = 0; b < data; b += 4) std::memcpy(p + b, &kPoisonF32, 4);
          break;
        case DType::kF16:
          for (int64_t b = 0; b < data; b += 2) std::memcpy(p + b, &kPoisonF16, 2);
          break;
        case DType::kBF16:
          for (int64_t b = 0; b < data; b += 2) std::memcpy(p + b, &kPoisonBF16, 2);
          break;
        case DType::kFp8E4M3:
        case DType::kInt8:
          std::memset(p, kPoison8, static_cast<size_t>(data));
          for (int64_t b = data; b + 4 <= chunk; b += 4) std::memcpy(p + b, &kPoisonF32, 4);
          break;
      }
      offset += chunk;
    }
  }
}

}  // namespace

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
  for (int32_t i = 0; i < a.num_blocks; ++i) {
    char* block = pool.k(a.blocks[i], 0);
    if (a.pattern == FillPattern::kZero) {
      std::memset(block, 0, static_cast<size_t>(bytes));
    } else {
      PoisonBlock(pool.layout, block);
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
  // One KV head's keys and values as floats, read once for its group of query heads.
  std::vector<float> kf, vf;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const char* k = static_cast<const char*>(a.k[s]);
    const char* v = static_cast<const char*>(a.v[s]);
    const int32_t len = a.seq_lens[s];
    for (int32_t kv = 0; kv < a.num_kv_heads; ++kv) {
      const int64_t head = static_cast<int64_t>(kv) * a.head_dim * dsize;
      kf.resize(static_cast<size_t>(len) * a.head_dim);
      vf.resize(kf.size());
      for (int32_t t = 0; t < len; ++t) {
        for (int32_t d = 0; d < a.head_dim; ++d) {
          const size_t i = static_cast<size_t>(t) * a.head_dim + d;
          kf[i] = LoadAsFloat(k + t * row + head + d * dsize, a.dtype);
          vf[i] = LoadAsFloat(v + t * row + head + d * dsize, a.dtype);
        }
      }
      for (int32_t h = kv * group; h < (kv + 1) * group; ++h) {
        const float* q = a.q + (static_cast<int64_t>(s) * a.num_q_heads + h) * a.head_dim;
        scores.assign(static_cast<size_t>(len), 0);
        double max = -INFINITY;
        for (int32_t t = 0; t < len; ++t) {
          const float* kt = &kf[static_cast<size_t>(t) * a.head_dim];
          double dot = 0;
          for (int32_t d = 0; d < a.head_dim; ++d) dot += static_cast<double>(q[d]) * kt[d];
          scores[t] = dot * a.scale;
          max = std::max(max, scores[t]);
        }
        double sum = 0;
        for (double& x : scores) sum += (x = std::exp(x - max));
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int32_t t = 0; t < len; ++t) {
          const float* vt = &vf[static_cast<size_t>(t) * a.head_dim];
          for (int32_t d = 0; d < a.head_dim; ++d) acc[d] += scores[t] * vt[d];
        }
        float* out = a.out + (static_cast<int64_t>(s) * a.num_q_heads + h) * a.head_dim;
        for (int32_t d = 0; d < a.head_dim; ++d) out[d] = static_cast<float>(acc[d] / sum);
      }
    }
  }
}

}  // namespace kvpool::kernels::cpu
