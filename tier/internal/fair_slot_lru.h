#pragma once

// FairSlotLru: the host and disk tiers' eviction order, fair by tenant (docs/tiers.md, "Fair by
// tenant"). Slots are named by index. Each slot holding a block belongs to one share, its tenant's
// (keyed by the block's tenant tag, NamespaceTags::tenant); each share keeps its slots in its own
// least-recently-used list, and counts them (its use). Room is made in the share whose use per
// unit of weight is the largest, from its least recently used slot: a tenant that floods the
// tier evicts its own blocks first, not another's prefix. This is the pool's fair eviction
// (docs/eviction.md) over the tier's one kind of slot.
//
// Share 0 is the default share: blocks with no tenant tag (tests, the replay), and tenants past
// `max_shares` (the shares are created on first use and never dropped: a hostile run of tenant
// names cannot grow them). With max_shares 0 every block is in share 0: one plain LRU order.
//
// A slot out of its list (pinned by a read in flight) still counts in its share's use but is not
// a candidate. Not thread-safe: the owning store's lock covers it.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "tier/internal/tenant_shares.h"

namespace kvpool::tier::internal {

class FairSlotLru {
 public:
  static constexpr int32_t kMaxWeight = TenantShares::kMaxWeight;

  // `slots` slots (>= 0), `max_shares` tenant shares beside the default one (>= 0).
  FairSlotLru(int64_t slots, int32_t max_shares);

  // The share of the blocks of `tenant` (a tenant tag; 0: none): its own, made on first use
  // while fewer than max_shares exist, else the default share 0.
  int32_t ShareOf(uint64_t tenant);
  // Sets `tenant`'s weight (its share is made if need be). Errors: INVALID_ARGUMENT (weight not
  // in [1, kMaxWeight], or tenant 0), RESOURCE_EXHAUSTED (no share left for it: it stays in the
  // default share, whose weight is 1), nothing changed.
  absl::Status SetWeight(uint64_t tenant, int32_t weight);

  // `slot` now holds a block of `share`: counted, and the most recent of its list.
  // REQUIRES: it holds none.
  void Add(int32_t slot, int32_t share);
  // `slot`'s block is gone: uncounted, and out of its list if it is in it.
  // REQUIRES: it holds one.
  void Remove(int32_t slot);
  // The most recent of its list. REQUIRES: it holds a block and is in its list.
  void Touch(int32_t slot);
  // Out of its list, still counted (pinned). REQUIRES: in its list.
  void Unlink(int32_t slot);
  // Back in its list as the most recent (unpinned). REQUIRES: holds a block, not in its list.
  void Relink(int32_t slot);

  // Every slot holds no block again; the shares and their weights stay.
  void Clear();

  // The slot to make room from: the least recent of the share with the most use per unit of
  // weight among those with a slot in their list; -1 when no list has one (all pinned or empty).
  int32_t Victim() const;

  int32_t share_of_slot(int32_t slot) const { return links_[static_cast<size_t>(slot)].share; }
  int32_t num_shares() const { return static_cast<int32_t>(shares_.size()); }
  // The slots holding blocks of `tenant`'s share (0 when it has none of its own).
  int64_t used_by(uint64_t tenant) const;
  // Slots taken by Victim's choice from `tenant`'s share, since creation (counted by the store
  // through CountEviction).
  uint64_t evicted_from(uint64_t tenant) const;
  void CountEviction(int32_t slot) { ++shares_[static_cast<size_t>(share_of_slot(slot))].evicted; }
  // Each share's list is well formed, its count matches the slots that name it, and no slot is
  // in two lists. O(slots).
  absl::Status CheckInvariants() const;

 private:
  struct Link {
    int32_t prev = -1;   // more recent
    int32_t next = -1;   // less recent
    int32_t share = -1;  // -1: holds no block
    bool linked = false;
  };
  struct ShareState {
    uint64_t tenant = 0;
    int32_t weight = 1;
    int64_t used = 0;
    int32_t head = -1;  // most recent
    int32_t tail = -1;  // least recent
    uint64_t evicted = 0;
  };
  void PushFront(int32_t slot);
  void Detach(int32_t slot);

  TenantShares tenants_;
  std::vector<Link> links_;
  std::vector<ShareState> shares_;  // [share]: [0] the default one
};

}  // namespace kvpool::tier::internal
