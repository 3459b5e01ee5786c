// PrefixCache: stats, invariants and the canonical dump.

#include <algorithm>
#include <string>

#include "fmt/format.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/errors.h"

namespace kvpool {

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s = counters_;
  s.child_scans = child_scans_;
  s.nodes = num_nodes_;
  s.full_nodes = num_full_;
  s.evictable = num_evictable_;
  s.candidates = policy_->size() + num_tails_;
  s.pinned = pinned_nodes_;
  s.namespaces = static_cast<int64_t>(roots_.size());
  return s;
}

// One cached (non-root) node: shape, coverage, hash chain, candidacy and pins.
absl::Status PrefixCache::CheckNode(NodeIndex node,
                                    const absl::flat_hash_map<NodeIndex, uint32_t>* pins,
                                    absl::flat_hash_map<NamespaceId, int64_t>* pin_held) const {
  const NodeIndex parent = nodes_[node].parent;
  const BlockId block = nodes_[node].block;
  if (parent == kNoNode || (nodes_[parent].block == kInvalidBlock && Root(ns_[node]) != parent)) {
    return InvariantViolation("node {} has no live parent", node);
  }
  if (nodes_[parent].block != kInvalidBlock && nodes_[parent].coverage != block_size_) {
    return InvariantViolation("node {} hangs under partial node {}", node, parent);
  }
  if (nodes_[node].coverage <= 0 || nodes_[node].coverage > block_size_) {
    return InvariantViolation("node {} has coverage {}", node, nodes_[node].coverage);
  }
  if (node_of_block_[static_cast<size_t>(block.value())] != node || !pool_->cache_held(block)) {
    return InvariantViolation("node {} and block {} do not point at each other", node,
                              block.value());
  }
  if (ns_[node] != ns_[parent]) return InvariantViolation("node {} left its namespace", node);
  if (nodes_[parent].block != kInvalidBlock && nodes_[node].priority > nodes_[parent].priority) {
    return InvariantViolation("node {} outranks its parent", node);
  }
  if (state_[node].depth != state_[parent].depth + 1)
    return InvariantViolation("node {} has a stale depth", node);
  if (nodes_[node].coverage == block_size_) {
    const BlockHash want =
        hashes_on_ ? PrefixChainHash(hash_[parent], ns_[node], Tokens(node)) : BlockHash{};
    if (hash_[node] != want ||
        state_[node].fingerprint != (hashes_on_ ? BlockFingerprint(want) : 0)) {
      return InvariantViolation("node {} has a broken hash chain", node);
    }
    if (FindFull(parent, Tokens(node)) == kNoNode)
      return InvariantViolation("node {} is not indexed", node);
  }
  const bool evictable = ShouldBeEvictable(node);
  if (evictable != (state_[node].evictable != 0))
    return InvariantViolation("node {} evictability is stale", node);
  const bool candidate = evictable && nodes_[node].num_children == 0;
  const bool tail = state_[node].in_tails != 0;
  if ((state_[node].in_policy != 0) != policy_->Contains(node)) {
    return InvariantViolation("node {} disagrees with the policy on holding it", node);
  }
  if (tail && policy_->Contains(node))
    return InvariantViolation("node {} is a tail and in the policy", node);
  if (candidate != (tail || policy_->Contains(node))) {
    return InvariantViolation("node {} is {}an evictable leaf but {} a candidate", node,
                              candidate ? "" : "not ", candidate ? "not" : "is");
  }
  if (candidate && tail != IsFirstOutTail(node)) {
    return InvariantViolation("node {} is in the wrong candidate list", node);
  }
  if (pins != nullptr) {
    auto it = pins->find(node);
    const uint32_t want = it == pins->end() ? 0 : it->second;
    if (state_[node].pins != want)
      return InvariantViolation("node {} has {} pins, {} expected", node, state_[node].pins, want);
  }
  if (state_[node].pins > nodes_[node].lock)
    return InvariantViolation("node {} has more pins than locks", node);
  const bool charged = state_[node].pins > 0 && pool_->state(block) == BlockState::kCached;
  if (charged != (state_[node].pin_charged != 0))
    return InvariantViolation("node {} pin charge is stale", node);
  if (charged) ++(*pin_held)[ns_[node]];
  return absl::OkStatus();
}

absl::Status PrefixCache::CheckInvariants(
    const absl::flat_hash_map<NodeIndex, uint32_t>* expected_locks,
    const absl::flat_hash_map<NodeIndex, uint32_t>* expected_pins) const {
  int64_t nodes = 0, full = 0, evictable = 0, pinned = 0;
  absl::flat_hash_map<NamespaceId, int64_t> pin_held;
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(nodes_.size()); ++node) {
    const bool root = nodes_[node].block == kInvalidBlock && nodes_[node].parent == kNoNode &&
                      Root(ns_[node]) == node && ns_[node] != kNoNamespace;
    if (nodes_[node].block == kInvalidBlock && !root) {  // free slot
      if (state_[node].in_tails != 0 || policy_->Contains(node) || state_[node].pins != 0) {
        return InvariantViolation("free node slot {} is still a candidate or pinned", node);
      }
      continue;
    }
    int32_t children = 0;
    for (NodeIndex c = nodes_[node].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
      if (nodes_[c].parent != node)
        return InvariantViolation("node {} lists child {} of another parent", node, c);
      ++children;
    }
    if (children != nodes_[node].num_children)
      return InvariantViolation("node {} child count is stale", node);
    if (expected_locks != nullptr) {
      auto it = expected_locks->find(node);
      const uint32_t want = it == expected_locks->end() ? 0 : it->second;
      if (nodes_[node].lock != want)
        return InvariantViolation("node {} has {} locks, {} expected", node, nodes_[node].lock,
                                  want);
    }
    if (root) continue;
    ++nodes;
    full += nodes_[node].coverage == block_size_ ? 1 : 0;
    evictable += ShouldBeEvictable(node) ? 1 : 0;
    pinned += state_[node].pins > 0 ? 1 : 0;
    if (absl::Status s = CheckNode(node, expected_pins, &pin_held); !s.ok()) return s;
  }
  for (size_t b = 0; b < node_of_block_.size(); ++b) {
    if (pool_->cache_held(BlockId(static_cast<int32_t>(b))) != (node_of_block_[b] != kNoNode)) {
      return InvariantViolation("block {} cache reference does not match the tree", b);
    }
  }
  if (nodes != num_nodes_ || full != num_full_) return InvariantViolation("node counts are stale");
  if (absl::Status s = CheckFirstBlocks(); !s.ok()) return s;
  if (evictable != num_evictable_) {
    return InvariantViolation("{} nodes evictable, {} counted", evictable, num_evictable_);
  }
  if (pinned != pinned_nodes_)
    return InvariantViolation("{} nodes pinned, {} counted", pinned, pinned_nodes_);
  if (pin_held != pin_held_) return InvariantViolation("pin-held blocks per namespace are stale");
  int64_t tails = 0;
  for (NodeIndex n = tails_head_; n != kNoNode; n = tail_next_[n]) {
    if (state_[n].in_tails == 0 || ++tails > num_tails_)
      return InvariantViolation("the first-out tail list is broken");
  }
  if (tails != num_tails_)
    return InvariantViolation("{} first-out tails listed, {} counted", tails, num_tails_);
  if (static_cast<int64_t>(children_.size()) > full)
    return InvariantViolation("child index has stale keys");
  if (absl::Status s = CheckChains(); !s.ok()) return s;
  if (!planner_.clean()) return InvariantViolation("the eviction planner's scratch is not reset");
  return policy_->CheckInvariants();
}

// The first-token chains hold exactly the children of wide parents, each under its own key; the
// full-child index only theirs, and each full child of a wide parent carries its token hash
// (RemoveNode finds its index entry by it).
absl::Status PrefixCache::CheckFirstBlocks() const {
  size_t first_full = 0;
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(nodes_.size()); ++node) {
    const bool first = nodes_[node].block != kInvalidBlock && state_[node].depth == 1 &&
                       nodes_[node].coverage == block_size_;
    if (!first) continue;
    ++first_full;
    if (!first_blocks_.contains({internal::HashTokens(Tokens(node)), node})) {
      return InvariantViolation("first block {} is missing from the first-block index", node);
    }
  }
  if (first_full != first_blocks_.size()) {
    return InvariantViolation("first-block index holds {} entries for {} first blocks",
                              first_blocks_.size(), first_full);
  }
  return absl::OkStatus();
}

absl::Status PrefixCache::CheckChains() const {
  int64_t expected = 0;
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(nodes_.size()); ++node) {
    if (nodes_[node].wide != 0) {
      if (nodes_[node].num_children == 0)
        return InvariantViolation("n{} is wide with no child", node);
      expected += nodes_[node].num_children;
      for (NodeIndex c = nodes_[node].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
        if (nodes_[c].coverage == block_size_ &&
            nodes_[c].token_hash != internal::HashTokens(Tokens(c))) {
          return InvariantViolation("full child n{} of wide n{} has a stale token hash", c, node);
        }
      }
    } else if (nodes_[node].num_children > kWideFanout) {
      return InvariantViolation("n{} has {} children but is not wide", node,
                                nodes_[node].num_children);
    }
  }
  int64_t chained = 0;
  for (const auto& [key, head] : chains_) {
    NodeIndex prev = kNoNode;
    for (NodeIndex n = head; n != kNoNode; prev = n, n = chain_next_[n]) {
      if (nodes_[n].parent != key.parent || nodes_[key.parent].wide == 0 ||
          nodes_[n].coverage == 0 || Tokens(n)[0] != key.token || chain_prev_[n] != prev ||
          ++chained > expected) {
        return InvariantViolation("first-token chain of n{} token {} is broken at n{}", key.parent,
                                  key.token, n);
      }
    }
  }
  if (chained != expected) {
    return InvariantViolation("{} children of wide nodes chained, {} expected", chained, expected);
  }
  // The full-child index holds children of wide parents only, each under its own token hash.
  for (const auto& [key, child] : children_) {
    if (nodes_[key.parent].wide == 0 || nodes_[child].parent != key.parent ||
        nodes_[child].coverage != block_size_ || nodes_[child].token_hash != key.token_hash) {
      return InvariantViolation("child index entry n{} -> n{} is stale", key.parent, child);
    }
  }
  return absl::OkStatus();
}

std::string PrefixCache::DebugString() const {
  std::string out = fmt::format(
      "cache nodes={} full={} evictable={} candidates={} pinned={} next_event={}\n", num_nodes_,
      num_full_, num_evictable_, policy_->size() + num_tails_, pinned_nodes_, events_.next_seq());
  auto it = std::back_inserter(out);
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(nodes_.size()); ++node) {
    if (nodes_[node].block == kInvalidBlock) continue;
    fmt::format_to(it,
                   "n{} parent={} block={} cov={} lock={} pins={} prio={} hits={} candidate={} "
                   "tokens={}\n",
                   node, nodes_[node].parent, nodes_[node].block.value(), nodes_[node].coverage,
                   nodes_[node].lock, state_[node].pins, nodes_[node].priority, state_[node].hits,
                   state_[node].in_tails != 0 ? "tail"
                   : policy_->Contains(node)  ? "policy"
                                              : "no",
                   fmt::join(Tokens(node), ","));
  }
  return out;
}

}  // namespace kvpool
