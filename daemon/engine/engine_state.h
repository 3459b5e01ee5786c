#pragma once

// EngineState: everything the Engine's one coarse lock guards (LevelDB's DBImpl state to the
// Engine's DB): the pools (PoolState), the live sessions and their tenants' limits, the
// counters, and whether the engine drains or has stopped serving. Every method REQUIRES that
// lock (thread-compatible); nothing here waits for the device or for I/O.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "daemon/engine/admission.h"
#include "daemon/engine/engine_options.h"
#include "daemon/engine/namespace_table.h"
#include "daemon/engine/pool_state.h"
#include "daemon/engine/session.h"
#include "kernels/device.h"

namespace kvpool::daemon {

struct SessionCounters {
  uint64_t opened = 0;
  uint64_t detached = 0;            // ended normally (the client said goodbye)
  uint64_t lost = 0;                // reclaimed: the connection closed without a goodbye
  uint64_t shut_down = 0;           // ended by the daemon's shutdown
  uint64_t sequences_released = 0;  // sequences still held when their session ended
  uint64_t refused = 0;             // attaches the engine refused (tenant limits)
};

struct CallCounters {
  uint64_t gave_up = 0;              // calls whose caller cancelled or ran past its deadline
  uint64_t released_on_give_up = 0;  // sequences created for such callers, released again
  uint64_t session_ended = 0;        // calls refused because their session had ended
  uint64_t device_failures = 0;      // calls whose device work could not be queued (undone)
  uint64_t not_permitted = 0;        // calls beyond the session's grant (KV access, priority)
  uint64_t over_limit = 0;           // calls beyond a ClientLimits bound
};

class EngineState final {
 public:
  // Errors: INVALID_ARGUMENT (options), RESOURCE_EXHAUSTED / INTERNAL (arenas).
  static absl::StatusOr<std::unique_ptr<EngineState>> Create(const EngineOptions& options,
                                                             kernels::Device* device);

  const EngineOptions& options() const { return options_; }
  // options().secret, or the random one drawn at creation when it has none.
  const tier::DeploymentSecret& secret() const { return secret_; }
  int64_t now() const { return options_.clock->NowNanos(); }
  int32_t num_pools() const { return static_cast<int32_t>(pools_.size()); }
  PoolState& pool(int32_t i) { return *pools_[static_cast<size_t>(i)]; }
  const PoolState& pool(int32_t i) const { return *pools_[static_cast<size_t>(i)]; }
  PoolState& pool_of(const Session& s) { return pool(s.pool); }
  // The pool named `name`. Errors: NOT_FOUND.
  absl::StatusOr<int32_t> FindPool(std::string_view name) const;

  // Sessions.
  // Opens a session the attach policy accepted, within its tenant's limits. A tenant with a quota
  // has it set on the session's namespace, in the tenant's quota group: the quota bounds the sum
  // over every namespace (model) of the tenant. Errors: PERMISSION_DENIED (an unknown tenant, or
  // KV access the tenant does not grant), RESOURCE_EXHAUSTED (the tenant's session limit, the
  // uid's (ClientLimits)).
  absl::StatusOr<std::shared_ptr<const Session>> Open(SessionSpec spec);
  // NOT_FOUND when `id` is not a live session (it ended, or never was).
  absl::Status CheckLive(SessionId id) const;
  std::shared_ptr<const Session> FindByToken(std::string_view token) const;
  // Forgets the session and releases everything it holds; the last session of a namespace takes
  // the namespace out of its tenant's quota group (it holds nothing any more), so that namespaces
  // of models no one uses do not pile up. Returns how many sequences; 0 (and nothing counted)
  // when it had ended already.
  int64_t End(SessionId id, SessionEnd how);
  const absl::flat_hash_map<SessionId, std::shared_ptr<const Session>>& sessions() const {
    return live_;
  }

  // Namespaces (namespace_table.h). The namespace of `s`'s calls with cache salt `salt`
  // (kvpool.proto AllocateItem.cache_salt; empty: the session's own, s.ns). A salt's first use by
  // the session makes its namespace one of the session's: in the table, and in the tenant's
  // quota group when the tenant has a quota, until the session ends. A session that has used
  // limits.cache_salts_per_session salts, or whose uid's sessions have used
  // limits.cache_salts_per_uid, first lets go of those it holds no sequence or pin in.
  // Errors: INVALID_ARGUMENT (a salt over kMaxCacheSaltBytes), RESOURCE_EXHAUSTED (it, or its
  // uid's sessions, hold sequences or pins in that many salted namespaces); nothing has changed.
  absl::StatusOr<NamespaceId> SaltedNamespace(const Session& s, std::string_view salt);
  // The engine's own books: each uid's salt count is its sessions' salts.
  absl::Status CheckInvariants() const;
  // The namespace SaltedNamespace would give, without making it the session's (lookups).
  // Errors: INVALID_ARGUMENT (a salt over kMaxCacheSaltBytes).
  absl::StatusOr<NamespaceId> PeekNamespace(const Session& s, std::string_view salt) const;
  const NamespaceTable& namespaces() const { return namespaces_; }
  // The session's own namespace now (salt ""): s.ns until an invalidation moved it.
  NamespaceId OwnNamespace(const Session& s) const;

  // What an invalidation did.
  struct Invalidated {
    tier::TagFilter filter;   // the tiers' blocks it drops
    uint64_t generation = 0;  // the tag's generation now
    int64_t sessions = 0;     // live sessions moved to new namespace ids
    int64_t namespaces = 0;   // namespaces they held, retired (their sequences keep them)
  };
  // Invalidates every namespace of `tenant` (of its model `model` only, unless empty): raises
  // the tag's generation (NamespaceTable), so every key of it derives a new id and nothing
  // cached under the old ids is matched again, in any tier; moves the tenant's live sessions to
  // the new ids (their sequences finish in the old ones, which they hold until they end).
  // Errors: INVALID_ARGUMENT (empty tenant); nothing has changed.
  absl::StatusOr<Invalidated> Invalidate(std::string_view tenant, std::string_view model);
  // Restores the generations of earlier invalidations (a restart). REQUIRES: no session yet.
  void RestoreGenerations(absl::flat_hash_map<uint64_t, uint64_t> generations) {
    namespaces_.SetGenerations(std::move(generations));
  }

  // What the admission gate needs to know of `s` now (admission.h); `waiting` is its caller's
  // CallContext::Check() where the call waited in a queue.
  CallerFacts FactsOf(const Session& s, absl::Status waiting = absl::OkStatus()) const;

  bool draining = false;
  uint64_t invalidations = 0;  // Invalidate calls that succeeded
  SessionCounters session_counters;
  CallCounters call_counters;
  // OK while the engine serves; the device failure that stopped it otherwise.
  absl::Status health;

 private:
  EngineState(const EngineOptions& options, tier::DeploymentSecret secret,
              std::vector<std::unique_ptr<PoolState>> pools)
      : options_(options),
        secret_(std::move(secret)),
        pools_(std::move(pools)),
        namespaces_(&secret_) {}
  // The limits of `tenant`. Errors: PERMISSION_DENIED when tenants are configured and it is not.
  absl::StatusOr<TenantLimits> LimitsOf(const std::string& tenant) const;
  NamespaceKey KeyOf(const Session& s, std::string_view salt) const;
  // Puts a namespace the table has just given `s` into its tenant's quota group (none for a
  // tenant without a quota) and eviction share (EngineOptions::eviction_shares); a namespace the
  // table forgot leaves both.
  void JoinTenant(const Session& s, NamespaceId ns);
  void LeaveNamespace(const Session& s, NamespaceId ns);
  // Lets go of the salted namespaces of `s` it holds no sequence or pin in. Costs its salts and
  // pins (its pool's books of what it holds, KvCacheManager::HeldIn), never the pool's.
  void PruneSalts(const Session& s);
  // Lets go of the retired namespaces (retired_) their sessions hold no sequence or pin in. Costs
  // those namespaces and their sessions' pins, as PruneSalts.
  void LeaveRetiredUnheld();

  const EngineOptions options_;
  const tier::DeploymentSecret secret_;
  const std::vector<std::unique_ptr<PoolState>> pools_;
  NamespaceTable namespaces_;
  // The salted namespaces each session has made its own, by salt.
  absl::flat_hash_map<SessionId, absl::flat_hash_map<std::string, NamespaceId>> salts_;
  // Their count summed by peer uid (limits.cache_salts_per_uid); no entry at zero.
  absl::flat_hash_map<uid_t, int32_t> salts_of_uid_;
  // Takes `n` salts of `s` off its uid's count.
  void DropSalts(const Session& s, size_t n);
  // Sessions whose own namespace an invalidation moved: the new one (the others: Session::ns).
  absl::flat_hash_map<SessionId, NamespaceId> own_;
  // Namespaces an invalidation took from each session: held (in the table and the quota group)
  // for the sequences and pins still in them, until the session ends; those it holds nothing in
  // are let go at each invalidation (LeaveRetiredUnheld).
  absl::flat_hash_map<SessionId, std::vector<NamespaceId>> retired_;
  uint64_t next_session_ = 1;
  absl::flat_hash_map<SessionId, std::shared_ptr<const Session>> live_;
  absl::flat_hash_map<std::string, SessionId> by_token_;
  absl::flat_hash_map<std::string, int32_t> sessions_of_tenant_;
  absl::flat_hash_map<uid_t, int32_t> sessions_of_uid_;
};

}  // namespace kvpool::daemon
