#pragma once

// LruEvictionPolicy: the least recently released leaf first, lowest priority class first
// (the order kvpool has always used; the replay reproduces the leaf-LRU reference rates of
// ../shared/traces/README.md with it). Pick it when reuse follows recency: the cache turns over
// more slowly than blocks come back. See docs/eviction.md.
//
// Candidates sit in one list per priority class, sorted by release order: a node just released
// is the newest and goes to the back, and a parent freed by evicting its last child is, in LRU
// order, almost always the oldest and goes to the front; both O(1). A candidate that fits
// neither end (a parent whose children went out of order) goes to a B-tree of stragglers,
// O(log n). Visit merges the two. Rank's score is always 0.
//
// Thread-compatible.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/btree_set.h"
#include "kvpool/eviction_policy.h"

namespace kvpool {

class LruEvictionPolicy final : public EvictionPolicy {
 public:
  void Reserve(NodeIndex capacity) override;
  void OnInsert(NodeIndex, const NodeFacts&, int64_t) override {}
  void OnHit(NodeIndex, const NodeFacts&, int64_t) override {}
  void OnErase(NodeIndex, const NodeFacts&, int64_t) override {}
  void Add(NodeIndex node, const NodeFacts& facts) override;
  void Remove(NodeIndex node, const NodeFacts& facts) override;
  bool Contains(NodeIndex node) const override {
    return node >= 0 && static_cast<size_t>(node) < slots_.size() && slots_[node].where != kNone;
  }
  int64_t size() const override { return size_; }
  EvictionRank Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const override;
  void Visit(int64_t now_ns,
             absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const override;
  absl::Status CheckInvariants() const override;
  std::string DebugString() const override;
  bool uses_fingerprints() const override { return false; }
  bool ranks_by_release() const override { return true; }
  bool hears_accesses() const override { return false; }

 private:
  static constexpr int kOrderBits = 58;  // release orders below 2^58: centuries of releases

  static uint64_t Key(int priority, uint64_t release_seq) {
    return (static_cast<uint64_t>(priority) << kOrderBits) | release_seq;
  }
  enum Where : uint8_t { kNone, kList, kStraggler };
  struct List {
    NodeIndex head = kNoNode;  // oldest
    NodeIndex tail = kNoNode;  // newest
    // Below every listed release order: the order of the head last evicted. A parent released
    // right after it (floor + 1) belongs at the front without reading the head's order.
    uint64_t floor = 0;
  };
  void Unlink(List& list, NodeIndex node);

  List lists_[kNumPriorities];
  absl::btree_set<std::pair<uint64_t, NodeIndex>> stragglers_;  // (Key, node)
  // By node, packed so that adding or removing a candidate touches one cache line per node.
  struct Slot {
    NodeIndex prev = kNoNode;  // in its list
    NodeIndex next = kNoNode;
    uint64_t seq = 0;  // its release order, while listed
    Where where = kNone;
  };
  std::vector<Slot> slots_;
  int64_t size_ = 0;
  NodeIndex added_below_ = 0;  // 1 + the highest node ever added (bounds CheckInvariants)
};

}  // namespace kvpool
