#pragma once

// EvictionPlanner: works out which blocks of a PrefixCache to evict, in order, to free a number
// of blocks, without changing the cache (PrefixCache::PlanEviction). It owns the scratch a plan
// needs, kept from one plan to the next so that a warm plan neither allocates nor hashes: by
// block, how many children the plan took (all zero between plans), the blocks whose counts to
// reset, and the parents the plan turned into leaves (a min-heap by rank). Which blocks the
// caller keeps is a bit of the cache's per-block entry (set and cleared by the plan).
//
// The plan walks the cache's first-out tails, then the policy's candidates in rank order. A
// victim may turn its parent into a leaf; such parents wait in the heap and are taken as soon as
// they rank below the policy's next candidate. Inside a run every block is its parent's only
// child, so a victim's run is walked from its tail without bookkeeping. O((k + m) log(k + n))
// for k victims and m skipped.
//
// With eviction shares (PrefixCache::SetShare), each share has its own policy, and the plan
// takes its next victim from the share with the largest use per unit of weight, counting what
// the plan took already. Only that share's candidates are read: a buffer filled from its
// policy's Visit, twice as many each time (a share read k deep costs O(k) visits), merged with
// the parents the plan turned into leaves in that share. A step from a share stops (queuing the
// next parent) once the share's use falls below the runner-up's, so a long run does not go in
// one piece while another share holds more. O(s) per step for s shares.
//
// Thread-compatible: each PrefixCache owns one and calls it under the cache's serialization.

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvpool/eviction_policy.h"
#include "kvpool/util/strong_id.h"

namespace kvpool {

class PrefixCache;

class EvictionPlanner final {
 public:
  // Appends to `victims` the blocks of `cache` to evict, in order, to free `blocks` blocks now,
  // never one listed in `keep`; returns how many blocks they free (fewer than asked when the
  // cache cannot free more). Changes nothing in `cache` (the kept bits it sets, it clears).
  int64_t Plan(const PrefixCache& cache, int64_t blocks, std::span<const BlockId> keep,
               std::vector<BlockId>* victims);

  // Whether the per-block scratch is all zero, as it is between plans (for CheckInvariants).
  bool clean() const;

 private:
  using Ranked = std::pair<EvictionRank, BlockId>;
  using Heap = std::vector<Ranked>;  // a min-heap by rank

  // One plan's progress.
  struct Progress {
    const PrefixCache* cache = nullptr;
    int64_t blocks = 0;  // asked for
    int64_t freed = 0;   // freed by the victims so far
    // Past this many freed, parents are queued rather than followed: the share being read may
    // have to give way to another (fair plans).
    int64_t follow_below = INT64_MAX;
    bool count_shares = false;  // count victims by share (in shares_[].planned)
    std::vector<BlockId>* victims = nullptr;
  };
  // A share's reading position in a fair plan.
  struct ShareCursor {
    std::vector<Ranked> next;  // its policy's candidates read and not taken yet, from `at`
    size_t at = 0;
    size_t read = 0;         // candidates its policy's Visit has given so far
    bool exhausted = false;  // the policy has no more
    int64_t planned = 0;     // victims planned from the share
  };
  // What a plan does with the parent of a block it took.
  enum class Step : uint8_t {
    kStop,    // nothing: it is not evictable, it is kept, or it has children left
    kFollow,  // take it next (it ranks right after its child)
    kQueue,   // queue it by rank among the freed parents
  };
  static Step NextStep(BlockId child, BlockId parent, bool chain, const Progress& p);
  // Takes evictable leaf `block` and the blocks it turns into leaves while they rank next.
  // `ranked`: taken in rank order (not as a first-out tail), so nothing untaken ranks below it.
  void Take(BlockId block, bool ranked, Progress* p);
  void Queue(BlockId parent, const Progress& p);
  void TakeParent(size_t share, Progress* p);
  // The policy's candidates of `share` in rank order, merged with its freed parents, until the
  // plan is done (one share, or shares off).
  void PlanShare(size_t share, Progress* p);
  // Steps from the share that uses the most per unit of weight until the plan is done.
  void PlanFair(Progress* p);
  // `share`'s next candidate in rank order that the plan may take, reading more of its policy
  // when the buffer runs out; nullptr when it has none.
  const Ranked* NextCandidate(const PrefixCache& cache, size_t share);
  // Whether `share` may still have a victim for this plan (a freed parent, or candidates of its
  // policy not read or not taken yet), without reading its policy.
  bool CanGive(const PrefixCache& cache, size_t share) const;

  std::vector<int32_t> gone_children_;  // by block: children planned away
  std::vector<BlockId> touched_;        // blocks whose gone_children_ to reset
  std::vector<Heap> freed_parents_;     // by share
  std::vector<ShareCursor> cursors_;    // by share (fair plans)
};

}  // namespace kvpool
