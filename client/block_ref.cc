#include "client/block_ref.h"

#include "fmt/format.h"

namespace kvpool::client {
namespace {

bool HasWindowTable(const v1::SequenceInfo& info) {
  return info.window_block_ids_size() > 0 || info.window_generations_size() > 0 ||
         info.window_released_begin() != 0 || info.window_released_end() != 0;
}

// ValidateSequenceInfo's window half (the block half has passed).
absl::Status ValidateWindow(const v1::SequenceInfo& info) {
  if (!HasWindowTable(info)) return absl::OkStatus();
  const uint64_t id = info.sequence_id();
  const int n = info.block_ids_size();
  if (info.window_block_ids_size() != n || info.window_generations_size() != n) {
    return absl::InvalidArgumentError(
        fmt::format("sequence {}: {} blocks but {} window block ids and {} window generations", id,
                    n, info.window_block_ids_size(), info.window_generations_size()));
  }
  const int64_t begin = info.window_released_begin();
  const int64_t end = info.window_released_end();
  const int64_t size = int64_t{info.table_offset()} + n;
  if (begin < 0 || begin > end || end > size) {
    return absl::InvalidArgumentError(
        fmt::format("sequence {}: released window run [{}, {}) outside a table of {} entries", id,
                    begin, end, size));
  }
  // Past the last window block: entries not allocated yet (a prefill in chunks takes them as it
  // goes), -1 like released ones.
  int allocated = n;
  while (allocated > 0 && info.window_block_ids(allocated - 1) < 0) --allocated;
  for (int i = 0; i < n; ++i) {
    const int64_t entry = int64_t{info.table_offset()} + i;
    const bool released = (entry >= begin && entry < end) || i >= allocated;
    const int32_t w = info.window_block_ids(i);
    if (released ? (w != -1 || info.window_generations(i) != 0) : w < 0) {
      return absl::InvalidArgumentError(fmt::format(
          "sequence {}: window entry {} is {} (generation {}), but the released run is [{}, {})",
          id, entry, w, info.window_generations(i), begin, end));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSequenceInfo(const v1::SequenceInfo& info) {
  if (info.block_ids_size() != info.generations_size()) {
    return absl::InvalidArgumentError(fmt::format("sequence {}: {} block ids but {} generations",
                                                  info.sequence_id(), info.block_ids_size(),
                                                  info.generations_size()));
  }
  if (info.table_offset() < 0) {
    return absl::InvalidArgumentError(fmt::format("sequence {}: negative table_offset {}",
                                                  info.sequence_id(), info.table_offset()));
  }
  for (int i = 0; i < info.block_ids_size(); ++i) {
    if (info.block_ids(i) < 0) {
      return absl::InvalidArgumentError(fmt::format("sequence {}: negative block id {} at entry {}",
                                                    info.sequence_id(), info.block_ids(i),
                                                    info.table_offset() + i));
    }
  }
  return ValidateWindow(info);
}

std::vector<BlockRef> ToBlockRefs(const v1::SequenceInfo& info) {
  const int n = std::min(info.block_ids_size(), info.generations_size());
  std::vector<BlockRef> refs;
  refs.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) refs.push_back(BlockRef{info.block_ids(i), info.generations(i)});
  return refs;
}

std::vector<BlockRef> ToWindowRefs(const v1::SequenceInfo& info) {
  const int n = std::min(info.window_block_ids_size(), info.window_generations_size());
  std::vector<BlockRef> refs;
  refs.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    refs.push_back(BlockRef{info.window_block_ids(i), info.window_generations(i)});
  }
  return refs;
}

absl::StatusOr<std::vector<v1::SequenceInfo>> SplitGrowResponse(
    const v1::GrowResponse& r, std::span<const uint64_t> sequence_ids) {
  const int n = static_cast<int>(sequence_ids.size());
  const int blocks = r.block_ids_size();
  const bool window = r.window_block_ids_size() > 0 || r.window_generations_size() > 0 ||
                      r.window_released_begin_size() > 0 || r.window_released_end_size() > 0;
  if (r.num_tokens_size() != n || r.table_offsets_size() != n || r.tail_lengths_size() != n ||
      r.generations_size() != blocks ||
      (window && (r.window_released_begin_size() != n || r.window_released_end_size() != n ||
                  r.window_block_ids_size() != blocks || r.window_generations_size() != blocks))) {
    return absl::InvalidArgumentError("arrays of the wrong length");
  }
  std::vector<v1::SequenceInfo> out(sequence_ids.size());
  int next = 0;
  for (int i = 0; i < n; ++i) {
    const int tail = r.tail_lengths(i);
    if (tail < 0 || r.table_offsets(i) < 0 || next + tail > blocks) {
      return absl::InvalidArgumentError("a tail outside the response");
    }
    v1::SequenceInfo& info = out[static_cast<size_t>(i)];
    info.set_sequence_id(sequence_ids[static_cast<size_t>(i)]);
    info.set_num_tokens(r.num_tokens(i));
    info.set_table_offset(r.table_offsets(i));
    info.mutable_block_ids()->Add(r.block_ids().begin() + next,
                                  r.block_ids().begin() + next + tail);
    info.mutable_generations()->Add(r.generations().begin() + next,
                                    r.generations().begin() + next + tail);
    if (window) {
      info.set_window_released_begin(r.window_released_begin(i));
      info.set_window_released_end(r.window_released_end(i));
      info.mutable_window_block_ids()->Add(r.window_block_ids().begin() + next,
                                           r.window_block_ids().begin() + next + tail);
      info.mutable_window_generations()->Add(r.window_generations().begin() + next,
                                             r.window_generations().begin() + next + tail);
    }
    next += tail;
    if (absl::Status s = ValidateSequenceInfo(info); !s.ok()) return s;
  }
  if (next != blocks) return absl::InvalidArgumentError("blocks left over");
  return out;
}

absl::Status ApplyGrow(const v1::SequenceInfo& tail, std::vector<BlockRef>* table) {
  if (absl::Status s = ValidateSequenceInfo(tail); !s.ok()) return s;
  const auto offset = static_cast<size_t>(tail.table_offset());
  if (offset > table->size()) {
    return absl::InvalidArgumentError(
        fmt::format("sequence {}: grow tail starts at entry {} but the held table has {} entries",
                    tail.sequence_id(), offset, table->size()));
  }
  const size_t end = offset + static_cast<size_t>(tail.block_ids_size());
  if (end > table->size()) table->resize(end);
  for (int i = 0; i < tail.block_ids_size(); ++i) {
    (*table)[offset + static_cast<size_t>(i)] = BlockRef{tail.block_ids(i), tail.generations(i)};
  }
  return absl::OkStatus();
}

absl::Status ApplyWindowGrow(const v1::SequenceInfo& tail, std::vector<BlockRef>* window_table) {
  if (absl::Status s = ValidateSequenceInfo(tail); !s.ok()) return s;
  if (!HasWindowTable(tail) && tail.block_ids_size() == 0) return absl::OkStatus();  // no change
  if (!HasWindowTable(tail)) {
    return absl::InvalidArgumentError(fmt::format(
        "sequence {}: a grow tail without a window table (the pool has no window group?)",
        tail.sequence_id()));
  }
  const auto offset = static_cast<size_t>(tail.table_offset());
  if (offset > window_table->size()) {
    return absl::InvalidArgumentError(fmt::format(
        "sequence {}: grow tail starts at entry {} but the held window table has {} entries",
        tail.sequence_id(), offset, window_table->size()));
  }
  const size_t end = offset + static_cast<size_t>(tail.window_block_ids_size());
  if (end > window_table->size()) window_table->resize(end);
  const auto released_end =
      std::min(window_table->size(), static_cast<size_t>(tail.window_released_end()));
  for (auto e = static_cast<size_t>(tail.window_released_begin()); e < released_end; ++e) {
    (*window_table)[e] = BlockRef{-1, 0};
  }
  for (int i = 0; i < tail.window_block_ids_size(); ++i) {
    (*window_table)[offset + static_cast<size_t>(i)] =
        BlockRef{tail.window_block_ids(i), tail.window_generations(i)};
  }
  return absl::OkStatus();
}

}  // namespace kvpool::client
