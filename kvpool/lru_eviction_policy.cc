#include "kvpool/lru_eviction_policy.h"

#include <algorithm>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"

namespace kvpool {

void LruEvictionPolicy::Reserve(NodeIndex capacity) {
  if (key_.size() < static_cast<size_t>(capacity))
    key_.resize(static_cast<size_t>(capacity), kAbsent);
}

void LruEvictionPolicy::Add(NodeIndex node, const NodeFacts& facts) {
  KVPOOL_DCHECK(!Contains(node) && facts.priority >= 0 && facts.priority < kNumPriorities);
  KVPOOL_DCHECK(facts.release_seq < (uint64_t{1} << kOrderBits));
  const uint64_t key = Key(facts.priority, facts.release_seq);
  key_[node] = key;
  order_.emplace(key, node);
  added_below_ = std::max(added_below_, node + 1);
}

void LruEvictionPolicy::Remove(NodeIndex node) {
  KVPOOL_DCHECK(Contains(node));
  order_.erase({key_[node], node});
  key_[node] = kAbsent;
}

EvictionRank LruEvictionPolicy::Rank(NodeIndex, const NodeFacts& facts, int64_t) const {
  return EvictionRank{.priority = facts.priority, .score = 0, .order = facts.release_seq};
}

void LruEvictionPolicy::Visit(int64_t,
                              absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const {
  constexpr uint64_t kOrderMask = (uint64_t{1} << kOrderBits) - 1;
  for (const auto& [key, node] : order_) {
    const EvictionRank rank{
        .priority = static_cast<int>(key >> kOrderBits), .score = 0, .order = key & kOrderMask};
    if (!visit(node, rank)) return;
  }
}

absl::Status LruEvictionPolicy::CheckInvariants() const {
  size_t held = 0;
  for (NodeIndex node = 0; node < added_below_; ++node) {  // every node ever added
    if (key_[node] == kAbsent) continue;
    ++held;
    if (!order_.contains({key_[node], node})) {
      return InvariantViolation("lru: node {} is not in its order", node);
    }
  }
  if (held != order_.size()) {
    return InvariantViolation("lru: {} nodes keyed but {} ordered", held, order_.size());
  }
  return absl::OkStatus();
}

std::string LruEvictionPolicy::DebugString() const {
  return fmt::format("lru candidates={}", order_.size());
}

}  // namespace kvpool
