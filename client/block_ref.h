#pragma once

// BlockRef: one entry of a sequence's block table as a client holds it, and helpers that turn the
// daemon's SequenceInfo messages into tables of them.
//
// A block id alone is not enough to address KV safely: the daemon hands a block out again after
// it is freed, bumping its generation. A client keeps (id, generation) pairs and PoolMapping
// refuses to address a block whose generation has moved on.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/v1/kvpool.pb.h"

namespace kvpool::client {

struct BlockRef {
  int32_t id = -1;          // dense block index in the pool, [0, layout.num_blocks)
  uint32_t generation = 0;  // the block's generation when the daemon handed it to this sequence

  friend bool operator==(const BlockRef&, const BlockRef&) = default;
};

// OK when `info`'s parallel arrays (block_ids, generations) have equal length, table_offset >= 0
// and every block id >= 0; and, when it carries a window table (window_block_ids, a pool with a
// window group), window_block_ids and window_generations are as long as block_ids, the released
// run is 0 <= window_released_begin <= window_released_end <= table_offset + block_ids_size(),
// and each listed window entry is -1 (with generation 0) exactly inside that run. Errors:
// INVALID_ARGUMENT naming what is wrong.
absl::Status ValidateSequenceInfo(const v1::SequenceInfo& info);

// The blocks listed in `info`, in order (for a full table: the whole table; for a Grow tail: the
// entries from table_offset on).
// REQUIRES: ValidateSequenceInfo(info).ok() (Client validates every response it returns).
std::vector<BlockRef> ToBlockRefs(const v1::SequenceInfo& info);

// The window table listed in `info`, parallel to ToBlockRefs(info): a released entry is
// BlockRef{-1, 0}. Empty without a window group.
// REQUIRES: ValidateSequenceInfo(info).ok().
std::vector<BlockRef> ToWindowRefs(const v1::SequenceInfo& info);

// Splits a GrowResponse into one SequenceInfo tail per item (sequence_ids: the request's, in
// order), window tails and released runs included. Errors: INVALID_ARGUMENT when the parallel
// arrays disagree in length, a tail lies outside the response, blocks are left over, or a tail
// fails ValidateSequenceInfo.
absl::StatusOr<std::vector<v1::SequenceInfo>> SplitGrowResponse(
    const v1::GrowResponse& response, std::span<const uint64_t> sequence_ids);

// A sequence's tables as a client holds them: made from a full table (Allocate, Fork: ToHeld) and
// kept current by Client::Grow's held form (ApplyGrowResponse).
struct HeldSequence {
  uint64_t sequence_id = 0;
  int64_t num_tokens = 0;
  std::vector<BlockRef> table;         // ToBlockRefs
  std::vector<BlockRef> window_table;  // ToWindowRefs: empty without a window group

  friend bool operator==(const HeldSequence&, const HeldSequence&) = default;
};

// The tables `info` lists, held. REQUIRES: ValidateSequenceInfo(info).ok().
HeldSequence ToHeld(const v1::SequenceInfo& info);

// Applies a whole GrowResponse to the sequences it answers (held[i]: item i's, by the request's
// order): each one's num_tokens, table (as ApplyGrow) and window table (as ApplyWindowGrow), read
// in place from the response's arrays, with no message per item (a decode step's batch). Every
// tail is checked before any applies. Errors, with nothing held changed: INVALID_ARGUMENT as
// SplitGrowResponse (a malformed response); FAILED_PRECONDITION when a tail starts past the table
// held for it (the held tables are not the ones the daemon extended).
absl::Status ApplyGrowResponse(const v1::GrowResponse& response, std::span<HeldSequence> held);

// Applies a Grow response entry to the table the caller holds: entry table_offset + i becomes
// tail.blocks[i]; entries before table_offset are unchanged, and the table grows to hold the tail
// (Grow never shrinks a table, so entries past the tail are kept).
// Errors: INVALID_ARGUMENT when `tail` is malformed or table_offset > table->size() (the held
// table is not the one the daemon extended); `*table` is unchanged after an error.
absl::Status ApplyGrow(const v1::SequenceInfo& tail, std::vector<BlockRef>* table);

// The same for the window table the caller holds (ToWindowRefs of an earlier reply): entries of
// the released run become {-1, 0} (the window slid past them since), then the tail applies as in
// ApplyGrow. Errors: INVALID_ARGUMENT as ApplyGrow, or when `tail` lists blocks but no window table
// (a pool without a window group); `*window_table` is unchanged after an error.
absl::Status ApplyWindowGrow(const v1::SequenceInfo& tail, std::vector<BlockRef>* window_table);

}  // namespace kvpool::client
