#pragma once

// TenantWriteBudget: the Redis tier's fairness by tenant (docs/tiers.md, "Fair by tenant: Redis").
// Redis evicts by its own policy and cannot tell tenants apart (its keys are MACs), so a tenant
// that pushes far more through it than it holds would evict every other tenant's blocks. What a
// store can bound instead is what it writes: every value lives at most the TTL, so the bytes a
// tenant wrote within the last TTL are all of its bytes Redis can still hold.
//
// Two limits, both checked before a write is queued:
// - All shares together hold at most total_bytes, always. With Redis's maxmemory above the totals
//   of every store writing to it (plus Redis's own overhead), Redis never has to evict, so no
//   tenant's blocks are pushed out by another's writes: they live their whole TTL.
// - Each share holds at most total_bytes * its weight / the weights of the active shares (its
//   own counted): a share is active while it has bytes in the window or has asked to write within
//   it (a refused write counts: a tenant that wants room shrinks the others' shares at once). So
//   one tenant alone may use the whole budget; when another starts writing, the first is held to
//   its share and the room its old writes leave as they age out goes to the other. A tenant gone
//   quiet stops counting a window after its last write: nothing is set aside for tenants that
//   left.
//
// Shares are FairSlotLru's (fair_slot_lru.h): share 0 is the default one (no tenant tag, and
// tenants past max_shares), made on a tenant's first write or weight and never dropped, so a run
// of made-up tenant names cannot grow them. The default share's weight is 1.
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
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "tier/internal/tenant_shares.h"

namespace kvpool::tier::internal {

class TenantWriteBudget {
 public:
  static constexpr int32_t kMaxWeight = TenantShares::kMaxWeight;
  static constexpr int64_t kBuckets = 16;

  // REQUIRES: total_bytes > 0, window_ns > 0, max_shares >= 0 (0: one share for every tenant).
  TenantWriteBudget(int64_t total_bytes, int64_t window_ns, int32_t max_shares);

  // Sets `tenant`'s weight (its share is made if need be). Errors: INVALID_ARGUMENT (weight not
  // in [1, kMaxWeight], or tenant 0), RESOURCE_EXHAUSTED (no share left: the tenant stays in the
  // default share), nothing changed.
  absl::Status SetWeight(uint64_t tenant, int32_t weight);

  // Reserves `bytes` for a write of `tenant` at `now_ns` if they fit both limits: its share's
  // held bytes plus these at most its share's budget, and everyone's held bytes plus these at
  // most total_bytes. Returns the share to Settle them against, or -1 (refused, counted in
  // Refused(), and the share is active from now).
  int32_t Reserve(uint64_t tenant, int64_t bytes, int64_t now_ns);
  // Settles a reservation of Reserve(): `written` bytes count against the share for one window
  // from `now_ns`; unwritten ones are given back. REQUIRES: `bytes` were reserved for `share`.
  void Settle(int32_t share, int64_t bytes, bool written, int64_t now_ns);

  // The share `tenant`'s writes go to, made on first use while shares are left (0 otherwise).
  int32_t ShareOf(uint64_t tenant);
  // The share `tenant`'s writes go to now, without making one: -1 when it has none yet (0 for
  // tenant 0).
  int32_t FindShare(uint64_t tenant) const { return tenants_.Find(tenant); }
  // Share `share`'s budget at `now_ns`: total_bytes * its weight / the weights of the active
  // shares, its own counted.
  int64_t BudgetOf(int32_t share, int64_t now_ns);
  // Bytes share `share` holds at `now_ns`: written within the window, and reserved.
  int64_t HeldBytes(int32_t share, int64_t now_ns);
  // Every share's held bytes: never more than total_bytes.
  int64_t TotalHeld(int64_t now_ns);
  // Writes refused to `share` since creation.
  uint64_t Refused(int32_t share) const { return shares_[static_cast<size_t>(share)].refused; }
  int32_t num_shares() const { return static_cast<int32_t>(shares_.size()); }
  int64_t total_bytes() const { return total_bytes_; }

  // Each share's buckets are within their epochs' slots and non-negative, reservations are
  // non-negative, every share but the default is indexed, and the shares hold at most the total.
  absl::Status CheckInvariants() const;

 private:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min() / 2;
  struct Bucket {
    int64_t epoch = -1;
    int64_t bytes = 0;
  };
  struct Share {
    uint64_t tenant = 0;
    int32_t weight = 1;
    int64_t reserved = 0;
    uint64_t refused = 0;
    int64_t asked_epoch = kNever;                // the last Reserve's, accepted or not
    std::array<Bucket, kBuckets + 1> buckets{};  // epochs [now - kBuckets, now]
  };

  int64_t Epoch(int64_t now_ns) const { return now_ns / bucket_ns_; }
  // Written bytes of `share` still live at `now_ns`; drops buckets that aged out.
  int64_t Live(Share& share, int64_t now_ns);
  bool Active(Share& share, int64_t now_ns) {
    return share.asked_epoch >= Epoch(now_ns) - kBuckets || share.reserved > 0 ||
           Live(share, now_ns) > 0;
  }

  const int64_t total_bytes_;
  const int64_t bucket_ns_;
  TenantShares tenants_;
  std::vector<Share> shares_;  // [share]: [0] the default one
};

}  // namespace kvpool::tier::internal
