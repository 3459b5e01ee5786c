#include "kvpool/kv_cache_manager.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {
namespace {

// Adds `blocks` to the entry for `ns` in a short list (a batch touches few namespaces).
void AddTo(std::vector<std::pair<NamespaceId, int64_t>>* by_ns, NamespaceId ns, int64_t blocks) {
  for (auto& [id, n] : *by_ns) {
    if (id == ns) {
      n += blocks;
      return;
    }
  }
  by_ns->emplace_back(ns, blocks);
}

absl::Status EmptyBatch(std::string_view what) {
  return absl::InvalidArgumentError(fmt::format("{}: empty batch", what));
}

// The state and window groups' options (KvCacheOptions).
absl::Status CheckGroupOptions(const KvCacheOptions& options) {
  if (options.state_slots < 0) {
    return absl::InvalidArgumentError(
        fmt::format("state_slots must be >= 0 (got {})", options.state_slots));
  }
  if (options.checkpoint_slots < 0 || options.checkpoint_interval < 0 ||
      (options.checkpoint_slots > 0 && options.checkpoint_slots >= options.state_slots)) {
    return absl::InvalidArgumentError(fmt::format(
        "checkpoint_slots must be in [0, state_slots) and checkpoint_interval >= 0 (got {} of {} "
        "slots, interval {})",
        options.checkpoint_slots, options.state_slots, options.checkpoint_interval));
  }
  if (options.window_blocks < 0 || options.sink_tokens < 0 ||
      (options.window_blocks > 0 && options.window_tokens <= 0)) {
    return absl::InvalidArgumentError(fmt::format(
        "window_blocks must be >= 0, sink_tokens >= 0 and, with a window group, window_tokens > 0 "
        "(got window_blocks {}, window_tokens {}, sink_tokens {})",
        options.window_blocks, options.window_tokens, options.sink_tokens));
  }
  if (options.block_bytes < 0 || options.window_block_bytes < 0 || options.state_bytes < 0 ||
      (options.block_bytes == 0 && (options.window_block_bytes > 0 || options.state_bytes > 0))) {
    return absl::InvalidArgumentError(fmt::format(
        "block_bytes, window_block_bytes and state_bytes must be >= 0, and the other groups' "
        "bytes are charged only beside block_bytes > 0 (got {}, {}, {})",
        options.block_bytes, options.window_block_bytes, options.state_bytes));
  }
  return absl::OkStatus();
}

// The BlockPool of a group beside the full group's: `num_blocks` blocks (slots), traced and
// fenced as the full group's.
absl::StatusOr<std::unique_ptr<BlockPool>> GroupPool(int32_t num_blocks, int32_t max_namespaces,
                                                     const KvCacheOptions& options) {
  return BlockPool::Create({.num_blocks = num_blocks,
                            .trace_depth = options.trace_depth,
                            .max_namespaces = max_namespaces,
                            .fences = options.fences});
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCacheManager>> KvCacheManager::Create(
    const KvCacheOptions& options) {
  if (options.block_size <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("block_size must be > 0 (got {})", options.block_size));
  }
  if (options.max_blocks_per_seq <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("max_blocks_per_seq must be > 0 (got {})", options.max_blocks_per_seq));
  }
  if (options.clock == nullptr) return absl::InvalidArgumentError("clock must not be null");
  if (options.max_sequences_per_session < 0) {
    return absl::InvalidArgumentError(
        fmt::format("max_sequences_per_session must be >= 0 (0: unlimited; got {})",
                    options.max_sequences_per_session));
  }
  if (options.event_capacity_bytes == 0) {
    return absl::InvalidArgumentError("event_capacity_bytes must be > 0");
  }
  if (options.max_pins < 0 || options.max_pin_ttl_ns <= 0 || options.max_pinned_blocks < 0) {
    return absl::InvalidArgumentError(
        fmt::format("pin limits must be max_pins >= 0, max_pin_ttl_ns > 0, max_pinned_blocks >= "
                    "0 (got {}, {}, {})",
                    options.max_pins, options.max_pin_ttl_ns, options.max_pinned_blocks));
  }
  KVPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<BlockPool> pool,
      BlockPool::Create(BlockPoolOptions{.num_blocks = options.num_blocks,
                                         .trace_depth = options.trace_depth,
                                         .max_namespaces = options.max_namespaces,
                                         .fences = options.fences,
                                         .residency_sample = options.residency_sample,
                                         .residency_seed = options.residency_seed}));
  std::unique_ptr<PrefixCache> cache;
  if (options.prefix_cache) {
    KVPOOL_ASSIGN_OR_RETURN(
        cache, PrefixCache::Create({.block_size = options.block_size,
                                    .epoch = options.epoch,
                                    .event_capacity = options.event_capacity,
                                    .event_capacity_bytes = options.event_capacity_bytes,
                                    .evicted_memory = options.evicted_memory,
                                    .events = options.cache_events,
                                    .event_group = EventGroupsOf(options).main,
                                    .journal = options.publish_journal,
                                    .policy = options.eviction_policy,
                                    .history_blocks = options.eviction_history_blocks,
                                    .policy_factory = options.eviction_policy_factory,
                                    .max_shares = options.eviction_shares,
                                    .block_bytes = std::max<int64_t>(1, options.block_bytes)},
                                   pool.get()));
  }
  KVPOOL_RETURN_IF_ERROR(CheckGroupOptions(options));
  std::unique_ptr<BlockPool> states;
  if (options.state_slots > 0) {
    KVPOOL_ASSIGN_OR_RETURN(states, GroupPool(options.state_slots, /*max_namespaces=*/1, options));
  }
  std::unique_ptr<BlockPool> window;
  if (options.window_blocks > 0) {
    KVPOOL_ASSIGN_OR_RETURN(window,
                            GroupPool(options.window_blocks, options.max_namespaces, options));
  }
  return std::unique_ptr<KvCacheManager>(new KvCacheManager(
      options, std::move(pool), std::move(cache), std::move(states), std::move(window)));
}

KvCacheManager::KvCacheManager(const KvCacheOptions& options, std::unique_ptr<BlockPool> pool,
                               std::unique_ptr<PrefixCache> cache,
                               std::unique_ptr<BlockPool> states, std::unique_ptr<BlockPool> window)
    : block_size_(options.block_size),
      max_blocks_per_seq_(options.max_blocks_per_seq),
      clock_(options.clock),
      pool_(std::move(pool)),
      cache_(std::move(cache)),
      states_(std::move(states)),
      checkpoint_slots_(states_ && cache_ ? options.checkpoint_slots : 0),
      checkpoint_interval_(options.checkpoint_interval),
      checkpoints_by_tokens_saved_(options.checkpoint_eviction ==
                                       KvCacheOptions::CheckpointEviction::kByTokensSaved ||
                                   options.checkpoint_eviction ==
                                       KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved),
      checkpoints_by_kind_(options.checkpoint_eviction ==
                           KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved),
      journal_checkpoints_(checkpoint_slots_ > 0 && options.publish_journal),
      window_(std::move(window)),
      window_tokens_(window_ ? options.window_tokens : 0),
      sink_tokens_(window_ ? options.sink_tokens : 0),
      event_groups_(EventGroupsOf(options)),
      journal_windows_(window_ && cache_ && options.publish_journal),
      max_sequences_per_session_(options.max_sequences_per_session),
      quota_bytes_(options.block_bytes > 0),
      unit_block_(options.block_bytes > 0 ? options.block_bytes : 1),
      unit_window_(options.block_bytes > 0 ? options.window_block_bytes : 0),
      unit_state_(options.block_bytes > 0 ? options.state_bytes : 0),
      max_pins_(options.max_pins),
      max_pin_ttl_ns_(options.max_pin_ttl_ns),
      max_pinned_blocks_(options.max_pinned_blocks > 0 ? options.max_pinned_blocks
                                                       : options.num_blocks / 2) {
  if (states_) {
    // The slots' one owner (any id: the state group's namespace table is its own).
    const absl::StatusOr<NamespaceSlot> owner = states_->RegisterNamespace(NamespaceId(1));
    KVPOOL_CHECK_OK(owner.status());
    state_owner_ = *owner;
  }
  if (checkpoint_slots_ > 0) {
    checkpoint_at_.resize(static_cast<size_t>(states_->num_blocks()));
  }
  if (window_) {
    window_at_.resize(static_cast<size_t>(window_->num_blocks()));
    window_lru_.Reset(window_->num_blocks());
  }
  if (cache_ && (checkpoint_slots_ > 0 || window_)) {
    // A block the tree lets go takes its secondary components (checkpoint, window block) with it.
    if (checkpoint_slots_ > 0 && options.evict_unresumable_first) cache_->EvictUnresumableFirst();
    cache_->SetOnRemove([this](BlockId block, const TraceContext& ctx) {
      if (auto it = checkpoint_of_.find(block); it != checkpoint_of_.end()) {
        DropCheckpoint(it->second, ctx);
      }
      checkpoint_ghosts_.erase(block);
      if (auto it = window_of_.find(block); it != window_of_.end()) {
        DropWindowBlock(it->second, ctx);
      }
    });
  }
  if (cache_ && window_) {
    // KeepWindowBlocks, after the Commit, re-keeps or drops their window blocks.
    cache_->SetOnWiden([this](BlockId block) {
      if (window_of_.contains(block)) widened_.push_back(block);
    });
  }
}

int32_t BreakEvenCheckpointInterval(int64_t state_bytes, int64_t block_bytes) {
  if (state_bytes <= 0 || block_bytes <= 0) return 0;
  const int64_t blocks = (state_bytes + block_bytes - 1) / block_bytes;
  return static_cast<int32_t>(std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max()));
}

int32_t DefaultCheckpointInterval(int64_t state_bytes, int64_t block_bytes) {
  const int64_t thrice = int64_t{3} * BreakEvenCheckpointInterval(state_bytes, block_bytes);
  return static_cast<int32_t>(std::min<int64_t>(thrice, std::numeric_limits<int32_t>::max()));
}

std::optional<KvCacheOptions::CheckpointEviction> ParseCheckpointEviction(std::string_view name) {
  using Eviction = KvCacheOptions::CheckpointEviction;
  if (name == "expected_tokens_saved") return Eviction::kByExpectedTokensSaved;
  if (name == "tokens_saved") return Eviction::kByTokensSaved;
  if (name == "lru") return Eviction::kLeastRecentlyUsed;
  return std::nullopt;
}

KvCacheManager::EventGroups KvCacheManager::EventGroupsOf(const KvCacheOptions& options) {
  // As Create() makes the groups.
  const bool window = options.window_blocks > 0;
  const bool state = options.state_slots > 0;
  if (!window && !state) return {};
  EventGroups groups{.main = KvEventGroup{}};
  int32_t next = 1;
  if (window) {
    groups.window = KvEventGroup{.index = next++,
                                 .kind = KvGroupKind::kSlidingWindow,
                                 .sliding_window = options.window_tokens};
  }
  if (state) groups.state = KvEventGroup{.index = next++, .kind = KvGroupKind::kStateSpace};
  return groups;
}

TraceContext KvCacheManager::BeginCall(SessionId session, SequenceId sequence) {
  const TraceContext ctx = Context(session, sequence);
  if (cache_) cache_->SetTime(ctx.time_ns);
  if (!pins_.empty()) ExpirePinsAt(ctx.time_ns);
  return ctx;
}

absl::Status KvCacheManager::SetNamespaceQuota(NamespaceId ns, int64_t max_blocks, uint64_t group) {
  if (max_blocks < 0) {
    return absl::InvalidArgumentError(fmt::format("negative namespace quota {}", max_blocks));
  }
  if (ns == kNoNamespace) return absl::InvalidArgumentError("namespace 0 is reserved");
  LeaveQuota(ns);
  if (max_blocks == kUnlimited) return absl::OkStatus();
  const QuotaKey key = group != 0 ? QuotaKey{group, true} : QuotaKey{ns.value(), false};
  auto [entry, fresh] = quotas_.try_emplace(key);
  Quota& quota = entry->second;
  if (fresh) {
    if (free_tallies_.empty()) {
      quota.tally = next_tally_++;
    } else {
      quota.tally = free_tallies_.back();
      free_tallies_.pop_back();
    }
  }
  quota.max_blocks = max_blocks;
  quota.members.insert(ns);
  quota_of_.emplace(ns, key);
  // What `ns` holds now counts from here on (moved from no tally into the quota's).
  FileUnder(ns, quota.tally);
  if (auto it = states_by_ns_.find(ns); it != states_by_ns_.end()) quota.state_slots += it->second;
  return absl::OkStatus();
}

void KvCacheManager::LeaveQuota(NamespaceId ns) {
  auto it = quota_of_.find(ns);
  if (it == quota_of_.end()) return;
  auto entry = quotas_.find(it->second);
  Quota& quota = entry->second;
  FileUnder(ns, 0);
  if (auto held = states_by_ns_.find(ns); held != states_by_ns_.end()) {
    quota.state_slots -= held->second;
  }
  quota.members.erase(ns);
  if (quota.members.empty()) {
    // Every total is back to 0 with its last member gone: the tally is clean for the next quota.
    free_tallies_.push_back(quota.tally);
    quotas_.erase(entry);
  }
  quota_of_.erase(it);
}

void KvCacheManager::FileUnder(NamespaceId ns, uint32_t tally) {
  pool_->SetTally(ns, tally);
  if (window_) window_->SetTally(ns, tally);
  if (cache_) cache_->SetTally(ns, tally);
}

void KvCacheManager::AddStateSlots(NamespaceId ns, int64_t delta) {
  auto held = states_by_ns_.try_emplace(ns, 0).first;
  held->second += delta;
  if (held->second == 0) states_by_ns_.erase(held);
  if (quota_of_.empty()) return;
  if (auto it = quota_of_.find(ns); it != quota_of_.end()) {
    quotas_.find(it->second)->second.state_slots += delta;
  }
}

int64_t KvCacheManager::QuotaUsage(const Quota& quota) const {
  // Running totals (see Quota): O(1) however many namespaces share the quota.
  // Blocks only pins hold count too (a pin's blocks cannot be evicted to make room).
  const int64_t blocks =
      pool_->tally_active(quota.tally) + (cache_ ? cache_->tally_pin_held(quota.tally) : 0);
  const int64_t window_blocks =
      window_ && unit_window_ > 0 ? window_->tally_active(quota.tally) : 0;
  const int64_t state_slots = unit_state_ > 0 ? quota.state_slots : 0;
  return blocks * unit_block_ + window_blocks * unit_window_ + state_slots * unit_state_;
}

std::optional<KvCacheManager::QuotaUse> KvCacheManager::QuotaOf(NamespaceId ns) const {
  auto it = quota_of_.find(ns);
  if (it == quota_of_.end()) return std::nullopt;
  const Quota& quota = quotas_.at(it->second);
  return QuotaUse{.used = QuotaUsage(quota), .bound = QuotaBound(quota), .bytes = quota_bytes_};
}

absl::Status KvCacheManager::SetEvictionShare(NamespaceId ns, uint64_t share, uint32_t weight) {
  if (cache_ == nullptr) {
    return absl::FailedPreconditionError("eviction shares need the prefix cache");
  }
  return cache_->SetShare(ns, share, weight);
}

std::vector<ShareUse> KvCacheManager::EvictionShares() const {
  return cache_ == nullptr ? std::vector<ShareUse>{} : cache_->Shares();
}

std::optional<ShareUse> KvCacheManager::EvictionShareOf(NamespaceId ns) const {
  if (cache_ == nullptr || !cache_->shares_on()) return std::nullopt;
  return cache_->ShareOf(ns);
}

int64_t KvCacheManager::QuotaBound(const Quota& quota) const {
  const int64_t most = std::numeric_limits<int64_t>::max();
  return quota.max_blocks > most / unit_block_ ? most : quota.max_blocks * unit_block_;
}

std::string KvCacheManager::QuotaText(int64_t used, const Quota& quota) const {
  if (!quota_bytes_) {
    return fmt::format("{} of {} blocks in use", used, quota.max_blocks);
  }
  return fmt::format(
      "{} of {} bytes in use: a quota of {} blocks of {} bytes, window-group blocks charged {} "
      "bytes and state slots {}",
      used, QuotaBound(quota), quota.max_blocks, unit_block_, unit_window_, unit_state_);
}

void KvCacheManager::AddCharge(std::vector<GroupCharge>* charges, NamespaceId ns,
                               int64_t window_blocks, int64_t state_slots) {
  if (window_blocks == 0 && state_slots == 0) return;
  for (GroupCharge& c : *charges) {
    if (c.ns == ns) {
      c.window_blocks += window_blocks;
      c.state_slots += state_slots;
      return;
    }
  }
  charges->push_back({.ns = ns, .window_blocks = window_blocks, .state_slots = state_slots});
}

absl::Status KvCacheManager::SetSessionQuota(SessionId session, int64_t max_block_refs,
                                             uint64_t group) {
  if (max_block_refs < 0) {
    return absl::InvalidArgumentError(fmt::format("negative session quota {}", max_block_refs));
  }
  auto it = sessions_.find(session);
  if (group != 0 && it != sessions_.end() && it->second.group != 0 && it->second.group != group) {
    return absl::InvalidArgumentError(fmt::format("session {} is in reference group {} already",
                                                  session.value(), it->second.group));
  }
  SessionUsage& usage = sessions_[session];
  usage.quota = max_block_refs;
  if (group != 0 && usage.group == 0) {
    usage.group = group;
    RefGroup& g = ref_groups_[group];
    ++g.sessions;
    g.block_refs += usage.block_refs;
    g.sequences += usage.sequences;
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::SetRefGroupStateSlots(uint64_t group, int64_t max_state_slots) {
  if (max_state_slots < 0 || group == 0) {
    return absl::InvalidArgumentError(
        fmt::format("reference group {}: {} state slots (a group is not 0, a bound not negative)",
                    group, max_state_slots));
  }
  if (states_) ref_groups_[group].max_state_slots = max_state_slots;
  return absl::OkStatus();
}

absl::Status KvCacheManager::SetRefGroupQuota(uint64_t group, int64_t max_block_refs) {
  if (max_block_refs < 0 || group == 0) {
    return absl::InvalidArgumentError(
        fmt::format("reference group {}: quota {} (a group is not 0, a quota not negative)", group,
                    max_block_refs));
  }
  ref_groups_[group].quota = max_block_refs;
  return absl::OkStatus();
}

void KvCacheManager::AddSequences(SessionUsage& usage, int64_t delta) {
  usage.sequences += delta;
  if (usage.group != 0) ref_groups_[usage.group].sequences += delta;
}

void KvCacheManager::AddRefs(SessionId session, int64_t delta) {
  AddRefs(sessions_[session], delta);
}

void KvCacheManager::AddRefs(SessionUsage& usage, int64_t delta) {
  usage.block_refs += delta;
  if (usage.group != 0) ref_groups_[usage.group].block_refs += delta;
}

absl::StatusOr<Sequence*> KvCacheManager::Owned(SessionId caller, SequenceId sequence) {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) {
    return absl::NotFoundError(fmt::format("no sequence {}", sequence.value()));
  }
  if (it->second.session != caller) {
    return absl::PermissionDeniedError(
        fmt::format("sequence {} belongs to another session", sequence.value()));
  }
  return &it->second;
}

std::vector<int32_t> KvCacheManager::SpareTokensOf(std::span<const int32_t> tokens) {
  std::vector<int32_t> out;
  // Newest first: the buffer freed last is the one most likely still in cache.
  for (size_t i = spare_tokens_.size(); i-- > 0;) {
    if (spare_tokens_[i].capacity() >= tokens.size()) {
      out = std::move(spare_tokens_[i]);
      spare_tokens_.erase(spare_tokens_.begin() + static_cast<ptrdiff_t>(i));
      break;
    }
  }
  out.assign(tokens.begin(), tokens.end());
  return out;
}

void KvCacheManager::KeepSpareTokens(std::vector<int32_t>& tokens) {
  tokens.clear();
  if (spare_tokens_.size() == kSpareTokenBuffers) {
    const auto smallest =
        std::min_element(spare_tokens_.begin(), spare_tokens_.end(),
                         [](const auto& a, const auto& b) { return a.capacity() < b.capacity(); });
    if (smallest->capacity() >= tokens.capacity()) return;
    spare_tokens_.erase(smallest);
  }
  spare_tokens_.push_back(std::move(tokens));
}

void KvCacheManager::CountMissed(const AllocatePlan& p, uint64_t tokens) {
  switch (p.stop) {
    case MatchStop::kPromptEnd:  // no cache: nothing was cached
    case MatchStop::kUnknownNamespace:
    case MatchStop::kNoChild:
    case MatchStop::kDiverged:
      (p.first_block_elsewhere ? counters_.missed_another_namespace
                               : counters_.missed_not_cached) += tokens;
      return;
    case MatchStop::kEvicted:
      (p.below_admission_bar ? counters_.missed_below_admission_bar : counters_.missed_evicted) +=
          tokens;
      return;
    case MatchStop::kInsufficientCoverage:
      counters_.missed_coverage += tokens;
      return;
  }
}

absl::Status KvCacheManager::CountExhausted(absl::Status status) {
  if (absl::IsResourceExhausted(status)) ++counters_.exhausted;
  return status;
}

void KvCacheManager::RetainBlock(BlockId block, const TraceContext& ctx) {
  KVPOOL_CHECK_OK(pool_->Retain(block, ctx));
  if (cache_) cache_->OnBlockRefsChanged(block);
}

void KvCacheManager::ReleaseBlock(BlockId block, const TraceContext& ctx) {
  KVPOOL_CHECK_OK(pool_->Release(block, ctx));
  if (cache_) cache_->OnBlockRefsChanged(block);
}

bool KvCacheManager::MustCopy(BlockId block, int32_t slot, uint32_t other_holders) const {
  if (other_holders > 0) return true;
  return cache_ && pool_->cache_held(block) && slot < cache_->CoverageOf(block);
}

uint32_t KvCacheManager::Claim(WriteClaims* claims, BlockId block) {
  for (auto& [b, n] : *claims) {
    if (b == block) return n++;
  }
  claims->emplace_back(block, 1);
  return 0;
}

absl::Status KvCacheManager::PlanGrow(Sequence* sequence, int64_t num_tokens, WriteClaims* claims,
                                      GrowPlan* plan) const {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(fmt::format("negative token count {}", num_tokens));
  }
  *plan = GrowPlan{.sequence = sequence, .num_tokens = num_tokens};
  if (num_tokens <= sequence->num_tokens) return absl::OkStatus();  // already covered
  const int64_t need = BlocksFor(num_tokens);
  if (need > max_blocks_per_seq_) {
    return ResourceExhausted(Resource::kTableBound, need - max_blocks_per_seq_,
                             fmt::format("sequence {} to {} tokens needs {} blocks",
                                         sequence->id.value(), num_tokens, need));
  }
  plan->new_blocks = static_cast<int32_t>(need - static_cast<int64_t>(sequence->table.size()));
  // The first token written lands in the existing last block when the sequence ends inside it.
  const int32_t slot = static_cast<int32_t>(sequence->num_tokens % block_size_);
  if (slot != 0) {
    const BlockId target = sequence->table[static_cast<size_t>(sequence->num_tokens / block_size_)];
    const uint32_t refs = pool_->refs(target) - (pool_->cache_held(target) ? 1 : 0);
    if (refs > 1 || pool_->cache_held(target)) {  // shared or published: rare, so checked here
      // Copies planned earlier in this batch take their holders off the block.
      uint32_t moved = 0;
      for (const auto& [b, n] : *claims) moved += b == target ? n : 0;
      if (MustCopy(target, slot, refs - 1 - moved)) {
        plan->cow = true;
        Claim(claims, target);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckQuotas(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                                         std::span<const GroupCharge> groups,
                                         std::string_view what) const {
  std::vector<std::pair<QuotaKey, int64_t>> adds;  // quota units, by quota: a batch touches few
  const auto add_to = [&](NamespaceId ns, int64_t units) {
    auto it = quota_of_.find(ns);
    if (units <= 0 || it == quota_of_.end()) return;
    auto add = std::find_if(adds.begin(), adds.end(),
                            [&](const auto& entry) { return entry.first == it->second; });
    if (add == adds.end()) {
      adds.emplace_back(it->second, units);
    } else {
      add->second += units;
    }
  };
  for (const auto& [ns, n] : by_ns) add_to(ns, n * unit_block_);
  for (const GroupCharge& c : groups) {
    add_to(c.ns, c.window_blocks * unit_window_ + c.state_slots * unit_state_);
  }
  for (const auto& [key, n] : adds) {
    const Quota& quota = quotas_.at(key);
    const int64_t used = QuotaUsage(quota);
    const int64_t bound = QuotaBound(quota);
    if (used <= bound && n <= bound - used) continue;
    const std::string where =
        key.group ? fmt::format("quota group {:#x} ({} over {} namespaces)", key.id,
                                QuotaText(used, quota), quota.members.size())
                  : fmt::format("namespace {} ({})", key.id, QuotaText(used, quota));
    // The shortfall in blocks (of block_bytes each, with bytes).
    const int64_t over = used - bound + n;
    return ResourceExhausted(Resource::kNamespaceQuota, (over + unit_block_ - 1) / unit_block_,
                             fmt::format("{} in {}", what, where));
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckSequences(SessionId session, int64_t more,
                                            std::string_view what) const {
  auto it = sessions_.find(session);
  if (states_ && it != sessions_.end() && it->second.group != 0) {
    const RefGroup& g = ref_groups_.at(it->second.group);
    if (g.sequences + more > g.max_state_slots) {
      return ResourceExhausted(
          Resource::kStateSlots, g.sequences + more - g.max_state_slots,
          fmt::format("{} of {} more: session {}'s group holds {} state slots of its {}", what,
                      more, session.value(), g.sequences, g.max_state_slots));
    }
  }
  if (max_sequences_per_session_ == 0) return absl::OkStatus();
  const int64_t held = it == sessions_.end() ? 0 : it->second.sequences;
  if (held + more <= max_sequences_per_session_) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      fmt::format("{} of {} more: session {} holds {} sequences: at most {} "
                  "(max_sequences_per_session)",
                  what, more, session.value(), held, max_sequences_per_session_));
}

absl::Status KvCacheManager::PlanNamespaces(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                                            std::vector<NamespaceSlot>* recycle,
                                            std::string_view what) const {
  int64_t new_namespaces = 0;
  for (const auto& [ns, n] : by_ns) new_namespaces += pool_->FindNamespace(ns) ? 0 : 1;
  if (new_namespaces <= pool_->namespaces_left()) return absl::OkStatus();
  const auto full = [&] {
    return absl::ResourceExhaustedError(fmt::format(
        "{}: the namespace table is full ({} namespaces hold blocks or sequences, {} new ones "
        "asked)",
        what, pool_->stats().namespaces, new_namespaces));
  };
  // The table is full: one sweep finds every idle slot (O(slots): the pool counts each slot's
  // blocks, and the sequences that name it), so the next sweeps are as rare as the table is
  // large, or (FullTable) as frees are.
  if (!FindRoom(*pool_, &full_table_, by_ns, new_namespaces, recycle)) return full();
  return absl::OkStatus();
}

bool KvCacheManager::FindRoom(const BlockPool& pool, FullTable* table,
                              std::span<const std::pair<NamespaceId, int64_t>> namespaces,
                              int64_t fresh, std::vector<NamespaceSlot>* recycle) const {
  if (table->Refuses(pool, sequences_freed_, fresh, pool.namespaces_left())) return false;
  // The call's own namespaces' slots: never recycled under it.
  std::vector<uint8_t> own(static_cast<size_t>(pool.namespace_slots()), 0);
  int64_t kept = 0;
  for (const auto& [ns, n] : namespaces) {
    if (const std::optional<NamespaceSlot> slot = pool.FindNamespace(ns)) {
      own[slot->value()] = 1;
      ++kept;
    }
  }
  *recycle = pool.IdleNamespaces(own);
  if (fresh <= pool.namespaces_left() + static_cast<int64_t>(recycle->size())) return true;
  // What this sweep found bounds the next ones until something is freed, the slots the call
  // kept (which another call may find idle) included.
  *table = {.blocks_freed = pool.freed(),
            .sequences_freed = sequences_freed_,
            .idle = static_cast<int64_t>(recycle->size()) + kept};
  recycle->clear();
  return false;
}

absl::Status KvCacheManager::CheckCapacity(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                                           SessionId session, int64_t refs, std::string_view what,
                                           std::span<const GroupCharge> groups) {
  if (!quotas_.empty()) KVPOOL_RETURN_IF_ERROR(CheckQuotas(by_ns, groups, what));
  if (refs > 0) {
    auto it = sessions_.find(session);
    if (it == sessions_.end()) return absl::OkStatus();
    const SessionUsage& usage = it->second;
    if (usage.quota != kUnlimited && usage.block_refs + refs > usage.quota) {
      return ResourceExhausted(Resource::kSessionQuota, usage.block_refs + refs - usage.quota,
                               fmt::format("{} for session {} ({} of {} block references held)",
                                           what, session.value(), usage.block_refs, usage.quota));
    }
    if (usage.group != 0) {
      const RefGroup& g = ref_groups_.at(usage.group);
      if (g.quota != kUnlimited && g.block_refs + refs > g.quota) {
        return ResourceExhausted(
            Resource::kSessionQuota, g.block_refs + refs - g.quota,
            fmt::format("{} for session {} ({} of {} block references held by its group)", what,
                        session.value(), g.block_refs, g.quota));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckRoom(int64_t blocks, std::span<const BlockId> keep,
                                       std::vector<BlockId>* victims, std::string_view what) {
  if (blocks > pool_->num_free()) ReclaimRetired();
  int64_t short_by = blocks - pool_->num_free();
  if (short_by > 0 && cache_) short_by -= cache_->PlanEviction(short_by, keep, victims);
  if (short_by > 0) {
    victims->clear();
    return ResourceExhausted(Resource::kPoolBlocks, short_by,
                             fmt::format("{} needs {} blocks, {} free, {} cached", what, blocks,
                                         pool_->num_free(), pool_->num_cached()));
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckStateRoom(int64_t slots, std::string_view what,
                                            std::span<const BlockId> keep) {
  if (!states_ || slots == 0) return absl::OkStatus();
  const TraceContext ctx = Context(kNoSession, SequenceId(0));
  if (slots > states_->num_free()) states_->ReclaimRetired(ctx);
  int64_t short_by = slots - states_->num_free();
  if (short_by > 0) {
    // Cached checkpoints give way to working states: those nobody holds whose fences have passed
    // free a slot at once when evicted.
    int64_t spare = 0;
    for (const auto& key : checkpoint_order_) {
      const BlockId slot = key.id;
      if (states_->state(slot) == BlockState::kCached && states_->FencesPassed(slot) &&
          std::find(keep.begin(), keep.end(), slot) == keep.end()) {
        ++spare;
      }
    }
    if (spare >= short_by) {
      for (; short_by > 0; --short_by) KVPOOL_CHECK(EvictFirstCheckpoint(keep, true, ctx));
    }
  }
  if (short_by > 0) {
    return ResourceExhausted(Resource::kStateSlots, short_by,
                             fmt::format("{} needs {} state slots, {} free of {}", what, slots,
                                         states_->num_free(), states_->num_blocks()));
  }
  return absl::OkStatus();
}

void KvCacheManager::TakeStateSlot(Sequence* seq, BlockId copy_of, const TraceContext& ctx,
                                   DevicePlan* plan) {
  if (!states_) return;
  std::vector<BlockId> slot;
  KVPOOL_CHECK_OK(states_->Allocate(1, state_owner_, ctx, &slot, /*fills=*/nullptr));
  seq->state_slot = slot[0];
  if (copy_of == kInvalidBlock) {
    plan->state_zeros.push_back(slot[0]);
  } else {
    plan->state_copies.push_back(BlockCopy{copy_of, slot[0]});
  }
}

void KvCacheManager::EvictPlanned(std::span<const BlockId> victims, const TraceContext& ctx) {
  if (victims.empty()) return;
  cache_->Evict(victims, ctx);
  counters_.evictions += victims.size();
}

TableChange KvCacheManager::ApplyGrow(const GrowPlan& plan, const TraceContext& ctx,
                                      DevicePlan* device_plan) {
  Sequence& seq = *plan.sequence;
  TableChange change{.sequence = seq.id,
                     .old_num_tokens = seq.num_tokens,
                     .first_changed = static_cast<int32_t>(seq.table.size()),
                     .window_entries = static_cast<int32_t>(seq.window_table.size())};
  if (plan.num_tokens <= seq.num_tokens) return change;
  if (plan.cow) {
    const size_t index = static_cast<size_t>(seq.num_tokens / block_size_);
    const BlockId src = seq.table[index];
    std::vector<BlockId> dst;
    KVPOOL_CHECK_OK(pool_->Allocate(1, seq.slot, ctx, &dst, /*fills=*/nullptr));
    ReleaseBlock(src, ctx);
    seq.table[index] = dst[0];
    device_plan->copies.push_back(BlockCopy{src, dst[0]});
    ++counters_.cow_copies;
    change.first_changed = static_cast<int32_t>(index);
    change.replaced = src;
  }
  if (plan.new_blocks > 0) {
    KVPOOL_CHECK_OK(
        pool_->Allocate(plan.new_blocks, seq.slot, ctx, &seq.table, &device_plan->fills));
  }
  if (window_) ApplyWindowGrow(plan, ctx, device_plan, &change);
  seq.num_tokens = plan.num_tokens;
  return change;
}

void KvCacheManager::RevertGrow(SessionId caller, std::span<const TableChange> changes) {
  const TraceContext ctx = Context(caller, SequenceId(0));
  if (cache_) cache_->SetTime(ctx.time_ns);  // no pin expiry: the grow's state must stay as it was
  for (auto it = changes.rbegin(); it != changes.rend(); ++it) {
    Sequence& seq = sequences_.at(it->sequence);
    KVPOOL_CHECK(seq.session == caller);
    // Its old blocks, the copied one included (a copy-on-write is of the block it ended in).
    ReleaseTail(&seq, static_cast<size_t>(BlocksFor(it->old_num_tokens)), ctx);
    // (Window entries the grow added below the old length: GrowRequest::window_ahead.)
    if (window_) ReleaseWindowTail(&seq, static_cast<size_t>(it->window_entries), ctx);
    const size_t index = static_cast<size_t>(it->first_changed);
    if (it->replaced != kInvalidBlock) {
      // The source is still held (by another sequence or the cache): that is why it was copied.
      RetainBlock(it->replaced, ctx);
      ReleaseBlock(seq.table[index], ctx);
      seq.table[index] = it->replaced;
    }
    if (it->window_replaced != kInvalidBlock) {
      KVPOOL_CHECK_OK(window_->Retain(it->window_replaced, ctx));
      KVPOOL_CHECK_OK(window_->Release(seq.window_table[index], ctx));
      seq.window_table[index] = it->window_replaced;
    }
    seq.num_tokens = it->old_num_tokens;
    if (states_) DropPlanned(&seq, seq.num_tokens, ctx);
  }
}

absl::StatusOr<AllocateResult> KvCacheManager::Allocate(SessionId caller,
                                                        const AllocateRequest& request,
                                                        DevicePlan* plan) {
  std::vector<AllocateResult> results;
  KVPOOL_RETURN_IF_ERROR(AllocateBatch(caller, std::span(&request, 1), &results, plan));
  return results[0];
}

absl::Status KvCacheManager::AllocateBatch(SessionId caller,
                                           std::span<const AllocateRequest> requests,
                                           std::vector<AllocateResult>* results, DevicePlan* plan) {
  ++counters_.allocate_calls;
  TraceContext ctx = BeginCall(caller, SequenceId(0));
  if (requests.empty()) return EmptyBatch("allocate");
  if (caller == kNoSession) return absl::InvalidArgumentError("session 0 is reserved");
  std::vector<AllocatePlan> plans(requests.size());
  AllocateTally tally;
  for (size_t k = 0; k < requests.size(); ++k) {
    KVPOOL_RETURN_IF_ERROR(CountExhausted(PlanAllocate(requests[k], &tally, &plans[k])));
  }
  std::vector<BlockId> victims;
  std::vector<NamespaceSlot> recycle;
  KVPOOL_RETURN_IF_ERROR(
      CountExhausted(CheckSequences(caller, static_cast<int64_t>(requests.size()), "allocate")));
  KVPOOL_RETURN_IF_ERROR(
      CountExhausted(CheckCapacity(tally.by_ns, caller, tally.refs, "allocate", tally.groups)));
  KVPOOL_RETURN_IF_ERROR(CountExhausted(PlanNamespaces(tally.by_ns, &recycle, "allocate")));
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckRoom(tally.blocks, tally.keep, &victims, "allocate")));
  std::vector<NamespaceSlot> window_recycle;
  std::vector<BlockId> window_victims;
  if (window_) {
    KVPOOL_RETURN_IF_ERROR(
        CountExhausted(PlanWindowNamespaces(tally.by_ns, &window_recycle, "allocate")));
    KVPOOL_RETURN_IF_ERROR(CountExhausted(
        CheckWindowRoom(tally.window_blocks, tally.window_keep, &window_victims, "allocate")));
  }
  std::vector<BlockId> resumed;  // checkpoints the batch copies: never evicted for its slots
  for (const AllocatePlan& p : plans) {
    if (p.resume != kInvalidBlock) resumed.push_back(p.resume);
  }
  KVPOOL_RETURN_IF_ERROR(
      CountExhausted(CheckStateRoom(static_cast<int64_t>(requests.size()), "allocate", resumed)));

  // Everything checked: from here on nothing can fail.
  pool_->RecycleNamespaces(recycle);
  EvictPlanned(victims, ctx);
  if (window_) window_->RecycleNamespaces(window_recycle);
  EvictWindowPlanned(window_victims, ctx);
  SessionUsage& usage = sessions_[caller];
  for (size_t k = 0; k < requests.size(); ++k) {
    const AllocateRequest& r = requests[k];
    AllocatePlan& p = plans[k];
    const SequenceId id(next_sequence_id_++);
    ctx.sequence = id;
    const absl::StatusOr<NamespaceSlot> slot = pool_->RegisterNamespace(r.ns);
    KVPOOL_CHECK_OK(slot.status());
    Sequence& seq = sequences_[id];
    seq = Sequence{.id = id,
                   .session = caller,
                   .ns = r.ns,
                   .slot = *slot,
                   .tokens = TokensOf(r.prompt),
                   .priority = r.priority,
                   .retain_tail = r.retain_tail};
    AdoptMatch(&seq, r, p, ctx, plan);
    HoldSequence(usage, seq);
    if (states_) AddStateSlots(r.ns, 1);
    // (Uncut, the state holds no tokens of the match: it is not to be stepped or kept.)
    seq.state_tokens = p.uncut && p.match.matched_tokens > 0 ? -1 : p.match.matched_tokens;
    // The branch point's checkpoint goes on the last block the prompt shares whole: the one
    // tree block every later prompt through here follows, whichever sibling it continues into.
    const int64_t branch = p.branch_at / block_size_ * block_size_;
    seq.branch_at = branch > p.match.matched_tokens ? branch : 0;
    seq.num_tokens = r.num_tokens;
    counters_.prompt_tokens += r.prompt.size();
    counters_.hit_tokens += static_cast<uint64_t>(p.match.matched_tokens);
    counters_.missed_no_checkpoint += static_cast<uint64_t>(p.no_checkpoint);
    counters_.missed_window_evicted += static_cast<uint64_t>(p.window_evicted);
    CountMissed(p, r.prompt.size() - static_cast<uint64_t>(p.match.matched_tokens) -
                       static_cast<uint64_t>(p.no_checkpoint) -
                       static_cast<uint64_t>(p.window_evicted));
    results->push_back(AllocateResult{id, p.match.matched_tokens});
  }
  AddSequences(usage, static_cast<int64_t>(requests.size()));
  AddRefs(usage, tally.refs);
  return absl::OkStatus();
}

void KvCacheManager::AdoptMatch(Sequence* seq, const AllocateRequest& r, const AllocatePlan& p,
                                const TraceContext& ctx, DevicePlan* plan) {
  if (cache_) seq->path = cache_->Adopt(p.match);
  for (BlockId block : p.match.full) {
    seq->table.push_back(block);
    RetainBlock(block, ctx);
    pool_->NoteCacheHit(block, ctx);
  }
  if (p.match.partial != kInvalidBlock) {
    const BlockId src = p.match.partial;
    if (p.copy_partial) {
      KVPOOL_CHECK_OK(pool_->Allocate(1, seq->slot, ctx, &seq->table, /*fills=*/nullptr));
      plan->copies.push_back(BlockCopy{src, seq->table.back()});
      ++counters_.cow_copies;
    } else {
      seq->table.push_back(src);
      RetainBlock(src, ctx);
      pool_->NoteCacheHit(src, ctx);
    }
  }
  KVPOOL_CHECK_OK(pool_->Allocate(p.new_blocks, seq->slot, ctx, &seq->table, &plan->fills));
  if (window_) AdoptWindow(seq, p, r.num_tokens, ctx, plan);
  TakeStateSlot(seq, p.resume, ctx, plan);
  if (p.resume != kInvalidBlock) {
    // Held while the sequence lives, as its path's blocks are: the copy out of it is fenced
    // with the plan, and the checkpoint stays where the match found it.
    KVPOOL_CHECK_OK(states_->Retain(p.resume, ctx));
    seq->resumed_from = p.resume;
    TouchCheckpoint(p.resume);
    ++counters_.checkpoints.resumed;
  }
  if (p.ghost) CountGhost(p.ghost->first);
}

absl::Status KvCacheManager::PlanAllocate(const AllocateRequest& r, AllocateTally* tally,
                                          AllocatePlan* p) const {
  if (r.ns == kNoNamespace) return absl::InvalidArgumentError("namespace 0 is reserved");
  if (r.num_tokens < 0 || static_cast<int64_t>(r.prompt.size()) > r.num_tokens) {
    return absl::InvalidArgumentError(
        fmt::format("token count {} is negative or shorter than the prompt ({} tokens)",
                    r.num_tokens, r.prompt.size()));
  }
  if (r.priority < 0 || r.priority >= kNumPriorities) {
    return absl::InvalidArgumentError(
        fmt::format("priority {} outside [0, {})", r.priority, kNumPriorities));
  }
  const int64_t need = BlocksFor(r.num_tokens);
  if (need > max_blocks_per_seq_) {
    return ResourceExhausted(
        Resource::kTableBound, need - max_blocks_per_seq_,
        fmt::format("a sequence of {} tokens needs {} blocks", r.num_tokens, need));
  }
  if (cache_ && !r.prompt.empty()) {
    p->match = cache_->Match(r.ns, r.prompt);
    if (p->match.matched_tokens < static_cast<int64_t>(r.prompt.size())) {
      MatchExplanation why;
      cache_->ExplainStop(r.ns, r.prompt, p->match, &why);
      p->stop = why.stop;
      p->below_admission_bar = why.below_admission_bar;
      p->first_block_elsewhere = why.first_block_elsewhere;
    }
    p->uncut = (states_ || window_) && r.adopt_uncut;
    if ((states_ || window_) && !p->uncut) {
      // A state group resumes only from a checkpoint of the state exactly where the match ends,
      // a window group only where it holds the window there (docs/hybrid-groups.md §4): the
      // match is cut at the deepest point both reach.
      p->branch_at = p->match.matched_tokens;
      p->resume = CutResumable(&p->match, &p->no_checkpoint, &p->window_evicted, &p->ghost);
    }
  }
  // Table slots the match fills: every fully matched block, and the partially matched one
  // (shared, or copied when the sequence will write into it).
  const int64_t from_match =
      static_cast<int64_t>(p->match.full.size()) + (p->match.partial != kInvalidBlock ? 1 : 0);
  if (p->match.partial != kInvalidBlock) {
    const BlockId block = p->match.partial;
    // Sharing it is enough unless the sequence will write into it: then it must write alone
    // and above the published tokens, or it gets a copy.
    if (r.num_tokens > p->match.matched_tokens) {
      uint32_t earlier = 0;  // holders this batch already added
      for (const auto& [b, n] : tally->joined) earlier += b == block ? n : 0;
      p->copy_partial = MustCopy(block, p->match.partial_tokens, pool_->refs(block) - 1 + earlier);
    }
    if (!p->copy_partial) Claim(&tally->joined, block);
    tally->keep.push_back(p->match.partial);
  }
  tally->keep.insert(tally->keep.end(), p->match.full.begin(), p->match.full.end());
  int64_t charged = 0;  // physical blocks this request adds to the namespace's ACTIVE ones
  // A match's blocks are distinct (one node per block): only earlier requests' adoptions can
  // repeat one, so only they are searched (a whole-list search is quadratic in a long match).
  std::vector<BlockId>& adopted = tally->adopted;
  const auto adopted_before = static_cast<ptrdiff_t>(adopted.size());
  auto charge = [&](BlockId block) {
    // A CACHED block becomes ACTIVE: charged, unless a pin held (and charged) it already.
    if (pool_->state(block) == BlockState::kCached && !cache_->pin_held(block) &&
        std::find(adopted.begin(), adopted.begin() + adopted_before, block) ==
            adopted.begin() + adopted_before) {
      adopted.push_back(block);
      ++charged;
    }
  };
  for (BlockId block : p->match.full) charge(block);  // the blocks held by reference
  if (p->match.partial != kInvalidBlock && !p->copy_partial) charge(p->match.partial);
  p->new_blocks = static_cast<int32_t>(need - from_match);
  const int64_t fresh = p->new_blocks + (p->copy_partial ? 1 : 0);
  tally->blocks += fresh;
  AddTo(&tally->by_ns, r.ns, charged + fresh);
  tally->refs += need;
  if (window_) PlanWindowAllocate(r, tally, p);
  if (states_) AddCharge(&tally->groups, r.ns, 0, 1);
  return absl::OkStatus();
}

absl::Status KvCacheManager::Grow(SessionId caller, SequenceId sequence, int64_t num_tokens,
                                  DevicePlan* plan) {
  const GrowRequest request{sequence, num_tokens};
  return GrowBatch(caller, std::span(&request, 1), plan);
}

absl::Status KvCacheManager::GrowBatch(SessionId caller, std::span<const GrowRequest> requests,
                                       DevicePlan* plan, std::vector<TableChange>* changes) {
  ++counters_.grow_calls;
  TraceContext ctx = BeginCall(caller, SequenceId(0));  // one clock reading per call
  if (requests.empty()) return EmptyBatch("grow");
  std::vector<GrowPlan> plans(requests.size());
  WriteClaims claims;
  WriteClaims window_claims;
  std::vector<std::pair<NamespaceId, int64_t>> by_ns;
  std::vector<GroupCharge> groups;  // window blocks the batch adds, by namespace
  int64_t refs = 0;
  int64_t blocks = 0;
  int64_t window_blocks = 0;
  const uint64_t mark = ++batch_serial_;
  for (size_t k = 0; k < requests.size(); ++k) {
    const GrowRequest& r = requests[k];
    KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, r.sequence));
    if (seq->batch_mark == mark) {
      return absl::InvalidArgumentError(
          fmt::format("sequence {} appears twice in one grow batch", r.sequence.value()));
    }
    seq->batch_mark = mark;
    KVPOOL_RETURN_IF_ERROR(CountExhausted(PlanGrow(seq, r.num_tokens, &claims, &plans[k])));
    if (window_) {
      PlanWindowGrow(*seq, r.window_ahead, &window_claims, &plans[k]);
      const int64_t w = plans[k].window_new_blocks + (plans[k].window_cow ? 1 : 0);
      window_blocks += w;
      AddCharge(&groups, seq->ns, w, 0);
    }
    const int64_t n = plans[k].new_blocks + (plans[k].cow ? 1 : 0);
    if (n > 0) AddTo(&by_ns, seq->ns, n);
    blocks += n;
    refs += plans[k].new_blocks;
  }
  std::vector<BlockId> victims;
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckCapacity(by_ns, caller, refs, "grow", groups)));
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckRoom(blocks, {}, &victims, "grow")));
  std::vector<BlockId> window_victims;
  KVPOOL_RETURN_IF_ERROR(
      CountExhausted(CheckWindowRoom(window_blocks, {}, &window_victims, "grow")));

  // Everything checked: from here on nothing can fail.
  EvictPlanned(victims, ctx);
  EvictWindowPlanned(window_victims, ctx);
  if (changes != nullptr) changes->reserve(changes->size() + plans.size());
  for (const GrowPlan& p : plans) {
    ctx.sequence = p.sequence->id;
    const TableChange change = ApplyGrow(p, ctx, plan);
    if (changes != nullptr) changes->push_back(change);
  }
  if (refs > 0) AddRefs(caller, refs);
  return absl::OkStatus();
}

absl::Status KvCacheManager::Commit(SessionId caller, SequenceId sequence, int64_t num_tokens,
                                    std::span<const int32_t> new_tokens) {
  ++counters_.commit_calls;
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  const int64_t known = static_cast<int64_t>(seq->tokens.size() + new_tokens.size());
  if (num_tokens < 0 || num_tokens > seq->num_tokens || known < num_tokens ||
      known > seq->num_tokens) {
    return absl::InvalidArgumentError(
        fmt::format("cannot commit {} tokens of sequence {}: it has {} tokens, {} of them known",
                    num_tokens, sequence.value(), seq->num_tokens, known));
  }
  KVPOOL_RETURN_IF_ERROR(CheckPublish(*seq, new_tokens, num_tokens, /*claims=*/nullptr));
  seq->tokens.insert(seq->tokens.end(), new_tokens.begin(), new_tokens.end());
  if (cache_) {
    cache_->Commit(seq->ns, std::span(seq->tokens).first(static_cast<size_t>(num_tokens)),
                   seq->table, seq->priority, seq->retain_tail, &seq->path, ctx);
    if (!seq->checkpoints.empty()) KeepPlanned(seq, /*at_end=*/false, ctx);
    if (window_) KeepWindowBlocks(seq, num_tokens, ctx);
  }
  return absl::OkStatus();
}

void KvCacheManager::ReleaseTail(Sequence* sequence, size_t keep, const TraceContext& ctx) {
  // Deepest first: a tree node becomes evictable only after its descendants (the eviction
  // policy's leaf-first promise), and the LIFO free list hands the first block out next.
  CachePath& path = sequence->path;
  if (window_) ReleaseWindowTail(sequence, keep, ctx);
  // The blocks past the path's full nodes first (its partial node's, and any not published)...
  for (size_t k = sequence->table.size(); k > std::max(keep, path.full.size());) {
    --k;
    if (path.partial != kInvalidBlock && k == path.full.size()) {
      cache_->Unlock(path.partial);
      path.partial = kInvalidBlock;
    }
    ReleaseBlock(sequence->table[k], ctx);
  }
  // ...then the full nodes' blocks, deepest first.
  if (path.full.size() > keep) cache_->ReleasePath(&path, sequence->table, keep, ctx);
  AddRefs(sequence->session, -static_cast<int64_t>(sequence->table.size() - keep));
  sequence->table.resize(keep);
}

absl::Status KvCacheManager::Truncate(SessionId caller, SequenceId sequence, int64_t num_tokens,
                                      DevicePlan* plan) {
  ++counters_.truncate_calls;
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  if (num_tokens < 0 || num_tokens > seq->num_tokens) {
    return absl::InvalidArgumentError(fmt::format("cannot truncate sequence {} of {} tokens to {}",
                                                  sequence.value(), seq->num_tokens, num_tokens));
  }
  if (window_) KVPOOL_RETURN_IF_ERROR(CheckWindowTruncate(*seq, num_tokens));
  // Below its known tokens its state goes back to a checkpoint, or to the state of no tokens; a
  // lost one does wherever it can.
  const bool rewind = states_ && num_tokens < static_cast<int64_t>(seq->tokens.size());
  const bool restorable = rewind || (states_ && seq->state_lost);
  BlockId restore = kInvalidBlock;
  bool zero = false;
  if (restorable && num_tokens > 0) {
    absl::StatusOr<BlockId> point = RewindPoint(*seq, num_tokens, plan != nullptr);
    if (point.ok()) {
      restore = *point;
    } else if (rewind) {
      return point.status();
    }
  } else if (restorable) {
    if (rewind && plan == nullptr) {
      return absl::FailedPreconditionError(fmt::format(
          "cannot truncate sequence {} to 0 tokens without a device plan to zero its state",
          sequence.value()));
    }
    zero = plan != nullptr;
  }
  if (states_) {
    DropPlanned(seq, num_tokens, ctx);
    if (restore != kInvalidBlock) {
      plan->state_copies.push_back(BlockCopy{restore, seq->state_slot});
      TouchCheckpoint(restore);
      seq->state_tokens = num_tokens;
      seq->state_lost = false;
    } else if (zero) {
      plan->state_zeros.push_back(seq->state_slot);
      seq->state_tokens = 0;
      seq->state_lost = false;
    } else if (seq->state_tokens > num_tokens) {
      seq->state_tokens = -1;
    }
  }
  ReleaseTail(seq, static_cast<size_t>(BlocksFor(num_tokens)), ctx);
  // The tree path keeps only the full blocks the sequence still has whole; the block it now
  // ends inside is still held (so never evicted) and is protected by its coverage.
  if (cache_) cache_->Truncate(&seq->path, static_cast<size_t>(num_tokens / block_size_));
  if (static_cast<int64_t>(seq->tokens.size()) > num_tokens) {
    seq->tokens.resize(static_cast<size_t>(num_tokens));
  }
  seq->num_tokens = num_tokens;
  return absl::OkStatus();
}

absl::Status KvCacheManager::TakeBackGrowth(SessionId caller, SequenceId sequence,
                                            int64_t num_tokens, int32_t window_entries,
                                            DevicePlan* plan) {
  KVPOOL_RETURN_IF_ERROR(Truncate(caller, sequence, num_tokens, plan));
  if (window_ && window_entries >= 0) {
    ReleaseWindowTail(&sequences_.at(sequence), static_cast<size_t>(window_entries),
                      Context(caller, sequence));
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceId> KvCacheManager::Fork(SessionId caller, SequenceId sequence,
                                                DevicePlan* plan) {
  ++counters_.fork_calls;
  TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * parent, Owned(caller, sequence));
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckSequences(caller, 1, "fork")));
  const bool partial = parent->num_tokens % block_size_ != 0;
  const std::pair<NamespaceId, int64_t> by_ns[] = {{parent->ns, partial ? 1 : 0}};
  // The child shares the parent's window blocks but the one both write into, and has a state
  // slot of its own.
  const GroupCharge groups[] = {{.ns = parent->ns,
                                 .window_blocks = WindowPartialLive(*parent) ? 1 : 0,
                                 .state_slots = states_ ? 1 : 0}};
  std::vector<BlockId> victims;
  KVPOOL_RETURN_IF_ERROR(CountExhausted(
      CheckCapacity(by_ns, caller, static_cast<int64_t>(parent->table.size()), "fork", groups)));
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckRoom(partial ? 1 : 0, {}, &victims, "fork")));
  std::vector<BlockId> window_victims;
  KVPOOL_RETURN_IF_ERROR(CountExhausted(
      CheckWindowRoom(WindowPartialLive(*parent) ? 1 : 0, {}, &window_victims, "fork")));
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckStateRoom(1, "fork")));

  const SequenceId id(next_sequence_id_++);
  ctx.sequence = id;
  EvictPlanned(victims, ctx);
  EvictWindowPlanned(window_victims, ctx);
  // Copy what the child needs before inserting: the insert may move `parent`.
  Sequence child{.id = id,
                 .session = caller,
                 .ns = parent->ns,
                 .slot = parent->slot,
                 .num_tokens = parent->num_tokens,
                 .table = parent->table,
                 .window_slot = parent->window_slot,
                 .tokens = TokensOf(parent->tokens),
                 .priority = parent->priority,
                 .retain_tail = parent->retain_tail,
                 .state_tokens = parent->state_tokens,
                 .state_lost = parent->state_lost};
  if (cache_) child.path = cache_->Clone(parent->path);
  if (window_) ForkWindow(*parent, &child, ctx, plan);
  const size_t shared = child.table.size() - (partial ? 1 : 0);
  for (size_t i = 0; i < shared; ++i) RetainBlock(child.table[i], ctx);
  if (partial) {
    std::vector<BlockId> dst;
    KVPOOL_CHECK_OK(pool_->Allocate(1, child.slot, ctx, &dst, /*fills=*/nullptr));
    plan->copies.push_back(BlockCopy{child.table.back(), dst[0]});
    child.table.back() = dst[0];
    ++counters_.cow_copies;
  }
  TakeStateSlot(&child, parent->state_slot, ctx, plan);
  if (states_) AddStateSlots(child.ns, 1);
  SessionUsage& usage = sessions_[caller];
  AddRefs(usage, static_cast<int64_t>(child.table.size()));
  AddSequences(usage, 1);
  HoldSequence(usage, child);
  sequences_.emplace(id, std::move(child));
  return id;
}

absl::Status KvCacheManager::Free(SessionId caller, SequenceId sequence, OnFree on_free) {
  return FreeBatch(caller, std::span(&sequence, 1), on_free);
}

absl::Status KvCacheManager::FreeBatch(SessionId caller, std::span<const SequenceId> sequences,
                                       OnFree on_free) {
  ++counters_.free_calls;
  const int64_t now_ns = BeginCall(caller, SequenceId(0)).time_ns;
  if (sequences.empty()) return EmptyBatch("free");
  std::vector<Sequence*> seqs;
  seqs.reserve(sequences.size());
  PublishClaims claims;
  const bool commit = on_free == OnFree::kCommit && cache_ != nullptr;
  const uint64_t mark = ++batch_serial_;
  for (SequenceId id : sequences) {
    KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, id));
    if (seq->batch_mark == mark) {
      return absl::InvalidArgumentError(
          fmt::format("sequence {} appears twice in one free batch", id.value()));
    }
    seq->batch_mark = mark;
    if (commit) {
      KVPOOL_RETURN_IF_ERROR(CheckPublish(*seq, {}, static_cast<int64_t>(seq->tokens.size()),
                                          sequences.size() > 1 ? &claims : nullptr));
    }
    seqs.push_back(seq);
  }
  // Everything checked: from here on nothing can fail.
  for (Sequence* seq : seqs) FreeChecked(seq, on_free, now_ns);
  return absl::OkStatus();
}

void KvCacheManager::FreeChecked(Sequence* seq, OnFree on_free, int64_t now_ns) {
  const SequenceId id = seq->id;
  const SessionId caller = seq->session;
  const TraceContext ctx{caller, id, now_ns};
  if (on_free == OnFree::kCommit && cache_) {
    cache_->Commit(seq->ns, seq->tokens, seq->table, seq->priority, seq->retain_tail, &seq->path,
                   ctx);
    if (window_) KeepWindowBlocks(seq, static_cast<int64_t>(seq->tokens.size()), ctx);
  }
  // Before the path goes: the checkpoints it keeps hang on the path's blocks.
  if (states_) {
    ReleaseStates(seq, on_free == OnFree::kCommit && cache_, ctx);
    AddStateSlots(seq->ns, -1);
  }
  ReleaseTail(seq, 0, ctx);
  if (cache_) cache_->Truncate(&seq->path, 0);
  // (The session's entry stays, emptied or not, until FreeSession.)
  SessionUsage& usage = sessions_.find(caller)->second;
  AddSequences(usage, -1);
  UnholdSequence(usage, *seq);
  RecycleTokens(seq->tokens);
  sequences_.erase(id);
  ++sequences_freed_;
}

absl::Status KvCacheManager::CheckPublish(const Sequence& seq, std::span<const int32_t> extra,
                                          int64_t num_tokens, PublishClaims* claims) const {
  if (!cache_) return absl::OkStatus();
  const size_t bs = static_cast<size_t>(block_size_);
  const std::span<const int32_t> known(seq.tokens);
  const size_t end = static_cast<size_t>(num_tokens);
  std::vector<int32_t> joined;  // a block straddling the known tokens and `extra`
  for (size_t k = seq.path.full.size(); k * bs < end; ++k) {
    const BlockId block = seq.table[k];
    // A block the tree holds no node for agrees with any tokens (no copy needed to see that).
    if (claims == nullptr && cache_->CoverageOf(block) == 0) continue;
    const size_t begin = k * bs;
    const size_t stop = std::min(end, begin + bs);
    std::span<const int32_t> tokens;  // the block's, from the known tokens and `extra`
    if (stop <= known.size()) {
      tokens = known.subspan(begin, stop - begin);
    } else if (begin >= known.size()) {
      tokens = extra.subspan(begin - known.size(), stop - begin);
    } else {
      joined.assign(known.begin() + static_cast<ptrdiff_t>(begin), known.end());
      joined.insert(joined.end(), extra.begin(),
                    extra.begin() + static_cast<ptrdiff_t>(stop - known.size()));
      tokens = joined;
    }
    bool agrees = cache_->Agrees(block, tokens);
    if (agrees && claims != nullptr) {
      auto [it, fresh] = claims->try_emplace(block, tokens.begin(), tokens.end());
      std::vector<int32_t>& other = it->second;
      agrees =
          fresh || std::equal(other.begin(), other.begin() + std::min(other.size(), tokens.size()),
                              tokens.begin());
      if (tokens.size() > other.size()) other.assign(tokens.begin(), tokens.end());
    }
    if (!agrees) {
      return absl::FailedPreconditionError(fmt::format(
          "sequence {} says block {} (table entry {}) holds other tokens than were published for "
          "it: another sequence shares the block and wrote it first (write only past a Grow, "
          "which copies a shared block)",
          seq.id.value(), block.value(), k));
    }
  }
  return absl::OkStatus();
}

int64_t KvCacheManager::FreeSession(SessionId session) {
  BeginCall(session, SequenceId(0));
  // What it holds, from its holdings (never a walk over the pool's), copied since each release
  // takes an entry out of them, and sorted: a deterministic release order.
  std::vector<SequenceId> owned;
  if (const SessionHoldings* held = HoldingsOf(session)) {
    owned.assign(held->sequences.begin(), held->sequences.end());
  }
  std::sort(owned.begin(), owned.end());
  for (SequenceId id : owned) KVPOOL_CHECK_OK(Free(session, id));
  // Only now: each Free may have expired some of its pins first (housekeeping).
  std::vector<PinId> pins;
  if (const SessionHoldings* held = HoldingsOf(session)) {
    pins.assign(held->pins.begin(), held->pins.end());
  }
  std::sort(pins.begin(), pins.end());
  visited_.fetch_add(owned.size() + pins.size(), std::memory_order_relaxed);
  for (PinId id : pins) ReleasePin(id);
  if (auto it = sessions_.find(session); it != sessions_.end()) {
    if (const uint64_t group = it->second.group; group != 0 && --ref_groups_[group].sessions == 0) {
      ref_groups_.erase(group);
    }
    sessions_.erase(it);
  }
  return static_cast<int64_t>(owned.size());
}

}  // namespace kvpool
