#pragma once

// TenantWriteBudget: the Redis tier's fairness by tenant (docs/tiers.md, "Fair by tenant: Redis").
// Redis evicts by its own policy and cannot tell tenants apart (its keys are MACs), so a tenant
// that pushes far more through it than it holds would evict every other tenant's blocks. What a
// store can bound instead is what it writes: every value lives at most the TTL, so the bytes a
// tenant wrote within the last TTL are all of its bytes Redis can still hold. The budget gives
// each tenant's share total_bytes * weight / (the weights of the shares in use) of that, and a
// write past it is refused before it is queued. While the set of shares does not change, their
// live bytes add up to at most total_bytes: with Redis's maxmemory above the budgets of every
// store writing to it (plus Redis's per-key overhead), Redis never has to evict, and a quiet
// tenant's blocks live their whole TTL whatever another tenant writes. When a share joins, the
// others' budgets shrink and a share over its new budget writes nothing until its old writes age
// out (at most one window).
//
// Shares are FairSlotLru's (fair_slot_lru.h): share 0 is the default one (no tenant tag, and
// tenants past max_shares), made on a tenant's first write or weight and never dropped, so a run
// of made-up tenant names cannot grow them. A share is "in use", and counts in the divisor, once
// it has a weight set (its tenant's session opened: it is expected to write) or has reserved a
// byte; the default share's weight is 1.
//
// Time is cut into kBuckets buckets per window; a byte written during a bucket counts until that
// bucket's end plus the window, never less than its value's TTL (counting it up to one bucket
// longer is the safe side). A write reserves its bytes while it is queued (Reserve) and settles
// them when its round trip is done (Settle): written bytes count from then for one window,
// others (the key was there already, or the write was lost) are given back.
//
// Not thread-safe: the owning store's lock covers it.

#include <array>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace kvpool::tier::internal {

class TenantWriteBudget {
 public:
  static constexpr int32_t kMaxWeight = 1'000'000;  // as FairSlotLru's
  static constexpr int64_t kBuckets = 16;

  // REQUIRES: total_bytes > 0, window_ns > 0, max_shares >= 0 (0: one share for every tenant).
  TenantWriteBudget(int64_t total_bytes, int64_t window_ns, int32_t max_shares);

  // Sets `tenant`'s weight (its share is made if need be, and is in use from now). Errors:
  // INVALID_ARGUMENT (weight not in [1, kMaxWeight], or tenant 0), RESOURCE_EXHAUSTED (no share
  // left: the tenant stays in the default share), nothing changed.
  absl::Status SetWeight(uint64_t tenant, int32_t weight);

  // Reserves `bytes` for a write of `tenant` at `now_ns` if they fit its share's budget (its
  // live and reserved bytes plus these, at most its budget): returns the share to Settle them
  // against, or -1 (the write is refused and counted in Refused()).
  int32_t Reserve(uint64_t tenant, int64_t bytes, int64_t now_ns);
  // Settles a reservation of Reserve(): `written` bytes count against the share for one window
  // from `now_ns`; unwritten ones are given back. REQUIRES: `bytes` were reserved for `share`.
  void Settle(int32_t share, int64_t bytes, bool written, int64_t now_ns);

  // The share `tenant`'s writes go to, made on first use while shares are left (0 otherwise).
  int32_t ShareOf(uint64_t tenant);
  // The share `tenant`'s writes go to now, without making one: -1 when it has none yet (0 for
  // tenant 0).
  int32_t FindShare(uint64_t tenant) const { return Find(tenant); }
  // Share `share`'s budget now: total_bytes * its weight / the weights of the shares in use (its
  // own counted).
  int64_t BudgetOf(int32_t share) const;
  // Bytes of `tenant`'s share written within the window before `now_ns` (reserved ones
  // included), and its writes refused since creation; 0 for a tenant with no share of its own
  // (the default share's: tenant 0).
  int64_t LiveBytes(uint64_t tenant, int64_t now_ns);
  uint64_t Refused(uint64_t tenant) const;
  int32_t num_shares() const { return static_cast<int32_t>(shares_.size()); }

  // Each share's buckets are within the window's epochs and non-negative, reservations are
  // non-negative, and the divisor is the in-use shares' weights.
  absl::Status CheckInvariants() const;

 private:
  struct Bucket {
    int64_t epoch = -1;
    int64_t bytes = 0;
  };
  struct Share {
    uint64_t tenant = 0;
    int32_t weight = 1;
    bool in_use = false;
    int64_t reserved = 0;
    uint64_t refused = 0;
    std::array<Bucket, kBuckets + 1> buckets{};  // epochs [now - kBuckets, now]
  };

  int64_t Epoch(int64_t now_ns) const { return now_ns / bucket_ns_; }
  // Written bytes of `share` still live at `now_ns`; drops buckets that aged out.
  int64_t Live(Share& share, int64_t now_ns);
  int64_t BudgetOf(const Share& share) const;
  void Use(Share& share);
  int32_t Find(uint64_t tenant) const;

  const int64_t total_bytes_;
  const int64_t bucket_ns_;
  const int32_t max_shares_;
  int64_t weights_in_use_ = 0;
  std::vector<Share> shares_;
  absl::flat_hash_map<uint64_t, int32_t> share_index_;
};

}  // namespace kvpool::tier::internal
