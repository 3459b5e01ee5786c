// KvCacheManager: the sliding-window group (docs/hybrid-groups.md §3, §4). A window block holds
// the same tokens as the block at the same table entry, for the window layers; a sequence keeps
// only the entries its window still reads (plus its sinks), and SlideWindow releases the rest,
// fenced. The tree keeps, beside a published block, the window block that holds its tokens while
// it is still live at Commit (CACHED in the window group while only the tree holds it); it leaves
// with its block, or alone, least recently used first, when the window group needs room. A
// prompt resumes only where every window block its window needs is kept.

#include <algorithm>
#include <utility>

#include "fmt/format.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {
namespace {

size_t Index(BlockId b) { return static_cast<size_t>(b.value()); }

// The block a match names at table entry `i` (a full one, or the partially matched one).
BlockId MatchBlock(const PrefixMatch& m, size_t i) {
  return i < m.full.size() ? m.full[i] : m.partial;
}

}  // namespace

int64_t KvCacheManager::WindowBound() const {
  if (!window_) return 0;
  return BlocksFor(int64_t{window_tokens_} + block_size_) + SinkBlocks();
}

BlockId KvCacheManager::CutResumable(
    PrefixMatch* m, int64_t* no_checkpoint, int64_t* window_evicted,
    std::optional<std::pair<BlockId, CheckpointKind>>* ghost) const {
  // Both cuts only shorten the match: alternate them until neither moves it.
  for (;;) {
    const int64_t before = m->matched_tokens;
    if (window_) CutToWindow(m);
    *window_evicted += before - m->matched_tokens;
    if (!states_) return kInvalidBlock;
    const int64_t at = m->matched_tokens;
    const BlockId resume = CutToCheckpoint(m, ghost);
    *no_checkpoint += at - m->matched_tokens;
    if (!window_ || m->matched_tokens == at) return resume;
  }
}

bool KvCacheManager::CutToWindow(PrefixMatch* m) const {
  bool cut = false;
  for (;;) {
    const int64_t p = m->matched_tokens;
    const int64_t blocks = static_cast<int64_t>(m->full.size()) + (m->partial != kInvalidBlock);
    // The deepest needed entry whose window block the tree does not keep (a tombstone).
    int64_t missing = -1;
    for (int64_t i = blocks - 1; i >= 0 && missing < 0; --i) {
      if (!WindowNeeds(i, p)) {
        i = std::min(i, SinkBlocks());  // skip to the sinks (the loop's --i lands below them)
        continue;
      }
      if (!window_of_.contains(MatchBlock(*m, static_cast<size_t>(i)))) missing = i;
    }
    if (missing < 0) return cut;
    // The next candidate is that block's start: its window lies wholly before the tombstone.
    m->full.resize(static_cast<size_t>(missing));
    m->partial = kInvalidBlock;
    m->partial_tokens = 0;
    m->matched_tokens = missing * block_size_;
    cut = true;
  }
}

bool KvCacheManager::WindowMustCopy(BlockId block, int32_t slot, uint32_t other_holders) const {
  if (other_holders > 0) return true;
  // Kept by the tree: the tokens its primary block published are immutable.
  const BlockId primary = window_at_[Index(block)].primary;
  return window_->cache_held(block) && primary != kInvalidBlock &&
         slot < cache_->CoverageOf(primary);
}

void KvCacheManager::PlanWindowGrow(const Sequence& seq, int64_t window_ahead, WriteClaims* claims,
                                    GrowPlan* plan) const {
  if (plan->num_tokens <= seq.num_tokens) return;
  const int64_t horizon = window_ahead < 0 || window_ahead >= plan->num_tokens
                              ? plan->num_tokens
                              : std::min(plan->num_tokens, seq.num_tokens + window_ahead);
  plan->window_new_blocks = static_cast<int32_t>(
      std::max<int64_t>(0, BlocksFor(horizon) - static_cast<int64_t>(seq.window_table.size())));
  // The entry being written, when allocated, is live: it holds the last token, which every
  // window reads.
  if (!WindowPartialLive(seq)) return;
  const int32_t slot = static_cast<int32_t>(seq.num_tokens % block_size_);
  const BlockId target = seq.window_table[static_cast<size_t>(seq.num_tokens / block_size_)];
  KVPOOL_CHECK(target != kInvalidBlock);
  const bool kept = window_->cache_held(target);
  const uint32_t refs = window_->refs(target) - (kept ? 1 : 0);
  if (refs <= 1 && !kept) return;
  uint32_t moved = 0;  // copies planned earlier in this batch take their holders off the block
  for (const auto& [b, n] : *claims) moved += b == target ? n : 0;
  if (WindowMustCopy(target, slot, refs - 1 - moved)) {
    plan->window_cow = true;
    Claim(claims, target);
  }
}

void KvCacheManager::PlanWindowAllocate(const AllocateRequest& r, AllocateTally* tally,
                                        AllocatePlan* p) const {
  if (p->uncut) return;  // no window entries: ImportWindow gives them
  const PrefixMatch& m = p->match;
  int64_t adopted = 0;  // cached window blocks this request turns ACTIVE (a quota's charge)
  const auto adopt = [&](BlockId block) {
    std::vector<BlockId>& seen = tally->window_adopted;
    if (window_->state(block) == BlockState::kCached &&
        std::find(seen.begin(), seen.end(), block) == seen.end()) {
      seen.push_back(block);
      ++adopted;
    }
  };
  for (size_t i = 0; i < m.full.size(); ++i) {
    if (WindowNeeds(static_cast<int64_t>(i), m.matched_tokens)) {
      tally->window_keep.push_back(window_of_.at(m.full[i]));
      adopt(tally->window_keep.back());
    }
  }
  if (m.partial != kInvalidBlock) {
    // It holds the last matched token, which every window reads: always needed.
    const BlockId block = window_of_.at(m.partial);
    if (r.num_tokens > m.matched_tokens) {
      uint32_t earlier = 0;  // holders this batch already added
      for (const auto& [b, n] : tally->window_joined) earlier += b == block ? n : 0;
      p->window_copy_partial =
          WindowMustCopy(block, m.partial_tokens, window_->refs(block) - 1 + earlier);
    }
    if (!p->window_copy_partial) {
      Claim(&tally->window_joined, block);
      adopt(block);
    }
    tally->window_keep.push_back(block);
  }
  const int64_t from_match =
      static_cast<int64_t>(m.full.size()) + (m.partial != kInvalidBlock ? 1 : 0);
  const int64_t horizon = r.window_ahead < 0 || r.window_ahead >= r.num_tokens
                              ? r.num_tokens
                              : std::min(r.num_tokens, m.matched_tokens + r.window_ahead);
  p->window_new_blocks =
      static_cast<int32_t>(std::max<int64_t>(0, BlocksFor(horizon) - from_match));
  const int64_t fresh = p->window_new_blocks + (p->window_copy_partial ? 1 : 0);
  tally->window_blocks += fresh;
  AddCharge(&tally->groups, r.ns, fresh + adopted, 0);
}

absl::Status KvCacheManager::CheckWindowRoom(int64_t blocks, std::span<const BlockId> keep,
                                             std::vector<BlockId>* victims, std::string_view what) {
  if (!window_ || blocks == 0) return absl::OkStatus();
  if (blocks > window_->num_free()) window_->ReclaimRetired(Context(kNoSession, SequenceId(0)));
  const int64_t short_by = blocks - window_->num_free();
  // Cached window blocks give way, least recently used first (of the eviction share using the
  // most, with shares): those nobody holds whose fences have passed free a block at once when
  // evicted. Never primary blocks.
  const bool fair = cache_ != nullptr && cache_->fair();
  std::vector<std::pair<BlockId, BlockId>> eligible;
  for (const auto& [stamp, block] : window_lru_) {
    if (!fair && static_cast<int64_t>(victims->size()) >= short_by) break;
    if (window_->state(block) == BlockState::kCached && window_->FencesPassed(block) &&
        std::find(keep.begin(), keep.end(), block) == keep.end()) {
      if (fair) {
        eligible.emplace_back(block, window_at_[Index(block)].primary);
      } else {
        victims->push_back(block);
      }
    }
  }
  if (fair && short_by > static_cast<int64_t>(victims->size())) {
    const int64_t want = short_by - static_cast<int64_t>(victims->size());
    for (BlockId b : FairComponentVictims(eligible, want, unit_window_)) victims->push_back(b);
  }
  if (short_by > static_cast<int64_t>(victims->size())) {
    const int64_t missing = short_by - static_cast<int64_t>(victims->size());
    victims->clear();
    return ResourceExhausted(
        Resource::kWindowBlocks, missing,
        fmt::format("{} needs {} window group blocks, {} free of {}, {} cached", what, blocks,
                    window_->num_free(), window_->num_blocks(), window_->num_cached()));
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::PlanWindowNamespaces(
    std::span<const std::pair<NamespaceId, int64_t>> namespaces,
    std::vector<NamespaceSlot>* recycle, std::string_view what) const {
  int64_t fresh = 0;
  for (const auto& [ns, n] : namespaces) fresh += window_->FindNamespace(ns) ? 0 : 1;
  if (fresh <= window_->namespaces_left()) return absl::OkStatus();
  const auto full = [&] {
    return absl::ResourceExhaustedError(fmt::format(
        "{}: the window group's namespace table is full ({} new namespaces asked)", what, fresh));
  };
  if (!FindRoom(*window_, &full_window_table_, namespaces, fresh, recycle)) return full();
  return absl::OkStatus();
}

void KvCacheManager::EvictWindowPlanned(std::span<const BlockId> victims, const TraceContext& ctx) {
  for (BlockId block : victims) {
    // The call's primary evictions may have taken it with its block already.
    if (window_at_[Index(block)].primary != kInvalidBlock) DropWindowBlock(block, ctx);
  }
}

void KvCacheManager::ApplyWindowGrow(const GrowPlan& plan, const TraceContext& ctx,
                                     DevicePlan* device_plan, TableChange* change) {
  Sequence& seq = *plan.sequence;
  if (plan.window_cow) {
    const size_t index = static_cast<size_t>(seq.num_tokens / block_size_);
    const BlockId src = seq.window_table[index];
    std::vector<BlockId> dst;
    KVPOOL_CHECK_OK(window_->Allocate(1, seq.window_slot, ctx, &dst, /*fills=*/nullptr));
    KVPOOL_CHECK_OK(window_->Release(src, ctx));
    seq.window_table[index] = dst[0];
    device_plan->window_copies.push_back(BlockCopy{src, dst[0]});
    ++counters_.cow_copies;
    change->first_changed = std::min(change->first_changed, static_cast<int32_t>(index));
    change->window_replaced = src;
  }
  if (plan.window_new_blocks > 0) {
    KVPOOL_CHECK_OK(window_->Allocate(plan.window_new_blocks, seq.window_slot, ctx,
                                      &seq.window_table, &device_plan->window_fills));
  }
}

void KvCacheManager::AdoptWindow(Sequence* seq, const AllocatePlan& p, int64_t num_tokens,
                                 const TraceContext& ctx, DevicePlan* plan) {
  const absl::StatusOr<NamespaceSlot> slot = window_->RegisterNamespace(seq->ns);
  KVPOOL_CHECK_OK(slot.status());  // PlanWindowNamespaces made room
  seq->window_slot = *slot;
  if (p.uncut) return;  // no window entries: ImportWindow gives them
  const PrefixMatch& m = p.match;
  seq->window_table.reserve(static_cast<size_t>(BlocksFor(num_tokens)));
  for (size_t i = 0; i < m.full.size(); ++i) {
    if (!WindowNeeds(static_cast<int64_t>(i), m.matched_tokens)) {
      seq->window_table.push_back(kInvalidBlock);  // before its window: never read again
      continue;
    }
    const BlockId block = window_of_.at(m.full[i]);
    KVPOOL_CHECK_OK(window_->Retain(block, ctx));
    TouchWindowBlock(block);
    seq->window_table.push_back(block);
  }
  if (m.partial != kInvalidBlock) {
    const BlockId src = window_of_.at(m.partial);
    TouchWindowBlock(src);
    if (p.window_copy_partial) {
      KVPOOL_CHECK_OK(
          window_->Allocate(1, seq->window_slot, ctx, &seq->window_table, /*fills=*/nullptr));
      plan->window_copies.push_back(BlockCopy{src, seq->window_table.back()});
      ++counters_.cow_copies;
    } else {
      KVPOOL_CHECK_OK(window_->Retain(src, ctx));
      seq->window_table.push_back(src);
    }
  }
  KVPOOL_CHECK_OK(window_->Allocate(p.window_new_blocks, seq->window_slot, ctx, &seq->window_table,
                                    &plan->window_fills));
}

void KvCacheManager::ForkWindow(const Sequence& parent, Sequence* child, const TraceContext& ctx,
                                DevicePlan* plan) {
  child->window_table = parent.window_table;
  const bool partial = WindowPartialLive(parent);
  const size_t shared = child->window_table.size() - (partial ? 1 : 0);
  for (size_t i = 0; i < shared; ++i) {
    if (child->window_table[i] != kInvalidBlock) {
      KVPOOL_CHECK_OK(window_->Retain(child->window_table[i], ctx));
    }
  }
  if (partial) {  // both will write into it: the child gets a copy (the last entry is live)
    std::vector<BlockId> dst;
    KVPOOL_CHECK_OK(window_->Allocate(1, child->window_slot, ctx, &dst, /*fills=*/nullptr));
    plan->window_copies.push_back(BlockCopy{child->window_table.back(), dst[0]});
    child->window_table.back() = dst[0];
    ++counters_.cow_copies;
  }
}

absl::Status KvCacheManager::CheckWindowTruncate(const Sequence& seq, int64_t n) const {
  // (Entries not allocated yet hold nothing the rewound sequence reads.)
  const int64_t end = std::min(BlocksFor(n), static_cast<int64_t>(seq.window_table.size()));
  const int64_t sinks = std::min(SinkBlocks(), end);
  bool released = false;
  for (int64_t i = std::max(sinks, WindowStart(n)); i < end && !released; ++i) {
    released = seq.window_table[static_cast<size_t>(i)] == kInvalidBlock;
  }
  if (!released) return absl::OkStatus();
  // The released entries are one run after the sinks: [SinkBlocks(), first_live).
  int64_t first_live = SinkBlocks();
  while (first_live < end && seq.window_table[static_cast<size_t>(first_live)] == kInvalidBlock) {
    ++first_live;
  }
  return absl::FailedPreconditionError(fmt::format(
      "cannot truncate sequence {} of {} tokens to {}: a sequence of {} tokens reads tokens from "
      "{} on (window {}, {} sink tokens) and the window group released tokens [{}, {}) as they "
      "left the window (docs/hybrid-groups.md §3); the lowest length it can go back to is {} "
      "(or {} or fewer, within its sinks)",
      seq.id.value(), seq.num_tokens, n, n, std::max<int64_t>(0, n - window_tokens_ + 1),
      window_tokens_, sink_tokens_, SinkBlocks() * block_size_, first_live * block_size_,
      first_live * block_size_ + window_tokens_ - 1, SinkBlocks() * block_size_));
}

void KvCacheManager::ReleaseWindowTail(Sequence* seq, size_t keep, const TraceContext& ctx) {
  for (size_t k = seq->window_table.size(); k > keep;) {
    --k;
    if (seq->window_table[k] != kInvalidBlock) {
      KVPOOL_CHECK_OK(window_->Release(seq->window_table[k], ctx));  // fenced
    }
  }
  seq->window_table.resize(std::min(keep, seq->window_table.size()));
}

absl::Status KvCacheManager::ExtendWindow(SessionId caller, SequenceId sequence, int64_t tokens,
                                          DevicePlan* plan) {
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (tokens < 0 || tokens > seq->num_tokens) {
    return absl::InvalidArgumentError(
        fmt::format("cannot extend the window of sequence {} ({} tokens) to {} tokens",
                    sequence.value(), seq->num_tokens, tokens));
  }
  if (!window_) return absl::OkStatus();
  const int64_t add = BlocksFor(tokens) - static_cast<int64_t>(seq->window_table.size());
  if (add <= 0) return absl::OkStatus();
  if (!quotas_.empty()) {
    const GroupCharge groups[] = {{.ns = seq->ns, .window_blocks = add}};
    KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckQuotas({}, groups, "extend window")));
  }
  std::vector<BlockId> victims;
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckWindowRoom(add, {}, &victims, "extend window")));
  EvictWindowPlanned(victims, ctx);
  KVPOOL_CHECK_OK(
      window_->Allocate(add, seq->window_slot, ctx, &seq->window_table, &plan->window_fills));
  return absl::OkStatus();
}

absl::Status KvCacheManager::SlideWindow(SessionId caller, SequenceId sequence,
                                         int64_t computed_tokens) {
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (computed_tokens < 0 || computed_tokens > seq->num_tokens) {
    return absl::InvalidArgumentError(
        fmt::format("cannot slide the window of sequence {} ({} tokens) to {} computed tokens",
                    sequence.value(), seq->num_tokens, computed_tokens));
  }
  if (!window_) return absl::OkStatus();
  ReleaseBeforeWindow(seq, computed_tokens, ctx);
  return absl::OkStatus();
}

void KvCacheManager::ReleaseBeforeWindow(Sequence* seq, int64_t computed, const TraceContext& ctx) {
  // Deepest first, down to the run released before (or the sinks): O(entries released now).
  const int64_t start =
      std::min(WindowStart(computed), static_cast<int64_t>(seq->window_table.size()));
  for (int64_t i = start - 1; i >= SinkBlocks(); --i) {
    BlockId& entry = seq->window_table[static_cast<size_t>(i)];
    if (entry == kInvalidBlock) break;
    KVPOOL_CHECK_OK(window_->Release(entry, ctx));  // fenced: a step still reading it
    entry = kInvalidBlock;
    ++counters_.windows.released;
  }
}

absl::StatusOr<std::vector<std::pair<int64_t, BlockId>>> KvCacheManager::ImportWindow(
    SessionId caller, SequenceId sequence) {
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  std::vector<std::pair<int64_t, BlockId>> imported;
  if (!window_) return imported;
  const int64_t n = seq->num_tokens;
  const auto from = static_cast<int64_t>(seq->window_table.size());
  // Per entry appended: the tree's window block beside its block (a full one: it holds every
  // token the entry does), a fresh one, or none.
  const auto kept = [&](int64_t i) {
    const BlockId primary = seq->table[static_cast<size_t>(i)];
    const auto it = window_of_.find(primary);
    return it != window_of_.end() && window_at_[Index(it->second)].covered == block_size_
               ? it->second
               : kInvalidBlock;
  };
  int64_t fresh = 0;
  std::vector<BlockId> adopted;  // kept blocks it takes: charged when CACHED, never evicted for it
  int64_t charged = 0;
  for (int64_t i = from; i < BlocksFor(n); ++i) {
    if (!WindowNeeds(i, n)) continue;
    const BlockId block = kept(i);
    if (block == kInvalidBlock) {
      ++fresh;
    } else {
      adopted.push_back(block);
      charged += window_->state(block) == BlockState::kCached ? 1 : 0;
    }
  }
  std::vector<BlockId> victims;
  if (fresh + charged > 0 && !quotas_.empty()) {
    const GroupCharge groups[] = {{.ns = seq->ns, .window_blocks = fresh + charged}};
    KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckQuotas({}, groups, "import window")));
  }
  if (fresh > 0) {
    KVPOOL_RETURN_IF_ERROR(
        CountExhausted(CheckWindowRoom(fresh, adopted, &victims, "import window")));
  }
  EvictWindowPlanned(victims, ctx);
  ReleaseBeforeWindow(seq, n, ctx);
  seq->window_imported = true;
  std::vector<BlockId> blocks;
  KVPOOL_CHECK_OK(window_->Allocate(static_cast<int32_t>(fresh), seq->window_slot, ctx, &blocks,
                                    /*fills=*/nullptr));  // the caller's copies fill them
  imported.reserve(blocks.size());
  for (int64_t i = from; i < BlocksFor(n); ++i) {
    if (!WindowNeeds(i, n)) {
      seq->window_table.push_back(kInvalidBlock);
      continue;
    }
    if (const BlockId block = kept(i); block != kInvalidBlock) {
      KVPOOL_CHECK_OK(window_->Retain(block, ctx));
      TouchWindowBlock(block);
      seq->window_table.push_back(block);
      continue;
    }
    seq->window_table.push_back(blocks[imported.size()]);
    imported.emplace_back(i, seq->window_table.back());
  }
  return imported;
}

void KvCacheManager::KeepWindowBlocks(Sequence* seq, int64_t committed, const TraceContext& ctx) {
  const CachePath& path = seq->path;
  // (Blocks published without window entries, a KV client's that never extended its window,
  // leave tombstones.)
  const size_t published = std::min(path.full.size() + (path.partial != kInvalidBlock ? 1 : 0),
                                    seq->window_table.size());
  // (entry, tree block) of the window blocks kept here beside full blocks: the path's full ones,
  // or its partial one where the sequence's own block is full (a Truncate shortened the path).
  std::vector<std::pair<size_t, BlockId>> announce;
  const auto keep = [&](size_t i) {
    const BlockId primary = i < path.full.size() ? path.full[i] : path.partial;
    const BlockId block = seq->window_table[i];
    // Only the window block written beside the tree's own block holds its tokens (or one filled
    // with exactly those tokens' window, ImportWindow), and only those this sequence committed:
    // the path's partial block may be one it shares (a Fork) or follows that covers more. One per
    // tree block.
    if (block == kInvalidBlock || (seq->table[i] != primary && !seq->window_imported)) return;
    const int32_t coverage = cache_->CoverageOf(primary);
    if (committed - static_cast<int64_t>(i) * block_size_ < coverage) return;
    const bool full = coverage == block_size_;
    if (auto it = window_of_.find(primary); it != window_of_.end()) {
      WindowRecord& r = window_at_[Index(it->second)];
      if (r.covered == coverage) return;
      // The tree block was widened since (its sequence wrote on and committed more of it).
      if (it->second == block) {  // into the kept window block itself: it holds them too
        r.covered = coverage;
        if (full) announce.emplace_back(i, primary);  // (it was partial: not announced yet)
        return;
      }
      // Into a copy (the window group copied on write): the kept block lacks the new tokens.
      DropWindowBlock(it->second, ctx);
    }
    if (window_->cache_held(block)) return;
    KVPOOL_CHECK_OK(window_->AddCacheRef(block, ctx));
    window_at_[Index(block)] = {.primary = primary, .stamp = ++window_clock_, .covered = coverage};
    window_lru_.insert({window_clock_, block});
    window_of_[primary] = block;
    cache_->ChargeShare(primary, unit_window_);  // its tenant's cached bytes (fair eviction)
    ++counters_.windows.kept;
    if (full) announce.emplace_back(i, primary);
  };
  const size_t sinks = std::min(static_cast<size_t>(SinkBlocks()), published);
  for (size_t i = 0; i < sinks; ++i) keep(i);
  // The live entries are the last ones: O(window) per call, however long the sequence.
  for (size_t i = published; i > sinks && seq->window_table[i - 1] != kInvalidBlock; --i) {
    keep(i - 1);
  }
  // A widened tree block whose window block this sequence no longer holds live keeps none: the
  // kept one lacks the tokens it was widened by (a tombstone, as for a slid-out entry).
  for (BlockId primary : widened_) {
    if (auto it = window_of_.find(primary);
        it != window_of_.end() &&
        window_at_[Index(it->second)].covered < cache_->CoverageOf(primary)) {
      DropWindowBlock(it->second, ctx);
    }
  }
  widened_.clear();
  // One Stored event per run of consecutive entries (each block the parent of the next).
  std::sort(announce.begin(), announce.end());
  std::vector<BlockId> run;
  for (size_t a = 0; a < announce.size(); ++a) {
    if (journal_windows_) {  // a lower tier stores it beside its block
      if (const std::optional<PublishedBlock> p = cache_->PublishedOf(announce[a].second)) {
        published_windows_.push_back({.block = *p, .window = window_of_.at(announce[a].second)});
      }
    }
    run.push_back(announce[a].second);
    if (a + 1 == announce.size() || announce[a + 1].first != announce[a].first + 1) {
      cache_->AnnounceComponent(run, *event_groups_.window);
      run.clear();
    }
  }
}

void KvCacheManager::TakePublishedWindowBlocks(std::vector<PublishedWindowBlock>* out) {
  out->clear();
  for (const PublishedWindowBlock& w : published_windows_) {
    // Only those still kept where they were (one may have been dropped, its block reused since).
    auto it = window_of_.find(w.block.block);
    if (it != window_of_.end() && it->second == w.window &&
        window_at_[Index(w.window)].covered == block_size_) {
      out->push_back(w);
    }
  }
  published_windows_.clear();
}

void KvCacheManager::DropWindowBlock(BlockId block, const TraceContext& ctx) {
  WindowRecord& r = window_at_[Index(block)];
  if (r.covered == block_size_) {  // a Stored event named it
    cache_->ForgetComponent(std::span(&r.primary, 1), *event_groups_.window);
  }
  window_lru_.erase({r.stamp, block});
  window_of_.erase(r.primary);
  cache_->ChargeShare(r.primary, -unit_window_);
  r = WindowRecord{};
  // Fenced: a copy out of it, or a step reading it, still queued keeps it RETIRING.
  KVPOOL_CHECK_OK(window_->DropCacheRef(block, ctx));
  ++counters_.windows.evicted;
}

void KvCacheManager::TouchWindowBlock(BlockId block) {
  WindowRecord& r = window_at_[Index(block)];
  window_lru_.erase({r.stamp, block});
  r.stamp = ++window_clock_;
  window_lru_.insert({r.stamp, block});
}

absl::Status KvCacheManager::MarkWindowInFlight(std::span<const BlockId> blocks, Fence fence) {
  if (blocks.empty()) return absl::OkStatus();
  if (!window_) return absl::NotFoundError("this pool has no window group");
  for (BlockId block : blocks) {
    if (!window_->Contains(block)) {
      return absl::NotFoundError(fmt::format("window block {} does not exist", block.value()));
    }
    const BlockState state = window_->state(block);
    if (state != BlockState::kActive && state != BlockState::kCached) {
      return absl::FailedPreconditionError(fmt::format("device work on window block {} in state {}",
                                                       block.value(), BlockStateName(state)));
    }
  }
  const TraceContext ctx = Context(kNoSession, SequenceId(0));
  for (BlockId block : blocks) KVPOOL_RETURN_IF_ERROR(window_->MarkInFlight(block, fence, ctx));
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckWindows() const {
  if (!window_) {
    for (const auto& [id, seq] : sequences_) {
      if (!seq.window_table.empty()) {
        return InvariantViolation("sequence {} has a window table without a window group",
                                  id.value());
      }
    }
    return absl::OkStatus();
  }
  KVPOOL_RETURN_IF_ERROR(window_->CheckInvariants());
  const BlockPoolStats st = window_->stats();
  if (st.free + st.active + st.cached + st.retiring != st.num_blocks) {
    return InvariantViolation("window group: {} free + {} active + {} cached + {} retiring != {}",
                              st.free, st.active, st.cached, st.retiring, st.num_blocks);
  }
  for (const auto& [id, seq] : sequences_) {
    const size_t n = seq.window_table.size();
    if (n > seq.table.size() || window_->FindNamespace(seq.ns) != seq.window_slot) {
      return InvariantViolation("sequence {} has {} window entries for {} blocks (slot {})",
                                id.value(), n, seq.table.size(), seq.window_slot.value());
    }
    // Its sinks, then one run of released entries, then live ones to the end (entries past it
    // not allocated yet); a partial last block (being written) live when allocated.
    size_t i = 0;
    const size_t sinks = std::min(static_cast<size_t>(SinkBlocks()), n);
    while (i < sinks && seq.window_table[i] != kInvalidBlock) ++i;
    while (i < n && i >= sinks && seq.window_table[i] == kInvalidBlock) ++i;
    while (i < n && seq.window_table[i] != kInvalidBlock) ++i;
    if (i != n || (n == seq.table.size() && seq.num_tokens % block_size_ != 0 &&
                   seq.window_table[n - 1] == kInvalidBlock)) {
      return InvariantViolation(
          "sequence {}: window entry {} is released out of order (sinks {}, {} entries)",
          id.value(), i, sinks, n);
    }
    for (BlockId block : seq.window_table) {
      if (block != kInvalidBlock &&
          (!window_->Contains(block) || window_->state(block) != BlockState::kActive)) {
        return InvariantViolation("sequence {} holds window block {}, which is not ACTIVE",
                                  id.value(), block.value());
      }
    }
  }
  return CheckWindowRefs();
}

absl::Status KvCacheManager::CheckWindowRefs() const {
  std::vector<uint32_t> refs(static_cast<size_t>(window_->num_blocks()), 0);
  for (const auto& [id, seq] : sequences_) {
    for (BlockId block : seq.window_table) {
      if (block != kInvalidBlock) ++refs[Index(block)];
    }
  }
  if (window_lru_.size() != window_of_.size() || !window_lru_.CheckOrder()) {
    return InvariantViolation("{} window blocks kept, {} by tree block (LRU list intact: {})",
                              window_lru_.size(), window_of_.size(), window_lru_.CheckOrder());
  }
  for (const auto& [stamp, block] : window_lru_) {
    const WindowRecord& r = window_at_[Index(block)];
    auto it = window_of_.find(r.primary);
    if (r.stamp != stamp || it == window_of_.end() || it->second != block || !cache_ ||
        !cache_->holds(r.primary) || !window_->cache_held(block)) {
      return InvariantViolation("window block {} (for block {}) is not kept where it says",
                                block.value(), r.primary.value());
    }
    // It holds every token its block covers (a widened block's is re-kept or dropped).
    if (const int32_t coverage = cache_->CoverageOf(r.primary); r.covered != coverage) {
      return InvariantViolation("window block {} holds {} tokens of block {}, which covers {}",
                                block.value(), r.covered, r.primary.value(), coverage);
    }
    ++refs[Index(block)];
  }
  for (int32_t b = 0; b < window_->num_blocks(); ++b) {
    const BlockId block(b);
    const uint32_t want = refs[static_cast<size_t>(b)];
    const BlockState state = window_->state(block);
    const bool live = state == BlockState::kActive || state == BlockState::kCached;
    const bool only_tree = want == 1 && window_->cache_held(block);
    if ((live ? window_->refs(block) : 0) != want ||
        (window_->cache_held(block) && window_at_[Index(block)].primary == kInvalidBlock) ||
        (state == BlockState::kCached) != (live && only_tree)) {
      return InvariantViolation("window block {} is {} with {} references, {} expected", b,
                                BlockStateName(state), live ? window_->refs(block) : 0, want);
    }
  }
  return absl::OkStatus();
}

void KvCacheManager::WindowDebugString(std::string* out) const {
  *out += "window group:\n" + window_->DebugString();
  for (const auto& [stamp, block] : window_lru_) {
    const WindowRecord& r = window_at_[Index(block)];
    fmt::format_to(std::back_inserter(*out), "window block={} primary={} stamp={} covered={}\n",
                   block.value(), r.primary.value(), stamp, r.covered);
  }
}

void KvCacheManager::SequenceWindowDebugString(const Sequence& seq, std::string* out) const {
  std::vector<int32_t> ids;
  ids.reserve(seq.window_table.size());
  for (BlockId b : seq.window_table) ids.push_back(b.value());
  fmt::format_to(std::back_inserter(*out), " window={}@{}", fmt::join(ids, ","),
                 seq.window_slot.value());
}

}  // namespace kvpool
