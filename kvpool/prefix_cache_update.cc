// PrefixCache: publishing, eviction, events and invariants (lookup and locking live in
// prefix_cache.cc).

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "fmt/format.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"

namespace kvpool {
using internal::HashTokens;
using internal::StartsWith;

NodeIndex PrefixCache::Insert(NodeIndex parent, std::span<const int32_t> tokens, BlockId block,
                              int priority, const TraceContext& ctx) {
  const NodeIndex node = NewNode();
  parent_[node] = parent;
  prev_sibling_[node] = kNoNode;
  next_sibling_[node] = first_child_[parent];
  if (first_child_[parent] != kNoNode) prev_sibling_[first_child_[parent]] = node;
  first_child_[parent] = node;
  ++num_children_[parent];
  block_[node] = block;
  coverage_[node] = static_cast<int32_t>(tokens.size());
  lock_[node] = 1;  // the committing sequence follows it
  priority_[node] = static_cast<int8_t>(priority);
  ns_[node] = ns_[parent];
  std::copy(tokens.begin(), tokens.end(),
            tokens_.begin() + static_cast<ptrdiff_t>(node) * block_size_);
  // A node's class is at least its descendants' (the policy's leaf-first promise). The
  // ancestors are locked by the committing sequence, so none is in the policy's lists now.
  for (NodeIndex a = parent; a != kNoNode && block_[a] != kInvalidBlock && priority_[a] < priority;
       a = parent_[a]) {
    priority_[a] = static_cast<int8_t>(priority);
  }
  node_of_block_[static_cast<size_t>(block.value())] = node;
  KVPOOL_CHECK_OK(pool_->AddCacheRef(block, ctx));
  ++num_nodes_;
  ++counters_.inserted;
  if (coverage_[node] == block_size_) MakeFull(node);
  return node;
}

void PrefixCache::MakeFull(NodeIndex node) {
  const NodeIndex parent = parent_[node];
  token_hash_[node] = HashTokens(Tokens(node));
  hash_[node] = PrefixChainHash(hash_[parent], ns_[node], Tokens(node));
  // A 64-bit collision with a different block leaves this one out of the index; lookups still
  // find it by scanning the children.
  children_.try_emplace(ChildKey{parent, token_hash_[node]}, node);
  ++num_full_;
}

void PrefixCache::Widen(NodeIndex node, std::span<const int32_t> tokens) {
  KVPOOL_DCHECK(StartsWith(tokens, Tokens(node)));
  std::copy(tokens.begin(), tokens.end(),
            tokens_.begin() + static_cast<ptrdiff_t>(node) * block_size_);
  coverage_[node] = static_cast<int32_t>(tokens.size());
  ++counters_.widened;
  if (coverage_[node] == block_size_) MakeFull(node);
}

void PrefixCache::Commit(NamespaceId ns, std::span<const int32_t> tokens,
                         std::span<const BlockId> table, int priority, CachePath* path,
                         const TraceContext& ctx) {
  const size_t bs = static_cast<size_t>(block_size_);
  NodeIndex parent = path->full.empty() ? RootOrCreate(ns) : path->full.back();
  std::vector<NodeIndex> announced;  // nodes that became full here, in chain order
  auto flush = [&] {
    if (!announced.empty()) Announce(announced.front(), announced.back());
    announced.clear();
  };

  for (size_t k = path->full.size(); (k + 1) * bs <= tokens.size(); ++k) {
    const std::span<const int32_t> block = tokens.subspan(k * bs, bs);
    NodeIndex child = FindFull(parent, block);
    bool fresh = false;
    if (path->partial != kNoNode) {
      // The partial node sat at this position: it is either the sequence's own block, now
      // complete (widen it into the full node), or someone else's that we leave.
      const NodeIndex p = path->partial;
      path->partial = kNoNode;
      if (child == kNoNode && block_[p] == table[k] && parent_[p] == parent) {
        Widen(p, block);
        child = p;  // its lock moves into path->full
        fresh = true;
      } else {
        Unlock(p);
      }
    }
    if (child == kNoNode) {
      const NodeIndex owner = node_of_block_[static_cast<size_t>(table[k].value())];
      if (owner == kNoNode) {
        child = Insert(parent, block, table[k], priority, ctx);
        fresh = true;
      } else if (parent_[owner] == parent && coverage_[owner] < block_size_ &&
                 StartsWith(block, Tokens(owner))) {
        // The sequence's own earlier rewind endpoint (a Truncate dropped it from the path).
        Widen(owner, block);
        Lock(owner);
        child = owner;
        fresh = true;
      } else {
        break;  // the block is published elsewhere under other tokens: stop here
      }
    } else if (!fresh) {
      Lock(child);
    }
    if (fresh) {
      if (!announced.empty() && parent != announced.back()) flush();
      announced.push_back(child);
    } else {
      flush();
    }
    RemoveDominated(child, ctx);
    path->full.push_back(child);
    parent = child;
  }
  flush();

  const size_t done = path->full.size() * bs;
  if (done >= tokens.size() || tokens.size() - done >= bs) return;
  // The trailing partial block.
  const std::span<const int32_t> block = tokens.subspan(done);
  const BlockId mine = table[path->full.size()];
  const NodeIndex cur = path->partial;
  if (cur != kNoNode && parent_[cur] == parent && StartsWith(Tokens(cur), block)) return;
  if (NodeIndex s = Covering(parent, block, cur); s != kNoNode) {
    Lock(s);
    if (cur != kNoNode) Unlock(cur);
    path->partial = s;
    return;
  }
  const NodeIndex owner = node_of_block_[static_cast<size_t>(mine.value())];
  if (owner != kNoNode) {
    if (parent_[owner] == parent && StartsWith(block, Tokens(owner))) {
      if (coverage_[owner] < static_cast<int32_t>(block.size())) Widen(owner, block);
      if (owner != cur) {
        Lock(owner);
        if (cur != kNoNode) Unlock(cur);
        path->partial = owner;
      }
      RemoveDominated(owner, ctx);
    }
    return;
  }
  const NodeIndex node = Insert(parent, block, mine, priority, ctx);
  if (cur != kNoNode) Unlock(cur);
  path->partial = node;
  RemoveDominated(node, ctx);
}

void PrefixCache::RemoveDominated(NodeIndex node, const TraceContext& ctx) {
  const std::span<const int32_t> mine = Tokens(node);
  for (NodeIndex s = first_child_[parent_[node]]; s != kNoNode;) {
    const NodeIndex next = next_sibling_[s];
    if (s != node && coverage_[s] < block_size_ && StartsWith(mine, Tokens(s)) &&
        ShouldBeEvictable(s)) {
      RemoveNode(s, ctx);
      ++counters_.dominated;
    }
    s = next;
  }
  FlushRemoved();
}

void PrefixCache::RemoveNode(NodeIndex node, const TraceContext& ctx) {
  KVPOOL_CHECK_MSG(num_children_[node] == 0 && lock_[node] == 0,
                   "evicting a prefix-cache node that is not an unlocked leaf");
  if (policy_->Contains(node)) policy_->Remove(node);
  const NodeIndex parent = parent_[node];
  if (prev_sibling_[node] != kNoNode) {
    next_sibling_[prev_sibling_[node]] = next_sibling_[node];
  } else {
    first_child_[parent] = next_sibling_[node];
  }
  if (next_sibling_[node] != kNoNode) prev_sibling_[next_sibling_[node]] = prev_sibling_[node];
  --num_children_[parent];
  if (coverage_[node] == block_size_) {
    auto it = children_.find(ChildKey{parent, token_hash_[node]});
    if (it != children_.end() && it->second == node) children_.erase(it);
    if (pending_removed_ns_ != ns_[node]) FlushRemoved();
    pending_removed_ns_ = ns_[node];
    pending_removed_.push_back(hash_[node]);
    if (evicted_memory_ > 0) {
      BlockHash& slot = evicted_ring_[evicted_next_];
      if (slot != BlockHash{}) evicted_set_.erase(slot);
      slot = hash_[node];
      evicted_set_.insert(slot);
      evicted_next_ = (evicted_next_ + 1) % evicted_memory_;
    }
    --num_full_;
  }
  const BlockId block = block_[node];
  node_of_block_[static_cast<size_t>(block.value())] = kNoNode;
  KVPOOL_CHECK_OK(pool_->DropCacheRef(block, ctx));
  parent_[node] = kNoNode;
  next_sibling_[node] = prev_sibling_[node] = kNoNode;
  block_[node] = kInvalidBlock;
  coverage_[node] = 0;
  priority_[node] = 0;
  hash_[node] = BlockHash{};
  free_nodes_.push_back(node);
  --num_nodes_;
  ++counters_.evicted;
}

int64_t PrefixCache::PlanEviction(int64_t blocks, std::span<const NodeIndex> keep,
                                  std::vector<NodeIndex>* victims) const {
  if (blocks <= 0) return 0;
  const absl::flat_hash_set<NodeIndex> kept(keep.begin(), keep.end());
  absl::flat_hash_map<NodeIndex, int32_t> gone_children;  // children planned away
  int64_t freed = 0;
  for (NodeIndex node = policy_->Victim(); node != kNoNode && freed < blocks;
       node = policy_->After(node)) {
    if (kept.contains(node)) continue;
    auto it = gone_children.find(node);
    if (num_children_[node] - (it == gone_children.end() ? 0 : it->second) > 0) continue;
    victims->push_back(node);
    ++gone_children[parent_[node]];
    // A block still read by queued device work retires instead of freeing.
    if (pool_->FencesPassed(block_[node])) ++freed;
  }
  return freed;
}

void PrefixCache::Evict(std::span<const NodeIndex> victims, const TraceContext& ctx) {
  for (NodeIndex node : victims) {
    KVPOOL_CHECK(ShouldBeEvictable(node));
    RemoveNode(node, ctx);
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
  if (policy_->size() != num_nodes_) {
    return absl::FailedPreconditionError(
        fmt::format("{} of {} cached blocks are in use by sequences", num_nodes_ - policy_->size(),
                    num_nodes_));
  }
  // Every node is evictable; each plan takes every node that is a leaf once the ones before it
  // are gone, so a few rounds empty the tree.
  while (num_nodes_ > 0) {
    std::vector<NodeIndex> victims;
    PlanEviction(num_nodes_ + 1, {}, &victims);
    KVPOOL_CHECK(!victims.empty());
    for (NodeIndex node : victims) RemoveNode(node, ctx);
  }
  pending_removed_.clear();  // announced as one AllBlocksCleared instead
  events_.Append(KvEvent{.type = KvEventType::kAllBlocksCleared, .block_size = block_size_});
  return absl::OkStatus();
}

void PrefixCache::Announce(NodeIndex first, NodeIndex last) {
  KvEvent e{.type = KvEventType::kBlockStored, .ns = ns_[first], .block_size = block_size_};
  std::vector<NodeIndex> chain;
  for (NodeIndex n = last;; n = parent_[n]) {
    chain.push_back(n);
    if (n == first) break;
  }
  std::reverse(chain.begin(), chain.end());
  for (NodeIndex n : chain) {
    e.block_hashes.push_back(hash_[n]);
    const std::span<const int32_t> t = Tokens(n);
    e.token_ids.insert(e.token_ids.end(), t.begin(), t.end());
  }
  if (block_[parent_[first]] != kInvalidBlock) e.parent_hash = hash_[parent_[first]];
  events_.Append(std::move(e));
}

void PrefixCache::FlushRemoved() {
  if (pending_removed_.empty()) return;
  events_.Append(KvEvent{.type = KvEventType::kBlockRemoved,
                         .ns = pending_removed_ns_,
                         .block_hashes = std::move(pending_removed_),
                         .block_size = block_size_});
  pending_removed_.clear();
}

std::vector<KvEvent> PrefixCache::SnapshotEvents(uint64_t* resume_seq) const {
  std::vector<KvEvent> out;
  std::vector<NodeIndex> stack;
  for (const auto& [ns, root] : roots_) stack.push_back(root);
  while (!stack.empty()) {  // parents before children
    const NodeIndex node = stack.back();
    stack.pop_back();
    for (NodeIndex c = first_child_[node]; c != kNoNode; c = next_sibling_[c]) {
      if (coverage_[c] != block_size_) continue;
      KvEvent e{.type = KvEventType::kBlockStored, .ns = ns_[c], .block_size = block_size_};
      e.block_hashes.push_back(hash_[c]);
      if (block_[node] != kInvalidBlock) e.parent_hash = hash_[node];
      const std::span<const int32_t> t = Tokens(c);
      e.token_ids.assign(t.begin(), t.end());
      e.epoch = events_.epoch();
      out.push_back(std::move(e));
      stack.push_back(c);
    }
  }
  *resume_seq = events_.next_seq();
  return out;
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s = counters_;
  s.nodes = num_nodes_;
  s.full_nodes = num_full_;
  s.evictable = policy_->size();
  s.namespaces = static_cast<int64_t>(roots_.size());
  return s;
}

absl::Status PrefixCache::CheckInvariants(
    const absl::flat_hash_map<NodeIndex, uint32_t>* expected_locks) const {
  int64_t nodes = 0, full = 0, evictable = 0;
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(parent_.size()); ++node) {
    const bool root = block_[node] == kInvalidBlock && parent_[node] == kNoNode &&
                      Root(ns_[node]) == node && ns_[node] != kNoNamespace;
    if (block_[node] == kInvalidBlock && !root) continue;  // free slot
    int32_t children = 0;
    for (NodeIndex c = first_child_[node]; c != kNoNode; c = next_sibling_[c]) {
      if (parent_[c] != node)
        return InvariantViolation("node {} lists child {} of another parent", node, c);
      ++children;
    }
    if (children != num_children_[node])
      return InvariantViolation("node {} child count is stale", node);
    if (expected_locks != nullptr) {
      auto it = expected_locks->find(node);
      const uint32_t want = it == expected_locks->end() ? 0 : it->second;
      if (lock_[node] != want)
        return InvariantViolation("node {} has {} locks, {} expected", node, lock_[node], want);
    }
    if (root) continue;
    ++nodes;
    const NodeIndex parent = parent_[node];
    const BlockId block = block_[node];
    if (parent == kNoNode || (block_[parent] == kInvalidBlock && Root(ns_[node]) != parent)) {
      return InvariantViolation("node {} has no live parent", node);
    }
    if (block_[parent] != kInvalidBlock && coverage_[parent] != block_size_) {
      return InvariantViolation("node {} hangs under partial node {}", node, parent);
    }
    if (coverage_[node] <= 0 || coverage_[node] > block_size_) {
      return InvariantViolation("node {} has coverage {}", node, coverage_[node]);
    }
    if (node_of_block_[static_cast<size_t>(block.value())] != node || !pool_->cache_held(block)) {
      return InvariantViolation("node {} and block {} do not point at each other", node,
                                block.value());
    }
    if (ns_[node] != ns_[parent]) return InvariantViolation("node {} left its namespace", node);
    if (block_[parent] != kInvalidBlock && priority_[node] > priority_[parent]) {
      return InvariantViolation("node {} outranks its parent", node);
    }
    if (coverage_[node] == block_size_) {
      ++full;
      if (hash_[node] != PrefixChainHash(hash_[parent], ns_[node], Tokens(node))) {
        return InvariantViolation("node {} has a broken hash chain", node);
      }
      if (FindFull(parent, Tokens(node)) == kNoNode)
        return InvariantViolation("node {} is not indexed", node);
    }
    const bool should = ShouldBeEvictable(node);
    if (should != policy_->Contains(node)) {
      return InvariantViolation("node {} is {}evictable but the policy {} it", node,
                                should ? "" : "not ", should ? "lacks" : "holds");
    }
    evictable += should;
  }
  for (size_t b = 0; b < node_of_block_.size(); ++b) {
    if (pool_->cache_held(BlockId(static_cast<int32_t>(b))) != (node_of_block_[b] != kNoNode)) {
      return InvariantViolation("block {} cache reference does not match the tree", b);
    }
  }
  if (nodes != num_nodes_ || full != num_full_) return InvariantViolation("node counts are stale");
  if (evictable != policy_->size())
    return InvariantViolation("policy holds {} nodes, {} evictable", policy_->size(), evictable);
  if (static_cast<int64_t>(children_.size()) > full)
    return InvariantViolation("child index has stale keys");
  return absl::OkStatus();
}

std::string PrefixCache::DebugString() const {
  std::string out = fmt::format("cache nodes={} full={} evictable={} next_event={}\n", num_nodes_,
                                num_full_, policy_->size(), events_.next_seq());
  auto it = std::back_inserter(out);
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(parent_.size()); ++node) {
    if (block_[node] == kInvalidBlock) continue;
    fmt::format_to(it, "n{} parent={} block={} cov={} lock={} prio={} evictable={} tokens={}\n",
                   node, parent_[node], block_[node].value(), coverage_[node], lock_[node],
                   priority_[node], policy_->Contains(node), fmt::join(Tokens(node), ","));
  }
  return out;
}

}  // namespace kvpool
