// PrefixCache: stats, invariants and the canonical dump.

#include <string>

#include "fmt/format.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s = counters_;
  const internal::RunTreeStats& tree = tree_.stats();
  s.child_scans = tree.child_scans;
  s.runs = tree.runs;
  s.splits = tree.splits;
  s.merges = tree.merges;
  s.nodes = num_blocks_;
  s.full_nodes = num_full_;
  s.evictable = num_evictable_;
  s.candidates = num_tails_;
  for (const ShareSlot& share : shares_) {
    s.candidates += share.policy->size();
    s.shares += share.evictable > 0 || share.charged > 0 ? 1 : 0;
  }
  s.pinned = pinned_blocks_;
  s.namespaces = static_cast<int64_t>(tree_.roots().size());
  return s;
}

// One cached block: class, hash chain, candidacy and pins (its place is the tree's to check).
absl::Status PrefixCache::CheckBlock(BlockId block,
                                     const absl::flat_hash_map<BlockId, uint32_t>* pins,
                                     absl::flat_hash_map<NamespaceId, int64_t>* pin_held) const {
  const Entry& e = entry(block);
  const int b = block.value();
  const BlockId parent = tree_.Parent(block);
  if (parent != kInvalidBlock && e.priority > entry(parent).priority) {
    return InvariantViolation("block {} outranks its parent", b);
  }
  if (hashes_on_) {
    const BlockHash want =
        tree_.coverage(block) == block_size_
            ? PrefixChainHash(HashOf(parent), tree_.ns_of(block), tree_.Tokens(block))
            : BlockHash{};
    if (hash_[Index(block)] != want)
      return InvariantViolation("block {} has a broken hash chain", b);
  }
  const bool evictable = ShouldBeEvictable(block);
  if (evictable != (e.evictable != 0)) {
    return InvariantViolation("block {} evictability is stale", b);
  }
  const bool candidate = evictable && tree_.IsLeaf(block);
  const bool tail = e.in_tails != 0;
  const bool in_policy = PolicyOf(block).Contains(Key(block));
  if ((e.in_policy != 0) != in_policy) {
    return InvariantViolation("block {} disagrees with the policy on holding it", b);
  }
  if (tail && in_policy) return InvariantViolation("block {} is a tail and in the policy", b);
  if (candidate != (tail || in_policy)) {
    return InvariantViolation("block {} is {}an evictable leaf but {} a candidate", b,
                              candidate ? "" : "not ", candidate ? "not" : "is");
  }
  if (candidate && tail != IsFirstOutTail(block)) {
    return InvariantViolation("block {} is in the wrong candidate list", b);
  }
  if (pins != nullptr) {
    auto it = pins->find(block);
    const uint32_t want = it == pins->end() ? 0 : it->second;
    if (e.pins != want)
      return InvariantViolation("block {} has {} pins, {} expected", b, e.pins, want);
  }
  if (e.pins > e.lock) return InvariantViolation("block {} has more pins than locks", b);
  if (e.kept != 0) return InvariantViolation("block {} is still marked kept by a plan", b);
  const bool charged = e.pins > 0 && pool_->state(block) == BlockState::kCached;
  if (charged != (e.pin_charged != 0)) return InvariantViolation("block {} pin charge is stale", b);
  if (charged) ++(*pin_held)[tree_.ns_of(block)];
  return absl::OkStatus();
}

absl::Status PrefixCache::CheckInvariants(
    const absl::flat_hash_map<BlockId, uint32_t>* expected_locks,
    const absl::flat_hash_map<BlockId, uint32_t>* expected_pins) const {
  KVPOOL_RETURN_IF_ERROR(tree_.CheckInvariants());
  int64_t blocks = 0, full = 0, evictable = 0, pinned = 0, in_policies = 0;
  absl::flat_hash_map<NamespaceId, int64_t> pin_held;
  std::vector<int64_t> share_evictable(shares_.size(), 0);
  for (int32_t b = 0; b < pool_->num_blocks(); ++b) {
    const BlockId block(b);
    const bool held = tree_.Holds(block);
    if (pool_->cache_held(block) != held) {
      return InvariantViolation("block {} cache reference does not match the tree", b);
    }
    if (!held) {
      for (const ShareSlot& share : shares_) {
        if (entry(block).in_tails != 0 || share.policy->Contains(Key(block))) {
          return InvariantViolation("block {} left the tree but is still a candidate", b);
        }
      }
      continue;
    }
    ++blocks;
    full += tree_.coverage(block) == block_size_ ? 1 : 0;
    evictable += ShouldBeEvictable(block) ? 1 : 0;
    in_policies += entry(block).in_policy;
    if (entry(block).share >= shares_.size() || (!shares_on_ && entry(block).share != 0)) {
      return InvariantViolation("block {} belongs to share {} of {}", b, entry(block).share,
                                shares_.size());
    }
    if (shares_on_ && ShouldBeEvictable(block)) ++share_evictable[entry(block).share];
    pinned += entry(block).pins > 0 ? 1 : 0;
    if (expected_locks != nullptr) {
      auto it = expected_locks->find(block);
      const uint32_t want = it == expected_locks->end() ? 0 : it->second;
      if (entry(block).lock != want) {
        return InvariantViolation("block {} has {} locks, {} expected", b, entry(block).lock, want);
      }
    }
    KVPOOL_RETURN_IF_ERROR(CheckBlock(block, expected_pins, &pin_held));
  }
  if (expected_locks != nullptr) {
    for (const auto& [block, n] : *expected_locks) {
      if (!tree_.Holds(block)) {
        return InvariantViolation("block {} is locked {} times but not cached", block.value(), n);
      }
    }
  }
  KVPOOL_RETURN_IF_ERROR(CheckCounts(blocks, full, evictable, pinned, pin_held));
  KVPOOL_RETURN_IF_ERROR(CheckFirstBlocks());
  if (!planner_.clean()) return InvariantViolation("the eviction planner's scratch is not reset");
  return CheckShares(in_policies, share_evictable);
}

absl::Status PrefixCache::CheckShares(int64_t in_policies,
                                      std::span<const int64_t> evictable) const {
  int64_t held = 0;
  for (size_t i = 0; i < shares_.size(); ++i) {
    const ShareSlot& share = shares_[i];
    held += share.policy->size();
    if (shares_on_ && share.evictable != evictable[i]) {
      return InvariantViolation("share {} has {} evictable blocks, {} counted", share.key,
                                evictable[i], share.evictable);
    }
    if (share.charged < 0 || share.weight == 0 || share.weight > kMaxShareWeight) {
      return InvariantViolation("share {} has weight {} and {} charged bytes", share.key,
                                share.weight, share.charged);
    }
    KVPOOL_RETURN_IF_ERROR(share.policy->CheckInvariants());
  }
  if (held != in_policies) {
    return InvariantViolation("the shares' policies hold {} candidates, {} marked", held,
                              in_policies);
  }
  for (const auto& [ns, slot] : share_of_ns_) {
    if (slot == 0 || slot >= shares_.size()) {
      return InvariantViolation("namespace {} is filed under share slot {}", ns.value(), slot);
    }
  }
  return absl::OkStatus();
}

absl::Status PrefixCache::CheckFirstBlocks() const {
  size_t first_full = 0;
  for (int32_t b = 0; b < pool_->num_blocks(); ++b) {
    const BlockId block(b);
    if (!tree_.Holds(block) || tree_.depth(block) != 1 || tree_.coverage(block) != block_size_) {
      continue;
    }
    ++first_full;
    if (!first_blocks_.contains({internal::HashTokens(tree_.Tokens(block)), block})) {
      return InvariantViolation("first block {} is missing from the first-block index", b);
    }
  }
  if (first_full != first_blocks_.size()) {
    return InvariantViolation("first-block index holds {} entries for {} first blocks",
                              first_blocks_.size(), first_full);
  }
  return absl::OkStatus();
}

absl::Status PrefixCache::CheckCounts(
    int64_t blocks, int64_t full, int64_t evictable, int64_t pinned,
    const absl::flat_hash_map<NamespaceId, int64_t>& pin_held) const {
  if (blocks != num_blocks_ || full != num_full_) {
    return InvariantViolation("block counts are stale");
  }
  if (evictable != num_evictable_) {
    return InvariantViolation("{} blocks evictable, {} counted", evictable, num_evictable_);
  }
  if (pinned != pinned_blocks_) {
    return InvariantViolation("{} blocks pinned, {} counted", pinned, pinned_blocks_);
  }
  if (pin_held != pin_held_) return InvariantViolation("pin-held blocks per namespace are stale");
  std::vector<int64_t> by_tally(pin_held_by_tally_.size(), 0);
  for (const auto& [ns, tally] : tally_of_) {
    if (tally == 0 || tally >= by_tally.size()) {
      return InvariantViolation("namespace {} is filed under tally {}", ns.value(), tally);
    }
    auto it = pin_held.find(ns);
    by_tally[tally] += it == pin_held.end() ? 0 : it->second;
  }
  if (by_tally != pin_held_by_tally_) {
    return InvariantViolation("pin-held blocks per tally are stale");
  }
  int64_t tails = 0;
  for (BlockId b = tails_head_; b != kInvalidBlock; b = tail_next_[Index(b)]) {
    if (entry(b).in_tails == 0 || ++tails > num_tails_) {
      return InvariantViolation("the first-out tail list is broken");
    }
  }
  if (tails != num_tails_) {
    return InvariantViolation("{} first-out tails listed, {} counted", tails, num_tails_);
  }
  return absl::OkStatus();
}

std::string PrefixCache::DebugString() const {
  std::string out = fmt::format(
      "cache blocks={} full={} runs={} evictable={} candidates={} pinned={} next_event={}\n",
      num_blocks_, num_full_, tree_.stats().runs, num_evictable_, stats().candidates,
      pinned_blocks_, events_.next_seq());
  auto it = std::back_inserter(out);
  for (int32_t b = 0; b < pool_->num_blocks(); ++b) {
    const BlockId block(b);
    if (!tree_.Holds(block)) continue;
    const Entry& e = entry(block);
    // The run a block belongs to shows as `run=1` on its first block: slots are not printed, so
    // two trees holding the same runs print the same.
    fmt::format_to(it,
                   "b{} ns={} parent={} run={} cov={} lock={} pins={} prio={} hits={} "
                   "candidate={} tokens={}\n",
                   b, tree_.ns_of(block).value(), tree_.Parent(block).value(),
                   tree_.StartsRun(block) ? 1 : 0, tree_.coverage(block), e.lock, e.pins,
                   e.priority, e.hits,
                   e.in_tails != 0    ? "tail"
                   : e.in_policy != 0 ? "policy"
                                      : "no",
                   fmt::join(tree_.Tokens(block), ","));
  }
  return out;
}

}  // namespace kvpool
