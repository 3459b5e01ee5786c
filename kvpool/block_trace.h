#pragma once

// BlockTrace: for every block, a ring of its last `depth` operations (what happened, the
// reference count after, who asked, from where, when). Always on: recording is a 48-byte store
// and no allocation, so the pool can keep it in its hot path. Thread-compatible (the owning
// BlockPool serializes access).

#include <cstdint>
#include <source_location>
#include <string>
#include <string_view>
#include <vector>

#include "kvpool/util/strong_id.h"

namespace kvpool {

enum class BlockOp : uint8_t {
  kAllocate,     // handed out from the free list: refs 1, generation bumped
  kRetain,       // another reference taken
  kRelease,      // a reference dropped, others remain
  kFree,         // last reference dropped: back on the free list
  kRetire,       // last reference dropped while device work is in flight: RETIRING
  kReclaim,      // RETIRING -> FREE once its fences passed
  kInFlight,     // device work queued that touches the block
  kCacheRef,     // the prefix cache took its single reference
  kCacheDrop,    // the prefix cache returned its reference (eviction)
  kOverRelease,  // release of a block with no reference: refused and reported
};

std::string_view BlockOpName(BlockOp op);

// Who is asking, and when. Filled once per API call and passed down to every block it touches.
struct TraceContext {
  SessionId session = kNoSession;
  SequenceId sequence{0};
  int64_t time_ns = 0;
};

struct BlockTraceEntry {
  uint64_t op_seq = 0;  // pool-wide order of operations, from 1
  int64_t time_ns = 0;  // the calling operation's clock reading
  SequenceId sequence{0};
  SessionId session = kNoSession;
  std::source_location site;  // the kvpool call site that did it
  uint32_t refs_after = 0;
  uint32_t generation = 0;
  BlockId block = kInvalidBlock;  // filled in by the dump APIs (a ring knows its block)
  BlockOp op = BlockOp::kAllocate;
};

// One line: "#12 t=1500ns alloc refs=1 gen=3 session=2 seq=7 at kv_cache_manager.cc:88 (Grow)".
std::string FormatTraceEntry(const BlockTraceEntry& entry);

class BlockTrace final {
 public:
  // `depth` is 0 (record nothing) or a power of two, so that the ring index is a mask rather
  // than a division on the pool's hot path. REQUIRES: IsValidDepth(depth).
  BlockTrace(int32_t num_blocks, int32_t depth);

  static bool IsValidDepth(int32_t depth) { return depth >= 0 && (depth & (depth - 1)) == 0; }

  int32_t depth() const { return depth_; }

  void Record(BlockId block, BlockOp op, uint32_t refs_after, uint32_t generation,
              const TraceContext& ctx, const std::source_location& site) {
    if (depth_ == 0) return;
    const size_t i = static_cast<size_t>(block.value());
    const uint32_t n = recorded_[i]++;
    // One aggregate store: the compiler emits a few wide moves instead of nine narrow ones.
    entries_[i * static_cast<size_t>(depth_) + (n & mask_)] =
        Entry{next_op_seq_++ << 8 | static_cast<uint64_t>(op),
              ctx.time_ns,
              ctx.sequence,
              ctx.session,
              site,
              refs_after,
              generation};
  }

  // The block's remembered operations, oldest first.
  std::vector<BlockTraceEntry> History(BlockId block) const;
  // Every block's remembered operations, in pool-wide order.
  std::vector<BlockTraceEntry> All() const;
  // History(block) as text, one entry per line.
  std::string Format(BlockId block) const;

  // Structural equality of everything recorded (for fail-clean tests).
  bool operator==(const BlockTrace& other) const;

 private:
  // What a ring slot stores (BlockTraceEntry without the block id): 48 bytes.
  struct Entry {
    uint64_t seq_and_op;  // op_seq << 8 | op
    int64_t time_ns;
    SequenceId sequence;
    SessionId session;
    std::source_location site;
    uint32_t refs_after;
    uint32_t generation;
  };
  static_assert(sizeof(Entry) == 48);

  int32_t depth_;
  uint32_t mask_;  // depth_ - 1
  uint64_t next_op_seq_ = 1;
  std::vector<Entry> entries_;      // [num_blocks][depth] rings
  std::vector<uint32_t> recorded_;  // [num_blocks] operations ever recorded
};

}  // namespace kvpool
