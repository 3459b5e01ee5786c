#pragma once

// What an Engine is built from: plain values (the edge converts the config proto into these).

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "daemon/engine/step_scheduler.h"
#include "daemon/engine/tiers.h"
#include "kernels/plan_executor.h"
#include "kernels/pool_layout.h"
#include "kvpool/eviction_policy.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/kv_events.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/version.h"
#include "tier/secret.h"

namespace kvpool::daemon {

// The places where a call lets go of the engine's lock and takes it again (docs/threads-and-
// locks.md lists what each re-validates after the gap).
enum class LockGap : uint8_t {
  kTierLookup,     // a promotion asks the tiers (Promotion::Lookup)
  kPromotionCopy,  // a promotion waits for its copies (Promotion::Wait)
  kAdoption,       // a promotion's hold waits for its call's allocation
  kStepLaunch,     // a model step runs (Step::Launch)
  kControlWait,    // a control call waits for its device work (Engine::Complete)
};

// One pool: its own arena, block pool and prefix tree (docs/trust-model.md).
struct PoolOptions {
  std::string name = "default";
  kernels::PoolLayout layout;  // num_blocks set (LayoutForBudget)
  // Of layout.num_state_slots, those the prefix cache's state checkpoints may hold
  // (KvCacheOptions::checkpoint_slots); the others are the running sequences' working states.
  int32_t checkpoint_slots = 0;
};

// What a tenant may do and hold (docs/trust-model.md). Who may claim it is the attach policy's.
struct TenantLimits {
  bool kv_access = true;  // its sessions may ask for KV access
  // Blocks (ACTIVE, plus CACHED ones only its pins hold) summed over all its namespaces, i.e.
  // every model name its sessions claim; 0: unlimited.
  int64_t quota_blocks = 0;
  int32_t max_priority = 3;  // highest prefix-cache priority class, [0, kNumPriorities)
  int32_t max_sessions = 0;  // attached at once; 0: unlimited
  int32_t pool = 0;          // index into EngineOptions::pools
  // Its weight in fair eviction (EngineOptions::eviction_shares): under pressure, cached bytes
  // are taken from the tenant holding the most per unit of weight. [1, 1000000].
  uint32_t cache_weight = 1;
};

// What any one client may make the engine hold or wait on (config.proto Limits). Over a limit, a
// call fails with RESOURCE_EXHAUSTED and changes nothing.
struct ClientLimits {
  int32_t sessions_per_uid = 64;          // attached at once, per peer uid
  int32_t sequences_per_session = 65536;  // live, zero-token ones included
  int32_t batch_items = 4096;             // items of one Allocate, Grow or Free
  int32_t queued_calls_per_session = 64;  // Prefill/Decode calls queued or in a step
  int32_t decode_width = 512;             // sequences of one Decode
  // Cache salts one session holds sequences or pins under at once (EngineState::SaltedNamespace).
  int32_t cache_salts_per_session = 4096;
  // The same summed over the sessions of one peer uid (a salt two of them hold counts twice).
  // Each salt is a namespace, and a pool's namespace table has kMaxNamespaceSlots (65,534): one
  // uid must not be able to take them all (zero-token sequences hold one and no block, so no
  // quota stops them). Keep uids x this below the table where several uids share a pool.
  int32_t cache_salts_per_uid = 16384;
  // Block references the sessions of one peer uid hold at once, per pool. A sequence's token list
  // and table never outgrow its references (times block_size tokens), so this bounds what forks
  // and shared prefixes can make the daemon keep for one uid: 2^22 references of 16-token blocks
  // are 256 MiB of token lists.
  int64_t block_refs_per_uid = int64_t{1} << 22;
  // Stop tokens of one Generate: a stream keeps them and checks each token it yields against them.
  int32_t stop_tokens = 256;
  // State slots (one per live sequence, pools with a state group) one uid's sessions hold at
  // once, per pool; kUnlimited: every slot.
  int64_t state_slots_per_uid = kUnlimited;
};

struct EngineOptions {
  std::vector<PoolOptions> pools;     // at least one
  int32_t max_blocks_per_seq = 4096;  // bound on every block table
  int32_t trace_depth = 8;            // per-block trace entries: 0 or a power of 2
  bool prefix_cache = true;
  // Blocks between the checkpoints taken by interval (KvCacheOptions::checkpoint_interval). 0:
  // each pool's DefaultCheckpointInterval (three times its state slot bytes over its block bytes);
  // -1: none by interval.
  int32_t checkpoint_interval = 0;
  // The order cached checkpoints give way in (KvCacheOptions::checkpoint_eviction).
  KvCacheOptions::CheckpointEviction checkpoint_eviction =
      KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved;
  // Pools with a window group (PoolLayout::num_window_layers > 0): the sliding layers' window W
  // in tokens and sinks S (KvCacheOptions::window_tokens, sink_tokens; the model's).
  int32_t window_tokens = 0;
  int32_t sink_tokens = 0;
  std::string eviction_policy = std::string(kDefaultEvictionSpec);  // ParseEvictionSpec
  // Fair eviction by tenant (docs/eviction.md): tenants of a pool with a share of their own
  // (KvCacheOptions::eviction_shares), each ordered by its own instance of the policy; tenants
  // past it share the default share. 0: one pool-wide order.
  int32_t eviction_shares = 16;
  size_t event_capacity = 65536;                        // cache events kept for replay, per pool
  size_t event_capacity_bytes = kDefaultEventLogBytes;  // bytes those events may take, per pool
  kernels::FillPolicy fill_policy = kernels::FillPolicy::kNone;
  TierOptions tiers;  // lower tiers of every pool (each pool its own stores); off by default
  int64_t session_quota_blocks = 0;  // block references a session may hold; 0: unlimited
  // Tenants counted under their own name in per-tenant stats, per pool; later ones count under
  // "other" (TenantCounterTable).
  size_t max_tenant_labels = 64;
  // Share of block hand-outs followed for the residency histograms (BlockPoolOptions), [0, 1].
  double block_residency_sample = 0;
  // The configured tenants. Empty: any tenant name may be claimed, with `open_tenant`'s limits.
  absl::flat_hash_map<std::string, TenantLimits> tenants;
  TenantLimits open_tenant;
  // A tenant's quota is its TenantLimits::quota_blocks, and only that. Without `tenants`, this
  // names the quota_blocks of the tenants that claim these names (config.proto
  // tenant_quota_blocks, an alias for TenantSpec.quota_blocks in the zero-configuration mode);
  // with `tenants` it must be empty (Engine::Create: INVALID_ARGUMENT).
  absl::flat_hash_map<std::string, int64_t> open_quota_blocks;
  ClientLimits limits;
  uint64_t epoch = 1;  // this start of the daemon (stamped on events, told at attach)
  std::string daemon_version = absl::StrCat("kvpoold ", kVersion);
  const Clock* clock = Clock::Real();  // not owned; outlives the engine
  // Keys namespace ids and the tiers' keys and MACs (tier/secret.h); none: a random one.
  std::optional<tier::DeploymentSecret> secret;
  // Where invalidations are remembered across restarts (invalidations.h); empty: nowhere (a
  // restart forgets them). The edge names a file in the disk tier's directory.
  std::string invalidations_file;

  // Tests only. Runs in every lock gap, on the calling thread, with no lock held: a test holds a
  // gap open there (a latch) or changes the pool in it (an eviction), deterministically.
  std::function<void(LockGap)> lock_gap_hook;
  // Tests only: false skips the re-validation after a gap, to show that a test catches the race.
  bool revalidate_lock_gaps = true;

  // Model steps (when the engine runs a model).
  std::string model_name;                // reported at attach and in stats
  int64_t gather_window_ns = 2'000'000;  // how long a step waits for the previous step's sessions
  SchedulerOptions scheduler;
};

}  // namespace kvpool::daemon
