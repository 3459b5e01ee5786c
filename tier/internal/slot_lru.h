#pragma once

// The least-recently-used order of the host and disk tiers: an intrusive doubly linked list over
// slots kept in a vector and named by index, most recent first. `Slot` has int32_t prev and next
// (-1: none); head and tail are the list's ends (-1: empty). The caller holds its store's lock.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvpool::tier::internal {

// Takes `slot` out of the list. REQUIRES: it is in the list.
template <typename Slot>
void UnlinkSlot(std::vector<Slot>& slots, int32_t& head, int32_t& tail, int32_t slot) {
  Slot& s = slots[static_cast<size_t>(slot)];
  (s.prev >= 0 ? slots[static_cast<size_t>(s.prev)].next : head) = s.next;
  (s.next >= 0 ? slots[static_cast<size_t>(s.next)].prev : tail) = s.prev;
  s.prev = s.next = -1;
}

// Makes `slot` the most recent. REQUIRES: it is not in the list.
template <typename Slot>
void PushFrontSlot(std::vector<Slot>& slots, int32_t& head, int32_t& tail, int32_t slot) {
  Slot& s = slots[static_cast<size_t>(slot)];
  s.prev = -1;
  s.next = head;
  if (head >= 0) slots[static_cast<size_t>(head)].prev = slot;
  head = slot;
  if (tail < 0) tail = slot;
}

}  // namespace kvpool::tier::internal
