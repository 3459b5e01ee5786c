#include "daemon/engine/engine_state.h"

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/status_macros.h"
#include "xxhash.h"

namespace kvpool::daemon {

absl::StatusOr<std::unique_ptr<EngineState>> EngineState::Create(const EngineOptions& options,
                                                                 kernels::Device* device) {
  if (options.pools.empty()) return absl::InvalidArgumentError("the engine needs a pool");
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

NamespaceId EngineState::NamespaceOf(const PoolState& pool, std::string_view tenant,
                                     std::string_view model) const {
  // Length-prefixed parts: no choice of tenant and model strings makes two keys collide. The
  // layout's hash keeps pools of other shapes apart (their blocks are not interchangeable).
  const std::string key = fmt::format("{}:{}{}:{}{:016x}", tenant.size(), tenant, model.size(),
                                      model, pool.layout().Hash());
  const uint64_t h = XXH3_64bits(key.data(), key.size());
  return NamespaceId(h == 0 ? 1 : h);
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

// The quota group of every namespace of `tenant` (KvCacheManager::SetNamespaceQuota): never 0.
uint64_t QuotaGroupOf(std::string_view tenant) {
  const std::string key = fmt::format("quota:{}", tenant);
  const uint64_t h = XXH3_64bits(key.data(), key.size());
  return h == 0 ? 1 : h;
}

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
  PoolState* pool = limits.ok() ? &this->pool(limits->pool) : nullptr;
  const NamespaceId ns = pool ? NamespaceOf(*pool, spec.tenant, spec.model) : NamespaceId(0);
  if (limits.ok() && limits->quota_blocks > 0) {
    if (absl::Status s =
            pool->cache().SetNamespaceQuota(ns, limits->quota_blocks, QuotaGroupOf(spec.tenant));
        !s.ok()) {
      limits = s;
    }
  }
  if (!limits.ok()) {
    ++session_counters.refused;
    return limits.status();
  }
  auto session = std::make_shared<Session>();
  session->id = SessionId(next_session_++);
  session->token = NewToken();
  session->ns = ns;
  session->opened_ns = now();
  session->pool = limits->pool;
  session->max_priority = limits->max_priority;
  session->spec = std::move(spec);
  if (options_.session_quota_blocks > 0) {
    KVPOOL_CHECK_OK(pool->cache().SetSessionQuota(session->id, options_.session_quota_blocks));
  }
  ++sessions_of_tenant_[session->spec.tenant];
  ++sessions_of_uid_[session->spec.uid];
  ++sessions_of_ns_[{session->pool, ns}];
  live_.emplace(session->id, session);
  by_token_.emplace(session->token, session->id);
  ++session_counters.opened;
  return session;
}

absl::Status EngineState::CheckLive(SessionId id) const {
  if (live_.contains(id)) return absl::OkStatus();
  return absl::NotFoundError(fmt::format("session {} has ended", id.value()));
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
  const std::pair<int32_t, NamespaceId> ns{session->pool, session->ns};
  if (--sessions_of_ns_[ns] == 0) {
    sessions_of_ns_.erase(ns);
    KVPOOL_CHECK_OK(cache.SetNamespaceQuota(session->ns, kUnlimited));  // no longer in its group
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
