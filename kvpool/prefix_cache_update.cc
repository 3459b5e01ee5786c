// PrefixCache: publishing and events (lookup and locking live in prefix_cache.cc, eviction and
// pins in prefix_cache_evict.cc).

#include <algorithm>
#include <string>
#include <utility>

#include "kvpool/internal/tokens.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/check.h"

namespace kvpool {
using internal::StartsWith;

inline void PrefixCache::Fill(BlockId block, int priority, uint16_t share,
                              const TraceContext& ctx) {
  Entry& e = entry(block);
  e = Entry{};
  e.lock = 1;  // the committing sequence follows it
  e.priority = static_cast<int8_t>(priority);
  e.share = share;
  KVPOOL_CHECK_OK(pool_->AddCacheRef(block, ctx));
}

void PrefixCache::Insert(NodeIndex root, BlockId at, std::span<const int32_t> tokens, BlockId block,
                         int priority, const TraceContext& ctx) {
  tree_.Add(root, at, block, tokens);
  Fill(block, priority, ShareFor(tree_.ns_of(block)), ctx);
  if (at != kInvalidBlock) RaiseAncestors(at, priority);
  ++num_blocks_;
  ++counters_.inserted;
  if (tree_.coverage(block) == block_size_) {
    MakeFull(block);
  } else if (hashes_on_) {
    hash_[Index(block)] = BlockHash{};  // a partial block has no name (fingerprint 0)
  }
  // No longer a leaf: it leaves the candidates if it was one.
  if (at != kInvalidBlock && (entry(at).in_tails != 0 || entry(at).in_policy != 0)) {
    UpdateCandidate(at);
  }
  if (hears_accesses_) PolicyOf(block).OnInsert(Key(block), Facts(block), now_ns_);
}

size_t PrefixCache::AppendChain(NodeIndex root, BlockId at, std::span<const int32_t> tokens,
                                std::span<const BlockId> table, int priority, CachePath* path,
                                const TraceContext& ctx) {
  KVPOOL_DCHECK(tokens.size() == table.size() * static_cast<size_t>(block_size_));
  // A block the tree holds already is not inserted again: the general path decides (a shared
  // block sits at its own position, so this is not expected past the tree's edge).
  size_t n = 0;
  while (n < table.size() && !tree_.Holds(table[n])) ++n;
  if (n == 0) return 0;
  // Insert() for a position with no child, a whole run at once: each block is its
  // predecessor's only child and locked by the committing sequence (so no candidate), and the
  // class is raised once for the whole run.
  tree_.AddRun(root, at, table.first(n), tokens.first(n * static_cast<size_t>(block_size_)));
  if (at != kInvalidBlock) {
    if (entry(at).in_tails != 0 || entry(at).in_policy != 0) UpdateCandidate(at);
    RaiseAncestors(at, priority);
  }
  const NamespaceId ns = tree_.ns_of(table[0]);
  const uint16_t share = ShareFor(ns);
  BlockHash parent = HashOf(at);
  const size_t base = path->full.size();
  path->full.resize(base + n);
  BlockId* const follows = path->full.data() + base;  // written in place: no capacity checks
  for (size_t k = 0; k < n; ++k) {
    const BlockId block = table[k];
    Fill(block, priority, share, ctx);
    if (hashes_on_) parent = hash_[Index(block)] = PrefixChainHash(parent, ns, tree_.Tokens(block));
    if (hears_accesses_) PolicyOf(block).OnInsert(Key(block), Facts(block), now_ns_);
    follows[k] = block;
  }
  if (at == kInvalidBlock) IndexFirstBlock(table[0]);  // a run below a root starts at depth 1
  num_blocks_ += static_cast<int64_t>(n);
  num_full_ += static_cast<int64_t>(n);
  counters_.inserted += n;
  return n;
}

void PrefixCache::RaiseAncestors(BlockId block, int priority) {
  for (BlockId a = block; a != kInvalidBlock && entry(a).priority < priority; a = tree_.Parent(a)) {
    entry(a).priority = static_cast<int8_t>(priority);
  }
}

void PrefixCache::MakeFull(BlockId block) {
  if (hashes_on_) {
    hash_[Index(block)] =
        PrefixChainHash(HashOf(tree_.Parent(block)), tree_.ns_of(block), tree_.Tokens(block));
  }
  if (tree_.depth(block) == 1) IndexFirstBlock(block);
  ++num_full_;
}

void PrefixCache::IndexFirstBlock(BlockId block) {
  first_blocks_.emplace(tree_.TokenHash(block), block);
}

void PrefixCache::UnindexFirstBlock(BlockId block) {
  first_blocks_.erase({tree_.TokenHash(block), block});
}

void PrefixCache::Widen(BlockId block, std::span<const int32_t> tokens) {
  tree_.Widen(block, tokens);
  ++counters_.widened;
  if (on_widen_ != nullptr) on_widen_(block);
  if (tree_.coverage(block) == block_size_) {
    MakeFull(block);
    if (hears_accesses_) PolicyOf(block).OnInsert(Key(block), Facts(block), now_ns_);  // named now
  }
}

void PrefixCache::Commit(NamespaceId ns, std::span<const int32_t> tokens,
                         std::span<const BlockId> table, int priority, bool retain_tail,
                         CachePath* path, const TraceContext& ctx) {
  CommitBlocks(ns, tokens, table, priority, path, ctx);
  if (retain_tail && path->partial != kInvalidBlock) entry(path->partial).retain = 1;
}

void PrefixCache::CommitBlocks(NamespaceId ns, std::span<const int32_t> tokens,
                               std::span<const BlockId> table, int priority, CachePath* path,
                               const TraceContext& ctx) {
  const size_t bs = static_cast<size_t>(block_size_);
  const NodeIndex root = tree_.RootOrCreate(ns);
  BlockId at = path->full.empty() ? kInvalidBlock : path->full.back();
  const bool announce = events_on_ || journal_on_;
  std::vector<BlockId> announced;  // blocks that became full here, a chain (if announced)
  auto flush = [&] {
    if (!announced.empty()) Announce(announced);
    announced.clear();
  };

  for (size_t k = path->full.size(); (k + 1) * bs <= tokens.size(); ++k) {
    if (path->partial == kInvalidBlock && tree_.NumChildren(root, at) == 0) {
      // Past the tree's edge: what follows is new (most of what a prompt publishes).
      const size_t full = tokens.size() / bs;
      const size_t n = AppendChain(root, at, tokens.subspan(k * bs, (full - k) * bs),
                                   table.subspan(k, full - k), priority, path, ctx);
      if (n > 0) {
        if (announce) {
          if (!announced.empty() && at != announced.back()) flush();
          announced.insert(announced.end(), path->full.end() - static_cast<ptrdiff_t>(n),
                           path->full.end());
        }
        at = path->full.back();
        k += n - 1;
        continue;
      }
    }
    bool fresh = false;
    const BlockId child =
        CommitFull(root, at, tokens.subspan(k * bs, bs), table[k], priority, path, &fresh, ctx);
    if (child == kInvalidBlock) break;  // the block is published elsewhere under other tokens
    if (announce && fresh) {
      if (!announced.empty() && at != announced.back()) flush();
      announced.push_back(child);
    } else if (announce) {
      flush();
    }
    RemoveDominated(child, ctx);
    path->full.push_back(child);
    at = child;
  }
  flush();

  const size_t done = path->full.size() * bs;
  if (done >= tokens.size() || tokens.size() - done >= bs) return;
  CommitPartial(root, at, tokens.subspan(done), table[path->full.size()], priority, path, ctx);
}

BlockId PrefixCache::CommitFull(NodeIndex root, BlockId at, std::span<const int32_t> tokens,
                                BlockId mine, int priority, CachePath* path, bool* fresh,
                                const TraceContext& ctx) {
  const BlockId child = tree_.FindFull(root, at, tokens);
  if (path->partial != kInvalidBlock) {
    // The partial block sat at this position: either the sequence's own block, now complete
    // (widen it into a full one), or someone else's that we leave.
    const BlockId p = path->partial;
    path->partial = kInvalidBlock;
    if (child == kInvalidBlock && p == mine && tree_.HangsBelow(p, root, at)) {
      Widen(p, tokens);
      *fresh = true;
      return p;  // its lock moves into path->full
    }
    Unlock(p);
  }
  if (child != kInvalidBlock) {
    LockHit(child);  // computed again, but someone published it first
    return child;
  }
  if (!tree_.Holds(mine)) {
    Insert(root, at, tokens, mine, priority, ctx);
    *fresh = true;
    return mine;
  }
  if (tree_.HangsBelow(mine, root, at) && tree_.coverage(mine) < block_size_ &&
      StartsWith(tokens, tree_.Tokens(mine))) {
    // The sequence's own earlier rewind endpoint (a Truncate dropped it from the path).
    Widen(mine, tokens);
    Lock(mine);
    *fresh = true;
    return mine;
  }
  return kInvalidBlock;
}

void PrefixCache::CommitPartial(NodeIndex root, BlockId at, std::span<const int32_t> block,
                                BlockId mine, int priority, CachePath* path,
                                const TraceContext& ctx) {
  const BlockId cur = path->partial;
  if (cur != kInvalidBlock && tree_.HangsBelow(cur, root, at) &&
      StartsWith(tree_.Tokens(cur), block)) {
    return;
  }
  if (const BlockId s = tree_.Covering(root, at, block, cur); s != kInvalidBlock) {
    LockHit(s);
    if (cur != kInvalidBlock) Unlock(cur);
    path->partial = s;
    return;
  }
  if (tree_.Holds(mine)) {
    if (tree_.HangsBelow(mine, root, at) && StartsWith(block, tree_.Tokens(mine))) {
      if (tree_.coverage(mine) < static_cast<int32_t>(block.size())) Widen(mine, block);
      if (mine != cur) {
        Lock(mine);
        if (cur != kInvalidBlock) Unlock(cur);
        path->partial = mine;
      }
      RemoveDominated(mine, ctx);
    }
    return;
  }
  Insert(root, at, block, mine, priority, ctx);
  if (cur != kInvalidBlock) Unlock(cur);
  path->partial = mine;
  RemoveDominated(mine, ctx);
}

void PrefixCache::RemoveDominated(BlockId block, const TraceContext& ctx) {
  int32_t siblings = 0;
  const BlockId at = tree_.Parent(block, &siblings);
  // An only child has no sibling to dominate (the common case: reading its tokens costs a miss).
  if (siblings <= 1) return;
  const std::span<const int32_t> mine = tree_.Tokens(block);
  // A dominated sibling is a prefix of `mine`, so it shares its first token.
  std::vector<BlockId> candidates;
  tree_.Candidates(tree_.Root(tree_.ns_of(block)), at, mine[0], &candidates);
  for (BlockId s : candidates) {
    if (s != block && tree_.coverage(s) < block_size_ && StartsWith(mine, tree_.Tokens(s)) &&
        ShouldBeEvictable(s)) {
      Remove(s, ctx);
      ++counters_.dominated;
    }
  }
  FlushRemoved();
}

void PrefixCache::Announce(std::span<const BlockId> chain) {
  if (journal_on_) {
    const NamespaceId ns = tree_.ns_of(chain.front());
    BlockHash parent = HashOf(tree_.Parent(chain.front()));
    for (BlockId b : chain) {
      published_.push_back({.ns = ns, .block = b, .hash = hash_[Index(b)], .parent = parent});
      parent = hash_[Index(b)];
    }
  }
  if (events_on_) events_.Append(StoredEvent(chain, event_group_));
}

KvEvent PrefixCache::StoredEvent(std::span<const BlockId> chain,
                                 const std::optional<KvEventGroup>& group) const {
  KvEvent e{.type = KvEventType::kBlockStored,
            .ns = tree_.ns_of(chain.front()),
            .block_size = block_size_,
            .group = group};
  e.block_hashes.reserve(chain.size());
  e.token_ids.reserve(chain.size() * static_cast<size_t>(block_size_));
  for (BlockId b : chain) {
    KVPOOL_DCHECK(tree_.coverage(b) == block_size_);
    e.block_hashes.push_back(hash_[Index(b)]);
    const std::span<const int32_t> t = tree_.Tokens(b);
    e.token_ids.insert(e.token_ids.end(), t.begin(), t.end());
  }
  if (const BlockId parent = tree_.Parent(chain.front()); parent != kInvalidBlock) {
    e.parent_hash = hash_[Index(parent)];
  }
  return e;
}

void PrefixCache::FlushRemoved() {
  if (pending_removed_.empty()) return;
  events_.Append(KvEvent{.type = KvEventType::kBlockRemoved,
                         .ns = pending_removed_ns_,
                         .block_hashes = std::move(pending_removed_),
                         .block_size = block_size_,
                         .group = event_group_});
  pending_removed_.clear();
}

void PrefixCache::AnnounceComponent(std::span<const BlockId> chain, const KvEventGroup& group) {
  if (!events_on_ || chain.empty()) return;
  events_.Append(StoredEvent(chain, group));
}

void PrefixCache::ForgetComponent(std::span<const BlockId> blocks, const KvEventGroup& group) {
  if (!events_on_ || clearing_ || blocks.empty()) return;
  // Appended now, before the tree's removals still batched (FlushRemoved): a consumer never
  // holds a component whose block it was told is gone.
  KvEvent e{.type = KvEventType::kBlockRemoved,
            .ns = tree_.ns_of(blocks.front()),
            .block_size = block_size_,
            .group = group};
  for (BlockId b : blocks) {
    KVPOOL_DCHECK(tree_.ns_of(b) == e.ns);
    e.block_hashes.push_back(hash_[Index(b)]);
  }
  events_.Append(std::move(e));
}

KvEvent PrefixCache::ComponentStored(BlockId block, const KvEventGroup& group) const {
  KvEvent e = StoredEvent(std::span(&block, 1), group);
  e.epoch = events_.epoch();
  return e;
}

std::vector<KvEvent> PrefixCache::SnapshotEvents(uint64_t* resume_seq) const {
  std::vector<KvEvent> out;
  tree_.ForEachRun([&](BlockId, std::span<const BlockId> run) {
    for (const BlockId& b : run) {
      if (tree_.coverage(b) != block_size_) continue;
      out.push_back(StoredEvent(std::span(&b, 1), event_group_));
      out.back().epoch = events_.epoch();
    }
  });
  *resume_seq = events_.next_seq();
  return out;
}

}  // namespace kvpool
