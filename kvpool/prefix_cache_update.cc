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

inline void PrefixCache::FillNode(NodeIndex node, NodeIndex parent, std::span<const int32_t> tokens,
                                  BlockId block, int priority, const TraceContext& ctx) {
  Node& x = nodes_[node];
  x.parent = parent;
  x.first_child = x.next_sibling = x.prev_sibling = kNoNode;
  x.num_children = 0;
  x.block = block;
  x.coverage = static_cast<int32_t>(tokens.size());
  x.lock = 1;  // the committing sequence follows it
  x.priority = static_cast<int8_t>(priority);
  state_[node].depth = state_[parent].depth + 1;
  ns_[node] = ns_[parent];
  internal::CopyBlockTokens(tokens_.data() + static_cast<size_t>(node) * block_size_, tokens.data(),
                            tokens.size());
  node_of_block_[static_cast<size_t>(block.value())] = node;
  KVPOOL_CHECK_OK(pool_->AddCacheRef(block, ctx));
}

NodeIndex PrefixCache::Insert(NodeIndex parent, std::span<const int32_t> tokens, BlockId block,
                              int priority, const TraceContext& ctx) {
  const NodeIndex node = NewNode();
  FillNode(node, parent, tokens, block, priority, ctx);
  LinkChild(parent, node);
  RaiseAncestors(parent, priority);
  ++num_nodes_;
  ++counters_.inserted;
  if (nodes_[node].coverage == block_size_) MakeFull(node);
  // No longer a leaf: it leaves the candidates if it was one.
  if (state_[parent].in_tails != 0 || state_[parent].in_policy != 0) UpdateCandidate(parent);
  if (hears_accesses_) policy_->OnInsert(node, Facts(node), now_ns_);
  return node;
}

size_t PrefixCache::AppendChain(NodeIndex parent, std::span<const int32_t> tokens,
                                std::span<const BlockId> table, int priority, CachePath* path,
                                const TraceContext& ctx) {
  KVPOOL_DCHECK(nodes_[parent].first_child == kNoNode && nodes_[parent].wide == 0);
  KVPOOL_DCHECK(tokens.size() == table.size() * static_cast<size_t>(block_size_));
  // Insert() for a parent with no child, one block after another: each node is its parent's
  // only child and locked by the committing sequence (so no candidate), and the class is raised
  // once for the whole chain.
  if (state_[parent].in_tails != 0 || state_[parent].in_policy != 0) UpdateCandidate(parent);
  RaiseAncestors(parent, priority);
  const size_t bs = static_cast<size_t>(block_size_);
  size_t n = 0;
  for (; n < table.size(); ++n) {
    const BlockId block = table[n];
    // A block the tree holds already is not inserted again: the general path decides (a shared
    // block's node sits at its own position, so this is not expected past the tree's edge).
    if (node_of_block_[static_cast<size_t>(block.value())] != kNoNode) break;
    const NodeIndex node = NewNode();
    nodes_[parent].first_child = node;
    nodes_[parent].num_children = 1;
    FillNode(node, parent, tokens.subspan(n * bs, bs), block, priority, ctx);
    if (hashes_on_) {
      hash_[node] = PrefixChainHash(hash_[parent], ns_[node], Tokens(node));
      state_[node].fingerprint = BlockFingerprint(hash_[node]);
    }
    if (state_[node].depth == 1) IndexFirstBlock(node);
    if (hears_accesses_) policy_->OnInsert(node, Facts(node), now_ns_);
    path->full.push_back(node);
    parent = node;
  }
  num_nodes_ += static_cast<int64_t>(n);
  num_full_ += static_cast<int64_t>(n);
  counters_.inserted += n;
  return n;
}

void PrefixCache::RaiseAncestors(NodeIndex node, int priority) {
  for (NodeIndex a = node;
       a != kNoNode && nodes_[a].block != kInvalidBlock && nodes_[a].priority < priority;
       a = nodes_[a].parent) {
    nodes_[a].priority = static_cast<int8_t>(priority);
  }
}

void PrefixCache::MakeFull(NodeIndex node) {
  const NodeIndex parent = nodes_[node].parent;
  if (hashes_on_) {
    hash_[node] = PrefixChainHash(hash_[parent], ns_[node], Tokens(node));
    state_[node].fingerprint = BlockFingerprint(hash_[node]);
  }
  // Only wide parents index their full children. A 64-bit collision with a different block
  // leaves this one out of the index; lookups still find it by scanning the children.
  if (nodes_[parent].wide != 0) {
    nodes_[node].token_hash = HashTokens(Tokens(node));
    children_.try_emplace(ChildKey{parent, nodes_[node].token_hash}, node);
  }
  if (state_[node].depth == 1) IndexFirstBlock(node);
  ++num_full_;
}

void PrefixCache::IndexFirstBlock(NodeIndex node) {
  first_blocks_.emplace(HashTokens(Tokens(node)), node);
}

void PrefixCache::UnindexFirstBlock(NodeIndex node) {
  first_blocks_.erase({HashTokens(Tokens(node)), node});
}

void PrefixCache::Widen(NodeIndex node, std::span<const int32_t> tokens) {
  KVPOOL_DCHECK(StartsWith(tokens, Tokens(node)));
  std::copy(tokens.begin(), tokens.end(),
            tokens_.begin() + static_cast<ptrdiff_t>(node) * block_size_);
  nodes_[node].coverage = static_cast<int32_t>(tokens.size());
  ++counters_.widened;
  if (nodes_[node].coverage == block_size_) {
    MakeFull(node);
    if (hears_accesses_) policy_->OnInsert(node, Facts(node), now_ns_);  // its hash is known now
  }
}

void PrefixCache::Commit(NamespaceId ns, std::span<const int32_t> tokens,
                         std::span<const BlockId> table, int priority, bool retain_tail,
                         CachePath* path, const TraceContext& ctx) {
  CommitBlocks(ns, tokens, table, priority, path, ctx);
  if (retain_tail && path->partial != kNoNode) state_[path->partial].retain = 1;
}

void PrefixCache::CommitBlocks(NamespaceId ns, std::span<const int32_t> tokens,
                               std::span<const BlockId> table, int priority, CachePath* path,
                               const TraceContext& ctx) {
  const size_t bs = static_cast<size_t>(block_size_);
  NodeIndex parent = path->full.empty() ? RootOrCreate(ns) : path->full.back();
  const bool announce = events_on_ || journal_on_;
  std::vector<NodeIndex> announced;  // nodes that became full here, in chain order (if announced)
  auto flush = [&] {
    if (!announced.empty()) Announce(announced.front(), announced.back());
    announced.clear();
  };

  for (size_t k = path->full.size(); (k + 1) * bs <= tokens.size(); ++k) {
    if (path->partial == kNoNode && nodes_[parent].first_child == kNoNode) {
      // Past the tree's edge: what follows is new (most of what a prompt publishes).
      const size_t full = tokens.size() / bs;
      const size_t n = AppendChain(parent, tokens.subspan(k * bs, (full - k) * bs),
                                   table.subspan(k, full - k), priority, path, ctx);
      if (n > 0) {
        if (announce) {
          if (!announced.empty() && parent != announced.back()) flush();
          announced.insert(announced.end(), path->full.end() - static_cast<ptrdiff_t>(n),
                           path->full.end());
        }
        parent = path->full.back();
        k += n - 1;
        continue;
      }
    }
    const std::span<const int32_t> block = tokens.subspan(k * bs, bs);
    NodeIndex child = FindFull(parent, block);
    bool fresh = false;
    if (path->partial != kNoNode) {
      // The partial node sat at this position: it is either the sequence's own block, now
      // complete (widen it into the full node), or someone else's that we leave.
      const NodeIndex p = path->partial;
      path->partial = kNoNode;
      if (child == kNoNode && nodes_[p].block == table[k] && nodes_[p].parent == parent) {
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
      } else if (nodes_[owner].parent == parent && nodes_[owner].coverage < block_size_ &&
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
      LockHit(child);  // computed again, but someone published it first
    }
    if (announce && fresh) {
      if (!announced.empty() && parent != announced.back()) flush();
      announced.push_back(child);
    } else if (announce) {
      flush();
    }
    RemoveDominated(child, ctx);
    path->full.push_back(child);
    parent = child;
  }
  flush();

  const size_t done = path->full.size() * bs;
  if (done >= tokens.size() || tokens.size() - done >= bs) return;
  CommitPartial(parent, tokens.subspan(done), table[path->full.size()], priority, path, ctx);
}

void PrefixCache::CommitPartial(NodeIndex parent, std::span<const int32_t> block, BlockId mine,
                                int priority, CachePath* path, const TraceContext& ctx) {
  const NodeIndex cur = path->partial;
  if (cur != kNoNode && nodes_[cur].parent == parent && StartsWith(Tokens(cur), block)) return;
  if (NodeIndex s = Covering(parent, block, cur); s != kNoNode) {
    LockHit(s);
    if (cur != kNoNode) Unlock(cur);
    path->partial = s;
    return;
  }
  const NodeIndex owner = node_of_block_[static_cast<size_t>(mine.value())];
  if (owner != kNoNode) {
    if (nodes_[owner].parent == parent && StartsWith(block, Tokens(owner))) {
      if (nodes_[owner].coverage < static_cast<int32_t>(block.size())) Widen(owner, block);
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
  // An only child has no sibling to dominate (the common case: reading its tokens costs a miss).
  if (nodes_[nodes_[node].parent].num_children <= 1) return;
  const std::span<const int32_t> mine = Tokens(node);
  // A dominated sibling is a prefix of `mine`, so it shares its first token.
  for (NodeIndex s = FirstCandidate(nodes_[node].parent, mine[0]); s != kNoNode;) {
    ++child_scans_;
    const NodeIndex next = NextCandidate(s);
    if (s != node && nodes_[s].coverage < block_size_ && StartsWith(mine, Tokens(s)) &&
        ShouldBeEvictable(s)) {
      RemoveNode(s, ctx);
      ++counters_.dominated;
    }
    s = next;
  }
  FlushRemoved();
}

void PrefixCache::Announce(NodeIndex first, NodeIndex last) {
  if (journal_on_) {
    const size_t start = published_.size();
    for (NodeIndex n = last;; n = nodes_[n].parent) {
      const NodeIndex parent = nodes_[n].parent;
      published_.push_back(
          {.ns = ns_[n],
           .block = nodes_[n].block,
           .hash = hash_[n],
           .parent = nodes_[parent].block != kInvalidBlock ? hash_[parent] : BlockHash{}});
      if (n == first) break;
    }
    std::reverse(published_.begin() + static_cast<ptrdiff_t>(start), published_.end());
  }
  if (!events_on_) return;
  KvEvent e{.type = KvEventType::kBlockStored, .ns = ns_[first], .block_size = block_size_};
  std::vector<NodeIndex> chain;
  for (NodeIndex n = last;; n = nodes_[n].parent) {
    chain.push_back(n);
    if (n == first) break;
  }
  std::reverse(chain.begin(), chain.end());
  for (NodeIndex n : chain) {
    e.block_hashes.push_back(hash_[n]);
    const std::span<const int32_t> t = Tokens(n);
    e.token_ids.insert(e.token_ids.end(), t.begin(), t.end());
  }
  if (nodes_[nodes_[first].parent].block != kInvalidBlock)
    e.parent_hash = hash_[nodes_[first].parent];
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
    for (NodeIndex c = nodes_[node].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
      if (nodes_[c].coverage != block_size_) continue;
      KvEvent e{.type = KvEventType::kBlockStored, .ns = ns_[c], .block_size = block_size_};
      e.block_hashes.push_back(hash_[c]);
      if (nodes_[node].block != kInvalidBlock) e.parent_hash = hash_[node];
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

}  // namespace kvpool
