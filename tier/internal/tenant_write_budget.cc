#include "tier/internal/tenant_write_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvpool/util/check.h"

namespace kvpool::tier::internal {

TenantWriteBudget::TenantWriteBudget(int64_t total_bytes, int64_t window_ns, int32_t max_shares)
    : total_bytes_(total_bytes),
      bucket_ns_(std::max<int64_t>(1, window_ns / kBuckets)),
      tenants_(max_shares),
      shares_(1) {
  KVPOOL_CHECK(total_bytes > 0 && window_ns > 0 && max_shares >= 0);
}

int32_t TenantWriteBudget::ShareOf(uint64_t tenant) {
  bool made = false;
  const int32_t share = tenants_.ShareOf(tenant, &made);
  if (made) shares_.push_back(Share{.tenant = tenant});
  return share;
}

absl::Status TenantWriteBudget::SetWeight(uint64_t tenant, int32_t weight) {
  bool made = false;
  const absl::StatusOr<int32_t> share =
      tenants_.ShareToWeigh(tenant, weight, "write budget", &made);
  if (!share.ok()) return share.status();
  if (made) shares_.push_back(Share{.tenant = tenant});
  shares_[static_cast<size_t>(*share)].weight = weight;
  return absl::OkStatus();
}

int64_t TenantWriteBudget::Live(Share& share, int64_t now_ns) {
  const int64_t oldest = Epoch(now_ns) - kBuckets;
  int64_t live = 0;
  for (Bucket& b : share.buckets) {
    if (b.epoch < oldest) {
      b = Bucket{};
    } else {
      live += b.bytes;
    }
  }
  return live;
}

int64_t TenantWriteBudget::BudgetOf(int32_t index, int64_t now_ns) {
  int64_t weights = 0;
  for (size_t i = 0; i < shares_.size(); ++i) {
    if (static_cast<int32_t>(i) == index || Active(shares_[i], now_ns)) {
      weights += shares_[i].weight;
    }
  }
  const int64_t weight = shares_[static_cast<size_t>(index)].weight;
  return static_cast<int64_t>(static_cast<__int128>(total_bytes_) * weight / weights);
}

int64_t TenantWriteBudget::HeldBytes(int32_t index, int64_t now_ns) {
  Share& share = shares_[static_cast<size_t>(index)];
  return Live(share, now_ns) + share.reserved;
}

int64_t TenantWriteBudget::TotalHeld(int64_t now_ns) {
  int64_t held = 0;
  for (size_t i = 0; i < shares_.size(); ++i) held += HeldBytes(static_cast<int32_t>(i), now_ns);
  return held;
}

int32_t TenantWriteBudget::Reserve(uint64_t tenant, int64_t bytes, int64_t now_ns) {
  const int32_t index = ShareOf(tenant);
  Share& share = shares_[static_cast<size_t>(index)];
  const bool fits = HeldBytes(index, now_ns) + bytes <= BudgetOf(index, now_ns) &&
                    TotalHeld(now_ns) + bytes <= total_bytes_;
  share.asked_epoch = Epoch(now_ns);  // active now, whether it fits or not
  if (!fits) {
    ++share.refused;
    return -1;
  }
  share.reserved += bytes;
  return index;
}

void TenantWriteBudget::Settle(int32_t index, int64_t bytes, bool written, int64_t now_ns) {
  Share& share = shares_[static_cast<size_t>(index)];
  KVPOOL_DCHECK(share.reserved >= bytes);
  share.reserved -= bytes;
  if (!written) return;
  (void)Live(share, now_ns);  // frees the slot of an epoch that aged out
  const int64_t epoch = Epoch(now_ns);
  Bucket& b = share.buckets[static_cast<size_t>(epoch % (kBuckets + 1))];
  if (b.epoch != epoch) b = Bucket{.epoch = epoch};
  b.bytes += bytes;
}

absl::Status TenantWriteBudget::CheckInvariants() const {
  // Buckets not yet dropped count too: they only ever hold less than they did when the total was
  // last checked (Reserve), so their sum stays within it.
  int64_t held = 0;
  for (size_t i = 0; i < shares_.size(); ++i) {
    const Share& s = shares_[i];
    if (s.reserved < 0 || s.weight < 1 || s.weight > kMaxWeight) {
      return absl::InternalError(absl::StrCat("write budget: share ", i, " reserves ", s.reserved,
                                              " bytes at weight ", s.weight));
    }
    held += s.reserved;
    for (size_t k = 0; k < s.buckets.size(); ++k) {
      const Bucket& b = s.buckets[k];
      if (b.bytes < 0 || (b.epoch >= 0 && b.epoch % (kBuckets + 1) != static_cast<int64_t>(k)) ||
          (b.epoch < 0 && b.bytes != 0)) {
        return absl::InternalError(absl::StrCat("write budget: share ", i, " bucket ", k,
                                                " holds epoch ", b.epoch, " with ", b.bytes));
      }
      held += b.bytes;
    }
    if (i > 0 && tenants_.Find(s.tenant) != static_cast<int32_t>(i)) {
      return absl::InternalError(absl::StrCat("write budget: share ", i, " is not indexed"));
    }
  }
  if (static_cast<size_t>(tenants_.num_shares()) != shares_.size() || held > total_bytes_) {
    return absl::InternalError(
        absl::StrCat("write budget: shares hold ", held, " bytes of ", total_bytes_));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::tier::internal
