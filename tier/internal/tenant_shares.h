#pragma once

// TenantShares: which share a tenant's blocks belong to, for the tiers' fairness by tenant
// (FairSlotLru's room, TenantWriteBudget's bytes). Share 0 is the default one: no tenant tag,
// tenants past `max_shares`, and everyone when max_shares is 0. The others are numbered 1, 2, ...
// as tenants first show up and are never dropped, so a run of made-up tenant names cannot grow
// them. The owner keeps each share's state in a vector indexed by share. Not thread-safe.

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvpool::tier::internal {

class TenantShares {
 public:
  static constexpr int32_t kMaxWeight = 1'000'000;  // as the pool's (PrefixCache::kMaxShareWeight)

  explicit TenantShares(int32_t max_shares) : max_shares_(max_shares) {}

  // `tenant`'s share: its own, made now (numbered num_shares() - 1 after this call; *made set)
  // while fewer than max_shares exist, else 0.
  int32_t ShareOf(uint64_t tenant, bool* made) {
    *made = false;
    if (tenant == 0 || max_shares_ == 0) return 0;
    if (const auto it = index_.find(tenant); it != index_.end()) return it->second;
    if (static_cast<int32_t>(index_.size()) >= max_shares_) return 0;
    const auto share = static_cast<int32_t>(index_.size()) + 1;
    index_.emplace(tenant, share);
    *made = true;
    return share;
  }
  // The share whose weight becomes `weight` (ShareOf: made if need be, *made set). Errors, with
  // `owner` naming the caller: INVALID_ARGUMENT (weight not in [1, kMaxWeight], or tenant 0),
  // RESOURCE_EXHAUSTED (no share left: the tenant stays in the default share), nothing made.
  absl::StatusOr<int32_t> ShareToWeigh(uint64_t tenant, int32_t weight, absl::string_view owner,
                                       bool* made) {
    *made = false;
    if (tenant == 0 || weight < 1 || weight > kMaxWeight) {
      return absl::InvalidArgumentError(absl::StrCat(owner, ": weight ", weight, " of tenant tag ",
                                                     tenant, " (1..", kMaxWeight, ", a tenant)"));
    }
    const int32_t share = ShareOf(tenant, made);
    if (share == 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat(owner, ": all ", max_shares_, " tenant shares are taken"));
    }
    return share;
  }
  // `tenant`'s own share without making one: -1 when it has none (0 for tenant 0).
  int32_t Find(uint64_t tenant) const {
    if (tenant == 0) return 0;
    const auto it = index_.find(tenant);
    return it == index_.end() ? -1 : it->second;
  }
  // Shares made, the default one included.
  int32_t num_shares() const { return static_cast<int32_t>(index_.size()) + 1; }
  int32_t max_shares() const { return max_shares_; }

 private:
  const int32_t max_shares_;
  absl::flat_hash_map<uint64_t, int32_t> index_;  // tenant -> share, 1..max_shares
};

}  // namespace kvpool::tier::internal
