// PrefixCache: eviction candidates, eviction plans, block removal and pins (lookup and locking
// live in prefix_cache.cc, publishing in prefix_cache_update.cc).

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "fmt/format.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/check.h"

namespace kvpool {

void PrefixCache::UpdateCandidate(BlockId block) {
  Entry& e = entry(block);
  const bool want = e.evictable != 0 && tree_.IsLeaf(block);
  const bool tail = e.in_tails != 0;
  if (want == (tail || e.in_policy != 0)) return;
  if (!want) {
    if (tail) {
      TailRemove(block);
    } else {
      PolicyOf(block).Remove(Key(block), Facts(block));
      e.in_policy = 0;
    }
  } else if (IsFirstOutTail(block)) {
    TailPush(block);
  } else {
    PolicyOf(block).Add(Key(block), Facts(block));
    e.in_policy = 1;
  }
}

void PrefixCache::MarkResumePoint(BlockId block, bool on) {
  Entry& e = entry(block);
  if (e.resume == static_cast<uint8_t>(on)) return;
  const bool candidate = (e.in_tails | e.in_policy) != 0;
  if (candidate) {
    if (e.in_tails != 0) {
      TailRemove(block);
    } else {
      PolicyOf(block).Remove(Key(block), Facts(block));
      e.in_policy = 0;
    }
  }
  e.resume = on ? 1 : 0;
  if (candidate) UpdateCandidate(block);
}

void PrefixCache::TailPush(BlockId block) {
  entry(block).in_tails = 1;
  tail_prev_[Index(block)] = tails_tail_;
  tail_next_[Index(block)] = kInvalidBlock;
  if (tails_tail_ != kInvalidBlock) {
    tail_next_[Index(tails_tail_)] = block;
  } else {
    tails_head_ = block;
  }
  tails_tail_ = block;
  ++num_tails_;
}

void PrefixCache::TailRemove(BlockId block) {
  const BlockId prev = tail_prev_[Index(block)];
  const BlockId next = tail_next_[Index(block)];
  if (prev != kInvalidBlock) {
    tail_next_[Index(prev)] = next;
  } else {
    tails_head_ = next;
  }
  if (next != kInvalidBlock) {
    tail_prev_[Index(next)] = prev;
  } else {
    tails_tail_ = prev;
  }
  tail_prev_[Index(block)] = tail_next_[Index(block)] = kInvalidBlock;
  entry(block).in_tails = 0;
  --num_tails_;
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void PrefixCache::Release(BlockId block,
                                                              const TraceContext& ctx) {
  if (ABSL_PREDICT_FALSE(on_remove_ != nullptr)) on_remove_(block, ctx);
  if (shares_on_) ++shares_[entry(block).share].evicted;
  KVPOOL_CHECK_OK(pool_->DropCacheRef(block, ctx));
  --num_blocks_;
  ++counters_.evicted;
}

void PrefixCache::Forget(BlockId block, bool below_bar) {
  if (events_on_) {
    const NamespaceId ns = tree_.ns_of(block);
    if (pending_removed_ns_ != ns) FlushRemoved();
    pending_removed_ns_ = ns;
    pending_removed_.push_back(hash_[Index(block)]);
  }
  if (evicted_memory_ > 0) {
    BlockHash& slot = evicted_ring_[evicted_next_];
    if (slot != BlockHash{}) evicted_set_.erase(slot);
    slot = hash_[Index(block)];
    evicted_set_[slot] = below_bar;
    evicted_next_ = (evicted_next_ + 1) % evicted_memory_;
  }
  --num_full_;
}

void PrefixCache::Remove(BlockId block, const TraceContext& ctx, bool offer_parent) {
  Entry& e = entry(block);
  KVPOOL_CHECK_MSG(tree_.IsLeaf(block) && e.lock == 0,
                   "evicting a prefix-cache block that is not an unlocked leaf");
  if (e.in_tails != 0) {
    TailRemove(block);
  } else if (e.in_policy != 0) {
    PolicyOf(block).Remove(Key(block), Facts(block));
    e.in_policy = 0;
  }
  if (e.evictable != 0) {
    e.evictable = 0;
    --num_evictable_;
    CountEvictable(block, -1);
  }
  const bool full = tree_.coverage(block) == block_size_;
  // Asked before OnErase, which forgets what the policy knew of the block.
  const bool below_bar =
      full && evicted_memory_ > 0 && PolicyOf(block).below_admission_bar(Key(block));
  if (hears_accesses_) PolicyOf(block).OnErase(Key(block), Facts(block), now_ns_);
  if (full) {
    if (tree_.depth(block) == 1) UnindexFirstBlock(block);
    Forget(block, below_bar);
  }
  Release(block, ctx);  // while the tree still holds it: on_remove_ may name it in an event
  const BlockId parent = tree_.Remove(block);
  if (offer_parent && parent != kInvalidBlock) UpdateCandidate(parent);  // may be a leaf now
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline EvictionPlanner::Step EvictionPlanner::NextStep(
    BlockId child, BlockId parent, bool chain, const Progress& p) {
  // The plan has what it asked for: it takes nothing more, so the parent is not even ranked (an
  // eviction of one block, as EvictCached(1), ranks and queues nothing).
  if (p.freed >= p.blocks) return Step::kStop;
  const PrefixCache::Entry& pe = p.cache->entry(parent);
  if (pe.evictable == 0 || pe.kept != 0) return Step::kStop;
  // No resume point: it goes before anything the policy orders (EvictUnresumableFirst).
  if (p.cache->Unresumable(parent)) return Step::kFollow;
  // A run released at once, deepest first: the parent's release order is the next one in the
  // same class, so under a release-ordered policy nothing can rank between the two and the
  // parent is the next victim. No heap, no Rank(). (Unless a fair plan must look at the other
  // shares first.)
  const PrefixCache::Entry& ce = p.cache->entry(child);
  if (chain && pe.priority == ce.priority && pe.release_seq == ce.release_seq + 1 &&
      p.freed < p.follow_below) {
    return Step::kFollow;
  }
  return Step::kQueue;
}

void EvictionPlanner::Queue(BlockId parent, const Progress& p) {
  Heap& heap = freed_parents_[p.cache->entry(parent).share];
  heap.emplace_back(p.cache->RankOf(parent), parent);
  std::push_heap(heap.begin(), heap.end(), std::greater<>());
}

void EvictionPlanner::TakeParent(size_t share, Progress* p) {
  Heap& heap = freed_parents_[share];
  std::pop_heap(heap.begin(), heap.end(), std::greater<>());
  const BlockId parent = heap.back().second;
  heap.pop_back();
  Take(parent, /*ranked=*/true, p);
}

void EvictionPlanner::Take(BlockId block, bool ranked, Progress* p) {
  const PrefixCache& cache = *p->cache;
  const bool chain = ranked && cache.ranks_by_release_;
  while (true) {
    // Inside a run each block is its parent's only child: walk the run down to its first block.
    const std::span<const BlockId> run = cache.tree_.RunUpTo(block);
    size_t at = run.size() - 1;  // run[at] == block
    while (true) {
      p->victims->push_back(block);
      if (p->count_shares) ++cursors_[cache.entry(block).share].planned;
      // A block still read by queued device work retires instead of freeing.
      if (cache.pool_->FencesPassed(block)) ++p->freed;
      if (at == 0) break;
      const BlockId parent = run[--at];
      const Step step = NextStep(block, parent, chain, *p);
      if (step == Step::kStop) return;
      if (step == Step::kQueue) return Queue(parent, *p);
      block = parent;
    }
    // The run's first block: its parent ends the run above, which may have other children.
    int32_t children = 0;
    const BlockId parent = cache.tree_.Parent(block, &children);
    if (parent == kInvalidBlock) return;  // it hung at a root
    if (children != 1) {
      const size_t i = static_cast<size_t>(parent.value());
      if (gone_children_[i]++ == 0) touched_.push_back(parent);
      if (gone_children_[i] != children) return;
    }
    const Step step = NextStep(block, parent, chain, *p);
    if (step == Step::kStop) return;
    if (step == Step::kQueue) return Queue(parent, *p);
    block = parent;
  }
}

void EvictionPlanner::PlanShare(size_t share, Progress* p) {
  const PrefixCache& cache = *p->cache;
  Heap& heap = freed_parents_[share];
  cache.shares_[share].policy->Visit(cache.now_ns_, [&](NodeIndex key, const EvictionRank& rank) {
    while (p->freed < p->blocks && !heap.empty() && heap.front().first < rank) {
      TakeParent(share, p);
    }
    if (p->freed >= p->blocks) return false;
    if (cache.entry(BlockId(key)).kept == 0) Take(BlockId(key), /*ranked=*/true, p);
    return p->freed < p->blocks;
  });
  while (p->freed < p->blocks && !heap.empty()) TakeParent(share, p);
}

const EvictionPlanner::Ranked* EvictionPlanner::NextCandidate(const PrefixCache& cache,
                                                              size_t share) {
  ShareCursor& c = cursors_[share];
  while (true) {
    while (c.at < c.next.size() && cache.entry(c.next[c.at].second).kept != 0) ++c.at;
    if (c.at < c.next.size()) return &c.next[c.at];
    if (c.exhausted) return nullptr;
    // Read the next stretch: skip what was read before (the plan changed nothing), take as
    // many again. The stretches double, so reading k candidates costs O(k) visits in all.
    const size_t skip = c.read;
    const size_t want = std::max<size_t>(4, skip);
    size_t seen = 0;
    c.next.clear();
    c.at = 0;
    cache.shares_[share].policy->Visit(cache.now_ns_, [&](NodeIndex key, const EvictionRank& rank) {
      if (seen++ < skip) return true;
      c.next.emplace_back(rank, BlockId(key));
      return c.next.size() < want;
    });
    c.read += c.next.size();
    c.exhausted = c.next.size() < want;
  }
}

bool EvictionPlanner::CanGive(const PrefixCache& cache, size_t share) const {
  if (!freed_parents_[share].empty()) return true;
  const ShareCursor& c = cursors_[share];
  return cache.shares_[share].policy->size() > 0 && !(c.exhausted && c.at >= c.next.size());
}

void EvictionPlanner::PlanFair(Progress* p) {
  const PrefixCache& cache = *p->cache;
  const int64_t unit = cache.share_block_bytes_;
  const size_t none = cache.shares_.size();
  while (p->freed < p->blocks) {
    // The share using the most per unit of weight gives the next victim; the runner-up bounds
    // how much it gives before the shares are looked at again. Only the chosen share's
    // candidates are read.
    size_t best = none;
    double best_use = 0, second_use = -1;
    for (size_t i = 0; i < cache.shares_.size(); ++i) {
      if (!CanGive(cache, i)) continue;
      const double use = cache.shares_[i].UsePerWeight(unit, cursors_[i].planned);
      if (best == none || use > best_use) {
        second_use = best == none ? -1 : best_use;
        best = i;
        best_use = use;
      } else if (use > second_use) {
        second_use = use;
      }
    }
    if (best == none) return;  // nothing left to evict
    const Ranked* next = NextCandidate(cache, best);
    const Heap& heap = freed_parents_[best];
    if (next == nullptr && heap.empty()) continue;  // only kept candidates: it cannot give
    int64_t give = INT64_MAX - p->freed;
    if (second_use >= 0) {
      const double blocks = (best_use - second_use) * cache.shares_[best].weight / unit;
      give = std::max<int64_t>(1, static_cast<int64_t>(std::min(blocks, 1e15)) + 1);
    }
    p->follow_below = p->freed + std::min(give, INT64_MAX - p->freed);
    if (!heap.empty() && (next == nullptr || heap.front().first < next->first)) {
      TakeParent(best, p);
    } else {
      ++cursors_[best].at;
      Take(next->second, /*ranked=*/true, p);
    }
  }
}

// The plan walks the first-out tails, then the policy's candidates in rank order (the class
// comment in internal/eviction_planner.h).
int64_t EvictionPlanner::Plan(const PrefixCache& cache, int64_t blocks,
                              std::span<const BlockId> keep, std::vector<BlockId>* victims) {
  if (blocks <= 0) return 0;
  if (gone_children_.size() < cache.entries_.size()) {
    gone_children_.resize(cache.entries_.size(), 0);
  }
  const size_t shares = cache.shares_.size();
  if (freed_parents_.size() < shares) freed_parents_.resize(shares);
  for (size_t i = 0; i < shares; ++i) freed_parents_[i].clear();
  const bool fair = shares > 1;
  if (fair) {
    cursors_.resize(shares);
    for (ShareCursor& c : cursors_) c = ShareCursor{.next = std::move(c.next)};
    for (ShareCursor& c : cursors_) c.next.clear();
  }
  touched_.clear();
  for (BlockId b : keep) cache.entry(b).kept = 1;
  Progress p{.cache = &cache, .blocks = blocks, .count_shares = fair, .victims = victims};
  for (BlockId b = cache.tails_head_; b != kInvalidBlock && p.freed < blocks;
       b = cache.tail_next_[PrefixCache::Index(b)]) {
    if (cache.entry(b).kept == 0) Take(b, /*ranked=*/false, &p);
  }
  if (p.freed < blocks) {
    // One share with anything to give (a daemon's one tenant): its own order, as without shares.
    size_t givers = 0, giver = 0;
    for (size_t i = 0; i < shares && givers < 2; ++i) {
      if (cache.shares_[i].policy->size() > 0 || !freed_parents_[i].empty()) {
        ++givers;
        giver = i;
      }
    }
    if (givers > 1) {
      PlanFair(&p);
    } else {
      PlanShare(giver, &p);
    }
  }
  for (BlockId b : keep) cache.entry(b).kept = 0;
  for (BlockId b : touched_) gone_children_[static_cast<size_t>(b.value())] = 0;
  return p.freed;
}

bool EvictionPlanner::clean() const {
  return std::all_of(gone_children_.begin(), gone_children_.end(),
                     [](int32_t n) { return n == 0; });
}

size_t PrefixCache::TrimRun(std::span<const BlockId> victims, const TraceContext& ctx) {
  const BlockId last = victims[0];
  KVPOOL_CHECK(tree_.Holds(last) && tree_.IsLeaf(last));
  // victims[k] is the run's k-th block from the end, and the next victim is the one before it.
  const std::span<const BlockId> run = tree_.RunUpTo(last);
  const size_t most = std::min(victims.size(), run.size()) - 1;
  const BlockId* const up = run.data() + run.size() - 1;  // up[-k]: the k-th from the end
  Entry* const entries = entries_.data();  // in a local: the stores below cannot move it
  size_t n = 0;
  int64_t evictable = 0;
  uint64_t unresumable = 0;
  for (; n < most && victims[n + 1] == up[-static_cast<ptrdiff_t>(n) - 1]; ++n) {
    const BlockId block = victims[n];
    Entry& e = entries[Index(block)];
    if ((e.in_policy | e.in_tails) != 0) break;
    KVPOOL_CHECK(e.lock == 0 && pool_->state(block) == BlockState::kCached);
    evictable += e.evictable;
    unresumable += unresumable_first_ && e.resume == 0;
    if (shares_on_) shares_[e.share].evictable -= e.evictable;
    e.evictable = 0;
    Release(block, ctx);  // one call site: the pool's trace names Remove()'s and this the same
  }
  if (n == 0) return 0;
  num_evictable_ -= evictable;
  counters_.unresumable_evicted += unresumable;
  num_full_ -= static_cast<int64_t>(n);  // blocks before others in a run are full
  tree_.Trim(last, n);
  return n;
}

void PrefixCache::Evict(std::span<const BlockId> victims, const TraceContext& ctx) {
  for (size_t i = 0; i < victims.size();) {
    // Inside an evicted run (most victims): full blocks, no candidates (each had a child until the
    // plan took it), each its parent's only child and the next victim's child, and nothing to
    // record per block.
    if (lean_evictions_) {
      if (const size_t n = TrimRun(victims.subspan(i), ctx); n > 0) {
        i += n;
        continue;
      }
    }
    const BlockId block = victims[i];
    KVPOOL_CHECK(tree_.Holds(block) && ShouldBeEvictable(block));
    if (Unresumable(block)) {
      ++counters_.unresumable_evicted;
    } else if (entry(block).in_tails != 0) {
      ++counters_.tails_evicted;
    }
    // A plan takes a parent right after its last child unless another candidate ranks lower.
    // When the parent is the next victim it is not offered to the policy in between.
    const bool parent_next = i + 1 < victims.size() && victims[i + 1] == tree_.Parent(block);
    Remove(block, ctx, /*offer_parent=*/!parent_next);
    ++i;
  }
  FlushRemoved();
}

int64_t PrefixCache::EvictUpTo(int64_t blocks, const TraceContext& ctx) {
  std::vector<BlockId> victims;
  PlanEviction(blocks, {}, &victims);
  if (static_cast<int64_t>(victims.size()) > blocks) victims.resize(static_cast<size_t>(blocks));
  Evict(victims, ctx);
  return static_cast<int64_t>(victims.size());
}

absl::Status PrefixCache::Clear(const TraceContext& ctx) {
  if (num_evictable_ != num_blocks_) {
    return absl::FailedPreconditionError(
        fmt::format("{} of {} cached blocks are in use by sequences or pins",
                    num_blocks_ - num_evictable_, num_blocks_));
  }
  // Every block is evictable, so one plan takes them all, leaves before their parents.
  clearing_ = true;
  while (num_blocks_ > 0) {
    std::vector<BlockId> victims;
    PlanEviction(num_blocks_ + 1, {}, &victims);
    KVPOOL_CHECK(!victims.empty());
    for (BlockId block : victims) Remove(block, ctx);
  }
  clearing_ = false;
  pending_removed_.clear();  // announced as one AllBlocksCleared instead
  if (events_on_) {
    events_.Append(KvEvent{.type = KvEventType::kAllBlocksCleared, .block_size = block_size_});
  }
  return absl::OkStatus();
}

void PrefixCache::UpdatePinCharge(BlockId block) {
  Entry& e = entry(block);
  const bool want = e.pins > 0 && pool_->state(block) == BlockState::kCached;
  if (want == (e.pin_charged != 0)) return;
  e.pin_charged = want ? 1 : 0;
  const NamespaceId ns = tree_.ns_of(block);
  auto it = pin_held_.try_emplace(ns, 0).first;
  it->second += want ? 1 : -1;
  if (it->second == 0) pin_held_.erase(it);
  if (!tally_of_.empty()) {
    if (auto tally = tally_of_.find(ns); tally != tally_of_.end()) {
      pin_held_by_tally_[tally->second] += want ? 1 : -1;
    }
  }
}

void PrefixCache::SetTally(NamespaceId ns, uint32_t tally) {
  uint32_t& filed = tally_of_[ns];
  const uint32_t old = filed;
  if (tally == 0) {
    tally_of_.erase(ns);
  } else {
    filed = tally;
  }
  const int64_t held = pin_held(ns);
  if (tally >= pin_held_by_tally_.size()) pin_held_by_tally_.resize(tally + size_t{1}, 0);
  if (old != 0) pin_held_by_tally_[old] -= held;
  if (tally != 0) pin_held_by_tally_[tally] += held;
}

void PrefixCache::Pin(std::span<const BlockId> blocks, int priority) {
  KVPOOL_CHECK(priority >= 0 && priority < kNumPriorities);
  for (BlockId block : blocks) {
    KVPOOL_CHECK(tree_.Holds(block));
    Lock(block);  // first: a locked block is no candidate, so its class may change
    Entry& e = entry(block);
    if (e.pins++ == 0) ++pinned_blocks_;
    e.priority = static_cast<int8_t>(std::max<int>(e.priority, priority));
    UpdatePinCharge(block);
  }
}

void PrefixCache::Unpin(std::span<const BlockId> blocks) {
  // Deepest first, as sequences release: a block is released after its descendants.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const BlockId block = *it;
    KVPOOL_CHECK_MSG(entry(block).pins > 0, "unpin of a prefix-cache block that is not pinned");
    if (--entry(block).pins == 0) --pinned_blocks_;
    UpdatePinCharge(block);
    Unlock(block);
  }
}

int64_t PrefixCache::PinCharge(std::span<const BlockId> blocks) const {
  int64_t n = 0;
  for (BlockId block : blocks) {
    n += entry(block).pins == 0 && pool_->state(block) == BlockState::kCached ? 1 : 0;
  }
  return n;
}

int64_t PrefixCache::NewlyPinned(std::span<const BlockId> blocks) const {
  int64_t n = 0;
  for (BlockId block : blocks) n += entry(block).pins == 0 ? 1 : 0;
  return n;
}

int64_t PrefixCache::pin_held(NamespaceId ns) const {
  auto it = pin_held_.find(ns);
  return it == pin_held_.end() ? 0 : it->second;
}

}  // namespace kvpool
