#pragma once

// EvictionPlanner: works out which nodes of a PrefixCache to evict, in order, to free a number of
// blocks, without changing the cache (PrefixCache::PlanEviction). It owns the scratch a plan
// needs, kept from one plan to the next so that a warm plan neither allocates nor hashes: by
// node, how many children the plan took and whether the caller keeps it (both all zero between
// plans), the nodes whose counts to reset, and the parents the plan turned into leaves (a
// min-heap by rank).
//
// The plan walks the cache's first-out tails, then the policy's candidates in rank order. A
// victim may turn its parent into a leaf; such parents wait in the heap and are taken as soon as
// they rank below the policy's next candidate. O((k + m) log(k + n)) for k victims and m skipped.
//
// Thread-compatible: each PrefixCache owns one and calls it under the cache's serialization.

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvpool/eviction_policy.h"

namespace kvpool {

class PrefixCache;

class EvictionPlanner final {
 public:
  // Appends to `victims` the nodes of `cache` to evict, in order, to free `blocks` blocks now,
  // never one listed in `keep`; returns how many blocks they free (fewer than asked when the
  // cache cannot free more). Changes nothing in `cache`.
  int64_t Plan(const PrefixCache& cache, int64_t blocks, std::span<const NodeIndex> keep,
               std::vector<NodeIndex>* victims);

  // Whether the per-node scratch is all zero, as it is between plans (for CheckInvariants).
  bool clean() const;

 private:
  std::vector<int32_t> gone_children_;  // by node: children planned away
  std::vector<uint8_t> kept_;           // by node: listed in `keep`
  std::vector<NodeIndex> touched_;      // nodes whose gone_children_ to reset
  std::vector<std::pair<EvictionRank, NodeIndex>> freed_parents_;  // a min-heap by rank
};

}  // namespace kvpool
