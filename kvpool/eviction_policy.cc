#include "kvpool/eviction_policy.h"

#include <string>

#include "fmt/format.h"
#include "kvpool/util/check.h"

namespace kvpool {

void LruEvictionPolicy::Reserve(NodeIndex capacity) {
  const size_t n = static_cast<size_t>(capacity);
  if (class_of_.size() >= n) return;
  prev_.resize(n, kNoNode);
  next_.resize(n, kNoNode);
  class_of_.resize(n, -1);
}

void LruEvictionPolicy::Add(NodeIndex node, int priority) {
  KVPOOL_DCHECK(!Contains(node) && priority >= 0 && priority < kNumPriorities);
  List& list = lists_[priority];
  class_of_[node] = static_cast<int8_t>(priority);
  prev_[node] = list.tail;
  next_[node] = kNoNode;
  if (list.tail != kNoNode) {
    next_[list.tail] = node;
  } else {
    list.head = node;
  }
  list.tail = node;
  ++size_;
}

void LruEvictionPolicy::Remove(NodeIndex node) {
  KVPOOL_DCHECK(Contains(node));
  List& list = lists_[class_of_[node]];
  const NodeIndex prev = prev_[node];
  const NodeIndex next = next_[node];
  if (prev != kNoNode) {
    next_[prev] = next;
  } else {
    list.head = next;
  }
  if (next != kNoNode) {
    prev_[next] = prev;
  } else {
    list.tail = prev;
  }
  class_of_[node] = -1;
  --size_;
}

NodeIndex LruEvictionPolicy::Victim() const {
  for (const List& list : lists_) {
    if (list.head != kNoNode) return list.head;
  }
  return kNoNode;
}

NodeIndex LruEvictionPolicy::After(NodeIndex node) const {
  if (next_[node] != kNoNode) return next_[node];
  for (int c = class_of_[node] + 1; c < kNumPriorities; ++c) {
    if (lists_[c].head != kNoNode) return lists_[c].head;
  }
  return kNoNode;
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view name) {
  if (name == "lru") return std::make_unique<LruEvictionPolicy>();
  return absl::InvalidArgumentError(fmt::format("unknown eviction policy '{}' (known: lru)", name));
}

}  // namespace kvpool
