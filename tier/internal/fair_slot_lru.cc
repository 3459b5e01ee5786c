#include "tier/internal/fair_slot_lru.h"

#include "absl/strings/str_cat.h"
#include "kvpool/util/check.h"

namespace kvpool::tier::internal {

FairSlotLru::FairSlotLru(int64_t slots, int32_t max_shares)
    : tenants_(max_shares), links_(static_cast<size_t>(slots)), shares_(1) {}

int32_t FairSlotLru::ShareOf(uint64_t tenant) {
  bool made = false;
  const int32_t share = tenants_.ShareOf(tenant, &made);
  if (made) shares_.push_back(ShareState{.tenant = tenant});
  return share;
}

absl::Status FairSlotLru::SetWeight(uint64_t tenant, int32_t weight) {
  bool made = false;
  const absl::StatusOr<int32_t> share = tenants_.ShareToWeigh(tenant, weight, "tier share", &made);
  if (!share.ok()) return share.status();
  if (made) shares_.push_back(ShareState{.tenant = tenant});
  shares_[static_cast<size_t>(*share)].weight = weight;
  return absl::OkStatus();
}

void FairSlotLru::PushFront(int32_t slot) {
  Link& l = links_[static_cast<size_t>(slot)];
  ShareState& s = shares_[static_cast<size_t>(l.share)];
  l.prev = -1;
  l.next = s.head;
  if (s.head >= 0) links_[static_cast<size_t>(s.head)].prev = slot;
  s.head = slot;
  if (s.tail < 0) s.tail = slot;
  l.linked = true;
}

void FairSlotLru::Detach(int32_t slot) {
  Link& l = links_[static_cast<size_t>(slot)];
  ShareState& s = shares_[static_cast<size_t>(l.share)];
  (l.prev >= 0 ? links_[static_cast<size_t>(l.prev)].next : s.head) = l.next;
  (l.next >= 0 ? links_[static_cast<size_t>(l.next)].prev : s.tail) = l.prev;
  l.prev = l.next = -1;
  l.linked = false;
}

void FairSlotLru::Add(int32_t slot, int32_t share) {
  Link& l = links_[static_cast<size_t>(slot)];
  KVPOOL_DCHECK(l.share < 0 && share >= 0 && share < num_shares());
  l.share = share;
  ++shares_[static_cast<size_t>(share)].used;
  PushFront(slot);
}

void FairSlotLru::Remove(int32_t slot) {
  Link& l = links_[static_cast<size_t>(slot)];
  KVPOOL_DCHECK(l.share >= 0);
  if (l.linked) Detach(slot);
  --shares_[static_cast<size_t>(l.share)].used;
  l.share = -1;
}

void FairSlotLru::Touch(int32_t slot) {
  KVPOOL_DCHECK(links_[static_cast<size_t>(slot)].linked);
  if (shares_[static_cast<size_t>(share_of_slot(slot))].head == slot) return;
  Detach(slot);
  PushFront(slot);
}

void FairSlotLru::Unlink(int32_t slot) {
  KVPOOL_DCHECK(links_[static_cast<size_t>(slot)].linked);
  Detach(slot);
}

void FairSlotLru::Relink(int32_t slot) {
  KVPOOL_DCHECK(links_[static_cast<size_t>(slot)].share >= 0 &&
                !links_[static_cast<size_t>(slot)].linked);
  PushFront(slot);
}

void FairSlotLru::Clear() {
  for (Link& l : links_) l = Link{};
  for (ShareState& s : shares_) {
    s.used = 0;
    s.head = s.tail = -1;
  }
}

int32_t FairSlotLru::Victim() const {
  // The largest used / weight, compared as used_a * weight_b > used_b * weight_a (no division;
  // used < 2^31 and weight <= kMaxWeight < 2^20 fit in 64 bits).
  const ShareState* best = nullptr;
  for (const ShareState& s : shares_) {
    if (s.tail < 0) continue;
    if (best == nullptr || s.used * best->weight > best->used * s.weight) best = &s;
  }
  return best == nullptr ? -1 : best->tail;
}

int64_t FairSlotLru::used_by(uint64_t tenant) const {
  const int32_t share = tenants_.Find(tenant);
  return share <= 0 ? 0 : shares_[static_cast<size_t>(share)].used;
}

uint64_t FairSlotLru::evicted_from(uint64_t tenant) const {
  const int32_t share = tenants_.Find(tenant);
  return share <= 0 ? 0 : shares_[static_cast<size_t>(share)].evicted;
}

absl::Status FairSlotLru::CheckInvariants() const {
  std::vector<int64_t> linked(shares_.size(), 0);
  std::vector<int64_t> held(shares_.size(), 0);
  for (size_t i = 0; i < links_.size(); ++i) {
    const Link& l = links_[i];
    if (l.share < 0) {
      if (l.linked) return absl::InternalError(absl::StrCat("slot ", i, " linked, holding none"));
      continue;
    }
    if (l.share >= num_shares()) return absl::InternalError(absl::StrCat("slot ", i, " share"));
    ++held[static_cast<size_t>(l.share)];
    linked[static_cast<size_t>(l.share)] += l.linked ? 1 : 0;
  }
  for (size_t k = 0; k < shares_.size(); ++k) {
    const ShareState& s = shares_[k];
    if (s.used != held[k]) {
      return absl::InternalError(
          absl::StrCat("share ", k, " counts ", s.used, " slots, ", held[k], " name it"));
    }
    int64_t walked = 0;
    int32_t prev = -1;
    for (int32_t at = s.head; at >= 0; at = links_[static_cast<size_t>(at)].next) {
      const Link& l = links_[static_cast<size_t>(at)];
      if (!l.linked || l.share != static_cast<int32_t>(k) || l.prev != prev ||
          ++walked > linked[k]) {
        return absl::InternalError(absl::StrCat("share ", k, "'s list is broken at slot ", at));
      }
      prev = at;
    }
    if (walked != linked[k] || s.tail != prev) {
      return absl::InternalError(
          absl::StrCat("share ", k, "'s list holds ", walked, " of its ", linked[k], " slots"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool::tier::internal
