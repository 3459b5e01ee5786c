#pragma once

// The hybrid layer groups' rows of the pool table (stats_table.h; docs/hybrid-groups.md): the
// state group's slots and checkpoints, present only with a state group, and the window group's
// blocks and the window blocks the prefix cache keeps, present only with a window group. A
// pool without either exports none of them (no series stuck at zero).
//
// Private to stats_table.cc, which merges these rows into the pool table; header-only because
// the daemon's target list is not this module's to change.

#include <initializer_list>
#include <span>
#include <string_view>
#include <vector>

#include "daemon/engine/engine.h"
#include "daemon/metrics/stats_table.h"

namespace kvpool::daemon::internal {

inline bool HasStateGroup(const StatsSource& src) {
  return src.engine->cache.states.num_blocks > 0;
}
inline bool HasWindowGroup(const StatsSource& src) {
  return src.engine->cache.window.num_blocks > 0;
}

// One row of a family: its label's value and its figure.
struct GroupFigure {
  std::string_view label_value;
  double (*value)(const StatsSource&);
};

// The rows of family `name`, one per figure, labelled `label`, all present when `present`.
inline void GroupRows(std::vector<PoolRow>* rows, std::string_view name, StatKind kind,
                      std::string_view unit, std::string_view help, std::string_view label,
                      std::initializer_list<GroupFigure> figures,
                      bool (*present)(const StatsSource&)) {
  for (const GroupFigure& f : figures) {
    rows->push_back(
        {name, kind, unit, help, {label, f.label_value}, "", 1, f.value, nullptr, present});
  }
}

// A figure of the pool's KvCacheStats.
#define KVPOOL_CACHE_STAT(expr) \
  +[](const StatsSource& src) -> double { return static_cast<double>(src.engine->cache.expr); }

inline void AddStateRows(std::vector<PoolRow>* rows) {
  // One slot per live sequence (its working state), plus the prefix cache's checkpoints.
  GroupRows(rows, "state_slots", StatKind::kGauge, "slots",
            "State slots of the pool's state group, by state.", "state",
            {{"free", KVPOOL_CACHE_STAT(states.free)},
             {"active", KVPOOL_CACHE_STAT(states.active)},
             {"retiring", KVPOOL_CACHE_STAT(states.retiring)},
             {"cached", KVPOOL_CACHE_STAT(states.cached)}},
            &HasStateGroup);
  GroupRows(rows, "state_checkpoints", StatKind::kCounter, "checkpoints",
            "State checkpoints of the prefix cache, by event.", "event",
            {{"kept", KVPOOL_CACHE_STAT(checkpoints.kept)},
             {"resumed", KVPOOL_CACHE_STAT(checkpoints.resumed)},
             {"evicted", KVPOOL_CACHE_STAT(checkpoints.evicted)},
             {"skipped", KVPOOL_CACHE_STAT(checkpoints.skipped)},
             {"redundant", KVPOOL_CACHE_STAT(checkpoints.redundant)},
             {"rolled", KVPOOL_CACHE_STAT(checkpoints.rolled)}},
            &HasStateGroup);
#define KVPOOL_RESUME_RATE(kind) \
  KVPOOL_CACHE_STAT(checkpoints.resume_rate[static_cast<size_t>(CheckpointKind::kind)])
  GroupRows(rows, "state_checkpoint_resume_rate", StatKind::kGauge, "resumes per checkpoint",
            "Resumes per state checkpoint kept, by why it was taken (decayed).", "kind",
            {{"interval", KVPOOL_RESUME_RATE(kInterval)},
             {"branch", KVPOOL_RESUME_RATE(kBranch)},
             {"prefill_end", KVPOOL_RESUME_RATE(kPrefillEnd)},
             {"sequence_end", KVPOOL_RESUME_RATE(kSequenceEnd)},
             {"rolling", KVPOOL_RESUME_RATE(kRolling)},
             {"imported", KVPOOL_RESUME_RATE(kImported)},
             {"resumed", KVPOOL_RESUME_RATE(kResumed)}},
            &HasStateGroup);
#undef KVPOOL_RESUME_RATE
}

inline void AddWindowRows(std::vector<PoolRow>* rows) {
  // free + active + cached + retiring == the group's blocks (PoolLayout.num_window_blocks).
  GroupRows(rows, "window_blocks", StatKind::kGauge, "blocks",
            "Blocks of the pool's window group (sliding-window layers), by state.", "state",
            {{"free", KVPOOL_CACHE_STAT(window.free)},
             {"active", KVPOOL_CACHE_STAT(window.active)},
             {"cached", KVPOOL_CACHE_STAT(window.cached)},
             {"retiring", KVPOOL_CACHE_STAT(window.retiring)}},
            &HasWindowGroup);
  rows->push_back({"window_cache_blocks",
                   StatKind::kGauge,
                   "blocks",
                   "Window blocks the prefix cache keeps beside their full-attention blocks.",
                   {},
                   "",
                   1,
                   KVPOOL_CACHE_STAT(windows.cached),
                   nullptr,
                   &HasWindowGroup});
  GroupRows(rows, "window_block_events", StatKind::kCounter, "blocks",
            "Window blocks by event: kept or evicted by the prefix cache, released by sliding.",
            "event",
            {{"kept", KVPOOL_CACHE_STAT(windows.kept)},
             {"evicted", KVPOOL_CACHE_STAT(windows.evicted)},
             {"released", KVPOOL_CACHE_STAT(windows.released)}},
            &HasWindowGroup);
}

#undef KVPOOL_CACHE_STAT

// Every group row, built once (thread-safe: a function-local static).
inline std::span<const PoolRow> GroupStatRows() {
  static const std::vector<PoolRow> rows = [] {
    std::vector<PoolRow> out;
    AddStateRows(&out);
    AddWindowRows(&out);
    return out;
  }();
  return rows;
}

}  // namespace kvpool::daemon::internal
