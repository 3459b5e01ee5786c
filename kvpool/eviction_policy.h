#pragma once

// EvictionPolicy: orders the prefix cache's evictable nodes (unpinned, holding a block).
//
// The cache keeps one ordering promise that makes leaf-first eviction O(1): a node enters the
// evictable set only after every descendant that will ever be evictable before it (paths are
// unpinned leaf-to-root, and whoever pins a node pins its ancestors too). A policy that picks
// the earliest-entered node of the lowest priority class therefore always picks a leaf.
//
// Thread-compatible; owned by the PrefixCache.

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvpool {

using NodeIndex = int32_t;
inline constexpr NodeIndex kNoNode = -1;

// Priority classes: lower is evicted first. A node's class is at least each descendant's.
inline constexpr int kNumPriorities = 4;

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  // Node indices are dense in [0, capacity); called before nodes beyond it are used.
  virtual void Reserve(NodeIndex capacity) = 0;
  // `node` became evictable. REQUIRES: not already evictable; 0 <= priority < kNumPriorities.
  virtual void Add(NodeIndex node, int priority) = 0;
  // `node` stopped being evictable (pinned again, or evicted). REQUIRES: evictable.
  virtual void Remove(NodeIndex node) = 0;
  // The next node to evict, or kNoNode when nothing is evictable. Must have no evictable
  // descendant. Does not remove it.
  virtual NodeIndex Victim() const = 0;
  // The node that would be evicted after `node` (in the order Victim() starts), or kNoNode.
  // REQUIRES: Contains(node).
  virtual NodeIndex After(NodeIndex node) const = 0;
  virtual int64_t size() const = 0;
  virtual bool Contains(NodeIndex node) const = 0;
};

// Least recently released first, lowest priority class first. Intrusive doubly-linked lists:
// every operation is O(1) whatever the number of nodes.
class LruEvictionPolicy final : public EvictionPolicy {
 public:
  void Reserve(NodeIndex capacity) override;
  void Add(NodeIndex node, int priority) override;
  void Remove(NodeIndex node) override;
  NodeIndex Victim() const override;
  NodeIndex After(NodeIndex node) const override;
  int64_t size() const override { return size_; }
  bool Contains(NodeIndex node) const override {
    return node >= 0 && static_cast<size_t>(node) < class_of_.size() && class_of_[node] >= 0;
  }

 private:
  struct List {
    NodeIndex head = kNoNode;
    NodeIndex tail = kNoNode;
  };
  List lists_[kNumPriorities];
  std::vector<NodeIndex> prev_;
  std::vector<NodeIndex> next_;
  std::vector<int8_t> class_of_;  // -1: not evictable
  int64_t size_ = 0;
};

// Makes a policy by name ("lru"). Errors: INVALID_ARGUMENT for an unknown name.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view name);

}  // namespace kvpool
