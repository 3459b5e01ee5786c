#include "kernels/validate.h"

#include "fmt/format.h"

namespace kvpool::kernels {
namespace {

absl::Status Bad(std::string_view kernel, std::string_view why) {
  return absl::InvalidArgumentError(fmt::format("{}: {}", kernel, why));
}

absl::Status CheckPool(std::string_view kernel, const KvPoolView& pool) {
  if (pool.base == nullptr && pool.layout.num_blocks > 0) return Bad(kernel, "null pool base");
  if (absl::Status s = ValidateLayout(pool.layout); !s.ok()) return s;
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateWriteKv(const KvPoolView& pool, const WriteKvArgs& a) {
  if (absl::Status s = CheckPool("WriteKv", pool); !s.ok()) return s;
  if (a.layer < 0 || a.layer >= pool.layout.num_layers) {
    return Bad("WriteKv", fmt::format("layer {} outside [0, {})", a.layer, pool.layout.num_layers));
  }
  if (a.num_tokens < 0) return Bad("WriteKv", "negative token count");
  if (a.num_tokens > 0 && (a.k == nullptr || a.v == nullptr || a.slots == nullptr)) {
    return Bad("WriteKv", "null k, v or slots");
  }
  return absl::OkStatus();
}

absl::Status ValidateDecode(const KvPoolView& pool, const DecodeArgs& a) {
  if (absl::Status s = CheckPool("PagedAttentionDecode", pool); !s.ok()) return s;
  const PoolLayout& l = pool.layout;
  if (a.layer < 0 || a.layer >= l.num_layers) {
    return Bad("PagedAttentionDecode",
               fmt::format("layer {} outside [0, {})", a.layer, l.num_layers));
  }
  if (a.num_seqs < 0) return Bad("PagedAttentionDecode", "negative sequence count");
  if (a.num_q_heads <= 0 || a.num_q_heads % l.num_kv_heads != 0) {
    return Bad("PagedAttentionDecode",
               fmt::format("{} query heads is not a multiple of {} KV heads", a.num_q_heads,
                           l.num_kv_heads));
  }
  if (a.num_seqs > 0 &&
      (a.q == nullptr || a.out == nullptr || a.block_tables == nullptr || a.seq_lens == nullptr)) {
    return Bad("PagedAttentionDecode", "null q, out, block_tables or seq_lens");
  }
  if (a.num_seqs > 0 && a.table_stride <= 0) {
    return Bad("PagedAttentionDecode", "table_stride must be > 0");
  }
  if (a.num_seqs > 0 &&
      (a.max_seq_len <= 0 || a.max_seq_len > static_cast<int64_t>(a.table_stride) * l.block_size)) {
    return Bad("PagedAttentionDecode",
               fmt::format("max_seq_len {} outside [1, table_stride * block_size = {}]",
                           a.max_seq_len, static_cast<int64_t>(a.table_stride) * l.block_size));
  }
  if (a.workspace_bytes < 0 || (a.workspace_bytes > 0 && a.workspace == nullptr)) {
    return Bad("PagedAttentionDecode", "bad workspace");
  }
  if (a.window.window < 0 || a.window.sinks < 0) {
    return Bad("PagedAttentionDecode",
               fmt::format("window {} and sinks {} must be >= 0", a.window.window, a.window.sinks));
  }
  return absl::OkStatus();
}

absl::Status ValidatePrefill(const KvPoolView& pool, const PrefillArgs& a,
                             int64_t workspace_needed) {
  constexpr std::string_view kName = "PagedAttentionPrefill";
  if (absl::Status s = CheckPool(kName, pool); !s.ok()) return s;
  const PoolLayout& l = pool.layout;
  if (a.layer < 0 || a.layer >= l.num_layers) {
    return Bad(kName, fmt::format("layer {} outside [0, {})", a.layer, l.num_layers));
  }
  if (a.num_seqs < 0) return Bad(kName, "negative sequence count");
  if (a.num_q_heads <= 0 || a.num_q_heads % l.num_kv_heads != 0) {
    return Bad(kName, fmt::format("{} query heads is not a multiple of {} KV heads", a.num_q_heads,
                                  l.num_kv_heads));
  }
  if (a.num_seqs == 0) return absl::OkStatus();
  if (a.q == nullptr || a.out == nullptr || a.q_starts == nullptr || a.block_tables == nullptr ||
      a.seq_lens == nullptr) {
    return Bad(kName, "null q, out, q_starts, block_tables or seq_lens");
  }
  if (a.table_stride <= 0) return Bad(kName, "table_stride must be > 0");
  if (a.max_seq_len <= 0 || a.max_seq_len > static_cast<int64_t>(a.table_stride) * l.block_size) {
    return Bad(kName,
               fmt::format("max_seq_len {} outside [1, table_stride * block_size = {}]",
                           a.max_seq_len, static_cast<int64_t>(a.table_stride) * l.block_size));
  }
  if (a.max_q_len <= 0 || a.max_q_len > a.max_seq_len) {
    return Bad(kName, fmt::format("max_q_len {} outside [1, max_seq_len = {}]", a.max_q_len,
                                  a.max_seq_len));
  }
  if (a.workspace_bytes < 0 || (a.workspace_bytes > 0 && a.workspace == nullptr)) {
    return Bad(kName, "bad workspace");
  }
  if (a.window.window < 0 || a.window.sinks < 0) {
    return Bad(kName,
               fmt::format("window {} and sinks {} must be >= 0", a.window.window, a.window.sinks));
  }
  if (a.workspace_bytes < workspace_needed) {
    return Bad(kName, fmt::format("workspace of {} bytes, {} needed (PrefillWorkspaceBytes)",
                                  a.workspace_bytes, workspace_needed));
  }
  return absl::OkStatus();
}

absl::Status CheckVisibleBlocks(std::string_view kernel, int32_t seq, const int32_t* table,
                                const LayerLayout& l, const AttentionWindow& window,
                                int64_t first_pos, int64_t len) {
  const int64_t bs = l.block_size;
  const int64_t spans[2][2] = {{0, window.SinkEnd(first_pos)}, {window.Start(first_pos), len}};
  for (const auto& span : spans) {
    if (span[0] >= span[1]) continue;
    for (int64_t b = span[0] / bs; b < (span[1] + bs - 1) / bs; ++b) {
      if (table[b] < 0 || table[b] >= l.num_blocks) {
        return Bad(kernel, fmt::format("sequence {} block {} is {} (pool has {})", seq, b, table[b],
                                       l.num_blocks));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCopyBlocks(const KvPoolView& pool, const CopyBlocksArgs& a) {
  if (absl::Status s = CheckPool("CopyBlocks", pool); !s.ok()) return s;
  if (a.num_pairs < 0 || (a.num_pairs > 0 && a.pairs == nullptr)) {
    return Bad("CopyBlocks", "bad pair list");
  }
  return absl::OkStatus();
}

absl::Status ValidateFillBlocks(const KvPoolView& pool, const FillBlocksArgs& a) {
  if (absl::Status s = CheckPool("FillBlocks", pool); !s.ok()) return s;
  if (a.num_blocks < 0 || (a.num_blocks > 0 && a.blocks == nullptr)) {
    return Bad("FillBlocks", "bad block list");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::kernels
