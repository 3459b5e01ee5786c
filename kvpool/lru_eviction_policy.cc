#include "kvpool/lru_eviction_policy.h"

#include <algorithm>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"

namespace kvpool {

void LruEvictionPolicy::Reserve(NodeIndex capacity) {
  const size_t n = static_cast<size_t>(capacity);
  if (slots_.size() < n) slots_.resize(n);
}

void LruEvictionPolicy::Add(NodeIndex node, const NodeFacts& facts) {
  KVPOOL_DCHECK(!Contains(node) && facts.priority >= 0 && facts.priority < kNumPriorities);
  KVPOOL_DCHECK(facts.release_seq < (uint64_t{1} << kOrderBits));
  List& list = lists_[facts.priority];
  const uint64_t seq = facts.release_seq;
  ++size_;
  added_below_ = std::max(added_below_, node + 1);
  if (list.tail == kNoNode || (seq != list.floor + 1 && seq > slots_[list.tail].seq)) {
    slots_[node].prev = list.tail;  // the newest: at the back
    slots_[node].next = kNoNode;
    if (list.tail == kNoNode) {
      list.head = node;
      list.floor = std::min(list.floor, seq - 1);
    } else {
      slots_[list.tail].next = node;
    }
    list.tail = node;
  } else if (seq == list.floor + 1 || seq < slots_[list.head].seq) {  // the oldest: at the front
    slots_[node].prev = kNoNode;
    slots_[node].next = list.head;
    slots_[list.head].prev = node;
    list.head = node;
    list.floor = std::min(list.floor, seq - 1);
  } else {
    stragglers_.emplace(Key(facts.priority, seq), node);
    slots_[node].where = kStraggler;
    return;
  }
  slots_[node].seq = seq;
  slots_[node].where = kList;
}

void LruEvictionPolicy::Unlink(List& list, NodeIndex node) {
  const NodeIndex prev = slots_[node].prev;
  const NodeIndex next = slots_[node].next;
  (prev == kNoNode ? list.head : slots_[prev].next) = next;
  (next == kNoNode ? list.tail : slots_[next].prev) = prev;
}

void LruEvictionPolicy::Remove(NodeIndex node, const NodeFacts& facts) {
  KVPOOL_DCHECK(Contains(node));
  if (slots_[node].where == kList) {
    List& list = lists_[facts.priority];
    if (list.head == node) list.floor = facts.release_seq;  // every other listed order is above
    Unlink(list, node);
  } else {
    stragglers_.erase({Key(facts.priority, facts.release_seq), node});
  }
  slots_[node].where = kNone;
  --size_;
}

EvictionRank LruEvictionPolicy::Rank(NodeIndex, const NodeFacts& facts, int64_t) const {
  return EvictionRank{.priority = facts.priority, .score = 0, .order = facts.release_seq};
}

void LruEvictionPolicy::Visit(int64_t,
                              absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const {
  constexpr uint64_t kOrderMask = (uint64_t{1} << kOrderBits) - 1;
  auto straggler = stragglers_.begin();
  for (int priority = 0; priority < kNumPriorities; ++priority) {
    // Merge the class's list with its stragglers, both in release order.
    const auto end = stragglers_.lower_bound({Key(priority + 1, 0), kNoNode});
    NodeIndex listed = lists_[priority].head;
    while (listed != kNoNode || straggler != end) {
      const bool from_list =
          straggler == end ||
          (listed != kNoNode && slots_[listed].seq < (straggler->first & kOrderMask));
      const NodeIndex node = from_list ? listed : straggler->second;
      const uint64_t seq = from_list ? slots_[listed].seq : straggler->first & kOrderMask;
      if (from_list) {
        listed = slots_[listed].next;
      } else {
        ++straggler;
      }
      if (!visit(node, EvictionRank{.priority = priority, .score = 0, .order = seq})) return;
    }
  }
}

absl::Status LruEvictionPolicy::CheckInvariants() const {
  int64_t held = 0;
  for (NodeIndex node = 0; node < added_below_; ++node) held += slots_[node].where != kNone ? 1 : 0;
  int64_t listed = 0;
  for (const List& list : lists_) {
    NodeIndex prev = kNoNode;
    for (NodeIndex n = list.head; n != kNoNode; prev = n, n = slots_[n].next) {
      if (slots_[n].where != kList || slots_[n].prev != prev || ++listed > size_) {
        return InvariantViolation("lru: the list is broken at node {}", n);
      }
      if ((prev != kNoNode && slots_[prev].seq >= slots_[n].seq) || slots_[n].seq <= list.floor) {
        return InvariantViolation("lru: node {} is listed out of release order", n);
      }
    }
    if (list.tail != prev) return InvariantViolation("lru: a list's tail is stale");
  }
  for (const auto& [key, node] : stragglers_) {
    if (slots_[node].where != kStraggler)
      return InvariantViolation("lru: straggler {} unmarked", node);
  }
  if (held != size_ || listed + static_cast<int64_t>(stragglers_.size()) != size_) {
    return InvariantViolation("lru: {} marked, {} listed, {} stragglers, size {}", held, listed,
                              stragglers_.size(), size_);
  }
  return absl::OkStatus();
}

std::string LruEvictionPolicy::DebugString() const {
  return fmt::format("lru candidates={} stragglers={}", size_, stragglers_.size());
}

}  // namespace kvpool
