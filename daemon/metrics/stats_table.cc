// The stats tables (stats_table.h): one row per figure. Keep each row's help to one line; a
// row's proto field is only for figures GetStatsResponse carried before the table existed.

#include "daemon/metrics/stats_table.h"

#include <atomic>
#include <vector>

#include "daemon/metrics/group_stat_rows.h"
#include "daemon/metrics/tier_stat_rows.h"

namespace kvpool::daemon {
namespace {

// A row's value: `expr` over `e` (the pool's EngineStats) or `src` (the StatsSource).
#define KVPOOL_STAT(expr)                                \
  +[](const StatsSource& src) -> double {                \
    [[maybe_unused]] const EngineStats& e = *src.engine; \
    return static_cast<double>(expr);                    \
  }
#define KVPOOL_STAT_IF(expr) \
  +[](const StatsSource& src) -> bool { return static_cast<bool>(src.engine->expr); }
#define KVPOOL_TENANT_STAT(expr) \
  +[](const TenantCounters& t) -> double { return static_cast<double>(t.expr); }

constexpr StatKind kCounter = StatKind::kCounter;
constexpr StatKind kGauge = StatKind::kGauge;
constexpr StatKind kHistogram = StatKind::kHistogram;
constexpr StatLabel kNoLabel{};

uint64_t Load(const std::atomic<uint64_t> AttachCounters::*field, const StatsSource& src) {
  return src.attach == nullptr ? 0 : (src.attach->*field).load(std::memory_order_relaxed);
}
uint64_t Load(const std::atomic<uint64_t> ZmqEventCounters::*field, const StatsSource& src) {
  return (src.zmq->*field).load(std::memory_order_relaxed);
}
int64_t Load(const std::atomic<int64_t> ZmqEventCounters::*field, const StatsSource& src) {
  return (src.zmq->*field).load(std::memory_order_relaxed);
}
bool HasStreams(const StatsSource& src) { return src.streams != nullptr; }
bool HasZmq(const StatsSource& src) { return src.zmq != nullptr; }

// vLLM's KV cache usage: the share of blocks not free for a new sequence without an eviction
// (held by sequences, or released and waiting for device work). Cached blocks count as free, as
// vLLM counts its evictable cached blocks.
double UsageShare(const EngineStats& e) {
  const BlockPoolStats& p = e.cache.pool;
  return p.num_blocks > 0 ? static_cast<double>(p.active + p.retiring) / p.num_blocks : 0.0;
}

bool MeasuresResidency(const StatsSource& src) {
  return src.engine->cache.pool.residency.sample_rate > 0;
}
bool HasModel(const StatsSource& src) { return !src.engine->model_info.name.empty(); }
using internal::HasStateGroup;
using internal::HasWindowGroup;
const PoolRow kPoolRows[] = {
    // Blocks and sequences (gauges): free + active + cached + retiring == num_blocks.
    {"blocks", kGauge, "blocks", "Blocks of the pool.", kNoLabel, "num_blocks", 1,
     KVPOOL_STAT(e.cache.pool.num_blocks)},
    {"free_blocks", kGauge, "blocks", "Blocks on the free list.", kNoLabel, "free_blocks", 1,
     KVPOOL_STAT(e.cache.pool.free)},
    {"active_blocks", kGauge, "blocks", "Blocks held by sequences.", kNoLabel, "active_blocks", 1,
     KVPOOL_STAT(e.cache.pool.active)},
    {"cached_blocks", kGauge, "blocks", "Blocks held only by the prefix cache (evictable).",
     kNoLabel, "cached_blocks", 1, KVPOOL_STAT(e.cache.pool.cached)},
    {"retiring_blocks", kGauge, "blocks", "Released blocks waiting for device work to finish.",
     kNoLabel, "retiring_blocks", 1, KVPOOL_STAT(e.cache.pool.retiring)},
    {"sequences", kGauge, "sequences", "Live sequences.", kNoLabel, "sequences", 1,
     KVPOOL_STAT(e.cache.sequences)},
    {"sessions_holding_sequences", kGauge, "sessions",
     "Sessions holding at least one sequence in the pool.", kNoLabel, "sessions", 1,
     KVPOOL_STAT(e.cache.sessions)},
    {"sessions_attached", kGauge, "sessions", "Sessions attached to the pool now.", kNoLabel,
     "attached_sessions", 1, KVPOOL_STAT(e.attached_sessions)},
    {"cache_nodes", kGauge, "blocks", "Blocks indexed by the prefix cache.", kNoLabel,
     "cache_nodes", 1, KVPOOL_STAT(e.cache.cache.nodes)},
    {"pins", kGauge, "pins", "Live retention pins.", kNoLabel, "pins", 1,
     KVPOOL_STAT(e.cache.pins)},
    {"pinned_blocks", kGauge, "blocks", "Distinct blocks the live pins keep.", kNoLabel,
     "pinned_blocks", 1, KVPOOL_STAT(e.cache.pinned_blocks)},
    // Pool calls and block traffic (counters).
    {"allocate_calls", kCounter, "calls", "Allocate calls.", kNoLabel, "allocate_calls", 1,
     KVPOOL_STAT(e.cache.allocate_calls)},
    {"grow_calls", kCounter, "calls", "Grow calls.", kNoLabel, "grow_calls", 1,
     KVPOOL_STAT(e.cache.grow_calls)},
    {"truncate_calls", kCounter, "calls", "Truncate calls.", kNoLabel, "truncate_calls", 1,
     KVPOOL_STAT(e.cache.truncate_calls)},
    {"fork_calls", kCounter, "calls", "Fork calls.", kNoLabel, "fork_calls", 1,
     KVPOOL_STAT(e.cache.fork_calls)},
    {"commit_calls", kCounter, "calls", "Commit calls.", kNoLabel, "commit_calls", 1,
     KVPOOL_STAT(e.cache.commit_calls)},
    {"free_calls", kCounter, "calls", "Free calls.", kNoLabel, "free_calls", 1,
     KVPOOL_STAT(e.cache.free_calls)},
    {"blocks_allocated", kCounter, "blocks", "Blocks handed out from the free list.", kNoLabel,
     "blocks_allocated", 1, KVPOOL_STAT(e.cache.pool.allocated)},
    {"blocks_freed", kCounter, "blocks", "Blocks returned to the free list.", kNoLabel,
     "blocks_freed", 1, KVPOOL_STAT(e.cache.pool.freed)},
    {"cow_copies", kCounter, "blocks", "Copy-on-write block copies planned.", kNoLabel,
     "cow_copies", 1, KVPOOL_STAT(e.cache.cow_copies)},
    {"scrubs", kCounter, "blocks", "Blocks zeroed because they changed tenant.", kNoLabel, "scrubs",
     1, KVPOOL_STAT(e.cache.pool.scrubs)},
    {"exhausted", kCounter, "calls", "Calls refused with RESOURCE_EXHAUSTED.", kNoLabel,
     "exhausted", 1, KVPOOL_STAT(e.cache.exhausted)},
    {"over_releases", kCounter, "releases", "Refused releases of unreferenced blocks (bugs).",
     kNoLabel, "over_releases", 1, KVPOOL_STAT(e.cache.pool.over_releases)},
    {"prompt_tokens", kCounter, "tokens", "Prompt tokens looked up in the prefix cache.", kNoLabel,
     "prompt_tokens", 1, KVPOOL_STAT(e.cache.prompt_tokens)},
    {"hit_tokens", kCounter, "tokens", "Prompt tokens found in the prefix cache.", kNoLabel,
     "hit_tokens", 1, KVPOOL_STAT(e.cache.hit_tokens)},
    {"missed_tokens",
     kCounter,
     "tokens",
     "Prompt tokens not found in the prefix cache, by why the match stopped.",
     {"reason", "not_cached"},
     "",
     1,
     KVPOOL_STAT(e.cache.missed_not_cached)},
    {"missed_tokens",
     kCounter,
     "tokens",
     "Prompt tokens not found in the prefix cache, by why the match stopped.",
     {"reason", "another_namespace"},
     "",
     1,
     KVPOOL_STAT(e.cache.missed_another_namespace)},
    {"missed_tokens",
     kCounter,
     "tokens",
     "Prompt tokens not found in the prefix cache, by why the match stopped.",
     {"reason", "evicted"},
     "",
     1,
     KVPOOL_STAT(e.cache.missed_evicted)},
    {"missed_tokens",
     kCounter,
     "tokens",
     "Prompt tokens not found in the prefix cache, by why the match stopped.",
     {"reason", "below_admission_bar"},
     "",
     1,
     KVPOOL_STAT(e.cache.missed_below_admission_bar)},
    {"missed_tokens",
     kCounter,
     "tokens",
     "Prompt tokens not found in the prefix cache, by why the match stopped.",
     {"reason", "coverage"},
     "",
     1,
     KVPOOL_STAT(e.cache.missed_coverage)},
    {"missed_tokens",
     kCounter,
     "tokens",
     "Prompt tokens not found in the prefix cache, by why the match stopped.",
     {"reason", "no_checkpoint"},
     "",
     1,
     KVPOOL_STAT(e.cache.missed_no_checkpoint),
     nullptr,
     &HasStateGroup},
    {"missed_tokens",
     kCounter,
     "tokens",
     "Prompt tokens not found in the prefix cache, by why the match stopped.",
     {"reason", "window_evicted"},
     "",
     1,
     KVPOOL_STAT(e.cache.missed_window_evicted),
     nullptr,
     &HasWindowGroup},
    {"evictions",
     kCounter,
     "blocks",
     "Cached blocks evicted, by reason.",
     {"reason", "capacity"},
     "evictions",
     1,
     KVPOOL_STAT(e.cache.evictions - e.cache.admin_evictions)},
    {"evictions",
     kCounter,
     "blocks",
     "Cached blocks evicted, by reason.",
     {"reason", "admin"},
     "evictions",
     1,
     KVPOOL_STAT(e.cache.admin_evictions)},
    {"pins_made", kCounter, "pins", "Retention pins made.", kNoLabel, "pins_made", 1,
     KVPOOL_STAT(e.cache.pins_made)},
    {"pins_expired", kCounter, "pins", "Retention pins that ran out of time.", kNoLabel,
     "pins_expired", 1, KVPOOL_STAT(e.cache.pins_expired)},
    {"fence_wait_seconds", kHistogram, "seconds",
     "Time released blocks spent RETIRING, waiting for device work, until reclaimed.", kNoLabel, "",
     1, nullptr, +[](const StatsSource& src) { return &src.engine->cache.pool.fence_wait; }},
    {"events_next_seq", kGauge, "events", "Sequence number the next cache event will take.",
     kNoLabel, "events_next_seq", 1, KVPOOL_STAT(e.events_next_seq)},
    // The model's steps in the pool.
    {"model_steps", kCounter, "steps", "Model steps run.", kNoLabel, "model_steps", 1,
     KVPOOL_STAT(e.model.steps), nullptr, &HasModel},
    {"model_step_sequences", kCounter, "sequences", "Sequences summed over the model steps.",
     kNoLabel, "model_step_sequences", 1, KVPOOL_STAT(e.model.step_sequences), nullptr, &HasModel},
    {"model_busy_seconds", kCounter, "seconds", "Time spent in model steps.", kNoLabel,
     "model_busy_us", 1e6, KVPOOL_STAT(static_cast<double>(e.model.busy_ns) * 1e-9), nullptr,
     &HasModel},
    {"prefill_calls", kCounter, "calls", "Prefill calls.", kNoLabel, "prefill_calls", 1,
     KVPOOL_STAT(e.model.prefill_calls), nullptr, &HasModel},
    {"prefill_tokens_computed", kCounter, "tokens", "Prompt tokens the model computed.", kNoLabel,
     "prefill_tokens_computed", 1, KVPOOL_STAT(e.model.prefill_computed), nullptr, &HasModel},
    {"prefill_tokens_reused", kCounter, "tokens", "Prompt tokens served from the prefix cache.",
     kNoLabel, "prefill_tokens_reused", 1, KVPOOL_STAT(e.model.prefill_reused), nullptr, &HasModel},
    {"prefill_chunks", kCounter, "chunks", "Prefill chunks that left tokens for a later step.",
     kNoLabel, "prefill_chunks", 1, KVPOOL_STAT(e.model.prefill_chunks), nullptr, &HasModel},
    {"decode_tokens", kCounter, "tokens", "Tokens generated by decode steps.", kNoLabel,
     "decode_tokens", 1, KVPOOL_STAT(e.model.decode_tokens), nullptr, &HasModel},
    {"step_seconds", kHistogram, "seconds", "Model time of each step.", kNoLabel, "", 1, nullptr,
     +[](const StatsSource& src) { return &src.engine->model.step_seconds; }, &HasModel},
    {"step_batch_size", kHistogram, "sequences", "Sequences in each model step.", kNoLabel, "", 1,
     nullptr, +[](const StatsSource& src) { return &src.engine->model.step_batch; }, &HasModel},
    // vLLM's names (vllm/v1/metrics/loggers.py), for dashboards and autoscalers that query them.
    {"vllm:kv_cache_usage_perc", kGauge, "ratio",
     "KV-cache usage: share of blocks held by sequences (1 = full).", kNoLabel, "", 1,
     KVPOOL_STAT(UsageShare(e))},
    // Sampled block residency (metrics.block_residency_sample), as vLLM's --kv-cache-metrics.
    {"vllm:kv_block_lifetime_seconds", kHistogram, "seconds",
     "KV cache block lifetime from hand-out to eviction (sampled).", kNoLabel, "", 1, nullptr,
     +[](const StatsSource& src) { return &src.engine->cache.pool.residency.lifetime; },
     &MeasuresResidency},
    {"vllm:kv_block_idle_before_evict_seconds", kHistogram, "seconds",
     "Idle time of a KV cache block from its last prefix hit to its eviction (sampled).", kNoLabel,
     "", 1, nullptr,
     +[](const StatsSource& src) { return &src.engine->cache.pool.residency.idle_before_evict; },
     &MeasuresResidency},
    {"vllm:kv_block_reuse_gap_seconds", kHistogram, "seconds",
     "Gaps between a KV cache block's last four prefix hits, at eviction (sampled).", kNoLabel, "",
     1, nullptr,
     +[](const StatsSource& src) { return &src.engine->cache.pool.residency.reuse_gap; },
     &MeasuresResidency},
    {"vllm:prefix_cache_queries", kCounter, "tokens",
     "Prefix cache queries: prompt tokens looked up.", kNoLabel, "", 1,
     KVPOOL_STAT(e.cache.prompt_tokens)},
    {"vllm:prefix_cache_hits", kCounter, "tokens", "Prefix cache hits: prompt tokens found.",
     kNoLabel, "", 1, KVPOOL_STAT(e.cache.hit_tokens)},
};

const PoolRow kDaemonRows[] = {
    {"uptime_seconds", kGauge, "seconds", "Time since the daemon started.", kNoLabel,
     "uptime_seconds", 1, KVPOOL_STAT(e.uptime_seconds)},
    {"draining", kGauge, "bool", "1 while the daemon drains (takes no new sequences).", kNoLabel,
     "draining", 1, KVPOOL_STAT(e.draining)},
    {"namespaces", kGauge, "namespaces", "Namespaces some session uses now.", kNoLabel, "", 1,
     KVPOOL_STAT(e.namespaces)},
    {"invalidations", kCounter, "calls", "Invalidate calls that succeeded.", kNoLabel,
     "invalidations", 1, KVPOOL_STAT(e.invalidations)},
    // Sessions.
    {"sessions_opened", kCounter, "sessions", "Attaches accepted.", kNoLabel, "sessions_opened", 1,
     KVPOOL_STAT(e.sessions.opened)},
    {"sessions_ended",
     kCounter,
     "sessions",
     "Sessions ended, by how.",
     {"how", "detached"},
     "sessions_detached",
     1,
     KVPOOL_STAT(e.sessions.detached)},
    {"sessions_ended",
     kCounter,
     "sessions",
     "Sessions ended, by how.",
     {"how", "reclaimed"},
     "sessions_reclaimed",
     1,
     KVPOOL_STAT(e.sessions.lost)},
    {"sessions_ended",
     kCounter,
     "sessions",
     "Sessions ended, by how.",
     {"how", "shut_down"},
     "sessions_shut_down",
     1,
     KVPOOL_STAT(e.sessions.shut_down)},
    {"sequences_released_on_end", kCounter, "sequences",
     "Sequences their sessions still held when they ended.", kNoLabel, "sequences_released_on_end",
     1, KVPOOL_STAT(e.sessions.sequences_released)},
    // Calls the engine refused or undid.
    {"calls_given_up", kCounter, "calls", "Calls whose caller cancelled or ran out of time.",
     kNoLabel, "calls_given_up", 1, KVPOOL_STAT(e.calls.gave_up)},
    {"sequences_released_on_give_up", kCounter, "sequences",
     "Sequences created for callers that gave up, released again.", kNoLabel,
     "sequences_released_on_give_up", 1, KVPOOL_STAT(e.calls.released_on_give_up)},
    {"calls_refused",
     kCounter,
     "calls",
     "Calls refused, by reason.",
     {"reason", "session_ended"},
     "calls_of_ended_sessions",
     1,
     KVPOOL_STAT(e.calls.session_ended)},
    {"calls_refused",
     kCounter,
     "calls",
     "Calls refused, by reason.",
     {"reason", "not_permitted"},
     "calls_not_permitted",
     1,
     KVPOOL_STAT(e.calls.not_permitted)},
    {"calls_refused",
     kCounter,
     "calls",
     "Calls refused, by reason.",
     {"reason", "over_limit"},
     "calls_over_limit",
     1,
     KVPOOL_STAT(e.calls.over_limit)},
    {"device_failures", kCounter, "calls", "Calls whose device work could not be queued.", kNoLabel,
     "device_failures", 1, KVPOOL_STAT(e.calls.device_failures)},
    // The event streams: WatchEvents followers and the ZeroMQ publisher.
    {"event_followers", kGauge, "streams", "WatchEvents streams following now.", kNoLabel, "", 1,
     KVPOOL_STAT(src.streams->followers), nullptr, &HasStreams},
    {"event_snapshots",
     kCounter,
     "snapshots",
     "WatchEvents snapshots sent, by why.",
     {"reason", "requested"},
     "",
     1,
     KVPOOL_STAT(src.streams->snapshots_requested),
     nullptr,
     &HasStreams},
    {"event_snapshots",
     kCounter,
     "snapshots",
     "WatchEvents snapshots sent, by why.",
     {"reason", "fell_behind"},
     "",
     1,
     KVPOOL_STAT(src.streams->snapshots_behind),
     nullptr,
     &HasStreams},
    {"event_follower_lag_events", kHistogram, "events",
     "Events a WatchEvents stream still had to send after each batch it was sent.", kNoLabel, "", 1,
     nullptr, +[](const StatsSource& src) { return &src.streams->follower_lag; }, &HasStreams},
    {"zmq_event_batches", kCounter, "batches", "KVEventBatch messages the ZeroMQ publisher sent.",
     kNoLabel, "", 1, KVPOOL_STAT(Load(&ZmqEventCounters::batches, src)), nullptr, &HasZmq},
    {"zmq_event_resyncs", kCounter, "batches",
     "Resync batches sent for events lost behind the event log.", kNoLabel, "", 1,
     KVPOOL_STAT(Load(&ZmqEventCounters::resyncs, src)), nullptr, &HasZmq},
    {"zmq_event_dropped", kCounter, "batches",
     "Batches published to no subscriber: the PUB socket held zmq_events.queued_bytes.", kNoLabel,
     "", 1, KVPOOL_STAT(Load(&ZmqEventCounters::dropped, src)), nullptr, &HasZmq},
    {"zmq_event_queued_bytes",
     kGauge,
     "bytes",
     "Payload bytes ZeroMQ holds for subscribers or replay peers, by socket.",
     {"socket", "pub"},
     "",
     1,
     KVPOOL_STAT(Load(&ZmqEventCounters::queued_bytes, src)),
     nullptr,
     &HasZmq},
    {"zmq_event_queued_bytes",
     kGauge,
     "bytes",
     "Payload bytes ZeroMQ holds for subscribers or replay peers, by socket.",
     {"socket", "replay"},
     "",
     1,
     KVPOOL_STAT(Load(&ZmqEventCounters::replay_queued_bytes, src)),
     nullptr,
     &HasZmq},
    {"zmq_event_send_errors", kCounter, "batches", "Batches the PUB socket refused.", kNoLabel, "",
     1, KVPOOL_STAT(Load(&ZmqEventCounters::send_errors, src)), nullptr, &HasZmq},
    {"zmq_event_replays",
     kCounter,
     "requests",
     "Replay requests, by outcome.",
     {"outcome", "answered"},
     "",
     1,
     KVPOOL_STAT(Load(&ZmqEventCounters::replays, src)),
     nullptr,
     &HasZmq},
    {"zmq_event_replays",
     kCounter,
     "requests",
     "Replay requests, by outcome.",
     {"outcome", "malformed"},
     "",
     1,
     KVPOOL_STAT(Load(&ZmqEventCounters::replays_refused, src)),
     nullptr,
     &HasZmq},
    {"zmq_event_replays",
     kCounter,
     "requests",
     "Replay requests, by outcome.",
     {"outcome", "abandoned"},
     "",
     1,
     KVPOOL_STAT(Load(&ZmqEventCounters::replays_abandoned, src)),
     nullptr,
     &HasZmq},
    // The attach socket.
    {"attach_refusals",
     kCounter,
     "attaches",
     "Attaches refused, by reason.",
     {"reason", "peer_not_allowed"},
     "attach_refused_at_accept",
     1,
     KVPOOL_STAT(Load(&AttachCounters::refused_at_accept, src))},
    {"attach_refusals",
     kCounter,
     "attaches",
     "Attaches refused, by reason.",
     {"reason", "displaced"},
     "attach_displaced",
     1,
     KVPOOL_STAT(Load(&AttachCounters::displaced, src))},
    {"attach_refusals",
     kCounter,
     "attaches",
     "Attaches refused, by reason.",
     {"reason", "timed_out"},
     "attach_timed_out",
     1,
     KVPOOL_STAT(Load(&AttachCounters::timed_out, src))},
    {"attach_refusals",
     kCounter,
     "attaches",
     "Attaches refused, by reason.",
     {"reason", "malformed"},
     "attach_malformed",
     1,
     KVPOOL_STAT(Load(&AttachCounters::malformed, src))},
    {"attach_refusals",
     kCounter,
     "attaches",
     "Attaches refused, by reason.",
     {"reason", "tenant_limits"},
     "sessions_refused",
     1,
     KVPOOL_STAT(e.sessions.refused)},
    {"attach_accept_backoffs", kCounter, "times", "Times accept ran out of descriptors.", kNoLabel,
     "attach_accept_backoffs", 1, KVPOOL_STAT(Load(&AttachCounters::accept_backoffs, src))},
    {"doorbell_calls", kCounter, "calls", "Decode calls answered through decode doorbells.",
     kNoLabel, "doorbell_calls", 1, KVPOOL_STAT(Load(&AttachCounters::doorbell_calls, src))},
    {"doorbells_refused", kCounter, "attaches",
     "Attaches that asked for a decode doorbell and got none.", kNoLabel, "doorbells_refused", 1,
     KVPOOL_STAT(Load(&AttachCounters::doorbells_refused, src))},
};

const TenantRow kTenantRows[] = {
    {"tenant_prompt_tokens", kCounter, "tokens",
     "Prompt tokens a tenant's Allocate calls looked up in the prefix cache.", kNoLabel, "", 1,
     KVPOOL_TENANT_STAT(prompt_tokens)},
    {"tenant_hit_tokens", kCounter, "tokens",
     "Prompt tokens of a tenant's Allocate calls found in the prefix cache.", kNoLabel, "", 1,
     KVPOOL_TENANT_STAT(hit_tokens)},
    {"tenant_cached_bytes", kGauge, "bytes",
     "Bytes of a tenant's evictable cached blocks and what is kept beside them (its eviction "
     "share).",
     kNoLabel, "", 1, KVPOOL_TENANT_STAT(cached_bytes)},
    {"tenant_evicted_blocks", kCounter, "blocks",
     "Cached blocks evicted from a tenant's eviction share.", kNoLabel, "", 1,
     KVPOOL_TENANT_STAT(evicted_blocks)},
    {"tenant_tier_blocks", kGauge, "blocks",
     "Blocks of a tenant's share of the host and disk tiers (their fair order).", kNoLabel, "", 1,
     KVPOOL_TENANT_STAT(tier_blocks)},
    {"tenant_tier_evicted_blocks", kCounter, "blocks",
     "Blocks evicted from a tenant's share of the host and disk tiers to make room.", kNoLabel, "",
     1, KVPOOL_TENANT_STAT(tier_evicted_blocks)},
    {"tenant_redis_bytes", kGauge, "bytes",
     "Bytes a tenant wrote to Redis within the last TTL (its share of the write budget).", kNoLabel,
     "", 1, KVPOOL_TENANT_STAT(redis_bytes)},
    {"tenant_redis_over_budget_blocks", kCounter, "blocks",
     "Blocks not written to Redis: the tenant's share of the write budget was used.", kNoLabel, "",
     1, KVPOOL_TENANT_STAT(redis_over_budget_blocks)},
};

const RpcRow kRpcRows[] = {
    {"rpcs", kCounter, "calls", "KvPool RPCs completed, by method and status code.", kNoLabel, "",
     1, +[](const RpcCounters::Entry& e) { return static_cast<double>(e.calls); }},
};

#undef KVPOOL_STAT
#undef KVPOOL_STAT_IF
#undef KVPOOL_TENANT_STAT

template <typename Source>
StatSample SampleOf(const StatRow<Source>& row, const Source& source) {
  StatSample s{.name = row.name,
               .kind = row.kind,
               .unit = row.unit,
               .help = row.help,
               .label = row.label,
               .proto_field = row.proto_field,
               .proto_scale = row.proto_scale};
  if (row.kind == StatKind::kHistogram) {
    s.histogram = row.histogram(source);
  } else {
    s.value = row.value(source);
  }
  return s;
}

bool IsVllm(std::string_view name) { return name.starts_with("vllm:"); }

}  // namespace

std::string_view StatKindName(StatKind kind) {
  switch (kind) {
    case StatKind::kCounter:
      return "counter";
    case StatKind::kGauge:
      return "gauge";
    case StatKind::kHistogram:
      return "histogram";
  }
  return "untyped";
}

std::span<const PoolRow> PoolStatRows() {
  // The pool's own rows, then its hybrid groups' (group_stat_rows.h), then its tiers'
  // (tier_stat_rows.h).
  static const std::vector<PoolRow> rows = [] {
    std::vector<PoolRow> out(std::begin(kPoolRows), std::end(kPoolRows));
    const std::span<const PoolRow> groups = internal::GroupStatRows();
    out.insert(out.end(), groups.begin(), groups.end());
    const std::span<const PoolRow> tiers = internal::TierStatRows();
    out.insert(out.end(), tiers.begin(), tiers.end());
    return out;
  }();
  return rows;
}
std::span<const PoolRow> DaemonStatRows() { return kDaemonRows; }
std::span<const TenantRow> TenantStatRows() { return kTenantRows; }
std::span<const RpcRow> RpcStatRows() { return kRpcRows; }

void ForEachStat(const StatsSource& source, bool daemon_rows,
                 const std::function<void(const StatSample&)>& fn) {
  const EngineStats& e = *source.engine;
  const std::string_view model =
      e.model_info.name.empty() ? std::string_view("none") : std::string_view(e.model_info.name);
  for (const PoolRow& row : PoolStatRows()) {
    if (row.present != nullptr && !row.present(source)) continue;
    StatSample s = SampleOf(row, source);
    s.labels.emplace_back("pool", e.pool);
    if (IsVllm(row.name)) s.labels.emplace_back("model_name", model);
    if (!row.label.name.empty()) s.labels.emplace_back(row.label.name, row.label.value);
    fn(s);
  }
  for (const auto& [tenant, counters] : e.tenants) {
    for (const TenantRow& row : kTenantRows) {
      if (row.present != nullptr && !row.present(counters)) continue;
      StatSample s = SampleOf(row, counters);
      s.labels.emplace_back("pool", e.pool);
      s.labels.emplace_back("tenant", tenant);
      if (!row.label.name.empty()) s.labels.emplace_back(row.label.name, row.label.value);
      fn(s);
    }
  }
  if (!daemon_rows) return;
  for (const PoolRow& row : kDaemonRows) {
    if (row.present != nullptr && !row.present(source)) continue;
    StatSample s = SampleOf(row, source);
    if (!row.label.name.empty()) s.labels.emplace_back(row.label.name, row.label.value);
    fn(s);
  }
  if (source.rpcs == nullptr) return;
  for (const RpcCounters::Entry& entry : source.rpcs->Snapshot()) {
    for (const RpcRow& row : kRpcRows) {
      StatSample s = SampleOf(row, entry);
      s.labels.emplace_back("method", entry.method);
      s.labels.emplace_back("code", entry.code);
      fn(s);
    }
  }
}

std::string ExportedName(std::string_view name, StatKind kind) {
  std::string out = IsVllm(name) ? std::string(name) : "kvpool_" + std::string(name);
  if (kind == StatKind::kCounter) out += "_total";
  return out;
}

}  // namespace kvpool::daemon
