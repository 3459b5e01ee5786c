#pragma once

// TenantCounters: what one tenant's calls did in a pool, for per-tenant metrics; and the table
// of them, whose tenant names a LabelFold bounds (tenants past the bound are counted under
// "other"), so neither its memory nor the label values it exports grow with the names clients
// claim. Thread-compatible: the engine's lock guards it.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/strings/string_view.h"
#include "daemon/engine/label_fold.h"

namespace kvpool::daemon {

struct TenantCounters {
  uint64_t prompt_tokens = 0;  // prompt tokens its Allocate calls looked up
  uint64_t hit_tokens = 0;     // of which found in the prefix cache
  // Its eviction share in the pool (fair eviction), filled in by the stats snapshot: the bytes
  // of the cached blocks it may lose and of what is kept beside them, and the blocks evicted
  // from it. 0 with fair eviction off, for "other", and for a tenant past
  // limits.eviction_shares (it is in the pool's default share).
  int64_t cached_bytes = 0;
  uint64_t evicted_blocks = 0;
  // Its share of the host and disk tiers' block stores (their fair order, TierSet::TenantUse),
  // filled in by the stats snapshot: blocks held there now, and blocks evicted from it to make
  // room. 0 without those tiers, for "other", and past the shares.
  int64_t tier_blocks = 0;
  uint64_t tier_evicted_blocks = 0;
  // Its share of the Redis tier's write budget (tiers.redis.tenant_write_budget_bytes): bytes
  // written within the last TTL or queued, and blocks dropped past its share. 0 without a
  // budget, for "other", and past the shares.
  int64_t redis_bytes = 0;
  uint64_t redis_over_budget_blocks = 0;
};

class TenantCounterTable final {
 public:
  explicit TenantCounterTable(size_t max_labels) : fold_(max_labels) {}

  // The counters `tenant` is counted under (its own, or "other"'s past the bound).
  TenantCounters& For(std::string_view tenant) {
    const std::string_view label = fold_.Label(tenant);
    auto it = counters_.find(absl::string_view(label.data(), label.size()));
    if (it == counters_.end()) it = counters_.emplace(std::string(label), TenantCounters{}).first;
    return it->second;
  }

  // Every label's counters, by label.
  std::vector<std::pair<std::string, TenantCounters>> Snapshot() const {
    return {counters_.begin(), counters_.end()};
  }

 private:
  LabelFold fold_;
  absl::btree_map<std::string, TenantCounters> counters_;  // at most max_labels + 1 entries
};

}  // namespace kvpool::daemon
