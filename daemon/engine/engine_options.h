#pragma once

// What an Engine is built from: plain values (the edge converts the config proto into these).

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "daemon/engine/step_scheduler.h"
#include "kernels/plan_executor.h"
#include "kernels/pool_layout.h"
#include "kvpool/util/clock.h"

namespace kvpool::daemon {

struct EngineOptions {
  kernels::PoolLayout layout;         // num_blocks set (LayoutForBudget)
  int32_t max_blocks_per_seq = 4096;  // bound on every block table
  int32_t trace_depth = 8;            // per-block trace entries: 0 or a power of 2
  bool prefix_cache = true;
  std::string eviction_policy = "lru";
  size_t event_capacity = 65536;  // cache events kept for replay
  kernels::FillPolicy fill_policy = kernels::FillPolicy::kNone;
  int64_t session_quota_blocks = 0;  // block references a session may hold; 0: unlimited
  // ACTIVE blocks a tenant's namespace may own, by tenant; absent: unlimited.
  absl::flat_hash_map<std::string, int64_t> tenant_quota_blocks;
  uint64_t epoch = 1;  // this start of the daemon (stamped on events, told at attach)
  std::string daemon_version = "kvpoold 0.1.0";
  const Clock* clock = Clock::Real();  // not owned; outlives the engine

  // Model steps (when the engine runs a model).
  std::string model_name;                // reported at attach and in stats
  int64_t gather_window_ns = 2'000'000;  // how long a step waits for the previous step's sessions
  SchedulerOptions scheduler;
};

}  // namespace kvpool::daemon
