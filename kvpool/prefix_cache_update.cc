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

NodeIndex PrefixCache::Insert(NodeIndex parent, std::span<const int32_t> tokens,
                              uint64_t token_hash, BlockId block, int priority,
                              const TraceContext& ctx) {
  const NodeIndex node = NewNode();
  parent_[node] = parent;
  block_[node] = block;
  coverage_[node] = static_cast<int32_t>(tokens.size());
  lock_[node] = 1;  // the committing sequence follows it
  priority_[node] = static_cast<int8_t>(priority);
  state_[node].depth = state_[parent].depth + 1;
  ns_[node] = ns_[parent];
  std::copy(tokens.begin(), tokens.end(),
            tokens_.begin() + static_cast<ptrdiff_t>(node) * block_size_);
  LinkChild(parent, node);
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
  if (coverage_[node] == block_size_) MakeFull(node, token_hash);
  UpdateCandidate(parent);  // no longer a leaf
  policy_->OnInsert(node, Facts(node), now_ns_);
  return node;
}

void PrefixCache::MakeFull(NodeIndex node, uint64_t token_hash) {
  KVPOOL_DCHECK(token_hash == HashTokens(Tokens(node)));
  const NodeIndex parent = parent_[node];
  token_hash_[node] = token_hash;
  if (hashes_on_) {
    hash_[node] = PrefixChainHash(hash_[parent], ns_[node], Tokens(node));
    state_[node].fingerprint = BlockFingerprint(hash_[node]);
  }
  // Only wide parents index their full children. A 64-bit collision with a different block
  // leaves this one out of the index; lookups still find it by scanning the children.
  if (wide_[parent] != 0) children_.try_emplace(ChildKey{parent, token_hash_[node]}, node);
  ++num_full_;
}

void PrefixCache::Widen(NodeIndex node, std::span<const int32_t> tokens) {
  KVPOOL_DCHECK(StartsWith(tokens, Tokens(node)));
  std::copy(tokens.begin(), tokens.end(),
            tokens_.begin() + static_cast<ptrdiff_t>(node) * block_size_);
  coverage_[node] = static_cast<int32_t>(tokens.size());
  ++counters_.widened;
  if (coverage_[node] == block_size_) {
    MakeFull(node, HashTokens(tokens));
    policy_->OnInsert(node, Facts(node), now_ns_);  // its hash is known now
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
  std::vector<NodeIndex> announced;  // nodes that became full here, in chain order
  auto flush = [&] {
    if (!announced.empty()) Announce(announced.front(), announced.back());
    announced.clear();
  };

  for (size_t k = path->full.size(); (k + 1) * bs <= tokens.size(); ++k) {
    const std::span<const int32_t> block = tokens.subspan(k * bs, bs);
    const uint64_t block_hash = HashTokens(block);
    NodeIndex child = FindFull(parent, block, block_hash);
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
        child = Insert(parent, block, block_hash, table[k], priority, ctx);
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
      LockHit(child);  // computed again, but someone published it first
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
    LockHit(s);
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
  const NodeIndex node = Insert(parent, block, 0, mine, priority, ctx);
  if (cur != kNoNode) Unlock(cur);
  path->partial = node;
  RemoveDominated(node, ctx);
}

void PrefixCache::RemoveDominated(NodeIndex node, const TraceContext& ctx) {
  const std::span<const int32_t> mine = Tokens(node);
  // A dominated sibling is a prefix of `mine`, so it shares its first token.
  for (NodeIndex s = FirstCandidate(parent_[node], mine[0]); s != kNoNode;) {
    ++child_scans_;
    const NodeIndex next = NextCandidate(s);
    if (s != node && coverage_[s] < block_size_ && StartsWith(mine, Tokens(s)) &&
        ShouldBeEvictable(s)) {
      RemoveNode(s, ctx);
      ++counters_.dominated;
    }
    s = next;
  }
  FlushRemoved();
}

void PrefixCache::Announce(NodeIndex first, NodeIndex last) {
  if (!events_on_) return;
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

}  // namespace kvpool
