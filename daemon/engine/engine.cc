// Engine: sessions, control calls and compute submission (admin in engine_admin.cc).

#include "daemon/engine/engine.h"

#include <algorithm>
#include <span>

#include "absl/cleanup/cleanup.h"
#include "daemon/engine/invalidations.h"
#include "daemon/engine/promotion.h"
#include "daemon/engine/step.h"
#include "daemon/engine/step_runner.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {
namespace {

spdlog::logger& Log() { return Logger("daemon"); }

absl::Status DeviceError(const absl::Status& s) {
  return absl::InternalError(fmt::format("device: {}", s.message()));
}

absl::Status NoModelError() {
  return absl::FailedPreconditionError("kvpoold runs no model (config: model { name: \"none\" })");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       kernels::Device* device,
                                                       model::StepModel* model) {
  if (model != nullptr && model->state_bytes() > 0) {
    // Each sequence's state lives in its pool's state group (docs/hybrid-groups.md §3).
    for (const PoolOptions& pool : options.pools) {
      if (pool.layout.num_state_slots == 0 || pool.layout.state_slot_bytes < model->state_bytes()) {
        return absl::InvalidArgumentError(fmt::format(
            "pool {} has {} state slots of {} bytes; the model's state-space layers need slots "
            "of {} bytes (shape.state_slots)",
            pool.name, pool.layout.num_state_slots, pool.layout.state_slot_bytes,
            model->state_bytes()));
      }
    }
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<EngineState> state, EngineState::Create(options, device));
  ModelInfo info;
  if (model != nullptr) {
    info = {.name = options.model_name.empty() ? "model" : options.model_name,
            .vocab_size = model->config().vocab_size,
            .max_position = model->config().max_position};
  }
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(state), model, std::move(info)));
  // The tier writers hand their events to the pool's log (stopped again in ~Engine).
  Engine* e = engine.get();
  for (size_t i = 0; i < e->tiers_.size(); ++i) {
    if (e->tiers_[i] == nullptr) continue;
    e->tiers_[i]->set_on_events([e, pool = static_cast<int32_t>(i)] {
      WriteLock lock(e);
      e->state_->pool(pool).DrainTierEvents();
    });
    {
      // What the tiers told before there was a log to take it (the disk's records found at start).
      WriteLock lock(e);
      e->state_->pool(static_cast<int32_t>(i)).DrainTierEvents();
    }
    // Stage and KeepInHost run under the engine's lock (TierSet::set_tags_of).
    e->tiers_[i]->set_tags_of([e](NamespaceId ns) {
      e->mu_.AssertReaderHeld();
      return e->state_->namespaces().TagsOf(ns);
    });
  }
  if (!options.invalidations_file.empty()) {
    WriteLock lock(e);
    KVPOOL_ASSIGN_OR_RETURN(
        Generations generations,
        LoadGenerations(options.invalidations_file, e->state_->secret().fingerprint()));
    e->state_->RestoreGenerations(std::move(generations));
  }
  if (model != nullptr) {
    StepExecutor* const executor = e;  // the runner sees the engine as its executor only
    engine->runner_ =
        std::make_unique<StepRunner>(executor, static_cast<int32_t>(options.pools.size()),
                                     options.clock, options.gather_window_ns, options.scheduler);
  }
  return engine;
}

Engine::Engine(std::unique_ptr<EngineState> state, model::StepModel* model, ModelInfo model_info)
    : layouts_([&] {
        std::vector<kernels::PoolLayout> layouts;
        for (int32_t i = 0; i < state->num_pools(); ++i) layouts.push_back(state->pool(i).layout());
        return layouts;
      }()),
      pool_names_([&] {
        std::vector<std::string> names;
        for (int32_t i = 0; i < state->num_pools(); ++i) names.push_back(state->pool(i).name());
        return names;
      }()),
      epoch_(state->options().epoch),
      clock_(state->options().clock),
      device_(&state->pool(0).device()),
      model_(model),
      model_info_(std::move(model_info)),
      started_ns_(state->now()),
      gate_({.vocab_size = model_info_.vocab_size,
             .max_position = model_info_.max_position,
             .max_pin_ttl_ns = KvCacheOptions{}.max_pin_ttl_ns,  // the engine keeps the default
             .limits = state->options().limits}),
      lock_gap_hook_(state->options().lock_gap_hook),
      revalidate_lock_gaps_(state->options().revalidate_lock_gaps),
      tiers_([&] {
        std::vector<TierSet*> tiers;  // by pool; null without tiers
        for (int32_t i = 0; i < state->num_pools(); ++i) tiers.push_back(state->pool(i).tiers());
        return tiers;
      }()),
      invalidations_file_(state->options().invalidations_file),
      state_(std::move(state)),
      told_seq_(static_cast<size_t>(state_->num_pools()), 1) {}

Engine::~Engine() {
  StopCompute();
  // The tier writers call back into the engine (their events): stop them while it is whole.
  for (TierSet* t : tiers_) {
    if (t != nullptr) t->Stop();
  }
}

absl::StatusOr<std::shared_ptr<const Session>> Engine::OpenSession(SessionSpec spec) {
  WriteLock lock(this);
  return state_->Open(std::move(spec));
}

std::shared_ptr<const Session> Engine::Authenticate(std::string_view token) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->FindByToken(token);
}

int64_t Engine::EndSession(SessionId id, SessionEnd how) {
  int64_t released;
  {
    WriteLock lock(this);
    released = state_->End(id, how);
  }
  if (runner_) runner_->SessionEnded(id);
  return released;
}

absl::StatusOr<PoolGrant> Engine::Grant(std::shared_ptr<const Session> session) const {
  PoolGrant grant;
  {
    absl::ReaderMutexLock lock(&mu_);
    KVPOOL_RETURN_IF_ERROR(state_->CheckLive(session->id));
    const PoolState& pool = state_->pool(session->pool);
    if (session->spec.kv_access) {
      KVPOOL_ASSIGN_OR_RETURN(grant.arena, pool.arena().Export());
      KVPOOL_ASSIGN_OR_RETURN(grant.generation_table, pool.generations().Export());
    }
    grant.daemon_version = state_->options().daemon_version;
    grant.pool = pool.name();
  }
  grant.layout = layout(session->pool);
  grant.session = std::move(session);
  grant.epoch = epoch_;
  grant.model = model_info_;
  return grant;
}

absl::Status Engine::Admit(const Session& s, const CallAsk& ask) const {
  const Verdict verdict = gate_.CheckCaller(ask, state_->FactsOf(s));
  Count(verdict.counted, state_->call_counters);
  return verdict.status;
}

absl::Status Engine::Complete(const Session& s, Fence fence, std::span<const SequenceId> created,
                              const CallContext& context) {
  InGap(LockGap::kControlWait);
  if (fence.value != 0) {
    if (absl::Status waited = device_->Synchronize(fence); !waited.ok()) {
      Log().critical("device failed, kvpoold stops serving: {}", waited.ToString());
      {
        WriteLock lock(this);
        if (state_->health.ok()) state_->health = waited;
      }
      Release(s, created);
      return DeviceError(waited);
    }
  }
  if (absl::Status gave_up = context.Check(); !gave_up.ok() && !created.empty()) {
    // The caller will never learn of these sequences: they must not outlive the call.
    Release(s, created);
    WriteLock lock(this);
    ++state_->call_counters.gave_up;
    state_->call_counters.released_on_give_up += created.size();
    return gave_up;
  }
  return absl::OkStatus();
}

void Engine::Release(const Session& s, std::span<const SequenceId> created) {
  WriteLock lock(this);
  KvCacheManager& cache = state_->pool_of(s).cache();
  for (SequenceId id : created) {
    // Gone already when the session ended meanwhile (its end released everything).
    const Sequence* seq = cache.Find(id);
    if (seq != nullptr && seq->session == s.id) KVPOOL_CHECK_OK(cache.Free(s.id, id));
  }
}

absl::StatusOr<Tables> Engine::Allocate(const Session& s, std::span<const AllocateRequest> requests,
                                        const CallContext& context,
                                        std::span<const std::string> salts) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  KVPOOL_CHECK(salts.empty() || salts.size() == requests.size());
  auto salt = [&](size_t i) {
    return salts.empty() ? std::string_view() : std::string_view(salts[i]);
  };
  // Arguments first, then who asks and what it may do, then limits (admission.h); tier work
  // only after all.
  CallAsk ask{
      .creates = true, .kv_access = true, .items = requests.size(), .sequences = requests.size()};
  for (size_t i = 0; i < requests.size(); ++i) {
    ask.salt_bytes.push_back(salt(i).size());
    ask.priorities.push_back(requests[i].priority);
  }
  KVPOOL_RETURN_IF_ERROR(gate_.CheckArguments(ask).status);
  {
    WriteLock lock(this);
    KVPOOL_RETURN_IF_ERROR(Admit(s, ask));
  }
  std::vector<PromotionHold> holds;  // what the tiers had, held for this call's sequences
  const absl::Cleanup unused = [&] {
    if (holds.empty()) return;
    WriteLock lock(this);
    for (const PromotionHold& h : holds) ReleaseHold(*state_, h, /*adopted=*/false);
  };
  if (tiers_[static_cast<size_t>(s.pool)] != nullptr) {
    for (size_t i = 0; i < requests.size(); ++i) {
      if (auto hold = LoadFromTiers(s, salt(i), requests[i].prompt, context)) {
        holds.push_back(*hold);
      }
    }
  }
  if (!holds.empty()) InGap(LockGap::kAdoption);
  Tables out;
  std::vector<SequenceId> created;
  Fence fence;
  {
    WriteLock lock(this);
    KVPOOL_RETURN_IF_ERROR(Admit(s, ask));  // again: the session may have ended meanwhile
    std::vector<AllocateRequest> items(requests.begin(), requests.end());
    for (size_t i = 0; i < items.size(); ++i) {
      KVPOOL_ASSIGN_OR_RETURN(items[i].ns, state_->SaltedNamespace(s, salt(i)));
    }
    PoolState& pool = state_->pool_of(s);
    std::vector<AllocateResult> results;
    DevicePlan plan;
    KVPOOL_RETURN_IF_ERROR(pool.cache().AllocateBatch(s.id, items, &results, &plan));
    // The new sequences matched the promoted blocks: they hold them now, the loaders can go.
    for (const PromotionHold& h : holds) ReleaseHold(*state_, h, /*adopted=*/true);
    holds.clear();
    TenantCounters& tenant = pool.tenant_counters.For(s.spec.tenant);
    for (size_t i = 0; i < results.size(); ++i) {
      created.push_back(results[i].sequence);
      tenant.prompt_tokens += items[i].prompt.size();
      tenant.hit_tokens += static_cast<uint64_t>(results[i].matched_tokens);
    }
    const absl::StatusOr<Fence> carried = pool.Carry(plan);
    if (!carried.ok()) {
      KVPOOL_CHECK_OK(pool.cache().FreeBatch(s.id, created));
      ++state_->call_counters.device_failures;
      return DeviceError(carried.status());
    }
    fence = *carried;
    for (const AllocateResult& r : results) {
      pool.AppendTable(*pool.cache().Find(r.sequence), 0, r.matched_tokens, &out);
    }
  }
  KVPOOL_RETURN_IF_ERROR(Complete(s, fence, created, context));
  return out;
}

absl::StatusOr<Tables> Engine::Grow(const Session& s, std::span<const GrowRequest> requests,
                                    const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  Tables out;
  std::vector<int64_t> old_lengths;
  std::vector<int32_t> old_window_entries;
  Fence fence;
  {
    WriteLock lock(this);
    KVPOOL_RETURN_IF_ERROR(Admit(s, {.kv_access = true, .items = requests.size()}));
    PoolState& pool = state_->pool_of(s);
    DevicePlan plan;
    std::vector<TableChange> changes;
    KVPOOL_RETURN_IF_ERROR(pool.cache().GrowBatch(s.id, requests, &plan, &changes));
    const absl::StatusOr<Fence> carried = pool.Carry(plan);
    if (!carried.ok()) {
      pool.cache().RevertGrow(s.id, changes);
      ++state_->call_counters.device_failures;
      return DeviceError(carried.status());
    }
    fence = *carried;
    out.slices.reserve(changes.size());
    out.blocks.reserve(changes.size());  // a decode step's grow: at most a block each, mostly
    out.generations.reserve(changes.size());
    old_lengths.reserve(changes.size());
    old_window_entries.reserve(changes.size());
    for (const TableChange& c : changes) {
      // (A window table that stopped short of the old length may have grown from its end.)
      const int32_t from = pool.cache().window() != nullptr
                               ? std::min(c.first_changed, c.window_entries)
                               : c.first_changed;
      pool.AppendTable(*pool.cache().Find(c.sequence), from, 0, &out);
      old_lengths.push_back(c.old_num_tokens);
      old_window_entries.push_back(c.window_entries);
    }
  }
  KVPOOL_RETURN_IF_ERROR(Complete(s, fence, {}, CallContext::Uncancellable()));
  if (absl::Status gave_up = context.Check(); !gave_up.ok()) {
    // The caller never learns of the new blocks: take the growth back (a copy-on-write copy, which
    // has run, stays in the table: it holds the same tokens as the block it replaced).
    // Only a sequence as this grow left it: after the client's own Truncate and Grow meanwhile
    // its blocks are those that call handed out (the same ids, maybe, at new generations). A
    // rewind the cache refuses (the client committed or slid its window past the old length
    // meanwhile) leaves the growth in place.
    WriteLock lock(this);
    KvCacheManager& cache = state_->pool_of(s).cache();
    size_t first = 0;
    for (size_t i = 0; i < out.slices.size(); ++i) {
      const TableSlice& slice = out.slices[i];
      const size_t n = static_cast<size_t>(slice.length);
      const Sequence* seq = cache.Find(slice.sequence);
      bool as_left = seq != nullptr && seq->session == s.id &&
                     seq->num_tokens == slice.num_tokens && old_lengths[i] < seq->num_tokens &&
                     seq->table.size() == static_cast<size_t>(slice.table_offset) + n;
      for (size_t j = 0; as_left && j < n; ++j) {
        const BlockId b = seq->table[static_cast<size_t>(slice.table_offset) + j];
        as_left =
            b == out.blocks[first + j] && cache.pool().generation(b) == out.generations[first + j];
      }
      first += n;
      if (!as_left) continue;
      if (absl::Status undone =
              cache.TakeBackGrowth(s.id, seq->id, old_lengths[i], old_window_entries[i]);
          !undone.ok()) {
        Logger("daemon").warn("sequence {}: a grow its caller gave up on stays: {}",
                              seq->id.value(), undone.message());
      }
    }
    ++state_->call_counters.gave_up;
    return gave_up;
  }
  return out;
}

absl::Status Engine::Truncate(const Session& s, SequenceId sequence, int64_t num_tokens,
                              const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  Fence fence;
  {
    WriteLock lock(this);
    KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
    PoolState& pool = state_->pool_of(s);
    // A hybrid model's rewind below the known tokens copies the checkpoint there into its state.
    DevicePlan plan;
    KVPOOL_RETURN_IF_ERROR(pool.cache().Truncate(s.id, sequence, num_tokens, &plan));
    const absl::StatusOr<Fence> carried = pool.Carry(plan);
    if (!carried.ok()) {
      KVPOOL_CHECK_OK(pool.cache().AdvanceState(s.id, sequence, -1));  // its state is undefined
      ++state_->call_counters.device_failures;
      return DeviceError(carried.status());
    }
    fence = *carried;
  }
  return Complete(s, fence, {}, CallContext::Uncancellable());
}

absl::StatusOr<Tables> Engine::Fork(const Session& s, SequenceId sequence,
                                    const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  Tables out;
  SequenceId child;
  Fence fence;
  {
    WriteLock lock(this);
    KVPOOL_RETURN_IF_ERROR(Admit(s, {.creates = true, .sequences = 1}));
    PoolState& pool = state_->pool_of(s);
    DevicePlan plan;
    KVPOOL_ASSIGN_OR_RETURN(child, pool.cache().Fork(s.id, sequence, &plan));
    const absl::StatusOr<Fence> carried = pool.Carry(plan);
    if (!carried.ok()) {
      KVPOOL_CHECK_OK(pool.cache().Free(s.id, child));
      ++state_->call_counters.device_failures;
      return DeviceError(carried.status());
    }
    fence = *carried;
    pool.AppendTable(*pool.cache().Find(child), 0, 0, &out);
  }
  KVPOOL_RETURN_IF_ERROR(Complete(s, fence, std::span(&child, 1), context));
  return out;
}

absl::Status Engine::Commit(const Session& s, SequenceId sequence, int64_t num_tokens,
                            std::span<const int32_t> new_tokens, const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  WriteLock lock(this);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {.kv_access = true}));
  PoolState& pool = state_->pool_of(s);
  KVPOOL_RETURN_IF_ERROR(pool.cache().Commit(s.id, sequence, num_tokens, new_tokens));
  // Committed tokens are computed: with a window group, the window blocks no later query reads
  // go back (the tree keeps those it just took while they are live). Cannot fail: the commit
  // checked the sequence and the length.
  KVPOOL_CHECK_OK(pool.cache().SlideWindow(s.id, sequence, num_tokens));
  pool.StagePublished();
  return absl::OkStatus();
}

absl::Status Engine::Free(const Session& s, std::span<const SequenceId> sequences, OnFree on_free,
                          const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  WriteLock lock(this);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {.items = sequences.size()}));
  PoolState& pool = state_->pool_of(s);
  KVPOOL_RETURN_IF_ERROR(pool.cache().FreeBatch(s.id, sequences, on_free));
  pool.StagePublished();
  return absl::OkStatus();
}

absl::Status Engine::FreeForStream(const Session& s, SequenceId sequence, OnFree on_free) {
  WriteLock lock(this);
  if (!state_->health.ok()) {
    return absl::UnavailableError(
        fmt::format("kvpoold stopped serving: {}", state_->health.message()));
  }
  if (!state_->CheckLive(s.id).ok()) return absl::OkStatus();
  PoolState& pool = state_->pool_of(s);
  KVPOOL_RETURN_IF_ERROR(pool.cache().Free(s.id, sequence, on_free));
  pool.StagePublished();
  return absl::OkStatus();
}

bool Engine::MayPromote(const Session& s, const CallContext& context) const {
  return state_->health.ok() && !state_->draining && state_->CheckLive(s.id).ok() &&
         !s.spec.tenant.empty() && context.Check().ok();
}

std::optional<PromotionHold> Engine::LoadFromTiers(const Session& s, std::string_view salt,
                                                   std::span<const int32_t> prompt,
                                                   const CallContext& context) {
  TierSet* const tiers = tiers_[static_cast<size_t>(s.pool)];
  if (tiers == nullptr || prompt.size() < static_cast<size_t>(layout(s.pool).block_size)) {
    return std::nullopt;
  }
  NamespaceId ns;
  {
    WriteLock lock(this);
    absl::StatusOr<NamespaceId> peeked = state_->PeekNamespace(s, salt);
    if (!MayPromote(s, context) || !peeked.ok()) return std::nullopt;
    ns = *peeked;
  }
  Promotion promotion(s.pool, ns, prompt, layout(s.pool).block_size);
  const absl::Cleanup recycle = [&] { promotion.Recycle(*tiers); };
  // An eviction that shrinks the local match during the lookup sends it round again, at most
  // this often (each round is a local match and one tier round trip).
  constexpr int kRounds = 3;
  for (int round = 0; round < kRounds; ++round) {
    {
      WriteLock lock(this);
      if (!MayPromote(s, context) || !promotion.Match(*state_)) return std::nullopt;
    }
    InGap(LockGap::kTierLookup);
    promotion.Lookup(*tiers);
    Promotion::Outcome outcome;
    {
      WriteLock lock(this);
      if (!MayPromote(s, context)) return std::nullopt;  // what the session was may be gone
      outcome = promotion.Start(*state_, *device_, revalidate_lock_gaps_);
    }
    switch (outcome) {
      case Promotion::Outcome::kNothing:
        return std::nullopt;
      case Promotion::Outcome::kFailed:
        tiers->CountPromotion(promotion.hits(), 0, 0, 0, /*failed=*/true);
        return std::nullopt;
      case Promotion::Outcome::kRaced:
        tiers->CountRaced();
        continue;
      case Promotion::Outcome::kStarted:
        return FinishPromotion(s, promotion, context);
    }
  }
  return std::nullopt;
}

std::optional<PromotionHold> Engine::FinishPromotion(const Session& s, Promotion& promotion,
                                                     const CallContext& context) {
  InGap(LockGap::kPromotionCopy);
  const absl::Status copied = promotion.Wait(*device_);
  WriteLock lock(this);
  std::optional<PromotionHold> hold = promotion.Publish(*state_, copied);
  if (hold.has_value() && !MayPromote(s, context)) {
    // The caller is gone (its session ended, it gave up, the engine drains): nothing is held for
    // it. The blocks stay published.
    ReleaseHold(*state_, *hold, /*adopted=*/false);
    return std::nullopt;
  }
  return hold;
}

void Engine::InGap(LockGap gap) const {
  if (lock_gap_hook_) lock_gap_hook_(gap);
}

absl::StatusOr<int64_t> Engine::MatchPrefix(const Session& s, std::span<const int32_t> tokens,
                                            std::string_view salt) const {
  const CallAsk ask{.salt_bytes = {salt.size()}};
  KVPOOL_RETURN_IF_ERROR(gate_.CheckArguments(ask).status);
  WriteLock lock(this);
  KVPOOL_RETURN_IF_ERROR(Admit(s, ask));
  KVPOOL_ASSIGN_OR_RETURN(const NamespaceId ns, state_->PeekNamespace(s, salt));
  return state_->pool_of(s).cache().MatchPrefix(ns, tokens);
}

namespace {

// The live pin `id` of `session` in `cache` (as ListPins(session) would list it, without a walk
// over its pins); INTERNAL if the manager just made or renewed it and lost it.
absl::StatusOr<PinInfo> FindPin(const KvCacheManager& cache, SessionId session, PinId id,
                                int64_t now_ns) {
  const PinInfo* pin = cache.FindPin(id);
  if (pin != nullptr && pin->session == session && pin->expires_ns > now_ns) return *pin;
  return absl::InternalError(fmt::format("pin {} vanished", id.value()));
}

}  // namespace

absl::StatusOr<PinInfo> Engine::PinPrefix(const Session& s, std::span<const int32_t> tokens,
                                          int64_t ttl_ns, int priority, std::string_view salt) {
  const CallAsk ask{.salt_bytes = {salt.size()}, .priorities = {priority}, .pin_ttl_ns = ttl_ns};
  KVPOOL_RETURN_IF_ERROR(gate_.CheckArguments(ask).status);
  WriteLock lock(this);
  KVPOOL_RETURN_IF_ERROR(Admit(s, ask));
  KVPOOL_ASSIGN_OR_RETURN(const NamespaceId ns, state_->SaltedNamespace(s, salt));
  KvCacheManager& cache = state_->pool_of(s).cache();
  KVPOOL_ASSIGN_OR_RETURN(const PinId id, cache.PinPrefix(s.id, ns, tokens, ttl_ns, priority));
  return FindPin(cache, s.id, id, state_->now());
}

absl::StatusOr<PinInfo> Engine::PinSequence(const Session& s, SequenceId sequence, int64_t ttl_ns,
                                            int priority) {
  const CallAsk ask{.priorities = {priority}, .pin_ttl_ns = ttl_ns};
  KVPOOL_RETURN_IF_ERROR(gate_.CheckArguments(ask).status);
  WriteLock lock(this);
  KVPOOL_RETURN_IF_ERROR(Admit(s, ask));
  KvCacheManager& cache = state_->pool_of(s).cache();
  KVPOOL_ASSIGN_OR_RETURN(const PinId id, cache.PinSequence(s.id, sequence, ttl_ns, priority));
  return FindPin(cache, s.id, id, state_->now());
}

absl::StatusOr<PinInfo> Engine::RenewPin(const Session& s, PinId pin, int64_t ttl_ns) {
  const CallAsk ask{.pin_ttl_ns = ttl_ns};
  KVPOOL_RETURN_IF_ERROR(gate_.CheckArguments(ask).status);
  WriteLock lock(this);
  KVPOOL_RETURN_IF_ERROR(Admit(s, ask));
  KvCacheManager& cache = state_->pool_of(s).cache();
  KVPOOL_RETURN_IF_ERROR(cache.RenewPin(s.id, pin, ttl_ns));
  return FindPin(cache, s.id, pin, state_->now());
}

absl::Status Engine::Unpin(const Session& s, PinId pin) {
  WriteLock lock(this);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
  return state_->pool_of(s).cache().Unpin(s.id, pin);
}

std::vector<Engine::PinListing> Engine::ListPins(SessionId session) const {
  WriteLock lock(this);
  std::vector<PinListing> out;
  for (int32_t p = 0; p < state_->num_pools(); ++p) {
    for (PinInfo& pin : state_->pool(p).cache().ListPins(session)) {
      out.push_back({.info = std::move(pin), .pool = p});
    }
  }
  return out;
}

void Engine::Submit(std::unique_ptr<ComputeCall> call) {
  if (Admit(*call)) runner_->Submit(std::move(call));
}

void Engine::SubmitOrRun(std::unique_ptr<ComputeCall> call) {
  if (Admit(*call)) runner_->SubmitOrRun(std::move(call));
}

absl::Status Engine::CheckDecodeWidth(size_t sequences) {
  if (runner_ == nullptr) return NoModelError();
  const Verdict verdict = gate_.CheckDecodeWidth(sequences);
  if (verdict.counted != Counted::kNone) {
    WriteLock lock(this);
    Count(verdict.counted, state_->call_counters);
  }
  return verdict.status;
}

absl::Status Engine::CheckStopTokens(size_t tokens) {
  const Verdict verdict = gate_.CheckStopTokens(tokens);
  if (verdict.counted != Counted::kNone) {
    WriteLock lock(this);
    Count(verdict.counted, state_->call_counters);
  }
  return verdict.status;
}

bool Engine::Admit(ComputeCall& call) {
  if (runner_ == nullptr) {
    call.result().status = NoModelError();
    call.Complete();
    return false;
  }
  if (absl::Status refused = AdmitCompute(call); !refused.ok()) {
    call.result().status = std::move(refused);
    call.Complete();
    return false;
  }
  if (call.request().creates()) {
    // Held for the call until its plan adopts the blocks (Step::PlanCall) or drops it.
    call.promotion = LoadFromTiers(call.session(), call.request().cache_salt, call.request().tokens,
                                   call.context());
    if (call.promotion.has_value()) InGap(LockGap::kAdoption);
  }
  return true;
}

absl::Status Engine::AdmitCompute(const ComputeCall& call) {
  const CallAsk ask = AdmissionGate::AskOf(call, /*queued=*/true);
  Verdict verdict = gate_.CheckArguments(ask);
  if (!verdict.ok()) return verdict.status;
  {
    absl::ReaderMutexLock lock(&mu_);
    verdict = gate_.CheckCaller(ask, state_->FactsOf(call.session()));
  }
  if (verdict.counted != Counted::kNone) {
    WriteLock lock(this);
    Count(verdict.counted, state_->call_counters);
  }
  return verdict.status;
}

void Engine::StopCompute() {
  if (runner_) runner_->Stop();
}

void Engine::RunStep(int32_t pool, std::span<ComputeCall* const> calls) {
  Step step(pool, calls, {model_info_.vocab_size, model_info_.max_position}, gate_);
  {
    WriteLock lock(this);
    step.Plan(*state_);
  }
  // The step itself, outside the lock: control calls go on meanwhile (Finish re-validates what
  // they may have changed).
  InGap(LockGap::kStepLaunch);
  const absl::Status launched = step.Launch(*model_, *clock_);
  WriteLock lock(this);
  step.Finish(*state_, launched);
}

StepExecutor& StepExecutorOf(Engine& engine) { return engine; }

void Engine::Abandon(ComputeCall& call, const absl::Status& why) {
  WriteLock lock(this);
  const bool created =
      call.request().creates() && call.progress() != nullptr &&
      call.progress()->StillHolds(state_->pool_of(call.session()).cache(), call.session().id).ok();
  Step::Abandon(*state_, call);
  call.result().status = why;
  if (absl::IsCancelled(why) || absl::IsDeadlineExceeded(why)) {
    ++state_->call_counters.gave_up;
    if (created) ++state_->call_counters.released_on_give_up;
  } else if (absl::IsNotFound(why)) {
    // Dropped from the queue as its session ended (StepRunner::SessionEnded): counted as the
    // gate counts a call that finds its session ended when its step plans it.
    ++state_->call_counters.session_ended;
  }
}

}  // namespace kvpool::daemon
