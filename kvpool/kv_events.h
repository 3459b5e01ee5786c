#pragma once

// KV cache events for routers and remote tiers (vLLM's KV-event vocabulary): BlockStored,
// BlockRemoved, AllBlocksCleared. Every event carries a gap-free sequence number (from 1) and
// the daemon's epoch, so a consumer can tell a missed event from a restart. The log keeps a
// bounded replay ring; a consumer that fell behind it must take a snapshot first
// (PrefixCache::SnapshotEvents) and resume from the snapshot's sequence number.
//
// Thread-compatible.

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "kvpool/util/strong_id.h"

namespace kvpool {

// xxh3-128 of (parent hash, namespace, the block's tokens): names a full block's content and
// everything before it.
struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;

  friend bool operator==(const BlockHash&, const BlockHash&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& b) {
    return H::combine(std::move(h), b.lo, b.hi);
  }
};

enum class KvEventType : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };

struct KvEvent {
  uint64_t seq = 0;    // gap-free, from 1; 0 in snapshot entries
  uint64_t epoch = 0;  // changes when the daemon restarts
  KvEventType type = KvEventType::kBlockStored;
  NamespaceId ns;
  // Stored: the new full blocks, parent first, each the parent of the next. Removed: the
  // evicted blocks. Cleared: empty.
  std::vector<BlockHash> block_hashes;
  std::optional<BlockHash> parent_hash;  // stored: the first block's parent (none at the root)
  std::vector<int32_t> token_ids;        // stored: every block's tokens, concatenated
  int32_t block_size = 0;
};

class EventLog final {
 public:
  // REQUIRES: capacity > 0.
  EventLog(uint64_t epoch, size_t capacity);

  // Assigns the next sequence number and the epoch, and keeps the event in the ring.
  void Append(KvEvent event);

  // Appends to `out` the events with seq >= `from`, at most `max`. Returns false, appending
  // nothing, when `from` is older than the oldest event kept: events were dropped and the
  // consumer needs a snapshot. `from` beyond next_seq() is not an error (nothing to read yet).
  bool ReadFrom(uint64_t from, size_t max, std::vector<KvEvent>* out) const;

  uint64_t epoch() const { return epoch_; }
  // The sequence number the next event will get (one past the newest).
  uint64_t next_seq() const { return next_seq_; }
  uint64_t oldest_seq() const { return ring_.empty() ? next_seq_ : ring_.front().seq; }

 private:
  const uint64_t epoch_;
  const size_t capacity_;
  uint64_t next_seq_ = 1;
  std::deque<KvEvent> ring_;
};

}  // namespace kvpool
