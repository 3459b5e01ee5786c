#include "client/block_ref.h"

#include "fmt/format.h"

namespace kvpool::client {

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
  return absl::OkStatus();
}

std::vector<BlockRef> ToBlockRefs(const v1::SequenceInfo& info) {
  const int n = std::min(info.block_ids_size(), info.generations_size());
  std::vector<BlockRef> refs;
  refs.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) refs.push_back(BlockRef{info.block_ids(i), info.generations(i)});
  return refs;
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

}  // namespace kvpool::client
