#pragma once

// Reaches into a KvCacheManager where a test must set up what real runs take years to reach.

#include <cstdint>

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
};

}  // namespace kvpool
