// KvCacheManager: state checkpoints (docs/hybrid-groups.md §4). A checkpoint is a state-group
// slot holding every state-space layer's state after an exact token position; it belongs to the
// tree block that position ends in (with its offset in the block), is CACHED in the state group
// while only the tree keeps it, and leaves with its block. A prompt resumes from the deepest one
// its attention match reaches.

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

}  // namespace

std::string_view CheckpointKindName(CheckpointKind kind) {
  switch (kind) {
    case CheckpointKind::kInterval:
      return "interval";
    case CheckpointKind::kBranch:
      return "branch";
    case CheckpointKind::kPrefillEnd:
      return "prefill_end";
    case CheckpointKind::kSequenceEnd:
      return "sequence_end";
    case CheckpointKind::kRolling:
      return "rolling";
    case CheckpointKind::kImported:
      return "imported";
    case CheckpointKind::kResumed:
      return "resumed";
  }
  return "unknown";
}

BlockId KvCacheManager::CutToCheckpoint(
    PrefixMatch* m, std::optional<std::pair<BlockId, CheckpointKind>>* ghost) const {
  const int64_t bs = block_size_;
  // An evicted checkpoint at `block`, within `tokens` of it, that the cut passes.
  const auto passes = [&](BlockId block, int64_t tokens) {
    if (ghost == nullptr || ghost->has_value() || checkpoint_ghosts_.empty()) return;
    if (auto it = checkpoint_ghosts_.find(block);
        it != checkpoint_ghosts_.end() && it->second.offset <= tokens) {
      *ghost = std::pair{block, it->second.kind};
    }
  };
  // Deepest first: the partially matched block, then the full ones from the last.
  if (m->partial != kInvalidBlock) {
    passes(m->partial, m->partial_tokens);
    if (auto it = checkpoint_of_.find(m->partial); it != checkpoint_of_.end()) {
      const int32_t offset = checkpoint_at_[Index(it->second)].offset;
      if (offset <= m->partial_tokens) {
        m->partial_tokens = offset;
        m->matched_tokens = static_cast<int64_t>(m->full.size()) * bs + offset;
        return it->second;
      }
    }
    m->partial = kInvalidBlock;
    m->partial_tokens = 0;
  }
  for (size_t i = m->full.size(); i-- > 0;) {
    auto it = checkpoint_of_.find(m->full[i]);
    if (it == checkpoint_of_.end()) {
      passes(m->full[i], bs);
      continue;
    }
    const int32_t offset = checkpoint_at_[Index(it->second)].offset;
    if (offset == block_size_) {
      m->full.resize(i + 1);
    } else {  // the state inside the block: its first `offset` tokens are matched
      m->partial = m->full[i];
      m->partial_tokens = offset;
      m->full.resize(i);
    }
    m->matched_tokens = static_cast<int64_t>(i) * bs + offset;
    return it->second;
  }
  *m = PrefixMatch{};
  return kInvalidBlock;
}

bool KvCacheManager::EvictFirstCheckpoint(std::span<const BlockId> keep, bool passed,
                                          const TraceContext& ctx) {
  const bool fair = cache_ != nullptr && cache_->fair();
  std::vector<std::pair<BlockId, BlockId>> eligible;
  for (const auto& key : checkpoint_order_) {
    const BlockId slot = key.id;
    if (states_->state(slot) != BlockState::kCached) continue;  // a resuming sequence holds it
    if (passed && !states_->FencesPassed(slot)) continue;
    if (std::find(keep.begin(), keep.end(), slot) != keep.end()) continue;
    if (!fair) {
      DropCheckpoint(slot, ctx, /*victim=*/true);
      return true;
    }
    eligible.emplace_back(slot, checkpoint_at_[Index(slot)].block);
  }
  const std::vector<BlockId> victim = FairComponentVictims(eligible, 1, unit_state_);
  if (victim.empty()) return false;
  DropCheckpoint(victim[0], ctx, /*victim=*/true);
  return true;
}

std::vector<BlockId> KvCacheManager::FairComponentVictims(
    std::span<const std::pair<BlockId, BlockId>> eligible, int64_t want, int64_t unit) const {
  std::vector<BlockId> out;
  if (cache_ == nullptr || !cache_->fair()) {
    for (size_t i = 0; i < eligible.size() && static_cast<int64_t>(out.size()) < want; ++i) {
      out.push_back(eligible[i].first);
    }
    return out;
  }
  const std::vector<ShareUse> shares = cache_->Shares();
  std::vector<std::vector<BlockId>> by_share(shares.size());  // each in eviction order
  for (const auto& [component, primary] : eligible) {
    by_share[cache_->ShareIndexOf(primary)].push_back(component);
  }
  std::vector<size_t> taken(shares.size(), 0);
  while (static_cast<int64_t>(out.size()) < want) {
    size_t best = shares.size();
    double best_use = 0;
    for (size_t i = 0; i < shares.size(); ++i) {
      if (taken[i] == by_share[i].size()) continue;
      const double use =
          static_cast<double>(shares[i].bytes - static_cast<int64_t>(taken[i]) * unit) /
          shares[i].weight;
      if (best == shares.size() || use > best_use) {
        best = i;
        best_use = use;
      }
    }
    if (best == shares.size()) break;
    out.push_back(by_share[best][taken[best]++]);
  }
  return out;
}

BlockId KvCacheManager::TakeCheckpointSlot(const TraceContext& ctx) {
  // Decided before anything is evicted: a slot that cannot be had costs no cached checkpoint.
  if (states_->num_free() == 0) states_->ReclaimRetired(ctx);
  if (states_->num_free() == 0) {
    // Only a cached checkpoint whose fences have passed frees a slot now (and, evicted, its
    // share of checkpoint_slots too).
    if (!EvictFirstCheckpoint({}, /*passed=*/true, ctx)) return kInvalidBlock;
  } else if (static_cast<int64_t>(checkpoint_order_.size()) + planned_checkpoints_ >=
                 checkpoint_slots_ &&
             !EvictFirstCheckpoint({}, /*passed=*/false, ctx)) {
    return kInvalidBlock;
  }
  KVPOOL_CHECK(states_->num_free() > 0);  // a CACHED slot whose fences passed is freed at once
  std::vector<BlockId> slot;
  KVPOOL_CHECK_OK(states_->Allocate(1, state_owner_, ctx, &slot, /*fills=*/nullptr));
  ++planned_checkpoints_;
  return slot[0];
}

absl::Status KvCacheManager::PlanCheckpoints(SessionId caller, SequenceId sequence, int64_t from,
                                             int64_t to, bool prefill,
                                             std::vector<PlannedCheckpoint>* out) {
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (from < 0 || to <= from || to > seq->num_tokens) {
    return absl::InvalidArgumentError(
        fmt::format("checkpoints of sequence {} ({} tokens): a step from {} to {} tokens",
                    sequence.value(), seq->num_tokens, from, to));
  }
  // A checkpoint names the state after its position: only a state known to hold `from` tokens
  // can give one.
  if (checkpoint_slots_ == 0 || seq->state_tokens != from) return absl::OkStatus();
  const int64_t bs = block_size_;
  std::vector<int64_t> want;
  if (checkpoint_interval_ > 0) {
    const int64_t every = int64_t{checkpoint_interval_} * bs;
    for (int64_t p = (from / every + 1) * every; p <= to; p += every) want.push_back(p);
  }
  if (seq->branch_at > from && seq->branch_at <= to) want.push_back(seq->branch_at);
  if (prefill && (to - 1) / bs * bs > from) want.push_back((to - 1) / bs * bs);
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  // A decode ending on a block boundary no other checkpoint is wanted at: the rolling one.
  const bool rolling =
      !prefill && to % bs == 0 && !std::binary_search(want.begin(), want.end(), to);
  for (int64_t p : want) {
    const bool planned = std::any_of(seq->checkpoints.begin(), seq->checkpoints.end(),
                                     [&](const PlannedCheckpoint& c) { return c.position == p; });
    if (planned) continue;
    const BlockId slot = TakeCheckpointSlot(ctx);
    if (slot == kInvalidBlock) {
      ++counters_.checkpoints.skipped;
      continue;
    }
    checkpoint_at_[Index(slot)].kind =
        p == seq->branch_at ? CheckpointKind::kBranch
        : checkpoint_interval_ > 0 && p % (int64_t{checkpoint_interval_} * bs) == 0
            ? CheckpointKind::kInterval
            : CheckpointKind::kPrefillEnd;
    seq->checkpoints.push_back({p, slot});
    out->push_back({p, slot});
    ++counters_.checkpoints.planned;
  }
  if (rolling) PlanRolling(seq, to, out, ctx);
  std::sort(seq->checkpoints.begin(), seq->checkpoints.end(),
            [](const PlannedCheckpoint& a, const PlannedCheckpoint& b) {
              return a.position < b.position;
            });
  return absl::OkStatus();
}

void KvCacheManager::PlanRolling(Sequence* seq, int64_t position,
                                 std::vector<PlannedCheckpoint>* out, const TraceContext& ctx) {
  // Its slot is the sequence's alone (out of the tree): the step rewrites it after the one that
  // wrote it last, in stream order, and marks it in flight again.
  const auto held = std::find_if(seq->checkpoints.begin(), seq->checkpoints.end(),
                                 [](const PlannedCheckpoint& c) { return c.rolling; });
  if (held != seq->checkpoints.end()) {
    held->position = position;
    out->push_back(*held);
    ++counters_.checkpoints.rolled;
    return;
  }
  // The rolling ones never take more than a quarter of the slots: the tree's checkpoints are
  // worth more to the prompts that come back while the sequences decode.
  const BlockId slot =
      rolling_checkpoints_ < checkpoint_slots_ / 4 ? TakeCheckpointSlot(ctx) : kInvalidBlock;
  if (slot == kInvalidBlock) {
    ++counters_.checkpoints.skipped;
    return;
  }
  checkpoint_at_[Index(slot)].kind = CheckpointKind::kRolling;
  const PlannedCheckpoint planned{.position = position, .slot = slot, .rolling = true};
  seq->checkpoints.push_back(planned);
  out->push_back(planned);
  ++rolling_checkpoints_;
  ++counters_.checkpoints.planned;
}

absl::Status KvCacheManager::AdvanceState(SessionId caller, SequenceId sequence, int64_t tokens) {
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (tokens < -1 || tokens > seq->num_tokens) {
    return absl::InvalidArgumentError(
        fmt::format("the state of sequence {} ({} tokens) cannot hold {} tokens", sequence.value(),
                    seq->num_tokens, tokens));
  }
  seq->state_tokens = tokens;
  return absl::OkStatus();
}

absl::Status KvCacheManager::LoseState(SessionId caller, SequenceId sequence) {
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (!states_) return absl::OkStatus();
  seq->state_tokens = -1;
  seq->state_lost = true;
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckStateUsable(const Sequence& seq) const {
  if (!seq.state_lost) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "sequence {}: its state-space state was lost (a step that moved it was taken back: its "
      "caller gave up, or it failed); truncate it to a checkpoint (the nearest on its path is at "
      "{} tokens) or to 0, then compute forward (docs/hybrid-groups.md §3)",
      seq.id.value(), NearestCheckpoint(seq, seq.num_tokens)));
}

std::pair<BlockId, int32_t> KvCacheManager::PathPlace(const Sequence& seq, int64_t position) const {
  const auto index = static_cast<size_t>((position - 1) / block_size_);
  const auto offset = static_cast<int32_t>(position - static_cast<int64_t>(index) * block_size_);
  if (index < seq.path.full.size()) return {seq.path.full[index], offset};
  // The partial block may be another sequence's (one this sequence resumed inside and copied):
  // its tokens past what this sequence published need not be this sequence's.
  const int64_t start = static_cast<int64_t>(index) * block_size_;
  if (index == seq.path.full.size() && seq.path.partial != kInvalidBlock &&
      cache_->CoverageOf(seq.path.partial) >= offset &&
      static_cast<int64_t>(seq.tokens.size()) >= position &&
      cache_->Agrees(
          seq.path.partial,
          std::span(seq.tokens).subspan(static_cast<size_t>(start), static_cast<size_t>(offset)))) {
    return {seq.path.partial, offset};
  }
  return {kInvalidBlock, 0};
}

void KvCacheManager::KeepCheckpoint(BlockId block, int32_t offset, BlockId slot,
                                    CheckpointKind kind, const TraceContext& ctx) {
  if (auto it = checkpoint_of_.find(block); it != checkpoint_of_.end()) {
    // One checkpoint per block: the deepest (a later prompt that reaches it saves the most).
    if (checkpoint_at_[Index(it->second)].offset >= offset) {
      ++counters_.checkpoints.redundant;
      KVPOOL_CHECK_OK(states_->Release(slot, ctx));  // fenced: the step that wrote it
      return;
    }
    DropCheckpoint(it->second, ctx);
  }
  KVPOOL_CHECK_OK(states_->AddCacheRef(slot, ctx));
  KVPOOL_CHECK_OK(states_->Release(slot, ctx));  // CACHED unless a resuming sequence holds it
  checkpoint_ghosts_.erase(block);               // one checkpoint or ghost per block
  CountKept(kind);
  checkpoint_at_[Index(slot)] = {
      .block = block,
      .offset = offset,
      .key = checkpoint_order_.Insert(slot, Worth(TokensSaved(block, offset), kind)),
      .kind = kind};
  checkpoint_of_[block] = slot;
  cache_->MarkResumePoint(block, true);
  cache_->ChargeShare(block, unit_state_);  // its tenant's cached bytes (fair eviction)
  ++counters_.checkpoints.kept;
  // A checkpoint at a block's last token is named by the block's hash (KvEvent::group).
  if (offset == block_size_) {
    cache_->AnnounceComponent(std::span(&block, 1), *event_groups_.state);
    if (journal_checkpoints_) {
      if (const std::optional<PublishedBlock> p = cache_->PublishedOf(block)) {
        published_checkpoints_.push_back({.block = *p, .slot = slot});
      }
    }
  }
}

void KvCacheManager::TakePublishedCheckpoints(std::vector<PublishedCheckpoint>* out) {
  out->clear();
  for (const PublishedCheckpoint& c : published_checkpoints_) {
    // Only those still kept where they were (one may have been evicted, its slot reused since).
    auto it = checkpoint_of_.find(c.block.block);
    if (it != checkpoint_of_.end() && it->second == c.slot &&
        checkpoint_at_[Index(c.slot)].offset == block_size_) {
      out->push_back(c);
    }
  }
  published_checkpoints_.clear();
}

absl::StatusOr<BlockId> KvCacheManager::ImportCheckpoint(SessionId caller, SequenceId sequence,
                                                         int64_t position) {
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (position <= 0 || position % block_size_ != 0 || position > seq->num_tokens) {
    return absl::InvalidArgumentError(fmt::format(
        "an imported checkpoint of sequence {} ({} tokens) is at a block boundary in (0, {}]: "
        "not {}",
        sequence.value(), seq->num_tokens, seq->num_tokens, position));
  }
  if (checkpoint_slots_ == 0) {
    return absl::FailedPreconditionError("this pool keeps no state checkpoints");
  }
  if (std::any_of(seq->checkpoints.begin(), seq->checkpoints.end(),
                  [&](const PlannedCheckpoint& c) { return c.position == position; })) {
    return absl::InvalidArgumentError(fmt::format(
        "sequence {} has a checkpoint planned at {} already", sequence.value(), position));
  }
  const BlockId slot = TakeCheckpointSlot(ctx);
  if (slot == kInvalidBlock) {
    ++counters_.checkpoints.skipped;
    return ResourceExhausted(Resource::kStateSlots, 1,
                             fmt::format("importing a checkpoint at {} of sequence {}: no "
                                         "checkpoint slot can be spared",
                                         position, sequence.value()));
  }
  checkpoint_at_[Index(slot)].kind = CheckpointKind::kImported;
  const PlannedCheckpoint planned{.position = position, .slot = slot, .imported = true};
  seq->checkpoints.insert(
      std::upper_bound(seq->checkpoints.begin(), seq->checkpoints.end(), planned,
                       [](const PlannedCheckpoint& a, const PlannedCheckpoint& b) {
                         return a.position < b.position;
                       }),
      planned);
  ++counters_.checkpoints.planned;
  return slot;
}

void KvCacheManager::KeepPlanned(Sequence* seq, bool at_end, const TraceContext& ctx) {
  size_t kept = 0;
  for (const PlannedCheckpoint& c : seq->checkpoints) {
    // Only once the step that writes it has run (the state passed it), and where the path
    // reaches; a rolling one only at the end (until then its slot moves on).
    const bool ready = (c.imported || c.position <= seq->state_tokens) && (at_end || !c.rolling);
    const auto [block, offset] = ready ? PathPlace(*seq, c.position) : std::pair{kInvalidBlock, 0};
    if (block == kInvalidBlock) {
      seq->checkpoints[kept++] = c;
      continue;
    }
    --planned_checkpoints_;
    rolling_checkpoints_ -= c.rolling ? 1 : 0;
    KeepCheckpoint(block, offset, c.slot, checkpoint_at_[Index(c.slot)].kind, ctx);
  }
  seq->checkpoints.resize(kept);
}

absl::StatusOr<BlockId> KvCacheManager::RewindPoint(const Sequence& seq, int64_t position,
                                                    bool can_copy) const {
  if (checkpoint_slots_ > 0 && can_copy) {
    const auto [block, offset] = PathPlace(seq, position);
    if (auto it = checkpoint_of_.find(block); block != kInvalidBlock &&
                                              it != checkpoint_of_.end() &&
                                              checkpoint_at_[Index(it->second)].offset == offset) {
      return it->second;
    }
  }
  return absl::FailedPreconditionError(fmt::format(
      "cannot truncate sequence {} to {} tokens: its state-space state is {} and has no "
      "checkpoint at {}{} (docs/hybrid-groups.md §3); the nearest checkpoint on its path is at {} "
      "tokens",
      seq.id.value(), position,
      seq.state_lost ? std::string("lost (a step that moved it was taken back)")
                     : fmt::format("past its {} known tokens", seq.tokens.size()),
      position, can_copy ? "" : " it can be copied from (no device plan)",
      NearestCheckpoint(seq, position)));
}

int64_t KvCacheManager::NearestCheckpoint(const Sequence& seq, int64_t position) const {
  PrefixMatch path{.full = seq.path.full};
  path.full.resize(std::min(path.full.size(), static_cast<size_t>(position / block_size_)));
  path.matched_tokens = static_cast<int64_t>(path.full.size()) * block_size_;
  if (checkpoint_slots_ > 0) (void)CutToCheckpoint(&path);
  return path.matched_tokens;
}

void KvCacheManager::DropPlanned(Sequence* seq, int64_t position, const TraceContext& ctx) {
  while (!seq->checkpoints.empty() && seq->checkpoints.back().position > position) {
    KVPOOL_CHECK_OK(states_->Release(seq->checkpoints.back().slot, ctx));
    rolling_checkpoints_ -= seq->checkpoints.back().rolling ? 1 : 0;
    seq->checkpoints.pop_back();
    --planned_checkpoints_;
  }
}

uint64_t KvCacheManager::TokensBefore(BlockId block, int32_t offset) const {
  return static_cast<uint64_t>(cache_->DepthOf(block) - 1) * static_cast<uint64_t>(block_size_) +
         static_cast<uint64_t>(offset);
}

uint64_t KvCacheManager::TokensSaved(BlockId block, int32_t offset) const {
  if (!checkpoints_by_tokens_saved_) return 0;  // least recently used first
  const uint64_t at = TokensBefore(block, offset);
  // One checkpoint per block, so the next one up is in a block above: O(depth) probes, at a keep
  // or a use, never per token.
  for (BlockId b = cache_->ParentOf(block); b != kInvalidBlock; b = cache_->ParentOf(b)) {
    if (auto it = checkpoint_of_.find(b); it != checkpoint_of_.end()) {
      return at - TokensBefore(b, checkpoint_at_[Index(it->second)].offset);
    }
  }
  return at;
}

void KvCacheManager::DropCheckpoint(BlockId slot, const TraceContext& ctx, bool victim) {
  CheckpointSlot& c = checkpoint_at_[Index(slot)];
  if (c.offset == block_size_)
    cache_->ForgetComponent(std::span(&c.block, 1), *event_groups_.state);
  if (!victim) {
    checkpoint_order_.Erase(c.key);
  } else if (checkpoint_order_.Evict(c.key)) {
    // Rebased: every cached checkpoint's priority changed.
    for (const auto& key : checkpoint_order_) checkpoint_at_[Index(key.id)].key = key;
  }
  checkpoint_of_.erase(c.block);
  cache_->MarkResumePoint(c.block, false);
  // Evicted for room while its block stays: a prompt that passes it still counts for its kind.
  if (victim) checkpoint_ghosts_[c.block] = {.offset = c.offset, .kind = c.kind};
  cache_->ChargeShare(c.block, -unit_state_);
  c = CheckpointSlot{};
  // Fenced: a copy out of it still queued keeps it RETIRING.
  KVPOOL_CHECK_OK(states_->DropCacheRef(slot, ctx));
  ++counters_.checkpoints.evicted;
}

void KvCacheManager::TouchCheckpoint(BlockId slot) {
  CheckpointSlot& c = checkpoint_at_[Index(slot)];
  CountResume(&c.kind);
  c.key = checkpoint_order_.Touch(c.key, Worth(TokensSaved(c.block, c.offset), c.kind));
}

void KvCacheManager::CountGhost(BlockId block) {
  // Counted as a kept one would be (TouchCheckpoint).
  auto it = checkpoint_ghosts_.find(block);
  if (it == checkpoint_ghosts_.end()) return;  // its block left the tree since the match
  CountResume(&it->second.kind);
}

void KvCacheManager::CountResume(CheckpointKind* kind) {
  kind_rates_[static_cast<size_t>(*kind)].resumed += 1;
  if (*kind == CheckpointKind::kResumed) return;
  *kind = CheckpointKind::kResumed;
  CountKept(CheckpointKind::kResumed);
}

void KvCacheManager::CountKept(CheckpointKind kind) {
  kind_rates_[static_cast<size_t>(kind)].kept += 1;
  // Halved every few turns of the slots: the rates follow the workload, not its whole history.
  kept_since_decay_ += 1;
  if (kept_since_decay_ < 4.0 * checkpoint_slots_ + 256) return;
  kept_since_decay_ = 0;
  for (CheckpointKindRate& k : kind_rates_) {
    k.kept /= 2;
    k.resumed /= 2;
  }
}

uint64_t KvCacheManager::Worth(uint64_t tokens, CheckpointKind kind) const {
  if (!checkpoints_by_kind_) return tokens;
  return tokens * kind_rates_[static_cast<size_t>(kind)].weight() / CheckpointKindRate::kOne;
}

void KvCacheManager::ReleaseStates(Sequence* seq, bool commit, const TraceContext& ctx) {
  if (checkpoint_slots_ > 0 && commit) {
    KeepPlanned(seq, /*at_end=*/true, ctx);
    // Its working state holds exactly its known tokens: it becomes the checkpoint at their end
    // (no copy: the sequence is done with it).
    const int64_t end = seq->state_tokens;
    const auto [block, offset] = end > 0 && end == static_cast<int64_t>(seq->tokens.size())
                                     ? PathPlace(*seq, end)
                                     : std::pair{kInvalidBlock, 0};
    const bool room = block != kInvalidBlock &&
                      (static_cast<int64_t>(checkpoint_order_.size()) + planned_checkpoints_ <
                           checkpoint_slots_ ||
                       EvictFirstCheckpoint({}, false, ctx));
    if (room) {
      KeepCheckpoint(block, offset, seq->state_slot, CheckpointKind::kSequenceEnd, ctx);
      seq->state_slot = kInvalidBlock;
    }
  }
  DropPlanned(seq, -1, ctx);
  // Fenced like a block: a step still reading or writing the state keeps the slot RETIRING.
  if (seq->state_slot != kInvalidBlock) KVPOOL_CHECK_OK(states_->Release(seq->state_slot, ctx));
  if (seq->resumed_from != kInvalidBlock) {
    KVPOOL_CHECK_OK(states_->Release(seq->resumed_from, ctx));
    seq->resumed_from = kInvalidBlock;
  }
}

absl::Status KvCacheManager::CheckCachedCheckpoints(std::vector<uint32_t>* refs) const {
  for (const auto& key : checkpoint_order_) {
    const BlockId slot = key.id;
    const CheckpointSlot& c = checkpoint_at_[Index(slot)];
    auto it = checkpoint_of_.find(c.block);
    // Its priority is at most the floor plus the tokens before it: it was inserted or touched at
    // a floor no higher than today's, worth the tokens over the next checkpoint up then (or 0
    // least recently used).
    if (!(c.key == key) || it == checkpoint_of_.end() || it->second != slot ||
        key.priority > checkpoint_order_.floor() +
                           (checkpoints_by_tokens_saved_ ? TokensBefore(c.block, c.offset) : 0) *
                               (checkpoints_by_kind_
                                    ? static_cast<uint64_t>(CheckpointKindRate::kMaxRate)
                                    : 1) ||
        !cache_->holds(c.block) || c.offset <= 0 || c.offset > cache_->CoverageOf(c.block) ||
        !states_->cache_held(slot)) {
      return InvariantViolation("checkpoint slot {} (block {} offset {}) is not kept where it says",
                                slot.value(), c.block.value(), c.offset);
    }
    ++(*refs)[Index(slot)];
  }
  // The tree marks exactly the blocks holding a checkpoint as resume points.
  for (int32_t b = 0; cache_ != nullptr && b < pool_->num_blocks(); ++b) {
    const BlockId block(b);
    if (cache_->holds(block) && cache_->resume_point(block) != checkpoint_of_.contains(block)) {
      return InvariantViolation("block {} is {} resume point but keeps {} checkpoint", b,
                                cache_->resume_point(block) ? "a" : "no",
                                checkpoint_of_.contains(block) ? "a" : "no");
    }
  }
  for (const auto& [block, ghost] : checkpoint_ghosts_) {
    if (!cache_->holds(block) || checkpoint_of_.contains(block) || ghost.offset <= 0 ||
        ghost.offset > block_size_) {
      return InvariantViolation("an evicted checkpoint is remembered at block {} offset {}",
                                block.value(), ghost.offset);
    }
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckCheckpoints() const {
  // Every slot's references: its working state, planned checkpoints and resumed-from holds by
  // sequences, plus the tree's for a cached checkpoint.
  std::vector<uint32_t> refs(static_cast<size_t>(states_->num_blocks()), 0);
  int64_t planned = 0, rolling = 0;
  for (const auto& [id, seq] : sequences_) {
    ++refs[Index(seq.state_slot)];
    if (seq.state_lost && seq.state_tokens != -1) {
      return InvariantViolation("sequence {}'s state is lost but said to hold {} tokens",
                                id.value(), seq.state_tokens);
    }
    int64_t own_rolling = 0;
    for (const PlannedCheckpoint& c : seq.checkpoints) {
      if (!states_->Contains(c.slot) || c.position <= 0 || c.position > seq.num_tokens) {
        return InvariantViolation("sequence {} plans checkpoint {}@{} outside its {} tokens",
                                  id.value(), c.slot.value(), c.position, seq.num_tokens);
      }
      ++refs[Index(c.slot)];
      ++planned;
      own_rolling += c.rolling ? 1 : 0;
    }
    if (own_rolling > 1) {
      return InvariantViolation("sequence {} holds {} rolling checkpoints", id.value(),
                                own_rolling);
    }
    rolling += own_rolling;
    if (seq.resumed_from != kInvalidBlock) ++refs[Index(seq.resumed_from)];
  }
  if (rolling != rolling_checkpoints_ || rolling > checkpoint_slots_ / 4) {
    return InvariantViolation("{} rolling checkpoints (counted {}) for {} checkpoint slots",
                              rolling, rolling_checkpoints_, checkpoint_slots_);
  }
  if (planned != planned_checkpoints_ ||
      planned + static_cast<int64_t>(checkpoint_order_.size()) > checkpoint_slots_ ||
      checkpoint_order_.size() != checkpoint_of_.size()) {
    return InvariantViolation(
        "{} planned checkpoints (counted {}) and {} cached ({} by block) for {} checkpoint slots",
        planned, planned_checkpoints_, checkpoint_order_.size(), checkpoint_of_.size(),
        checkpoint_slots_);
  }
  KVPOOL_RETURN_IF_ERROR(CheckCachedCheckpoints(&refs));
  for (int32_t i = 0; i < states_->num_blocks(); ++i) {
    const BlockId slot(i);
    const BlockState state = states_->state(slot);
    const bool live = state == BlockState::kActive || state == BlockState::kCached;
    if ((live ? states_->refs(slot) : 0) != refs[static_cast<size_t>(i)] ||
        (state == BlockState::kCached) !=
            (refs[static_cast<size_t>(i)] == 1 && states_->cache_held(slot))) {
      return InvariantViolation("state slot {} is {} with {} references, {} expected", i,
                                BlockStateName(state), live ? states_->refs(slot) : 0,
                                refs[static_cast<size_t>(i)]);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool
