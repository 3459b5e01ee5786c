#pragma once

// Engine: the daemon's pool, its sessions and its model steps, behind one coarse lock, in core
// types only (DESIGN.md §2: protobuf stops at the gRPC service and the attach server). The edges
// authenticate and translate; the engine decides.
//
// Sessions bound everything (DESIGN.md §4.7). The engine keeps the set of live sessions under its
// lock: a call of a session that has ended is refused (NOT_FOUND) before it changes anything, and
// a call that created something after its caller gave up (CallContext) releases it before it
// returns. Ending a session releases every sequence it holds (fenced) and every queued call of
// it.
//
// Control calls run in three steps: under the lock, ask the KvCacheManager, enqueue the device
// plan it returns (a queue push, never a wait) and mark the plan's blocks in flight; then, outside
// the lock, wait for that work, so when the call returns the client may write its blocks at once;
// a plan that could not be enqueued is undone at once (RevertGrow, Free), leaving the pool as it
// was (cached blocks evicted to make room stay evicted). Compute calls queue for the StepRunner,
// whose steps the engine plans and finishes under the lock and runs outside it (step.h).
//
// Cache events reach the edges through EventListeners (event_listener.h): every hold of the lock
// as writer ends by telling them of the pools whose event log grew in it, after the lock is
// released (WriteLock).
//
// Lock order: KvPoolService's writer locks -> Engine::mu_ -> the device's stream locks. The
// StepRunner's lock is never held while the engine's is taken, nor the other way round; done
// callbacks run with no lock held. listeners_mu_ is never held with mu_: the listeners run after
// mu_ is released, under listeners_mu_ as reader, and may take mu_ as reader themselves.
//
// Thread-safe.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/engine/admission.h"
#include "daemon/engine/call_context.h"
#include "daemon/engine/compute_call.h"
#include "daemon/engine/engine_options.h"
#include "daemon/engine/engine_state.h"
#include "daemon/engine/event_listener.h"
#include "daemon/engine/promotion.h"
#include "daemon/engine/session.h"
#include "daemon/engine/step_executor.h"
#include "kernels/device.h"
#include "kvpool/block_trace.h"
#include "kvpool/kv_cache_manager.h"
#include "model/step_model.h"

namespace kvpool::daemon {

struct LockOrderPeer;

class StepRunner;

// The model behind Prefill/Decode/Generate (empty name: none).
struct ModelInfo {
  std::string name;
  int32_t vocab_size = 0;
  int32_t max_position = 0;
};

// What an attached client receives. Owns its descriptors, which only a KV-access session gets.
struct PoolGrant {
  std::shared_ptr<const Session> session;
  uint64_t epoch = 0;
  std::string daemon_version;
  std::string pool;  // its pool's name
  kernels::PoolLayout layout;
  std::optional<kernels::ArenaExport> arena;  // KV access only
  UniqueFd generation_table;                  // KV access only; it cannot be mapped writable
  ModelInfo model;
};

// One pool's figures, and the engine's.
struct EngineStats {
  std::string pool;
  std::vector<std::string> pools;  // every pool's name
  KvCacheStats cache;
  int64_t attached_sessions = 0;  // sessions attached now (holding sequences or not)
  size_t namespaces = 0;          // namespaces some session uses now (every pool's)
  SessionCounters sessions;
  CallCounters calls;
  ModelCounters model;
  ModelInfo model_info;
  uint64_t events_next_seq = 0;
  uint64_t epoch = 0;
  std::string device;
  kernels::PoolLayout layout;
  double uptime_seconds = 0;
  bool draining = false;
  absl::Status health;
  TierStats tiers;  // the pool's lower tiers (tiers.host / .disk / .remote say which exist)
  uint64_t invalidations = 0;  // Invalidate calls that succeeded (every pool)
  std::vector<std::pair<std::string, TenantCounters>> tenants;  // the pool's, by tenant label
};

struct SessionListing {
  std::shared_ptr<const Session> session;
  int64_t sequences = 0;
  int64_t block_refs = 0;
  // Its tenant's quota in its pool, over all the tenant's namespaces there (in bytes in a pool
  // that charges every layer group's, KvCacheManager::QuotaOf); nullopt without one.
  std::optional<KvCacheManager::QuotaUse> quota;
  // Its tenant's eviction share in its pool (KvCacheManager::EvictionShareOf); nullopt without.
  std::optional<ShareUse> share;
};

class Engine final : private StepExecutor {
 public:
  // `device` must outlive the engine. `model` (not owned, may be null: no compute calls) runs the
  // steps; the engine starts a StepRunner for it. Errors: those of EngineState::Create.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                        kernels::Device* device,
                                                        model::StepModel* model);
  ~Engine();  // StopCompute(), then releases the pool

  // --- Sessions ---
  // Opens a session for an accepted attach. Errors: RESOURCE_EXHAUSTED (the tenant's quota needs
  // a namespace slot and none is left).
  absl::StatusOr<std::shared_ptr<const Session>> OpenSession(SessionSpec spec);
  // The live session holding `token`; null when none (unknown, or the session ended).
  std::shared_ptr<const Session> Authenticate(std::string_view token) const;
  // Ends a session: its further calls are refused, its queued calls complete with NOT_FOUND, and
  // everything it holds is released (fenced). Returns how many sequences it held; 0 when it had
  // ended already.
  int64_t EndSession(SessionId id, SessionEnd how);
  // What a client of `session` needs to map the pool. Errors: INTERNAL (export failed).
  absl::StatusOr<PoolGrant> Grant(std::shared_ptr<const Session> session) const;
  std::vector<SessionListing> ListSessions() const;

  // --- Control calls (session calls; errors as in kvpool.proto; a failed call changes nothing).
  // Whether a call is taken is the AdmissionGate's (admission.h), in one order for every call:
  // arguments, then the session's life, then permission, then limits.
  // Every call: NOT_FOUND once the session has ended, CANCELLED / DEADLINE_EXCEEDED when the caller
  // gave up before the call changed anything, UNAVAILABLE after a device failure stopped the
  // engine. Allocate and Fork also UNAVAILABLE while draining. Allocate, Grow and Commit
  // PERMISSION_DENIED for a compute-only session (they hand out blocks to write, or publish what
  // a client wrote); Allocate also for a priority above the tenant's ceiling. When the caller gives
  // up while Allocate, Fork or Grow waits for its device work, what the call made is taken back
  // (new sequences freed, grown ones rewound) and the call fails with the caller's status;
  // Truncate, Commit and Free, which create nothing, stand. ---

  // New sequences in the session's namespace, or in the namespace of `salts[i]`
  // (EngineState::SaltedNamespace; `salts` is empty or one per request; `requests[i].ns` is
  // ignored). Full tables. Also INVALID_ARGUMENT for a salt over kMaxCacheSaltBytes.
  absl::StatusOr<Tables> Allocate(const Session& s, std::span<const AllocateRequest> requests,
                                  const CallContext& context,
                                  std::span<const std::string> salts = {});
  // The changed tail of each table, in request order.
  absl::StatusOr<Tables> Grow(const Session& s, std::span<const GrowRequest> requests,
                              const CallContext& context);
  absl::Status Truncate(const Session& s, SequenceId sequence, int64_t num_tokens,
                        const CallContext& context);
  // The child's full table.
  absl::StatusOr<Tables> Fork(const Session& s, SequenceId sequence, const CallContext& context);
  absl::Status Commit(const Session& s, SequenceId sequence, int64_t num_tokens,
                      std::span<const int32_t> new_tokens, const CallContext& context);
  absl::Status Free(const Session& s, std::span<const SequenceId> sequences, OnFree on_free,
                    const CallContext& context);
  // A Generate stream's free of its own sequence as it ends (free_when_done, or one its caller
  // never learned of): the daemon's cleanup, not a call of the client's, so neither admitted nor
  // counted. Nothing is left to free once the session ended: its end released everything.
  // Errors: UNAVAILABLE (kvpoold stopped serving), NOT_FOUND (freed already).
  absl::Status FreeForStream(const Session& s, SequenceId sequence, OnFree on_free);
  absl::StatusOr<int64_t> MatchPrefix(const Session& s, std::span<const int32_t> tokens,
                                      std::string_view salt = {}) const;

  // --- Retention pins (kvpool.proto PinRequest; KvCacheManager::PinPrefix for the rules). Pins
  // live in the session's pool, in its namespace, and end with the session. A compute-only
  // session may pin (a pin hands out nothing to write); a priority above the tenant's ceiling is
  // PERMISSION_DENIED. Errors otherwise as the manager's, plus those of every session call. ---
  absl::StatusOr<PinInfo> PinPrefix(const Session& s, std::span<const int32_t> tokens,
                                    int64_t ttl_ns, int priority, std::string_view salt = {});
  absl::StatusOr<PinInfo> PinSequence(const Session& s, SequenceId sequence, int64_t ttl_ns,
                                      int priority);
  // The pin as renewed.
  absl::StatusOr<PinInfo> RenewPin(const Session& s, PinId pin, int64_t ttl_ns);
  absl::Status Unpin(const Session& s, PinId pin);
  struct PinListing {
    PinInfo info;
    int32_t pool = 0;
  };
  // The live pins of `session` (kNoSession: every session's), by pool, then id.
  std::vector<PinListing> ListPins(SessionId session) const;

  // --- Compute calls ---
  bool has_model() const { return runner_ != nullptr; }
  ModelInfo model_info() const { return model_info_; }
  // Queues a Prefill or Decode; `call->Complete()` runs exactly once with its outcome (at once,
  // with FAILED_PRECONDITION, when the engine runs no model; UNAVAILABLE after StopCompute()).
  void Submit(std::unique_ptr<ComputeCall> call);
  // Submit, except that when the model is idle the call's step runs on the calling thread, which
  // returns once the call is complete (StepRunner::SubmitOrRun). For a thread that only waits for
  // the call's answer (a decode doorbell's).
  void SubmitOrRun(std::unique_ptr<ComputeCall> call);
  // Completes every queued call with UNAVAILABLE and lets the step in progress finish.
  // Idempotent.
  void StopCompute();
  // Whether a Decode of `sequences` could be taken as far as its width goes, for an edge to ask
  // before it builds anything per sequence (the gate asks again on Submit). Errors:
  // FAILED_PRECONDITION (no model, as Submit answers), RESOURCE_EXHAUSTED (over
  // limits.decode_width; counted as the gate's refusals are).
  absl::Status CheckDecodeWidth(size_t sequences);
  // A Generate's stop tokens against limits.stop_tokens, before the stream copies them. Errors:
  // RESOURCE_EXHAUSTED (counted as the gate's refusals are).
  absl::Status CheckStopTokens(size_t tokens);

  // --- Admin --- (pools by index: FindPool)
  int32_t num_pools() const { return static_cast<int32_t>(layouts_.size()); }
  // Errors: NOT_FOUND.
  absl::StatusOr<int32_t> FindPool(std::string_view name) const;
  const kernels::PoolLayout& layout(int32_t pool = 0) const {
    return layouts_[static_cast<size_t>(pool)];
  }
  const std::string& pool_name(int32_t pool) const {
    return pool_names_[static_cast<size_t>(pool)];
  }
  uint64_t epoch() const { return epoch_; }

  EngineStats Stats(int32_t pool = 0) const;
  // Full tables of every sequence (of `session` only, unless 0) in `pool` (every pool: nullopt),
  // by id, with their owners and pools.
  Tables ListSequences(std::optional<int32_t> pool, SessionId session,
                       std::vector<SessionId>* owners, std::vector<int32_t>* pools) const;
  // A block's remembered operations, or every block's (nullopt). Errors: INVALID_ARGUMENT (no
  // such block).
  absl::StatusOr<std::vector<BlockTraceEntry>> BlockTrace(int32_t pool,
                                                          std::optional<BlockId> block) const;
  MatchExplanation Explain(int32_t pool, NamespaceId ns, std::span<const int32_t> tokens) const;
  // Evicts up to `blocks` unused cached blocks, or, with `all`, empties the prefix cache.
  // Errors: INVALID_ARGUMENT (negative count), FAILED_PRECONDITION (all, while blocks are used).
  absl::StatusOr<int64_t> Evict(int32_t pool, int64_t blocks, bool all);
  // Every pool's invariants, and that clients see every block's current generation.
  absl::Status CheckInvariants() const;
  // Waits until every block published so far reached the tiers (host stored, remote written).
  // Errors: DEADLINE_EXCEEDED.
  absl::Status FlushTiers(absl::Duration timeout) const;
  // What Invalidate did.
  struct Invalidation {
    uint64_t generation = 0;  // the tenant's (or model's) invalidation count now
    int64_t sessions = 0;     // live sessions moved to new namespace ids
    int64_t namespaces = 0;   // namespaces retired (their live sequences finish in them)
    int64_t tier_blocks = 0;  // blocks the host and disk tiers dropped (every pool)
  };
  // Drops every tier's entries of the namespaces of `tenant` (of its model `model` only, unless
  // empty), without a drain: from now on no match in any tier (device pool, host, disk, Redis)
  // finds a block cached in them before, while other tenants' blocks stay (EngineState::
  // Invalidate has the construction; docs/tiers.md, Invalidation). The host and disk tiers drop
  // theirs at once (events, counted); the device pool's and Redis's become unreachable and age
  // out. Remembered across restarts in options.invalidations_file. Errors: INVALID_ARGUMENT
  // (empty tenant, nothing changed); INTERNAL when it holds now but could not be written down
  // (a restart would forget it).
  absl::StatusOr<Invalidation> Invalidate(std::string_view tenant, std::string_view model);

  // Refuses new sequences from now on; returns how many are still live (every pool).
  int64_t Drain();
  bool draining() const;
  // OK while serving; the device failure that stopped the engine otherwise.
  absl::Status health() const;

  // A pool's cache events from `from` (EventLog::ReadFrom): false when some were dropped and the
  // consumer needs SnapshotEvents() first.
  bool ReadEvents(int32_t pool, uint64_t from, size_t max, std::vector<KvEvent>* out) const;
  std::vector<KvEvent> SnapshotEvents(int32_t pool, uint64_t* resume_seq) const;
  uint64_t next_event_seq(int32_t pool) const;
  // Adds a listener told of every pool's new events from now on (event_listener.h). Not owned:
  // it must stay until RemoveEventListener, which waits for a call of it in progress.
  // REQUIRES: not added already.
  void AddEventListener(EventListener* listener) ABSL_LOCKS_EXCLUDED(mu_, listeners_mu_);
  void RemoveEventListener(EventListener* listener) ABSL_LOCKS_EXCLUDED(mu_, listeners_mu_);

 private:
  // The StepRunner's hooks (step_executor.h), private: only the runner this engine starts holds
  // them (tests: daemon/engine/internal/step_executor_of.h).
  friend StepExecutor& StepExecutorOf(Engine& engine);
  void RunStep(int32_t pool, std::span<ComputeCall* const> calls) override;
  void Abandon(ComputeCall& call, const absl::Status& why) override;

  friend struct LockOrderPeer;  // tests/daemon/lock_order_test.cc takes the locks in order
  Engine(std::unique_ptr<EngineState> state, model::StepModel* model, ModelInfo model_info);

  // A hold of mu_ as writer (every one in the engine is one): when it ends, it releases mu_ and
  // then tells the listeners of each pool whose event log grew during it.
  class ABSL_SCOPED_LOCKABLE WriteLock {
   public:
    explicit WriteLock(const Engine* engine) ABSL_EXCLUSIVE_LOCK_FUNCTION(engine->mu_);
    ~WriteLock() ABSL_UNLOCK_FUNCTION();
    WriteLock(const WriteLock&) = delete;
    WriteLock& operator=(const WriteLock&) = delete;

   private:
    const Engine* const engine_;
  };
  // (pool, its log's next_seq) of each pool whose log grew since the last call.
  using GrownLogs = absl::InlinedVector<std::pair<int32_t, uint64_t>, 4>;
  GrownLogs TakeGrownLogs() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TellListeners(const GrownLogs& grown) const ABSL_LOCKS_EXCLUDED(mu_, listeners_mu_);

  // Under the lock, before a call changes anything: the admission gate's stages after the
  // arguments (admission.h), counted. The caller checked the arguments (gate_.CheckArguments)
  // before it took the lock.
  absl::Status Admit(const Session& s, const CallAsk& ask) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a call's device work was queued, outside the lock: waits for it; then releases the
  // sequences the call created when the wait failed or the caller gave up meanwhile.
  absl::Status Complete(const Session& s, Fence fence, std::span<const SequenceId> created,
                        const CallContext& context);
  void Release(const Session& s, std::span<const SequenceId> created);
  // Before a call that makes a sequence over `prompt` (in the namespace of `salt`), once the
  // call is admitted: promotes what the pool's tiers hold after the prompt's locally cached
  // prefix (promotion.h) and returns the hold that keeps it for the call, to release once the
  // call's allocation adopted it (ReleaseHold). Best effort: nullopt when there is nothing to
  // promote or no room, the device failed (counted), or the caller is gone.
  std::optional<PromotionHold> LoadFromTiers(const Session& s, std::string_view salt,
                                             std::span<const int32_t> prompt,
                                             const CallContext& context) ABSL_LOCKS_EXCLUDED(mu_);
  // The copy's wait and the publish of a started promotion.
  std::optional<PromotionHold> FinishPromotion(const Session& s, Promotion& promotion,
                                               const CallContext& context) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether tier work for a call of `s` is still worth doing (serving, not draining, the session
  // live, the caller waiting).
  bool MayPromote(const Session& s, const CallContext& context) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A gap between two holds of the lock: the test hook runs (EngineOptions::lock_gap_hook).
  void InGap(LockGap gap) const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a compute call may queue (admission.h, every stage). Errors: those of the gate.
  absl::Status AdmitCompute(const ComputeCall& call) ABSL_LOCKS_EXCLUDED(mu_);
  // Submit's checks before the runner sees `call`: false when it was completed at once (no model,
  // refused by admission); true when it may go to the runner (a tier promotion started for it).
  bool Admit(ComputeCall& call) ABSL_LOCKS_EXCLUDED(mu_);

  const std::vector<kernels::PoolLayout> layouts_;  // by pool
  const std::vector<std::string> pool_names_;
  const uint64_t epoch_;
  const Clock* const clock_;
  kernels::Device* const device_;
  model::StepModel* const model_;
  const ModelInfo model_info_;
  const int64_t started_ns_;
  const AdmissionGate gate_;  // every call's admission (admission.h)
  const std::function<void(LockGap)> lock_gap_hook_;
  const bool revalidate_lock_gaps_;
  // Each pool's tiers (PoolState::tiers(); null: none), fixed at creation, so calls of pools
  // without tiers skip the tier paths without taking the lock.
  const std::vector<TierSet*> tiers_;

  const std::string invalidations_file_;
  // Serializes invalidations, so the generations are written in the order they were raised.
  // Taken before mu_, never after it.
  absl::Mutex invalidation_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  const std::unique_ptr<EngineState> state_ ABSL_PT_GUARDED_BY(mu_);
  std::unique_ptr<StepRunner> runner_;  // set once in Create; null without a model
  // Each pool's log's next_seq as last told to the listeners (mutable: const calls that hold the
  // lock as writer, MatchPrefix and ListPins, may append events too).
  mutable std::vector<uint64_t> told_seq_ ABSL_GUARDED_BY(mu_);
  mutable absl::Mutex listeners_mu_;
  std::vector<EventListener*> listeners_ ABSL_GUARDED_BY(listeners_mu_);
};

}  // namespace kvpool::daemon
