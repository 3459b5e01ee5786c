#include "daemon/engine/engine_state.h"

#include "absl/container/flat_hash_set.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {

absl::StatusOr<std::unique_ptr<EngineState>> EngineState::Create(const EngineOptions& options,
                                                                 kernels::Device* device) {
  if (options.pools.empty()) return absl::InvalidArgumentError("the engine needs a pool");
  if (!options.tenants.empty() && !options.open_quota_blocks.empty()) {
    // One way to give a tenant a quota: a configured tenant's is its TenantLimits::quota_blocks;
    // open_quota_blocks is that same field for tenants of the zero-configuration mode.
    return absl::InvalidArgumentError(
        fmt::format("open_quota_blocks names {} tenant(s) but tenants are configured: give each "
                    "its TenantLimits::quota_blocks (config: tenants[].quota_blocks)",
                    options.open_quota_blocks.size()));
  }
  tier::DeploymentSecret secret = options.secret.value_or(tier::DeploymentSecret::Random());
  std::vector<std::unique_ptr<PoolState>> pools;
  for (const PoolOptions& pool : options.pools) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<PoolState> state,
                            PoolState::Create(pool, options, device, secret));
    pools.push_back(std::move(state));
  }
  for (const auto& [name, limits] : options.tenants) {
    if (limits.pool < 0 || limits.pool >= static_cast<int32_t>(pools.size())) {
      return absl::InvalidArgumentError(fmt::format("tenant {}: no pool {}", name, limits.pool));
    }
  }
  return std::unique_ptr<EngineState>(
      new EngineState(options, std::move(secret), std::move(pools)));
}

absl::StatusOr<int32_t> EngineState::FindPool(std::string_view name) const {
  for (int32_t i = 0; i < num_pools(); ++i) {
    if (pool(i).name() == name) return i;
  }
  return absl::NotFoundError(fmt::format("no pool '{}'", name));
}

NamespaceKey EngineState::KeyOf(const Session& s, std::string_view salt) const {
  return {.layout_hash = pool(s.pool).layout().Hash(),
          .tenant = s.spec.tenant,
          .model = s.spec.model,
          .salt = salt};
}

absl::StatusOr<TenantLimits> EngineState::LimitsOf(const std::string& tenant) const {
  if (tenant.empty()) {  // an admin-only session: it holds nothing
    return TenantLimits{.kv_access = false, .max_priority = 0};
  }
  if (options_.tenants.empty()) {
    TenantLimits limits = options_.open_tenant;
    if (auto it = options_.open_quota_blocks.find(tenant); it != options_.open_quota_blocks.end()) {
      limits.quota_blocks = it->second;
    }
    return limits;
  }
  auto it = options_.tenants.find(tenant);
  if (it == options_.tenants.end()) {
    return absl::PermissionDeniedError(fmt::format("no tenant '{}'", tenant));
  }
  return it->second;
}

namespace {

// Counting without inserting: a refused attach must leave no entry behind.
template <typename Map, typename Key>
int32_t CountOf(const Map& map, const Key& key) {
  auto it = map.find(key);
  return it == map.end() ? 0 : it->second;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Session>> EngineState::Open(SessionSpec spec) {
  absl::StatusOr<TenantLimits> limits = LimitsOf(spec.tenant);
  if (limits.ok() && spec.kv_access && !limits->kv_access) {
    limits = absl::PermissionDeniedError(
        fmt::format("tenant {} is compute-only: no KV access", spec.tenant));
  }
  if (limits.ok() && limits->max_sessions > 0 &&
      CountOf(sessions_of_tenant_, spec.tenant) >= limits->max_sessions) {
    limits = absl::ResourceExhaustedError(fmt::format(
        "tenant {} has its {} sessions attached already", spec.tenant, limits->max_sessions));
  }
  if (limits.ok() && CountOf(sessions_of_uid_, spec.uid) >= options_.limits.sessions_per_uid) {
    limits = absl::ResourceExhaustedError(
        fmt::format("uid {} has its {} sessions attached already (limits.sessions_per_uid)",
                    spec.uid, options_.limits.sessions_per_uid));
  }
  if (!limits.ok()) {
    ++session_counters.refused;
    return limits.status();
  }
  PoolState* pool = &this->pool(limits->pool);
  auto session = std::make_shared<Session>();
  session->id = SessionId(next_session_++);
  session->token = NewToken();
  session->opened_ns = now();
  session->pool = limits->pool;
  session->max_priority = limits->max_priority;
  session->quota_blocks = limits->quota_blocks;
  session->cache_weight = limits->cache_weight;
  session->spec = std::move(spec);
  session->ns = namespaces_.Acquire(KeyOf(*session, ""));
  JoinTenant(*session, session->ns);
  // The uid's sessions share one bound on block references (and so on the token lists and tables
  // they make the pool keep: forks and shared prefixes hold references, not blocks).
  const uint64_t uid_group = uint64_t{session->spec.uid} + 1;
  KVPOOL_CHECK_OK(pool->cache().SetRefGroupQuota(uid_group, options_.limits.block_refs_per_uid));
  KVPOOL_CHECK_OK(
      pool->cache().SetRefGroupStateSlots(uid_group, options_.limits.state_slots_per_uid));
  KVPOOL_CHECK_OK(pool->cache().SetSessionQuota(
      session->id, options_.session_quota_blocks > 0 ? options_.session_quota_blocks : kUnlimited,
      uid_group));
  ++sessions_of_tenant_[session->spec.tenant];
  ++sessions_of_uid_[session->spec.uid];
  live_.emplace(session->id, session);
  by_token_.emplace(session->token, session->id);
  ++session_counters.opened;
  return session;
}

absl::Status EngineState::CheckLive(SessionId id) const {
  if (live_.contains(id)) return absl::OkStatus();
  return absl::NotFoundError(fmt::format("session {} has ended", id.value()));
}

CallerFacts EngineState::FactsOf(const Session& s, absl::Status waiting) const {
  return {.session = &s,
          .serving = health,
          .live = CheckLive(s.id),
          .waiting = std::move(waiting),
          .draining = draining,
          .held_sequences = pool(s.pool).cache().session_sequences(s.id),
          .queued_calls = s.compute_calls.load(std::memory_order_relaxed)};
}

std::shared_ptr<const Session> EngineState::FindByToken(std::string_view token) const {
  auto it = by_token_.find(absl::string_view(token.data(), token.size()));
  return it == by_token_.end() ? nullptr : live_.at(it->second);
}

int64_t EngineState::End(SessionId id, SessionEnd how) {
  auto it = live_.find(id);
  if (it == live_.end()) return 0;
  const std::shared_ptr<const Session> session = it->second;
  by_token_.erase(session->token);
  live_.erase(it);
  if (--sessions_of_tenant_[session->spec.tenant] == 0) {
    sessions_of_tenant_.erase(session->spec.tenant);
  }
  if (--sessions_of_uid_[session->spec.uid] == 0) sessions_of_uid_.erase(session->spec.uid);
  KvCacheManager& cache = pool_of(*session).cache();
  const int64_t released = cache.FreeSession(id);
  // Nothing of the session is left in its namespaces: they are no longer its.
  if (auto salted = salts_.find(id); salted != salts_.end()) {
    for (const auto& [salt, ns] : salted->second) LeaveNamespace(*session, ns);
    DropSalts(*session, salted->second.size());
    salts_.erase(salted);
  }
  LeaveNamespace(*session, OwnNamespace(*session));
  own_.erase(id);
  if (auto retired = retired_.find(id); retired != retired_.end()) {
    for (NamespaceId ns : retired->second) LeaveNamespace(*session, ns);
    retired_.erase(retired);
  }
  session_counters.sequences_released += static_cast<uint64_t>(released);
  switch (how) {
    case SessionEnd::kDetached:
      ++session_counters.detached;
      break;
    case SessionEnd::kConnectionLost:
      ++session_counters.lost;
      break;
    case SessionEnd::kShutdown:
      ++session_counters.shut_down;
      break;
  }
  return released;
}

}  // namespace kvpool::daemon

namespace kvpool::daemon {

void EngineState::JoinTenant(const Session& s, NamespaceId ns) {
  if (s.spec.tenant.empty()) return;  // an admin-only session holds nothing
  KvCacheManager& cache = pool(s.pool).cache();
  const uint64_t group = namespaces_.QuotaGroup(s.spec.tenant);
  // The tenant's eviction share (fair eviction): refused only when shares are off or every share
  // is taken, and then its blocks are in the pool's default share.
  if (options_.eviction_shares > 0 && options_.prefix_cache) {
    (void)cache.SetEvictionShare(ns, group, s.cache_weight);
    // The same share in the host tier, keyed by the tenant tag its blocks carry there.
    if (TierSet* tiers = pool(s.pool).tiers()) {
      tiers->SetTenantWeight(namespaces_.TagsOf(ns).tenant, static_cast<int32_t>(s.cache_weight));
    }
  }
  if (s.quota_blocks <= 0) return;
  // Cannot fail: the quota is positive and the namespace is not 0.
  KVPOOL_CHECK_OK(cache.SetNamespaceQuota(ns, s.quota_blocks, group));
}

void EngineState::LeaveNamespace(const Session& s, NamespaceId ns) {
  // The last user gone, the namespace holds nothing of anyone's: out of its quota group and its
  // share, so that namespaces no one uses do not pile up there. (Its cached blocks stay in the
  // share they were published into.)
  if (!namespaces_.Release(ns)) return;
  KvCacheManager& cache = pool(s.pool).cache();
  if (s.quota_blocks > 0) KVPOOL_CHECK_OK(cache.SetNamespaceQuota(ns, kUnlimited));
  if (options_.eviction_shares > 0 && options_.prefix_cache && !s.spec.tenant.empty()) {
    KVPOOL_CHECK_OK(cache.SetEvictionShare(ns, 0));
  }
}

absl::StatusOr<NamespaceId> EngineState::PeekNamespace(const Session& s,
                                                       std::string_view salt) const {
  if (salt.size() > kMaxCacheSaltBytes) {
    return absl::InvalidArgumentError(
        fmt::format("a cache salt of {} bytes: at most {}", salt.size(), kMaxCacheSaltBytes));
  }
  return salt.empty() ? OwnNamespace(s) : namespaces_.Peek(KeyOf(s, salt));
}

NamespaceId EngineState::OwnNamespace(const Session& s) const {
  auto it = own_.find(s.id);
  return it == own_.end() ? s.ns : it->second;
}

absl::StatusOr<EngineState::Invalidated> EngineState::Invalidate(std::string_view tenant,
                                                                 std::string_view model) {
  if (tenant.empty()) return absl::InvalidArgumentError("invalidate: name a tenant");
  const tier::NamespaceTags tags = namespaces_.Tags(tenant, model);
  Invalidated out{
      .filter = {.tenant = tags.tenant, .any_model = model.empty(), .model = tags.model}};
  out.generation = namespaces_.Invalidate(model.empty() ? tags.tenant : tags.model);
  for (const auto& [id, session] : live_) {
    const Session& s = *session;
    if (s.spec.tenant != tenant || (!model.empty() && s.spec.model != model)) continue;
    std::vector<NamespaceId>& retired = retired_[id];
    retired.push_back(OwnNamespace(s));
    const NamespaceId fresh = namespaces_.Acquire(KeyOf(s, ""));
    JoinTenant(s, fresh);
    own_[id] = fresh;
    // Salted ones are acquired afresh at their next use.
    if (auto salted = salts_.find(id); salted != salts_.end()) {
      for (const auto& [salt, ns] : salted->second) retired.push_back(ns);
      out.namespaces += static_cast<int64_t>(salted->second.size());
      DropSalts(s, salted->second.size());
      salts_.erase(salted);
    }
    ++out.sessions;
    ++out.namespaces;
  }
  LeaveRetiredUnheld();
  return out;
}

namespace {

// Whether a session holds a namespace in its pool: a live sequence in it, or a pin over it whose
// time is not up (one whose time is up is over, as ListPins says, though no call has expired it
// yet). From the pool's books of the session (KvCacheManager::HoldingsOf): its own pins once,
// then O(1) per namespace, never a walk over the pool's sequences or pins.
class HeldBy final {
 public:
  HeldBy(const KvCacheManager& cache, SessionId session) : cache_(cache), session_(session) {
    for (const PinInfo& pin : cache.ListPins(session)) pinned_.insert(pin.ns);
  }
  bool operator()(NamespaceId ns) const {
    return cache_.HeldIn(session_, ns).sequences > 0 || pinned_.contains(ns);
  }

 private:
  const KvCacheManager& cache_;
  const SessionId session_;
  absl::flat_hash_set<NamespaceId> pinned_;
};

}  // namespace

void EngineState::LeaveRetiredUnheld() {
  // Its live sequences finish in a retired namespace, and its pins hold theirs; one it holds
  // nothing in is left now (else an idle session kept one more per invalidation, and every salt
  // it had, until it ended). A session's sequences and pins are in its own pool only.
  for (auto it = retired_.begin(); it != retired_.end();) {
    const Session& s = *live_.at(it->first);
    const HeldBy held(pool_of(s).cache(), s.id);
    std::erase_if(it->second, [&](NamespaceId ns) {
      if (held(ns)) return false;
      LeaveNamespace(s, ns);
      return true;
    });
    if (it->second.empty()) {
      retired_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<NamespaceId> EngineState::SaltedNamespace(const Session& s, std::string_view salt) {
  KVPOOL_ASSIGN_OR_RETURN(const NamespaceId peeked, PeekNamespace(s, salt));
  if (salt.empty()) return peeked;
  auto& mine = salts_[s.id];
  if (mine.contains(absl::string_view(salt.data(), salt.size()))) return peeked;
  const size_t most = static_cast<size_t>(options_.limits.cache_salts_per_session);
  const int32_t most_of_uid = options_.limits.cache_salts_per_uid;
  if (mine.size() >= most || CountOf(salts_of_uid_, s.spec.uid) >= most_of_uid) PruneSalts(s);
  if (mine.size() >= most) {
    ++call_counters.over_limit;
    return absl::ResourceExhaustedError(
        fmt::format("session {} holds sequences or pins under {} cache salts: at most {} "
                    "(limits.cache_salts_per_session)",
                    s.id.value(), mine.size(), most));
  }
  // (Only the caller's own salts are pruned: its uid's other sessions keep theirs until they
  // let go of them or end, so that a refused salt costs no walk over them.)
  if (const int32_t of_uid = CountOf(salts_of_uid_, s.spec.uid); of_uid >= most_of_uid) {
    ++call_counters.over_limit;
    return absl::ResourceExhaustedError(fmt::format(
        "the sessions of uid {} hold {} cache salts ({} of them session {}'s, each holding a "
        "sequence or pin under it): at most {} (limits.cache_salts_per_uid)",
        s.spec.uid, of_uid, mine.size(), s.id.value(), most_of_uid));
  }
  const NamespaceId ns = namespaces_.Acquire(KeyOf(s, salt));
  JoinTenant(s, ns);
  mine.emplace(std::string(salt), ns);
  ++salts_of_uid_[s.spec.uid];
  return ns;
}

absl::Status EngineState::CheckInvariants() const {
  absl::flat_hash_map<uid_t, int32_t> want;
  for (const auto& [id, salts] : salts_) {
    if (!salts.empty()) want[live_.at(id)->spec.uid] += static_cast<int32_t>(salts.size());
  }
  if (want != salts_of_uid_) {
    return InvariantViolation("{} uids hold cache salts, the books count {}", want.size(),
                              salts_of_uid_.size());
  }
  return absl::OkStatus();
}

void EngineState::DropSalts(const Session& s, size_t n) {
  if (n == 0) return;
  auto it = salts_of_uid_.find(s.spec.uid);
  KVPOOL_CHECK(it != salts_of_uid_.end() && it->second >= static_cast<int32_t>(n));
  it->second -= static_cast<int32_t>(n);
  if (it->second == 0) salts_of_uid_.erase(it);
}

void EngineState::PruneSalts(const Session& s) {
  // Costs the session's own salts and pins (a refused salt changes nothing, and must not cost
  // the other sessions a walk over the pool, under the lock they wait for).
  const HeldBy held(pool(s.pool).cache(), s.id);
  auto& mine = salts_[s.id];
  for (auto it = mine.begin(); it != mine.end();) {
    if (held(it->second)) {
      ++it;
      continue;
    }
    LeaveNamespace(s, it->second);
    mine.erase(it++);
    DropSalts(s, 1);
  }
}

}  // namespace kvpool::daemon
