#pragma once

// The lower tiers' rows of the pool table (stats_table.h): each tier store's figures, labelled
// medium="host" | "disk" | "redis" and present only when the pool has that tier, then the moves
// between the device pool and the tiers. They fill GetStatsResponse.tiers as they fill every
// other output: a row's proto_field is a path below GetStatsResponse ("tiers.lookups"), and a
// path through the repeated `tiers.stores` picks the store whose `medium` is the row's label
// value (stats_proto.cc). Adding a store figure is one StoreRows line (three rows) plus the code
// that counts it.
//
// Private to stats_table.cc, which merges these rows into the pool table; header-only because
// the daemon's target list is not this module's to change.

#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "daemon/engine/engine.h"
#include "daemon/metrics/stats_table.h"

namespace kvpool::daemon::internal {

enum class TierMedium { kHost, kDisk, kRedis };

inline std::string_view TierMediumName(TierMedium m) {
  switch (m) {
    case TierMedium::kHost:
      return "host";
    case TierMedium::kDisk:
      return "disk";
    case TierMedium::kRedis:
      return "redis";
  }
  return "";
}

template <TierMedium M>
bool HasTier(const StatsSource& src) {
  const TierStats& t = src.engine->tiers;
  switch (M) {
    case TierMedium::kHost:
      return t.host;
    case TierMedium::kDisk:
      return t.disk;
    case TierMedium::kRedis:
      return t.remote;
  }
  return false;
}

inline bool HasAnyTier(const StatsSource& src) {
  const TierStats& t = src.engine->tiers;
  return t.host || t.disk || t.remote;
}

template <TierMedium M>
const tier::RemoteTierStats& StoreOf(const TierStats& t) {
  switch (M) {
    case TierMedium::kHost:
      return t.host_store;
    case TierMedium::kDisk:
      return t.disk_store;
    case TierMedium::kRedis:
      return t.remote_store;
  }
  return t.remote_store;
}

// A figure of one store: `Figure` (a member of tier::RemoteTierStats, or a function of it) of
// the store of medium `M`.
template <TierMedium M, auto Figure>
double StoreValue(const StatsSource& src) {
  return static_cast<double>(std::invoke(Figure, StoreOf<M>(src.engine->tiers)));
}

inline uint64_t DroppedWrites(const tier::RemoteTierStats& s) {
  return s.dropped_queue_full + s.dropped_over_budget + s.dropped_breaker_open +
         s.dropped_write_errors + s.dropped_shutdown;
}

// The rows of figure `F` of every store: one per medium, labelled by it.
template <auto F>
void StoreRows(std::vector<PoolRow>* rows, std::string_view name, StatKind kind,
               std::string_view unit, std::string_view help, std::string_view field) {
  rows->push_back({name,
                   kind,
                   unit,
                   help,
                   {"medium", "host"},
                   field,
                   1,
                   &StoreValue<TierMedium::kHost, F>,
                   nullptr,
                   &HasTier<TierMedium::kHost>});
  rows->push_back({name,
                   kind,
                   unit,
                   help,
                   {"medium", "disk"},
                   field,
                   1,
                   &StoreValue<TierMedium::kDisk, F>,
                   nullptr,
                   &HasTier<TierMedium::kDisk>});
  rows->push_back({name,
                   kind,
                   unit,
                   help,
                   {"medium", "redis"},
                   field,
                   1,
                   &StoreValue<TierMedium::kRedis, F>,
                   nullptr,
                   &HasTier<TierMedium::kRedis>});
}

// One row of figures only some media have (the host and disk tiers' own), present with that
// medium.
template <TierMedium M>
PoolRow MediumRow(std::string_view name, StatKind kind, std::string_view unit,
                  std::string_view help, std::string_view field,
                  double (*value)(const StatsSource&), double proto_scale = 1) {
  return {name,  kind,        unit,  help,    {"medium", TierMediumName(M)},
          field, proto_scale, value, nullptr, &HasTier<M>};
}

// A row of the moves between the pool and its tiers (present with any tier).
inline PoolRow MoveRow(std::string_view name, StatKind kind, std::string_view unit,
                       std::string_view help, StatLabel label, std::string_view field,
                       double (*value)(const StatsSource&)) {
  return {name, kind, unit, help, label, field, 1, value, nullptr, &HasAnyTier};
}

#define KVPOOL_TIER_STAT(expr)                                                  \
  +[](const StatsSource& src) -> double {                                       \
    [[maybe_unused]] const TierStats& t = src.engine->tiers;                    \
    [[maybe_unused]] const tier::DiskTierStats& d = t.disk_tier;                \
    [[maybe_unused]] const double block_tokens = src.engine->layout.block_size; \
    return static_cast<double>(expr);                                           \
  }

inline void AddStoreRows(std::vector<PoolRow>* rows) {
  StoreRows<&tier::RemoteTierStats::lookups>(rows, "tier_store_lookups", StatKind::kCounter,
                                             "calls", "Lookups asked of a tier store.",
                                             "tiers.stores.lookups");
  StoreRows<&tier::RemoteTierStats::hits>(rows, "tier_store_hits", StatKind::kCounter, "blocks",
                                          "Blocks a tier store returned.", "tiers.stores.hits");
  StoreRows<&tier::RemoteTierStats::misses>(rows, "tier_store_misses", StatKind::kCounter, "blocks",
                                            "Blocks asked of a tier store and not returned.",
                                            "tiers.stores.misses");
  StoreRows<&tier::RemoteTierStats::corrupt>(
      rows, "tier_store_corrupt", StatKind::kCounter, "blocks",
      "Values a tier store refused by a check (counted in misses).", "tiers.stores.corrupt");
  StoreRows<&tier::RemoteTierStats::forged>(
      rows, "tier_store_forged", StatKind::kCounter, "blocks",
      "Of the refused values, those whose MAC did not verify.", "tiers.stores.forged");
  StoreRows<&tier::RemoteTierStats::written>(rows, "tier_store_written", StatKind::kCounter,
                                             "blocks", "Blocks a tier store stored.",
                                             "tiers.stores.written");
  StoreRows<&tier::RemoteTierStats::already_present>(
      rows, "tier_store_already_present", StatKind::kCounter, "blocks",
      "Writes that found their key already stored.", "tiers.stores.already_present");
  StoreRows<&DroppedWrites>(rows, "tier_store_dropped", StatKind::kCounter, "blocks",
                            "Writes dropped: queue full, over a tenant's write budget, breaker "
                            "open, write errors, shutdown.",
                            "tiers.stores.dropped");
  StoreRows<&tier::RemoteTierStats::bytes_read>(rows, "tier_store_read_bytes", StatKind::kCounter,
                                                "bytes", "Payload bytes read from a tier store.",
                                                "tiers.stores.bytes_read");
  StoreRows<&tier::RemoteTierStats::bytes_written>(
      rows, "tier_store_written_bytes", StatKind::kCounter, "bytes",
      "Value bytes (header and payload) written to a tier store.", "tiers.stores.bytes_written");
  StoreRows<&tier::RemoteTierStats::queued_blocks>(
      rows, "tier_store_queued_blocks", StatKind::kGauge, "blocks",
      "Blocks waiting in a tier store's write queue.", "tiers.stores.queued_blocks");
  StoreRows<&tier::RemoteTierStats::breaker_opens>(
      rows, "tier_store_breaker_opens", StatKind::kCounter, "times",
      "Times a tier store's circuit breaker opened.", "tiers.stores.breaker_opens");
}

// The host and disk tiers' own figures: what they hold and what they dropped.
inline void AddLocalStoreRows(std::vector<PoolRow>* rows) {
  using enum TierMedium;
  const StatKind kGauge = StatKind::kGauge;
  const StatKind kCounter = StatKind::kCounter;
  rows->push_back(MediumRow<kHost>(
      "tier_store_capacity_blocks", kGauge, "blocks", "Blocks a local tier store has room for.",
      "tiers.stores.capacity_blocks", KVPOOL_TIER_STAT(t.host_capacity_blocks)));
  rows->push_back(MediumRow<kDisk>(
      "tier_store_capacity_blocks", kGauge, "blocks", "Blocks a local tier store has room for.",
      "tiers.stores.capacity_blocks", KVPOOL_TIER_STAT(d.capacity_blocks)));
  rows->push_back(MediumRow<kHost>("tier_store_blocks", kGauge, "blocks",
                                   "Blocks a local tier store holds.", "tiers.stores.blocks",
                                   KVPOOL_TIER_STAT(t.host_blocks)));
  rows->push_back(MediumRow<kDisk>("tier_store_blocks", kGauge, "blocks",
                                   "Blocks a local tier store holds.", "tiers.stores.blocks",
                                   KVPOOL_TIER_STAT(d.blocks)));
  rows->push_back(MediumRow<kHost>("tier_store_evicted", kCounter, "blocks",
                                   "Blocks a local tier store dropped to make room.",
                                   "tiers.stores.evicted", KVPOOL_TIER_STAT(t.host_evicted)));
  rows->push_back(MediumRow<kDisk>("tier_store_evicted", kCounter, "blocks",
                                   "Blocks a local tier store dropped to make room.",
                                   "tiers.stores.evicted", KVPOOL_TIER_STAT(d.evicted)));
  rows->push_back(MediumRow<kHost>("tier_store_invalidated", kCounter, "blocks",
                                   "Blocks a local tier store dropped by Invalidate.",
                                   "tiers.stores.invalidated",
                                   KVPOOL_TIER_STAT(t.host_invalidated)));
  rows->push_back(MediumRow<kDisk>("tier_store_invalidated", kCounter, "blocks",
                                   "Blocks a local tier store dropped by Invalidate.",
                                   "tiers.stores.invalidated", KVPOOL_TIER_STAT(d.invalidated)));
  // The disk tier's I/O and its index rebuilt at start.
  rows->push_back(MediumRow<kDisk>("tier_store_read_errors", kCounter, "reads",
                                   "Disk tier reads that failed (counted as misses).",
                                   "tiers.stores.read_errors", KVPOOL_TIER_STAT(d.read_errors)));
  rows->push_back(MediumRow<kDisk>("tier_store_write_errors", kCounter, "batches",
                                   "Disk tier write batches that failed.",
                                   "tiers.stores.write_errors", KVPOOL_TIER_STAT(d.write_errors)));
  rows->push_back(MediumRow<kDisk>(
      "tier_store_recovered_blocks", kGauge, "blocks", "Disk tier records kept at start.",
      "tiers.stores.recovered_blocks", KVPOOL_TIER_STAT(d.recovered_blocks)));
  rows->push_back(MediumRow<kDisk>("tier_store_scan_dropped", kGauge, "entries",
                                   "Damaged or duplicate disk index entries dropped at start.",
                                   "tiers.stores.scan_dropped", KVPOOL_TIER_STAT(d.scan_dropped)));
  rows->push_back(MediumRow<kDisk>("tier_store_scan_seconds", kGauge, "seconds",
                                   "Time the disk tier took to rebuild its index at start.",
                                   "tiers.stores.scan_ms",
                                   KVPOOL_TIER_STAT(static_cast<double>(d.scan_ns) * 1e-9), 1e3));
  rows->push_back(MediumRow<kDisk>("tier_store_direct_io", kGauge, "bool",
                                   "1 when the disk tier uses O_DIRECT.", "tiers.stores.direct_io",
                                   KVPOOL_TIER_STAT(d.direct_io)));
}

// Demotions (published blocks copied out toward the tiers) and promotions (tier hits copied
// into fresh device blocks; by tier, present with that tier).
inline void AddMoveRows(std::vector<PoolRow>* rows) {
  const StatKind kGauge = StatKind::kGauge;
  const StatKind kCounter = StatKind::kCounter;
  const StatLabel none{};
  const char* const kBytesHelp = "Bytes copied between the pool and its tiers.";
  const char* const kSecondsHelp = "Copy time between the pool and its tiers (enqueue to fence).";
  const char* const kPromotedHelp = "Tier hits copied into fresh device blocks, by tier.";
  rows->push_back(MoveRow("tier_demoted_blocks", kCounter, "blocks",
                          "Published blocks copied out of the pool toward the tiers.", none,
                          "tiers.demoted_blocks", KVPOOL_TIER_STAT(t.demoted)));
  rows->push_back(MoveRow("tier_transfer_bytes", kCounter, "bytes", kBytesHelp,
                          {"direction", "demote"}, "tiers.demoted_bytes",
                          KVPOOL_TIER_STAT(t.demoted_bytes)));
  rows->push_back(MoveRow("tier_transfer_bytes", kCounter, "bytes", kBytesHelp,
                          {"direction", "promote"}, "tiers.promoted_bytes",
                          KVPOOL_TIER_STAT(t.promoted_bytes)));
  rows->push_back(MoveRow("tier_transfer_seconds", kCounter, "seconds", kSecondsHelp,
                          {"direction", "demote"}, "",
                          KVPOOL_TIER_STAT(static_cast<double>(t.demote_ns) * 1e-9)));
  rows->push_back(MoveRow("tier_transfer_seconds", kCounter, "seconds", kSecondsHelp,
                          {"direction", "promote"}, "",
                          KVPOOL_TIER_STAT(static_cast<double>(t.promote_ns) * 1e-9)));
  rows->push_back(MoveRow("tier_demote_dropped", kCounter, "blocks",
                          "Demotions not copied: the staging bound was reached.", none,
                          "tiers.demote_dropped", KVPOOL_TIER_STAT(t.demote_dropped_full)));
  rows->push_back(MoveRow("tier_demote_failed", kCounter, "blocks",
                          "Demotion copies the device failed.", none, "tiers.demote_failed",
                          KVPOOL_TIER_STAT(t.demote_failed)));
  rows->push_back(MoveRow("tier_demote_queued", kGauge, "blocks", "Demotions staged now.", none,
                          "tiers.demote_queued", KVPOOL_TIER_STAT(t.demote_queued)));
  rows->push_back(MoveRow("tier_lookups", kCounter, "calls",
                          "Local prefix misses looked up in the tiers.", none, "tiers.lookups",
                          KVPOOL_TIER_STAT(t.lookups)));
  rows->push_back(MediumRow<TierMedium::kHost>("tier_promoted_blocks", kCounter, "blocks",
                                               kPromotedHelp, "tiers.promoted_from_host",
                                               KVPOOL_TIER_STAT(t.promoted_from_host)));
  rows->push_back(MediumRow<TierMedium::kDisk>("tier_promoted_blocks", kCounter, "blocks",
                                               kPromotedHelp, "tiers.promoted_from_disk",
                                               KVPOOL_TIER_STAT(t.promoted_from_disk)));
  rows->push_back(MediumRow<TierMedium::kRedis>("tier_promoted_blocks", kCounter, "blocks",
                                                kPromotedHelp, "tiers.promoted_from_redis",
                                                KVPOOL_TIER_STAT(t.promoted_from_remote)));
  rows->push_back(MoveRow("tier_promote_failed", kCounter, "blocks",
                          "Tier hits not promoted: no room, or a device failure.", none,
                          "tiers.promote_failed", KVPOOL_TIER_STAT(t.promote_failed)));
  rows->push_back(MoveRow("tier_promote_raced", kCounter, "calls",
                          "Tier lookups done again: an eviction shrank the local match meanwhile.",
                          none, "tiers.promote_raced", KVPOOL_TIER_STAT(t.promote_raced)));
  rows->push_back(MoveRow("tier_promotions", kCounter, "promotions",
                          "Promotions held for a call, by what became of them.",
                          {"outcome", "adopted"}, "tiers.promote_adopted",
                          KVPOOL_TIER_STAT(t.promote_adopted)));
  rows->push_back(MoveRow("tier_promotions", kCounter, "promotions",
                          "Promotions held for a call, by what became of them.",
                          {"outcome", "unused"}, "tiers.promote_unused",
                          KVPOOL_TIER_STAT(t.promote_unused)));
  rows->push_back(MoveRow("tier_lookups_truncated", kCounter, "calls",
                          "Tier lookups cut short: every lookup buffer was in use.", none,
                          "tiers.lookup_truncated", KVPOOL_TIER_STAT(t.lookup_truncated)));
  // State checkpoints beside the host tier's blocks (pools with a state group).
  rows->push_back(MoveRow("tier_checkpoints", kGauge, "checkpoints",
                          "State checkpoints the host tier holds beside its blocks.", none,
                          "tiers.host_checkpoints", KVPOOL_TIER_STAT(t.host_checkpoints)));
  rows->push_back(MoveRow("tier_checkpoint_capacity", kGauge, "checkpoints",
                          "State checkpoints the host tier has room for.", none,
                          "tiers.host_checkpoint_capacity",
                          KVPOOL_TIER_STAT(t.host_checkpoint_capacity)));
  rows->push_back(MoveRow("tier_demoted_checkpoints", kCounter, "checkpoints",
                          "State checkpoints copied out of the pool toward the host tier.", none,
                          "tiers.demoted_checkpoints", KVPOOL_TIER_STAT(t.demoted_checkpoints)));
  rows->push_back(MoveRow("tier_promoted_checkpoints", kCounter, "checkpoints",
                          "State checkpoints copied from the host tier into the pool with a "
                          "promoted prefix.",
                          none, "tiers.promoted_checkpoints",
                          KVPOOL_TIER_STAT(t.promoted_checkpoints)));
  // Window-group blocks beside the host tier's blocks (pools with a window group).
  rows->push_back(MoveRow("tier_window_blocks", kGauge, "blocks",
                          "Window-group blocks the host tier holds beside its blocks.", none,
                          "tiers.host_window_blocks", KVPOOL_TIER_STAT(t.host_window_blocks)));
  rows->push_back(MoveRow("tier_window_block_capacity", kGauge, "blocks",
                          "Window-group blocks the host tier has room for.", none,
                          "tiers.host_window_capacity", KVPOOL_TIER_STAT(t.host_window_capacity)));
  rows->push_back(MoveRow("tier_demoted_window_blocks", kCounter, "blocks",
                          "Window-group blocks copied out of the pool toward the host tier.", none,
                          "tiers.demoted_window_blocks",
                          KVPOOL_TIER_STAT(t.demoted_window_blocks)));
  rows->push_back(MoveRow("tier_promoted_window_blocks", kCounter, "blocks",
                          "Window-group blocks copied from the host tier into the pool with a "
                          "promoted prefix.",
                          none, "tiers.promoted_window_blocks",
                          KVPOOL_TIER_STAT(t.promoted_window_blocks)));
  rows->push_back(MoveRow("tier_disk_checkpoints", kGauge, "checkpoints",
                          "State checkpoints the disk tier holds beside its blocks.", none,
                          "tiers.disk_checkpoints", KVPOOL_TIER_STAT(t.disk_checkpoints)));
  rows->push_back(MoveRow("tier_disk_window_blocks", kGauge, "blocks",
                          "Window-group blocks the disk tier holds beside its blocks.", none,
                          "tiers.disk_window_blocks", KVPOOL_TIER_STAT(t.disk_window_blocks)));
}

// vLLM's connector names (the tiers as its external prefix cache), in tokens.
template <TierMedium M>
void AddExternalRows(std::vector<PoolRow>* rows) {
  rows->push_back(
      MediumRow<M>("vllm:external_prefix_cache_queries", StatKind::kCounter, "tokens",
                   "Tokens asked of a lower tier (blocks times block size), by tier.", "",
                   KVPOOL_TIER_STAT((StoreOf<M>(t).hits + StoreOf<M>(t).misses) * block_tokens)));
  rows->push_back(MediumRow<M>("vllm:external_prefix_cache_hits", StatKind::kCounter, "tokens",
                               "Tokens a lower tier returned (blocks times block size), by tier.",
                               "", KVPOOL_TIER_STAT(StoreOf<M>(t).hits * block_tokens)));
}

#undef KVPOOL_TIER_STAT

// Every tier row, built once (thread-safe: a function-local static).
inline std::span<const PoolRow> TierStatRows() {
  static const std::vector<PoolRow> rows = [] {
    std::vector<PoolRow> out;
    AddStoreRows(&out);
    AddLocalStoreRows(&out);
    AddMoveRows(&out);
    AddExternalRows<TierMedium::kHost>(&out);
    AddExternalRows<TierMedium::kDisk>(&out);
    AddExternalRows<TierMedium::kRedis>(&out);
    return out;
  }();
  return rows;
}

}  // namespace kvpool::daemon::internal
