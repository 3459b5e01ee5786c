// Engine: sessions, control calls and compute submission (admin in engine_admin.cc).

#include "daemon/engine/engine.h"

#include "absl/cleanup/cleanup.h"
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

// The owner of the sequences that promote tier hits into the pool (Engine::LoadFromTiers): no
// session, so no client can see, free or end them.
constexpr SessionId kTierLoader{~uint64_t{0}};

absl::Status DeviceError(const absl::Status& s) {
  return absl::InternalError(fmt::format("device: {}", s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                                       kernels::Device* device,
                                                       model::StepModel* model) {
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
      absl::MutexLock lock(&e->mu_);
      e->state_->pool(pool).DrainTierEvents();
    });
  }
  if (model != nullptr) {
    engine->runner_ =
        std::make_unique<StepRunner>(engine.get(), static_cast<int32_t>(options.pools.size()),
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
      limits_(state->options().limits),
      tiers_([&] {
        std::vector<TierSet*> tiers;  // by pool; null without tiers
        for (int32_t i = 0; i < state->num_pools(); ++i) tiers.push_back(state->pool(i).tiers());
        return tiers;
      }()),
      state_(std::move(state)) {}

Engine::~Engine() {
  StopCompute();
  // The tier writers call back into the engine (their events): stop them while it is whole.
  for (TierSet* t : tiers_) {
    if (t != nullptr) t->Stop();
  }
}

absl::StatusOr<std::shared_ptr<const Session>> Engine::OpenSession(SessionSpec spec) {
  absl::MutexLock lock(&mu_);
  return state_->Open(std::move(spec));
}

std::shared_ptr<const Session> Engine::Authenticate(std::string_view token) const {
  absl::ReaderMutexLock lock(&mu_);
  return state_->FindByToken(token);
}

int64_t Engine::EndSession(SessionId id, SessionEnd how) {
  int64_t released;
  {
    absl::MutexLock lock(&mu_);
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

absl::Status Engine::Admit(const Session& s, Needs needs) const {
  if (!state_->health.ok()) {
    return absl::UnavailableError(
        fmt::format("kvpoold stopped serving: {}", state_->health.message()));
  }
  if (absl::Status live = state_->CheckLive(s.id); !live.ok()) {
    ++state_->call_counters.session_ended;
    return live;
  }
  if (s.spec.tenant.empty()) {
    ++state_->call_counters.not_permitted;
    return absl::PermissionDeniedError("an admin session without a tenant holds no sequences");
  }
  if (needs.kv_access && !s.spec.kv_access) {
    ++state_->call_counters.not_permitted;
    return absl::PermissionDeniedError(
        "a compute-only session may not hold blocks to write or publish KV it wrote (attach "
        "with KV access, if its tenant grants it)");
  }
  if (needs.creates && state_->draining) {
    return absl::UnavailableError("kvpoold is draining: no new sequences");
  }
  if (needs.items > static_cast<size_t>(state_->options().limits.batch_items)) {
    ++state_->call_counters.over_limit;
    return absl::ResourceExhaustedError(
        fmt::format("{} items in one call: at most {} (limits.batch_items)", needs.items,
                    state_->options().limits.batch_items));
  }
  // The pool's manager enforces this bound too; checked here first so that it is counted.
  const int64_t held = state_->pool(s.pool).cache().session_sequences(s.id);
  const int32_t max_sequences = state_->options().limits.sequences_per_session;
  if (needs.sequences > 0 && held + static_cast<int64_t>(needs.sequences) > max_sequences) {
    ++state_->call_counters.over_limit;
    return absl::ResourceExhaustedError(
        fmt::format("session {} holds {} sequences: at most {} (limits.sequences_per_session)",
                    s.id.value(), held, max_sequences));
  }
  return absl::OkStatus();
}

absl::Status Engine::Complete(const Session& s, Fence fence, std::span<const SequenceId> created,
                              const CallContext& context) {
  if (fence.value != 0) {
    if (absl::Status waited = device_->Synchronize(fence); !waited.ok()) {
      Log().critical("device failed, kvpoold stops serving: {}", waited.ToString());
      {
        absl::MutexLock lock(&mu_);
        if (state_->health.ok()) state_->health = waited;
      }
      Release(s, created);
      return DeviceError(waited);
    }
  }
  if (absl::Status gave_up = context.Check(); !gave_up.ok() && !created.empty()) {
    // The caller will never learn of these sequences: they must not outlive the call.
    Release(s, created);
    absl::MutexLock lock(&mu_);
    ++state_->call_counters.gave_up;
    state_->call_counters.released_on_give_up += created.size();
    return gave_up;
  }
  return absl::OkStatus();
}

void Engine::Release(const Session& s, std::span<const SequenceId> created) {
  absl::MutexLock lock(&mu_);
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
  std::vector<AllocateRequest> items(requests.begin(), requests.end());
  for (size_t i = 0; i < salts.size(); ++i) {
    if (salts[i].size() > kMaxCacheSaltBytes) {
      return absl::InvalidArgumentError(fmt::format("item {}: a cache salt of {} bytes: at most {}",
                                                    i, salts[i].size(), kMaxCacheSaltBytes));
    }
  }
  for (AllocateRequest& item : items) {
    if (item.priority > s.max_priority) {
      return absl::PermissionDeniedError(fmt::format("priority {} is above tenant {}'s ceiling {}",
                                                     item.priority, s.spec.tenant, s.max_priority));
    }
  }
  if (s.spec.kv_access) {  // else Admit refuses the call: it must not warm the cache either
    for (size_t i = 0; i < items.size(); ++i) {
      LoadFromTiers(s, items[i].prompt, salts.empty() ? "" : salts[i]);
    }
  }
  Tables out;
  std::vector<SequenceId> created;
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
    KVPOOL_RETURN_IF_ERROR(Admit(s, {.creates = true,
                                     .kv_access = true,
                                     .items = requests.size(),
                                     .sequences = requests.size()}));
    for (size_t i = 0; i < items.size(); ++i) {
      KVPOOL_ASSIGN_OR_RETURN(items[i].ns,
                              state_->SaltedNamespace(s, salts.empty() ? "" : salts[i]));
    }
    PoolState& pool = state_->pool_of(s);
    std::vector<AllocateResult> results;
    DevicePlan plan;
    KVPOOL_RETURN_IF_ERROR(pool.cache().AllocateBatch(s.id, items, &results, &plan));
    for (const AllocateResult& r : results) created.push_back(r.sequence);
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
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
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
    for (const TableChange& c : changes) {
      pool.AppendTable(*pool.cache().Find(c.sequence), c.first_changed, 0, &out);
      old_lengths.push_back(c.old_num_tokens);
    }
  }
  KVPOOL_RETURN_IF_ERROR(Complete(s, fence, {}, CallContext::Uncancellable()));
  if (absl::Status gave_up = context.Check(); !gave_up.ok()) {
    // The caller never learns of the new blocks: take the growth back (a copy-on-write copy, which
    // has run, stays in the table: it holds the same tokens as the block it replaced).
    absl::MutexLock lock(&mu_);
    KvCacheManager& cache = state_->pool_of(s).cache();
    for (size_t i = 0; i < out.slices.size(); ++i) {
      const Sequence* seq = cache.Find(out.slices[i].sequence);
      if (seq != nullptr && seq->session == s.id && seq->num_tokens == out.slices[i].num_tokens &&
          old_lengths[i] < seq->num_tokens) {
        KVPOOL_CHECK_OK(cache.Truncate(s.id, seq->id, old_lengths[i]));
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
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
  return state_->pool_of(s).cache().Truncate(s.id, sequence, num_tokens);
}

absl::StatusOr<Tables> Engine::Fork(const Session& s, SequenceId sequence,
                                    const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  Tables out;
  SequenceId child;
  Fence fence;
  {
    absl::MutexLock lock(&mu_);
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
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {.kv_access = true}));
  PoolState& pool = state_->pool_of(s);
  KVPOOL_RETURN_IF_ERROR(pool.cache().Commit(s.id, sequence, num_tokens, new_tokens));
  pool.StagePublished();
  return absl::OkStatus();
}

absl::Status Engine::Free(const Session& s, std::span<const SequenceId> sequences, OnFree on_free,
                          const CallContext& context) {
  KVPOOL_RETURN_IF_ERROR(context.Check());
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {.items = sequences.size()}));
  PoolState& pool = state_->pool_of(s);
  KVPOOL_RETURN_IF_ERROR(pool.cache().FreeBatch(s.id, sequences, on_free));
  pool.StagePublished();
  return absl::OkStatus();
}

namespace {

// The chained names of the prompt's first `full` blocks, as the prefix cache computes them.
std::vector<BlockHash> ChainHashes(NamespaceId ns, std::span<const int32_t> prompt, size_t full,
                                   int32_t block_size) {
  std::vector<BlockHash> chain(full);
  BlockHash parent;
  for (size_t i = 0; i < full; ++i) {
    chain[i] = parent = PrefixChainHash(parent, ns, prompt.subspan(i * block_size, block_size));
  }
  return chain;
}

// Under the engine's lock: a loader sequence over the prompt's first `upto` blocks (the cached
// ones adopted, fresh blocks for the rest) and the copies of the tier hits into the fresh ones,
// on the transfer stream after the plan's fills. Returns the loader and the copies' fence;
// errors (no room, a partly cached block, a copy not queued) leave the pool as it was.
struct Loading {
  SequenceId loader;
  Fence copied;
};
absl::StatusOr<Loading> StartPromotion(PoolState& pool, kernels::Device& device, NamespaceId ns,
                                       std::span<const int32_t> prompt, size_t local, size_t upto,
                                       const TierSet::Found& found) {
  KvCacheManager& cache = pool.cache();
  const int32_t bs = cache.block_size();
  const int64_t block_bytes = pool.layout().block_bytes();
  DevicePlan plan;
  KVPOOL_ASSIGN_OR_RETURN(const AllocateResult made,
                          cache.Allocate(kTierLoader,
                                         {.ns = ns,
                                          .num_tokens = static_cast<int64_t>(upto) * bs,
                                          .prompt = prompt.first(upto * bs)},
                                         &plan));
  if (made.matched_tokens % bs != 0) {  // a partly cached block is shared, not ours to fill
    KVPOOL_CHECK_OK(cache.Free(kTierLoader, made.sequence));
    return absl::AbortedError("a partly cached block");
  }
  absl::StatusOr<Fence> fence = pool.Carry(plan);
  const Sequence& seq = *cache.Find(made.sequence);
  std::vector<BlockId> targets;
  for (size_t i = static_cast<size_t>(made.matched_tokens / bs); fence.ok() && i < upto; ++i) {
    const BlockId block = seq.table[i];
    void* dst = static_cast<std::byte*>(pool.view().base) + block.value() * block_bytes;
    fence = device.CopyToDevice(kernels::StreamId::kTransfer, dst,
                                found.block(i - local, block_bytes).data(), block_bytes);
    targets.push_back(block);
  }
  // Whatever was queued keeps its blocks out of the free list until it has run.
  const Fence queued = fence.ok() ? *fence : device.LastFence(kernels::StreamId::kTransfer);
  if (!targets.empty()) KVPOOL_CHECK_OK(cache.MarkInFlight(targets, queued));
  if (!fence.ok()) {
    KVPOOL_CHECK_OK(cache.Free(kTierLoader, made.sequence));
    return fence.status();
  }
  return Loading{made.sequence, *fence};
}

}  // namespace

void Engine::LoadFromTiers(const Session& s, std::span<const int32_t> prompt,
                           std::string_view salt) {
  TierSet* const tiers = tiers_[static_cast<size_t>(s.pool)];
  if (tiers == nullptr) return;
  const int32_t bs = layout(s.pool).block_size;
  const size_t full = prompt.size() / static_cast<size_t>(bs);
  if (full == 0) return;
  // 1. The local match, under the lock.
  PoolState* pool;
  size_t local;
  NamespaceId ns;
  {
    absl::MutexLock lock(&mu_);
    if (!state_->health.ok() || state_->draining || !state_->CheckLive(s.id).ok() ||
        s.spec.tenant.empty()) {
      return;
    }
    absl::StatusOr<NamespaceId> peeked = state_->PeekNamespace(s, salt);
    if (!peeked.ok()) return;
    ns = *peeked;
    pool = &state_->pool_of(s);
    local = static_cast<size_t>(pool->cache().MatchPrefix(ns, prompt) / bs);
  }
  if (local >= full) return;

  // 2. The tiers, for the blocks after it, with no lock held.
  const std::vector<BlockHash> chain = ChainHashes(ns, prompt, full, bs);
  TierSet::Found found = tiers->Lookup(ns, local == 0 ? BlockHash{} : chain[local - 1],
                                       std::span(chain).subspan(local));
  const absl::Cleanup recycle = [&] { tiers->Recycle(&found); };
  if (found.hits == 0) return;
  const size_t upto = local + static_cast<size_t>(found.hits);
  const int64_t from_host = found.from_host;
  const int64_t from_remote = found.hits - found.from_host;

  // 3. The copies into fresh blocks of a loader sequence, queued under the lock.
  const int64_t started = absl::GetCurrentTimeNanos();
  absl::StatusOr<Loading> loading;
  {
    absl::MutexLock lock(&mu_);
    if (!state_->health.ok() || state_->draining || !state_->CheckLive(s.id).ok()) return;
    loading = StartPromotion(*pool, *device_, ns, prompt, local, upto, found);
  }
  if (!loading.ok()) {  // no room, a shared partial block, a copy not queued: a miss
    tiers->CountPromotion(from_host, from_remote, 0, /*failed=*/true);
    return;
  }

  // 4. Their fence, with no lock held; then the blocks are published (the prefix cache holds
  // them from here on, for this caller's Allocate and everyone else's) and the loader goes.
  const absl::Status waited = device_->Synchronize(loading->copied);
  absl::MutexLock lock(&mu_);
  KvCacheManager& cache = pool->cache();
  if (!waited.ok() || !cache.Free(kTierLoader, loading->loader, OnFree::kCommit).ok()) {
    KVPOOL_CHECK_OK(cache.Free(kTierLoader, loading->loader));
    tiers->CountPromotion(from_host, from_remote, 0, /*failed=*/true);
    return;
  }
  pool->StagePublished(std::span(chain).first(upto));  // already in a tier: not staged again
  tiers->CountPromotion(from_host, from_remote, absl::GetCurrentTimeNanos() - started, false);
  if (from_remote > 0) {  // what Redis had goes into the host tier too
    const size_t first_remote = local + static_cast<size_t>(from_host);
    tiers->KeepInHost(ns, first_remote == 0 ? BlockHash{} : chain[first_remote - 1],
                      std::span(chain).subspan(first_remote, static_cast<size_t>(from_remote)),
                      found, static_cast<size_t>(from_host));
    pool->DrainTierEvents();
  }
}

absl::StatusOr<int64_t> Engine::MatchPrefix(const Session& s, std::span<const int32_t> tokens,
                                            std::string_view salt) const {
  absl::MutexLock lock(&mu_);
  KVPOOL_ASSIGN_OR_RETURN(const NamespaceId ns, state_->PeekNamespace(s, salt));
  KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
  return state_->pool_of(s).cache().MatchPrefix(ns, tokens);
}

namespace {

// The live pin `id` of `session` in `cache`; INTERNAL if the manager just made it and lost it.
absl::StatusOr<PinInfo> FindPin(const KvCacheManager& cache, SessionId session, PinId id) {
  for (const PinInfo& pin : cache.ListPins(session)) {
    if (pin.id == id) return pin;
  }
  return absl::InternalError(fmt::format("pin {} vanished", id.value()));
}

}  // namespace

absl::Status Engine::CheckPinPriority(const Session& s, int priority) const {
  if (priority > s.max_priority) {
    ++state_->call_counters.not_permitted;
    return absl::PermissionDeniedError(fmt::format("priority {} is above tenant {}'s ceiling {}",
                                                   priority, s.spec.tenant, s.max_priority));
  }
  return absl::OkStatus();
}

absl::StatusOr<PinInfo> Engine::PinPrefix(const Session& s, std::span<const int32_t> tokens,
                                          int64_t ttl_ns, int priority, std::string_view salt) {
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(state_->PeekNamespace(s, salt).status());  // the salt's length
  KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
  KVPOOL_RETURN_IF_ERROR(CheckPinPriority(s, priority));
  KVPOOL_ASSIGN_OR_RETURN(const NamespaceId ns, state_->SaltedNamespace(s, salt));
  KvCacheManager& cache = state_->pool_of(s).cache();
  KVPOOL_ASSIGN_OR_RETURN(const PinId id, cache.PinPrefix(s.id, ns, tokens, ttl_ns, priority));
  return FindPin(cache, s.id, id);
}

absl::StatusOr<PinInfo> Engine::PinSequence(const Session& s, SequenceId sequence, int64_t ttl_ns,
                                            int priority) {
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
  KVPOOL_RETURN_IF_ERROR(CheckPinPriority(s, priority));
  KvCacheManager& cache = state_->pool_of(s).cache();
  KVPOOL_ASSIGN_OR_RETURN(const PinId id, cache.PinSequence(s.id, sequence, ttl_ns, priority));
  return FindPin(cache, s.id, id);
}

absl::StatusOr<PinInfo> Engine::RenewPin(const Session& s, PinId pin, int64_t ttl_ns) {
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
  KvCacheManager& cache = state_->pool_of(s).cache();
  KVPOOL_RETURN_IF_ERROR(cache.RenewPin(s.id, pin, ttl_ns));
  return FindPin(cache, s.id, pin);
}

absl::Status Engine::Unpin(const Session& s, PinId pin) {
  absl::MutexLock lock(&mu_);
  KVPOOL_RETURN_IF_ERROR(Admit(s, {}));
  return state_->pool_of(s).cache().Unpin(s.id, pin);
}

std::vector<Engine::PinListing> Engine::ListPins(SessionId session) const {
  absl::MutexLock lock(&mu_);
  std::vector<PinListing> out;
  for (int32_t p = 0; p < state_->num_pools(); ++p) {
    for (PinInfo& pin : state_->pool(p).cache().ListPins(session)) {
      out.push_back({.info = std::move(pin), .pool = p});
    }
  }
  return out;
}

void Engine::Submit(std::unique_ptr<ComputeCall> call) {
  if (runner_ == nullptr) {
    call->result().status =
        absl::FailedPreconditionError("kvpoold runs no model (config: model { name: \"none\" })");
    call->Complete();
    return;
  }
  if (absl::Status refused = CheckCompute(*call); !refused.ok()) {
    call->result().status = std::move(refused);
    call->Complete();
    return;
  }
  if (call->request().creates()) {
    LoadFromTiers(call->session(), call->request().tokens, call->request().cache_salt);
  }
  runner_->Submit(std::move(call));
}

absl::Status Engine::CheckCompute(const ComputeCall& call) {
  const ComputeRequest& r = call.request();
  const ClientLimits& limits = limits_;
  // Per call: a top_k no step can serve fails this call alone, not the step it would join.
  if (r.cache_salt.size() > kMaxCacheSaltBytes) {
    return absl::InvalidArgumentError(fmt::format("a cache salt of {} bytes: at most {}",
                                                  r.cache_salt.size(), kMaxCacheSaltBytes));
  }
  if (r.top_k < 0 || r.top_k > model_info_.vocab_size) {
    return absl::InvalidArgumentError(
        fmt::format("top_k {} outside [0, {}] (the vocabulary)", r.top_k, model_info_.vocab_size));
  }
  if (r.prefill() && static_cast<int64_t>(r.tokens.size()) > model_info_.max_position) {
    return absl::OutOfRangeError(
        fmt::format("a prompt of {} tokens: the model's context is {} positions", r.tokens.size(),
                    model_info_.max_position));
  }
  absl::Status over;
  if (!r.prefill() && r.decode.size() > static_cast<size_t>(limits.decode_width)) {
    over = absl::ResourceExhaustedError(
        fmt::format("a decode of {} sequences: at most {} (limits.decode_width)", r.decode.size(),
                    limits.decode_width));
  } else if (call.session().compute_calls.load(std::memory_order_relaxed) >
             limits.queued_calls_per_session) {
    over = absl::ResourceExhaustedError(
        fmt::format("session {} has {} compute calls queued or running already "
                    "(limits.queued_calls_per_session)",
                    call.session().id.value(), limits.queued_calls_per_session));
  }
  if (!over.ok()) {
    absl::MutexLock lock(&mu_);
    ++state_->call_counters.over_limit;
  }
  return over;
}

void Engine::StopCompute() {
  if (runner_) runner_->Stop();
}

void Engine::RunStep(int32_t pool, std::span<ComputeCall* const> calls) {
  Step step(pool, calls, {model_info_.vocab_size, model_info_.max_position});
  {
    absl::MutexLock lock(&mu_);
    step.Plan(*state_);
  }
  // The step itself, outside the lock: control calls go on meanwhile.
  const absl::Status launched = step.Launch(*model_, *clock_);
  absl::MutexLock lock(&mu_);
  step.Finish(*state_, launched);
}

void Engine::Abandon(ComputeCall& call, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  const bool created =
      call.request().creates() && call.progress() != nullptr &&
      call.progress()->StillHolds(state_->pool_of(call.session()).cache(), call.session().id).ok();
  Step::Abandon(*state_, call);
  call.result().status = why;
  if (absl::IsCancelled(why) || absl::IsDeadlineExceeded(why)) {
    ++state_->call_counters.gave_up;
    if (created) ++state_->call_counters.released_on_give_up;
  }
}

}  // namespace kvpool::daemon
