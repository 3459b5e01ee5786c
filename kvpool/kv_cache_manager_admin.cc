// KvCacheManager: device fences, inspection, prefix-cache administration and invariants (the
// sequence operations live in kv_cache_manager.cc).

#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "fmt/format.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {
namespace {

size_t Index(BlockId b) { return static_cast<size_t>(b.value()); }

std::vector<int32_t> Ids(std::span<const BlockId> blocks) {
  std::vector<int32_t> ids;
  ids.reserve(blocks.size());
  for (BlockId b : blocks) ids.push_back(b.value());
  return ids;
}

}  // namespace

absl::Status KvCacheManager::MarkInFlight(std::span<const BlockId> blocks, Fence fence) {
  for (BlockId block : blocks) {
    if (!pool_->Contains(block)) {
      return absl::NotFoundError(fmt::format("block {} does not exist", block.value()));
    }
    const BlockState state = pool_->state(block);
    if (state != BlockState::kActive && state != BlockState::kCached) {
      return absl::FailedPreconditionError(
          fmt::format("device work on block {} in state {}", block.value(), BlockStateName(state)));
    }
  }
  const TraceContext ctx = Context(kNoSession, SequenceId(0));
  for (BlockId block : blocks) KVPOOL_RETURN_IF_ERROR(pool_->MarkInFlight(block, fence, ctx));
  return absl::OkStatus();
}

absl::Status KvCacheManager::MarkStatesInFlight(std::span<const BlockId> slots, Fence fence) {
  if (slots.empty()) return absl::OkStatus();
  if (!states_) return absl::NotFoundError("this pool has no state group");
  for (BlockId slot : slots) {
    if (!states_->Contains(slot)) {
      return absl::NotFoundError(fmt::format("state slot {} does not exist", slot.value()));
    }
    if (states_->state(slot) != BlockState::kActive &&
        states_->state(slot) != BlockState::kCached) {
      return absl::FailedPreconditionError(fmt::format("device work on state slot {} in state {}",
                                                       slot.value(),
                                                       BlockStateName(states_->state(slot))));
    }
  }
  const TraceContext ctx = Context(kNoSession, SequenceId(0));
  for (BlockId slot : slots) KVPOOL_RETURN_IF_ERROR(states_->MarkInFlight(slot, fence, ctx));
  return absl::OkStatus();
}

int32_t KvCacheManager::ReclaimRetired() {
  const TraceContext ctx = Context(kNoSession, SequenceId(0));
  return pool_->ReclaimRetired(ctx) + (states_ ? states_->ReclaimRetired(ctx) : 0) +
         (window_ ? window_->ReclaimRetired(ctx) : 0);
}

const Sequence* KvCacheManager::Find(SequenceId sequence) const {
  auto it = sequences_.find(sequence);
  return it == sequences_.end() ? nullptr : &it->second;
}

int64_t KvCacheManager::session_sequences(SessionId session) const {
  auto it = sessions_.find(session);
  return it == sessions_.end() ? 0 : it->second.sequences;
}

void KvCacheManager::ForEachSequence(absl::FunctionRef<void(const Sequence&)> fn) const {
  visited_.fetch_add(sequences_.size(), std::memory_order_relaxed);
  for (const auto& [id, seq] : sequences_) fn(seq);
}

int64_t KvCacheManager::MatchPrefix(NamespaceId ns, std::span<const int32_t> tokens) const {
  if (!cache_) return 0;
  PrefixMatch m = cache_->Match(ns, tokens);
  // With a state or window group a prompt resumes only where they can (what Allocate adopts).
  int64_t no_checkpoint = 0;
  int64_t window_evicted = 0;
  if (states_ || window_) (void)CutResumable(&m, &no_checkpoint, &window_evicted);
  return m.matched_tokens;
}

MatchExplanation KvCacheManager::ExplainMatch(NamespaceId ns,
                                              std::span<const int32_t> tokens) const {
  if (!cache_) return MatchExplanation{.stop = MatchStop::kUnknownNamespace};
  MatchExplanation e = cache_->Explain(ns, tokens);
  if (states_ || window_) {
    PrefixMatch m = cache_->Match(ns, tokens);
    int64_t no_checkpoint = 0;
    (void)CutResumable(&m, &no_checkpoint, &e.window_evicted_tokens);
    e.resumable_tokens = m.matched_tokens;
  }
  return e;
}

int64_t KvCacheManager::EvictCached(int64_t blocks) {
  if (!cache_ || blocks <= 0) return 0;
  const int64_t evicted = cache_->EvictUpTo(blocks, BeginCall(kNoSession, SequenceId(0)));
  counters_.evictions += static_cast<uint64_t>(evicted);
  counters_.admin_evictions += static_cast<uint64_t>(evicted);
  return evicted;
}

absl::Status KvCacheManager::ClearCache() {
  if (!cache_) return absl::OkStatus();
  const int64_t before = cache_->stats().nodes;
  KVPOOL_RETURN_IF_ERROR(cache_->Clear(BeginCall(kNoSession, SequenceId(0))));
  counters_.evictions += static_cast<uint64_t>(before);
  counters_.admin_evictions += static_cast<uint64_t>(before);
  // The AllBlocksCleared clears every medium (a consumer forgets all it holds of this pool): the
  // tiers' blocks, which stay, are told again right after it.
  std::vector<KvEvent> tiers;
  tier_events_.AppendSnapshot(&tiers);
  for (KvEvent& e : tiers) cache_->AppendEvent(std::move(e));
  return absl::OkStatus();
}

absl::Status KvCacheManager::AppendTierEvent(KvEvent event) {
  if (!cache_) return absl::OkStatus();
  if (event.group) {
    const std::optional<KvEventGroup>& group =
        event.group->kind == KvGroupKind::kSlidingWindow ? event_groups_.window
        : event.group->kind == KvGroupKind::kStateSpace  ? event_groups_.state
                                                         : event_groups_.main;
    if (!group) {
      return absl::InvalidArgumentError(
          fmt::format("a lower tier's {} event in a pool without that group",
                      GroupKindName(event.group->kind)));
    }
    event.group = group;
  } else {
    event.group = event_groups_.main;  // none in a pool of one group
  }
  if (cache_->events_on()) tier_events_.Apply(event);
  cache_->AppendEvent(std::move(event));
  return absl::OkStatus();
}

std::vector<KvEvent> KvCacheManager::SnapshotEvents(uint64_t* resume_seq) const {
  if (!cache_) {
    *resume_seq = 1;
    return {};
  }
  std::vector<KvEvent> out = cache_->SnapshotEvents(resume_seq);
  // Then the components kept beside full blocks, after the blocks they name: each group's in the
  // tree's order, so each after its parent's. (From the tree's coverage, not the records': the
  // random tests hold the events to this.)
  std::vector<KvEvent> windows, checkpoints;
  for (const auto& [stamp, block] : window_lru_) {
    const BlockId primary = window_at_[Index(block)].primary;
    if (cache_->CoverageOf(primary) == block_size_) {
      windows.push_back(cache_->ComponentStored(primary, *event_groups_.window));
    }
  }
  for (const auto& key : checkpoint_order_) {
    const CheckpointSlot& c = checkpoint_at_[Index(key.id)];
    if (c.offset == block_size_) {
      checkpoints.push_back(cache_->ComponentStored(c.block, *event_groups_.state));
    }
  }
  const size_t tree_events = out.size();
  for (std::vector<KvEvent>* components : {&windows, &checkpoints}) {
    absl::flat_hash_map<BlockHash, size_t> by_hash;
    for (size_t i = 0; i < components->size(); ++i) {
      by_hash.emplace((*components)[i].block_hashes.front(), i);
    }
    std::vector<bool> told(components->size(), false);
    std::vector<KvEvent> ordered;
    ordered.reserve(components->size());
    for (size_t i = 0; i < tree_events; ++i) {
      for (const BlockHash& h : out[i].block_hashes) {
        if (const auto it = by_hash.find(h); it != by_hash.end() && !told[it->second]) {
          told[it->second] = true;
          ordered.push_back(std::move((*components)[it->second]));
        }
      }
    }
    // Each names a full block of the tree, so none is left; were one, it would still be told.
    for (size_t i = 0; i < components->size(); ++i) {
      if (!told[i]) ordered.push_back(std::move((*components)[i]));
    }
    std::move(ordered.begin(), ordered.end(), std::back_inserter(out));
  }
  // Then the lower tiers' blocks, as their events told them.
  tier_events_.AppendSnapshot(&out);
  return out;
}

KvCacheStats KvCacheManager::stats() const {
  KvCacheStats s = counters_;
  s.pool = pool_->stats();
  s.sequences = static_cast<int64_t>(sequences_.size());
  s.sessions = 0;
  for (const auto& [id, usage] : sessions_) s.sessions += usage.sequences > 0 ? 1 : 0;
  if (cache_) s.cache = cache_->stats();
  s.pins = static_cast<int64_t>(pins_.size());
  s.pinned_blocks = cache_ ? cache_->pinned_blocks() : 0;
  if (states_) s.states = states_->stats();
  s.checkpoints.cached = static_cast<int64_t>(checkpoint_order_.size());
  s.checkpoints.pending = planned_checkpoints_;
  for (size_t k = 0; k < kind_rates_.size() && checkpoint_slots_ > 0; ++k) {
    s.checkpoints.resume_rate[k] =
        static_cast<double>(kind_rates_[k].weight()) / CheckpointKindRate::kOne;
  }
  if (window_) s.window = window_->stats();
  s.windows.cached = static_cast<int64_t>(window_lru_.size());
  return s;
}

absl::Status KvCacheManager::CheckStates() const {
  if (!states_) {
    for (const auto& [id, seq] : sequences_) {
      if (seq.state_slot != kInvalidBlock) {
        return InvariantViolation("sequence {} holds a state slot without a state group",
                                  id.value());
      }
    }
    return absl::OkStatus();
  }
  KVPOOL_RETURN_IF_ERROR(states_->CheckInvariants());
  std::vector<uint8_t> held(static_cast<size_t>(states_->num_blocks()), 0);
  for (const auto& [id, seq] : sequences_) {
    const BlockId slot = seq.state_slot;
    if (!states_->Contains(slot) || states_->state(slot) != BlockState::kActive ||
        held[static_cast<size_t>(slot.value())]++ != 0) {
      return InvariantViolation("sequence {} holds state slot {}, which is not its own ACTIVE one",
                                id.value(), slot.value());
    }
  }
  return CheckCheckpoints();
}

absl::Status KvCacheManager::CheckRefGroups() const {
  absl::flat_hash_map<uint64_t, RefGroup> groups;
  for (const auto& [session, u] : sessions_) {
    if (u.group == 0) continue;
    groups[u.group].block_refs += u.block_refs;
    groups[u.group].sequences += u.sequences;
    ++groups[u.group].sessions;
  }
  for (const auto& [group, g] : ref_groups_) {
    const RefGroup& want = groups[group];
    if (g.block_refs != want.block_refs || g.sessions != want.sessions || g.sessions == 0 ||
        g.sequences != want.sequences) {
      return InvariantViolation(
          "reference group {} counts {} refs and {} sequences of {} sessions, but {}, {} of {}",
          group, g.block_refs, g.sequences, g.sessions, want.block_refs, want.sequences,
          want.sessions);
    }
  }
  if (groups.size() != ref_groups_.size()) {
    return InvariantViolation("{} reference groups have sessions, {} are tracked", groups.size(),
                              ref_groups_.size());
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckInvariants() const {
  KVPOOL_RETURN_IF_ERROR(pool_->CheckInvariants());
  std::vector<uint32_t> refs(static_cast<size_t>(pool_->num_blocks()), 0);
  absl::flat_hash_map<SessionId, SessionUsage> usage;
  absl::flat_hash_map<BlockId, uint32_t> locks;
  for (const auto& [id, seq] : sequences_) {
    if (seq.id != id)
      return InvariantViolation("sequence {} is filed under another id", id.value());
    if (static_cast<int64_t>(seq.table.size()) != BlocksFor(seq.num_tokens)) {
      return InvariantViolation("sequence {} of {} tokens has {} blocks", id.value(),
                                seq.num_tokens, seq.table.size());
    }
    if (static_cast<int64_t>(seq.table.size()) > max_blocks_per_seq_) {
      return InvariantViolation("sequence {} exceeds max_blocks_per_seq", id.value());
    }
    if (static_cast<int64_t>(seq.tokens.size()) > seq.num_tokens) {
      return InvariantViolation("sequence {} knows more tokens than it holds", id.value());
    }
    if (pool_->FindNamespace(seq.ns) != seq.slot) {
      return InvariantViolation("sequence {} has a stale namespace slot", id.value());
    }
    if (seq.path.full.size() > seq.table.size()) {
      return InvariantViolation("sequence {} follows more cached blocks than it has blocks",
                                id.value());
    }
    for (BlockId block : seq.path.full) ++locks[block];
    if (seq.path.partial != kInvalidBlock) ++locks[seq.path.partial];
    for (BlockId block : seq.table) {
      if (!pool_->Contains(block) || pool_->state(block) != BlockState::kActive) {
        return InvariantViolation(
            "sequence {} references block {} in state {}", id.value(), block.value(),
            pool_->Contains(block) ? BlockStateName(pool_->state(block)) : "invalid");
      }
      ++refs[static_cast<size_t>(block.value())];
    }
    usage[seq.session].block_refs += static_cast<int64_t>(seq.table.size());
    ++usage[seq.session].sequences;
  }
  for (int32_t b = 0; b < pool_->num_blocks(); ++b) {
    const BlockId block(b);
    const uint32_t expected = refs[static_cast<size_t>(b)] + (pool_->cache_held(block) ? 1 : 0);
    if (pool_->refs(block) != expected) {
      return InvariantViolation("block {} has refs {} but {} references exist", b,
                                pool_->refs(block), expected);
    }
  }
  for (const auto& [session, u] : sessions_) {
    static const SessionUsage kNone;
    auto it = usage.find(session);
    const SessionUsage& want = it == usage.end() ? kNone : it->second;
    if (u.block_refs != want.block_refs || u.sequences != want.sequences) {
      return InvariantViolation("session {} usage is {} refs / {} sequences but {} / {} exist",
                                session.value(), u.block_refs, u.sequences, want.block_refs,
                                want.sequences);
    }
  }
  for (const auto& [session, u] : usage) {
    if (!sessions_.contains(session))
      return InvariantViolation("session {} is untracked", session.value());
    if (max_sequences_per_session_ > 0 && u.sequences > max_sequences_per_session_) {
      return InvariantViolation("session {} holds {} sequences, more than {}", session.value(),
                                u.sequences, max_sequences_per_session_);
    }
  }
  KVPOOL_RETURN_IF_ERROR(CheckRefGroups());
  KVPOOL_RETURN_IF_ERROR(CheckHoldings());
  KVPOOL_RETURN_IF_ERROR(CheckNamedSlots());
  KVPOOL_RETURN_IF_ERROR(CheckQuotaBooks());
  KVPOOL_RETURN_IF_ERROR(CheckFullTables());
  KVPOOL_RETURN_IF_ERROR(CheckStates());
  KVPOOL_RETURN_IF_ERROR(CheckWindows());
  KVPOOL_RETURN_IF_ERROR(CheckShareCharges());
  if (cache_) {
    absl::flat_hash_map<BlockId, uint32_t> pinned;
    KVPOOL_RETURN_IF_ERROR(CheckPins(&locks, &pinned));
    KVPOOL_RETURN_IF_ERROR(cache_->CheckInvariants(&locks, &pinned));
  } else if (pool_->num_cached() != 0 || !pins_.empty()) {
    return InvariantViolation("cached blocks or pins without a prefix cache");
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckFullTables() const {
  // (The slots live sequences name are counted by the pool, and CheckNamedSlots recounted them.)
  const auto check = [&](const FullTable& table, const BlockPool& pool,
                         std::string_view which) -> absl::Status {
    if (table.idle < 0 || table.blocks_freed != pool.freed() ||
        table.sequences_freed != sequences_freed_) {
      return absl::OkStatus();
    }
    const size_t idle = pool.IdleNamespaces({}).size();
    if (static_cast<int64_t>(idle) > table.idle) {
      return InvariantViolation(
          "{} namespace table: {} idle slots, though nothing was freed since a sweep found at "
          "most {}",
          which, idle, table.idle);
    }
    return absl::OkStatus();
  };
  KVPOOL_RETURN_IF_ERROR(check(full_table_, *pool_, "the pool's"));
  if (window_) KVPOOL_RETURN_IF_ERROR(check(full_window_table_, *window_, "the window group's"));
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckQuotaBooks() const {
  size_t members = 0;
  for (const auto& [key, quota] : quotas_) {
    if (quota.members.empty() || quota.max_blocks < 0 || quota.max_blocks == kUnlimited) {
      return InvariantViolation("quota {:#x} has {} members and bound {}", key.id,
                                quota.members.size(), quota.max_blocks);
    }
    for (NamespaceId ns : quota.members) {
      auto it = quota_of_.find(ns);
      if (it == quota_of_.end() || !(it->second == key) || (!key.group && key.id != ns.value())) {
        return InvariantViolation("namespace {} is listed in quota {:#x} but counts elsewhere",
                                  ns.value(), key.id);
      }
    }
    members += quota.members.size();
  }
  if (members != quota_of_.size()) {
    return InvariantViolation("{} namespaces have a quota but quotas list {}", quota_of_.size(),
                              members);
  }
  // The state slots a quota charges: one per live sequence, by namespace.
  absl::flat_hash_map<NamespaceId, int64_t> states;
  if (states_) {
    for (const auto& [id, seq] : sequences_) ++states[seq.ns];
  }
  if (states != states_by_ns_) {
    return InvariantViolation("state slots by namespace: {} namespaces hold some, the books say {}",
                              states.size(), states_by_ns_.size());
  }
  return CheckQuotaTotals();
}

absl::Status KvCacheManager::CheckQuotaTotals() const {
  // Tallies: each quota has its own, and with the free ones they are exactly 1 .. next_tally_-1.
  std::vector<uint8_t> tallies(next_tally_, 0);
  for (uint32_t tally : free_tallies_) {
    if (tally == 0 || tally >= next_tally_ || tallies[tally]++ != 0) {
      return InvariantViolation("free quota tally {} is out of range or listed twice", tally);
    }
    if (pool_->tally_active(tally) != 0 || (window_ && window_->tally_active(tally) != 0) ||
        (cache_ && cache_->tally_pin_held(tally) != 0)) {
      return InvariantViolation("free quota tally {} still counts blocks", tally);
    }
  }
  for (const auto& [key, quota] : quotas_) {
    if (quota.tally == 0 || quota.tally >= next_tally_ || tallies[quota.tally]++ != 0) {
      return InvariantViolation("quota {:#x} has tally {}, out of range or not its own", key.id,
                                quota.tally);
    }
    // The totals, recounted from the members (what QuotaUsage summed before it kept totals).
    int64_t active = 0;
    int64_t pin_held = 0;
    int64_t window_active = 0;
    int64_t state_slots = 0;
    visited_.fetch_add(quota.members.size(), std::memory_order_relaxed);
    for (NamespaceId ns : quota.members) {
      if (pool_->tally_of(ns) != quota.tally || (window_ && window_->tally_of(ns) != quota.tally) ||
          (cache_ && cache_->tally_of(ns) != quota.tally)) {
        return InvariantViolation("namespace {} of quota {:#x} is not filed under its tally {}",
                                  ns.value(), key.id, quota.tally);
      }
      if (const std::optional<NamespaceSlot> slot = pool_->FindNamespace(ns)) {
        active += pool_->active_blocks(*slot);
      }
      if (cache_) pin_held += cache_->pin_held(ns);
      if (window_) {
        if (const std::optional<NamespaceSlot> slot = window_->FindNamespace(ns)) {
          window_active += window_->active_blocks(*slot);
        }
      }
      if (auto it = states_by_ns_.find(ns); it != states_by_ns_.end()) state_slots += it->second;
    }
    if (active != pool_->tally_active(quota.tally) ||
        pin_held != (cache_ ? cache_->tally_pin_held(quota.tally) : 0) ||
        window_active != (window_ ? window_->tally_active(quota.tally) : 0) ||
        state_slots != quota.state_slots) {
      return InvariantViolation(
          "quota {:#x} totals (active {}, pin-held {}, window {}, state slots {}) are not its "
          "members' ({}, {}, {}, {})",
          key.id, pool_->tally_active(quota.tally),
          cache_ ? cache_->tally_pin_held(quota.tally) : 0,
          window_ ? window_->tally_active(quota.tally) : 0, quota.state_slots, active, pin_held,
          window_active, state_slots);
    }
  }
  if (std::find(tallies.begin() + 1, tallies.end(), 0) != tallies.end()) {
    return InvariantViolation("a quota tally below {} is neither used nor free", next_tally_);
  }
  // No namespace outside a quota is filed under a tally.
  if (pool_->tallied_namespaces() != quota_of_.size() ||
      (window_ && window_->tallied_namespaces() != quota_of_.size()) ||
      (cache_ && cache_->tallied_namespaces() != quota_of_.size())) {
    return InvariantViolation("{} namespaces have a quota but more are filed under a tally",
                              quota_of_.size());
  }
  return absl::OkStatus();
}

void KvCacheManager::CheckpointDebugString(std::string* out) const {
  // In eviction order, the next victim first.
  for (const auto& key : checkpoint_order_) {
    const CheckpointSlot& c = checkpoint_at_[Index(key.id)];
    fmt::format_to(std::back_inserter(*out),
                   "checkpoint slot={} block={} offset={} stamp={} priority={} kind={}\n",
                   key.id.value(), c.block.value(), c.offset, key.stamp, key.priority,
                   CheckpointKindName(c.kind));
  }
  if (checkpoint_slots_ == 0) return;
  fmt::format_to(std::back_inserter(*out), "checkpoint floor={} evicted_remembered={}\n",
                 checkpoint_order_.floor(), checkpoint_ghosts_.size());
  for (size_t k = 0; k < kind_rates_.size(); ++k) {
    const CheckpointKindRate& r = kind_rates_[k];
    fmt::format_to(std::back_inserter(*out),
                   "checkpoint kind={} kept={:.1f} resumed={:.1f} weight={}/{}\n",
                   CheckpointKindName(static_cast<CheckpointKind>(k)), r.kept, r.resumed,
                   r.weight(), CheckpointKindRate::kOne);
  }
}

std::string KvCacheManager::DebugString() const {
  std::string out = pool_->DebugString();
  if (cache_) out += cache_->DebugString();
  if (states_) out += "state group:\n" + states_->DebugString();
  if (window_) WindowDebugString(&out);
  CheckpointDebugString(&out);
  auto it = std::back_inserter(out);
  std::vector<SequenceId> ids;
  for (const auto& [id, seq] : sequences_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  fmt::format_to(it, "next_sequence={}\nsequences:\n", next_sequence_id_);
  for (SequenceId id : ids) {
    const Sequence& seq = sequences_.at(id);
    fmt::format_to(it, "{} session={} ns={} tokens={} known={} table={} path={}+{}", id.value(),
                   seq.session.value(), seq.ns.value(), seq.num_tokens, seq.tokens.size(),
                   fmt::join(Ids(seq.table), ","), fmt::join(Ids(seq.path.full), ","),
                   seq.path.partial.value());
    if (states_) {
      fmt::format_to(it, " state={}@{}{}", seq.state_slot.value(), seq.state_tokens,
                     seq.state_lost ? " lost" : "");
      for (const PlannedCheckpoint& c : seq.checkpoints) {
        fmt::format_to(it, " ckpt={}@{}", c.slot.value(), c.position);
      }
      if (seq.resumed_from != kInvalidBlock) {
        fmt::format_to(it, " resumed={}", seq.resumed_from.value());
      }
      if (seq.branch_at != 0) fmt::format_to(it, " branch={}", seq.branch_at);
    }
    if (window_) SequenceWindowDebugString(seq, &out);
    out += "\n";
  }
  std::vector<std::pair<SessionId, const SessionUsage*>> sessions;
  for (const auto& [id, u] : sessions_) {
    if (u.shown()) sessions.emplace_back(id, &u);
  }
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  out += "sessions:";
  for (const auto& [id, usage] : sessions) {
    const SessionUsage& u = *usage;
    fmt::format_to(it, " {}={}/{}/{}", id.value(), u.block_refs, u.sequences, u.quota);
    if (u.group != 0) fmt::format_to(it, "@{}", u.group);
  }
  std::vector<std::pair<QuotaKey, std::vector<uint64_t>>> quotas;
  for (const auto& [key, quota] : quotas_) {
    std::vector<uint64_t> members;
    for (NamespaceId ns : quota.members) members.push_back(ns.value());
    std::sort(members.begin(), members.end());
    quotas.emplace_back(key, std::move(members));
  }
  std::sort(quotas.begin(), quotas.end(), [](const auto& a, const auto& b) {
    return std::pair(a.first.group, a.first.id) < std::pair(b.first.group, b.first.id);
  });
  out += "\nquotas:";
  for (const auto& [key, members] : quotas) {
    fmt::format_to(it, " {}{}={}[{}]", key.group ? "group" : "ns", key.id,
                   quotas_.at(key).max_blocks, fmt::join(members, ","));
  }
  out += "\npins:";
  std::vector<PinId> pins;
  for (const auto& [id, pin] : pins_) pins.push_back(id);
  std::sort(pins.begin(), pins.end());
  for (PinId id : pins) {
    const Pin& p = pins_.at(id);
    fmt::format_to(it, " {}:session={},ns={},seq={},prio={},tokens={},expires={},blocks={}",
                   id.value(), p.info.session.value(), p.info.ns.value(), p.info.sequence.value(),
                   p.info.priority, p.info.tokens, p.info.expires_ns,
                   fmt::join(Ids(p.blocks), "/"));
  }
  out += "\n";
  return out;
}

absl::Status KvCacheManager::CheckShareCharges() const {
  if (cache_ == nullptr || !cache_->shares_on()) return absl::OkStatus();
  // Every share is charged exactly the components kept beside its blocks (fair eviction).
  std::vector<ShareUse> shares = cache_->Shares();
  std::vector<int64_t> want(shares.size(), 0);
  for (const auto& [primary, window] : window_of_)
    want[cache_->ShareIndexOf(primary)] += unit_window_;
  for (const auto& [block, slot] : checkpoint_of_) want[cache_->ShareIndexOf(block)] += unit_state_;
  for (size_t i = 0; i < shares.size(); ++i) {
    if (shares[i].charged != want[i]) {
      return InvariantViolation("eviction share {} is charged {} bytes for components of {}",
                                shares[i].key, shares[i].charged, want[i]);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool
