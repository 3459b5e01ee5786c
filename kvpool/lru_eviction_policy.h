#pragma once

// LruEvictionPolicy: the least recently released leaf first, lowest priority class first
// (the order kvpool has always used; the replay reproduces the leaf-LRU reference rates of
// ../shared/traces/README.md with it). Pick it when reuse follows recency: the cache turns over
// more slowly than blocks come back. See docs/eviction.md.
//
// Candidates sit in one B-tree keyed by (priority class, release order): Add, Remove O(log n);
// Visit O(log n) to start, then O(1) per candidate. Rank's score is always 0.
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
  void Remove(NodeIndex node) override;
  bool Contains(NodeIndex node) const override {
    return node >= 0 && static_cast<size_t>(node) < key_.size() && key_[node] != kAbsent;
  }
  int64_t size() const override { return static_cast<int64_t>(order_.size()); }
  EvictionRank Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const override;
  void Visit(int64_t now_ns,
             absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const override;
  absl::Status CheckInvariants() const override;
  std::string DebugString() const override;

 private:
  static constexpr uint64_t kAbsent = ~uint64_t{0};
  static constexpr int kOrderBits = 58;  // release orders below 2^58: centuries of releases

  static uint64_t Key(int priority, uint64_t release_seq) {
    return (static_cast<uint64_t>(priority) << kOrderBits) | release_seq;
  }

  absl::btree_set<std::pair<uint64_t, NodeIndex>> order_;
  std::vector<uint64_t> key_;  // by node: its key in order_, kAbsent when not a candidate
  NodeIndex added_below_ = 0;  // 1 + the highest node ever added (bounds CheckInvariants)
};

}  // namespace kvpool
