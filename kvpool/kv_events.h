#pragma once

// KV cache events for routers and remote tiers (vLLM's KV-event vocabulary): BlockStored,
// BlockRemoved, AllBlocksCleared. Every event carries a gap-free sequence number (from 1) and
// the daemon's epoch, so a consumer can tell a missed event from a restart. The log keeps a
// bounded replay ring, bounded both in events and in bytes (one event can carry a whole chain's
// hashes and tokens); the oldest events are dropped past either bound. A consumer that fell
// behind the ring must take a snapshot first (PrefixCache::SnapshotEvents) and resume from the
// snapshot's sequence number.
//
// Thread-compatible.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
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

// EventLog's default byte budget: 64 MiB.
inline constexpr size_t kDefaultEventLogBytes = size_t{64} << 20;

enum class KvEventType : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };

// Where an event's blocks are (vLLM's `medium`): the device pool, or the host or disk tier below
// it (docs/tiers.md). Tier events name blocks by hash only (no tokens).
enum class KvMedium : uint8_t { kDevice, kHost, kDisk };

// The life cycle of a layer group (vLLM's kv_cache_spec_kind: full_attention, sliding_window,
// mamba; docs/hybrid-groups.md).
enum class KvGroupKind : uint8_t { kFullAttention, kSlidingWindow, kStateSpace };
// vLLM's name of `kind`: "full_attention", "sliding_window", "mamba".
std::string_view GroupKindName(KvGroupKind kind);

// Which of a hybrid pool's layer groups an event's blocks belong to (vLLM's group_idx,
// kv_cache_spec_kind, kv_cache_spec_sliding_window). Index 0 is the main blocks (the
// full-attention layers, and the sliding ones where the pool has no window group); then the
// window group, then the state group, each where the pool has it. A window group's event names
// the tree's full blocks whose window blocks the tree keeps; a state group's names the full
// blocks at whose last token the tree keeps a checkpoint. Both by the same hashes as the main
// blocks' events, so a consumer keys what it knows by (hash, group).
struct KvEventGroup {
  int32_t index = 0;
  KvGroupKind kind = KvGroupKind::kFullAttention;
  int32_t sliding_window = 0;  // kSlidingWindow: the window, in tokens; else 0

  friend bool operator==(const KvEventGroup&, const KvEventGroup&) = default;
};

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
  KvMedium medium = KvMedium::kDevice;
  // Set on every Stored and Removed event of a pool with more than one layer group; absent in a
  // pool of one (every event then names main blocks). AllBlocksCleared clears every group.
  std::optional<KvEventGroup> group;
};

// The memory one event takes in the ring, in bytes: the struct and its vectors' buffers.
size_t EventBytes(const KvEvent& event);

class EventLog final {
 public:
  // Keeps at most `capacity` events taking at most `max_bytes` bytes (EventBytes).
  // REQUIRES: capacity > 0, max_bytes > 0.
  EventLog(uint64_t epoch, size_t capacity, size_t max_bytes = kDefaultEventLogBytes);

  // Assigns the next sequence number and the epoch, and keeps the event in the ring, dropping the
  // oldest events past either bound (this one too, when it alone is over the byte budget: readers
  // are told of the drop as of any other).
  void Append(KvEvent event);
  // Changes the byte budget, dropping the oldest events past it now. REQUIRES: max_bytes > 0.
  void set_max_bytes(size_t max_bytes);

  // Appends to `out` the events with seq >= `from`, at most `max`. Returns false, appending
  // nothing, when `from` is older than the oldest event kept: events were dropped and the
  // consumer needs a snapshot. `from` beyond next_seq() is not an error (nothing to read yet).
  bool ReadFrom(uint64_t from, size_t max, std::vector<KvEvent>* out) const;

  uint64_t epoch() const { return epoch_; }
  // The sequence number the next event will get (one past the newest).
  uint64_t next_seq() const { return next_seq_; }
  uint64_t oldest_seq() const { return ring_.empty() ? next_seq_ : ring_.front().seq; }
  size_t size() const { return ring_.size(); }  // events kept
  size_t bytes() const { return bytes_; }       // their EventBytes, <= max_bytes()
  size_t max_bytes() const { return max_bytes_; }
  uint64_t dropped() const { return dropped_; }  // events dropped since creation, either bound

 private:
  void DropPastBounds();

  const uint64_t epoch_;
  const size_t capacity_;
  size_t max_bytes_;
  uint64_t next_seq_ = 1;
  size_t bytes_ = 0;
  uint64_t dropped_ = 0;
  std::deque<KvEvent> ring_;
};

// The lower tiers' blocks as a pool's event log has told them (its Stored and Removed events of
// medium kHost and kDisk, every group): what a consumer that followed each of them holds. A pool's
// snapshot restates it after the device's blocks, and after an AllBlocksCleared (which clears
// every medium, docs/events.md) the pool tells it again, so a consumer that rebuilds from either
// loses no tier's block. At most about 150 bytes per block a tier holds (a 48-byte entry of the
// told order, at most half of them dead, and a 25-byte hash-map slot, the map 7/16 to 7/8 full).
//
// Thread-compatible.
class TierEventView final {
 public:
  // Applies a tier's event. An AllBlocksCleared forgets every block of its medium.
  // REQUIRES: event.medium != KvMedium::kDevice.
  void Apply(const KvEvent& event);
  // Appends Stored events (seq 0) naming every block held: by medium (host, then disk), then by
  // group (main blocks first); in a group, in the order first told, but each block after its
  // parent where that is held too (whatever order the tier told them in: the disk's records
  // found at start come in slot order), a block right after its parent on the parent's event.
  // O(blocks held), no lock of its own: callers may snapshot at once under a shared lock.
  void AppendSnapshot(std::vector<KvEvent>* out) const;
  size_t size() const { return size_; }  // blocks held, every medium and group

 private:
  struct Told {
    BlockHash hash;
    BlockHash parent;  // {} at the root
    NamespaceId ns;
    bool held = true;  // false once removed (the entry is dead)
  };
  struct Group {
    std::optional<KvEventGroup> group;
    int32_t block_size = 0;
    // The blocks in the order told, dead entries among them until compacted (when more than
    // half are), and each held block's entry.
    std::vector<Told> told;
    absl::flat_hash_map<BlockHash, size_t> held;
  };
  static void Compact(Group& g);
  // By (medium, group index).
  std::map<std::pair<KvMedium, int32_t>, Group> groups_;
  size_t size_ = 0;
};

}  // namespace kvpool
