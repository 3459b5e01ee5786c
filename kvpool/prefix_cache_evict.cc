// PrefixCache: eviction candidates, eviction plans, node removal and pins (lookup and locking
// live in prefix_cache.cc, publishing in prefix_cache_update.cc).

#include <algorithm>
#include <queue>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "fmt/format.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/check.h"

namespace kvpool {

void PrefixCache::UpdateCandidate(NodeIndex node) {
  if (nodes_[node].block == kInvalidBlock) return;  // a root
  const bool want = state_[node].evictable != 0 && nodes_[node].num_children == 0;
  NodeState& state = state_[node];
  const bool tail = state.in_tails != 0;
  if (want == (tail || state.in_policy != 0)) return;
  if (!want) {
    if (tail) {
      TailRemove(node);
    } else {
      policy_->Remove(node, Facts(node));
      state.in_policy = 0;
    }
  } else if (IsFirstOutTail(node)) {
    TailPush(node);
  } else {
    policy_->Add(node, Facts(node));
    state.in_policy = 1;
  }
}

void PrefixCache::TailPush(NodeIndex node) {
  state_[node].in_tails = 1;
  tail_prev_[node] = tails_tail_;
  tail_next_[node] = kNoNode;
  if (tails_tail_ != kNoNode) {
    tail_next_[tails_tail_] = node;
  } else {
    tails_head_ = node;
  }
  tails_tail_ = node;
  ++num_tails_;
}

void PrefixCache::TailRemove(NodeIndex node) {
  const NodeIndex prev = tail_prev_[node];
  const NodeIndex next = tail_next_[node];
  if (prev != kNoNode) {
    tail_next_[prev] = next;
  } else {
    tails_head_ = next;
  }
  if (next != kNoNode) {
    tail_prev_[next] = prev;
  } else {
    tails_tail_ = prev;
  }
  tail_prev_[node] = tail_next_[node] = kNoNode;
  state_[node].in_tails = 0;
  --num_tails_;
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void PrefixCache::FreeSlot(NodeIndex node,
                                                               const TraceContext& ctx) {
  const BlockId block = nodes_[node].block;
  if (state_[node].depth == 1 && nodes_[node].coverage == block_size_) UnindexFirstBlock(node);
  node_of_block_[static_cast<size_t>(block.value())] = kNoNode;
  KVPOOL_CHECK_OK(pool_->DropCacheRef(block, ctx));
  nodes_[node].parent = kNoNode;
  nodes_[node].block = kInvalidBlock;
  nodes_[node].coverage = 0;
  nodes_[node].priority = 0;
  nodes_[node].token_hash = 0;
  state_[node].depth = 0;
  state_[node].hits = 0;
  state_[node].retain = 0;
  if (hashes_on_) {  // otherwise never set
    state_[node].fingerprint = 0;
    hash_[node] = BlockHash{};
  }
  free_nodes_.push_back(node);
  --num_nodes_;
  ++counters_.evicted;
}

void PrefixCache::RemoveNode(NodeIndex node, const TraceContext& ctx, bool offer_parent) {
  KVPOOL_CHECK_MSG(nodes_[node].num_children == 0 && nodes_[node].lock == 0,
                   "evicting a prefix-cache node that is not an unlocked leaf");
  if (state_[node].in_tails != 0) {
    TailRemove(node);
  } else if (state_[node].in_policy != 0) {
    policy_->Remove(node, Facts(node));
    state_[node].in_policy = 0;
  }
  if (state_[node].evictable != 0) {
    state_[node].evictable = 0;
    --num_evictable_;
  }
  const bool full = nodes_[node].coverage == block_size_;
  // Asked before OnErase, which forgets what the policy knew of the node.
  const bool below_bar = full && evicted_memory_ > 0 && policy_->below_admission_bar(node);
  if (hears_accesses_) policy_->OnErase(node, Facts(node), now_ns_);
  const NodeIndex parent = nodes_[node].parent;
  if (nodes_[parent].wide == 0 && nodes_[parent].num_children == 1) {
    // An only child of a narrow parent (an evicted chain): it has no siblings to unlink from.
    nodes_[parent].first_child = kNoNode;
    nodes_[parent].num_children = 0;
  } else {
    if (full && nodes_[parent].wide != 0) {  // before UnlinkChild, which may make it narrow
      auto it = children_.find(ChildKey{parent, nodes_[node].token_hash});
      if (it != children_.end() && it->second == node) children_.erase(it);
    }
    UnlinkChild(node);
  }
  if (full) {
    if (events_on_) {
      if (pending_removed_ns_ != ns_[node]) FlushRemoved();
      pending_removed_ns_ = ns_[node];
      pending_removed_.push_back(hash_[node]);
    }
    if (evicted_memory_ > 0) {
      BlockHash& slot = evicted_ring_[evicted_next_];
      if (slot != BlockHash{}) evicted_set_.erase(slot);
      slot = hash_[node];
      evicted_set_[slot] = below_bar;
      evicted_next_ = (evicted_next_ + 1) % evicted_memory_;
    }
    --num_full_;
  }
  FreeSlot(node, ctx);
  if (offer_parent) UpdateCandidate(parent);  // may have become a leaf
}

// The plan walks the first-out tails, then the policy's candidates in rank order (the class
// comment in internal/eviction_planner.h).
int64_t EvictionPlanner::Plan(const PrefixCache& cache, int64_t blocks,
                              std::span<const NodeIndex> keep, std::vector<NodeIndex>* victims) {
  if (blocks <= 0) return 0;
  const std::vector<PrefixCache::Node>& nodes = cache.nodes_;
  const std::vector<PrefixCache::NodeState>& state = cache.state_;
  if (gone_children_.size() < nodes.size()) {
    gone_children_.resize(nodes.size(), 0);
    kept_.resize(nodes.size(), 0);
  }
  freed_parents_.clear();
  touched_.clear();
  for (NodeIndex node : keep) kept_[node] = 1;
  constexpr auto kLater = std::greater<>();
  int64_t freed = 0;
  // `ranked`: `node` is taken in rank order (not as a first-out tail), so nothing untaken ranks
  // below it.
  auto take = [&](NodeIndex node, bool ranked) {
    while (true) {
      victims->push_back(node);
      // A block still read by queued device work retires instead of freeing.
      if (cache.pool_->FencesPassed(nodes[node].block)) ++freed;
      const NodeIndex parent = nodes[node].parent;
      if (nodes[parent].block == kInvalidBlock) return;  // a root
      const int32_t children = nodes[parent].num_children;
      if (children != 1) {  // an only child frees its parent without bookkeeping
        if (gone_children_[parent]++ == 0) touched_.push_back(parent);
        if (gone_children_[parent] != children) return;
      }
      if (state[parent].evictable == 0 || kept_[parent] != 0) return;
      // A chain released at once, deepest first: the parent's release order is the next one
      // in the same class, so under a release-ordered policy nothing can rank between the two
      // and the parent is the next victim. No heap, no Rank().
      if (ranked && cache.ranks_by_release_ && freed < blocks &&
          nodes[parent].priority == nodes[node].priority &&
          state[parent].release_seq == state[node].release_seq + 1) {
        node = parent;
        continue;
      }
      freed_parents_.emplace_back(cache.RankOf(parent), parent);
      std::push_heap(freed_parents_.begin(), freed_parents_.end(), kLater);
      return;
    }
  };
  auto take_parent = [&] {
    std::pop_heap(freed_parents_.begin(), freed_parents_.end(), kLater);
    const NodeIndex parent = freed_parents_.back().second;
    freed_parents_.pop_back();
    take(parent, /*ranked=*/true);
  };
  for (NodeIndex node = cache.tails_head_; node != kNoNode && freed < blocks;
       node = cache.tail_next_[node]) {
    if (kept_[node] == 0) take(node, /*ranked=*/false);
  }
  if (freed < blocks) {
    cache.policy_->Visit(cache.now_ns_, [&](NodeIndex node, const EvictionRank& rank) {
      while (freed < blocks && !freed_parents_.empty() && freed_parents_.front().first < rank) {
        take_parent();
      }
      if (freed >= blocks) return false;
      if (kept_[node] == 0) take(node, /*ranked=*/true);
      return freed < blocks;
    });
  }
  while (freed < blocks && !freed_parents_.empty()) take_parent();
  for (NodeIndex node : keep) kept_[node] = 0;
  for (NodeIndex node : touched_) gone_children_[node] = 0;
  return freed;
}

bool EvictionPlanner::clean() const {
  return std::all_of(gone_children_.begin(), gone_children_.end(),
                     [](int32_t n) { return n == 0; }) &&
         std::all_of(kept_.begin(), kept_.end(), [](uint8_t k) { return k == 0; });
}

void PrefixCache::Evict(std::span<const NodeIndex> victims, const TraceContext& ctx) {
  for (size_t i = 0; i < victims.size(); ++i) {
    const NodeIndex node = victims[i];
    KVPOOL_CHECK(ShouldBeEvictable(node));
    if (state_[node].in_tails != 0) ++counters_.tails_evicted;
    // An evicted chain: a plan takes a parent right after its last child unless another
    // candidate ranks lower. When the parent is the next victim it is not offered to the
    // policy in between.
    const NodeIndex parent = nodes_[node].parent;
    const bool parent_next = i + 1 < victims.size() && victims[i + 1] == parent;
    // Inside an evicted chain (most victims): a full node, no candidate (it had a child until
    // the plan took it), its narrow parent's only child and next victim, and nothing to record
    // per block. RemoveNode() in a few stores.
    if (parent_next && lean_evictions_ && state_[node].in_policy == 0 &&
        state_[node].in_tails == 0 && nodes_[node].coverage == block_size_ &&
        nodes_[parent].wide == 0 && nodes_[parent].num_children == 1 &&
        nodes_[node].num_children == 0) {
      if (state_[node].evictable != 0) {
        state_[node].evictable = 0;
        --num_evictable_;
      }
      nodes_[parent].first_child = kNoNode;
      nodes_[parent].num_children = 0;
      --num_full_;
      FreeSlot(node, ctx);
      continue;
    }
    RemoveNode(node, ctx, /*offer_parent=*/!parent_next);
  }
  FlushRemoved();
}

int64_t PrefixCache::EvictUpTo(int64_t blocks, const TraceContext& ctx) {
  std::vector<NodeIndex> victims;
  PlanEviction(blocks, {}, &victims);
  if (static_cast<int64_t>(victims.size()) > blocks) victims.resize(static_cast<size_t>(blocks));
  Evict(victims, ctx);
  return static_cast<int64_t>(victims.size());
}

absl::Status PrefixCache::Clear(const TraceContext& ctx) {
  if (num_evictable_ != num_nodes_) {
    return absl::FailedPreconditionError(
        fmt::format("{} of {} cached blocks are in use by sequences or pins",
                    num_nodes_ - num_evictable_, num_nodes_));
  }
  // Every node is evictable, so one plan takes them all, leaves before their parents.
  while (num_nodes_ > 0) {
    std::vector<NodeIndex> victims;
    PlanEviction(num_nodes_ + 1, {}, &victims);
    KVPOOL_CHECK(!victims.empty());
    for (NodeIndex node : victims) RemoveNode(node, ctx);
  }
  pending_removed_.clear();  // announced as one AllBlocksCleared instead
  if (events_on_) {
    events_.Append(KvEvent{.type = KvEventType::kAllBlocksCleared, .block_size = block_size_});
  }
  return absl::OkStatus();
}

void PrefixCache::UpdatePinCharge(NodeIndex node) {
  const bool want = state_[node].pins > 0 && nodes_[node].block != kInvalidBlock &&
                    pool_->state(nodes_[node].block) == BlockState::kCached;
  if (want == (state_[node].pin_charged != 0)) return;
  state_[node].pin_charged = want ? 1 : 0;
  auto it = pin_held_.try_emplace(ns_[node], 0).first;
  it->second += want ? 1 : -1;
  if (it->second == 0) pin_held_.erase(it);
}

void PrefixCache::Pin(std::span<const NodeIndex> nodes, int priority) {
  KVPOOL_CHECK(priority >= 0 && priority < kNumPriorities);
  for (NodeIndex node : nodes) {
    KVPOOL_CHECK(nodes_[node].block != kInvalidBlock);
    Lock(node);  // first: a locked node is no candidate, so its class may change
    if (state_[node].pins++ == 0) ++pinned_nodes_;
    nodes_[node].priority = static_cast<int8_t>(std::max<int>(nodes_[node].priority, priority));
    UpdatePinCharge(node);
  }
}

void PrefixCache::Unpin(std::span<const NodeIndex> nodes) {
  // Deepest first, as sequences release: a node is released after its descendants.
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    const NodeIndex node = *it;
    KVPOOL_CHECK_MSG(state_[node].pins > 0, "unpin of a prefix-cache node that is not pinned");
    if (--state_[node].pins == 0) --pinned_nodes_;
    UpdatePinCharge(node);
    Unlock(node);
  }
}

int64_t PrefixCache::PinCharge(std::span<const NodeIndex> nodes) const {
  int64_t n = 0;
  for (NodeIndex node : nodes) {
    n += state_[node].pins == 0 && pool_->state(nodes_[node].block) == BlockState::kCached ? 1 : 0;
  }
  return n;
}

int64_t PrefixCache::NewlyPinned(std::span<const NodeIndex> nodes) const {
  int64_t n = 0;
  for (NodeIndex node : nodes) n += state_[node].pins == 0 ? 1 : 0;
  return n;
}

int64_t PrefixCache::pin_held(NamespaceId ns) const {
  auto it = pin_held_.find(ns);
  return it == pin_held_.end() ? 0 : it->second;
}

}  // namespace kvpool
