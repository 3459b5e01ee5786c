// Engine: what operators ask of it (stats, listings, traces, events, eviction, invariants, drain).

#include <algorithm>

#include "daemon/engine/engine.h"
#include "daemon/engine/invalidations.h"
#include "daemon/engine/label_fold.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {

absl::StatusOr<int32_t> Engine::FindPool(std::string_view name) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->FindPool(name);
}

EngineStats Engine::Stats(int32_t pool_index) const {
  EngineStats s;
  absl::ReaderMutexLock lock(&mu_);
  const PoolState& pool = state_->pool(pool_index);
  s.pool = pool.name();
  for (int32_t i = 0; i < state_->num_pools(); ++i) s.pools.push_back(state_->pool(i).name());
  s.cache = pool.cache().stats();
  for (const auto& [id, session] : state_->sessions()) {
    s.attached_sessions += session->pool == pool_index ? 1 : 0;
  }
  s.namespaces = state_->namespaces().size();
  s.sessions = state_->session_counters;
  s.calls = state_->call_counters;
  s.model = pool.model_counters;
  s.model_info = model_info_;
  s.events_next_seq = pool.cache().events() ? pool.cache().events()->next_seq() : 0;
  s.epoch = epoch_;
  s.device = device_->name();
  s.layout = pool.layout();
  s.uptime_seconds = static_cast<double>(state_->now() - started_ns_) * 1e-9;
  s.draining = state_->draining;
  s.health = state_->health;
  if (pool.tiers() != nullptr) s.tiers = pool.tiers()->stats();
  s.invalidations = state_->invalidations;
  s.tenants = pool.tenant_counters.Snapshot();
  if (pool.tiers() != nullptr) {
    for (auto& [label, counters] : s.tenants) {
      if (label == LabelFold::kOther) continue;
      const TierSet::TenantUse use =
          pool.tiers()->UseOf(state_->namespaces().Tags(label, "").tenant);
      counters.tier_blocks = use.blocks;
      counters.tier_evicted_blocks = use.evicted;
      counters.redis_bytes = use.remote_bytes;
      counters.redis_over_budget_blocks = use.remote_over_budget;
    }
  }
  const std::vector<ShareUse> shares = pool.cache().EvictionShares();
  if (shares.size() > 1) {
    for (auto& [label, counters] : s.tenants) {
      if (label == LabelFold::kOther) continue;  // many tenants, or none
      const uint64_t key = state_->namespaces().QuotaGroup(label);
      for (const ShareUse& share : shares) {
        if (share.key != key) continue;
        counters.cached_bytes = share.bytes;
        counters.evicted_blocks = share.evicted;
      }
    }
  }
  return s;
}

absl::StatusOr<Engine::Invalidation> Engine::Invalidate(std::string_view tenant,
                                                        std::string_view model) {
  absl::MutexLock serialized(&invalidation_mu_);
  Invalidation out;
  Generations generations;
  uint64_t fingerprint = 0;
  {
    WriteLock lock(this);
    KVPOOL_ASSIGN_OR_RETURN(const EngineState::Invalidated done, state_->Invalidate(tenant, model));
    out = {.generation = done.generation, .sessions = done.sessions, .namespaces = done.namespaces};
    for (int32_t p = 0; p < state_->num_pools(); ++p) {
      PoolState& pool = state_->pool(p);
      if (pool.tiers() == nullptr) continue;
      out.tier_blocks += pool.tiers()->Invalidate(done.filter);
      pool.DrainTierEvents();
    }
    ++state_->invalidations;
    generations = state_->namespaces().generations();
    fingerprint = state_->secret().fingerprint();
  }
  Logger("daemon").info("invalidated tenant {}{}{}: {} sessions moved, {} tier blocks dropped",
                        tenant, model.empty() ? "" : " model ", model, out.sessions,
                        out.tier_blocks);
  if (invalidations_file_.empty()) return out;
  // Outside the engine's lock: a file write and a sync.
  if (absl::Status s = SaveGenerations(invalidations_file_, fingerprint, generations); !s.ok()) {
    return absl::InternalError(
        fmt::format("the invalidation holds until a restart, but could not be written down: {}",
                    std::string(s.message())));
  }
  return out;
}

absl::Status Engine::FlushTiers(absl::Duration timeout) const {
  const int64_t deadline_ns = clock_->NowNanos() + absl::ToInt64Nanoseconds(timeout);
  for (TierSet* t : tiers_) {
    if (t != nullptr) {
      KVPOOL_RETURN_IF_ERROR(
          t->Flush(absl::Nanoseconds(std::max<int64_t>(deadline_ns - clock_->NowNanos(), 0))));
    }
  }
  return absl::OkStatus();
}

std::vector<SessionListing> Engine::ListSessions() const {
  std::vector<SessionListing> out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [id, session] : state_->sessions()) {
    const KvCacheManager& cache = state_->pool(session->pool).cache();
    out.push_back({.session = session,
                   .quota = cache.QuotaOf(session->ns),
                   .share = cache.EvictionShareOf(session->ns)});
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.session->id < b.session->id; });
  for (int32_t p = 0; p < state_->num_pools(); ++p) {
    state_->pool(p).cache().ForEachSequence([&](const Sequence& seq) {
      auto it = std::lower_bound(
          out.begin(), out.end(), seq.session,
          [](const SessionListing& l, SessionId id) { return l.session->id < id; });
      if (it == out.end() || it->session->id != seq.session) return;
      ++it->sequences;
      it->block_refs += static_cast<int64_t>(seq.table.size());
    });
  }
  return out;
}

Tables Engine::ListSequences(std::optional<int32_t> pool, SessionId session,
                             std::vector<SessionId>* owners, std::vector<int32_t>* pools) const {
  absl::ReaderMutexLock lock(&mu_);
  Tables out;
  for (int32_t p = 0; p < state_->num_pools(); ++p) {
    if (pool && *pool != p) continue;
    const PoolState& state = state_->pool(p);
    std::vector<const Sequence*> seqs;
    state.cache().ForEachSequence([&](const Sequence& seq) {
      if (session == kNoSession || seq.session == session) seqs.push_back(&seq);
    });
    std::sort(seqs.begin(), seqs.end(), [](const auto* a, const auto* b) { return a->id < b->id; });
    for (const Sequence* seq : seqs) {
      state.AppendTable(*seq, 0, 0, &out);
      owners->push_back(seq->session);
      pools->push_back(p);
    }
  }
  return out;
}

absl::StatusOr<std::vector<BlockTraceEntry>> Engine::BlockTrace(
    int32_t pool_index, std::optional<BlockId> block) const {
  absl::ReaderMutexLock lock(&mu_);
  const BlockPool& pool = state_->pool(pool_index).cache().pool();
  if (!block) return pool.trace().All();
  if (!pool.Contains(*block)) {
    return absl::InvalidArgumentError(
        fmt::format("no block {} (the pool has {})", block->value(), pool.num_blocks()));
  }
  return pool.trace().History(*block);
}

MatchExplanation Engine::Explain(int32_t pool, NamespaceId ns,
                                 std::span<const int32_t> tokens) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->pool(pool).cache().ExplainMatch(ns, tokens);
}

absl::StatusOr<int64_t> Engine::Evict(int32_t pool, int64_t blocks, bool all) {
  WriteLock lock(this);
  KvCacheManager& cache = state_->pool(pool).cache();
  if (all) {
    const int64_t before = cache.stats().cache.nodes;
    KVPOOL_RETURN_IF_ERROR(cache.ClearCache());
    return before;
  }
  if (blocks < 0) return absl::InvalidArgumentError("evict: negative block count");
  return cache.EvictCached(blocks);
}

absl::Status Engine::CheckInvariants() const {
  absl::ReaderMutexLock lock(&mu_);
  for (int32_t p = 0; p < state_->num_pools(); ++p) {
    KVPOOL_RETURN_IF_ERROR(state_->pool(p).CheckInvariants());
  }
  return state_->CheckInvariants();
}

int64_t Engine::Drain() {
  WriteLock lock(this);
  state_->draining = true;
  int64_t live = 0;
  for (int32_t p = 0; p < state_->num_pools(); ++p) {
    live += state_->pool(p).cache().stats().sequences;
  }
  return live;
}

bool Engine::draining() const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->draining;
}

absl::Status Engine::health() const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->health;
}

bool Engine::ReadEvents(int32_t pool, uint64_t from, size_t max, std::vector<KvEvent>* out) const {
  absl::ReaderMutexLock lock(&mu_);
  const EventLog* log = state_->pool(pool).cache().events();
  return log == nullptr || log->ReadFrom(from, max, out);
}

std::vector<KvEvent> Engine::SnapshotEvents(int32_t pool, uint64_t* resume_seq) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->pool(pool).cache().SnapshotEvents(resume_seq);
}

uint64_t Engine::next_event_seq(int32_t pool) const {
  absl::ReaderMutexLock lock(&mu_);
  const EventLog* log = state_->pool(pool).cache().events();
  return log ? log->next_seq() : 1;
}

void Engine::AddEventListener(EventListener* listener) {
  absl::MutexLock lock(&listeners_mu_);
  KVPOOL_CHECK(std::find(listeners_.begin(), listeners_.end(), listener) == listeners_.end());
  listeners_.push_back(listener);
}

void Engine::RemoveEventListener(EventListener* listener) {
  absl::MutexLock lock(&listeners_mu_);  // as writer: no call of it is in progress after this
  listeners_.erase(std::remove(listeners_.begin(), listeners_.end(), listener), listeners_.end());
}

Engine::WriteLock::WriteLock(const Engine* engine) : engine_(engine) { engine_->mu_.Lock(); }

// Not analyzed: the analysis cannot see that engine_->mu_ is the capability this object holds.
Engine::WriteLock::~WriteLock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const GrownLogs grown = engine_->TakeGrownLogs();
  engine_->mu_.Unlock();
  if (!grown.empty()) engine_->TellListeners(grown);
}

Engine::GrownLogs Engine::TakeGrownLogs() const {
  GrownLogs grown;
  for (int32_t p = 0; p < state_->num_pools(); ++p) {
    const EventLog* log = state_->pool(p).cache().events();
    if (log == nullptr) continue;
    uint64_t& told = told_seq_[static_cast<size_t>(p)];
    if (log->next_seq() == told) continue;
    told = log->next_seq();
    grown.emplace_back(p, told);
  }
  return grown;
}

void Engine::TellListeners(const GrownLogs& grown) const {
  absl::ReaderMutexLock lock(&listeners_mu_);
  for (EventListener* listener : listeners_) {
    for (const auto& [pool, next_seq] : grown) listener->OnEvents(pool, next_seq);
  }
}

}  // namespace kvpool::daemon
