#pragma once

// Reaches into a KvCacheManager where a test must set up what real runs take years to reach, or
// reads what its DebugString lists without formatting the whole manager.

#include <atomic>
#include <cstdint>
#include <vector>

#include "kvpool/internal/greedy_dual.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"

namespace kvpool {

class KvCacheManagerTestPeer {
 public:
  // The cached checkpoints' priorities are rebased once the floor reaches `at` tokens instead of
  // 2^62 (internal::GreedyDualOrder). REQUIRES: no checkpoint cached yet.
  static void RebaseCheckpointsAt(KvCacheManager& cache, uint64_t at) {
    KVPOOL_CHECK(cache.checkpoint_order_.empty());
    cache.checkpoint_order_ = internal::GreedyDualOrder<BlockId>(at);
  }
  // How many times the cached checkpoints' priorities were rebased.
  static uint64_t CheckpointRebases(const KvCacheManager& cache) {
    return cache.checkpoint_order_.rebases();
  }
  // The cached checkpoints in the eviction order, the next victim first: DebugString's
  // "checkpoint slot= block= offset= stamp= priority=" lines.
  struct ListedCheckpoint {
    int32_t slot = -1;
    int32_t block = -1;
    int32_t offset = 0;
    uint64_t stamp = 0;
    uint64_t priority = 0;
    bool operator==(const ListedCheckpoint&) const = default;
  };
  static std::vector<ListedCheckpoint> CachedCheckpoints(const KvCacheManager& cache) {
    std::vector<ListedCheckpoint> out;
    for (const auto& key : cache.checkpoint_order_) {
      const auto& c = cache.checkpoint_at_[static_cast<size_t>(key.id.value())];
      out.push_back({key.id.value(), c.block.value(), c.offset, key.stamp, key.priority});
    }
    return out;
  }
  // Sequences and pins walked so far by calls that list them (ForEachSequence, ListPins,
  // FreeSession): a call's cost in entries it was not asked about is the difference.
  static uint64_t Visited(const KvCacheManager& cache) {
    return cache.visited_.load(std::memory_order_relaxed);
  }
  // Sessions with an entry in the books (their usage and SessionHoldings), emptied ones included.
  static size_t SessionsBooked(const KvCacheManager& cache) { return cache.sessions_.size(); }
  // The floor of that order (DebugString's "checkpoint floor=").
  static uint64_t CheckpointFloor(const KvCacheManager& cache) {
    return cache.checkpoint_order_.floor();
  }
};

}  // namespace kvpool
